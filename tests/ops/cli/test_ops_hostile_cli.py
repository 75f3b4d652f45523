"""Hostile values round-trip byte-exact and execute nothing; hostile names are refused."""

from __future__ import annotations

import json

import pytest

NASTY = [
    "it's \"quoted\"", "a; touch {canary}", "$(touch {canary})", "`touch {canary}`", "back\\slash\\n",
    "new\nline", "  spaces  ", "", "uni\u00e9\u4e2d\U0001f600", "$HOME ${PATH} $((1+1))", "'; echo PWNED; '",
    "--x", "*", "~", "a|b&c>d<e", "%s%n",
]


def test_hostile_args_and_env_round_trip(ops_env, tmp_path):
    canary = tmp_path / "canary"
    args = [a.replace("{canary}", str(canary)) for a in NASTY]
    hostile_env = "x'; touch " + str(canary) + "; '$(touch " + str(canary) + ")\n\"`id`\""
    (ops_env.runbooks / "env.yaml").write_text(
        (ops_env.runbooks / "job.yaml").read_text().replace(
            'PYTHONUNBUFFERED: "1"', "PYTHONUNBUFFERED: \"1\"\n  HOSTILE: " + json.dumps(hostile_env)))
    out = tmp_path / "argv.json"
    done = ops_env.sub("launch", "env", "--", "--out", str(out), *args)
    assert done.returncode == 0, done.stderr
    ops_env.wait_for(out)
    got = json.loads(out.read_text(encoding="utf-8"))
    assert got["argv"][2:] == ["--out", str(out), *args]
    assert got["env"]["HOSTILE"] == hostile_env
    assert got["env"]["DFLASH_OPS_RUN_ID"] == ops_env.run_dirs()[-1].name
    assert not canary.exists(), "a hostile value was executed"


# a run id as a name: `stop <that id>` would find the new run (by its name) in place of the run of that id
@pytest.mark.parametrize("name", ["a;b", "../x", "$(id)", "", "-x", "a b", "a\nb", "x" * 65, "caf\u00e9", "a/b",
                                  "job-20260101T000000-ab12"])
def test_hostile_run_names_exit_2(ops_env, name):
    done = ops_env.cli("launch", "job", "--name", name)
    assert done.exit_code == 2, done.output
    assert "invalid run name" in done.stderr
    assert ops_env.run_dirs() == []


@pytest.mark.parametrize("ct", ["0", "abc", "1;id", "-1", "200 201", "1234567890"])
def test_hostile_container_ids_exit_2(ops_env, ct):
    done = ops_env.cli("launch", "job", "--host", "10.0.0.1", "--ct", ct, "--dry-run")
    assert done.exit_code == 2 and "invalid container id" in done.stderr


# a..b and a label over 63 characters: the resolver's IDNA codec raised UnicodeError (a traceback) for them
@pytest.mark.parametrize("host", ["a;b", "$(id)", "pve 1", "-oProxyCommand=id", "nosuchhost", "a..b", "a.b.",
                                  "a-.b", "x." + "a" * 64 + ".com", "u@a..b:22"])
def test_bad_hosts_exit_2(ops_env, host):
    done = ops_env.cli("runs", "--host", host)
    assert done.exit_code == 2 and "unknown host" in done.stderr
    trust = ops_env.cli("trust-host", "--", host)
    assert trust.exit_code == 2 and "unknown host" in trust.stderr


def test_dns_names_up_to_the_limits_are_addresses(ops_env):
    longest = ".".join(["a" * 63] * 3 + ["b" * 61])  # 63-character labels, 253 characters in all
    for host in ("x." + "a" * 63 + ".com", longest, "a-b.c", "root@10.0.0.1:2222"):
        done = ops_env.cli("launch", "job", "--host", host, "--dry-run")
        assert done.exit_code == 0, (host, done.output)
    too_long = ops_env.cli("launch", "job", "--host", longest + "b", "--dry-run")
    assert too_long.exit_code == 2 and "unknown host" in too_long.stderr
