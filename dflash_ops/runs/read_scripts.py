"""PURE builders of the read-only scripts: the listing of runs, a run's probe, its log's tail, its processes.
Quoting and the shared prelude: shellcmd.py."""

from __future__ import annotations

from dflash_ops import wire
from dflash_ops.runs.shellcmd import NO_RUN_DIR, PRELUDE, PRINT_NOW, RUN_ID_GLOB, path_word, q

LOG_TAIL_BYTES = 65536
CHUNK_BYTES = 1 << 20

PROC_LINES = f"dflash_procs | sed 's/^/{wire.PROC} /'\n"  # every live marked process (parse.proc_lines)


def procs_script() -> str:
    """`DFLASH_PROC <pid> <run id> <sid>` for every live process that carries a run's marker."""
    return PRELUDE + PROC_LINES


# In a loop over "$RUNS"/*: skip what is not a run directory. Only a name with a run id's shape (no space, no
# newline) is one: any other name could print lines of its own into a listing.
RUN_DIR_ONLY = '  [ -d "$d" ] && dflash_is_id "${d##*/}" || continue\n'


def list_script(runs_dir: str) -> str:
    """Every run dir under `runs_dir` (RUN_DIR_ONLY): a DFLASH_RUN state line followed by a DFLASH_JSON line
    (run.json on one line), and its DFLASH_KEPT line if it has one."""
    return (PRELUDE + f"RUNS={path_word(runs_dir)}\n"
            + PRINT_NOW + PROC_LINES +
            '[ -d "$RUNS" ] || exit 0\n'
            f'for d in "$RUNS"/*{RUN_ID_GLOB}; do\n'
            + RUN_DIR_ONLY +
            '  dflash_state "$d"\n'
            f"  printf '{wire.RUN_JSON} '; {{ head -c 65536 -- \"$d/run.json\" 2>/dev/null || true; }} | tr -d '\\n'; echo\n"
            '  dflash_kept "$d"\n'
            "done\n")


def kept_script(run_dir: str) -> str:
    """The run's `DFLASH_KEPT` line, when it ended on SIGTERM/SIGINT after its checkpoint (else nothing)."""
    return PRELUDE + f"D={path_word(run_dir)}\n" + '[ -d "$D" ] && dflash_kept "$D"\nexit 0\n'


def probe_script(run_dir: str, tail_bytes: int = LOG_TAIL_BYTES) -> str:
    """State of one run, then `DFLASH_LOG` and the last `tail_bytes` of its log."""
    return PRELUDE + probe_body(run_dir, tail_bytes)


def probe_body(run_dir: str, tail_bytes: int) -> str:
    return (f"D={path_word(run_dir)}\n" + PRINT_NOW + NO_RUN_DIR +
            'dflash_state "$D"\n'
            f"echo {wire.LOG}\n"
            f'tail -c {int(tail_bytes)} -- "$D/output.log" 2>/dev/null || true\n')


def tail_start_script(run_dir: str, lines: int, *, whole_partial: bool = False, hidden_ere: str | None = None) -> str:
    """Byte offset where the last `lines` lines of the log begin (a trailing partial line counts as one).

    With `lines == 0` that is the end of the log, or with `whole_partial` the start of a trailing partial line,
    so a follower never starts in the middle of the line being written. With `hidden_ere`, lines matching it are
    not counted (the view will not show them), so `-n N` shows N lines of what is shown.
    """
    n = int(lines)
    log = 'head -c "$size" -- "$D/output.log" 2>/dev/null'
    count = f'n=$({log} | tail -n {n} | wc -c)\n'
    if n > 0 and hidden_ere is not None:
        # the line number of the Nth shown line from the end; the bytes before it are skipped
        count = (f'first=$({log} | grep -a -n -v -E -e {q(hidden_ere)} | tail -n {n} | head -n 1 | cut -d: -f1)\n'
                 'if [ -z "$first" ]; then n=0; else\n'
                 f'  n=$((size - $({log} | head -n $((first - 1)) | wc -c)))\n'
                 'fi\n')
    if n == 0 and whole_partial:
        # the last byte is a newline (or the log is empty): start at the end; else at the partial line's start
        count = (f'nl=$({log} | tail -c 1 | wc -l)\n'
                 f'n=0; [ "$nl" = 1 ] || n=$({log} | tail -n 1 | wc -c)\n')
    return (f"D={path_word(run_dir)}\n" + NO_RUN_DIR +
            'size=$(stat -c %s -- "$D/output.log" 2>/dev/null || echo 0)\n'
            + count +
            f"printf '{wire.START} %s\\n' \"$((size - n))\"\n")


def tail_chunk_script(run_dir: str, offset: int, max_bytes: int = CHUNK_BYTES) -> str:
    """State first, then up to `max_bytes` of the log from byte `offset`.

    Order matters: the state is read before the bytes, so once it says "not alive" the bytes read after it are
    everything the job ever wrote (up to max_bytes).
    """
    return (PRELUDE + f"D={path_word(run_dir)}\n" + NO_RUN_DIR +
            'dflash_state "$D"\n'
            f'tail -c +{int(offset) + 1} -- "$D/output.log" 2>/dev/null | head -c {int(max_bytes)}\n')




def joined_script(run_dir: str, ere: str, tail_bytes: int = 4096) -> str:
    """probe_script's state and log tail, with `DFLASH_JOINED` among the header lines once a line of the log
    matches the extended regex `ere` (read after the state: a run that ended had written that line before)."""
    return (PRELUDE + f"D={path_word(run_dir)}\n" + PRINT_NOW + NO_RUN_DIR +
            'dflash_state "$D"\n'
            f'grep -a -q -E -e {q(ere)} -- "$D/output.log" 2>/dev/null && echo {wire.JOINED}\n'
            f"echo {wire.LOG}\n"
            f'tail -c {int(tail_bytes)} -- "$D/output.log" 2>/dev/null || true\n')
