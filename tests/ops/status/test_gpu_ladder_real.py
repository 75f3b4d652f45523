"""The probe and kill scripts against real holder processes, the fake nvidia-smi and fake device nodes:
process groups, the SIGTERM->grace->SIGKILL ladder, and PID mapping across a PID namespace + cgroup `lxc/<ctid>`."""
import os
import subprocess
import sys
import time

import pytest

from support.procfs import is_alive as alive

from dflash_ops.gpus import facts, scripts


def run_bash(script: str) -> str:
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def probe(fake) -> facts.GpuSnapshot:
    return facts.parse_probe(run_bash(scripts.probe_script(nvidia_smi=str(fake.nvidia_smi), dev_glob=fake.dev_glob)))



def test_probe_without_nvidia_smi_says_so(tmp_path):
    snap = facts.parse_probe(run_bash(scripts.probe_script(nvidia_smi=str(tmp_path / "absent"),
                                                           dev_glob=f"{tmp_path}/nvidia*")))
    assert snap.no_gpu_reason == f"{tmp_path / 'absent'} not found" and snap.gpus == () and snap.apps == ()


def test_probe_sees_holders_and_their_memory(fake_gpus, holders):
    parent = holders.start(gpu=3, mib=2048, child="3:4096")
    snap = probe(fake_gpus)
    assert [g.mem_used_mib for g in snap.gpus] == [0, 0, 0, 6144, 0, 0, 0, 0]
    found = {h.pid: h for h in facts.find_holders(snap)}
    child = next(p for p in found if p != parent)
    assert found[parent].used_mib == 2048 and found[child].used_mib == 4096
    assert found[parent].gpu_indices == (3,) and set(found[child].devices) == {fake_gpus.dev("nvidia3"),
                                                                             fake_gpus.dev("nvidiactl")}
    assert found[child].pgid == found[parent].pgid == parent and os.getpid() in snap.self_pids


def test_ladder_kills_group_including_the_child_then_gpus_read_zero(fake_gpus, holders):
    parent = holders.start(gpu=0, mib=2048, child="0:4096")
    plan = facts.plan_kill(probe(fake_gpus), facts.Scope())
    assert {t.pgid for t in plan.targets} == {parent}
    report = scripts.parse_kill_report(run_bash(scripts.kill_script(plan.targets, grace_s=5)))
    assert set(report.died_on_term) == {t.pid for t in plan.targets} and report.alive == ()
    after = probe(fake_gpus)
    assert facts.is_idle(after) and facts.find_holders(after) == ()


def test_ladder_escalates_to_sigkill_after_grace(fake_gpus, holders):
    stubborn = holders.start(gpu=1, mib=1024, ignore_term=True)
    plan = facts.plan_kill(probe(fake_gpus), facts.Scope())
    report = scripts.parse_kill_report(run_bash(scripts.kill_script(plan.targets, grace_s=0.3)))
    assert report.died_on_term == () and report.gone == (stubborn,) and not alive(stubborn)


def test_holder_in_our_process_group_is_killed_alone(fake_gpus, holders):
    mine = holders.start(gpu=2, mib=512, new_session=False)    # shares pytest's group: never signal that group
    plan = facts.plan_kill(probe(fake_gpus), facts.Scope())
    assert [(t.pid, t.pgid) for t in plan.targets] == [(mine, None)]
    scripts.parse_kill_report(run_bash(scripts.kill_script(plan.targets, grace_s=5)))
    assert not alive(mine) and alive(os.getpid())


def test_kill_script_refuses_reused_pid(fake_gpus, holders):
    pid = holders.start(gpu=0, mib=100)
    (target,) = facts.plan_kill(probe(fake_gpus), facts.Scope()).targets
    wrong = facts.KillTarget(pid=target.pid, starttime=target.starttime + 1, pgid=target.pgid)
    report = scripts.parse_kill_report(run_bash(scripts.kill_script((wrong,), grace_s=0.2)))
    assert alive(pid) and report.absent == (pid,) and report.died_on_term == report.gone == ()


