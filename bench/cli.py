"""`python -m bench.cli`: print the CLI's performance figures (not a test).

  help_cold_start_s     median wall time of N fresh `python -m dflash_ops --help` processes
  launch_overhead_s     launch-to-verified minus the liveness wait (median of K launches)
  tail_latency_s        line written (job's clock) -> line emitted by `follow` (median and max)
  status_wall_s         wall time of N fresh `python -m dflash_ops status --json` processes (`--status-only`
                        skips the sections above; tests/ops/status/testbed_bench.py runs it against 8 emulated
                        containers behind the loopback sshd, with and without a hung host)
  runs_latency_s        with `--runs N`: wall time of one fresh `dflash-ops runs`, `status`, `tail NAME
                        --no-follow` and `stop NAME` process each, against N finished runs made in a throwaway
                        runs dir of the local host (plus one live run of NAME for `stop` to stop)

Against the local transport by default; `--inventory FILE --host H [--ct N]` measures a remote target (the
tail latency then also contains the clock offset between the two machines).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

JOB = ("import sys, time\nprint('bench started', flush=True)\nend = time.time() + float(sys.argv[1])\n"
       "while time.time() < end:\n    print('t=%.6f' % time.time(), flush=True)\n    time.sleep(0.25)\n")


def help_cold_start(n: int) -> list[float]:
    repo = str(Path(__file__).resolve().parent.parent)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "dflash_ops", "--help"], stdout=subprocess.DEVNULL, check=True,
                       cwd=repo, env={"PYTHONPATH": repo, "PATH": "/usr/bin:/bin"})
        times.append(time.perf_counter() - t0)
    return times


def _session(args):
    from dflash_ops import inventory
    from dflash_ops.runs.lifecycle import Session

    inv = inventory.load_inventory(Path(args.inventory) if args.inventory else None)
    return Session.of(inventory.resolve_target(inv, args.host, args.ct))


def _book(seconds: float, wait_s: float):
    from dflash_ops.spec import Liveness, Runbook

    return Runbook(name="bench", command=("{python}", "-c", JOB, str(seconds)),
                   liveness=Liveness(wait_s=wait_s, pattern="bench started"))


def launch_overheads(s, k: int, wait_s: float) -> list[float]:
    from dflash_ops.runs import lifecycle

    out = []
    for i in range(k):
        spec = lifecycle.plan(s, _book(30, wait_s), name=f"bench-launch-{i}")
        launched = lifecycle.launch(s, spec)
        out.append(launched.verified_after_s - wait_s)
        lifecycle.stop(s, launched.status, grace_s=2)
    return out


def tail_latencies(s, seconds: float) -> list[float]:
    from dflash_ops.runs import follow, lifecycle

    spec = lifecycle.plan(s, _book(seconds, 0.2), name="bench-tail")
    launched = lifecycle.launch(s, spec)
    lat: list[float] = []

    def emit(line: bytes) -> None:
        if line.startswith(b"t="):
            lat.append(time.time() - float(line[2:]))

    follow.follow(s, launched.status, start=0, emit=emit)
    return lat


def status_walls(n: int, inventory: str | None, host: str | None) -> tuple[list[float], int]:
    """Wall seconds of `n` fresh `dflash-ops status --json` processes, and the last one's exit code."""
    import os

    repo = str(Path(__file__).resolve().parent.parent)
    argv = [sys.executable, "-m", "dflash_ops"] + (["--inventory", inventory] if inventory else []) + ["status",
                                                                                                      "--json"]
    argv += ["--host", host] if host else []
    times, rc = [], 0
    for _ in range(n):
        t0 = time.perf_counter()
        rc = subprocess.run(argv, stdout=subprocess.DEVNULL, cwd=repo,
                            env={**os.environ, "PYTHONPATH": repo}).returncode
        times.append(time.perf_counter() - t0)
    return times, rc


def print_status(n: int, inventory: str | None, host: str | None, label: str = "") -> None:
    st, rc = status_walls(n, inventory, host)
    print(f"status_wall_s       median {statistics.median(st):.3f}  min {min(st):.3f}  max {max(st):.3f}  "
          f"(n={n}, exit {rc}{', ' + label if label else ''})")


