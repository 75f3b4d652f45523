"""Compiling our Triton kernels for the H200 without a GPU: what the interpreter does not check (types of
loop-carried values, layouts, the PTX a division or a cast becomes) only triton's compiler and its bundled ptxas do."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def compile_for_h200(script: str, tmp_path: Path) -> dict:
    """Run `script` in a fresh interpreter (no TRITON_INTERPRET, a cache of its own under tmp_path); it compiles
    kernels for sm_90 and prints one line `COMPILED {json}` -> that json."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO)
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.split("COMPILED ", 1)[1])
