"""gpu-reset output: what will be killed (and what is spared, and why), then the before/after table or JSON."""
from __future__ import annotations

import json
import sys

from dflash_ops.cli.status_view import holder_dict
from dflash_ops.gpus import facts


def _console():
    """Text from hosts (process names, error messages) is printed as it is, never read as Rich markup."""
    from rich.console import Console

    return Console(soft_wrap=True, markup=False)


def _row(*cells: str):
    from rich.text import Text

    return [c if isinstance(c, Text) else Text(c) for c in cells]


def no_gpu(host: str, reason: str, *, json_out: bool) -> None:
    if json_out:
        sys.stdout.write(json.dumps({"host": host, "gpu": {"available": False, "reason": reason}}) + "\n")
    else:
        sys.stdout.write(f"{host}: no GPU: {reason}; nothing to reset\n")


def _where(h: facts.Holder) -> str:
    if h.ctid is None:
        return "host"
    return f"ct{h.ctid}" + (f" pid {h.ct_pid}" if h.ct_pid is not None else "")


def plan(host: str, snap: facts.GpuSnapshot, p: facts.KillPlan, scope: facts.Scope) -> None:
    from rich.table import Table

    by_pid = {h.pid: h for h in facts.find_holders(snap)}
    console = _console()
    if not p.targets:
        console.print(f"{host}: no GPU holder in scope ({scope.describe()})")
    else:
        table = Table(title=_row(f"will kill on {host} ({scope.describe()})")[0], title_justify="left")
        for col in ("pid", "where", "command", "gpus", "memory", "signal"):
            table.add_column(col, no_wrap=True)
        for t in p.targets:
            h = by_pid[t.pid]
            table.add_row(*_row(str(h.pid), _where(h), h.comm, ",".join(map(str, h.gpu_indices)) or "-",
                                f"{h.used_mib} MiB" if h.is_compute_app else "fd only",
                                f"process group {t.pgid}" if t.pgid else "this pid only"))
        console.print(table)
    for pgid in sorted({g for g, _, _ in p.bystanders}):
        who = ", ".join(f"{pid} ({comm})" for g, pid, comm in p.bystanders if g == pgid)
        console.print(_row(f"process group {pgid} also holds, with no GPU: {who}: they are signalled with it")[0])
    for h, why in p.spared:
        console.print(_row(f"spared: pid {h.pid} ({h.comm}, {_where(h)}): {why}")[0])


def _result_dict(host: str, r, resets) -> dict:
    def gpu_rows(snap):
        holders = facts.find_holders(snap)
        return [{"index": g.index, "uuid": g.uuid, "memory_used_mib": g.mem_used_mib,
                 "memory_total_mib": g.mem_total_mib,
                 "holders": [holder_dict(h) for h in holders if g.index in h.gpu_indices]} for g in snap.gpus]

    return {"host": host, "ok": not r.held, "held": list(r.held), "watched": list(r.watched),
            "waited_s": round(r.waited_s, 3), "before": gpu_rows(r.before), "after": gpu_rows(r.after),
            "rounds": [{"targets": [{"pid": t.pid, "pgid": t.pgid} for t in rd.plan.targets],
                        "group_members": [{"pgid": g, "pid": pid, "comm": comm} for g, pid, comm in rd.plan.bystanders],
                        "spared": [{"pid": h.pid, "comm": h.comm, "reason": why} for h, why in rd.plan.spared],
                        "absent": list(rd.report.absent), "died_on_term": list(rd.report.died_on_term),
                        "gone": list(rd.report.gone), "alive": list(rd.report.alive),
                        "marked_stopped": [{"where": m.where, "run_ids": list(m.run_ids), "error": m.error}
                                           for m in rd.marked]} for rd in r.rounds],
            "resets": [{"index": i, "uuid": u, "ok": ok, "message": m} for i, u, ok, m in resets]}


def result(host: str, r, resets, *, json_out: bool) -> None:
    if json_out:
        sys.stdout.write(json.dumps(_result_dict(host, r, resets)) + "\n")
        return
    from rich.table import Table
    from rich.text import Text

    console = _console()
    for n, rd in enumerate(r.rounds, 1):
        rep = rd.report
        console.print(f"round {n}: {len(rd.plan.targets)} targeted, {len(rep.died_on_term)} ended on SIGTERM, "
                      f"{len(rep.gone) - len(rep.died_on_term)} needed SIGKILL, {len(rep.alive)} survived"
                      + (f", {len(rep.absent)} already gone" if rep.absent else ""))
        for m in rd.marked:
            if m.run_ids:
                console.print(f"  marked stopped ({m.where}): {', '.join(m.run_ids)}")
            if m.error:
                console.print(f"  could not mark runs stopped ({m.where}): {m.error}")
    after_holders = facts.find_holders(r.after)
    before = {g.index: g for g in r.before.gpus}
    table = Table(title=Text(f"GPUs on {host}: before -> after"), title_justify="left")
    for col in ("gpu", "uuid", "before", "after", "state"):
        table.add_column(col, no_wrap=col != "state")
    for g in r.after.gpus:
        b = before.get(g.index)
        held_by = [h for h in after_holders if g.index in h.gpu_indices]
        state = Text("HELD ", style="red") if g.index in r.held else Text()
        state.append(", ".join(f"pid {h.pid} ({_where(h)})" for h in held_by)
                     or ("free" if g.mem_used_mib == 0 else "-"))
        table.add_row(*_row(str(g.index), g.uuid, f"{b.mem_used_mib if b else '?'} MiB", f"{g.mem_used_mib} MiB",
                            state))
    console.print(table)
    for i, uuid, ok, message in resets:
        console.print(f"nvidia-smi -r GPU {i} ({uuid}): {'ok' if ok else 'NOT reset'}: {message}")
