"""PURE builders of the read-only scripts: the listing of runs, a run's probe, its log's tail, its processes.
Quoting and the shared prelude: shellcmd.py."""

from __future__ import annotations

from dflash_ops import names, wire
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


# The marked processes, printed as PROC_LINES print them and kept in LIVE["<run id> <pid>"]: a run is alive when
# its recorded pid is among them (what dflash_state's dflash_marked asks, for every run at once). LIVE_ID[<run id>]:
# some process of it lives.
LIVE_MAP = ('declare -A LIVE=() LIVE_ID=()\n'
            'while read -r p id sid; do\n'
            f"  printf '{wire.PROC} %s %s %s\\n' \"$p\" \"$id\" \"$sid\"; LIVE[\"$id $p\"]=1; LIVE_ID[$id]=1\n"
            'done < <(dflash_procs)\n')

# One `find` pass for the times and sizes dflash_state reads with a `stat` per run: ENDED_X/ENDED_S[<run id>]
# (mtime of exit_code / stopped), SIZE[<run id>] (of output.log). Records end at NULs, so no name forges one.
def _stat_map(where: str) -> str:
    return ('declare -A ENDED_X=() ENDED_S=() SIZE=()\n'
            'while IFS= read -r -d \'\' rec; do\n'
            '  t=${rec%% *}; rest=${rec#* }; sz=${rest%% *}; p=${rest#* }; id=${p%/*}; id=${id##*/}; t=${t%.*}\n'
            '  case ${p##*/} in\n'
            '    exit_code) ENDED_X[$id]=$t;; stopped) ENDED_S[$id]=$t;; output.log) SIZE[$id]=$sz;;\n'
            '  esac\n'
            f'done < <(find -L {where} \\( -name exit_code -o -name stopped -o -name output.log \\)'
            " -printf '%T@ %s %h/%f\\0' 2>/dev/null)\n")


STAT_MAP = _stat_map('"$RUNS"/ -mindepth 2 -maxdepth 2')
# a limited listing: the dirs it shows only (SHOW and LIVE_ID, as NEWEST_MAP leaves them), in "${shown[@]}"
STAT_MAP_SHOWN = ('shown=()\n'
                  'declare -A seen=()\n'
                  'for id in ${SHOW[@]+"${!SHOW[@]}"} ${LIVE_ID[@]+"${!LIVE_ID[@]}"}; do\n'
                  '  [ -z "${seen[$id]-}" ] && [ -d "$RUNS/$id" ] && { seen[$id]=1; shown+=("$RUNS/$id"); }\n'
                  'done\n'
                  'declare -A ENDED_X=() ENDED_S=() SIZE=()\n'
                  '[ "${#shown[@]}" -gt 0 ] && ' + _stat_map('"${shown[@]}" -mindepth 1 -maxdepth 1')
                  .split("declare -A ENDED_X=() ENDED_S=() SIZE=()\n", 1)[1])

# dflash_state's line for "$d" from the maps above, with shell builtins only (no process per run).
STATE_FROM_MAPS = (
    '  id=${d##*/}; p=; pid=-; ex=-; st=0; ended=-; alive=0\n'
    '  [ -r "$d/pid" ] && read -r p < "$d/pid"\n'
    '  case $p in \'\'|*[!0-9]*) ;; *) pid=$p; [ -n "${LIVE["$id $p"]-}" ] && alive=1;; esac\n'
    '  if [ -r "$d/exit_code" ]; then\n'
    '    read -r ex < "$d/exit_code" || ex=-; case $ex in \'\'|*[!0-9]*) ex=-;; esac; ended=${ENDED_X[$id]--}\n'
    '  fi\n'
    '  if [ -e "$d/stopped" ]; then st=1; [ "$ended" = - ] && ended=${ENDED_S[$id]--}; fi\n'
    f"  printf '{wire.STATE} %s %s %s %s %s %s %s\\n' \"$id\" \"$alive\" \"$pid\" \"$ex\" \"$st\" \"$ended\""
    ' "${SIZE[$id]-0}"\n')

# run.json on one line, read with `read -N` (a builtin: no head/tr per run)
RUN_JSON_LINE = ('  j=; [ -r "$d/run.json" ] && IFS= read -r -d \'\' -N 65536 j < "$d/run.json"\n'
                 f"  printf '{wire.RUN_JSON} %s\\n' \"${{j//$'\\n'/}}\"\n")


# With a limit: SHOW[<run id>] for the newest "$n" run dirs by stamp and tag (one `sort`), the others counted
NEWEST_MAP = ('keys=()\n'
              f'for d in "$RUNS"/*{RUN_ID_GLOB}; do\n'
              + RUN_DIR_ONLY +
              '  keys+=("${d: -20} ${d##*/}")\n'
              'done\n'
              'declare -A SHOW=()\n'
              '[ "${#keys[@]}" -gt 0 ] && while read -r _k id; do SHOW[$id]=1; done < '
              '<(printf \'%s\\n\' "${keys[@]}" | sort | tail -n "$n")\n'
              'listed=0\n')


def _also(ref: str) -> str:
    """SHOW the run `ref` names: that id, or the newest directory of that name (the glob's order is theirs)."""
    if names.is_run_id(ref):
        return f"SHOW[{q(ref)}]=1\n"
    return (f'c=( "$RUNS"/{q(names.run_name(ref))}{RUN_ID_GLOB} )\n'
            'for ((i = ${#c[@]} - 1; i >= 0; i--)); do [ -d "${c[i]}" ] && { SHOW[${c[i]##*/}]=1; break; }; done\n')


