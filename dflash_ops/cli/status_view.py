"""HostStatus values -> JSON-able dicts and Rich renderables (for `status`; `gpu-reset` reuses the GPU table)."""
from __future__ import annotations

from dflash_ops.cli.lines import Cell, as_text, state_style, wrap
from dflash_ops.errors import HostUnreachable, OpsError
from dflash_ops.fanout import Outcome
from dflash_ops.gpus import facts
from dflash_ops.hoststatus import HostStatus, RunRow
from dflash_ops.metrics_line import Progress


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    if s >= 86400:
        return f"{s // 86400}d{s % 86400 // 3600:02d}h"
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


# --------------------------------------------------------------------------- JSON

def holder_dict(h: facts.Holder, run_id: str | None = None) -> dict:
    return {"pid": h.pid, "comm": h.comm, "gpus": list(h.gpu_indices), "used_mib": h.used_mib,
            "compute_app": h.is_compute_app, "pgid": h.pgid, "ct": str(h.ctid) if h.ctid is not None else None,
            "ct_pid": h.ct_pid, "run_id": run_id}


def gpu_dicts(snap: facts.GpuSnapshot, holders: tuple[facts.Holder, ...], runs: dict[int, str]) -> list[dict]:
    return [{"index": g.index, "uuid": g.uuid, "memory_used_mib": g.mem_used_mib,
             "memory_total_mib": g.mem_total_mib, "utilization_pct": g.util_pct,
             "holders": [holder_dict(h, runs.get(h.pid)) for h in holders if g.index in h.gpu_indices]}
            for g in snap.gpus]


def _run_dict(row: RunRow) -> dict:
    r = row.status
    return {"run_id": r.run_id, "name": r.name, "state": r.state, "state_text": r.state_text, "pid": r.pid,
            "uptime_s": r.duration_s, "exit_code": r.exit_code, "started_at": r.started_at, "log": r.log_path,
            "gpus": list(row.gpu_indices), "leftovers": r.leftovers, "dir_missing": r.dir_missing,
            "metrics": row.metrics.as_dict() if row.metrics and not isinstance(row.metrics, Progress) else None,
            "progress": row.metrics.as_dict() if isinstance(row.metrics, Progress) else None}


def host_dict(o: Outcome) -> dict:
    host = o.key
    base = {"host": host.name, "transport": host.transport, "elapsed_s": round(o.elapsed_s, 3)}
    if not o.ok:
        err = o.error
        return {**base, "reachable": False, "error": {"code": getattr(err, "code", "error"),
                                                       "exit_code": getattr(err, "exit_code", 1),
                                                       "message": str(err)}}
    hs: HostStatus = o.value
    runs = dict(hs.holder_runs)
    gpu = ({"available": False, "reason": hs.gpu_error or hs.snapshot.no_gpu_reason, "gpus": []}
           if hs.snapshot is None or hs.snapshot.no_gpu_reason else
           {"available": True, "reason": None, "gpus": gpu_dicts(hs.snapshot, hs.holders, runs)})
    targets = [{"target": t.label, "ct": t.ct, "error": t.error, "runs": [_run_dict(r) for r in t.runs],
                "finished_hidden": t.finished_hidden} for t in hs.targets]
    return {**base, "reachable": True, "error": None, "gpu": gpu, "targets": targets}


def report_dict(outcomes: list[Outcome], elapsed_s: float) -> dict:
    return {"hosts": [host_dict(o) for o in outcomes], "elapsed_s": round(elapsed_s, 3)}


# --------------------------------------------------------------------------- text
# A block per host and a few short lines per run, so that 80 columns (a laptop terminal, a pipe) show every figure
# (lines.py: broken between values, never cut).


def run_cells(row: RunRow) -> tuple[list[Cell], list[Cell]]:
    """PURE: one run as `<run id>  <state>  pid N  up T  gpus G`, then its latest metrics (empty without any)."""
    r, m = row.status, row.metrics
    head = [(r.run_id, "bold"), (r.state_text, state_style(r.state, r.exit_code)), (f"pid {r.pid or '-'}", ""),
            (f"up {_duration(r.duration_s)}", "")]
    if row.gpu_indices:
        head.append(("gpus " + ",".join(map(str, row.gpu_indices)), ""))
    if m is None:
        return head, []
    if isinstance(m, Progress):
        return head, [(f, "") for f in progress_figures(m)]
    figures = [f"step {m.step}" + (" done" if m.done else ""), f"loss {_num(m.loss, '.4f')}"]
    figures += [f"tok/s {_num(m.tokens_per_s, ',.0f')}"] if m.tokens_per_s is not None else []
    figures += [f"acc {_num(m.acc, '.3f')}"] if m.acc is not None else []
    return head, [(f, "") for f in figures]


