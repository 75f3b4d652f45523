"""Frozen values that cross module seams: where a run lives, what it runs, and what became of it."""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from dflash_ops.noderecord import NodeRun

LOCAL, SSH, PROXMOX = "local", "ssh", "proxmox"
TRANSPORTS = (LOCAL, SSH, PROXMOX)
DEFAULT_PCT = "/usr/sbin/pct"
DEFAULT_CT_RUNS_DIR = "/root/dflash-runs"
# plain SSH/Proxmox hosts: under the LOGIN user's home, expanded by the remote shell (shellcmd.path_word)
DEFAULT_HOST_RUNS_DIR = "~/dflash-runs"
# `pct exec` keeps the PVE host's environment by default (leaks host secrets): we start from `env -i` + these.
CT_BASE_ENV = (("HOME", "/root"), ("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"))


def local_state_dir() -> Path:
    """`$XDG_STATE_HOME/dflash-ops`, default `~/.local/state/dflash-ops`: what dflash-ops keeps on this machine."""
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "dflash-ops"


def local_runs_dir() -> str:
    """`$XDG_STATE_HOME/dflash-ops/runs`, default `~/.local/state/dflash-ops/runs`."""
    return str(local_state_dir() / "runs")


@dataclass(frozen=True)
class Container:
    """One LXC container of a Proxmox host; `runs_dir`/`python` are paths inside the container."""

    ctid: str
    runs_dir: str = DEFAULT_CT_RUNS_DIR
    python: str = "python3"
    env: tuple[tuple[str, str], ...] = ()
    rdzv_address: str | None = None      # its own address on the nodes' network (a bridged container's IP)


@dataclass(frozen=True)
class Host:
    """A named machine and how to reach it. `address` may be an ~/.ssh/config alias."""

    name: str
    transport: str = LOCAL
    address: str | None = None
    user: str | None = None
    port: int | None = None
    identity_file: str | None = None
    known_hosts: str | None = None       # None: ~/.ssh/known_hosts
    jump: str | None = None              # "[user@]host[:port]" or a comma list of hops (ssh://... too)
    pct: str = DEFAULT_PCT
    runs_dir: str | None = None          # for runs on the host itself (no container)
    python: str | None = None
    env: tuple[tuple[str, str], ...] = ()
    containers: tuple[Container, ...] = ()
    containers_listed: bool = False      # True: --ct must name one of `containers`
    connect_timeout_s: float = 10.0
    keepalive_s: int = 15
    rdzv_address: str | None = None      # as the other nodes of a multi-node run reach it (NAT, jump hosts)

    def container(self, ctid: str) -> Container | None:
        return next((c for c in self.containers if c.ctid == ctid), None)


@dataclass(frozen=True)
class Target:
    """Host x optional container: where scripts run. With a container, scripts go through `pct exec`."""

    host: Host
    container: Container | None = None

    @property
    def label(self) -> str:
        return self.host.name if self.container is None else f"{self.host.name}/ct{self.container.ctid}"

    @property
    def cli_args(self) -> str:
        """`--host H [--ct N]`, as a hint's command line names this target (a shell could paste it)."""
        args = ["--host", self.host.name] + (["--ct", self.container.ctid] if self.container else [])
        return shlex.join(args)

    @property
    def runs_dir(self) -> str:
        """Absolute, or `~`-relative (the remote login's home; scripts expand it, see shellcmd.path_word)."""
        if self.container is not None:
            return self.container.runs_dir
        if self.host.runs_dir:
            return self.host.runs_dir
        if self.host.transport == LOCAL:
            return local_runs_dir()
        return DEFAULT_HOST_RUNS_DIR

    @property
    def python(self) -> str:
        if self.container is not None:
            return self.container.python
        if self.host.python:
            return self.host.python
        return sys.executable if self.host.transport == LOCAL else "python3"

    @property
    def env(self) -> tuple[tuple[str, str], ...]:
        return self.host.env + (self.container.env if self.container else ())

    @property
    def rdzv_address(self) -> str | None:
        """The address other nodes reach this target by, when the inventory says it: a container's own (it has
        a network of its own: its host's address is not its), else the host's."""
        return self.container.rdzv_address if self.container is not None else self.host.rdzv_address


@dataclass(frozen=True)
class Liveness:
    wait_s: float = 5.0
    pattern: str = "."
    timeout_s: float | None = None   # keep polling for `pattern` until wait_s + ... up to this many seconds


