"""PURE parsers of what the remote scripts (*_scripts.py) print, and the byte-exact line assembler used by `tail`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace

from dflash_ops import names, wire
from dflash_ops import noderecord as record
from dflash_ops.errors import RemoteFailed
from dflash_ops.spec import EXITED, KILLED, LOST, RUNNING, STOPPED, RunStatus


@dataclass(frozen=True)
class RawState:
    """One `DFLASH_RUN <id> <alive> <pid> <exit> <stopped> <ended> <log size>` line."""

    run_id: str
    alive: bool
    pid: int | None
    exit_code: int | None
    stopped: bool
    ended_at: float | None
    log_size: int


def _opt_int(text: str) -> int | None:
    return None if text == "-" else int(text)


def state_line(line: str) -> RawState | None:
    words = line.split()
    if len(words) != 8 or words[0] != wire.STATE or not names.is_run_id(words[1]):
        return None
    try:
        return RawState(run_id=words[1], alive=words[2] == "1", pid=_opt_int(words[3]), exit_code=_opt_int(words[4]),
                        stopped=words[5] == "1", ended_at=None if words[6] == "-" else float(words[6]),
                        log_size=int(words[7]))
    except ValueError:
        return None


def state_of(raw: RawState, kept_step: int | None = None) -> str:
    """docs/contracts.md section 2: running / exited N / stopped (after its checkpoint: `kept_step`, from its
    DFLASH_KEPT line) / killed / lost."""
    if raw.alive:
        return RUNNING
    if kept_step is not None and raw.exit_code in wire.STOP_EXITS:
        return STOPPED
    if raw.stopped or (raw.exit_code is not None and raw.exit_code >= wire.EXIT_SIGNALLED):
        return KILLED
    if raw.exit_code is not None:
        return EXITED
    return LOST


def status(raw: RawState, meta: dict, now: float, runs_dir: str, kept_step: int | None = None) -> RunStatus:
    argv = meta.get("argv")
    started = meta.get("started_at")
    group, rank = _multinode(meta, raw.run_id)
    state = state_of(raw, kept_step)
    return RunStatus(
        run_id=raw.run_id, name=str(meta.get("name") or names.RUN_ID_RE.fullmatch(raw.run_id).group("name")),
        state=state, pid=raw.pid, exit_code=raw.exit_code, stopped_step=kept_step if state == STOPPED else None,
        started_at=float(started) if isinstance(started, (int, float)) else None, ended_at=raw.ended_at, now=now,
        run_dir=f"{runs_dir}/{raw.run_id}", runbook=str(meta.get("runbook") or ""),
        argv=tuple(str(a) for a in argv) if isinstance(argv, list) else (), log_size=raw.log_size,
        stopped=raw.stopped, multinode=group, node_rank=rank)


def _multinode(meta: dict, run_id: str):
    """run.json's multi-node record and this node's rank in it; (None, None) for a one-node run, or when the
    record is not a valid one of this run."""
    group, rank = record.from_dict(meta.get("multinode")), meta.get("node_rank")
    if group is None or group.run_id != run_id or type(rank) is not int or not 0 <= rank < len(group.nodes):
        return None, None
    return group, rank


def updated(run: RunStatus, raw: RawState, now: float, procs: int | None = None,
            kept_step: int | None = None) -> RunStatus:
    """`run` with the state read in `raw` (identity, argv and start time kept), its count of live marked
    processes when known, and the step of the checkpoint it stopped at (`kept_step`: its DFLASH_KEPT line)."""
    state = state_of(raw, kept_step)
    return replace(run, state=state, pid=raw.pid if not run.dir_missing else run.pid,
                   exit_code=raw.exit_code, ended_at=raw.ended_at, now=now, log_size=raw.log_size,
                   procs=run.procs if procs is None else procs, stopped=raw.stopped,
                   stopped_step=kept_step if state == STOPPED else None)


def lines(text: str) -> list[str]:
    """`text` split at newlines only: what a script prints is one line per newline, whatever other line breaks
    (a carriage return, U+2028) a value read from a log or a file carries."""
    return text.split("\n")


def kept_steps(text: str) -> dict[str, int]:
    """`DFLASH_KEPT <run id> <json>` lines -> run id -> the step of the checkpoint it stopped at (a line whose JSON
    names no step is none)."""
    steps = {}
    for line in lines(text):
        words = line.split(" ", 2)
        if len(words) != 3 or words[0] != wire.KEPT or not names.is_run_id(words[1]):
            continue
        try:
            step = json.loads(words[2]).get("step")
        except (json.JSONDecodeError, AttributeError):
            continue
        if type(step) is int and step >= 0:
            steps[words[1]] = step
    return steps


def older_count(text: str) -> int:
    """A limited listing's `DFLASH_OLDER <count>`: the runs it left out (0 without one)."""
    words = next((ln.split() for ln in lines(text) if ln.startswith(wire.OLDER + " ")), [])
    return int(words[1]) if len(words) == 2 and names.is_digits(words[1]) else 0


def now_line(text: str) -> float | None:
    for line in lines(text):
        if line.startswith(wire.NOW + " "):
            try:
                return float(line.split()[1])
            except (IndexError, ValueError):
                return None
    return None


def proc_lines(text: str) -> dict[str, list[tuple[int, int]]]:
    """`DFLASH_PROC <pid> <run id> <sid>` lines (the marked processes, dflash_procs) -> run id -> [(pid, sid)]."""
    procs: dict[str, list[tuple[int, int]]] = {}
    for line in lines(text):
        words = line.split()
        if (len(words) == 4 and words[0] == wire.PROC and names.is_digits(words[1])
                and names.is_digits(words[3]) and names.is_run_id(words[2])):
            procs.setdefault(words[2], []).append((int(words[1]), int(words[3])))
    return procs


