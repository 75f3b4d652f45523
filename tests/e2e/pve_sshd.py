"""An sshd whose sessions find `pct` at /usr/sbin/pct, as on a Proxmox host, without touching this machine's /usr/sbin.

The server runs in a private mount namespace where /usr/sbin is replaced by a directory of symlinks to the real
entries (reached through a bind mount of the original) plus `pct`, a two-line script that execs the test bed's shim.
Only bind mounts are used. A bare address (`--host 127.0.0.1 --ct N`) gets no inventory settings, so the CLI uses
`/usr/sbin/pct`: this server is what lets that path be tested for real.
"""
from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

from support.sshd import SSHD_BIN, SSHD_DEFAULT_PATH, Sshd, sshd_argv

REAL_SBIN = Path("/usr/sbin")
# $1: where the original /usr/sbin stays reachable, $2: the symlink farm that replaces it; then exec sshd.
MOUNT_AND_EXEC = 'mount --bind /usr/sbin "$1" && mount --bind "$2" /usr/sbin && shift 2 && exec "$@"'


class PveSshd(Sshd):
    def __init__(self, workdir: Path, pct_shim: Path) -> None:
        super().__init__(workdir)
        self.pct_shim = pct_shim
        self._orig = self.workdir / "sbin-orig"
        self._farm = self.workdir / "sbin"

    def _build_farm(self) -> None:
        if self._farm.exists():
            return
        self._orig.mkdir(parents=True)
        self._farm.mkdir()
        for entry in REAL_SBIN.iterdir():
            (self._farm / entry.name).symlink_to(self._orig / entry.name)
        pct = self._farm / "pct"
        pct.write_text(f"#!/bin/sh\nexec {shlex.quote(str(self.pct_shim))} \"$@\"\n")
        pct.chmod(0o755)

    def _spawn(self) -> None:
        self._build_farm()
        argv = sshd_argv(
            port=self.port, host_key=self.host_key, authorized_keys=self.authorized_keys, pid_file=self._pid_file,
            user=self.user, path_env=f"{self.bin_dir}:{SSHD_DEFAULT_PATH}",
        )
        assert argv[0] == str(SSHD_BIN)
        wrapped = ["unshare", "--mount", "--propagation", "private", "sh", "-c", MOUNT_AND_EXEC, "sh",
                   str(self._orig), str(self._farm), *argv]
        with open(self.log_path, "ab") as log:
            log.write(f"--- starting sshd (with /usr/sbin/pct) on {self.host}:{self.port}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(wrapped, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
