"""A fake `nvidia-smi` whose GPU holders are real processes.

State file (JSON, path from --state or $FAKE_NVIDIA_SMI_STATE):

    {"gpus": [{"uuid": "GPU-0000...", "total_mib": 143771}, ...],
     "holders": [{"pid": 1234, "gpu": 0, "mib": 2048}, ...],     # optional, host PIDs
     "resets": []}                                                # appended to by `-r -i UUID`

Besides the listed holders, every live process whose environment carries `FAKE_NVIDIA_HOLD=<gpu>:<mib>[:<state>]`
holds <mib> MiB on GPU <gpu> (of the fake whose state file is <state>, or of every fake when it is left out) -- so holders started inside a PID namespace need no host-PID bookkeeping. Memory is
computed on each call from /proc: a holder that is gone, or a zombie, holds nothing.

Answers only what dflash-ops asks:
    --query-gpu=index,uuid,memory.used,memory.total,utilization.gpu --format=csv,noheader,nounits
    --query-compute-apps=pid,process_name,used_memory,gpu_uuid --format=csv,noheader,nounits
    -r -i UUID       (refused while a holder uses that GPU, like the real one)
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

HOLD_VAR = b"FAKE_NVIDIA_HOLD="
GPU_FIELDS = ["index", "uuid", "memory.used", "memory.total", "utilization.gpu"]
APP_FIELDS = ["pid", "process_name", "used_memory", "gpu_uuid"]


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2:].split()[0] != "Z"


def _env_holds(pid: str, state_path: str) -> list[tuple[int, int]]:
    """FAKE_NVIDIA_HOLD=<gpu>:<mib>[:<state file>] -- with a state file, only that fake's GPUs are held."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return []
    for item in environ.split(b"\0"):
        if item.startswith(HOLD_VAR):
            gpu, mib, *state = item[len(HOLD_VAR):].decode().split(":", 2)
            return [(int(gpu), int(mib))] if not state or state[0] == state_path else []
    return []


def live_holders(state: dict, state_path: str = "") -> list[tuple[int, int, int]]:
    """(pid, gpu index, MiB) for every holder alive right now."""
    found = [(int(h["pid"]), int(h["gpu"]), int(h["mib"])) for h in state.get("holders", [])]
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            found += [(int(pid), gpu, mib) for gpu, mib in _env_holds(pid, state_path)]
    return sorted({h for h in found if _alive(h[0])})


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "[Not Found]"


def main(argv: list[str]) -> int:
    state_path = os.environ.get("FAKE_NVIDIA_SMI_STATE")
    if argv[:1] == ["--state"]:
        state_path, argv = argv[1], argv[2:]
    if not state_path:
        print("fake nvidia-smi: no state file (--state or FAKE_NVIDIA_SMI_STATE)", file=sys.stderr)
        return 9
    state = json.loads(Path(state_path).read_text())
    holders = live_holders(state, str(Path(state_path).resolve()))
    gpus = state["gpus"]
    if argv == [f"--query-gpu={','.join(GPU_FIELDS)}", "--format=csv,noheader,nounits"]:
        for i, gpu in enumerate(gpus):
            used = sum(mib for _, g, mib in holders if g == i)
            print(f"{i}, {gpu['uuid']}, {used}, {gpu['total_mib']}, {87 if used else 0}")
        return 0
    if argv == [f"--query-compute-apps={','.join(APP_FIELDS)}", "--format=csv,noheader,nounits"]:
        for pid, g, mib in holders:
            print(f"{pid}, {_comm(pid)}, {mib}, {gpus[g]['uuid']}")
        return 0
    if len(argv) == 3 and argv[0] == "-r" and argv[1] == "-i":
        index = next((i for i, g in enumerate(gpus) if g["uuid"] == argv[2]), None)
        if index is None or any(g == index for _, g, _ in holders):
            print(f"Unable to reset GPU {argv[2]}: in use by another client.", file=sys.stderr)
            return 255
        state.setdefault("resets", []).append(argv[2])
        Path(state_path).write_text(json.dumps(state))
        print(f"GPU {argv[2]} was successfully reset.")
        return 0
    print(f"fake nvidia-smi: unsupported arguments {argv}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


def install(bin_dir: Path, state_path: Path, *, n_gpus: int = 8, total_mib: int = 143771) -> Path:
    """Write `bin_dir/nvidia-smi` (a wrapper bound to state_path) and a fresh state with n_gpus idle GPUs."""
    gpus = [{"uuid": f"GPU-{i:08x}-fake-4e1d-9c3a-{i:012x}", "total_mib": total_mib} for i in range(n_gpus)]
    state_path.write_text(json.dumps({"gpus": gpus, "holders": [], "resets": []}))
    bin_dir.mkdir(parents=True, exist_ok=True)
    wrapper = bin_dir / "nvidia-smi"
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} {Path(__file__).resolve()} --state {state_path} \"$@\"\n")
    wrapper.chmod(0o755)
    return wrapper
