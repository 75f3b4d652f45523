"""PURE: what every remote script shares -- the quoting of values into shell words, the prelude of helpers the
scripts start with, and the argv/string that carries a script to the target. The scripts themselves:
launch_scripts.py, stop_scripts.py, read_scripts.py.

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

import shlex

from dflash_ops import wire
from dflash_ops.spec import CT_BASE_ENV, Target

q = shlex.quote
RUN_ID_GLOB = "-" + "[0-9]" * 8 + "T" + "[0-9]" * 6 + "-" + "[0-9a-f]" * 4

# Shared helpers. A run is alive when its recorded pid (the wrapper: group leader) is not a zombie, runs as the
# user this script runs as (real and effective uid), and carries the marker (wire.MARKER_VAR=<run id>) as one
# whole entry of /proc/<pid>/environ: a reused pid never matches (zombies have no environ). Every such process
# belongs to the run, whatever its group or session (a child that called setsid keeps it): `dflash_procs` finds
# them all, also for a run whose directory was deleted; `stop` signals them and the wrapper's group, and launches
# are refused while any lives. An environment is any process's to write: it is read split at NULs only (a value
# may hold newlines), a run id must have a run id's shape, and another user's process is never the run's.
_PRELUDE = r"""set -u
dflash_mine() {
  local k r e _
  while read -r k r e _; do [ "$k" = Uid: ] && { [ "$r" = "$EUID" ] && [ "$e" = "$EUID" ]; return; }; done \
    2>/dev/null < "/proc/$1/status"
  return 1
}
# glob patterns with the characters spelled out (no ranges: no locale widens them), not a regex: a regex is compiled
# at every call, and listings ask this of every run dir
dflash_is_id() {
  local n=${1%-*-*} t=${1#"${1%-*-*}"}
  case $t in __STAMP_TAG__) ;; *) return 1;; esac
  case $n in ''|[!__ALNUM__]*|*[!__ALNUM__._-]*) return 1;; esac
  [ "${#n}" -le 64 ]
}
dflash_marked() { dflash_mine "$1" && grep -qzxF -- "__MARKER__=$2" "/proc/$1/environ" 2>/dev/null; }
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
  local rec pid kv line f
  local -A id=() dir=()
  # one record per NUL: "/proc/<pid>/environ:<entry>", the entry whole, newlines and all
  while IFS= read -r -d '' rec; do
    pid=${rec#/proc/}; pid=${pid%%/*}; kv=${rec#/proc/"$pid"/environ:}
    case $pid in ''|*[!0-9]*) continue;; esac
    case $kv in
      __MARKER__=*) id[$pid]=${kv#__MARKER__=} ;;
      __RUN_DIR_VAR__=*) dir[$pid]=${kv#__RUN_DIR_VAR__=} ;;
    esac
  done < <(grep -Hazx -e '__MARKER__=.*' -e '__RUN_DIR_VAR__=.*' /proc/[0-9]*/environ 2>/dev/null)
  [ "${#id[@]}" -gt 0 ] || return 0    # bash < 4.4 calls an empty "${!id[@]}" unbound under set -u
  for pid in "${!id[@]}"; do
    dflash_is_id "${id[$pid]}" || continue
    dflash_mine "$pid" || continue
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
# A run that exited on SIGTERM/SIGINT after its checkpoint: the JSON of the last stopped line of its log, unless a
# resume's line follows it (that stop was an earlier attempt's: the attempt that exited now wrote none).
dflash_kept() {
  local d=$1 ex= line
  [ -r "$d/exit_code" ] && read -r ex < "$d/exit_code"
  case $ex in __STOP_EXITS__) ;; *) return 0;; esac
  line=$(tail -c 65536 -- "$d/output.log" 2>/dev/null | grep -a -F -e '__STOPPED__{' -e '__RESUMED__{' | tail -n 1 \
    | head -c 4096)
  case $line in *'__RESUMED__{'*) return 0;; esac
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


_ALNUM = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
_DIGIT, _HEX = "[0123456789]", "[0123456789abcdef]"
# names.RUN_ID_RE as a POSIX extended regex, anchored: what a run id read from a remote file or environment must be
RUN_ID_ERE = "^[A-Za-z0-9][A-Za-z0-9._-]{0,63}-[0-9]{8}T[0-9]{6}-[0-9a-f]{4}$"
PRELUDE = _filled(_PRELUDE, ALNUM=_ALNUM, STAMP_TAG="-" + _DIGIT * 8 + "T" + _DIGIT * 6 + "-" + _HEX * 4,
                  MARKER=wire.MARKER_VAR, RUN_DIR_VAR=wire.RUN_DIR_VAR,
                  STATE=wire.STATE, KEPT=wire.KEPT,
                  STOPPED=wire.STOPPED_PREFIX, RESUMED=wire.RESUMED_PREFIX, STOP_EXITS="|".join(map(str, wire.STOP_EXITS)))
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