def list_script(runs_dir: str, newest: int | None = None, also: str | None = None) -> str:
    """Every run dir under `runs_dir` (RUN_DIR_ONLY): a DFLASH_RUN state line followed by a DFLASH_JSON line
    (run.json on one line), and its DFLASH_KEPT line if it has one.

    With `newest`: only the runs a process of which lives and the `newest` newest others (plus one per live run,
    so that the `newest` newest finished runs are among them); the others are counted, unread, on a
    `DFLASH_OLDER <count>` line. `also`: a run id, or a run name (its newest run), listed however old.

    Its cost does not grow by a process per run: one scan of the processes, one `find` for the times and sizes,
    then shell builtins per run (dflash_kept reads a log only for a run that exited on SIGTERM/SIGINT)."""
    limited = newest is not None
    return (PRELUDE + f"RUNS={path_word(runs_dir)}\n"
            + PRINT_NOW + LIVE_MAP +
            '[ -d "$RUNS" ] || exit 0\n'
            + (f'n=$(( {int(newest)} + ${{#LIVE_ID[@]}} ))\n' + NEWEST_MAP if limited else "")
            + (_also(also) if limited and also is not None else "")
            + (STAT_MAP_SHOWN if limited else STAT_MAP) +
            f'for d in "$RUNS"/*{RUN_ID_GLOB}; do\n'
            # a limited listing looks a name up before anything else: most are not shown
            + ('  [ -n "${SHOW[${d##*/}]-}${LIVE_ID[${d##*/}]-}" ] || continue\n' if limited else "")
            + RUN_DIR_ONLY
            + ('  listed=$((listed + 1))\n' if limited else "")
            + STATE_FROM_MAPS + RUN_JSON_LINE +
            '  dflash_kept "$d"\n'
            "done\n"
            + (f'echo "{wire.OLDER} $(( ${{#keys[@]}} - listed ))"\n' if limited else ""))


def find_script(runs_dir: str, ref: str | None) -> str:
    """The listing (list_script's lines) of the one run `ref` names, found by directory names alone: the run of
    that id, or the newest run of that name (run ids sort by their UTC stamp, then their tag), or with None the
    newest run of all; and the marked processes of runs whose directory is gone (parse.orphan), of which the
    caller picks those `ref` names. Reads the files of that one run only. `ref` must be a run id or a valid run
    name (lifecycle.check_ref)."""
    if ref is not None and names.is_run_id(ref):
        pick = f"best=$RUNS/{q(ref)}\n"
    elif ref is not None:
        # one name: the glob's order (stamp, then tag) is the runs' order; the newest is the last directory
        pick = (f'c=( "$RUNS"/{q(ref)}{RUN_ID_GLOB} ); best=\n'
                'for ((i = ${#c[@]} - 1; i >= 0; i--)); do [ -d "${c[i]}" ] && { best=${c[i]}; break; }; done\n')
    else:
        # every name: the newest by stamp and tag (an id's last 20 characters, compared as strings); a newest that
        # is no run directory is set aside and the pick made again (cheap compares per entry, one check per pick)
        pick = ("declare -A bad=(); best=\n"
                "while :; do\n"
                "  best=; key=\n"
                f'  for d in "$RUNS"/*{RUN_ID_GLOB}; do\n'
                '    k=${d: -20}\n'
                '    [[ -z $best || $k > $key || ( $k == "$key" && $d > $best ) ]] && [ -z "${bad[$d]-}" ] && '
                '{ best=$d; key=$k; }\n'
                "  done\n"
                '  [ -z "$best" ] || { [ -d "$best" ] && dflash_is_id "${best##*/}"; } && break\n'
                '  bad[$best]=1\n'
                "done\n")
    return (PRELUDE + f"RUNS={path_word(runs_dir)}\n" + PRINT_NOW +
            'while read -r p id sid; do\n'
            f"  [ -d \"$RUNS/$id\" ] || printf '{wire.PROC} %s %s %s\\n' \"$p\" \"$id\" \"$sid\"\n"
            'done < <(dflash_procs)\n'
            '[ -d "$RUNS" ] || exit 0\n'
            + pick +
            'd=${best:-}\n'
            '[ -n "$d" ] && [ -d "$d" ] && dflash_is_id "${d##*/}" || exit 0\n'
            'dflash_state "$d"\n'
            + RUN_JSON_LINE.replace("  ", "", 1).replace("\n  printf", "\nprintf") +
            'dflash_kept "$d"\n')


def kept_script(run_dir: str) -> str:
    """The run's `DFLASH_KEPT` line, when it ended on SIGTERM/SIGINT after its checkpoint (else nothing)."""
    return PRELUDE + f"D={path_word(run_dir)}\n" + '[ -d "$D" ] && dflash_kept "$D"\nexit 0\n'


def probe_script(run_dir: str, tail_bytes: int = LOG_TAIL_BYTES, since: int | None = None) -> str:
    """State of one run, then `DFLASH_LOG` and the last `tail_bytes` of its log; with `since`, the first
    `tail_bytes` from that byte offset instead (a resumed attempt's lines, not its earlier attempts')."""
    return PRELUDE + probe_body(run_dir, tail_bytes, None if since is None else str(int(since)))


def probe_body(run_dir: str, tail_bytes: int, since: str | None = None) -> str:
    """probe_script's lines; `since` is a shell word for the byte offset (a number, or `"$off"` in a script that
    computed it)."""
    read = (f'tail -c {int(tail_bytes)} -- "$D/output.log"' if since is None else
            f'tail -c +$(( {since} + 1 )) -- "$D/output.log" | head -c {int(tail_bytes)}')
    return (f"D={path_word(run_dir)}\n" + PRINT_NOW + NO_RUN_DIR +
            'dflash_state "$D"\n'
            f"echo {wire.LOG}\n"
            f'{read} 2>/dev/null || true\n')


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
