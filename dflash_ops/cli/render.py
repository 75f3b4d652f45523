"""Values -> text or JSON. Data goes to stdout; chatter and errors to stderr. Rich is imported lazily."""

from __future__ import annotations

import json
import shlex
import sys
import time
from dataclasses import asdict

from dflash_ops.errors import OpsError
from dflash_ops.spec import Launched, RunStatus


def _err(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def _out(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def error(exc: OpsError, *, json_out: bool) -> None:
    if json_out:
        _out(json.dumps({"error": {"code": exc.code, "exit_code": exc.exit_code, "message": exc.message,
                                   "hint": exc.hint, "detail": exc.detail}}))
        return
    _err(f"error: {exc.message}")
    if exc.detail:
        _err("\n".join(f"  | {line}" for line in exc.detail.splitlines()))
    if exc.hint:
        _err(f"hint: {exc.hint}")


def out(text: str) -> None:
    _out(text)


def info(text: str) -> None:
    _err(text)


def status_dict(s: RunStatus) -> dict:
    d = asdict(s)
    d.update(state_text=s.state_text, duration_s=s.duration_s, log_path=s.log_path, argv=list(s.argv),
             leftovers=s.leftovers, multinode=s.multinode.as_dict() if s.multinode else None)
    return d


def started(spec, target: str, pid: int, wait_s: float | None) -> None:
    live = spec.liveness
    wait = live.wait_s if wait_s is None else wait_s
    upto = f" (up to {live.timeout_s:g} s)" if live.timeout_s else ""
    _err(f"started {spec.run_id} on {target} (pid {pid}); proving it alive: wait {wait:g} s, "
         f"then /{live.pattern}/ in the log{upto}")


def _launched_dict(l: Launched) -> dict:
    return {"run_id": l.spec.run_id, "name": l.spec.name, "runbook": l.spec.runbook, "host": l.spec.host,
            "ct": l.spec.ct, "target": l.target, "pid": l.pid, "run_dir": l.spec.run_dir,
            "log": l.spec.log_path, "state": l.status.state_text if l.status else None,
            "matched_line": l.matched_line, "verified_after_s": l.verified_after_s,
            "stopped_first": list(l.stopped_first)}


def launched(l: Launched, *, json_out: bool) -> None:
    if json_out:
        _out(json.dumps(_launched_dict(l)))
        return
    for rid in l.stopped_first:
        _err(f"stopped {rid} first (--force)")
    state = l.status.state_text if l.status else "?"
    _out(f"launched {l.spec.run_id}")
    _out(f"  host      {l.spec.host}" + (f"  container {l.spec.ct}" if l.spec.ct else ""))
    _out(f"  pid       {l.pid}  (process group {l.pid})")
    _out(f"  log       {l.spec.log_path}")
    _out(f"  state     {state} after {l.verified_after_s or 0:.1f} s")
    if l.matched_line is not None:
        _out(f"  matched   {l.matched_line[:200]}")


def node_started(run_id: str, rank: int, target: str, pid: int) -> None:
    _err(f"started node {rank} of {run_id} on {target} (pid {pid})")


def _rendezvous_text(run) -> str:
    r = run.rendezvous
    return f"rendezvous {r.endpoint} ({r.backend}, timeout {r.timeout_s} s)"


def nodes_waiting(run) -> None:
    r = run.rendezvous
    _err(f"every node of {run.run_id} is up; waiting for them to meet at {r.endpoint} (up to {r.timeout_s} s)")


def nodes_interrupted(run_id: str, stopped) -> None:
    """Ctrl-C during a multi-node launch, after its nodes were stopped (multinode/watch.NodeStopped each)."""
    _err(f"interrupted; rolled back {run_id}:")
    for r in stopped:
        _err(f"  node {r.node.rank} ({r.label}) {r.text}")


def nodes_launched(done, *, json_out: bool) -> None:
    """A multi-node launch (multinode/launch.NodesLaunched): the run, then a line per node."""
    run = done.run
    if json_out:
        _out(json.dumps({"run_id": run.run_id, "multinode": run.as_dict(),
                         "nodes": [dict(_launched_dict(l), rank=i) for i, l in enumerate(done.launched)]}))
        return
    for i, l in enumerate(done.launched):
        for rid in l.stopped_first:
            _err(f"stopped {rid} first on node {i} (--force)")
    _out(f"launched {run.run_id} on {len(run.nodes)} node(s), {_rendezvous_text(run)}")
    width = max(len(l.target) for l in done.launched)
    for i, l in enumerate(done.launched):
        state = l.status.state_text if l.status else "?"
        _out(f"  node {i}  {l.target:<{width}}  pid {l.pid}  {state} after {l.verified_after_s or 0:.1f} s  "
             f"log {l.spec.log_path}")


def nodes_dry_run(run, dry_runs, labels, *, json_out: bool) -> None:
    """Every node's command (`labels`: the nodes' targets, by rank)."""
    if json_out:
        _out(json.dumps({"run_id": run.run_id, "multinode": run.as_dict(),
                         "nodes": [{"rank": i, "target": labels[i], "run_dir": d.spec.run_dir,
                                    "argv": list(d.spec.argv), "command": d.command}
                                   for i, d in enumerate(dry_runs)]}))
        return
    from dflash_ops.multinode.plan import DRY_RUN_ADDRESS

    found = (f"; rank 0's address, {DRY_RUN_ADDRESS} here, is found in its container at launch"
             if run.rendezvous.address == DRY_RUN_ADDRESS else "")
    _err(f"# dry run: would launch {run.run_id} on {len(run.nodes)} node(s) "
         f"({argv_summary(dry_runs[0].spec.argv)}), {_rendezvous_text(run)}; the port is not checked (a launch "
         f"checks it on rank 0's node){found}; nothing was run")
    for i, d in enumerate(dry_runs):
        _out(f"# node {i}: {labels[i]}")
        _out(d.command)


def argv_summary(argv, limit: int = 120) -> str:
    """PURE: the argv as a shell would read it (shlex.join), whole tokens only: the tokens that fit in `limit`
    characters, then " …" when some are left out (the first token always shows, however long)."""
    import shlex

    words = [shlex.quote(a) for a in argv]
    shown, used = [], 0
    for word in words:
        if shown and used + 1 + len(word) > limit:
            return " ".join(shown) + " …"
        shown.append(word)
        used += len(word) + (1 if len(shown) > 1 else 0)
    return " ".join(shown)


def dry_run(spec, command: str, *, json_out: bool) -> None:
    if json_out:
        _out(json.dumps({"run_id": spec.run_id, "run_dir": spec.run_dir, "argv": list(spec.argv), "command": command}))
        return
    _err(f"# dry run: would launch {spec.run_id} ({argv_summary(spec.argv)}); nothing was run")
    _out(command)


def _when(epoch: float | None) -> str:
    return "-" if epoch is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(epoch))


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _print_lines(lines) -> None:
    """Lines of cells (cli/lines.py) on stdout, in a console's width: the terminal's, else $COLUMNS, else 80 when
    piped; every value is plain text (a run name, an error or a label with brackets is never Rich markup)."""
    from rich.console import Console

    from dflash_ops.cli.lines import as_text

    Console(soft_wrap=True).print(as_text(lines))


def _width() -> int:
    from rich.console import Console

    return Console().width


def _state_cell(r: RunStatus) -> tuple[str, str]:
    from dflash_ops.cli.lines import state_style

    return r.state_text, state_style(r.state, r.exit_code)


RUNS_HEADER = ("run id", "state", "pid", "started", "duration")
RUNS_LABELS = ("", "", "pid", "started", "took")


def runs_lines(title: str, runs: list[RunStatus], width: int):
    """PURE: `runs`'s view: a title, then a table (run id, state, pid, started, duration; a run's name is the start
    of its id) when it fits `width`, else each run on its own lines, broken between values and never cut."""
    from dflash_ops.cli.lines import columns, wrap

    rows = [[(r.run_id, "bold"), _state_cell(r), (str(r.pid or "-"), ""), (_when(r.started_at), ""),
             (_duration(r.duration_s), "")] for r in runs]
    return wrap([(title, "bold")], width, 0, 2) + columns(RUNS_HEADER, rows, width, labels=RUNS_LABELS)


def runs_table(runs: list[RunStatus], *, target: str, json_out: bool, where: str = "") -> None:
    """where: the target's `--host H [--ct N]`, so that a hint's command runs against it when pasted."""
    if json_out:
        _out(json.dumps([status_dict(r) for r in runs]))
        return
    if not runs:
        _err(f"no runs on {target}")
        return
    _print_lines(runs_lines(f"runs on {target}", runs, _width()))
    for r in runs:
        stop = shlex.join(["dflash-ops", "stop", r.run_id]) + (f" {where}" if where else "")
        if r.leftovers:
            _err(f"{r.run_id} {r.state} but {r.leftovers} of its processes live on: `{stop}` ends them")
        elif r.dir_missing:
            _err(f"{r.run_id}: its run dir is gone but {r.procs} of its processes live on: `{stop}` ends them")


NODES_HEADER = ("node", "target", "state", "pid", "started", "duration")
NODES_LABELS = ("node", "", "", "pid", "started", "took")


def node_runs_lines(run_id: str, states, overall, width: int):
    """PURE: `runs RUN`'s view: the run and its state, then a row per node (multinode/state.NodeState), as
    `runs_lines` lays them out."""
    from dflash_ops.cli.lines import columns, wrap

    rows = [[(str(s.node.rank), ""), (s.label, ""), (s.error or "?", "red"), ("-", ""), ("-", ""), ("-", "")]
            if s.status is None else
            [(str(s.node.rank), ""), (s.label, ""), _state_cell(s.status), (str(s.status.pid or "-"), ""),
             (_when(s.status.started_at), ""), (_duration(s.status.duration_s), "")] for s in states]
    return wrap([(run_id, "bold"), (overall.text, "")], width, 0, 2) + columns(NODES_HEADER, rows, width,
                                                                                labels=NODES_LABELS)


def node_runs(run_id: str, states, overall, *, json_out: bool) -> None:
    """`runs RUN`: a row per node (multinode/state.NodeState), then the run's overall state."""
    if json_out:
        _out(json.dumps({"run_id": run_id, "state": overall.state, "state_text": overall.text,
                         "nodes": [{"rank": s.node.rank, "target": s.label, "error": s.error,
                                    "status": status_dict(s.status) if s.status else None} for s in states]}))
        return
    _print_lines(node_runs_lines(run_id, states, overall, _width()))


def nodes_stopped(run_id: str, results, *, json_out: bool) -> None:
    """`stop` of a multi-node run: a line per node (multinode/watch.NodeStopped)."""
    if json_out:
        _out(json.dumps({"run_id": run_id, "nodes": [
            {"rank": r.node.rank, "target": r.label, "action": r.how,
             "status": status_dict(r.stopped.status) if r.stopped else None,
             "error": None if r.error is None else {"code": r.error.code, "exit_code": r.error.exit_code,
                                                    "message": r.error.message}} for r in results]}))
        return
    _out(f"stopping {run_id} on {len(results)} node(s):")
    for r in results:
        _out(f"  node {r.node.rank} ({r.label}) {r.text}")


def resume_command(run_id: str, target_args: str) -> str:
    """The command that continues run `run_id` of the target `target_args` (`--host H --ct N`), shell-quoted."""
    return f"dflash-ops resume {shlex.quote(run_id)} {target_args}"


def stopped(run_id: str, how: str, status: RunStatus, *, json_out: bool, target_args: str | None = None) -> None:
    """What `stop` did; for a run it stopped at a checkpoint, with `target_args` (its `--host`/`--ct`), the command
    that resumes it (JSON: `resume`)."""
    resume = (resume_command(run_id, target_args)
              if target_args is not None and status.state == "stopped" and how != "not_running" else None)
    if json_out:
        doc = {"run_id": run_id, "action": how, "status": status_dict(status)}
        _out(json.dumps(doc if resume is None else {**doc, "resume": resume}))
        return
    if how == "not_running":
        _out(f"run {run_id} is not running ({status.state_text}); nothing to stop")
        return
    signal = _signal(how)
    if status.state == "exited":
        _out(f"killed leftover processes of {run_id} with {signal}; the run itself {status.state_text}")
    else:
        _out(f"stopped {run_id} with {signal}; state: {status.state_text}")
    if resume is not None:
        _out(f"resume with: {resume}")


def _signal(how: str) -> str:
    from dflash_ops.runs.lifecycle import signal_text

    return signal_text(how)


def resumed(r, *, json_out: bool) -> None:
    """`resume`'s answer: launch's, with where this attempt's log starts (JSON `log_start`)."""
    if json_out:
        _out(json.dumps({**_launched_dict(r.launched), "resumed": True, "log_start": r.log_start}))
        return
    l = r.launched
    state = l.status.state_text if l.status else "?"
    _out(f"resumed {l.spec.run_id}")
    _out(f"  host      {l.spec.host}" + (f"  container {l.spec.ct}" if l.spec.ct else ""))
    _out(f"  pid       {l.pid}  (process group {l.pid})")
    _out(f"  log       {l.spec.log_path} (appended to, from byte {r.log_start})")
    _out(f"  state     {state} after {l.verified_after_s or 0:.1f} s")
    if l.matched_line is not None:
        _out(f"  matched   {l.matched_line[:200]}")


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def pulled_file(f, dest) -> None:
    _out(f"{dest}  {_size(f.size)}  sha256 {f.sha256}")


def pulled(p, *, json_out: bool) -> None:
    if json_out:
        _out(json.dumps({"run_id": p.run_id, "what": p.what, "to": str(p.to),
                         "files": [{"path": f.rel, "dest": str(dest), "size": f.size, "sha256": f.sha256}
                                   for f, dest in p.files], "links": list(p.links)}))
        return
    for link in p.links:
        _err(f"not pulled: {link} (a symbolic link: links are not followed)")
    total = sum(f.size for f, _ in p.files)
    _err(f"pulled the {p.what} of {p.run_id}: {len(p.files)} file(s), {_size(total)}, into {p.to} "
         "(sizes and SHA-256 checked)")