def test_container_holders_map_to_ct_pids_and_are_scoped(fake_gpus, holders):
    in_ct = holders.start(gpu=4, mib=3000, child="5:1000", ctid=931)
    on_host = holders.start(gpu=6, mib=700)
    snap = probe(fake_gpus)
    found = {h.pid: h for h in facts.find_holders(snap)}
    assert found[in_ct].ctid == 931 and found[in_ct].ct_pid == 2 and found[on_host].ctid is None
    child = next(h for h in found.values() if h.gpu_indices == (4, 5) or h.used_mib == 1000)
    assert child.ctid == 931 and child.ct_pgid == found[in_ct].ct_pid == 2  # the run's pid file
    plan = facts.plan_kill(snap, facts.Scope(ctid=931))
    assert {t.pid for t in plan.targets} == {in_ct, child.pid}
    scripts.parse_kill_report(run_bash(scripts.kill_script(plan.targets, grace_s=5)))
    after = facts.find_holders(probe(fake_gpus))
    assert [h.pid for h in after] == [on_host] and alive(on_host)


@pytest.mark.ssh
def test_holder_started_through_pct_maps_by_pid_namespace(tmp_path, fake_gpus):
    import shlex
    import sys
    import time

    from conftest import HOLDER, host_pid_of
    from support.container import EmulatedContainer

    with EmulatedContainer(412, tmp_path / "pve") as ct:
        ready = tmp_path / "ct-holder.ready"
        argv = [sys.executable, str(HOLDER), "--hold", fake_gpus.hold(7, 900), "--ready", str(ready),
                "--dev", fake_gpus.dev("nvidia7")]
        ct.pct_exec("bash", "-c", f"setsid {shlex.join(argv)} </dev/null >/dev/null 2>&1 &", check=True)
        deadline = time.monotonic() + 300
        while not ready.exists():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        pid = host_pid_of(ready)
        script = scripts.probe_script(nvidia_smi=str(fake_gpus.nvidia_smi), dev_glob=fake_gpus.dev_glob,
                                      pct=str(ct.pct), ctids=(412, 413))
        snap = facts.parse_probe(run_bash(script))
        (holder,) = facts.find_holders(snap)
        assert (holder.pid, holder.ctid, holder.ct_pid) == (pid, 412, ct.container_pid(pid))
        assert holder.ct_pgid == holder.ct_pid and [c for c, _ in snap.ct_pidns] == [412]


def test_a_holder_named_with_a_newline_hides_no_other_holder(fake_gpus, holders, tmp_path):
    """A process names itself (its comm, which /proc/PID/stat carries) as it likes, newlines included: a holder
    named `x\\n@@END` must not end the probe's section of holders early and hide the holders listed after it."""
    ready = tmp_path / "named.ready"
    code = ("import ctypes, sys, time; ctypes.CDLL(None).prctl(15, b'x\\n@@END', 0, 0, 0); "
            "f = open(sys.argv[1], 'rb'); open(sys.argv[2], 'w').close(); time.sleep(120)")
    named = subprocess.Popen([sys.executable, "-c", code, fake_gpus.dev("nvidia1"), str(ready)],
                             start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not ready.exists():
            assert time.monotonic() < deadline, "the named holder did not start"
            time.sleep(0.01)
        parent = holders.start(gpu=2, mib=1024)
        assert named.pid < parent      # listed first (pids in order), so a forged line would hide the other
        snap = probe(fake_gpus)
        procs = {p.pid: p for p in snap.procs}
        assert parent in procs and named.pid in procs, sorted(procs)
        assert procs[named.pid].comm == "x @@END"
        assert {h.pid for h in facts.find_holders(snap)} >= {parent, named.pid}
    finally:
        named.kill()
        named.wait()