def orphan(run_id: str, procs: list[tuple[int, int]], now: float, runs_dir: str) -> RunStatus:
    """A run known only by its live processes (its directory is gone). Its pid is the session leader among them
    (the wrapper started with setsid), else the lowest."""
    leaders = sorted(p for p, sid in procs if p == sid)
    return RunStatus(run_id=run_id, name=names.RUN_ID_RE.fullmatch(run_id).group("name"), state=RUNNING,
                     pid=(leaders or sorted(p for p, _ in procs))[0], exit_code=None, started_at=None,
                     ended_at=None, now=now, run_dir=f"{runs_dir}/{run_id}", procs=len(procs), dir_missing=True)


_LISTING_TAGS = (wire.NOW, wire.PROC, wire.KEPT, wire.OLDER)   # read above, by their own parsers


def run_list(text: str, runs_dir: str) -> list[RunStatus]:
    """Output of `list_script` -> statuses, oldest first (run ids sort by their UTC stamp); runs whose directory
    is gone but whose processes live are listed too (see `orphan`). A line outside the listing's protocol (an
    unknown tag, a state line that does not parse, a run.json line not right after a state line) is RemoteFailed:
    the listing is refused whole rather than read as something else."""
    now = now_line(text) or 0.0
    procs = proc_lines(text)
    kept = kept_steps(text)
    out: list[RunStatus] = []
    pending: RawState | None = None
    for line in lines(text):
        tag = line.split(" ", 1)[0]
        raw = state_line(line) if tag == wire.STATE else None
        if raw is not None:
            pending = raw
            continue
        if tag == wire.RUN_JSON and pending is not None:
            try:
                meta = json.loads(line[len(wire.RUN_JSON):].strip() or "{}")
            except json.JSONDecodeError:
                meta = {}
            found = status(pending, meta if isinstance(meta, dict) else {}, now, runs_dir, kept.get(pending.run_id))
            out.append(replace(found, procs=len(procs.pop(found.run_id, []))))
        elif line and tag not in _LISTING_TAGS:
            raise RemoteFailed(f"the runs listing has a line outside its protocol: {line[:120]!r}")
        pending = None
    out += [orphan(run_id, ps, now, runs_dir) for run_id, ps in procs.items()]
    return sorted(out, key=lambda s: (names.RUN_ID_RE.fullmatch(s.run_id).group("stamp"), s.started_at or 0, s.run_id))


def run_meta(text: str, run_id: str) -> dict:
    """A listing's run.json of `run_id` (its DFLASH_JSON line, right after its state line) as an object; {} where
    there is none or it does not parse as one."""
    after = False
    for line in lines(text):
        if after and line.startswith(wire.RUN_JSON + " "):
            try:
                meta = json.loads(line[len(wire.RUN_JSON):].strip() or "{}")
            except json.JSONDecodeError:
                return {}
            return meta if isinstance(meta, dict) else {}
        raw = state_line(line)
        after = raw is not None and raw.run_id == run_id
    return {}


@dataclass(frozen=True)
class Probe:
    raw: RawState | None
    now: float
    log_tail: bytes


def probe(stdout: bytes) -> Probe:
    """Output of `probe_script`: header lines, then `DFLASH_LOG\\n`, then raw log bytes."""
    head, sep, log = stdout.partition(wire.LOG.encode() + b"\n")
    text = head.decode("utf-8", "replace")
    raw = next((r for r in map(state_line, text.splitlines()) if r is not None), None)
    return Probe(raw=raw, now=now_line(text) or 0.0, log_tail=log if sep else b"")


def joined(stdout: bytes) -> bool:
    """Output of `joined_script`: its header says DFLASH_JOINED (a log line matched)."""
    head = stdout.partition(wire.LOG.encode() + b"\n")[0]
    return wire.JOINED.encode() in head.split(b"\n")


def tagged(text: str, tag: str) -> list[str] | None:
    """Words after the first line starting with `tag` (e.g. DFLASH_LAUNCHED), or None."""
    for line in text.splitlines():
        words = line.split()
        if words and words[0] == tag:
            return words[1:]
    return None


def chunk(stdout: bytes) -> tuple[RawState | None, bytes]:
    """Output of `tail_chunk_script`: one state line, then raw log bytes."""
    first, _, data = stdout.partition(b"\n")
    return state_line(first.decode("utf-8", "replace")), data


@dataclass
class LineAssembler:
    """Turns byte chunks read at known offsets into complete lines, each exactly once.

    `offset` is the next byte to request. A chunk whose start is not `offset` is trimmed or rejected, so a resumed
    read after a reconnect can neither repeat nor skip a byte. Only complete lines are released; `flush()` releases
    a final unterminated line, as it is, when the run is over.
    """

    offset: int = 0
    pending: bytearray = field(default_factory=bytearray)

    def feed(self, start: int, data: bytes) -> list[bytes]:
        if start > self.offset:
            raise ValueError(f"gap in log: have bytes up to {self.offset}, got a chunk starting at {start}")
        data = data[self.offset - start:]
        self.offset += len(data)
        self.pending += data
        *lines, rest = bytes(self.pending).split(b"\n")
        self.pending = bytearray(rest)
        return [line + b"\n" for line in lines]

    def flush(self) -> list[bytes]:
        """The unterminated rest, byte for byte (no newline added: the output stays an exact copy of the log)."""
        if not self.pending:
            return []
        rest, self.pending = bytes(self.pending), bytearray()
        return [rest]
