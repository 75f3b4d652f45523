"""A process that "holds a GPU" for the fake nvidia-smi: FAKE_NVIDIA_HOLD=<gpu>:<mib> in its environment and fake
device nodes open. Optionally starts a child in its own process group (a DataLoader worker)
holding more, and optionally ignores SIGTERM (a stuck holder the ladder must SIGKILL).

    python gpu_holder.py --hold GPU:MIB --ready FILE [--dev PATH]... [--child GPU:MIB] [--ignore-term]
                         [--bystander PIDFILE]

--bystander: also start a `sleep` in the same process group that holds no GPU (a launcher's shell, a logger), and
write its pid to PIDFILE.
"""
import argparse
import os
import signal
import subprocess
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hold", required=True, help="GPU:MIB, exported as FAKE_NVIDIA_HOLD to this process only")
    ap.add_argument("--ready", required=True)
    ap.add_argument("--dev", action="append", default=[])
    ap.add_argument("--child")
    ap.add_argument("--ignore-term", action="store_true")
    ap.add_argument("--bystander")
    args = ap.parse_args()
    if os.environ.get("FAKE_NVIDIA_HOLD") != args.hold:
        # re-exec so that only this process (not the shells that started it) carries the marker
        os.execve(sys.executable, [sys.executable, *sys.argv], dict(os.environ, FAKE_NVIDIA_HOLD=args.hold))
    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    held = [open(path, "rb") for path in args.dev]  # noqa: SIM115 -- kept open on purpose: that is the holding
    if args.bystander:
        env = {k: v for k, v in os.environ.items() if k != "FAKE_NVIDIA_HOLD"}
        sleeper = subprocess.Popen(["sleep", "3600"], env=env, pass_fds=())
        with open(args.bystander, "w") as f:
            f.write(str(sleeper.pid))
    if args.child:
        argv = [sys.executable, __file__, "--hold", args.child, "--ready", args.ready + ".child"]
        # same process group: the worker dies with its trainer's group
        subprocess.Popen(argv + [f"--dev={d}" for d in args.dev])
        while not os.path.exists(args.ready + ".child"):
            time.sleep(0.01)
    with open(args.ready + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename(args.ready + ".tmp", args.ready)
    while held:
        time.sleep(3600)


if __name__ == "__main__":
    main()
