"""A run's life through the CLI over real SSH into emulated containers: launch, survive, tail, exit code, duplicate
refusal, group stop, `runs` states, tail across sshd restarts, dry run, and the inductor-cache pre-step.

Each test owns one container of the module's bed (ct0: life, ct1: group stop + dry run, ct2: states + tail
reconnect, ct3: inductor cache, then --follow and Ctrl-C, ct4: relative paths after `--`, stop keeps work), so no test sees
another's runs.
"""
from __future__ import annotations

import json
import shlex
import signal
import subprocess

import pytest

from support import procfs, sshclient

from e2e_bed import LineReader, marked_processes, wait_for

pytestmark = pytest.mark.ssh
CONTAINERS = 5


def lines(n: int) -> bytes:
    return b"".join(b"line %d\n" % i for i in range(n))


def one_run(bed, ctid: int, run_id: str) -> dict:
    [run] = [r for r in bed.runs(ctid) if r["run_id"] == run_id]
    return run


def test_launch_survives_the_connection_closing_then_tail_and_exit_code(bed):
    ctid, gate = bed.ct(0), bed.gate("life")
    doc = bed.launch(ctid, "--gate", str(gate), "--lines", "25", "--rc", "3", name="life", real=True)
    assert (doc["state"], doc["matched_line"], doc["ct"]) == ("running", "job started", str(ctid))
    run_id, pid = doc["run_id"], doc["pid"]
    host_pid = bed.container(0).host_pid(pid)
    assert host_pid is not None and procfs.is_alive(host_pid)

    # The launching process has exited (its connection is closed); now drop every connection the server holds.
    bed.tb.sshd.restart()
    assert procfs.is_alive(host_pid)
    assert (one_run(bed, ctid, run_id)["state"], one_run(bed, ctid, run_id)["pid"]) == ("running", pid)

    gate.touch()
    tail = bed.proc("tail", run_id, *bed.target(ctid), "-n", "1000")
    assert tail.returncode == 4, tail.stderr
    assert tail.stdout == b"job started\n" + lines(25)
    assert f"run {run_id} exited 3".encode() in tail.stderr
    assert (bed.tb.runs_dirs[ctid] / run_id / "exit_code").read_bytes() == b"3\n"
    run = one_run(bed, ctid, run_id)
    assert (run["state"], run["state_text"], run["exit_code"]) == ("exited", "exited 3", 3)
    assert not procfs.is_alive(host_pid)


def test_duplicate_is_refused_and_stop_kills_the_whole_group_child_included(bed):
    ctid, ct, child_file = bed.ct(1), bed.container(1), bed.file("grp-child")
    doc = bed.launch(ctid, "--child", str(child_file), "--gate", str(bed.gate("grp")), name="grp")
    run_id = doc["run_id"]
    wait_for(child_file.exists, "the job's child pid")
    child = ct.host_pid(int(child_file.read_text()))
    assert child is not None and procfs.is_alive(child)
    assert sorted(marked_processes(ct, run_id)) == sorted([ct.host_pid(doc["pid"]), child, procfs.ppid(child)])

    dup = bed.cli("launch", "job", *bed.target(ctid), "--name", "grp", "--", "--gate", str(bed.gate("grp")))
    assert dup.returncode == 5, dup.stderr
    assert f"run {run_id} of that name is alive".encode() in dup.stderr
    assert [p.name for p in bed.run_dirs(ctid, "grp")] == [run_id]

    stop = bed.cli("stop", "grp", *bed.target(ctid), "--grace", "10", "--json")
    assert stop.returncode == 0, stop.stderr
    result = json.loads(stop.stdout)
    assert (result["run_id"], result["action"], result["status"]["state"]) == (run_id, "terminated", "killed")
    assert not procfs.is_alive(child)
    assert marked_processes(ct, run_id) == []
    assert (bed.tb.runs_dirs[ctid] / run_id / "stopped").is_file()
    assert one_run(bed, ctid, run_id)["state"] == "killed"

    again = bed.cli("stop", run_id, *bed.target(ctid))
    assert again.returncode == 0 and b"is not running" in again.stdout


def test_dry_run_prints_the_exact_command_and_starts_nothing(bed):
    ctid, sshd = bed.ct(1), bed.tb.sshd
    before = bed.run_dirs(ctid)
    done = bed.proc("launch", "job", *bed.target(ctid), "--name", "dry", "--dry-run", "--", "--lines", "2")
    assert done.returncode == 0, done.stderr
    prefix = f"ssh {sshd.user}@{sshd.host}:{sshd.port}: ".encode()
    assert done.stdout.startswith(prefix) and done.stdout.endswith(b"\n")
    command = done.stdout[len(prefix):-1].decode()
    argv = shlex.split(command)
    assert argv[:4] == [str(bed.tb.pct), "exec", str(ctid), "--"]
    assert argv[4:6] == ["env", "-i"] and argv[-3:-1] == ["bash", "-c"]
    assert bed.run_dirs(ctid) == before

    # "Exact": sent as it stands over a plain SSH connection, it launches the very run the dry run named.
    run_id = done.stderr.decode().split("would launch ", 1)[1].split(" ", 1)[0]
    client = sshclient.connect(sshd)
    try:
        result = sshclient.run(client, command)
    finally:
        client.close()
    assert result.exit_code == 0, result
    assert b"DFLASH_LAUNCHED " in result.stdout
    wait_for((bed.tb.runs_dirs[ctid] / run_id / "exit_code").exists, "the hand-sent run to finish")
    assert (bed.tb.runs_dirs[ctid] / run_id / "output.log").read_bytes() == b"job started\n" + lines(2)
    assert one_run(bed, ctid, run_id)["state_text"] == "exited 0"


