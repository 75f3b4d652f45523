"""Benchmark driver (not a test): `status` over 8 emulated containers behind the real loopback sshd.

    PYTHONPATH=. python3 tests/ops/status/testbed_bench.py [-n 10]

Starts the test bed (sshd on 127.0.0.1, 8 containers, one fake-trainer run in each, a fake nvidia-smi on the
host's PATH), then runs `python -m bench.cli --status-only` twice: on the Proxmox host alone, and on the
whole inventory with an extra host that accepts TCP but never answers (connect_timeout_s: 1), which must cost one
connect timeout in total. Needs root (namespaces), openssh-server and util-linux.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path[:0] = [str(HERE), str(REPO), str(REPO / "tests")]  # HERE first: its conftest

import yaml  # noqa: E402
from support.container import start_containers  # noqa: E402
from support.sshd import Sshd  # noqa: E402
from support.testbed import build_testbed  # noqa: E402

from conftest import FakeGpus, trainer_runbook  # noqa: E402
from support import fake_nvidia_smi  # noqa: E402
from test_status_cli import SilentServer  # noqa: E402


def bench(n: int, inventory: Path, host: str | None, label: str, env: dict) -> None:
    argv = [sys.executable, "-m", "bench.cli", "--status-only", "-n", str(n), "--inventory", str(inventory)]
    out = subprocess.run(argv + (["--host", host] if host else []), cwd=REPO, env=env, capture_output=True,
                         text=True, check=True).stdout.strip()
    print(f"{out}  [{label}]")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=10)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        sshd = Sshd(tmp / "sshd").start()
        cts = start_containers(list(range(200, 208)), tmp / "pve")
        silent = SilentServer()
        try:
            tb = build_testbed(sshd, cts, tmp / "testbed")
            (tmp / "dev").mkdir()
            for name in [f"nvidia{i}" for i in range(8)] + ["nvidiactl"]:
                (tmp / "dev" / name).write_bytes(b"")
            smi = fake_nvidia_smi.install(tmp / "bin", tmp / "gpus.json", n_gpus=8)
            fake = FakeGpus(bin_dir=tmp / "bin", nvidia_smi=smi, state=tmp / "gpus.json", dev_dir=tmp / "dev")
            sshd.install_executable("nvidia-smi", smi.read_text())
            env = {**os.environ, "PYTHONPATH": str(REPO), "DFLASH_OPS_NVIDIA_DEV_GLOB": fake.dev_glob,
                   "HOME": str(tmp)}
            base = [sys.executable, "-m", "dflash_ops", "--inventory", str(tb.inventory), "--runbooks",
                    str(tmp / "runbooks")]
            for i, ct in enumerate(cts):
                book = trainer_runbook(tmp / "runbooks", fake, gpu=i, mib=1000 + i, child_mib=500, name=f"ft{i}")
                subprocess.run(base + ["launch", book, "--host", tb.host, "--ct", str(ct.ctid), "--json"],
                               cwd=REPO, env=env, check=True, capture_output=True)
            bench(args.n, tb.inventory, tb.host, "1 Proxmox host, 8 containers, 8 runs, 16 GPU holders", env)
            doc = yaml.safe_load(tb.inventory.read_text())
            doc["hosts"]["hung"] = {**doc["hosts"][tb.host], "port": silent.port, "connect_timeout_s": 1}
            tb.inventory.write_text(yaml.safe_dump(doc))
            bench(max(3, args.n // 3), tb.inventory, None, "whole inventory + a hung host, connect_timeout_s 1", env)
            out = subprocess.run(base + ["status", "--json"], cwd=REPO, env=env, capture_output=True, text=True)
            hosts = {h["host"]: h["elapsed_s"] for h in json.loads(out.stdout)["hosts"]}
            print(f"per-host elapsed_s: {hosts}")
        finally:
            silent.close()
            for ct in cts:
                ct.stop()
            sshd.stop()


if __name__ == "__main__":
    main()