@dataclass(frozen=True)
class Runbook:
    name: str
    command: tuple[str, ...]
    description: str = ""
    workdir: str | None = None   # None: the run dir; on this machine (no container), the directory `launch` ran in
    env: tuple[tuple[str, str], ...] = ()
    pre: tuple[str, ...] = ()
    liveness: Liveness = field(default_factory=Liveness)
    source: str = ""
    nodes: bool = False      # one node of a multi-node run: its command reads torchrun's PET_* rendezvous variables


@dataclass(frozen=True)
class RunSpec:
    """A fully resolved launch: every placeholder substituted, every value still unquoted."""

    run_id: str
    name: str
    runbook: str
    argv: tuple[str, ...]
    workdir: str
    env: tuple[tuple[str, str], ...]
    pre: tuple[str, ...]
    runs_dir: str
    host: str
    ct: str | None
    liveness: Liveness
    multinode: NodeRun | None = None     # one node of this multi-node run, of rank `node_rank`
    node_rank: int | None = None
    extra_args: tuple[str, ...] = ()     # the arguments given after `--` (the tail of `argv`)

    @property
    def run_dir(self) -> str:
        return f"{self.runs_dir}/{self.run_id}"

    @property
    def log_path(self) -> str:
        return f"{self.run_dir}/output.log"


# stopped: ended by SIGTERM/SIGINT after writing its checkpoint (the trainer's DFLASH_STOPPED line); killed:
# `stopped` marked, or ended by a signal, without that line
RUNNING, EXITED, STOPPED, KILLED, LOST = "running", "exited", "stopped", "killed", "lost"


@dataclass(frozen=True)
class RunStatus:
    """A run as read back from its run directory (docs/contracts.md section 2)."""

    run_id: str
    name: str
    state: str                      # running | exited | stopped | killed | lost
    pid: int | None
    exit_code: int | None
    started_at: float | None
    ended_at: float | None          # mtime of exit_code / stopped, when present
    now: float                      # the remote clock when this was read
    run_dir: str
    runbook: str = ""
    argv: tuple[str, ...] = ()
    log_size: int = 0
    procs: int = 0                  # live processes carrying the run's marker (the wrapper, its children, ...)
    dir_missing: bool = False       # found by its processes' marker only: its run directory is gone
    stopped: bool = False           # `dflash-ops stop` ended it (its `stopped` file)
    multinode: NodeRun | None = None   # one node of a multi-node run: the run's record (noderecord.py)
    node_rank: int | None = None
    stopped_step: int | None = None    # state stopped: the step of the checkpoint it wrote before it exited

    @property
    def log_path(self) -> str:
        return f"{self.run_dir}/output.log"

    @property
    def leftovers(self) -> int:
        """Live processes of a run that is not running (it exited, was killed or lost its wrapper)."""
        return 0 if self.state == RUNNING else self.procs

    @property
    def holds_on(self) -> bool:
        """Anything of it still lives: a launch of its name, or a cache clear, must wait."""
        return self.state == RUNNING or self.procs > 0

    @property
    def duration_s(self) -> float | None:
        if self.started_at is None:
            return None
        end = self.now if self.state == RUNNING else self.ended_at
        return None if end is None else max(0.0, end - self.started_at)

    @property
    def state_text(self) -> str:
        if self.state == EXITED:
            text = f"exited {self.exit_code}"
        elif self.state == STOPPED:
            text = f"stopped at step {self.stopped_step}"
        elif self.state == KILLED and self.exit_code is not None:
            text = f"killed ({self.exit_code})"
        else:
            text = self.state
        if self.dir_missing:
            text += " (run dir gone)"
        if self.leftovers:
            text += f", {self.leftovers} leftover{'s' if self.leftovers > 1 else ''}"
        return text


@dataclass(frozen=True)
class Completed:
    """Result of one command on a target; a non-zero exit is data, not an exception."""

    command: str
    exit_code: int
    stdout: bytes
    stderr: bytes

    @property
    def out(self) -> str:
        return self.stdout.decode("utf-8", "replace")

    @property
    def err(self) -> str:
        return self.stderr.decode("utf-8", "replace")


@dataclass(frozen=True)
class Launched:
    spec: RunSpec
    target: str
    pid: int
    status: RunStatus | None = None       # after the liveness proof
    matched_line: str | None = None
    verified_after_s: float | None = None
    stopped_first: tuple[str, ...] = ()   # run ids stopped by --force