def test_runs_json_over_ssh_shows_running_exited_and_killed(bed):
    ctid = bed.ct(2)
    alive = bed.launch(ctid, "--gate", str(bed.gate("never")), name="alive")
    exits = bed.launch(ctid, "--gate", str(bed.gate("ex")), "--rc", "7", name="exits")
    killed = bed.launch(ctid, "--gate", str(bed.gate("never")), name="killed")
    bed.gate("ex").touch()
    wait_for((bed.tb.runs_dirs[ctid] / exits["run_id"] / "exit_code").exists, "run `exits` to end")
    assert bed.cli("stop", "killed", *bed.target(ctid), "--grace", "5").returncode == 0

    states = {r["run_id"]: r["state_text"] for r in bed.runs(ctid)}
    assert states == {alive["run_id"]: "running", exits["run_id"]: "exited 7", killed["run_id"]: "killed (143)"}
    table = bed.cli("runs", *bed.target(ctid))
    assert table.returncode == 0
    for run, state in ((alive, "running"), (exits, "exited 7"), (killed, "killed (143)")):
        [row] = [line for line in table.stdout.decode().splitlines() if run["run_id"] in line]
        assert f" {state} " in row
    assert bed.cli("stop", alive["run_id"], *bed.target(ctid), "--grace", "5").returncode == 0


