"""`dflash-ops gpu-reset`: kill what holds the GPUs (by process group, on the host), verify they are free."""
from __future__ import annotations

from typing import Annotated

import typer

from dflash_ops.cli._common import CtOpt, HostOpt, JsonOpt, confirmed, rendered_errors, settings
from dflash_ops.names import SECONDS_MAX
from dflash_ops.wire import STOP_GRACE_S

YesOpt = Annotated[bool, typer.Option("--yes", "-y", help="Do not ask before killing (or before --hard resets).")]
GraceOpt = Annotated[float, typer.Option(
    "--grace", min=0, max=SECONDS_MAX,
    help="Seconds between SIGTERM and SIGKILL (the default lets a trainer write its checkpoint).")]
AllOpt = Annotated[bool, typer.Option("--all-containers", help="Also kill holders in other containers and on the "
                                                                 "Proxmox host itself.")]
HardOpt = Annotated[bool, typer.Option("--hard", help="Then offer `nvidia-smi -r` for each GPU once it is idle.")]
WaitOpt = Annotated[float, typer.Option("--wait", min=0, max=SECONDS_MAX,
                                        help="Seconds to wait for the GPUs to be released.")]
ThresholdOpt = Annotated[int, typer.Option("--threshold-mib", min=0,
                                           help="memory.used at or below this counts as free (H200 idles at 0).")]


def gpu_reset(ctx: typer.Context, host: HostOpt = None, ct: CtOpt = None, yes: YesOpt = False,
              grace: GraceOpt = STOP_GRACE_S, all_containers: AllOpt = False, hard: HardOpt = False,
              wait: WaitOpt = 30.0, threshold_mib: ThresholdOpt = 0, json_out: JsonOpt = False) -> None:
    """Find GPU holders (compute apps and processes with /dev/nvidia* open, DataLoader workers too) on the host,
    show them, SIGTERM their process groups, SIGKILL after --grace, mark stopped the runs this ended without an exit
    code, re-scan, and wait until every GPU in scope is free. Exit 1 if one is still held. Never touches our own SSH
    session, sshd or GPU daemons."""
    from dflash_ops.cli import reset_view
    from dflash_ops.gpus import reset

    with rendered_errors(json_out):
        hg, scope = _resolve(ctx, host, ct, all_containers, yes, json_out)
        try:
            before = hg.probe()
            if before.no_gpu_reason:
                reset_view.no_gpu(hg.host.name, before.no_gpu_reason, json_out=json_out)
                return
            from dflash_ops.gpus import facts

            plan = facts.plan_kill(before, scope)
            if not json_out:
                reset_view.plan(hg.host.name, before, plan, scope)
            also = f" and the {len(plan.bystanders)} in their process groups" if plan.bystanders else ""
            if plan.targets and not yes and not confirmed(f"Kill {len(plan.targets)} process(es){also}?"):
                raise typer.Exit(1)   # docs/gpu-reset.md: declining exits 1 with nothing killed
            result = reset.reset(hg, before, plan, scope, grace_s=grace, wait_s=wait, threshold_mib=threshold_mib)
            resets = _hard_resets(hg, result, yes) if hard and not result.held else ()
        finally:
            hg.transport.close()
        reset_view.result(hg.host.name, result, resets, json_out=json_out)
        if result.held and json_out:
            raise typer.Exit(reset.GpuStillHeld.exit_code)   # one JSON document: it says ok false, held [...]
        if result.held:
            raise reset.GpuStillHeld(
                f"GPU(s) {', '.join(map(str, result.held))} on {hg.host.name} still held after {result.waited_s:.0f} s",
                hint="see the table above; a holder outside the scope needs --all-containers")


def _resolve(ctx: typer.Context, host: str | None, ct: str | None, all_containers: bool, yes: bool, json_out: bool):
    from dflash_ops import inventory
    from dflash_ops.errors import UsageError
    from dflash_ops.gpus import facts, reset
    from dflash_ops.gpus.facts import GpuSettings
    from dflash_ops.spec import PROXMOX
    from dflash_ops.ssh import transport

    if json_out and not yes:
        raise UsageError("--json needs --yes (there is no prompt in machine-readable mode)")
    inv = inventory.load_inventory(settings(ctx).inventory or inventory.default_path())
    if ct is not None:
        h = inventory.resolve_target(inv, host, ct).host
    else:
        h = inventory.resolve_host(inv, host or inv.default_host, with_ct=False)
        if h.transport == PROXMOX and not all_containers:
            raise UsageError(f"host {h.name!r} is a Proxmox host: name a container with --ct, or pass "
                             "--all-containers to kill every GPU holder on it")
    target = int(ct) if ct is not None else None
    # every listed container's PID namespace: holders map to containers even where cgroups name none
    known = tuple(sorted({int(c.ctid) for c in h.containers} | ({target} if target else set())))
    hg = reset.HostGpus(host=h, transport=transport.for_host(h), settings=GpuSettings.from_env(),
                        ctids=known if h.transport == PROXMOX else ())
    return hg, facts.Scope(ctid=target, all_containers=all_containers)


def _hard_resets(hg, result, yes: bool) -> tuple[tuple[int, str, bool, str], ...]:
    """`nvidia-smi -r -i UUID` per GPU that is idle now (no compute app at all: a reset hits every container)."""
    out = []
    busy = {a.gpu_uuid for a in result.after.apps}
    for g in result.after.gpus:
        if g.index not in result.watched:
            continue
        if g.uuid in busy:
            out.append((g.index, g.uuid, False, "skipped: still in use"))
            continue
        if not yes and not confirmed(f"Reset GPU {g.index} ({g.uuid}) with nvidia-smi -r? It affects every "
                                      "container using it"):
            out.append((g.index, g.uuid, False, "skipped: not confirmed"))
            continue
        ok, message = hg.reset(g.uuid)
        out.append((g.index, g.uuid, ok, message))
    return tuple(out)
