"""`dflash-ops status` end to end: real runs (fake trainer printing the metrics contract), a fake nvidia-smi whose
holders are those real processes, the local transport and the real sshd + emulated Proxmox containers."""
import json
import socket
import threading

import pytest
import yaml

from conftest import cli, trainer_runbook


@pytest.fixture
def gpu_env(fake_gpus, monkeypatch):
    monkeypatch.setenv("DFLASH_OPS_NVIDIA_SMI", str(fake_gpus.nvidia_smi))
    monkeypatch.setenv("DFLASH_OPS_NVIDIA_DEV_GLOB", fake_gpus.dev_glob)
    return fake_gpus


def _stop(inventory, host, run_id, ct=None):
    args = ["--inventory", str(inventory), "stop", run_id, "--grace", "2", "--host", host]
    res = cli(*args + (["--ct", str(ct)] if ct else []))
    assert res.exit_code == 0, res.output


def test_local_status_shows_run_metrics_and_gpu_holders(tmp_path, gpu_env):
    inv = tmp_path / "inventory.yaml"
    inv.write_text(yaml.safe_dump({"hosts": {"local": {"transport": "local", "runs_dir": str(tmp_path / "runs")}}}))
    book = trainer_runbook(tmp_path / "runbooks", gpu_env, gpu=2, mib=2048, child_mib=4096)
    launched = cli("--inventory", str(inv), "--runbooks", str(tmp_path / "runbooks"), "launch", book, "--json")
    assert launched.exit_code == 0, launched.output
    run = json.loads(launched.stdout)
    try:
        res = cli("--inventory", str(inv), "status", "--json")
        assert res.exit_code == 0, res.output
        (host,) = json.loads(res.stdout)["hosts"]
        (target,) = host["targets"]
        (row,) = target["runs"]
        assert (row["run_id"], row["state"], row["pid"], row["gpus"]) == (run["run_id"], "running", run["pid"], [2])
        assert row["metrics"]["step"] >= 10 and row["metrics"]["tokens_per_s"] == 51234.5 and row["uptime_s"] >= 0
        gpu2 = host["gpu"]["gpus"][2]
        assert gpu2["memory_used_mib"] == 6144 and {h["run_id"] for h in gpu2["holders"]} == {run["run_id"]}
        assert sorted(h["used_mib"] for h in gpu2["holders"]) == [2048, 4096]
        human = cli("--inventory", str(inv), "status")
        assert run["run_id"] in human.stdout and "GPUs on local" in human.stdout and "6144 / 143771 MiB" in human.stdout
    finally:
        _stop(inv, "local", run["run_id"])


def test_status_of_one_run_lists_the_runs_of_its_target_once(tmp_path, gpu_env, monkeypatch):
    """`status RUN` finds the run with the same query that reads its metrics and GPUs: one listing of the target's
    runs, not one to find it and another for the report (each command still goes through the real transport)."""
    from dflash_ops.ssh import local, transport

    inv = tmp_path / "inventory.yaml"
    inv.write_text(yaml.safe_dump({"hosts": {"local": {"transport": "local", "runs_dir": str(tmp_path / "runs")}}}))
    book = trainer_runbook(tmp_path / "runbooks", gpu_env, gpu=1, mib=1024)
    launched = cli("--inventory", str(inv), "--runbooks", str(tmp_path / "runbooks"), "launch", book, "--json")
    assert launched.exit_code == 0, launched.output
    run = json.loads(launched.stdout)
    scripts: list[str] = []

    class Counted(local.LocalTransport):
        def run(self, argv, **kwargs):
            scripts.append(" ".join(argv))
            return super().run(argv, **kwargs)

    monkeypatch.setattr(transport, "for_host", lambda host: Counted(host.name))
    try:
        res = cli("--inventory", str(inv), "status", run["run_id"], "--json")
        assert res.exit_code == 0, res.output
        doc = json.loads(res.stdout)
        assert doc["state"] == "running" and doc["nodes"][0]["run"]["gpus"] == [1]
        assert doc["nodes"][0]["run"]["metrics"]["step"] >= 10
        assert sum(s.count("DFLASH_JSON") for s in scripts) == 1, scripts      # one listing of the runs dir
        assert len(scripts) == 1
        missing = cli("--inventory", str(inv), "status", "nosuchrun", "--json")
        assert missing.exit_code == 3 and json.loads(missing.stdout)["error"]["code"] == "run_not_found"
    finally:
        monkeypatch.undo()
        _stop(inv, "local", run["run_id"])


