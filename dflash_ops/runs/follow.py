"""Use case: `tail`, a run's log from a byte offset, followed across dropped connections until the run ends.
read_scripts + transport + parse (LineAssembler); no typer, no rich."""

from __future__ import annotations

import time
from collections.abc import Callable

from dflash_ops import names, wire
from dflash_ops.errors import HostUnreachable, RemoteFailed
from dflash_ops.runs import parse, read_scripts
from dflash_ops.runs.lifecycle import Session
from dflash_ops.spec import RUNNING, RunStatus

TAIL_POLL_S = 0.2
RECONNECT_BUDGET_S = 120.0


def tail_start(s: Session, run: RunStatus, lines: int, *, follow: bool = True, hidden_ere: str | None = None) -> int:
    """Byte offset of the last `lines` lines (not counting lines matching `hidden_ere`, which the view hides).
    `lines == 0` while following a running run starts at the line being written (if any), so it comes out whole;
    otherwise 0 lines start at the end of the log."""
    whole = follow and run.state == RUNNING
    done = s.run(read_scripts.tail_start_script(run.run_dir, lines, whole_partial=whole, hidden_ere=hidden_ere),
                 f"reading {run.run_id}'s log")
    words = parse.tagged(done.out, wire.START)
    return int(words[0]) if words and names.is_digits(words[0].removeprefix("-")) else 0


def follow(s: Session, run: RunStatus, *, start: int, emit: Callable[[bytes], None], keep_following: bool = True,
           poll_s: float = TAIL_POLL_S, sleep: Callable[[float], None] = time.sleep,
           reconnect_budget_s: float = RECONNECT_BUDGET_S,
           notify: Callable[[str], None] = lambda message: None) -> RunStatus:
    """Emit complete log lines from byte `start`; with `keep_following`, until the run ends. When following ends
    (or without `keep_following`), bytes after the last newline are emitted as they are: the emitted bytes are
    exactly the log from `start`.

    Survives dropped connections: reconnects with bounded backoff and resumes at the exact byte offset
    (LineAssembler), so no line is lost or repeated. Returns the final state read with the last bytes.
    """
    asm = parse.LineAssembler(offset=start)
    backoff, lost_since = 0.25, None
    while True:
        try:
            done = s.run(read_scripts.tail_chunk_script(run.run_dir, asm.offset), f"reading {run.run_id}'s log",
                         timeout_s=30.0)
        except HostUnreachable as exc:
            if lost_since is None:
                notify(f"{exc.message}; reconnecting (resuming at byte {asm.offset})")
            lost_since = lost_since or time.monotonic()
            if time.monotonic() - lost_since > reconnect_budget_s:
                raise
            sleep(backoff)
            backoff = min(backoff * 2, 5.0)
            _try_reconnect(s)
            continue
        backoff, lost_since = 0.25, None
        raw, data = parse.chunk(done.stdout)
        for line in asm.feed(asm.offset, data):
            emit(line)
        if raw is None:
            raise RemoteFailed(f"cannot read the state of {run.run_id}", detail=done.out[-2000:])
        if len(data) >= read_scripts.CHUNK_BYTES:
            continue  # more is already there
        if not keep_following or not raw.alive:
            for line in asm.flush():
                emit(line)
            # the count read when tailing began would outlive the processes it counted
            procs = run.procs if raw.alive else _marked_procs(s, run.run_id)
            return parse.updated(run, raw, time.time(), procs, None if raw.alive else _kept_step(s, run, raw))
        sleep(poll_s)


def _marked_procs(s: Session, run_id: str) -> int:
    """How many live processes carry `run_id`'s marker now; 0 where the host cannot be asked (the log is all
    emitted by then: a lost connection must not turn a finished tail into an error)."""
    try:
        done = s.run(read_scripts.procs_script(), f"counting {run_id}'s processes", timeout_s=30.0)
    except (HostUnreachable, RemoteFailed):
        return 0
    return len(parse.proc_lines(done.out).get(run_id, []))


def _kept_step(s: Session, run: RunStatus, raw: parse.RawState) -> int | None:
    """The step of the checkpoint a run that ended on SIGTERM/SIGINT wrote first; None where it wrote none, or
    the host cannot be asked (as for `_marked_procs`)."""
    if raw.exit_code not in wire.STOP_EXITS:
        return None
    try:
        done = s.run(read_scripts.kept_script(run.run_dir), f"reading how {run.run_id} ended", timeout_s=30.0)
    except (HostUnreachable, RemoteFailed):
        return None
    return parse.kept_steps(done.out).get(run.run_id)


def _try_reconnect(s: Session) -> None:
    try:
        s.transport.reconnect()
    except HostUnreachable:
        pass  # the next run() raises again and the backoff continues
