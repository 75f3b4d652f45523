"""GPU facts and GPU holders: pure builders and parsers (no SSH, no subprocess).

One remote bash script (`scripts.probe_script`) runs on the machine that owns the GPUs -- the Proxmox host, never a
container, because a container may not see host PIDs. It prints sections:

    @@SELF <pid> <pid> ...          the probe's own shell and its ancestors (never killed)
    @@NOGPU <reason>                 no usable nvidia-smi (this machine, CI)
    @@GPUS / @@APPS                  nvidia-smi --query-gpu / --query-compute-apps CSV (noheader, nounits)
    @@FDS                            "<pid> <link target>" for every fd pointing at an nvidia device node
    @@CTNS                           "<ctid> pid:[<inode>]" per container asked about (its PID namespace)
    @@PROCS                          "P\t<pid>\t<NSpid line>\t<cgroup lines joined by |>\t<pid ns>\t<stat>"
                                     "L\t<pgid>\t<NSpid line of the group leader>" per candidate's group
    @@GROUPS                         "M\t<stat>" for every other process in a candidate's process group
    @@END

`parse_probe` turns that into a `GpuSnapshot`; `find_holders` joins it into `Holder`s, mapped to containers by
cgroup (`lxc/<ctid>`, PVE) or else by PID namespace (the inode `pct exec CT -- readlink /proc/self/ns/pid` shows is
the one the host sees), and to container PIDs by `NSpid`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from dflash_ops import names

GPU_QUERY = "--query-gpu=index,uuid,memory.used,memory.total,utilization.gpu"
APPS_QUERY = "--query-compute-apps=pid,process_name,used_memory,gpu_uuid"
CSV_FORMAT = "--format=csv,noheader,nounits"
DEFAULT_DEV_GLOB = "/dev/nvidia*"

# Daemons that keep /dev/nvidia* open without being anyone's job; killing them breaks the host, not a run.
SYSTEM_COMMS = frozenset({"nvidia-persistenced", "nv-fabricmanager", "nvidia-smi", "nv-hostengine", "dcgm-exporter",
                          "sshd", "systemd", "init"})

# PVE: lxc.cgroup.dir.container = lxc/<vmid> (+ "/ns"); plain LXC: lxc.payload.<vmid>.
_CT_CGROUP = re.compile(r"/lxc(?:\.payload)?[./](\d+)(?:/|\||$)")
_DEV_GPU = re.compile(r"/nvidia(\d+)$")


@dataclass(frozen=True)
class GpuInfo:
    index: int
    uuid: str
    mem_used_mib: int
    mem_total_mib: int
    util_pct: int | None


@dataclass(frozen=True)
class ComputeApp:
    pid: int                      # PID in the namespace nvidia-smi ran in (the host's, by design)
    process_name: str
    used_mib: int | None          # None when the driver says [N/A]
    gpu_uuid: str


@dataclass(frozen=True)
class ProcInfo:
    pid: int
    comm: str
    state: str                    # one letter from /proc/PID/stat; "Z" is a zombie (holds nothing)
    ppid: int
    pgid: int
    starttime: int                # clock ticks since boot: with pid, identifies the process (PID-reuse guard)
    nspid: tuple[int, ...]        # host PID first, innermost namespace PID last
    ctid: int | None              # container by cgroup, None if the cgroup names none
    pidns: str = ""               # "pid:[4026532345]"


@dataclass(frozen=True)
class GpuSnapshot:
    gpus: tuple[GpuInfo, ...] = ()
    apps: tuple[ComputeApp, ...] = ()
    fds: tuple[tuple[int, str], ...] = ()            # (pid, device path)
    procs: tuple[ProcInfo, ...] = ()
    leaders: tuple[tuple[int, tuple[int, ...]], ...] = ()   # (pgid, NSpid of the group leader)
    self_pids: tuple[int, ...] = ()
    self_pgids: tuple[int, ...] = ()
    ct_pidns: tuple[tuple[int, str], ...] = ()      # (ctid, its PID namespace) for the containers asked about
    members: tuple[ProcInfo, ...] = ()    # the other processes of the candidates' process groups (stat facts only)
    no_gpu_reason: str | None = None

    def proc(self, pid: int) -> ProcInfo | None:
        return next((p for p in self.procs if p.pid == pid), None)

    def leader_nspid(self, pgid: int) -> tuple[int, ...]:
        return next((ns for g, ns in self.leaders if g == pgid), ())


@dataclass(frozen=True)
class Holder:
    """One process holding GPUs: a compute app, or a process with an nvidia device node open."""
    pid: int
    comm: str
    gpu_indices: tuple[int, ...]   # empty when it holds only control nodes (nvidiactl, nvidia-uvm)
    used_mib: int                  # from compute apps; 0 for fd-only holders
    is_compute_app: bool
    pgid: int
    starttime: int
    ctid: int | None
    # PIDs as the container sees them (NSpid's second entry: `pct exec` runs there, also when the process sits in a
    # namespace nested inside the container, e.g. a Docker container in the LXC); None on the host
    ct_pid: int | None
    ct_pgid: int | None = None     # the group leader's: the run's `pid` file
    devices: tuple[str, ...] = field(default=())


# --------------------------------------------------------------------------- parsing

def _int_or_none(text: str) -> int | None:
    text = text.strip()
    try:
        return int(float(text))
    except ValueError:
        return None       # "[N/A]", "[Not Supported]"


def parse_query_gpu(text: str) -> tuple[GpuInfo, ...]:
    """Rows of `nvidia-smi --query-gpu=index,uuid,memory.used,memory.total,utilization.gpu` (csv,noheader,nounits)."""
    gpus = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) < 4 or _int_or_none(cells[0]) is None:
            continue
        gpus.append(GpuInfo(index=int(cells[0]), uuid=cells[1], mem_used_mib=_int_or_none(cells[2]) or 0,
                            mem_total_mib=_int_or_none(cells[3]) or 0,
                            util_pct=_int_or_none(cells[4]) if len(cells) > 4 else None))
    return tuple(gpus)


def parse_compute_apps(text: str) -> tuple[ComputeApp, ...]:
    """Rows of `--query-compute-apps=pid,process_name,used_memory,gpu_uuid`; names may contain commas."""
    apps = []
    for line in text.splitlines():
        head, _, rest = line.partition(",")
        if _int_or_none(head) is None or not rest:
            continue
        name_and_mem, _, uuid = rest.rpartition(",")
        name, _, mem = name_and_mem.rpartition(",")
        apps.append(ComputeApp(pid=int(head), process_name=name.strip(), used_mib=_int_or_none(mem),
                               gpu_uuid=uuid.strip()))
    return tuple(apps)


def parse_nspid(line: str) -> tuple[int, ...]:
    """`NSpid:\t1590\t1` -> (1590, 1); empty for kernels without NSpid."""
    _, _, values = line.partition(":")
    return tuple(int(v) for v in values.split() if names.is_digits(v))


def ctid_from_cgroup(cgroup: str) -> int | None:
    """Container id from /proc/PID/cgroup text (`0::/lxc/200/ns/...` on PVE), None outside containers."""
    match = _CT_CGROUP.search(cgroup)
    return int(match.group(1)) if match else None


def parse_stat(stat: str) -> tuple[str, str, int, int, int]:
    """/proc/PID/stat -> (comm, state, ppid, pgid, starttime). comm may hold spaces and parens."""
    comm = stat[stat.find("(") + 1:stat.rfind(")")]
    rest = stat[stat.rfind(")") + 2:].split()   # rest[0] is field 3 (state)
    return comm, rest[0], int(rest[1]), int(rest[2]), int(rest[19])


def _parse_proc_row(cells: list[str]) -> ProcInfo | None:
    if len(cells) < 5 or not names.is_digits(cells[1]):
        return None
    try:
        comm, state, ppid, pgid, start = parse_stat(cells[5])
    except (IndexError, ValueError):
        return None
    return ProcInfo(pid=int(cells[1]), comm=comm, state=state, ppid=ppid, pgid=pgid, starttime=start,
                    nspid=parse_nspid(cells[2]), ctid=ctid_from_cgroup(cells[3]), pidns=cells[4].strip())


def _split_sections(text: str) -> dict[str, list[str]]:
    sections: dict[str, list[str]] = {}
    current = None
    for line in text.split("\n"):      # newlines only: a comm may hold any other line break
        if line.startswith("@@"):
            name, _, arg = line[2:].partition(" ")
            current = name
            sections.setdefault(name, [])
            if arg:
                sections[name].append(arg)
        elif current is not None:
            sections[current].append(line)
    return sections


def _ints(lines: list[str]) -> tuple[int, ...]:
    return tuple(int(p) for p in " ".join(lines).split() if names.is_digits(p))


def parse_probe(text: str) -> GpuSnapshot:
    """Output of `probe_script` -> GpuSnapshot. Raises ValueError when the script did not finish (no @@END)."""
    sec = _split_sections(text)
    if "END" not in sec:
        raise ValueError("GPU probe output is incomplete (no @@END marker)")
    procs, leaders = [], []
    for line in sec.get("PROCS", []):
        cells = line.split("\t", 5)   # stat last: a comm may hold a tab
        if cells[0] == "P" and (proc := _parse_proc_row(cells)):
            procs.append(proc)
        elif cells[0] == "L" and len(cells) >= 3 and names.is_digits(cells[1]):
            leaders.append((int(cells[1]), parse_nspid(cells[2])))
    ct_pidns = []
    for line in sec.get("CTNS", []):
        ctid, _, ns = line.partition(" ")
        if names.is_digits(ctid) and ns.startswith("pid:["):
            ct_pidns.append((int(ctid), ns.strip()))
    fds = []
    for line in sec.get("FDS", []):
        pid, _, dev = line.partition(" ")
        if names.is_digits(pid):
            fds.append((int(pid), dev.strip()))
    members = []
    for line in sec.get("GROUPS", []):
        tag, _, stat = line.partition("\t")
        pid = stat.split(" ", 1)[0]
        if tag != "M" or not names.is_digits(pid):
            continue
        try:
            comm, state, ppid, pgid, start = parse_stat(stat)
        except (IndexError, ValueError):
            continue
        members.append(ProcInfo(pid=int(pid), comm=comm, state=state, ppid=ppid, pgid=pgid, starttime=start,
                                nspid=(), ctid=None))
    reason = (" ".join(sec["NOGPU"]).strip() or "nvidia-smi failed") if "NOGPU" in sec else None
    return GpuSnapshot(
        gpus=parse_query_gpu("\n".join(sec.get("GPUS", []))),
        apps=parse_compute_apps("\n".join(sec.get("APPS", []))),
        fds=tuple(fds), procs=tuple(procs), leaders=tuple(leaders), ct_pidns=tuple(ct_pidns), members=tuple(members),
        self_pids=_ints(sec.get("SELF", [])), self_pgids=_ints(sec.get("SELFPG", [])),
        no_gpu_reason=reason)


# --------------------------------------------------------------------------- holders

def find_holders(snap: GpuSnapshot) -> tuple[Holder, ...]:
    """Join compute apps and device fds into one Holder per live process, sorted by pid."""
    by_uuid = {g.uuid: g.index for g in snap.gpus}
    pids = sorted({a.pid for a in snap.apps} | {pid for pid, _ in snap.fds})
    ct_by_ns = {ns: ctid for ctid, ns in snap.ct_pidns}
    holders = []
    for pid in pids:
        proc = snap.proc(pid)
        if proc is None or proc.state == "Z":
            continue            # gone since nvidia-smi listed it, or a zombie: holds nothing
        apps = [a for a in snap.apps if a.pid == pid]
        devices = tuple(sorted({d for p, d in snap.fds if p == pid}))
        indices = {by_uuid[a.gpu_uuid] for a in apps if a.gpu_uuid in by_uuid}
        indices |= {int(m.group(1)) for d in devices if (m := _DEV_GPU.search(d))}
        leader = snap.leader_nspid(proc.pgid)
        ctid = proc.ctid if proc.ctid is not None else ct_by_ns.get(proc.pidns)
        in_ct = ctid is not None and len(proc.nspid) > 1
        holders.append(Holder(
            pid=pid, comm=proc.comm, gpu_indices=tuple(sorted(indices)),
            used_mib=sum(a.used_mib or 0 for a in apps), is_compute_app=bool(apps),
            pgid=proc.pgid, starttime=proc.starttime, ctid=ctid,
            ct_pid=proc.nspid[1] if in_ct else None,
            ct_pgid=leader[1] if in_ct and len(leader) > 1 else None, devices=devices))
    return tuple(holders)


def is_idle(snap: GpuSnapshot, *, threshold_mib: int = 0) -> bool:
    """No compute app left and memory.used <= threshold on every GPU (H200 idles at exactly 0 MiB)."""
    return not snap.apps and all(g.mem_used_mib <= threshold_mib for g in snap.gpus)


# --------------------------------------------------------------------------- what to kill

@dataclass(frozen=True)
class Scope:
    """Which holders a reset may touch. On a plain host (local, SSH) every holder is in scope."""
    ctid: int | None = None
    all_containers: bool = False

    def covers(self, holder: Holder) -> bool:
        return self.all_containers or self.ctid is None or holder.ctid == self.ctid

    def describe(self) -> str:
        return "all containers" if self.all_containers or self.ctid is None else f"container {self.ctid}"


@dataclass(frozen=True)
class KillTarget:
    pid: int
    starttime: int                 # the kill script re-checks it: a reused PID is never signalled
    pgid: int | None               # signal this group; None: the pid alone (its group holds something we keep)


@dataclass(frozen=True)
class KillPlan:
    targets: tuple[KillTarget, ...]
    spared: tuple[tuple[Holder, str], ...]      # (holder, why it is not killed)
    # Processes holding no GPU that a target's group signal reaches too (the job's launcher, its shells, its other
    # children), as (pgid, pid, comm): shown before anything is signalled.
    bystanders: tuple[tuple[int, int, str], ...] = ()


def _spare_reason(h: Holder, snap: GpuSnapshot, scope: Scope) -> str | None:
    if h.pid in snap.self_pids:
        return "our own session"
    if h.pid == 1:
        return "the host's init"
    if h.comm in SYSTEM_COMMS:
        return f"system process ({h.comm})"
    proc = snap.proc(h.pid)
    if proc and proc.nspid and proc.nspid[-1] == 1 and not h.is_compute_app:
        return "init of its PID namespace, holds no GPU memory"
    if not scope.covers(h):
        if h.ctid is not None:
            where = f"container {h.ctid}"
        elif proc and len(proc.nspid) > 1:
            where = "another PID namespace (a container not in the inventory?)"
        else:
            where = "the host, outside any container"
        return f"belongs to {where}, not {scope.describe()} (use --all-containers)"
    return None


def plan_kill(snap: GpuSnapshot, scope: Scope) -> KillPlan:
    """Decide, per holder, whether to signal its process group, the pid alone, or nothing.

    A group is signalled only when no process we must keep (our session, system daemons, a namespace's init,
    spared holders) is in it; otherwise the holder's pid alone is signalled. The group's other members, which hold
    no GPU, are the plan's bystanders.
    """
    targets, spared = [], []
    holders = find_holders(snap)
    keep_groups = {p.pgid for p in (*snap.procs, *snap.members)
                   if p.comm in SYSTEM_COMMS or p.pid == 1 or p.pid in snap.self_pids}
    keep_groups |= {0, 1} | set(snap.self_pids) | set(snap.self_pgids)
    decided = [(h, _spare_reason(h, snap, scope)) for h in holders]
    keep_groups |= {h.pgid for h, why in decided if why}
    for h, why in decided:
        if why:
            spared.append((h, why))
        else:
            targets.append(KillTarget(pid=h.pid, starttime=h.starttime,
                                      pgid=None if h.pgid in keep_groups else h.pgid))
    signalled = {t.pgid for t in targets if t.pgid is not None}
    bystanders = tuple((m.pgid, m.pid, m.comm) for m in sorted(snap.members, key=lambda m: (m.pgid, m.pid))
                       if m.pgid in signalled and m.state != "Z")
    return KillPlan(targets=tuple(targets), spared=tuple(spared), bystanders=bystanders)
