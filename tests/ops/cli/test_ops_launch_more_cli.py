"""launch: bare-address targets, --follow, the inductor-cache pre step, concurrent launches of one name, --env."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest


def test_bare_address_and_ct_need_no_inventory(ops_env):
    done = ops_env.cli("launch", "job", "--host", "10.1.2.6", "--ct", "200", "--dry-run")
    assert done.exit_code == 0, done.output
    prefix = "ssh root@10.1.2.6:22: "
    assert done.stdout.startswith(prefix)
    argv = shlex.split(done.stdout[len(prefix):])
    assert argv[:6] == ["/usr/sbin/pct", "exec", "200", "--", "env", "-i"] and argv[8:10] == ["bash", "-c"]
    assert "RUNS=/root/dflash-runs\n" in argv[10]


def test_launch_follow_streams_to_the_end(ops_env):
    """The start-up lines show while the run is being proven alive (before the launch's summary), the rest as
    `tail` follows on from there: every log line once, in order."""
    done = ops_env.sub("launch", "job", "--follow", "--", "--lines", "30", "--every", "0.1", "--rc", "2")
    assert done.returncode == 4, done.stderr
    log = (ops_env.run_dirs()[-1] / "output.log").read_text()
    shown = "".join(line for line in done.stdout.splitlines(keepends=True) if line.startswith(("job started", "step ")))
    assert shown == log and "step 29" in log and "exited 2" in done.stderr
    assert done.stdout.index("job started") < done.stdout.index("launched ")


def test_json_with_follow_is_refused_before_anything_starts(ops_env):
    done = ops_env.sub("launch", "job", "--json", "--follow")
    assert done.returncode == 2, done.stderr
    err = json.loads(done.stdout)["error"]
    assert err["code"] == "usage" and err["message"].startswith("--json and --follow do not go together")
    assert ops_env.run_dirs() == []


def test_json_makes_the_command_lines_own_usage_errors_json_too(ops_env):
    for args, says in ((("launch", "job", "--wait", "-1"), "Invalid value for '--wait'"),
                       (("runs", "--bogus"), "No such option: --bogus")):
        done = ops_env.sub(*args, "--json")
        assert done.returncode == 2, done.stderr
        err = json.loads(done.stdout)["error"]
        assert err["code"] == "usage" and err["message"].startswith(says), err
        assert err["hint"].endswith(f" {args[0]} --help") and done.stderr == ""  # `python -m dflash_ops` here
    plain = ops_env.sub("runs", "--bogus")
    assert plain.returncode == 2 and plain.stdout == "" and "No such option: --bogus" in plain.stderr


ENDLESS = [("launch", "job", "--wait", "inf"), ("launch", "job", "--force", "--wait", "nan"),
           ("stop", "job", "--grace", "inf"), ("stop", "job", "--grace", "1e400"), ("status", "--timeout", "inf"),
           ("status", "--watch", "--interval", "nan"), ("gpu-reset", "--grace", "inf"),
           ("tail", "job", "-n", "99999999999999999999")]


def test_an_endless_number_is_a_usage_error_and_touches_no_run(ops_env):
    """`inf`/`nan`/a 20-digit count passes a lower bound alone; it must be refused as the other bad values are (exit
    2, the option named), before anything reaches the run: a --force launch would otherwise stop it and then crash."""
    live = ops_env.sub("launch", "job", "--json", "--", "--hold")
    assert live.returncode == 0, live.stderr
    for args in ENDLESS:
        done = ops_env.sub(*args)
        assert done.returncode == 2 and "Invalid value for" in done.stderr and "Traceback" not in done.stderr, \
            (args, done.stderr)
    assert [r["state"] for r in ops_env.runs_json()] == ["running"]


def _cache_runbook(env, cache) -> None:
    (env.runbooks / "cached.yaml").write_text(
        (env.runbooks / "job.yaml").read_text().replace(
            'PYTHONUNBUFFERED: "1"', f'PYTHONUNBUFFERED: "1"\n  TORCHINDUCTOR_CACHE_DIR: "{cache}"')
        + "pre: [clear_inductor_cache]\n")


def test_clear_inductor_cache_removes_the_cache_and_is_refused_while_a_run_lives(ops_env, tmp_path):
    cache = tmp_path / "inductor cache"
    (cache / "triton").mkdir(parents=True)
    _cache_runbook(ops_env, cache)
    ok = ops_env.sub("launch", "cached", "--", "--hold")
    assert ok.returncode == 0, ok.stderr
    assert not cache.exists()
    (cache / "triton").mkdir(parents=True)
    refused = ops_env.sub("launch", "cached", "--name", "other")
    assert refused.returncode == 5 and "inductor cache" in refused.stderr
    assert (cache / "triton").is_dir(), "cache cleared while a run was alive"
    assert len(ops_env.run_dirs()) == 1


def test_force_refused_by_another_run_keeps_the_run_it_would_have_replaced(ops_env, tmp_path):
    """`launch cached --force` while a run of another name lives: the cache may not be cleared, so the launch is
    refused -- before --force stops anything, so the user's live `cached` run goes on."""
    cache = tmp_path / "cache"
    _cache_runbook(ops_env, cache)
    first = ops_env.sub("launch", "cached", "--json", "--", "--hold")
    assert first.returncode == 0, first.stderr
    assert ops_env.sub("launch", "job", "--", "--hold").returncode == 0  # holds the runs dir: cache in use
    forced = ops_env.sub("launch", "cached", "--force")
    assert forced.returncode == 5 and "inductor cache" in forced.stderr, forced.stderr
    states = {r["run_id"]: r["state"] for r in ops_env.runs_json()}
    assert states[json.loads(first.stdout)["run_id"]] == "running" and len(states) == 2, states


def test_a_forced_launch_that_fails_after_the_stop_says_what_it_stopped(ops_env):
    """--force stopped the live run, then the new one died in its liveness check: the error says both."""
    first = ops_env.sub("launch", "job", "--json", "--", "--hold")
    assert first.returncode == 0, first.stderr
    forced = ops_env.sub("launch", "job", "--force", "--", "--rc", "7")
    assert forced.returncode == 4, forced.stderr
    assert f"stopped first (--force): {json.loads(first.stdout)['run_id']}" in forced.stderr, forced.stderr


def test_concurrent_launches_of_one_name_start_exactly_one(ops_env):
    cmd = [sys.executable, "-m", "dflash_ops", "--runbooks", str(ops_env.runbooks), "launch", "job", "--json",
           "--", "--hold"]
    procs = [subprocess.Popen(cmd, env=ops_env.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(3)]
    codes = sorted(p.wait(timeout=60) for p in procs)
    assert codes == [0, 5, 5], [p.stderr.read() for p in procs]
    assert [r["state"] for r in ops_env.runs_json()] == ["running"]


def test_launch_env_reaches_the_job_verbatim_and_replaces_the_runbooks_value(ops_env, tmp_path):
    """--env KEY=VALUE: the job sees the value byte for byte (quotes, $, ;, =, newline: no shell runs it), a runbook
    key given again takes the --env value, run.json lists the keys, the marker stays dflash-ops' own."""
    out, canary = tmp_path / "seen.json", tmp_path / "canary"
    hostile = f"a'b\"c $(touch {canary}); `touch {canary}` x=y\nz"
    done = ops_env.sub("launch", "job", "--json", "--env", f"HOSTILE={hostile}", "-e", "PYTHONUNBUFFERED=yes",
                       "--", "--out", str(out))
    assert done.returncode == 0, done.stderr
    launched = json.loads(done.stdout)
    ops_env.wait_for(out)
    seen = json.loads(out.read_text())
    assert seen["env"] == {"HOSTILE": hostile, "DFLASH_OPS_RUN_ID": launched["run_id"]}
    assert not canary.exists()
    meta = json.loads((Path(launched["run_dir"]) / "run.json").read_text())
    assert meta["env_keys"] == ["HOSTILE", "PYTHONUNBUFFERED"]  # the runbook's PYTHONUNBUFFERED was replaced


@pytest.mark.parametrize("item, message", [
    ("NOEQUALS", "expected KEY=VALUE"),
    ("1BAD=x", "invalid environment variable name"),
    ("A B=x", "invalid environment variable name"),
    ("DFLASH_OPS_RUN_ID=x", "set by dflash-ops itself"),
    ("DFLASH_OPS_RUN_DIR=/elsewhere", "set by dflash-ops itself"),
])
def test_launch_env_refuses_bad_items_in_one_line(ops_env, item, message):
    done = ops_env.sub("launch", "job", "--env", item)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert done.stderr.startswith("error: ") and "Traceback" not in done.stderr
    assert ops_env.run_dirs() == []
