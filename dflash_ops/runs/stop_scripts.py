"""PURE builders of the scripts that stop runs: `stop` (the signal ladder, the fence), a multi-node stop's marking,
and gpu-reset's runs of the GPU holders and their marking. Quoting and the shared prelude: shellcmd.py."""

from __future__ import annotations

from collections.abc import Sequence

from dflash_ops import wire
from dflash_ops.runs.shellcmd import PRELUDE, path_word, q


MARK_STOPPED = ('if [ -d "$D" ] && [ ! -e "$D/exit_code" ]; then\n'
                '  date +%s > "$D/stopped.tmp" && mv -f -- "$D/stopped.tmp" "$D/stopped"\n'
                'fi\n')


def mark_stopped_script(runs_dir: str, run_id: str) -> str:
    """The first half of a multi-node `stop`: mark the run stopped on this node, if it runs, before any node is
    signalled, so a node that fails because another was stopped (its collective lost a peer) reads as stopped,
    not failed. A run that ended (exited, lost) keeps its state."""
    return (PRELUDE + f"RUNS={path_word(runs_dir)}\nID={q(run_id)}\nD=\"$RUNS/$ID\"\n"
            'pid=$(dflash_pid "$D")\n'
            'if [ "$pid" != - ] && dflash_marked "$pid" "$ID"; then\n' + MARK_STOPPED + "fi\n")


def runs_of_holders_script(runs_dir: str, holders: Sequence[tuple[int, int]]) -> str:
    """gpu-reset, before it signals (read-only): the live runs of "$RUNS" that GPU holders belong to. `holders`:
    (pid, start time) as this machine or container numbers them; a pid whose start time differs was reused and is
    skipped. A run id comes from a process's environment, so only a plain name is kept (no `/`, no leading dot).
    Prints `DFLASH_RUNOF <run id>` once per run."""
    pairs = " ".join(f"{int(pid)}:{int(start)}" for pid, start in holders)
    return (PRELUDE + f"RUNS={path_word(runs_dir)}\nHOLDERS={q(pairs)}\n"
            'seen=" "\n'
            'while read -r p ID _sid; do\n'
            '  want=; for h in $HOLDERS; do [ "${h%%:*}" = "$p" ] && want=${h#*:}; done\n'
            '  [ -n "$want" ] || continue\n'
            '  read -r line < "/proc/$p/stat" 2>/dev/null || continue\n'
            '  read -r -a f <<< "${line##*) }"\n'
            '  [ "${f[19]:-}" = "$want" ] || continue\n'
            '  case $ID in [A-Za-z0-9]*) ;; *) continue;; esac\n'
            '  case $ID in *[!A-Za-z0-9._-]*) continue;; esac\n'
            '  case $seen in *" $ID "*) continue;; esac\n'
            f'  seen="$seen$ID "; echo "{wire.RUN_OF} $ID"\n'
            'done < <(dflash_procs)\n')


def mark_ended_stopped_script(runs_dir: str, run_ids: Sequence[str]) -> str:
    """gpu-reset, after its kill ladder: mark stopped each of `run_ids` that has ended without an exit code (its
    wrapper was SIGKILLed), so that it reads `killed`, as after `stop`, not `lost`. A run still alive, or one that
    wrote its exit code, is left as it is. Prints `DFLASH_MARKED <run id>` for each run marked,
    `DFLASH_UNMARKED <run id>` where writing `stopped` failed."""
    return (PRELUDE + f"RUNS={path_word(runs_dir)}\n"
            f"for ID in {' '.join(q(i) for i in run_ids)}; do\n"
            '  D="$RUNS/$ID"; pid=$(dflash_pid "$D")\n'
            '  [ -d "$D" ] && [ ! -e "$D/exit_code" ] && [ ! -e "$D/stopped" ] || continue\n'
            '  [ "$pid" != - ] && dflash_marked "$pid" "$ID" && continue\n'
            + MARK_STOPPED +
            f'  if [ -e "$D/stopped" ]; then echo "{wire.MARKED} $ID"; else echo "{wire.UNMARKED} $ID"; fi\n'
            'done\n')


