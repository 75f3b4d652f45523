"""On a real GPU (the H200 machine): `python3 -m pytest -m gpu tests/ops/status/test_gpu_reset_h200.py`.

A process holds 2 GiB of GPU 0 and its child holds 4 GiB more (a trainer and its DataLoader-like worker);
`dflash-ops gpu-reset --host local --yes` must kill both and leave every GPU at ~0 MiB (H200: exactly 0).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
HOLDER = r'''
import subprocess, sys, time, torch
held = torch.empty(2 << 30, dtype=torch.uint8, device="cuda:0")
child = subprocess.Popen([sys.executable, "-c",
    "import time, torch; b = torch.empty(4 << 30, dtype=torch.uint8, device='cuda:0'); "
    "torch.cuda.synchronize(); print('child', flush=True); time.sleep(3600)"], stdout=sys.stdout)
torch.cuda.synchronize()
print("parent", flush=True)
time.sleep(3600)
'''


def _apps() -> list[str]:
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory,gpu_uuid",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if line.strip()]


@pytest.mark.gpu
def test_gpu_reset_kills_holder_and_its_child_and_memory_returns_to_zero(tmp_path):
    assert _apps() == [], "GPUs must be idle before this test"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        assert sorted(holder.stdout.readline().strip() for _ in range(2)) == ["child", "parent"]
        assert len(_apps()) == 2
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        done = subprocess.run([sys.executable, "-m", "dflash_ops", "gpu-reset", "--host", "local", "--yes",
                               "--grace", "5", "--json"], capture_output=True, text=True, env=env, cwd=tmp_path,
                              timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        out = json.loads(done.stdout)
        before0 = next(g for g in out["before"] if g["index"] == 0)
        assert len(before0["holders"]) == 2 and before0["memory_used_mib"] >= 6 * 1024
        assert all(g["memory_used_mib"] == 0 for g in out["after"]) and _apps() == []
        holder.wait(timeout=10)
    finally:
        if holder.poll() is None:
            os.killpg(holder.pid, 9)
            holder.wait()
