"""`status` for one host: one script, one round trip, every container of the host covered.

PURE builder and parser, plus `query_host` (the only effect: one `transport.run`). The host script runs, in
parallel and each under `timeout`, the GPU probe (gpus.scripts.probe_script, on the host itself) and one runs
listing per target (through `pct exec` for a container), then prints their outputs as sections:

    %%DFLASH gpu <rc>                    then the probe's output
    %%DFLASH target <i> <rc>             then target i's listing: read_scripts.list_script, then ours:
        DFLASH_PIDNS pid:[inode]         the target's PID namespace (maps GPU holders when cgroups do not)
        DFLASH_MLINES <run id>           then "M <log line>" for the last metrics/progress/done lines of its log
                                         (the live runs and the FINISHED_SHOWN newest others: those shown)
    %%DFLASH err <i>                     then the last bytes of target i's stderr

One SSH connection per host is what bounds an unreachable host to one connect timeout, not one per container.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass, replace

from dflash_ops import metrics_line, names, wire
from dflash_ops.errors import RemoteFailed
from dflash_ops.gpus import facts, scripts
from dflash_ops.runs import parse, read_scripts, shellcmd
from dflash_ops.spec import PROXMOX, RUNNING, Container, Host, RunStatus, Target

SECTION = wire.SECTION
PART_TIMEOUT_S = 15
LOG_WINDOW_BYTES = 65536
# Finished runs shown per target, the newest; the others are counted (`runs` lists them all, `runs --prune`
# removes them), so a runs dir of thousands of finished runs costs status no process per run.
FINISHED_SHOWN = 10


@dataclass(frozen=True)
class RunRow:
    status: RunStatus
    metrics: metrics_line.Metrics | metrics_line.Progress | None   # training's, or another job's progress
    gpu_indices: tuple[int, ...] = ()        # GPUs its process group holds right now


@dataclass(frozen=True)
class TargetStatus:
    label: str
    ct: str | None
    runs: tuple[RunRow, ...] = ()
    error: str | None = None                 # the container did not answer (stopped, unknown, timed out)
    finished_hidden: int = 0                 # finished runs older than the FINISHED_SHOWN newest: not in `runs`


@dataclass(frozen=True)
class HostStatus:
    host: str
    transport: str
    snapshot: facts.GpuSnapshot | None
    holders: tuple[facts.Holder, ...]
    holder_runs: tuple[tuple[int, str], ...]  # (holder host pid, run id)
    targets: tuple[TargetStatus, ...]
    gpu_error: str | None = None


def targets_of(host: Host, ct: str | None = None) -> list[Target]:
    """The targets `status` covers on `host`: the host itself, or its containers (all listed ones, or `ct`)."""
    if host.transport != PROXMOX:
        return [Target(host)]
    if ct is not None:
        return [Target(host, host.container(ct) or Container(ctid=ct))]
    return [Target(host, c) for c in host.containers]


def target_script(runs_dir: str, also: str | None = None) -> str:
    """Runs listing (read_scripts.list_script, the live runs and the FINISHED_SHOWN newest others) plus the PID
    namespace and the last metrics lines of the runs it lists; `also`: a run id listed however old (`status RUN`)."""
    q = shlex.quote
    return (read_scripts.list_script(runs_dir, newest=FINISHED_SHOWN, also=also) +
            f"printf '{wire.PIDNS} %s\\n' \"$(readlink /proc/self/ns/pid 2>/dev/null)\"\n"
            'for d in ${shown[@]+"${shown[@]}"}; do\n'
            + read_scripts.RUN_DIR_ONLY +
            '  id=${d##*/}\n'
            f"  printf '{wire.MLINES} %s\\n' \"$id\"\n"
            f'  tail -c {LOG_WINDOW_BYTES} -- "$d/output.log" 2>/dev/null'
            f" | grep -a -e {q(metrics_line.GREP_PATTERN)} | tail -n 2 | sed 's/^/M /'\n"
            "done\n")


def host_script(targets: list[Target], gpu: facts.GpuSettings, *, part_timeout_s: int = PART_TIMEOUT_S,
                also: str | None = None) -> str:
    """The one script sent to a host (see module docstring); `also`: a run id listed whether or not it is shown."""
    q = shlex.quote
    lim = f"timeout -k 2 {int(part_timeout_s)}"
    lines = ['tmp=$(mktemp -d) || exit 1', "trap 'rm -rf -- \"$tmp\"' EXIT",
             f"{{ {lim} bash -c {q(scripts.probe_script(nvidia_smi=gpu.nvidia_smi, dev_glob=gpu.dev_glob))}"
             ' >"$tmp/gpu" 2>/dev/null; echo $? >"$tmp/gpu.rc"; } &']
    for i, t in enumerate(targets):
        argv = shellcmd.target_argv(t, target_script(t.runs_dir, also))
        lines.append(f'{{ {lim} {shlex.join(argv)} >"$tmp/{i}" 2>"$tmp/{i}.err"; echo $? >"$tmp/{i}.rc"; }} &')
    lines += ["wait",
              f'echo "{SECTION}gpu $(cat "$tmp/gpu.rc")"; cat "$tmp/gpu"',
              f'for i in {" ".join(str(i) for i in range(len(targets)))}; do',
              f'  echo "{SECTION}target $i $(cat "$tmp/$i.rc")"; cat "$tmp/$i"',
              f'  echo "{SECTION}err $i"; tail -c 1000 "$tmp/$i.err"',
              "done"]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- parsing

def _sections(text: str) -> list[tuple[list[str], list[str]]]:
    out: list[tuple[list[str], list[str]]] = []
    for line in text.split("\n"):    # only a newline ends a line: a log line may hold any other line break
        if line.startswith(SECTION):
            out.append((line[len(SECTION):].split(), []))
        elif out:
            out[-1][1].append(line)
    return out


def _rc_text(rc: int, part_timeout_s: int) -> str:
    return f"timed out after {part_timeout_s} s" if rc in wire.EXIT_TIMED_OUT else f"exit code {rc}"


def _target_runs(body: list[str], runs_dir: str) -> tuple[list[RunStatus], dict, str, int]:
    listing, mlines, pidns, current = [], {}, "", None
    for line in body:
        if line.startswith(wire.PIDNS + " "):
            pidns = line.split(" ", 1)[1].strip()
        elif line.startswith(wire.MLINES + " "):
            current = line.split(" ", 1)[1].strip()
            mlines[current] = []
        elif line.startswith("M ") and current is not None:
            mlines[current].append(line[2:])
        elif current is None:
            listing.append(line)
    runs = parse.run_list("\n".join(listing), runs_dir)
    metrics = {rid: m for rid, lines in mlines.items() if (m := metrics_line.latest(lines)) is not None}
    return runs, metrics, pidns, parse.older_count("\n".join(listing))


def parse_host(text: str, host: Host, targets: list[Target], *,
               part_timeout_s: int = PART_TIMEOUT_S, also: str | None = None) -> HostStatus:
    """Output of `host_script` -> HostStatus, with GPU holders joined to the runs whose process group they are in."""
    snap, gpu_error = None, "no GPU section in the host's answer"
    per_target: dict[int, tuple[list[RunStatus], dict, str, int]] = {}
    errors: dict[int, str] = {}
    rcs: dict[int, int] = {}
    for head, body in _sections(text):
        if head[0] == "gpu":
            rc = int(head[1]) if len(head) > 1 and names.is_digits(head[1]) else -1
            try:
                snap, gpu_error = facts.parse_probe("\n".join(body)), None
            except ValueError as exc:
                gpu_error = f"GPU probe failed ({_rc_text(rc, part_timeout_s)}): {exc}"
        elif head[0] == "target" and len(head) == 3:
            i, rc = int(head[1]), int(head[2]) if names.is_digits(head[2]) else -1
            rcs[i] = rc
            if rc == 0:
                try:
                    per_target[i] = _target_runs(body, targets[i].runs_dir)
                except RemoteFailed as exc:
                    errors[i] = exc.message
        elif head[0] == "err" and len(head) == 2:
            i = int(head[1])
            if rcs.get(i, 0) != 0:
                last = (body[-1].strip() if body else "") or "(no message)"
                errors[i] = f"{_rc_text(rcs[i], part_timeout_s)}: {last}"
    if snap is not None:
        ct_ns = tuple((int(t.container.ctid), per_target[i][2]) for i, t in enumerate(targets)
                      if t.container is not None and i in per_target and per_target[i][2].startswith("pid:["))
        snap = replace(snap, ct_pidns=snap.ct_pidns + ct_ns)
    holders = facts.find_holders(snap) if snap is not None else ()
    statuses, holder_runs = _join(targets, per_target, errors, holders, also)
    return HostStatus(host=host.name, transport=host.transport, snapshot=snap, holders=holders,
                      holder_runs=holder_runs, targets=statuses, gpu_error=gpu_error)


def _run_key(h: facts.Holder) -> tuple[str | None, int | None]:
    """(container, the holder's process-group id as the run's `pid` file has it)."""
    if h.ctid is not None:
        return str(h.ctid), h.ct_pgid
    return None, h.pgid


def shown_runs(runs: list[RunStatus], keep: int = FINISHED_SHOWN,
               also: str | None = None) -> tuple[list[RunStatus], int]:
    """PURE: the runs `status` shows (oldest first): every one alive (running, leftovers, run dir gone), the
    newest `keep` finished, and the runs of `also` (a run id or name); and how many finished runs it leaves out."""
    from dflash_ops.runs.prune import finished

    done = [r for r in runs if finished(r) and also not in (r.run_id, r.name)]
    hidden = {r.run_id for r in done[:max(0, len(done) - keep)]}
    return [r for r in runs if r.run_id not in hidden], len(hidden)


def _join(targets, per_target, errors, holders, also=None):
    by_key = {_run_key(h): [] for h in holders}
    for h in holders:
        by_key[_run_key(h)].append(h)
    statuses, holder_runs = [], []
    for i, t in enumerate(targets):
        ct = t.container.ctid if t.container is not None else None
        if i not in per_target:
            statuses.append(TargetStatus(label=t.label, ct=ct, error=errors.get(i, "no answer")))
            continue
        runs, metrics, _, older = per_target[i]
        runs, hidden = shown_runs(runs, also=also)
        hidden += older
        rows = []
        for r in runs:
            held = by_key.get((ct, r.pid), []) if r.state == RUNNING and r.pid else []
            holder_runs += [(h.pid, r.run_id) for h in held]
            rows.append(RunRow(status=r, metrics=metrics.get(r.run_id),
                               gpu_indices=tuple(sorted({g for h in held for g in h.gpu_indices}))))
        statuses.append(TargetStatus(label=t.label, ct=ct, runs=tuple(rows), finished_hidden=hidden))
    return tuple(statuses), tuple(holder_runs)


# --------------------------------------------------------------------------- effect

def query_host(host: Host, targets: list[Target], gpu: facts.GpuSettings, *,
               part_timeout_s: int = PART_TIMEOUT_S, transport=None, also: str | None = None) -> HostStatus:
    """One connection, one command. Raises OpsError (HostUnreachable, AuthFailed, ...) when the host fails.
    `transport`: an open one to `host` to use (and leave open), else one is made and closed."""
    from dflash_ops.ssh.transport import for_host

    t = transport or for_host(host)
    try:
        done = t.run(["bash", "-c", host_script(targets, gpu, part_timeout_s=part_timeout_s, also=also)],
                     timeout_s=part_timeout_s + 10)
    finally:
        if transport is None:
            t.close()
    if done.exit_code != 0:
        raise RemoteFailed(f"status script on {host.name} failed with exit code {done.exit_code}",
                           detail="\n".join(done.err.strip().splitlines()[-10:]) or None)
    return parse_host(done.out, host, targets, part_timeout_s=part_timeout_s, also=also)
