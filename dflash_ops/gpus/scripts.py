"""PURE builders of the bash that runs on the GPU-owning machine, and the parser of the kill report.

`probe_script` prints the sections `facts.parse_probe` reads (see the `facts` module docstring); `kill_script` runs
the SIGTERM -> grace -> SIGKILL ladder over a `facts.KillPlan`'s targets. Every value enters through
`shlex.quote` or as a validated int.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass

from dflash_ops.gpus.facts import APPS_QUERY, CSV_FORMAT, DEFAULT_DEV_GLOB, GPU_QUERY, KillTarget

_SELF_CHAIN = r"""
chain=""; chain_pg=""; p=$$
while [ -n "$p" ] && [ "$p" -gt 1 ] 2>/dev/null; do
  s=$(cat "/proc/$p/stat" 2>/dev/null) || break
  set -- ${s##*) }
  chain="$chain $p"; chain_pg="$chain_pg $3"; p=$2
done
"""

_PROBE_BODY = r"""
echo "@@SELF$chain"; echo "@@SELFPG$chain_pg"
if ! command -v "$smi" >/dev/null 2>&1; then
  case $smi in */*) echo "@@NOGPU $smi not found";; *) echo "@@NOGPU $smi not found on PATH";; esac
elif ! gpus=$("$smi" "$gq" "$fmt" 2>&1); then
  echo "@@NOGPU $(printf '%s' "$gpus" | head -n 1)"
else
  echo "@@GPUS"; printf '%s\n' "$gpus"
  echo "@@APPS"; apps=$("$smi" "$aq" "$fmt" 2>/dev/null) && printf '%s\n' "$apps"
fi
echo "@@CTNS"
for ct in $ctids; do printf '%s %s\n' "$ct" "$("$pct" exec "$ct" -- readlink /proc/self/ns/pid 2>/dev/null)"; done
echo "@@FDS"
fds=$(find /proc/[0-9]*/fd -maxdepth 1 \( -lname "$glob" -o -lname "$glob2" \) -printf '%h %l\n' 2>/dev/null \
      | sed 's#^/proc/\([0-9]*\)/fd #\1 #')
[ -n "$fds" ] && printf '%s\n' "$fds"
echo "@@PROCS"
pids=$({ printf '%s\n' "${apps:-}" | cut -d, -f1; printf '%s\n' "$fds" | cut -d' ' -f1; } \
       | tr -d ' ' | grep -E '^[0-9]+$' | sort -un)