def test_no_gpu_is_said_plainly(tmp_path, monkeypatch):
    """Once, in words: no nested parentheses repeating the command's name."""
    missing = tmp_path / "no-such-nvidia-smi"
    monkeypatch.setenv("DFLASH_OPS_NVIDIA_SMI", str(missing))
    res = cli("status", "--host", "local")
    assert res.exit_code == 0 and res.stdout.splitlines()[0] == f"local: no GPU: {missing} not found"
    data = json.loads(cli("status", "--host", "local", "--json").stdout)
    assert data["hosts"][0]["gpu"] == {"available": False, "gpus": [], "reason": f"{missing} not found"}
    # the default: nvidia-smi looked up on PATH (an empty PATH directory here)
    monkeypatch.setenv("DFLASH_OPS_NVIDIA_SMI", "nvidia-smi")
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    res = cli("status", "--host", "local")
    assert res.stdout.splitlines()[0] == "local: no GPU: nvidia-smi not found on PATH", res.stdout
    reset = cli("gpu-reset", "--host", "local", "--yes")
    assert reset.exit_code == 0 and reset.stdout == "local: no GPU: nvidia-smi not found on PATH; nothing to reset\n"


def test_unknown_host_is_a_usage_error():
    res = cli("status", "--host", "no_such_host", "--json")
    assert res.exit_code == 2 and json.loads(res.stdout)["error"]["code"] == "usage"


