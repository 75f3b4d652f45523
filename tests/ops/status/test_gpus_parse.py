"""Pure parsers and the kill plan, on text shaped like real nvidia-smi and /proc output."""
from dflash_ops.gpus import facts, scripts

PROBE = """@@SELF 900 899 1
@@SELFPG 900 899 1
@@GPUS
0, GPU-aaaa, 2566, 143771, 87
1, GPU-bbbb, 0, 143771, [N/A]
@@APPS
1585, python3, 2566, GPU-aaaa
@@FDS
1585 /dev/nvidia0
1585 /dev/nvidiactl
1601 /dev/nvidia0
777 /dev/nvidiactl
@@PROCS
P\t1585\tNSpid: 1585 12\t0::/lxc/200/ns/user.slice|\tpid:[4026532001]\t1585 (python3) S 1500 1500 1500 0 -1 4194560 1 0 0 0 10 1 0 0 20 0 3 0 424242 1 1
L\t1500\tNSpid: 1500 7
P\t1601\tNSpid: 1601 13\t0::/lxc/200/ns|\tpid:[4026532001]\t1601 (pt_data (worker)) S 1585 1500 1500 0 -1 4194560 1 0 0 0 10 1 0 0 20 0 3 0 424250 1 1
L\t1500\tNSpid: 1500 7
P\t777\tNSpid: 777\t0::/system.slice|\tpid:[4026531836]\t777 (nvidia-persistenced) S 1 777 777 0 -1 4194560 1 0 0 0 10 1 0 0 20 0 3 0 100 1 1
L\t777\tNSpid: 777
@@END
"""


def test_parse_query_gpu_handles_not_available_cells():
    rows = facts.parse_query_gpu("0, GPU-a, 12, 143771, 5\n1, GPU-b, 0, 143771, [N/A]\n")
    assert rows[1] == facts.GpuInfo(index=1, uuid="GPU-b", mem_used_mib=0, mem_total_mib=143771, util_pct=None)


def test_parse_compute_apps_keeps_commas_in_process_names():
    (app,) = facts.parse_compute_apps("42, python3 -c a,b, 1024, GPU-x\n")
    assert (app.pid, app.process_name, app.used_mib, app.gpu_uuid) == (42, "python3 -c a,b", 1024, "GPU-x")


def test_ctid_from_cgroup_pve_and_plain_lxc_and_host():
    assert facts.ctid_from_cgroup("0::/lxc/200/ns/init.scope") == 200
    assert facts.ctid_from_cgroup("12:pids:/lxc.payload.101/x|0::/") == 101
    assert facts.ctid_from_cgroup("0::/system.slice/sshd.service") is None
    assert facts.ctid_from_cgroup("0::/user.slice/lxc-monitor") is None


def test_parse_stat_with_spaces_and_parens_in_comm():
    comm, state, ppid, pgid, start = facts.parse_stat(
        "1601 (pt_data (worker)) S 1585 1500 1500 0 -1 4194560 1 0 0 0 10 1 0 0 20 0 3 0 424250 1 1")
    assert (comm, state, ppid, pgid, start) == ("pt_data (worker)", "S", 1585, 1500, 424250)


def test_find_holders_maps_host_pids_to_container_and_run():
    snap = facts.parse_probe(PROBE)
    by_pid = {h.pid: h for h in facts.find_holders(snap)}
    trainer, worker = by_pid[1585], by_pid[1601]
    assert (trainer.ctid, trainer.ct_pid, trainer.ct_pgid, trainer.used_mib) == (200, 12, 7, 2566)
    assert trainer.gpu_indices == (0,) and trainer.is_compute_app
    assert (worker.ctid, worker.ct_pid, worker.is_compute_app, worker.gpu_indices) == (200, 13, False, (0,))
    assert by_pid[777].gpu_indices == () and by_pid[777].ctid is None


