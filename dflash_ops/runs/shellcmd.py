"""PURE builders of the bash scripts run on a target, and of the argv/string that carries them.

Quoting contract: every value from a user, an inventory or a runbook enters a script only through `shlex.quote`
(or `shlex.join` for an argv). Fixed shell text is ours. The resulting layers are:

    ssh channel string = shlex.join(target_argv)                      (parse 1: the remote login shell)
    target_argv        = [pct, exec, CT, --, env, -i, ..., bash, -c, SCRIPT]  or  [bash, -c, SCRIPT]
    SCRIPT             = "... nohup setsid bash -c " + quote(WRAPPED)  (parse 2: bash -c SCRIPT)
    WRAPPED            = "... " + shlex.join(argv)                      (parse 3: bash -c WRAPPED)

Scripts report on stdout with lines tagged `DFLASH_<WORD>` and with exit codes, both named in `wire.py`; `parse.py`
reads them back.
"""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Sequence

from dflash_ops import wire
from dflash_ops.spec import CT_BASE_ENV, RunSpec, Target

q = shlex.quote
RUN_ID_GLOB = "-" + "[0-9]" * 8 + "T" + "[0-9]" * 6 + "-" + "[0-9a-f]" * 4
LOG_TAIL_BYTES = 65536
CHUNK_BYTES = 1 << 20

# Shared helpers. A run is alive when its recorded pid (the wrapper: group leader) is not a zombie and carries
# the marker (wire.MARKER_VAR=<run id>) in /proc/<pid>/environ: a reused pid never matches (zombies have no environ).
# Every process that carries the marker belongs to the run, whatever its group or session (a child that called
# setsid keeps it): `dflash_procs` finds them all, also for a run whose directory was deleted; `stop` signals
# them and the wrapper's group, and launches are refused while any lives.
_PRELUDE = r"""set -u
dflash_marked() { grep -qzxF -- "__MARKER__=$2" "/proc/$1/environ" 2>/dev/null; }
dflash_group_alive() {
  local s line f p
  dflash_marked "$1" "$2" && return 0
  for s in /proc/[0-9]*/stat; do
    read -r line < "$s" 2>/dev/null || continue
    read -r -a f <<< "${line##*) }"
    [ "${f[2]:-}" = "$1" ] || continue
    p=${s#/proc/}; p=${p%/stat}
    dflash_marked "$p" "$2" && return 0
  done
  return 1
}
# "PID RUN_ID SID" for every live process of a run of "$RUNS" (see above). A process belongs to "$RUNS" when its
# __RUN_DIR_VAR__ is "$RUNS/<its run id>", or, for a run started without that variable, when that directory
# exists. One grep reads every environ; zombies and kernel threads have none.
dflash_procs() {
  local line pid kv f
  local -A id=() dir=()
  while IFS= read -r line; do
    pid=${line#/proc/}; pid=${pid%%/*}; kv=${line#*/environ:}
    case $kv in
      __MARKER__=*) id[$pid]=${kv#__MARKER__=} ;;
      __RUN_DIR_VAR__=*) dir[$pid]=${kv#__RUN_DIR_VAR__=} ;;
    esac
  done < <(grep -Hazx -e '__MARKER__=.*' -e '__RUN_DIR_VAR__=.*' /proc/[0-9]*/environ 2>/dev/null \
           | tr '\0' '\n')
  [ "${#id[@]}" -gt 0 ] || return 0    # bash < 4.4 calls an empty "${!id[@]}" unbound under set -u
  for pid in "${!id[@]}"; do
    if [ -n "${dir[$pid]-}" ]; then [ "${dir[$pid]}" = "$RUNS/${id[$pid]}" ] || continue
    else [ -d "$RUNS/${id[$pid]}" ] || continue; fi
    read -r line < "/proc/$pid/stat" 2>/dev/null || continue
    read -r -a f <<< "${line##*) }"
    [ "${f[0]}" = Z ] && continue
    printf '%s %s %s\n' "$pid" "${id[$pid]}" "${f[3]}"
  done
}
dflash_pid() { local p=; [ -r "$1/pid" ] && read -r p < "$1/pid"; case $p in ''|*[!0-9]*) echo -;; *) echo "$p";; esac; }
dflash_state() {
  local d=$1 pid alive=0 ex=- st=0 ended=- size
  pid=$(dflash_pid "$d")
  [ "$pid" != - ] && dflash_marked "$pid" "${d##*/}" && alive=1
  if [ -r "$d/exit_code" ]; then
    read -r ex < "$d/exit_code" || ex=-; case $ex in ''|*[!0-9]*) ex=-;; esac
    ended=$(stat -c %Y -- "$d/exit_code" 2>/dev/null || echo -)
  fi
  if [ -e "$d/stopped" ]; then st=1; [ "$ended" = - ] && ended=$(stat -c %Y -- "$d/stopped" 2>/dev/null || echo -); fi
  size=$(stat -c %s -- "$d/output.log" 2>/dev/null || echo 0)
  printf '__STATE__ %s %s %s %s %s %s %s\n' "${d##*/}" "$alive" "$pid" "$ex" "$st" "$ended" "$size"
}
# A run that exited on SIGTERM/SIGINT after its checkpoint: the JSON of the last stopped line of its log.
dflash_kept() {
  local d=$1 ex= line
  [ -r "$d/exit_code" ] && read -r ex < "$d/exit_code"
  case $ex in __STOP_EXITS__) ;; *) return 0;; esac
  line=$(tail -c 65536 -- "$d/output.log" 2>/dev/null | grep -a -F -e '__STOPPED__{' | tail -n 1 | head -c 4096)
  [ -n "$line" ] && printf '__KEPT__ %s %s\n' "${d##*/}" "${line#*__STOPPED__}"
  return 0
}
"""