def stop_script(runs_dir: str, run_id: str, grace_s: float, *, fence: bool = False, now: bool = False) -> str:
    """SIGTERM every process of the run, wait up to `grace_s`, SIGKILL what is left; with `now`, SIGKILL at once.

    The run's processes are those that carry its marker (dflash_procs: wherever their group or session, and also
    when the run's directory is gone), plus the wrapper's process group while one of its members carries the
    marker. `stopped` is written before the first signal unless the run already has an exit code (then only its
    leftover processes are killed). Ends with `DFLASH_STOP <how>`, `DFLASH_LEFT <count still alive>`, the
    run's state line and, when it ended after its checkpoint, its `DFLASH_KEPT` line.

    With `fence` (a launch of this run may still be on its way here: a rolled-back multi-node launch whose node
    did not answer in time), it first takes the runs dir's launch lock, so a launch script holding it finishes
    starting its job before the job is looked for; and where the run has no directory it creates one, marked
    stopped (`DFLASH_STOP fenced`), so that a launch script arriving later cannot create it and start the job.
    """
    grace_us = max(0, int(grace_s * 1_000_000))
    fenced = ""
    if fence:
        fenced = ('mkdir -p -- "$RUNS" 2>/dev/null\n'
                  'if command -v flock >/dev/null 2>&1 && exec 9>>"$RUNS/.launch.lock"; then flock -w 30 9; fi\n'
                  'if [ ! -d "$D" ] && [ -z "$left" ] && mkdir -- "$D" 2>/dev/null; then\n'
                  f'  date +%s > "$D/stopped"; echo "{wire.STOP} fenced"; echo "{wire.LEFT} 0"; state; exit 0\n'
                  'fi\n'
                  'left=$(mine)\n')
    if now:
        ladder = 'how=killed_now; sig KILL\n'
    else:
        # The grace is wall-clock time (bash's EPOCHREALTIME, its separator stripped whatever the locale): each
        # `mine` reads every process's environ, slow on a busy host, so counting rounds would outlast the
        # caller's timeout and leave the job running.
        ladder = ('sig TERM\n'
                  'now_us() { echo "${EPOCHREALTIME//[!0-9]/}"; }\n'
                  f'end=$(( $(now_us) + {grace_us} ))\n'
                  'while [ "$(now_us)" -lt "$end" ] && [ -n "$(mine)" ]; do sleep 0.1; done\n'
                  'how=terminated\n'
                  'if [ -n "$(mine)" ]; then how=killed; sig KILL; fi\n')
    return (PRELUDE + f"RUNS={path_word(runs_dir)}\nID={q(run_id)}\nD=\"$RUNS/$ID\"\n"
            'mine() { local p i s; dflash_procs | while read -r p i s; do [ "$i" = "$ID" ] && echo "$p"; done; }\n'
            f'state() {{ if [ -d "$D" ]; then dflash_state "$D"; dflash_kept "$D"; '
            f'else printf \'{wire.STATE} %s 0 - - 1 - 0\\n\' "$ID"; fi; }}\n'
            'left=$(mine)\n'
            + fenced +
            f'[ -d "$D" ] || [ -n "$left" ] || {{ echo {wire.MISSING}; exit {wire.EXIT_MISSING}; }}\n'
            'pid=$(dflash_pid "$D")\n'
            f'if [ -z "$left" ]; then echo "{wire.STOP} not_running"; echo "{wire.LEFT} 0"; state; exit 0; fi\n'
            '# a run that already exited keeps its state; only its leftover processes are signalled\n'
            + MARK_STOPPED +
            'sig() {\n'
            '  local p\n'
            '  [ "$pid" != - ] && dflash_group_alive "$pid" "$ID" && kill -"$1" -- "-$pid" 2>/dev/null\n'
            '  for p in $(mine); do kill -"$1" "$p" 2>/dev/null; done\n'
            '}\n'
            + ladder +
            # what SIGKILL left a moment to go (the kernel reaps it), then what is left is counted
            'i=0; while [ "$how" != terminated ] && [ $i -lt 50 ] && [ -n "$(mine)" ]; do sleep 0.1; i=$((i+1)); done\n'
            f'echo "{wire.STOP} $how"\n'
            f'printf \'{wire.LEFT} %s\\n\' "$(mine | wc -l)"\n'
            'state\n')