def test_plan_kills_groups_in_scope_and_spares_daemons_and_other_containers():
    snap = facts.parse_probe(PROBE)
    plan = facts.plan_kill(snap, facts.Scope(ctid=200))
    assert [(t.pid, t.pgid) for t in plan.targets] == [(1585, 1500), (1601, 1500)]
    assert [(h.pid, why) for h, why in plan.spared] == [(777, "system process (nvidia-persistenced)")]
    other = facts.plan_kill(snap, facts.Scope(ctid=201))
    why = dict((h.pid, why) for h, why in other.spared)
    assert other.targets == () and why[1585] == "belongs to container 200, not container 201 (use --all-containers)"
    assert len(facts.plan_kill(snap, facts.Scope(ctid=201, all_containers=True)).targets) == 2


def test_plan_signals_pid_alone_when_its_group_holds_our_session():
    probe = PROBE.replace("@@SELFPG 900 899 1", "@@SELFPG 1500 1")
    plan = facts.plan_kill(facts.parse_probe(probe), facts.Scope())
    assert {(t.pid, t.pgid) for t in plan.targets} == {(1585, None), (1601, None)}
    assert facts.parse_probe(probe).self_pgids == (1500, 1)


def test_pid_namespace_maps_holders_when_the_cgroup_names_no_container():
    probe = PROBE.replace("0::/lxc/200/ns", "0::/user.slice").replace("@@FDS", "@@CTNS\n200 pid:[4026532001]\n@@FDS")
    by_pid = {h.pid: h for h in facts.find_holders(facts.parse_probe(probe))}
    assert (by_pid[1585].ctid, by_pid[1585].ct_pid, by_pid[777].ctid) == (200, 12, None)


def test_no_gpu_and_truncated_output():
    snap = facts.parse_probe("@@SELF 5\n@@NOGPU nvidia-smi not found on PATH\n@@FDS\n@@PROCS\n@@END\n")
    assert snap.no_gpu_reason == "nvidia-smi not found on PATH" and snap.gpus == ()
    assert facts.parse_probe(PROBE).no_gpu_reason is None
    try:
        facts.parse_probe("@@SELF 5\n@@GPUS\n0, GPU-a, 1")
    except ValueError as e:
        assert "incomplete" in str(e)
    else:
        raise AssertionError("truncated probe output accepted")


def test_scripts_quote_every_value():
    script = scripts.probe_script(nvidia_smi="/opt/x y/nvidia-smi", dev_glob="/tmp/a'b/nvidia*")
    assert "smi='/opt/x y/nvidia-smi'" in script and """glob='/tmp/a'"'"'b/nvidia*'""" in script
    assert "glob2='/nvidia*'" in scripts.probe_script()     # a CT's bind-mounted node as the host may read it
    kill = scripts.kill_script((facts.KillTarget(pid=10, starttime=99, pgid=None),), grace_s=1.5)
    assert "targets=10:99:0" in kill and "grace_us=1500000" in kill


def test_group_members_without_a_gpu_are_named_and_a_group_holding_sshd_is_not_signalled():
    launcher = "1500 (bash) S 1400 1500 1500 0 -1 4194560 1 0 0 0 10 1 0 0 20 0 3 0 424000 1 1"
    probe = PROBE.replace("@@END", f"@@GROUPS\nM\t{launcher}\n@@END")
    plan = facts.plan_kill(facts.parse_probe(probe), facts.Scope(ctid=200))
    assert [(t.pid, t.pgid) for t in plan.targets] == [(1585, 1500), (1601, 1500)]
    assert plan.bystanders == ((1500, 1500, "bash"),)
    sshd = "1450 (sshd) S 1 1500 1500 0 -1 4194560 1 0 0 0 10 1 0 0 20 0 3 0 400000 1 1"
    guarded = facts.plan_kill(facts.parse_probe(probe.replace("@@END", f"M\t{sshd}\n@@END")), facts.Scope(ctid=200))
    assert [(t.pid, t.pgid) for t in guarded.targets] == [(1585, None), (1601, None)] and guarded.bystanders == ()