def make_finished_runs(runs_dir: Path, n: int, name: str = "old", now: float | None = None) -> list[str]:
    """`n` finished runs (exit 0, a one-line log) of `name` under `runs_dir`, one a minute back from `now`, as
    docs/contracts.md section 2 lays a run dir out; their ids, oldest first."""
    import json

    from dflash_ops import names

    now = time.time() if now is None else now
    ids = []
    for i in range(n):
        started = now - 60 * (n - i)
        rid = names.new_run_id(name, started, f"{i % 65536:04x}")
        d = runs_dir / rid
        d.mkdir(parents=True)
        (d / "run.json").write_text(json.dumps({"run_id": rid, "name": name, "runbook": "bench", "argv": ["true"],
                                                "started_at": started}))
        (d / "pid").write_text("999999999\n")
        (d / "output.log").write_text("done\n")
        (d / "exit_code").write_text("0\n")
        ids.append(rid)
    return ids


def runs_latencies(n: int) -> dict[str, tuple[float, int]]:
    """Wall seconds and exit code of one fresh `runs`, `status`, `tail old --no-follow`, `stop live` process each,
    against `n` finished runs (and one live run named `live`) in a throwaway local runs dir."""
    import os

    repo = str(Path(__file__).resolve().parent.parent)
    out = {}
    with tempfile.TemporaryDirectory() as state:
        env = {**os.environ, "PYTHONPATH": repo, "XDG_STATE_HOME": state}
        os.environ["XDG_STATE_HOME"] = state
        from dflash_ops import inventory, spec

        make_finished_runs(Path(spec.local_runs_dir()), n)
        from dflash_ops.runs import lifecycle

        s = lifecycle.Session.of(spec.Target(inventory.LOCAL_HOST))
        lifecycle.launch(s, lifecycle.plan(s, _book(120, 0.2), name="live"))
        for cmd in (["runs"], ["status", "--json"], ["tail", "old", "--no-follow"], ["stop", "live", "--grace", "5"]):
            t0 = time.perf_counter()
            rc = subprocess.run([sys.executable, "-m", "dflash_ops", *cmd], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, cwd=state, env=env, timeout=600).returncode
            out[" ".join(cmd)] = (time.perf_counter() - t0, rc)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.cli", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--inventory")
    p.add_argument("--host")
    p.add_argument("--ct")
    p.add_argument("-n", type=int, default=10, help="--help runs")
    p.add_argument("-k", type=int, default=3, help="launches")
    p.add_argument("--wait", type=float, default=1.0, help="liveness wait of the bench launches")
    p.add_argument("--tail-seconds", type=float, default=6.0)
    p.add_argument("--status-only", action="store_true", help="only the status section")
    p.add_argument("--runs", type=int, metavar="N", help="only the latency of runs/status/tail/stop against N "
                                                          "finished runs on the local host")
    args = p.parse_args(argv)
    if args.runs is not None:
        for cmd, (wall, rc) in runs_latencies(args.runs).items():
            print(f"runs_latency_s      {wall:7.3f}  dflash-ops {cmd}  (exit {rc}, {args.runs} finished runs)")
        return
    if args.status_only:
        print_status(args.n, args.inventory, args.host)
        return

    with tempfile.TemporaryDirectory() as state:
        import os

        if not args.host:
            os.environ["XDG_STATE_HOME"] = state  # local runs land in a throwaway dir
        h = help_cold_start(args.n)
        print(f"help_cold_start_s   median {statistics.median(h):.3f}  min {min(h):.3f}  max {max(h):.3f}  (n={args.n})")
        s = _session(args)
        try:
            lo = launch_overheads(s, args.k, args.wait)
            print(f"launch_overhead_s   median {statistics.median(lo):.3f}  max {max(lo):.3f}  "
                  f"(launch-to-verified minus wait {args.wait:g} s, k={args.k}, target {s.target.label})")
            tl = tail_latencies(s, args.tail_seconds)
            print(f"tail_latency_s      median {statistics.median(tl):.3f}  max {max(tl):.3f}  (lines={len(tl)})")
            print_status(args.n, args.inventory, args.host)
        finally:
            s.transport.close()


if __name__ == "__main__":
    main()
