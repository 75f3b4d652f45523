"""Golden tests of the pure shell builders: parse what we build back with shlex and compare to the intent."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import time

import pytest

from dflash_ops import names, wire
from dflash_ops.runs import launch_scripts, read_scripts, shellcmd, stop_scripts
from dflash_ops.ssh.common import command_string
from dflash_ops.spec import Container, Host, Liveness, RunSpec, Target

HOSTILE = ("it's \"q\"", "$(id)", "`id`", "a; b && c | d", "new\nline", "back\\slash", " ", "", "\u4e2d\U0001f600",
           "${HOME}", "'", '"', "--", "-c")


def spec(argv=("python3", "-m", "trainer", *HOSTILE), env=(("HOSTILE", "x'; $(id)\n`id`"),), pre=()) -> RunSpec:
    return RunSpec(run_id="r1-20260101T000000-abcd", name="r1", runbook="rb", argv=tuple(argv),
                   workdir="/runs dir/it's/r1-20260101T000000-abcd", env=env, pre=pre, runs_dir="/runs dir/it's",
                   host="pve1", ct="200", liveness=Liveness())


PVE = Target(Host(name="pve1", transport="proxmox", address="10.1.2.6", pct="/usr/sbin/pct"), Container(ctid="200"))


def _launch_command(script: str) -> str:
    start = script.index("DFLASH_OPS_RUN_ID=r1-")
    return script[start:script.index(" 9>&- &\n", start) + len(" 9>&- &")]


def _wrapped(script: str) -> str:
    words = shlex.split(_launch_command(script))
    assert words[:6] == ["DFLASH_OPS_RUN_ID=r1-20260101T000000-abcd", "DFLASH_OPS_RUN_DIR=$RUNS/r1-20260101T000000-abcd",
                         "nohup", "setsid", "bash", "-c"]
    assert words[7:] == ["dflash-run", "$PWD", ">>output.log", "2>&1", "</dev/null", "9>&-", "&"]  # $1: the run dir
    return words[6]


@pytest.mark.parametrize("text", [
    "r1-20260101T000000-abcd", "a.b_c-d-20261203T235959-0f9e", "a" * 64 + "-20260101T000000-abcd",
    "a" * 65 + "-20260101T000000-abcd", "-x-20260101T000000-abcd", "r1", "r1-20260101T000000-ABCD",
    "x\nr1-20260101T000000-abcd", "r1-20260101T000000-abcd\n", "a b-20260101T000000-abcd",
    "\u00e9-20260101T000000-abcd", "a\u00e9-20260101T000000-abcd", "*-20260101T000000-abcd",
    "r1-20260101T000000-abcd-20260102T000000-0000", "r1-2026010xT000000-abcd", "r1-20260101T000000-abcde",
    "r1--20260101T000000-abcd", "r1-20260101T000000-ab\u00b2d"])
def test_the_remote_run_id_rule_is_the_run_id_rule(text):
    """What the scripts accept as a run id (read from an environment or a directory name) is what names accepts."""
    assert (re.fullmatch(shellcmd.RUN_ID_ERE.strip("^$"), text) is not None) == names.is_run_id(text)
    done = subprocess.run(["bash", "-c", shellcmd.PRELUDE + 'dflash_is_id "$1"', "-", text])
    assert (done.returncode == 0) == names.is_run_id(text)


def test_two_parses_give_back_the_pct_argv_and_the_script():
    script = launch_scripts.launch_script(spec())
    sent = command_string(shellcmd.target_argv(PVE, script))
    argv = shlex.split(sent)  # parse 1: the PVE host's login shell
    assert argv[:9] == ["/usr/sbin/pct", "exec", "200", "--", "env", "-i", "HOME=/root", argv[7], "bash"]
    assert argv[7].startswith("PATH=/usr/local/sbin:") and argv[9:] == ["-c", script]


def test_the_job_argv_survives_every_layer_byte_exact():
    s = spec()
    wrapped = _wrapped(launch_scripts.launch_script(s))      # parse 2: bash -c SCRIPT
    run_line = wrapped[wrapped.index("cd -- "):wrapped.index("\nrc=$?")]
    words = shlex.split(run_line)                      # parse 3: bash -c WRAPPED
    assert words[:4] == ["cd", "--", s.workdir, "&&"] and tuple(words[4:]) == s.argv
    exports = wrapped[wrapped.index("export "):wrapped.index("\ncd -- ")]
    assert shlex.split(exports) == ["export", "HOSTILE=x'; $(id)\n`id`"]


def test_the_plain_host_argv_is_bash_c():
    assert shellcmd.target_argv(Target(Host(name="h", transport="ssh")), "echo") == ["bash", "-c", "echo"]


def test_trap_ordering_nohup_line_is_alone():
    """The `&` must background only the nohup command: never `a && nohup ... &`
    (`&` would then background the whole and-list, and `$!` would be a subshell's PID, not the job's)."""
    script = launch_scripts.launch_script(spec())
    command = _launch_command(script)
    start = script.index(command)
    assert script[start - 1] == "\n" and script[start + len(command)] == "\n"
    assert script[:start].rstrip().endswith("|| dflash_fail 'cannot enter the run dir'")  # the cd: its own list


def test_run_json_prefix_is_json_once_closed():
    import json

    s = spec()
    body = json.loads(launch_scripts.run_json_prefix(s) + "1700000000}")
    assert body["argv"] == list(s.argv) and body["env_keys"] == ["HOSTILE"] and body["started_at"] == 1700000000
    assert "\n" not in launch_scripts.run_json_prefix(s)


def test_clear_cache_uses_the_runbooks_cache_dir_quoted():
    s = spec(env=(("TORCHINDUCTOR_CACHE_DIR", "/c a/$(id)"),), pre=("clear_inductor_cache",))
    script = launch_scripts.launch_script(s)
    assert "TORCHINDUCTOR_CACHE_DIR='/c a/$(id)'" in script
    assert 'rm -rf -- "$cache"' in script
    assert script.index("DFLASH_REFUSED cache") < script.index("rm -rf") < script.index("nohup")


@pytest.mark.parametrize("build", [
    lambda: launch_scripts.launch_script(spec(pre=("clear_inductor_cache",))),
    lambda: launch_scripts.wrapper_script(spec()),
    lambda: read_scripts.list_script("/r'uns"),
    lambda: read_scripts.probe_script("/r/x-20260101T000000-abcd"),
    lambda: read_scripts.tail_start_script("/r/x", 5),
    lambda: read_scripts.tail_chunk_script("/r/x", 10),
    lambda: stop_scripts.stop_script("/r", "x-20260101T000000-abcd", 2.5),
    lambda: stop_scripts.runs_of_holders_script("~/r", [(12, 99), (34, 100)]),
    lambda: stop_scripts.mark_ended_stopped_script("~/r", ["x-20260101T000000-abcd"]),
])
def test_every_script_is_valid_bash(build):
    done = subprocess.run(["bash", "-n", "-c", build()], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_stop_grace_is_wall_clock_time_however_slow_each_round(tmp_path):
    """A job that ignores SIGTERM, and every `sleep` of the stop script taking 1 s (as a slow process scan makes
    each round of its wait): a 2 s grace still ends in about 2 s with the SIGKILL, not after 20 rounds (20 s),
    which would outlast the caller's timeout (grace + 30 s) and leave the job running."""
    rid = "x-20260101T000000-abcd"
    (tmp_path / "runs" / rid).mkdir(parents=True)
    slow = tmp_path / "bin"
    slow.mkdir()
    (slow / "sleep").write_text("#!/bin/sh\nexec /bin/sleep 1\n")
    (slow / "sleep").chmod(0o755)
    job = subprocess.Popen(["bash", "-c", "trap '' TERM; echo up; while :; do /bin/sleep 0.05; done"],
                           env={**os.environ, wire.MARKER_VAR: rid}, stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert job.stdout.readline() == b"up\n"  # its trap is set
        t0 = time.monotonic()
        done = subprocess.run(["bash", "-c", stop_scripts.stop_script(str(tmp_path / "runs"), rid, 2.0)],
                              env={**os.environ, "PATH": f"{slow}:{os.environ['PATH']}"}, capture_output=True,
                              text=True, timeout=120)
        took = time.monotonic() - t0
        assert f"{wire.STOP} killed" in done.stdout, done.stdout + done.stderr
        assert job.wait(timeout=60) == -signal.SIGKILL
        assert took < 12, took  # 20 rounds would be 20 s at the least
    finally:
        if job.poll() is None:
            job.kill()


def test_home_relative_paths_expand_on_the_remote_side_in_quoted_pieces():
    assert shellcmd.path_word("~/dflash-runs") == '"$HOME"/dflash-runs'
    assert shellcmd.path_word("~") == '"$HOME"'
    assert shellcmd.path_word("~/it's $(id)") == '"$HOME"/\'it\'"\'"\'s $(id)\''
    assert shellcmd.path_word("/root/x") == "/root/x" and shellcmd.path_word("~bob/x") == "'~bob/x'"
    out = subprocess.run(["bash", "-c", f"printf %s {shellcmd.path_word('~/it' + chr(39) + 's $(id)')}"],
                         capture_output=True, text=True, env={"HOME": "/h o"}, check=True).stdout
    assert out == "/h o/it's $(id)"
    assert 'RUNS="$HOME"/dflash-runs\n' in read_scripts.list_script("~/dflash-runs")


def test_a_home_relative_run_dir_reaches_the_job_as_the_wrappers_first_argument():
    rid = "r1-20260101T000000-abcd"
    s = RunSpec(run_id=rid, name="r1", runbook="rb", argv=("python3", f"--out=~/runs/{rid}/x y", "~/runs"),
                workdir="~/code", env=(("CKPT", f"~/runs/{rid}"),), pre=(), runs_dir="~/runs", host="h", ct=None,
                liveness=Liveness())
    wrapped = _wrapped(launch_scripts.launch_script(s))
    assert "export CKPT=\"$1\"\n" in wrapped and "cd -- \"$HOME\"/code && python3 " in wrapped
    words = wrapped[wrapped.index("python3 "):wrapped.index("\nrc=$?")]
    got = subprocess.run(["bash", "-c", f"printf '%s\\0' {words}", "dflash-run", "/abs/run dir"],
                         capture_output=True, check=True).stdout.split(b"\0")[:-1]
    assert got == [b"python3", b"--out=/abs/run dir/x y", b"~/runs"]   # only the run dir itself is replaced
    assert 'printf \'%s\\n\' "$rc" > "$1"/exit_code.tmp' in wrapped


def _starttime(pid: int) -> int:
    return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[19])


