"""The wire protocol: every tag, exit code and variable that passes between the trainer, the remote scripts and
the CLI, defined once (docs/contracts.md says what each carries).

Three parties meet here. The trainer prints its lines into the run's log; `dflash-ops` reads them (`status`,
`tail`, the launch's checks). The remote scripts (runs/*_scripts.py, runs/manifest.py, hoststatus.py: bash run on the
target) answer the CLI with tagged lines and exit codes. `launch` gives the job its environment, which every
process of the job inherits, the trainer's included.

Standard library only (os, re): the trainer imports it before torch, and `dflash_ops/__init__.py` imports
nothing, so `import dflash_ops.wire` costs the trainer one small module.
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping

# -- the job's environment (set by `launch`; no runbook or --env may set them) --------------------------------
MARKER_VAR = "DFLASH_OPS_RUN_ID"     # <run id>: a process carrying it belongs to that run (stop, the refusals)
RUN_DIR_VAR = "DFLASH_OPS_RUN_DIR"   # "<runs dir>/<run id>": its run is found even when that directory is gone

# -- the trainer's settings from the environment (a user's shell, a runbook's env or --env) --------------------
DECODE_KERNELS_OFF_VAR = "DFLASH_DECODE_KERNELS_OFF"  # NAME,...: decode kernels run as torch ops (decode/switches.py)

# -- the run directory: what `launch` has written there when the job starts ------------------------------------
# (the trainer's fresh start accepts a --run-dir holding these; exit_code and stopped come only after the job
# ends or is being stopped, so they never meet a starting trainer)
LAUNCH_FILES = frozenset({"run.json", ".exit_code.reserve", "output.log", "pid", "pid.tmp"})

# -- the trainer's lines in the log: the prefix, then one line of JSON -----------------------------------------
METRICS_PREFIX = "DFLASH_METRICS "   # every log interval (status reads it); a human line follows
EVAL_PREFIX = "DFLASH_EVAL "         # an evaluation's result; a human line follows
PROGRESS_PREFIX = "DFLASH_PROGRESS "  # a long job that is not training (regenerate); a human line follows
DONE_PREFIX = "DFLASH_DONE "         # the job finished
STOPPED_PREFIX = "DFLASH_STOPPED "   # stopped by SIGTERM/SIGINT once its checkpoint was written: {"step": N, ...}
RESUMED_PREFIX = "DFLASH_RESUMED "   # `dflash-ops resume` wrote it before the next attempt: {"attempt": N, "at": epoch}
QUALITY_PREFIX = "DFLASH_QUALITY "   # the quality pipeline's result (for people and scripts; no CLI command reads it)
SWEEP_PREFIX = "DFLASH_SWEEP "       # the quality sweep's result (likewise)

# -- the job's exit status, as the wrapper records it ---------------------------------------------------------
EXIT_SIGNALLED = 128                 # 128 + N: ended by signal N (or by its handler, which exits so)
EXIT_INTERRUPTED = 128 + 2           # SIGINT (Ctrl-C)
EXIT_TERMINATED = 128 + 15           # SIGTERM (`stop`, `gpu-reset`)
EXIT_LAUNCHER_STOPPED = 1            # torchrun, once its SIGTERM'd ranks exited 143 (it raises SignalException)
# A job that exits so and whose log ends its stop with a DFLASH_STOPPED line kept its checkpoint: "stopped"
STOP_EXITS = (EXIT_TERMINATED, EXIT_INTERRUPTED, EXIT_LAUNCHER_STOPPED)
# How long `stop` and `gpu-reset` wait after SIGTERM before SIGKILL: the trainer then trains on to its next log
# step, writes a checkpoint and exits (DFLASH_STOPPED, EXIT_TERMINATED); an 8B-shape drafter's checkpoint took 20.5-24.5 s on
# one H200 machine's disk (`python -m bench.checkpoint`, docs/benchmarks.md).
STOP_GRACE_S = 120.0

# -- remote scripts -> CLI: each answer line starts with its tag ----------------------------------------------
STATE = "DFLASH_RUN"                 # <run id> <alive> <pid> <exit code> <stopped> <ended> <log size>
NOW = "DFLASH_NOW"                   # <epoch s>: the target's clock
PROC = "DFLASH_PROC"                 # <pid> <run id> <sid>: a live process carrying a run's marker
RUN_JSON = "DFLASH_JSON"             # then the run's run.json on one line (after its STATE line)
LOG = "DFLASH_LOG"                   # the end of the header: raw log bytes follow
MISSING = "DFLASH_MISSING"           # the run's directory is not there (exit EXIT_MISSING)
REFUSED = "DFLASH_REFUSED"           # <alive|cache|lock> <run id or ->: a launch refused (exit EXIT_REFUSED)
ERROR = "DFLASH_ERROR"               # <what failed>: a script's own account of its failure (exit EXIT_FAILED)
PRE = "DFLASH_PRE"                   # <step> <detail>: a runbook's pre step ran
CHECKED = "DFLASH_OK"                # the launch would not be refused
LAUNCHED = "DFLASH_LAUNCHED"         # <pid>: the job started, its pid recorded
START = "DFLASH_START"               # <byte offset>: where `tail -n N` starts, or a resumed attempt's first byte
OLDER = "DFLASH_OLDER"               # <count>: runs a limited listing left out (neither alive nor newest)
PRUNED = "DFLASH_PRUNED"             # <run id>: `runs --prune` removed that finished run's directory
SPARED = "DFLASH_SPARED"             # <run id>: `runs --prune` kept that run: a process of it is alive
RUN_OF = "DFLASH_RUNOF"              # <run id>: a GPU holder belongs to that run
MARKED = "DFLASH_MARKED"             # <run id>: marked stopped
UNMARKED = "DFLASH_UNMARKED"         # <run id>: could not be marked stopped
STOP = "DFLASH_STOP"                 # <terminated|killed|killed_now|not_running|fenced>: what `stop` did
LEFT = "DFLASH_LEFT"                 # <count>: the run's processes still alive after `stop`
PORT = "DFLASH_PORT"                 # <port>: free for the rendezvous
IP4 = "DFLASH_IP4"                   # <line of `ip -4 -o addr show scope global`>
HOSTIPS = "DFLASH_HOSTIPS"           # <`hostname -I`>
JOINED = "DFLASH_JOINED"             # the log shows the nodes met at the rendezvous
ROOT = "DFLASH_ROOT"                 # <absolute run dir>: where `pull` reads
FILE = "DFLASH_FILE"                 # <size> <sha256> <path>: a file `pull` brings
NOTHING = "DFLASH_NONE"              # the selection `pull` asked for is not there
LINK = "DFLASH_LINK"                 # <path>: a symbolic link at or in the selection (never followed)
BAD_NAME = "DFLASH_BADNAME"          # a file of the selection has a newline in its name (the pull is refused)
PIDNS = "DFLASH_PIDNS"               # <pid:[inode]>: the target's PID namespace
MLINES = "DFLASH_MLINES"             # <run id>: that run's last trainer lines follow, each as "M <line>"
KEPT = "DFLASH_KEPT"                 # <run id> <json>: the run ended after its DFLASH_STOPPED line (its json)
SECTION = "%%DFLASH "                # `status`: <gpu|target|err> ... heads one part of a host's answer

# -- remote scripts -> CLI: exit codes ------------------------------------------------------------------------
EXIT_FAILED = 1                      # with an ERROR line: what failed
EXIT_MISSING = 3                     # with a MISSING line: no such run (the CLI's RunNotFound, exit 3)
EXIT_REFUSED = 5                     # with a REFUSED line (the CLI's Refused, exit 5)
EXIT_TIMED_OUT = (124, 128 + 9)      # coreutils `timeout`: the part ran out of time (SIGKILLed after -k)


# -- the trainer under `dflash-ops launch` --------------------------------------------------------------------
_SET_ARG = re.compile(r"(?<!-- )--set (?=['\"]?[A-Za-z_][A-Za-z0-9_.]*=)")


def under_launch(environ: Mapping[str, str] = os.environ) -> bool:
    """This process is (part of) a job `dflash-ops launch` started: it carries the run's marker."""
    return bool(environ.get(MARKER_VAR))


def launch_hint(text: str, environ: Mapping[str, str] = os.environ) -> str:
    """A trainer message or hint as its reader types the fix: under `dflash-ops launch` the trainer's arguments
    follow `--` (`dflash-ops launch RUNBOOK -- --set k=v`), so `--set k=v` reads `-- --set k=v` there; elsewhere
    it is left as it is."""
    return _SET_ARG.sub("-- --set ", text) if under_launch(environ) else text
