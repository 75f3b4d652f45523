"""PID 1 of an emulated container: set the hostname, say "ready", then reap orphans until told to stop.

Run as `unshare --pid --fork --mount --uts --mount-proc python3 ct_init.py HOSTNAME`. Contract:
- prints exactly one line `ready <pid-as-seen-inside>` on stdout once the hostname is set and signals are armed;
- reaps every child that exits, so a job detached inside the container (re-parented to PID 1) never stays a zombie;
- exits 0 on SIGTERM, SIGINT or SIGHUP; SIGKILL from the host ends it too, and the kernel then kills every process of
  the namespace — the same as stopping a real container.
Standard library only: it runs under whatever python3 starts it.
"""
from __future__ import annotations

import os
import signal
import socket
import sys

STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}


def reap_all() -> None:
    """Collect every exited child without blocking."""
    while True:
        try:
            pid, _status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def main(argv: list[str]) -> int:
    hostname = argv[1] if len(argv) > 1 else "ct"
    socket.sethostname(hostname)  # our own UTS namespace: the host's name is untouched
    # Block the signals we wait for, so one arriving between a reap and the next wait stays pending instead of lost.
    # (A PID-1 process ignores default-action signals; blocked ones are queued, so the host's SIGTERM still lands.)
    watched = STOP_SIGNALS | {signal.SIGCHLD}
    signal.pthread_sigmask(signal.SIG_BLOCK, watched)
    sys.stdout.write(f"ready {os.getpid()}\n")
    sys.stdout.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())  # nothing else is ever written; don't hold the starter's pipe open
    os.close(devnull)
    while True:
        reap_all()
        if signal.sigwait(watched) in STOP_SIGNALS:
            reap_all()
            return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
