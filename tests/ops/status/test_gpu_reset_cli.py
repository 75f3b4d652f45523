"""`dflash-ops gpu-reset` end to end: real holder processes (a run with a DataLoader-like child, a holder that
ignores SIGTERM), the fake nvidia-smi over them, the local transport and the emulated Proxmox host over sshd."""
import json
import os

import pytest
import yaml

from support.procfs import is_alive as alive

from conftest import cli, trainer_runbook


@pytest.fixture
def gpu_env(fake_gpus, monkeypatch):
    monkeypatch.setenv("DFLASH_OPS_NVIDIA_SMI", str(fake_gpus.nvidia_smi))
    monkeypatch.setenv("DFLASH_OPS_NVIDIA_DEV_GLOB", fake_gpus.dev_glob)
    return fake_gpus



def local_inventory(tmp_path):
    inv = tmp_path / "inventory.yaml"
    inv.write_text(yaml.safe_dump({"hosts": {"local": {"transport": "local", "runs_dir": str(tmp_path / "runs")}}}))
    return inv


def test_local_reset_kills_run_group_child_and_stubborn_holder(tmp_path, gpu_env, holders):
    inv = local_inventory(tmp_path)
    book = trainer_runbook(tmp_path / "runbooks", gpu_env, gpu=0, mib=2048, child_mib=4096)
    launched = cli("--inventory", str(inv), "--runbooks", str(tmp_path / "runbooks"), "launch", book, "--json")
    assert launched.exit_code == 0, launched.output
    run = json.loads(launched.stdout)
    stubborn = holders.start(gpu=1, mib=1024, ignore_term=True)
    res = cli("--inventory", str(inv), "gpu-reset", "--host", "local", "--yes", "--grace", "0.5", "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    before = {g["index"]: g for g in out["before"]}
    assert before[0]["memory_used_mib"] == 6144 and before[1]["memory_used_mib"] == 1024
    assert all(g["memory_used_mib"] == 0 and g["holders"] == [] for g in out["after"])
    assert out["ok"] and out["held"] == [] and not alive(stubborn) and alive(os.getpid())
    first = out["rounds"][0]
    assert {t["pgid"] for t in first["targets"]} == {run["pid"], stubborn}
    assert stubborn in first["gone"] and stubborn not in first["died_on_term"]
    runs = json.loads(cli("--inventory", str(inv), "runs", "--json").stdout)
    # SIGTERM ended it: its wrapper wrote the exit code, which it keeps (nothing to mark)
    assert (runs[0]["state"], runs[0]["exit_code"], runs[0]["stopped"]) == ("killed", 143, False)
    assert first["marked_stopped"] == []


def test_reset_gives_a_run_the_time_to_write_its_checkpoint(tmp_path, gpu_env):
    """As `stop` does: SIGTERM, then the default grace, enough for a trainer that takes 12 s (well inside the
    120 s default) to write its checkpoint and exit; the run then reads stopped at its step, not killed."""
    import time
    from pathlib import Path

    inv = local_inventory(tmp_path)
    book = trainer_runbook(tmp_path / "runbooks", gpu_env, gpu=3, mib=1500, slow_term_s=12, name="saver")
    launched = cli("--inventory", str(inv), "--runbooks", str(tmp_path / "runbooks"), "launch", book, "--json")
    assert launched.exit_code == 0, launched.output
    run = json.loads(launched.stdout)
    t0 = time.monotonic()
    res = cli("--inventory", str(inv), "gpu-reset", "--host", "local", "--yes", "--json")
    assert res.exit_code == 0, res.output
    assert time.monotonic() - t0 >= 12 and json.loads(res.stdout)["ok"]
    [listed] = json.loads(cli("--inventory", str(inv), "runs", "--json").stdout)
    assert (listed["run_id"], listed["state"], listed["exit_code"]) == (run["run_id"], "stopped", 143), listed
    step = listed["stopped_step"]
    assert step >= 10 and (Path(run["run_dir"]) / "ckpt" / f"step_{step}" / "state").is_file()


def test_a_run_that_only_sigkill_ends_reads_killed_not_lost(tmp_path, gpu_env):
    """SIGKILL ends the wrapper before it can write an exit code: gpu-reset, which found the run from its holder
    before signalling, marks it stopped once it has ended, so it reads `killed`, as after `stop`, not `lost`."""
    inv = local_inventory(tmp_path)
    book = trainer_runbook(tmp_path / "runbooks", gpu_env, gpu=2, mib=1000, ignore_term=True, name="stuck")
    launched = cli("--inventory", str(inv), "--runbooks", str(tmp_path / "runbooks"), "launch", book, "--json")
    assert launched.exit_code == 0, launched.output
    run = json.loads(launched.stdout)
    res = cli("--inventory", str(inv), "gpu-reset", "--host", "local", "--yes", "--grace", "0.3")
    assert res.exit_code == 0, res.output
    assert f"marked stopped (host): {run['run_id']}" in res.stdout and "needed SIGKILL" in res.stdout
    assert not alive(run["pid"])
    (state,) = json.loads(cli("--inventory", str(inv), "runs", "--json").stdout)
    assert state["run_id"] == run["run_id"] and state["state"] == "killed" and state["stopped"]
    assert state["exit_code"] is None  # no exit code was written: without the mark this read `lost`


def test_asks_first_and_declining_kills_nothing(tmp_path, gpu_env, holders):
    pid = holders.start(gpu=3, mib=500, bystander=tmp_path / "bystander.pid")
    sleeper = int((tmp_path / "bystander.pid").read_text())
    res = cli("gpu-reset", "--host", "local", "--grace", "0.2", input="n\n")
    assert res.exit_code == 1 and alive(pid) and alive(sleeper)
    assert "will kill on local" in res.stdout and str(pid) in res.stdout and "process group" in res.stdout
    # what the group signal reaches beyond the GPU holders is named before the question, and in it
    assert f"process group {pid} also holds, with no GPU: {sleeper} (sleep)" in res.stdout
    assert "Kill 1 process(es) and the 1 in their process groups?" in res.stdout
    res = cli("gpu-reset", "--host", "local", "--grace", "0.2", input="y\n")
    assert res.exit_code == 0, res.output
    assert not alive(pid) and not alive(sleeper)
    assert "before -> after" in res.stdout


def test_gpu_held_by_our_own_session_is_spared_and_reported_held(tmp_path, gpu_env):
    state = json.loads(gpu_env.state.read_text())
    state["holders"] = [{"pid": os.getpid(), "gpu": 4, "mib": 700}]
    gpu_env.state.write_text(json.dumps(state))
    res = cli("gpu-reset", "--host", "local", "--yes", "--wait", "0.5", "--json")
    assert res.exit_code == 1 and alive(os.getpid())
    result = json.loads(res.stdout)
    assert result["held"] == [4] and not result["ok"] and result["rounds"] == []
    spared = next(h for h in result["after"][4]["holders"])
    assert spared["pid"] == os.getpid()
    human = cli("gpu-reset", "--host", "local", "--yes", "--wait", "0.2")
    assert human.exit_code == 1 and "spared: pid" in human.stdout and "our own session" in human.stdout
    assert "GPU(s) 4 on local still held" in human.stderr


def test_json_without_yes_is_refused(gpu_env):
    res = cli("gpu-reset", "--host", "local", "--json")
    assert res.exit_code == 2 and "--json needs --yes" in json.loads(res.stdout)["error"]["message"]


@pytest.mark.ssh
def test_proxmox_reset_is_scoped_to_the_container_then_all_then_hard(testbed, host_tools, gpu_env, tmp_path):
    tb = testbed(2)
    host_tools("nvidia-smi", gpu_env.nvidia_smi.read_text())
    base = ["--inventory", str(tb.inventory), "--runbooks", str(tmp_path / "runbooks")]
    a, b = tb.containers
    runs = {}
    for ct, gpu in ((a, 1), (b, 2)):  # a's job outlives SIGTERM: only SIGKILL ends it, and its wrapper
        book = trainer_runbook(tmp_path / "runbooks", gpu_env, gpu=gpu, mib=2000, child_mib=1000, name=f"ft{gpu}",
                               ignore_term=ct is a)
        res = cli(*base, "launch", book, "--host", tb.host, "--ct", str(ct.ctid), "--json")
        assert res.exit_code == 0, res.output
        runs[ct.ctid] = json.loads(res.stdout)

    res = cli(*base, "gpu-reset", "--host", tb.host, "--yes", "--grace", "2", "--json")
    assert res.exit_code == 2 and "--all-containers" in json.loads(res.stdout)["error"]["message"]

    res = cli(*base, "gpu-reset", "--host", tb.host, "--ct", str(a.ctid), "--yes", "--grace", "2", "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    (rd,) = out["rounds"]
    held_by_a = {h["pid"] for h in out["before"][1]["holders"]}
    assert {h["ct"] for h in out["before"][1]["holders"]} == {str(a.ctid)}
    assert {t["pid"] for t in rd["targets"]} == held_by_a and len(held_by_a) == 2
    assert {s["reason"] for s in rd["spared"]} == {f"belongs to container {b.ctid}, not container {a.ctid} "
                                                   "(use --all-containers)"}
    assert rd["marked_stopped"] == [{"where": f"ct{a.ctid}", "run_ids": [runs[a.ctid]["run_id"]], "error": None}]
    listed = json.loads(cli(*base, "runs", "--host", tb.host, "--ct", str(a.ctid), "--json").stdout)
    assert [(r["run_id"], r["state"], r["stopped"]) for r in listed] == [(runs[a.ctid]["run_id"], "killed", True)]
    after = {g["index"]: g for g in out["after"]}
    assert after[1]["memory_used_mib"] == 0 and after[2]["memory_used_mib"] == 3000
    assert out["watched"] == [1] and {h["ct"] for h in after[2]["holders"]} == {str(b.ctid)}

    res = cli(*base, "gpu-reset", "--host", tb.host, "--all-containers", "--hard", "--yes", "--grace", "2", "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert all(g["memory_used_mib"] == 0 for g in out["after"])
    assert len(out["resets"]) == 8 and all(r["ok"] for r in out["resets"])
    assert tb.sshd.running     # the kill scripts ran over it: our own session and sshd were never signalled
    assert json.loads(gpu_env.state.read_text())["resets"] == [g["uuid"] for g in out["after"]]


def test_unreachable_host_exits_69(tmp_path, gpu_env):
    inv = tmp_path / "inventory.yaml"
    inv.write_text(yaml.safe_dump({"hosts": {"gone": {"transport": "ssh", "address": "127.0.0.1", "port": 1,
                                                      "connect_timeout_s": 2}}}))
    res = cli("--inventory", str(inv), "gpu-reset", "--host", "gone", "--yes", "--json")
    assert res.exit_code == 69 and json.loads(res.stdout)["error"]["code"] == "unreachable"