def progress_figures(p: Progress) -> list[str]:
    """PURE: `regenerate 128/1000 answers  tok/s 812  eta 7m10s` (done: `... done`)."""
    figures = [f"{p.job} {p.done}/{p.total if p.total is not None else '?'}" + (f" {p.unit}" if p.unit else "")
               + (" done" if p.finished else "")]
    figures += [f"tok/s {_num(p.tokens_per_s, ',.0f')}"] if p.tokens_per_s is not None else []
    figures += [f"eta {_duration(p.eta_s)}"] if p.eta_s is not None and not p.finished else []
    return figures


def _holder_cells(h: facts.Holder, run_id: str | None) -> list[Cell]:
    where = f"ct{h.ctid}:{h.ct_pid}" if h.ctid is not None and h.ct_pid is not None else (
        f"ct{h.ctid}" if h.ctid is not None else "host")
    mem = f"{h.used_mib} MiB" if h.is_compute_app else "fd only"
    return [(f"pid {h.pid} ({where})", ""), (h.comm, ""), (mem, "")] + ([(f"run {run_id}", "")] if run_id else [])


def gpu_lines(snap: facts.GpuSnapshot, holders: tuple[facts.Holder, ...], runs: dict[int, str], width: int):
    """PURE: a line per GPU (index, memory, utilization; UUIDs are in `--json`), then a line per holder."""
    mems = [f"{g.mem_used_mib} / {g.mem_total_mib} MiB" for g in snap.gpus]
    mem_w = max(map(len, mems), default=0)
    idx_w = max((len(str(g.index)) for g in snap.gpus), default=1)
    out = []
    for g, mem in zip(snap.gpus, mems):
        util = _num(g.util_pct, "d") + ("%" if g.util_pct is not None else "")
        out += wrap([(f"gpu {g.index:>{idx_w}}", ""), (mem.rjust(mem_w), "yellow" if g.mem_used_mib else ""),
                     (util.rjust(4), "")], width, 2, 6)
        for group in _holder_groups([h for h in holders if g.index in h.gpu_indices], runs):
            cells = _holder_cells(group[0], runs.get(group[0].pid)) if len(group) == 1 else \
                _fd_group_cells(group, runs.get(group[0].pid))
            out += wrap(cells, width, 6, 8)
    return out


def _holder_groups(held: list[facts.Holder], runs: dict[int, str]) -> list[list[facts.Holder]]:
    """PURE: each compute app alone; the "fd only" holders (a device node open, no memory: torch's compile
    workers, a DataLoader's) together per run, or per process group outside a run, where their first one was."""
    groups: dict[tuple, list[facts.Holder]] = {}
    for h in held:
        key = ("app", h.pid) if h.is_compute_app else ("fds", h.ctid, runs.get(h.pid) or h.pgid)
        groups.setdefault(key, []).append(h)
    return list(groups.values())


def _fd_group_cells(group: list[facts.Holder], run_id: str | None) -> list[Cell]:
    """`14 processes (ct200)  python, pt_main_thread  fd only  run RUN` (their pids are in --json)."""
    h = group[0]
    where = f"ct{h.ctid}" if h.ctid is not None else "host"
    whose = f"run {run_id}" if run_id else f"process group {h.pgid}"
    comms = ", ".join(dict.fromkeys(x.comm for x in group))
    return [(f"{len(group)} processes ({where})", ""), (comms, ""), ("fd only", ""), (whose, "")]


def runs_lines(hs: HostStatus, width: int):
    """PURE: per target its label, then per run its two lines (see run_cells), or why there is nothing."""
    out = []
    if not hs.targets:
        out += wrap([("(no containers listed for this host in the inventory)", "")], width, 2, 2)
    for t in hs.targets:
        if t.error:
            out += wrap([(f"{t.label}:", "bold"), ("unreachable:", "red"), (t.error, "")], width, 2, 4)
        elif not t.runs:
            out += wrap([(f"{t.label}:", "bold"), ("no runs", "")], width, 2, 4)
        else:
            out += wrap([(t.label, "bold")], width, 2, 4)
        for row in t.runs:
            head, figures = run_cells(row)
            out += wrap(head, width, 4, 8)
            if figures:
                out += wrap(figures, width, 6, 8)
        if t.finished_hidden:
            out += wrap([(f"and {t.finished_hidden} older finished run(s): `dflash-ops runs --all` lists them, "
                          "`dflash-ops runs --prune` removes them", "dim")], width, 4, 8)
    return out


