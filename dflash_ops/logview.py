"""PURE: what `tail` shows people by default, line by line, from a run's log (`tail --raw` shows the bytes).

The trainer prints each interval twice: a machine line (`DFLASH_METRICS {json}`, for `status`) and a human line
next to it (docs/contracts.md section 3); the same holds for `DFLASH_EVAL` and `DFLASH_PROGRESS`. The human view drops those machine
lines, turns the machine lines that have no human twin (`DFLASH_DONE {json}`, and `dflash-ops resume`'s
`DFLASH_RESUMED {json}`) into short sentences, and keeps every other line as it is. Each line is mapped on its
own, with no state, so a view assembled from exactly-once lines (parse.LineAssembler, across reconnects) is itself
exactly-once.
"""
from __future__ import annotations

import json

from dflash_ops import wire

HIDDEN_PREFIXES = tuple(p.encode() for p in (wire.METRICS_PREFIX, wire.EVAL_PREFIX, wire.PROGRESS_PREFIX))
DONE_PREFIX = wire.DONE_PREFIX.encode()
RESUMED_PREFIX = wire.RESUMED_PREFIX.encode()
# The same rule as an ERE for the remote `grep -v -E` that counts the shown lines for `tail -n N`.
HIDDEN_ERE = "^(" + "|".join(p.decode().rstrip() for p in HIDDEN_PREFIXES) + ") "


def human_line(line: bytes) -> bytes | None:
    """One log line (with its newline, or a final unterminated one) -> the line to show, or None to show nothing."""
    if line.startswith(HIDDEN_PREFIXES):
        return None
    if line.startswith(DONE_PREFIX):
        return _done(line) or line
    if line.startswith(RESUMED_PREFIX):
        return _resumed(line) or line
    return line


def _resumed(line: bytes) -> bytes | None:
    """`DFLASH_RESUMED {"attempt": N, ...}` (written by `dflash-ops resume`) -> `resumed: attempt N`."""
    try:
        record = json.loads(line[len(RESUMED_PREFIX):])
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(record, dict) or type(record.get("attempt")) is not int:
        return None
    return f"resumed: attempt {record['attempt']}".encode() + (b"\n" if line.endswith(b"\n") else b"")


def _done(line: bytes) -> bytes | None:
    try:
        record = json.loads(line[len(DONE_PREFIX):])
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(record, dict):
        return None
    end = b"\n" if line.endswith(b"\n") else b""
    if "step" not in record:
        if not isinstance(record.get("job"), str):
            return None
        words = [f"done: {record['job']} {record.get('done', '?')}/{record.get('total', '?')}"]
        if isinstance(record.get("out"), str):
            words.append(f"out {record['out']}")
        return "; ".join(words).encode() + end
    words = [f"done at step {record['step']}"]
    if isinstance(record.get("export"), str):
        words.append(f"export {record['export']}")
    tau = record.get("eval", {}).get("tau") if isinstance(record.get("eval"), dict) else None
    if isinstance(tau, (int, float)):
        words.append(f"tau {tau}")
    return "; ".join(words).encode() + end