pgs=" "; cands=" $(printf '%s ' $pids)"
for pid in $pids; do
  stat=$(cat "/proc/$pid/stat" 2>/dev/null) || continue
  stat=${stat//$'\n'/ }   # a comm may hold a newline: one process, one line
  nspid=$(grep -m1 '^NSpid:' "/proc/$pid/status" 2>/dev/null | tr '\t' ' ')
  cg=$(tr '\n\t' '| ' < "/proc/$pid/cgroup" 2>/dev/null)
  printf 'P\t%s\t%s\t%s\t%s\t%s\n' "$pid" "$nspid" "$cg" "$(readlink "/proc/$pid/ns/pid" 2>/dev/null)" "$stat"
  rest=${stat##*) }; set -- $rest
  printf 'L\t%s\t%s\n' "$3" "$(grep -m1 '^NSpid:' "/proc/$3/status" 2>/dev/null | tr '\t' ' ')"
  pgs="$pgs$3 "
done
# every other process of those groups: a group's signal reaches them too, so the plan must name them
echo "@@GROUPS"
if [ "$pgs" != " " ]; then
  for f in /proc/[0-9]*/stat; do
    read -r stat 2>/dev/null < "$f" || continue
    rest=${stat##*) }; set -- $rest
    pid=${f#/proc/}; pid=${pid%/stat}
    [[ "$pgs" == *" $3 "* && "$cands" != *" $pid "* ]] && printf 'M\t%s\n' "$stat"
  done
fi
echo "@@END"
"""


def _outside_view(dev_glob: str) -> str:
    """How a container's bind-mounted /dev/nvidia0 may read from the host's /proc (relative to devtmpfs, whose
    mount the host reader cannot reach): `/nvidia0`. [UNVERIFIED on PVE; compute apps remain the primary source.]"""
    return dev_glob[len("/dev"):] if dev_glob.startswith("/dev/") else dev_glob


def probe_script(*, nvidia_smi: str = "nvidia-smi", dev_glob: str = DEFAULT_DEV_GLOB,
                 pct: str = "pct", ctids: tuple[int, ...] = ()) -> str:
    """Bash for the GPU-owning machine: GPUs, compute apps, device-fd holders and their /proc facts (see module doc).
    ctids: containers whose PID namespace to ask for through `pct exec` (maps holders when cgroups name none)."""
    head = "\n".join([
        f"pct={shlex.quote(pct)}; ctids={shlex.quote(' '.join(str(int(c)) for c in ctids))}",
        "export LC_ALL=C",
        f"smi={shlex.quote(nvidia_smi)}; glob={shlex.quote(dev_glob)}; glob2={shlex.quote(_outside_view(dev_glob))}",
        f"gq={shlex.quote(GPU_QUERY)}; aq={shlex.quote(APPS_QUERY)}; fmt={shlex.quote(CSV_FORMAT)}",
        "apps=''",
    ])
    return head + _SELF_CHAIN + _PROBE_BODY


_KILL_BODY = r"""
protect=" $chain $chain_pg "
now_us() { echo "${EPOCHREALTIME/./}"; }
# alive PID START: the same process (not a reused pid, not a zombie) still exists
alive() { local s; s=$(cat "/proc/$1/stat" 2>/dev/null) || return 1; set -- "$2" ${s##*) }
          [ "$2" != Z ] && [ "${21}" = "$1" ]; }
signal() {   # signal SIG: every target still alive gets SIG, by group when allowed
  for t in $targets; do IFS=: read -r pid start pg <<<"$t"
    alive "$pid" "$start" || continue
    if [ "$pg" != 0 ] && [[ "$protect" != *" $pg "* ]]; then kill -s "$1" -- "-$pg" 2>/dev/null
    else kill -s "$1" "$pid" 2>/dev/null; fi
  done; }
left() { local n=0; for t in $targets; do IFS=: read -r pid start pg <<<"$t"
           if alive "$pid" "$start"; then n=$((n+1))
           elif [ "$pg" != 0 ] && [[ "$protect" != *" $pg "* ]] && kill -0 -- "-$pg" 2>/dev/null; then n=$((n+1)); fi
         done; echo "$n"; }
wait_gone() { local end=$(( $(now_us) + $1 ))
             while [ "$(left)" != 0 ] && [ "$(now_us)" -lt "$end" ]; do sleep 0.05; done; }
present=""
for t in $targets; do IFS=: read -r pid start pg <<<"$t"
  if alive "$pid" "$start"; then present="$present $t"; else echo "R $pid absent"; fi
done
targets=$present
signal TERM; wait_gone "$grace_us"
for t in $targets; do IFS=: read -r pid start pg <<<"$t"; alive "$pid" "$start" || echo "R $pid term"; done
if [ "$(left)" != 0 ]; then signal KILL; wait_gone 5000000; fi
for t in $targets; do IFS=: read -r pid start pg <<<"$t"
  if alive "$pid" "$start"; then echo "R $pid alive"; else echo "R $pid gone"; fi
done
echo "@@END"
"""


def kill_script(targets: tuple[KillTarget, ...], *, grace_s: float) -> str:
    """Bash for the GPU-owning machine: SIGTERM each target's group (or pid), wait up to grace_s, SIGKILL what
    is left, wait up to 5 s more. Prints `R <pid> absent` (already gone, or its PID reused: not signalled),
    `R <pid> term` (died on TERM), then `R <pid> gone|alive` for each target that was present.
    Our own shell, its ancestors and their groups are never signalled, whatever the targets say.
    """
    if grace_s < 0:
        raise ValueError(f"grace must be >= 0 seconds, got {grace_s}")
    spec = " ".join(f"{int(t.pid)}:{int(t.starttime)}:{int(t.pgid or 0)}" for t in targets)
    head = f"export LC_ALL=C\ntargets={shlex.quote(spec)}; grace_us={int(grace_s * 1_000_000)}"
    return head + _SELF_CHAIN + _KILL_BODY


@dataclass(frozen=True)
class KillReport:
    absent: tuple[int, ...]
    died_on_term: tuple[int, ...]
    gone: tuple[int, ...]
    alive: tuple[int, ...]


def parse_kill_report(text: str) -> KillReport:
    if "@@END" not in text:
        raise ValueError("kill script output is incomplete (no @@END marker)")
    rows = [line.split() for line in text.splitlines() if line.startswith("R ")]
    pick = lambda word: tuple(int(r[1]) for r in rows if len(r) == 3 and r[2] == word)  # noqa: E731
    return KillReport(absent=pick("absent"), died_on_term=pick("term"), gone=pick("gone"), alive=pick("alive"))