def report_lines(outcomes: list[Outcome], elapsed_s: float, width: int) -> list[tuple[int, list[Cell]]]:
    """PURE: the whole report as lines of cells (see `wrap`)."""
    out: list[tuple[int, list[Cell]]] = []
    for o in outcomes:
        if not o.ok:
            code = getattr(o.error, "code", "error")
            out += wrap([(f"{o.key.name}: UNREACHABLE ({code})", "bold red"), (str(o.error), "red")], width, 0, 2)
            continue
        hs: HostStatus = o.value
        if hs.snapshot is None or hs.snapshot.no_gpu_reason:
            out += wrap([(f"{hs.host}: no GPU: {hs.gpu_error or hs.snapshot.no_gpu_reason}", "bold")], width, 0, 2)
        else:
            held = sum(1 for g in hs.snapshot.gpus if any(g.index in h.gpu_indices for h in hs.holders))
            out += wrap([(f"GPUs on {hs.host}: {len(hs.snapshot.gpus)}, {held} held", "bold")], width, 0, 2)
            out += gpu_lines(hs.snapshot, hs.holders, dict(hs.holder_runs), width)
        out += wrap([(f"runs on {hs.host}", "bold")], width, 0, 2)
        out += runs_lines(hs, width)
    out += wrap([(f"{len(outcomes)} host(s) in {elapsed_s:.2f} s", "dim")], width, 0, 2)
    return out


# --------------------------------------------------------------------------- one run, a row per node

def node_report_dict(run_id: str, overall, rows, elapsed_s: float) -> dict:
    """`status RUN --json`: the run's state and a row per node (multinode/watch.NodeRow)."""
    first = overall.first
    return {"run_id": run_id, "state": overall.state, "state_text": overall.text,
            "first_failed": None if first is None else {"rank": first.node.rank, "target": first.label},
            "nodes": [{"rank": r.state.node.rank, "target": r.state.label, "error": r.state.error,
                       "run": _run_dict(r.row) if r.row else None} for r in rows],
            "elapsed_s": round(elapsed_s, 3)}


def node_report_lines(run_id: str, overall, rows, elapsed_s: float, width: int) -> list[tuple[int, list[Cell]]]:
    """PURE: `<run id>  <overall state>`, then per node `node R  <target>  <state>  pid N  up T  gpus G` and its
    latest metrics (rank 0 prints them), or why it could not be read."""
    style = "green" if overall.state == "running" else "red" if overall.state in ("failed", "unknown") else "cyan"
    out = wrap([(run_id, "bold"), (overall.text, style)], width, 0, 2)
    for r in rows:
        where = [(f"node {r.state.node.rank}", "bold"), (r.state.label, "")]
        if r.row is None:
            out += wrap(where + [(r.state.error or "?", "red")], width, 2, 6)
            continue
        head, figures = run_cells(r.row)
        out += wrap(where + head[1:], width, 2, 6)
        if figures:
            out += wrap(figures, width, 4, 6)
    out += wrap([(f"{len(rows)} node(s) in {elapsed_s:.2f} s", "dim")], width, 0, 2)
    return out


def node_report_renderable(run_id: str, overall, rows, elapsed_s: float, width: int):
    return as_text(node_report_lines(run_id, overall, rows, elapsed_s, width))


def report_renderable(outcomes: list[Outcome], elapsed_s: float, width: int):
    """The report as Rich text for a console `width` columns wide (already wrapped: print it with soft_wrap)."""
    return as_text(report_lines(outcomes, elapsed_s, width))


def exit_code(outcomes: list[Outcome]) -> int:
    """0 when every host and every target in scope answered; else the first failed host's exit code (69
    unreachable, 77 auth, ...), else 69 (unreachable) when a target of a host that answered did not (a stopped
    container: its row says why)."""
    for o in outcomes:
        if isinstance(o.error, OpsError):
            return o.error.exit_code
    if any(t.error is not None for o in outcomes if o.value is not None for t in o.value.targets):
        return HostUnreachable.exit_code
    return 0