def test_tail_reconnects_after_sshd_restarts_and_loses_nothing(bed):
    ctid, gate = bed.ct(2), bed.gate("slow")
    doc = bed.launch(ctid, "--gate", str(gate), "--lines", "80", "--every", "0.02", name="slow")
    proc = subprocess.Popen(bed.argv("tail", doc["run_id"], *bed.target(ctid), "-n", "1000"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=bed.env(), cwd=bed.work)
    try:
        reader = LineReader(proc)
        reader.until(b"job started\n")
        bed.tb.sshd.restart()       # while tail waits on a silent run
        gate.touch()
        reader.until(b"line 10\n")
        bed.tb.sshd.restart()       # while lines are flowing
        assert proc.wait(timeout=120) == 0
        out = reader.rest()
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert out == b"job started\n" + lines(80)
    assert b"reconnecting" in err and f"run {doc['run_id']} exited 0".encode() in err


def test_tail_human_view_across_sshd_restarts_shows_every_human_line_once(bed):
    ctid, gate = bed.ct(2), bed.gate("view")
    doc = bed.launch(ctid, "--gate", str(gate), "--metrics", "60", "--every", "0.02", name="view")
    proc = subprocess.Popen(bed.argv("tail", doc["run_id"], *bed.target(ctid), "-n", "1000"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=bed.env(), cwd=bed.work)
    try:
        reader = LineReader(proc)
        reader.until(b"job started\n")
        bed.tb.sshd.restart()       # while tail waits on a silent run
        gate.touch()
        reader.until(b"step 10 loss 3.0\n")
        bed.tb.sshd.restart()       # while lines are flowing
        assert proc.wait(timeout=120) == 0
        out = reader.rest()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert out == b"job started\n" + b"".join(b"step %d loss %.1f\n" % (i, 4 - i / 10) for i in range(1, 61))
    log = (bed.tb.runs_dirs[ctid] / doc["run_id"] / "output.log").read_bytes()
    assert log.count(b"DFLASH_METRICS {") == 60
    assert bed.proc("tail", doc["run_id"], *bed.target(ctid), "-n", "1000", "--raw").stdout == log


def test_inductor_cache_is_cleared_in_the_container_and_refused_while_a_run_is_alive(bed):
    ctid, cache = bed.ct(3), bed.cache_dir
    (cache / "triton").mkdir(parents=True)
    (cache / "triton" / "kernel.so").write_bytes(b"old kernel")
    first = bed.launch(ctid, "--gate", str(bed.gate("never")), name="cache1", runbook="cachejob")
    assert not cache.exists()

    cache.mkdir()
    (cache / "kernel.so").write_bytes(b"in use")
    refused = bed.cli("launch", "cachejob", *bed.target(ctid), "--name", "cache2")
    assert refused.returncode == 5, refused.stderr
    assert f"not clearing the inductor cache: run {first['run_id']} is alive".encode() in refused.stderr
    assert (cache / "kernel.so").read_bytes() == b"in use"
    assert bed.run_dirs(ctid, "cache2") == []

    assert bed.cli("stop", "cache1", *bed.target(ctid), "--grace", "5").returncode == 0
    bed.launch(ctid, "--lines", "1", name="cache2", runbook="cachejob")
    assert not cache.exists()


def test_launch_follow_streams_to_the_end_and_ctrl_c_on_tail_leaves_the_run_alone(bed):
    ctid, gate = bed.ct(3), bed.gate("follow")
    launched = subprocess.run(bed.argv("launch", "job", *bed.target(ctid), "--name", "follow", "--follow", "--",
                                       "--lines", "5"), capture_output=True, env=bed.env(), cwd=bed.work, timeout=90)
    assert launched.returncode == 0, launched.stderr
    # the start-up shows while the run is proven alive (before the launch's summary), then tail goes on from there
    shown = b"".join(ln for ln in launched.stdout.splitlines(keepends=True)
                     if ln.startswith((b"job started", b"line ")))
    assert shown == b"job started\n" + lines(5)
    assert launched.stdout.index(b"job started") < launched.stdout.index(b"launched ")

    doc = bed.launch(ctid, "--gate", str(gate), name="ctrlc")
    proc = subprocess.Popen(bed.argv("tail", "ctrlc", *bed.target(ctid)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=bed.env(), cwd=bed.work,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        LineReader(proc).until(b"job started\n")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=300) == 130
        assert f"stopped tailing; run {doc['run_id']} goes on".encode() in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert one_run(bed, ctid, doc["run_id"])["state"] == "running"
    gate.touch()
    wait_for((bed.tb.runs_dirs[ctid] / doc["run_id"] / "exit_code").exists, "the run to end after the gate opens")
    assert one_run(bed, ctid, doc["run_id"])["state_text"] == "exited 0"


def test_a_relative_path_after_dashes_is_said_to_be_relative_to_the_run_dir_there(bed):
    """In a container the job runs in its run dir: a failed launch whose arguments after `--` hold a relative path
    says what that path is relative to."""
    ctid = bed.ct(4)
    (bed.runbooks / "diesjob.yaml").write_text(f'command: ["{{python}}", "{bed.job}"]\n'
                                               'liveness: {wait_s: 0.2, pattern: "never printed", timeout_s: 60}\n')
    done = bed.cli("launch", "diesjob", *bed.target(ctid), "--name", "rel", "--", "--argv", "data/argv.bin",
                   "--rc", "2")
    assert done.returncode == 4, done.stderr
    [run_dir] = bed.run_dirs(ctid, "rel")
    hint = [line for line in done.stderr.decode().splitlines() if line.startswith("hint: ")]
    assert hint == [f"hint: log: {run_dir}/output.log; 'data/argv.bin' and every relative path after `--` is "
                    f"relative to the job's working directory, {run_dir} on {bed.tb.host}/ct{ctid}"], done.stderr


def test_stop_in_a_container_waits_for_the_checkpoint_and_stop_now_does_not(bed, monkeypatch, tmp_path):
    """The job takes 12 s after SIGTERM to write its checkpoint (well inside the 120 s default grace): `stop` waits for it,
    and `runs` and `status` read the run `stopped at step 7`; `stop --now` SIGKILLs a second one at once."""
    ctid, root = bed.ct(4), bed.tb.runs_dirs[bed.ct(4)]
    saver = bed.launch(ctid, "--slow-term", "12", "--gate", str(bed.gate("saver")), name="saver")
    quick = bed.launch(ctid, "--slow-term", "60", "--gate", str(bed.gate("quick")), name="quick")
    stopped = bed.proc("stop", "saver", *bed.target(ctid), "--json", timeout=240)
    assert stopped.returncode == 0, stopped.stderr
    assert json.loads(stopped.stdout)["status"]["state_text"] == "stopped at step 7"
    assert (root / saver["run_id"] / "ckpt" / "step_7" / "state").read_bytes() == b"weights at step 7\n"
    assert one_run(bed, ctid, saver["run_id"])["state_text"] == "stopped at step 7"
    monkeypatch.setenv("DFLASH_OPS_NVIDIA_SMI", str(tmp_path / "no-nvidia-smi"))
    status = json.loads(bed.cli("status", *bed.target(ctid), "--json").stdout)
    [row] = [r for t in status["hosts"][0]["targets"] for r in t["runs"] if r["run_id"] == saver["run_id"]]
    assert (row["state"], row["state_text"]) == ("stopped", "stopped at step 7")
    now = bed.proc("stop", "quick", *bed.target(ctid), "--now", timeout=120)
    assert now.returncode == 0, now.stderr
    assert now.stdout.decode() == f"stopped {quick['run_id']} with SIGKILL at once (--now); state: killed\n"
    assert not (root / quick["run_id"] / "ckpt").exists()
    assert marked_processes(bed.container(4), quick["run_id"]) == []
