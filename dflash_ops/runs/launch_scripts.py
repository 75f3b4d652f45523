"""PURE builders of the launch's scripts: the launch (its run dir, refusals, pre steps, the detached wrapper and
the first probe), its read-only check, and rank 0's rendezvous port. Quoting and the shared prelude: shellcmd.py."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

from dflash_ops import wire
from dflash_ops.runs.read_scripts import LOG_TAIL_BYTES, probe_body
from dflash_ops.runs.shellcmd import PRELUDE, RUN_ID_GLOB, path_word, q, spec_word
from dflash_ops.spec import RunSpec


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


PID_RESERVE_BYTES = 24          # the pid file's room, taken before the job starts (a pid has at most 7 digits)
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


def _locked_head(spec: RunSpec) -> list[str]:
    """The prelude, "$RUNS" made, and `flock` on `<runs>/.launch.lock`: launches and resumes in one runs dir take
    turns (fd 9 is closed for the job, so the lock is released when the script ends)."""
    return [
        PRELUDE,
        f"RUNS={path_word(spec.runs_dir)}\n",
        f'mkdir -p -- "$RUNS" || {{ printf \'{wire.ERROR} cannot create %s\\n\' "$RUNS"; exit {wire.EXIT_FAILED}; }}\n',
        'if command -v flock >/dev/null 2>&1; then\n'
        f'  exec 9>>"$RUNS/.launch.lock" && flock -w 15 9 || {{ echo "{wire.REFUSED} lock -"; exit {wire.EXIT_REFUSED}; }}\n'
        'fi\n',
    ]


def _reserve(rd: str, fail: str) -> list[str]:
    """Room for the exit status and the pid file, taken before the job starts (a full disk fails here, `fail`)."""
    return [
        f"err=$({{ printf '\\n%.0s' {{1..{RC_RESERVE_BYTES}}} > {rd}/{RC_RESERVE}; }} 2>&1)"
        f" || {fail} \"cannot reserve room for the exit status: ${{err##*: }}\"\n",
        f"err=$({{ printf '%{PID_RESERVE_BYTES - 1}s\\n' '' > {rd}/pid.tmp; }} 2>&1)"
        f" || {fail} \"cannot write the pid file: ${{err##*: }}\"\n",
    ]


def _start_job(spec: RunSpec, fail: str) -> list[str]:
    """Start the detached wrapper in the run dir, its log appended to; record its pid; `DFLASH_LAUNCHED <pid>`.
    `fail` ends the script on an error."""
    rd = path_word(spec.run_dir)
    return [
        f"cd -- {rd} || {fail} 'cannot enter the run dir'\n",
        f"{wire.MARKER_VAR}={q(spec.run_id)} {wire.RUN_DIR_VAR}=\"$RUNS\"/{q(spec.run_id)}"
        f" nohup setsid bash -c {q(wrapper_script(spec))} dflash-run \"$PWD\""
        " >>output.log 2>&1 </dev/null 9>&- &\n",
        "pid=$!\n",
        # between fork and exec the child's environ lacks the marker: hold the lock until it shows (<= 2 s)
        f"i=0; while [ $i -lt 200 ] && kill -0 \"$pid\" 2>/dev/null && ! dflash_marked \"$pid\" {q(spec.run_id)};"
        " do sleep 0.01; i=$((i+1)); done\n",
        # a job whose pid cannot be recorded could not be told from a stranger later: end it (ours, just started)
        # (in place through fd 3: bash sends a `1<>` of a builtin inside `$(...)` to the capture instead)
        "if ! err=$({ { printf '%s\\n' \"$pid\" >&3; } 3<> pid.tmp && truncate -s $(( ${#pid} + 1 )) -- pid.tmp"
        " && mv -f -- pid.tmp pid; } 2>&1); then\n"
        '  kill -KILL -- "-$pid" 2>/dev/null\n'
        f'  while read -r p i s; do [ "$i" = {q(spec.run_id)} ] && kill -KILL "$p" 2>/dev/null; done < <(dflash_procs)\n'
        f'  {fail} "cannot write the pid file: ${{err##*: }}"\n'
        "fi\n",
        f"printf '{wire.LAUNCHED} %s\\n' \"$pid\"\n",
    ]


def _probe_after(spec: RunSpec, probe_after_s: float | None, since: str | None = None) -> list[str]:
    """With `probe_after_s`: release the lock, wait that long or until the job has ended, then probe it."""
    if probe_after_s is None:
        return []
    tenths = max(0, math.ceil(float(probe_after_s) * 10))
    return ["exec 9>&-\n",
            f'i=0; while [ $i -lt {tenths} ] && dflash_marked "$pid" {q(spec.run_id)}; do sleep 0.1; i=$((i+1)); done\n',
            probe_body(spec.run_dir, LOG_TAIL_BYTES, since)]


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
        *_locked_head(spec),
        _alive_loop(spec.name, "alive"),
        *(PRE_BUILDERS[step](spec) for step in spec.pre),
        f"mkdir -- {rd} || {{ printf '{wire.ERROR} cannot create %s\\n' {rd}; exit {wire.EXIT_FAILED}; }}\n",
        # from here on a failure (a full disk) removes what this launch created: no phantom run is left behind
        f"dflash_fail() {{ rm -rf -- {rd}; printf '{wire.ERROR} %s\\n' \"$1\"; exit {wire.EXIT_FAILED}; }}\n",
        f"err=$({{ printf '%s%s}}\\n' {q(run_json_prefix(spec))} \"$(date +%s)\" > {rd}/run.json.tmp"
        f" && mv -f -- {rd}/run.json.tmp {rd}/run.json; }} 2>&1) || dflash_fail \"cannot write run.json: ${{err##*: }}\"\n",
        # The pid file's room is taken now (rewritten in place once the job has its pid), then the log is proven
        # writable (a line written, then cut away: the log holds the job's bytes alone), so that a disk with room
        # for the run's files but not for its log starts nothing rather than a job that can never write.
        *_reserve(rd, "dflash_fail"),
        f"err=$({{ echo 'log check' > {rd}/output.log && : > {rd}/output.log; }} 2>&1)"
        f" || dflash_fail \"cannot write the log: ${{err##*: }}\"\n",
        *_start_job(spec, "dflash_fail"),
        *_probe_after(spec, probe_after_s),
    ]
    return "".join(parts)


ATTEMPTS = "attempts"      # <run dir>/attempts/<N>/: attempt N's run.json, pid, exit_code and stopped, kept by a resume
ATTEMPT_RECORDS = ("run.json", "pid", "exit_code", "stopped")


def resume_script(spec: RunSpec, probe_after_s: float | None = None, checkpoints: str | None = None) -> str:
    """Start the run `spec` again in its own run dir, as launch_script starts a run, under the same lock.

    Refused (exit 5) while a process of the run lives (`DFLASH_REFUSED running <id>`) or of another run of its
    name (`alive`), and, with `checkpoints` (the trainer's run dir, as the job sees it), where it holds no
    `ckpt/step_<N>` directory (`nockpt`); a run dir that is not there is DFLASH_MISSING (exit 3). Nothing the run
    had is removed: the last attempt's records (ATTEMPT_RECORDS) are copied to `attempts/<N>/` before they are
    replaced, and the log is appended to, after a `DFLASH_RESUMED {"attempt": N+1, "at": <epoch>}` line (which
    proves it writable). Prints `DFLASH_START <offset>` (the new attempt's first byte of the log) and
    `DFLASH_LAUNCHED <pid>`; with `probe_after_s`, the probe reads the log from that offset.
    """
    rd, rid = path_word(spec.run_dir), q(spec.run_id)
    check = ""
    if checkpoints is not None:
        check = (f"found=; for c in {path_word(checkpoints)}/ckpt/step_*; do\n"
                 '  case ${c##*/step_} in \'\'|*[!0-9]*) ;; *) [ -d "$c" ] && found=1;; esac\n'
                 "done\n"
                 f"[ -n \"$found\" ] || {{ printf '{wire.REFUSED} nockpt %s\\n' {rid}; exit {wire.EXIT_REFUSED}; }}\n")
    keep = " ".join(ATTEMPT_RECORDS)
    parts = [
        *_locked_head(spec),
        f'[ -d {rd} ] || {{ echo {wire.MISSING}; exit {wire.EXIT_MISSING}; }}\n',
        f'while read -r p i s; do [ "$i" = {rid} ] || continue\n'
        f"  printf '{wire.REFUSED} running %s\\n' {rid}; exit {wire.EXIT_REFUSED}\n"
        "done < <(dflash_procs)\n",
        _alive_loop(spec.name, "alive"),
        check,
        *(PRE_BUILDERS[step](spec) for step in spec.pre),
        f'n=1; while [ -e {rd}/{ATTEMPTS}/$n ]; do n=$((n+1)); done; A={rd}/{ATTEMPTS}/$n\n',
        # until the records are replaced, a failure leaves the run as it was
        f"dflash_undo() {{ rm -rf -- \"$A\"; rm -f -- {rd}/run.json.tmp {rd}/pid.tmp;"
        f" printf '{wire.ERROR} %s\\n' \"$1\"; exit {wire.EXIT_FAILED}; }}\n",
        f"err=$({{ mkdir -p -- \"$A\" && for f in {keep}; do [ ! -e {rd}/$f ] || cp -p -- {rd}/$f \"$A\"/ || exit 1;"
        f" done; }} 2>&1) || dflash_undo \"cannot keep the last attempt's records: ${{err##*: }}\"\n",
        f"err=$({{ printf '%s%s}}\\n' {q(run_json_prefix(spec))} \"$(date +%s)\" > {rd}/run.json.tmp; }} 2>&1)"
        f" || dflash_undo \"cannot write run.json: ${{err##*: }}\"\n",
        *_reserve(rd, "dflash_undo"),
        f"err=$({{ printf '%s{{\"attempt\": %s, \"at\": %s}}\\n' {q(wire.RESUMED_PREFIX)} \"$((n + 1))\" \"$(date +%s)\""
        f" >> {rd}/output.log; }} 2>&1) || dflash_undo \"cannot write the log: ${{err##*: }}\"\n",
        # the records are replaced: from here on a failure leaves them in "$A"
        f"dflash_fail() {{ printf '{wire.ERROR} %s\\n' \"$1\"; exit {wire.EXIT_FAILED}; }}\n",
        f"rm -f -- {rd}/exit_code {rd}/stopped {rd}/pid && mv -f -- {rd}/run.json.tmp {rd}/run.json"
        " || dflash_fail 'cannot replace the records of the last attempt'\n",
        f"off=$(stat -c %s -- {rd}/output.log) || dflash_fail 'cannot read the size of the log'\n",
        f"printf '{wire.START} %s\\n' \"$off\"\n",
        *_start_job(spec, "dflash_fail"),
        *_probe_after(spec, probe_after_s, '"$off"'),
    ]
    return "".join(parts)


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

