"""PURE `runs --prune`: which finished runs go (`select`), the script that removes them (`prune_script`) and what
it printed (`pruned`); the use case is lifecycle.prune. A run is removed by its exact, validated id; never a live
one."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dflash_ops import names, wire
from dflash_ops.runs.shellcmd import PRELUDE, path_word, q
from dflash_ops.spec import RUNNING, RunStatus

DAY_S = 86400.0
# ids per remote call: one `bash -c` argument stays far below Linux's 128 KiB per argument
BATCH = 500


def finished(r: RunStatus) -> bool:
    """Its wrapper is gone, no process carries its marker, and its directory is there."""
    return r.state != RUNNING and not r.procs and not r.dir_missing


def select(runs: Sequence[RunStatus], *, keep: int = 0, older_than_days: float | None = None,
           now: float) -> list[RunStatus]:
    """PURE: the finished runs of `runs` (oldest first, as listed) to remove: all but the newest `keep` finished
    ones, and with `older_than_days` only those that ended (else started) more than that many days before `now`.
    A run with neither time is old enough."""
    done = [r for r in runs if finished(r)]
    gone = done[:max(0, len(done) - keep)]
    if older_than_days is not None:
        cutoff = now - older_than_days * DAY_S
        gone = [r for r in gone if (r.ended_at or r.started_at or 0.0) <= cutoff]
    return gone


def prune_script(runs_dir: str, run_ids: Sequence[str]) -> str:
    """Under the runs dir's launch lock (a launch starting now has its process before it lets go), remove each
    run dir `run_ids` names unless a live process of the runs dir carries its marker (dflash_procs: the recorded
    pid of a live run among them): `DFLASH_PRUNED <id>` for each removed, `DFLASH_SPARED <id>` for each kept
    alive; an id that is no directory there (or a link) is skipped. No process per run: one scan, one `rm`."""
    ids = " ".join(q(names.run_id(r)) for r in run_ids)
    return (PRELUDE + f"RUNS={path_word(runs_dir)}\n"
            '[ -d "$RUNS" ] || exit 0\n'
            'if command -v flock >/dev/null 2>&1; then\n'
            f'  exec 9>>"$RUNS/.launch.lock" && flock -w 15 9 || {{ echo "{wire.REFUSED} lock -"; '
            f'exit {wire.EXIT_REFUSED}; }}\n'
            'fi\n'
            'declare -A LIVE=()\n'
            'while read -r p id sid; do LIVE[$id]=1; done < <(dflash_procs)\n'
            "gone=()\n"
            f"for ID in {ids}; do\n"
            '  D=$RUNS/$ID\n'
            '  dflash_is_id "$ID" && [ -d "$D" ] && [ ! -L "$D" ] || continue\n'
            f'  if [ -n "${{LIVE[$ID]-}}" ]; then echo "{wire.SPARED} $ID"; else gone+=("$D"); fi\n'
            "done\n"
            # one rm for the batch; each is said once it is gone
            '[ "${#gone[@]}" -gt 0 ] || exit 0\n'
            'rm -rf -- "${gone[@]}"\n'
            f'for D in "${{gone[@]}}"; do [ -e "$D" ] || echo "{wire.PRUNED} ${{D##*/}}"; done\n'
            "exit 0\n")


@dataclass(frozen=True)
class Pruned:
    removed: tuple[str, ...]
    spared: tuple[str, ...]      # alive when the script looked: kept


def pruned(text: str) -> Pruned:
    """What prune_script printed -> the run ids it removed and those it kept alive."""
    removed: list[str] = []
    spared: list[str] = []
    for line in text.split("\n"):
        tag, _, rid = line.partition(" ")
        if names.is_run_id(rid):
            (removed if tag == wire.PRUNED else spared if tag == wire.SPARED else []).append(rid)
    return Pruned(tuple(removed), tuple(spared))
