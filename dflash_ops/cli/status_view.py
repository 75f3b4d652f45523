"""HostStatus values -> JSON-able dicts and Rich renderables (for `status`; `gpu-reset` reuses the GPU table)."""
from __future__ import annotations

from dflash_ops.errors import OpsError
from dflash_ops.fanout import Outcome
from dflash_ops.gpus import facts
from dflash_ops.hoststatus import HostStatus, RunRow


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
            "gpus": list(row.gpu_indices), "metrics": row.metrics.as_dict() if row.metrics else None}


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
    targets = [{"target": t.label, "ct": t.ct, "error": t.error, "runs": [_run_dict(r) for r in t.runs]}
               for t in hs.targets]
    return {**base, "reachable": True, "error": None, "gpu": gpu, "targets": targets}


def report_dict(outcomes: list[Outcome], elapsed_s: float) -> dict:
    return {"hosts": [host_dict(o) for o in outcomes], "elapsed_s": round(elapsed_s, 3)}


# --------------------------------------------------------------------------- Rich

def gpu_table(snap: facts.GpuSnapshot, holders: tuple[facts.Holder, ...], runs: dict[int, str], *, title: str):
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for col in ("gpu", "uuid", "memory", "util", "held by"):
        table.add_column(col, no_wrap=col != "held by")
    for g in snap.gpus:
        held = [h for h in holders if g.index in h.gpu_indices]
        who = "\n".join(_holder_text(h, runs.get(h.pid)) for h in held) or "-"
        mem = f"{g.mem_used_mib} / {g.mem_total_mib} MiB"
        table.add_row(str(g.index), g.uuid, f"[yellow]{mem}[/]" if g.mem_used_mib else mem,
                      _num(g.util_pct, "d") + ("%" if g.util_pct is not None else ""), who)
    return table


def _holder_text(h: facts.Holder, run_id: str | None) -> str:
    where = f"ct{h.ctid}:{h.ct_pid}" if h.ctid is not None and h.ct_pid is not None else (
        f"ct{h.ctid}" if h.ctid is not None else "host")
    mem = f"{h.used_mib} MiB" if h.is_compute_app else "fd only"
    return f"pid {h.pid} ({where}) {h.comm} {mem}" + (f" run {run_id}" if run_id else "")


def runs_table(hs: HostStatus):
    from rich.table import Table

    table = Table(title=f"runs on {hs.host}", title_justify="left")
    ids = [row.status.run_id for t in hs.targets for row in t.runs]
    labels = [t.label for t in hs.targets]
    # ids and targets are copied into other commands: never fold or ellipsize them
    widths = {"run id": max(map(len, ids), default=None), "target": max(map(len, labels), default=None)}
    for col in ("target", "name", "run id", "state", "pid", "uptime", "step", "loss", "tok/s", "acc", "gpus"):
        table.add_column(col, no_wrap=True, min_width=widths.get(col))
    colors = {"running": "green", "exited": "cyan", "killed": "yellow", "lost": "red"}
    if not hs.targets:
        table.add_row(hs.host, "-", "(no containers listed for this host in the inventory)", *[""] * 8)
    for t in hs.targets:
        if t.error:
            table.add_row(t.label, "[red]unreachable[/]", t.error, *[""] * 8)
        elif not t.runs:
            table.add_row(t.label, "-", "(no runs)", *[""] * 8)
        for row in t.runs:
            r, m = row.status, row.metrics
            color = "red" if r.state == "exited" and r.exit_code else colors.get(r.state, "white")
            table.add_row(t.label, r.name, r.run_id, f"[{color}]{r.state_text}[/]", str(r.pid or "-"),
                          _duration(r.duration_s), str(m.step) + (" done" if m.done else "") if m else "-",
                          _num(m and m.loss, ".4f"), _num(m and m.tokens_per_s, ",.0f"), _num(m and m.acc, ".3f"),
                          ",".join(map(str, row.gpu_indices)) or "-")
    return table


def report_renderable(outcomes: list[Outcome], elapsed_s: float):
    from rich.console import Group
    from rich.text import Text

    parts = []
    for o in outcomes:
        host = o.key
        if not o.ok:
            err = o.error
            code = getattr(err, "code", "error")
            parts.append(Text(f"{host.name}: UNREACHABLE ({code}) {err}", style="bold red"))
            continue
        hs: HostStatus = o.value
        if hs.snapshot is None or hs.snapshot.no_gpu_reason:
            parts.append(Text(f"{hs.host}: no GPU ({hs.gpu_error or hs.snapshot.no_gpu_reason})", style="bold"))
        else:
            parts.append(gpu_table(hs.snapshot, hs.holders, dict(hs.holder_runs), title=f"GPUs on {hs.host}"))
        parts.append(runs_table(hs))
    parts.append(Text(f"{len(outcomes)} host(s) in {elapsed_s:.2f} s", style="dim"))
    return Group(*parts)


def exit_code(outcomes: list[Outcome]) -> int:
    """0 when every host answered; else the first failed host's exit code (69 unreachable, 77 auth, ...)."""
    for o in outcomes:
        if isinstance(o.error, OpsError):
            return o.error.exit_code
    return 0