def test_gpu_resets_runs_of_holders_are_found_by_marker_start_time_and_plain_name(tmp_path):
    """runs_of_holders_script, run for real: the live run a listed holder carries the marker of, not a run whose
    process is not listed, not a listed pid whose start time differs (reused), not a crafted run id."""
    import os
    import sys

    runs = tmp_path / "runs"
    runs.mkdir()

    def process(run_id: str, run_dir: str) -> subprocess.Popen:
        env = {**os.environ, "DFLASH_OPS_RUN_ID": run_id, "DFLASH_OPS_RUN_DIR": run_dir}
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)

    held, other, reused = "held-20260101T000000-abcd", "other-20260101T000000-abcd", "reused-20260101T000000-abcd"
    procs = {name: process(name, f"{runs}/{name}") for name in (held, other, reused)}
    procs["evil"] = process("../evil", f"{runs}/../evil")
    for name in (held, other, reused):
        (runs / name).mkdir()
        (runs / name / "pid").write_text(f"{procs[name].pid}\n")
    (tmp_path / "evil").mkdir()
    try:
        listed = [(procs[n].pid, _starttime(procs[n].pid)) for n in (held, "evil")]
        listed.append((procs[reused].pid, _starttime(procs[reused].pid) + 1))
        done = subprocess.run(["bash", "-c", stop_scripts.runs_of_holders_script(str(runs), listed)],
                              capture_output=True, text=True, timeout=60)
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"DFLASH_RUNOF {held}"]


def test_gpu_reset_marks_only_runs_that_ended_without_an_exit_code(tmp_path):
    import sys

    runs = tmp_path / "runs"
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             env={"DFLASH_OPS_RUN_ID": "alive-20260101T000000-abcd"})
    dead = subprocess.Popen(["true"])
    dead.wait()
    ids = {}
    for name, pid, exit_code in (("lost", dead.pid, None), ("alive", alive.pid, None), ("exited", dead.pid, "0")):
        ids[name] = f"{name}-20260101T000000-abcd"
        d = runs / ids[name]
        d.mkdir(parents=True)
        (d / "pid").write_text(f"{pid}\n")
        if exit_code is not None:
            (d / "exit_code").write_text(exit_code + "\n")
    try:
        done = subprocess.run(["bash", "-c", stop_scripts.mark_ended_stopped_script(str(runs), list(ids.values()) +
                                                                                ["gone-20260101T000000-abcd"])],
                              capture_output=True, text=True, timeout=60)
    finally:
        alive.kill()
        alive.wait()
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"DFLASH_MARKED {ids['lost']}"]
    assert [n for n in ids if (runs / ids[n] / "stopped").exists()] == ["lost"]
