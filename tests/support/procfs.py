"""Read-only helpers over the host's /proc: parents, states, and namespace PID maps.

Only the host view is read here (the test process lives in the host PID namespace). Every function tolerates a
process vanishing between two reads: it answers as if the process were already gone.
"""
from __future__ import annotations

import os
from pathlib import Path

PROC = Path("/proc")


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (so index 0 is the state letter), or None if gone."""
    try:
        raw = (PROC / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name is in parentheses and may itself contain spaces or ')': split after the last ')'.
    return raw[raw.rindex(")") + 2 :].split()


def state(pid: int) -> str | None:
    """One-letter state (R, S, D, Z, …) of host PID `pid`, or None if no such process."""
    fields = _stat_fields(pid)
    return fields[0] if fields else None


def ppid(pid: int) -> int | None:
    """Parent PID of host PID `pid` as the host sees it, or None if gone."""
    fields = _stat_fields(pid)
    return int(fields[1]) if fields else None


def is_alive(pid: int) -> bool:
    """True if `pid` exists and is not a zombie."""
    return state(pid) not in (None, "Z")


def children(pid: int) -> list[int]:
    """Host PIDs whose parent is `pid` (a /proc scan: this kernel has no /proc/PID/task/TID/children)."""
    found = []
    for entry in PROC.iterdir():
        if entry.name.isdigit() and ppid(int(entry.name)) == pid:
            found.append(int(entry.name))
    return sorted(found)


def nspid(pid: int) -> tuple[int, ...] | None:
    """The NSpid chain of host PID `pid`: (host pid, pid in child ns, …, pid in innermost ns), or None if gone.

    For a process inside one emulated container the tuple has two entries: `(host_pid, container_pid)`.
    """
    try:
        for line in (PROC / str(pid) / "status").read_text().splitlines():
            if line.startswith("NSpid:"):
                return tuple(int(x) for x in line.split()[1:])
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


def host_pid_of(init_host_pid: int, container_pid: int) -> int | None:
    """Map a PID as seen inside a container (whose PID 1 is host PID `init_host_pid`) to its host PID.

    Scans the host's /proc for a process that shares the init's PID namespace and whose innermost NSpid is
    `container_pid`. Returns None if there is none.
    """
    try:
        target_ns = os.readlink(PROC / str(init_host_pid) / "ns" / "pid")
    except (FileNotFoundError, ProcessLookupError):
        return None
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.readlink(entry / "ns" / "pid") != target_ns:
                continue
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        chain = nspid(int(entry.name))
        if chain and chain[-1] == container_pid:
            return int(entry.name)
    return None