def _filled(template: str, **words: str) -> str:
    """`template` with each `__NAME__` token replaced by its word (bash's own braces stay as they are)."""
    for name, word in words.items():
        token = f"__{name}__"
        assert token in template, token
        template = template.replace(token, word)
    return template


PRELUDE = _filled(_PRELUDE, MARKER=wire.MARKER_VAR, RUN_DIR_VAR=wire.RUN_DIR_VAR, STATE=wire.STATE, KEPT=wire.KEPT,
                  STOPPED=wire.STOPPED_PREFIX, STOP_EXITS="|".join(map(str, wire.STOP_EXITS)))
# The lines that end a script whose run dir `$D` is not there, or print the time on the target.
NO_RUN_DIR = f'[ -d "$D" ] || {{ echo {wire.MISSING}; exit {wire.EXIT_MISSING}; }}\n'
PRINT_NOW = f"printf '{wire.NOW} %s\\n' \"$(date +%s)\"\n"


def path_word(path: str) -> str:
    """`path` as ONE shell word. `~` or `~/rest` becomes `"$HOME"/'rest'` (only the fixed `"$HOME"` is unquoted), so
    the remote shell puts it under the login user's home; any other path is quoted whole (`~bob` stays literal)."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        return '"$HOME"/' + (q(path[2:]) if path[2:] else "")
    return q(path)


def spec_word(value: str, run_dir: str) -> str:
    """A runbook value (argv element, env value, workdir) as ONE word of the wrapper script. With a home-relative
    run dir, each occurrence of it becomes `"$1"` (the wrapper's first argument: the absolute run dir, so the job
    gets an absolute `{run_dir}`), every other piece is quoted."""
    if not run_dir.startswith("~") or run_dir not in value:
        return q(value)
    return '"$1"'.join(q(piece) if piece else "" for piece in value.split(run_dir))


def target_argv(target: Target, script: str) -> list[str]:
    """The argv that runs `script` on the target: through `pct exec` with a clean env for a container."""
    if target.container is None:
        return ["bash", "-c", script]
    env = [f"{k}={v}" for k, v in CT_BASE_ENV]
    return [target.host.pct, "exec", target.container.ctid, "--", "env", "-i", *env, "bash", "-c", script]


def command_string(argv: Sequence[str]) -> str:
    """The one string sent over SSH (parsed once by the remote login shell)."""
    return shlex.join(argv)


def run_json_prefix(spec: RunSpec) -> str:
    """run.json without its closing brace; the script appends `"started_at": <remote epoch>}`."""
    body = {"run_id": spec.run_id, "name": spec.name, "runbook": spec.runbook, "argv": list(spec.argv),
            "workdir": spec.workdir, "env_keys": [k for k, _ in spec.env], "host": spec.host, "ct": spec.ct}
    if spec.multinode is not None:
        body.update(node_rank=spec.node_rank, multinode=spec.multinode.as_dict())
    return json.dumps(body, ensure_ascii=True)[:-1] + ', "started_at": '


def wrapper_script(spec: RunSpec) -> str:
    """What the detached `bash -c WRAPPED dflash-run RUN_DIR` runs: env, the argv, then the exit code via tmp+rename.

    `$1` is the absolute run dir (a positional parameter: no runbook `export` can change it).
    `trap : TERM INT` makes the wrapper outlive a group SIGTERM long enough to record the job's status.
    The job starts only once the launch has recorded the wrapper's pid (`pid` holds `$$`): a launch that cannot
    write it removes the run dir instead, and the wrapper then ends before anything of the job ran (a kill alone
    could race the job's first forks). It gives up after PID_WAIT_S, with the run dir left without a pid.
    """
    rd, word = '"$1"', lambda v: spec_word(v, spec.run_dir)
    workdir = word(spec.workdir) if spec.run_dir in spec.workdir else path_word(spec.workdir)
    lines = ["trap : TERM INT",
             f'i=0; until [ -r {rd}/pid ] && read -r p < {rd}/pid && [ "$p" = "$$" ]; do',
             f'  [ -d {rd} ] && [ $i -lt {PID_WAIT_S * 100} ] || exit {wire.EXIT_FAILED}; sleep 0.01; i=$((i+1))',
             "done"]
    lines += [f"export {k}={word(v)}" for k, v in spec.env]
    lines += [f"cd -- {workdir} && {' '.join(map(word, spec.argv))}", "rc=$?", KEEP_RC,
              f'until dflash_keep_rc {rd} || [ ! -d {rd} ]; do sleep {RC_RETRY_S}; done',
              f"rm -f -- {rd}/{RC_RESERVE}",
              'exit "$rc"']
    return "\n".join(lines) + "\n"


PID_WAIT_S = 30                 # the wrapper's wait for its pid to be recorded (the launch writes it in ms)
RC_RESERVE = ".exit_code.reserve"
RC_RESERVE_BYTES = 32
RC_RETRY_S = 5
# The exit status is a few bytes, and it must survive a full disk: first the usual tmp + rename; if that cannot be
# written, the bytes reserved at launch are overwritten in place (`1<>`: no new block to allocate), cut to size
# and renamed into place; if even that fails, the wrapper keeps the status in memory and retries (above).
KEEP_RC = (
    "dflash_keep_rc() {\n"
    """  { printf '%s\\n' "$rc" > "$1"/exit_code.tmp && mv -f -- "$1"/exit_code.tmp "$1"/exit_code; } 2>/dev/null"""
    " && return 0\n"
    '  rm -f -- "$1"/exit_code.tmp\n'
    f"""  {{ printf '%s\\n' "$rc" 1<> "$1"/{RC_RESERVE} && truncate -s $(( ${{#rc}} + 1 )) -- "$1"/{RC_RESERVE}"""
    f""" && mv -f -- "$1"/{RC_RESERVE} "$1"/exit_code; }} 2>/dev/null\n"""
    "}")


def _alive_loop(name: str | None, tag: str, *, spared: str | None = None) -> str:
    """Refuse (exit 5, `DFLASH_REFUSED <tag> <run id>`) while a process of a run of "$RUNS" lives: of any run, or
    of the runs named `name`; never for the runs named `spared` (those `launch --force` stops first). A process
    counts whether it is the run's wrapper or a leftover of a run that exited, and whether or not the run's
    directory still exists (dflash_procs)."""
    match = ("" if name is None else
             f'  n=${{i%{RUN_ID_GLOB}}}; [ "$n" != "$i" ] && [ "$n" = {q(name)} ] || continue\n')
    if spared is not None:
        match += f'  n=${{i%{RUN_ID_GLOB}}}; [ "$n" != "$i" ] && [ "$n" = {q(spared)} ] && continue\n'
    return ("while read -r p i s; do\n" + match +
            f"  printf '{wire.REFUSED} {tag} %s\\n' \"$i\"; exit {wire.EXIT_REFUSED}\n"
            "done < <(dflash_procs)\n")


def cache_in_use_check(spec: RunSpec, spared: str | None = None) -> str:
    """clear_cache_step's refusal alone: while any process of a run in this runs dir lives (exit 5, refused),
    those of the runs named `spared` aside."""
    return _alive_loop(None, "cache", spared=spared)


def clear_cache_step(spec: RunSpec) -> str:
    """Refused while any process of a run in this runs dir lives; honours the runbook's TORCHINDUCTOR_CACHE_DIR."""
    env = dict(spec.env)
    set_dir = f"TORCHINDUCTOR_CACHE_DIR={q(env['TORCHINDUCTOR_CACHE_DIR'])}\n" if "TORCHINDUCTOR_CACHE_DIR" in env else ""
    return (cache_in_use_check(spec) + set_dir +
            'cache=${TORCHINDUCTOR_CACHE_DIR:-/tmp/torchinductor_$(id -un)}\n'
            f'rm -rf -- "$cache" || {{ printf \'{wire.ERROR} cannot clear %s\\n\' "$cache"; exit {wire.EXIT_FAILED}; }}\n'
            f"printf '{wire.PRE} clear_inductor_cache %s\\n' \"$cache\"\n")


PRE_BUILDERS = {"clear_inductor_cache": clear_cache_step}
# What each pre step refuses on, read-only (launch_check_script): the refusal without the effect.
PRE_CHECKS = {"clear_inductor_cache": cache_in_use_check}


def launch_check_script(spec: RunSpec, *, forced: bool = False) -> str:
    """The launch script's refusals, read-only: exit 5 (`DFLASH_REFUSED ...`) where `launch_script` would refuse --
    a live run of the name, a pre step's condition -- else print `DFLASH_OK`. For a launch of several nodes, which
    checks every node before any of them starts; the launch itself still checks, under its lock. `forced`: the
    refusals left once `launch --force` has stopped the live runs of the name (asked before it stops them)."""
    spared = spec.name if forced else None
    alive = "" if forced else _alive_loop(spec.name, "alive")
    return (PRELUDE + f"RUNS={path_word(spec.runs_dir)}\n" + alive
            + "".join(PRE_CHECKS[step](spec, spared) for step in spec.pre) + f"echo {wire.CHECKED}\n")


def launch_script(spec: RunSpec, probe_after_s: float | None = None) -> str:
    """Create the run dir, refuse a live duplicate, run pre-steps, start the job detached, print its pid.

    `flock` on `<runs>/.launch.lock` serialises launches in one runs dir (fd 9 is closed for the job so the lock
    is released when this script ends). The `cd ... || exit 1;` then `nohup ... &` on its own line avoids the
    `a && b & ` trap (which would background the whole list and hold the channel open).
    With `probe_after_s`, the same call then releases the lock, waits that long or until the job has ended,
    whichever comes first (a job that dies at once is reported then), and prints `probe_script`'s output, so
    launch-to-verified costs one round trip after the liveness wait.
    """
    rd = path_word(spec.run_dir)
    parts = [
        PRELUDE,
        f"RUNS={path_word(spec.runs_dir)}\n",
        f'mkdir -p -- "$RUNS" || {{ printf \'{wire.ERROR} cannot create %s\\n\' "$RUNS"; exit {wire.EXIT_FAILED}; }}\n',
        'if command -v flock >/dev/null 2>&1; then\n'
        f'  exec 9>>"$RUNS/.launch.lock" && flock -w 15 9 || {{ echo "{wire.REFUSED} lock -"; exit {wire.EXIT_REFUSED}; }}\n'
        'fi\n',
        _alive_loop(spec.name, "alive"),
        *(PRE_BUILDERS[step](spec) for step in spec.pre),
        f"mkdir -- {rd} || {{ printf '{wire.ERROR} cannot create %s\\n' {rd}; exit {wire.EXIT_FAILED}; }}\n",
        # from here on a failure (a full disk) removes what this launch created: no phantom run is left behind
        f"dflash_fail() {{ rm -rf -- {rd}; printf '{wire.ERROR} %s\\n' \"$1\"; exit {wire.EXIT_FAILED}; }}\n",
        f"err=$({{ printf '%s%s}}\\n' {q(run_json_prefix(spec))} \"$(date +%s)\" > {rd}/run.json.tmp"
        f" && mv -f -- {rd}/run.json.tmp {rd}/run.json; }} 2>&1) || dflash_fail \"cannot write run.json: ${{err##*: }}\"\n",
        f"err=$({{ printf '\\n%.0s' {{1..{RC_RESERVE_BYTES}}} > {rd}/{RC_RESERVE}; }} 2>&1)"
        f" || dflash_fail \"cannot reserve room for the exit status: ${{err##*: }}\"\n",
        f"cd -- {rd} || dflash_fail 'cannot enter the run dir'\n",
        f"{wire.MARKER_VAR}={q(spec.run_id)} {wire.RUN_DIR_VAR}=\"$RUNS\"/{q(spec.run_id)}"
        f" nohup setsid bash -c {q(wrapper_script(spec))} dflash-run \"$PWD\""
        " >>output.log 2>&1 </dev/null 9>&- &\n",
        "pid=$!\n",
        # between fork and exec the child's environ lacks the marker: hold the lock until it shows (<= 2 s)
        f"i=0; while [ $i -lt 200 ] && kill -0 \"$pid\" 2>/dev/null && ! dflash_marked \"$pid\" {q(spec.run_id)};"
        " do sleep 0.01; i=$((i+1)); done\n",
        # a job whose pid cannot be recorded could not be told from a stranger later: end it (ours, just started)
        "if ! err=$({ printf '%s\\n' \"$pid\" > pid.tmp && mv -f -- pid.tmp pid; } 2>&1); then\n"
        '  kill -KILL -- "-$pid" 2>/dev/null\n'
        f'  while read -r p i s; do [ "$i" = {q(spec.run_id)} ] && kill -KILL "$p" 2>/dev/null; done < <(dflash_procs)\n'
        '  dflash_fail "cannot write the pid file: ${err##*: }"\n'
        "fi\n",
        f"printf '{wire.LAUNCHED} %s\\n' \"$pid\"\n",
    ]
    if probe_after_s is not None:
        tenths = max(0, math.ceil(float(probe_after_s) * 10))
        parts += ["exec 9>&-\n",
                  f'i=0; while [ $i -lt {tenths} ] && dflash_marked "$pid" {q(spec.run_id)}; do sleep 0.1; i=$((i+1)); done\n',
                  _probe_body(spec.run_dir, LOG_TAIL_BYTES)]
    return "".join(parts)


PROC_LINES = f"dflash_procs | sed 's/^/{wire.PROC} /'\n"  # every live marked process (parse.proc_lines)


def procs_script() -> str:
    """`DFLASH_PROC <pid> <run id> <sid>` for every live process that carries a run's marker."""
    return PRELUDE + PROC_LINES


def list_script(runs_dir: str) -> str:
    """Every run dir under `runs_dir`: a DFLASH_RUN state line followed by a DFLASH_JSON line (run.json)."""
    return (PRELUDE + f"RUNS={path_word(runs_dir)}\n"
            + PRINT_NOW + PROC_LINES +
            '[ -d "$RUNS" ] || exit 0\n'
            f'for d in "$RUNS"/*{RUN_ID_GLOB}; do\n'
            '  [ -d "$d" ] || continue\n'
            '  dflash_state "$d"\n'
            f"  printf '{wire.RUN_JSON} '; {{ head -c 65536 -- \"$d/run.json\" 2>/dev/null || true; }} | tr -d '\\n'; echo\n"
            '  dflash_kept "$d"\n'
            "done\n")


def kept_script(run_dir: str) -> str:
    """The run's `DFLASH_KEPT` line, when it ended on SIGTERM/SIGINT after its checkpoint (else nothing)."""
    return PRELUDE + f"D={path_word(run_dir)}\n" + '[ -d "$D" ] && dflash_kept "$D"\nexit 0\n'


def probe_script(run_dir: str, tail_bytes: int = LOG_TAIL_BYTES) -> str:
    """State of one run, then `DFLASH_LOG` and the last `tail_bytes` of its log."""
    return PRELUDE + _probe_body(run_dir, tail_bytes)


def _probe_body(run_dir: str, tail_bytes: int) -> str:
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


# Write `stopped` (tmp + rename) unless the run already has an exit status, which it then keeps.
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


def rendezvous_script(candidates: Sequence[int], *, find_address: bool = False) -> str:
    """Rank 0's part of the rendezvous, checked where its torchrun will listen. `DFLASH_PORT <p>`: the first of
    `candidates` that no TCP socket of this network namespace uses as its local port (listening, connected or
    closing: /proc/net/tcp and tcp6), else `DFLASH_ERROR no free port` (exit 1). With `find_address`, first its
    own addresses, for multinode/rendezvous.own_ipv4: `DFLASH_IP4 <line>` per line of `ip -4 -o addr show scope
    global`, and `DFLASH_HOSTIPS <hostname -I>`."""
    ports = " ".join(str(int(p)) for p in candidates)
    found = ("{ ip -4 -o addr show scope global 2>/dev/null || true; } | while IFS= read -r l; do\n"
             f"  printf '{wire.IP4} %s\\n' \"$l\"\n"
             "done\n"
             f"printf '{wire.HOSTIPS} %s\\n' \"$(hostname -I 2>/dev/null)\"\n") if find_address else ""
    return (found + "used=' '\n"
            "while read -r _ local _; do\n"
            '  case $local in *:*) used+="$((16#${local##*:})) " ;; esac\n'
            "done < <(cat /proc/net/tcp /proc/net/tcp6 2>/dev/null)\n"
            f"for p in {ports}; do\n"
            '  case $used in *" $p "*) continue ;; esac\n'
            f"  printf '{wire.PORT} %s\\n' \"$p\"; exit 0\n"
            "done\n"
            f"echo '{wire.ERROR} no free port'; exit {wire.EXIT_FAILED}\n")


def joined_script(run_dir: str, ere: str, tail_bytes: int = 4096) -> str:
    """probe_script's state and log tail, with `DFLASH_JOINED` among the header lines once a line of the log
    matches the extended regex `ere` (read after the state: a run that ended had written that line before)."""
    return (PRELUDE + f"D={path_word(run_dir)}\n" + PRINT_NOW + NO_RUN_DIR +
            'dflash_state "$D"\n'
            f'grep -a -q -E -e {q(ere)} -- "$D/output.log" 2>/dev/null && echo {wire.JOINED}\n'
            f"echo {wire.LOG}\n"
            f'tail -c {int(tail_bytes)} -- "$D/output.log" 2>/dev/null || true\n')