class SilentServer:
    """Accepts TCP connections and never says a word: a hung host (paramiko waits for the SSH banner)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.conns = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                self.conns.append(self.sock.accept()[0])
            except OSError:
                return

    def close(self):
        self.sock.close()
        for c in self.conns:
            c.close()


@pytest.mark.ssh
def test_eight_containers_one_connection_with_a_hung_host_and_a_stopped_container(
        testbed, host_tools, gpu_env, tmp_path):
    tb = testbed(8)
    host_tools("nvidia-smi", gpu_env.nvidia_smi.read_text())
    silent = SilentServer()
    doc = yaml.safe_load(tb.inventory.read_text())
    doc["hosts"]["hung"] = {**doc["hosts"][tb.host], "port": silent.port, "connect_timeout_s": 1}
    tb.inventory.write_text(yaml.safe_dump(doc))
    runbooks = tmp_path / "runbooks"
    book = trainer_runbook(runbooks, gpu_env, gpu=5, mib=3000, child_mib=1000)
    ct_run, ct_stopped = tb.containers[3], tb.containers[6]
    base = ["--inventory", str(tb.inventory), "--runbooks", str(runbooks)]
    launched = cli(*base, "launch", book, "--host", tb.host, "--ct", str(ct_run.ctid), "--json")
    assert launched.exit_code == 0, launched.output
    run = json.loads(launched.stdout)
    ct_stopped.stop()
    try:
        res = cli(*base, "status", "--json", "--timeout", "10")
        data = json.loads(res.stdout)
        hosts = {h["host"]: h for h in data["hosts"]}
        assert res.exit_code == 69 and not hosts["hung"]["reachable"]
        assert hosts["hung"]["error"]["code"] == "unreachable"
        assert hosts["hung"]["elapsed_s"] < 10      # ended by its 1 s connect timeout, not by --timeout
        pve = hosts[tb.host]
        by_ct = {t["ct"]: t for t in pve["targets"]}
        assert len(by_ct) == 8, list(by_ct)
        assert "not running" in by_ct[str(ct_stopped.ctid)]["error"]
        assert all(t["error"] is None for ct, t in by_ct.items() if ct != str(ct_stopped.ctid))
        (row,) = by_ct[str(ct_run.ctid)]["runs"]
        assert (row["run_id"], row["state"], row["gpus"]) == (run["run_id"], "running", [5])
        assert row["metrics"]["step"] >= 10
        holders = pve["gpu"]["gpus"][5]["holders"]
        assert {(h["ct"], h["run_id"]) for h in holders} == {(str(ct_run.ctid), run["run_id"])}
        trainer = next(h for h in holders if h["used_mib"] == 3000)
        # host PID -> container PID, checked against the container's own view; the run's pid is its group leader
        assert trainer["ct_pid"] == ct_run.container_pid(trainer["pid"]) != trainer["pid"]
        assert ct_run.host_pid(run["pid"]) == trainer["pgid"]
        assert all(t["runs"] == [] for ct, t in by_ct.items() if ct not in (str(ct_run.ctid), str(ct_stopped.ctid)))
        human = cli(*base, "status")
        assert human.exit_code == 69 and "hung: UNREACHABLE (unreachable)" in human.stdout
        assert run["run_id"] in human.stdout and "not running" in human.stdout and "GPUs on pve-test" in human.stdout
        one = cli(*base, "status", "--host", tb.host, "--ct", str(ct_run.ctid), "--json")
        assert one.exit_code == 0, one.output
        one = json.loads(one.stdout)
        assert [(h["host"], [t["ct"] for t in h["targets"]]) for h in one["hosts"]] == [(tb.host, [str(ct_run.ctid)])]
        # the host answers, but a container in scope is down: 69, whether it is the only one in scope or not
        down = cli(*base, "status", "--host", tb.host, "--ct", str(ct_stopped.ctid))
        assert down.exit_code == 69 and f"ct{ct_stopped.ctid}:  unreachable" in down.stdout, down.output
        assert cli(*base, "status", "--host", tb.host, "--json").exit_code == 69
    finally:
        silent.close()
        _stop(tb.inventory, tb.host, run["run_id"], ct_run.ctid)


def test_watch_json_prints_one_document_per_refresh_until_ctrl_c(tmp_path, gpu_env):
    import os
    import signal
    import subprocess
    import sys

    from conftest import REPO

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "dflash_ops", "status", "--host", "local", "--watch", "--json",
                             "--interval", "0.2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=tmp_path)
    try:
        docs = [json.loads(proc.stdout.readline()) for _ in range(3)]
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=300)     # drained: a child blocked on a full pipe would never exit
    rc = proc.returncode
    assert rc == 0 and all(d["hosts"][0]["host"] == "local" and d["hosts"][0]["gpu"]["available"] for d in docs)


@pytest.mark.parametrize("columns", ["80", "120", "200", None])
def test_status_is_readable_at_80_120_and_200_columns_and_piped(tmp_path, gpu_env, columns):
    """Every figure of a run (pid, uptime, step, loss, tok/s, acc, gpus) and its whole id are on screen at any
    width; nothing is cut to "…". A real process with its stdout piped; None: no COLUMNS (a pipe reads as 80)."""
    import os
    import subprocess
    import sys

    from conftest import REPO

    inv = tmp_path / "inventory.yaml"
    inv.write_text(yaml.safe_dump({"hosts": {"local": {"transport": "local", "runs_dir": str(tmp_path / "runs")}}}))
    book = trainer_runbook(tmp_path / "runbooks", gpu_env, gpu=2, mib=2048, child_mib=4096)
    launched = cli("--inventory", str(inv), "--runbooks", str(tmp_path / "runbooks"), "launch", book,
                   "--name", "drafter-qwen3-8b-long-run-name", "--json")
    assert launched.exit_code == 0, launched.output
    run = json.loads(launched.stdout)
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    env.update(PYTHONPATH=str(REPO), **({"COLUMNS": columns} if columns else {}))
    width = int(columns or 80)
    try:
        done = subprocess.run([sys.executable, "-m", "dflash_ops", "--inventory", str(inv), "status"],
                              capture_output=True, text=True, env=env, timeout=60)
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        assert "…" not in done.stdout and all(len(line) <= width for line in lines), done.stdout
        [first] = [i for i, line in enumerate(lines) if line.lstrip().startswith(run["run_id"])]
        block = lines[first:first + 4]        # the run's lines: wrapped at 80 columns, whole at 200
        assert block[0].split()[:2] == [run["run_id"], "running"], done.stdout
        # each figure is its label and value side by side on one line (a wrap falls between figures only)
        figures = {words[i]: words[i + 1] for words in map(str.split, block) for i in range(len(words) - 1)}
        assert figures["pid"] == str(run["pid"]) and figures["gpus"] == "2", done.stdout
        assert figures["up"].startswith("0m") and figures["step"].isdigit(), done.stdout
        assert figures["tok/s"] == "51,234" and 0 < float(figures["acc"]) < float(figures["loss"]) < 4, done.stdout
        if width >= 120:
            assert len([line for line in block if "pid" in line or "step" in line]) == 2, done.stdout
        assert "6144 / 143771 MiB" in done.stdout and f"run {run['run_id']}" in done.stdout
    finally:
        _stop(inv, "local", run["run_id"])


def test_status_shows_the_newest_finished_runs_and_counts_the_others(tmp_path, monkeypatch):
    """Finished runs beyond hoststatus.FINISHED_SHOWN are counted, not shown (nor their logs read)."""
    from dflash_ops import hoststatus

    monkeypatch.setenv("DFLASH_OPS_NVIDIA_SMI", str(tmp_path / "no-such-nvidia-smi"))
    runs = tmp_path / "runs"
    inv = tmp_path / "inventory.yaml"
    inv.write_text(yaml.safe_dump({"hosts": {"local": {"transport": "local", "runs_dir": str(runs)}}}))
    made = []
    for i in range(hoststatus.FINISHED_SHOWN + 5):
        rid = f"old-20260101T0000{i:02d}-{i:04x}"
        (runs / rid).mkdir(parents=True)
        (runs / rid / "output.log").write_text('DFLASH_DONE {"step": 3}\n')
        (runs / rid / "exit_code").write_text("0\n")
        made.append(rid)
    res = cli("--inventory", str(inv), "status", "--json")
    assert res.exit_code == 0, res.output
    (target,) = json.loads(res.stdout)["hosts"][0]["targets"]
    assert [r["run_id"] for r in target["runs"]] == made[5:] and target["finished_hidden"] == 5
    human = cli("--inventory", str(inv), "status")
    assert "and 5 older finished run(s)" in human.stdout and made[4] not in human.stdout
    for ref in (made[0], "old"):                 # a run older than those shown is found by its id; a name: its newest
        one = cli("--inventory", str(inv), "status", ref, "--json")
        assert one.exit_code == 0, one.output
        doc = json.loads(one.stdout)
        assert doc["run_id"] == (made[0] if ref != "old" else made[-1]), doc
        assert doc["nodes"][0]["run"]["state"] == "exited", doc
