"""`gpu-reset` use case: find GPU holders on the GPU-owning machine, kill them by process group, re-scan, verify.

Effects go through one Transport to the host: the probe and the kill ladder run there (a container may not see
the PIDs that hold its GPUs). Only the runs' bookkeeping goes into a container, by `pct exec`, as `stop` does: the
run directory is the container's, and a name read from a container process's environment is resolved by the
container alone. Decisions are pure and live in `facts` (plan_kill) and `scripts` (kill_script); this module
sequences them:

    probe -> plan -> [caller confirms] -> the targets' runs (read-only) -> kill ladder -> those runs that ended
    without an exit code marked stopped -> re-scan (new holders in scope: the same, at most MAX_ROUNDS) -> poll
    until nothing in scope holds a GPU and its memory is back to ~0 (bounded) -> result.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from dflash_ops import names, wire
from dflash_ops.errors import OpsError, RemoteFailed
from dflash_ops.gpus import facts, scripts
from dflash_ops.hoststatus import GpuSettings
from dflash_ops.runs import shellcmd, stop_scripts
from dflash_ops.spec import PROXMOX, Container, Host, Target

MAX_ROUNDS = 3
POLL_S = 0.5


class GpuStillHeld(OpsError):
    """After the kill ladder and the bounded wait, a GPU in scope is still held (exit 1)."""

    code, exit_code = "gpu_still_held", 1


@dataclass(frozen=True)
class Marked:
    """Runs of one machine or container: those the targets belonged to (before the kill), or those marked
    stopped (after it)."""
    ctid: int | None                # None: the host itself (a host without containers)
    run_ids: tuple[str, ...]
    error: str | None = None        # the bookkeeping failed there (the kill went ahead: freeing the GPUs comes first)

    @property
    def where(self) -> str:
        return "host" if self.ctid is None else f"ct{self.ctid}"


@dataclass(frozen=True)
class Round:
    plan: facts.KillPlan
    report: scripts.KillReport
    marked: tuple[Marked, ...] = ()


@dataclass(frozen=True)
class ResetResult:
    before: facts.GpuSnapshot
    after: facts.GpuSnapshot
    rounds: tuple[Round, ...]
    held: tuple[int, ...]                # GPU indices still held in scope at the end (empty: success)
    watched: tuple[int, ...]             # GPU indices whose release was verified
    waited_s: float


@dataclass(frozen=True)
class HostGpus:
    """The effects: probe, kill and reset scripts on one host over one transport."""

    host: Host
    transport: object
    settings: GpuSettings
    ctids: tuple[int, ...] = ()

    def probe(self) -> facts.GpuSnapshot:
        script = scripts.probe_script(nvidia_smi=self.settings.nvidia_smi, dev_glob=self.settings.dev_glob,
                                      pct=self.host.pct, ctids=self.ctids)
        return facts.parse_probe(self._run(script, "GPU probe", 60).out)

    def runs_of(self, snap: facts.GpuSnapshot, targets: tuple[facts.KillTarget, ...]) -> tuple[Marked, ...]:
        """The dflash-ops runs the targets belong to, read where each runs: in its container (by its PID there), or
        on a host without containers. Holders on a Proxmox host itself run no dflash-ops job; a target signalled
        alone (its group keeps something we spare) may leave its run going, so its run is not looked for."""
        by_pid = {h.pid: h for h in facts.find_holders(snap)}
        where: dict[int | None, list[tuple[int, int]]] = {}
        for t in targets:
            h = by_pid.get(t.pid)
            if h is None or t.pgid is None:
                continue
            if self.host.transport != PROXMOX:
                where.setdefault(None, []).append((h.pid, h.starttime))
            elif h.ctid is not None and h.ct_pid is not None:
                where.setdefault(h.ctid, []).append((h.ct_pid, h.starttime))
        found = []
        for ctid, holders in sorted(where.items(), key=lambda kv: kv[0] or 0):
            out, error = self._in(ctid, lambda runs_dir: stop_scripts.runs_of_holders_script(runs_dir, holders))
            found.append(Marked(ctid, _tagged_ids(out, wire.RUN_OF), error))
        return tuple(found)

    def mark_ended(self, found: tuple[Marked, ...]) -> tuple[Marked, ...]:
        """Mark stopped those of `found` that the kill ended without an exit code (so they read `killed`)."""
        marked = []
        for runs in found:
            if not runs.run_ids:
                if runs.error:
                    marked.append(runs)
                continue
            ids = runs.run_ids
            out, error = self._in(runs.ctid, lambda runs_dir: stop_scripts.mark_ended_stopped_script(runs_dir, ids))
            failed = _tagged_ids(out, wire.UNMARKED)
            if failed and error is None:
                error = f"could not write stopped for {', '.join(failed)}"
            done = Marked(runs.ctid, _tagged_ids(out, wire.MARKED), error or runs.error)
            if done.run_ids or done.error:
                marked.append(done)
        return tuple(marked)

    def _in(self, ctid: int | None, script_for: Callable[[str], str]) -> tuple[str, str | None]:
        """Run a runs-dir script in container `ctid` (None: on the host) -> (stdout, error or None); never raises."""
        container = None if ctid is None else (self.host.container(str(ctid)) or Container(ctid=str(ctid)))
        target = Target(self.host, container)
        try:
            done = self.transport.run(shellcmd.target_argv(target, script_for(target.runs_dir)), timeout_s=60)
        except OpsError as exc:
            return "", str(exc)
        if done.exit_code != 0:
            lines = done.err.strip().splitlines()
            return done.out, lines[-1] if lines else f"exit code {done.exit_code}"
        return done.out, None

    def kill(self, targets: tuple[facts.KillTarget, ...], grace_s: float) -> scripts.KillReport:
        return scripts.parse_kill_report(self._run(scripts.kill_script(targets, grace_s=grace_s), "kill ladder",
                                                   grace_s + 30).out)

    def reset(self, uuid: str) -> tuple[bool, str]:
        """`nvidia-smi -r -i UUID` on the host; (ok, its message)."""
        done = self.transport.run([self.settings.nvidia_smi, "-r", "-i", uuid], timeout_s=120)
        lines = (done.out + done.err).strip().splitlines()
        return done.exit_code == 0, lines[-1] if lines else f"exit code {done.exit_code}"

    def _run(self, script: str, what: str, timeout_s: float):
        done = self.transport.run(["bash", "-c", script], timeout_s=timeout_s)
        if done.exit_code != 0 or "@@END" not in done.out:
            raise RemoteFailed(f"{what} on {self.host.name} failed with exit code {done.exit_code}",
                               detail="\n".join((done.err + done.out).strip().splitlines()[-10:]) or None)
        return done


def _tagged_ids(out: str, tag: str) -> tuple[str, ...]:
    """The run ids of `tag` lines; an id not of dflash-ops' own shape (a hostile container's output) is dropped."""
    ids = (line[len(tag) + 1:].strip() for line in out.splitlines() if line.startswith(tag + " "))
    return tuple(i for i in ids if names.RUN_ID_RE.fullmatch(i))


def held_in_scope(snap: facts.GpuSnapshot, scope: facts.Scope, watched: tuple[int, ...],
                  threshold_mib: int) -> tuple[int, ...]:
    """GPUs still held: any that a holder in scope still holds (a killable one, or a compute app we may not kill),
    plus watched GPUs whose memory is above the threshold although no other container's compute app accounts
    for it. Holders outside the scope (other containers) are not ours to report."""
    plan = facts.plan_kill(snap, scope)
    by_pid = {h.pid: h for h in facts.find_holders(snap)}
    ours = {i for t in plan.targets for i in by_pid[t.pid].gpu_indices}
    ours |= {i for h, _ in plan.spared if scope.covers(h) and h.is_compute_app for i in h.gpu_indices}
    others = {i for h, _ in plan.spared if not scope.covers(h) and h.is_compute_app for i in h.gpu_indices}
    leaked = {g.index for g in snap.gpus
              if g.index in watched and g.mem_used_mib > threshold_mib and g.index not in others}
    return tuple(sorted(ours | leaked))


def watched_gpus(snap: facts.GpuSnapshot, plan: facts.KillPlan, scope: facts.Scope) -> tuple[int, ...]:
    """The GPUs whose release we verify: those the targets held; every GPU when the scope is the whole host."""
    if scope.ctid is None or scope.all_containers:
        return tuple(g.index for g in snap.gpus)
    targeted = {t.pid for t in plan.targets}
    return tuple(sorted({i for h in facts.find_holders(snap) if h.pid in targeted for i in h.gpu_indices}))


def reset(hg: HostGpus, before: facts.GpuSnapshot, plan: facts.KillPlan, scope: facts.Scope, *, grace_s: float,
          wait_s: float, threshold_mib: int = 0, sleep: Callable[[float], None] = time.sleep) -> ResetResult:
    """Kill `plan` (already shown and confirmed), re-scan for new holders in scope, then wait for release."""
    rounds: list[Round] = []
    killed: set[int] = set()
    watched = set(watched_gpus(before, plan, scope))
    snap = before
    while plan.targets and len(rounds) < MAX_ROUNDS:
        runs = hg.runs_of(snap, plan.targets)
        report = hg.kill(plan.targets, grace_s)
        rounds.append(Round(plan=plan, report=report, marked=hg.mark_ended(runs)))
        killed |= {t.pid for t in plan.targets}
        snap = hg.probe()
        fresh = facts.plan_kill(snap, scope)
        targets = tuple(t for t in fresh.targets if t.pid not in killed)
        groups = {t.pgid for t in targets}
        plan = facts.KillPlan(targets=targets, spared=fresh.spared,
                              bystanders=tuple(b for b in fresh.bystanders if b[0] in groups))
        watched |= set(watched_gpus(snap, plan, scope))
    t0 = time.monotonic()
    while True:
        after = hg.probe()
        held = held_in_scope(after, scope, tuple(sorted(watched)), threshold_mib)
        if not held or time.monotonic() - t0 >= wait_s:
            return ResetResult(before=before, after=after, rounds=tuple(rounds), held=held,
                               watched=tuple(sorted(watched)), waited_s=time.monotonic() - t0)
        sleep(POLL_S)
