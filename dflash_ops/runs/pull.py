"""Use case: `pull`, a run's files brought to this machine, each checked against the size and SHA-256 listed where
the run lives before it is renamed into place. manifest.py (the listing, pure) + the transport; no typer, no rich."""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dflash_ops.errors import HostUnreachable, OpsError, Refused, RemoteFailed, RunNotFound
from dflash_ops.runs.manifest import Manifest, RemoteFile, destinations, manifest_script, parse_manifest
from dflash_ops.runs.lifecycle import LAST_LINES, Session
from dflash_ops.spec import Completed, RunStatus

@dataclass(frozen=True)
class Pulled:
    run_id: str
    what: str
    to: Path
    files: tuple[tuple[RemoteFile, Path], ...]
    links: tuple[str, ...] = ()        # symbolic links in the selection, left out (never followed)


STAGE_PREFIX = ".dflash-pull."     # a private directory beside a destination, one per file being fetched
PULL_STAGE_DIR = "/var/tmp"     # on a Proxmox host (disk, not tmpfs): one file at a time, removed after it


def pull_files(s: Session, run: RunStatus, what: str, to: Path, *, force: bool = False,
               on_file: Callable[[RemoteFile, Path], None] = lambda f, dest: None) -> Pulled:
    """Bring `what` of `run` to the directory `to` on this machine. The files are listed, with size and SHA-256,
    where the run lives; each is read there (in a container: `pct pull` into a private directory on the Proxmox
    host, whose filesystem view is the container's), fetched over SFTP on the same connection (or read, for this
    machine), checked against its listed size and hash, and only then renamed into place. Refused (exit 5), with
    nothing written, if a file would be overwritten and not `force`. Symbolic links are never followed nor
    pulled. A failure on this machine's side (a name too long, a full disk) is one OpsError line."""
    listing = s.run(manifest_script(run.run_dir, what), f"listing the {what} of {run.run_id}")
    manifest = parse_manifest(listing.out)
    if manifest.missing or not manifest.files:
        if manifest.links:
            raise RunNotFound(f"run {run.run_id} has no {what} on {s.target.label} to pull: {manifest.links[0]} is "
                              "a symbolic link, and links are not followed")
        raise RunNotFound(f"run {run.run_id} has no {what} on {s.target.label} yet",
                          hint="`dflash-ops tail` shows how far it got; the export is written when training ends"
                          if what == "export" else None)
    try:
        return _pull_listed(s, run, what, to, manifest, force=force, on_file=on_file)
    except OSError as exc:      # this machine's side: what the steps below did not say themselves
        raise OpsError(f"cannot write the {what} of {run.run_id} to {exc.filename or to}: "
                       f"{exc.strerror or exc}") from None


def _pull_listed(s: Session, run: RunStatus, what: str, to: Path, manifest: Manifest, *, force: bool,
                 on_file: Callable[[RemoteFile, Path], None]) -> Pulled:
    plan = destinations(manifest, to)
    there = [dest for _, dest in plan if _taken(dest)]
    if there and not force:
        more = f" (and {len(there) - 1} more)" if len(there) > 1 else ""
        raise Refused(f"{there[0]} exists{more}; nothing was pulled",
                      hint="pass --force to overwrite, or --to another directory")
    stage = _pull_stage(s) if s.target.container is not None else None
    try:
        for i, (f, dest) in enumerate(plan):
            source = f"{manifest.root}/{f.rel}"
            if stage is not None:
                held = f"{stage}/{i}"
                _host_run(s, [s.target.host.pct, "pull", s.target.container.ctid, source, held],
                          f"pct pull of {f.rel}", timeout_s=3600)
                source = held
            _fetch_checked(s, source, f, dest)
            if stage is not None:
                _host_run(s, ["rm", "-f", "--", source], "removing the staged copy")
            on_file(f, dest)
    finally:
        if stage is not None:
            try:
                _host_run(s, ["rm", "-rf", "--", stage], "removing the staging directory")
            except OpsError:
                pass    # the pull's own error (a dropped connection) is the one to show
    return Pulled(run_id=run.run_id, what=what, to=to, files=tuple(plan), links=manifest.links)


def _taken(dest: Path) -> bool:
    """Something (a file, a link, a directory) is at `dest` on this machine."""
    try:
        os.lstat(dest)
    except (FileNotFoundError, NotADirectoryError):
        return False        # (a file where a directory must go: making that directory says so)
    except OSError as exc:
        raise OpsError(f"cannot use {dest}: {exc.strerror or exc}") from None
    return True


def _fetch_checked(s: Session, source: str, f: RemoteFile, dest: Path) -> None:
    """Fetch into a staging file, check size and SHA-256, then rename it into place. The staging file is created
    exclusively (never through a link, mode 0600) in a private directory of its own made beside `dest` (so the
    rename stays on one file system): nothing planted in the destination can be written through, no file of the
    run is taken for a staging file, and the staging name adds nothing to the length of `dest`'s name."""
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OpsError(f"cannot create {dest.parent}: {exc.strerror or exc}") from None
    try:
        stage = Path(tempfile.mkdtemp(prefix=STAGE_PREFIX, dir=dest.parent))
    except OSError as exc:
        raise OpsError(f"cannot create a staging directory in {dest.parent}: {exc.strerror or exc}") from None
    part = stage / "part"
    try:
        os.close(os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
        got = s.transport.fetch(source, part, f.size)
        if got != f.sha256:
            raise RemoteFailed(f"{f.rel}: SHA-256 {got} of the bytes fetched is not the listed {f.sha256} "
                               "(it changed while being pulled?); nothing kept", hint="pull it again")
        try:
            os.replace(part, dest)
        except OSError as exc:
            raise OpsError(f"cannot write {dest}: {exc.strerror or exc}") from None
    finally:
        try:
            part.unlink(missing_ok=True)
            stage.rmdir()
        except OSError:
            pass     # what failed here is said by the error above


def _pull_stage(s: Session) -> str:
    """A private (0700) directory on the Proxmox host that `pct pull` writes into."""
    done = _host_run(s, ["mktemp", "-d", "-p", PULL_STAGE_DIR, "dflash-pull.XXXXXXXX"], "making a staging directory")
    stage = done.out.strip()
    if not re.fullmatch(re.escape(PULL_STAGE_DIR) + r"/dflash-pull\.[A-Za-z0-9]{8}", stage):
        raise RemoteFailed(f"mktemp on {s.target.host.name} printed {stage[:100]!r}")
    return stage


def _host_run(s: Session, argv: list[str], what: str, *, timeout_s: float = 60.0) -> Completed:
    """`argv` on the host itself (for a container: the Proxmox host, not inside the container)."""
    try:
        done = s.transport.run(argv, timeout_s=timeout_s)
    except HostUnreachable as exc:
        raise s._hinted(exc) from None
    if done.exit_code != 0:
        last = "\n".join((done.err + done.out).strip().splitlines()[-LAST_LINES:])
        raise RemoteFailed(f"{what} on {s.target.host.name} failed with exit code {done.exit_code}",
                           detail=last or None)
    return done
