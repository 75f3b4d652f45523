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


def sm90(fn, sig: dict, consts: dict, num_warps: int, aligned_ints: bool = False, **options):
    """Inside a `compile_for_h200` script: jitted `fn` compiled for sm_90 (the H200) -> triton's compiled kernel
    (`.asm` by stage, `.metadata.shared`). sig: the runtime arguments' types in order ("*bf16", "i32", "fp32", ...);
    consts: the constexprs' values, after them. Pointers are specialized 16-byte aligned, as a launch on torch's
    tensors is; with aligned_ints the i32 arguments too (strides that are multiples of 16). options: the launch's
    other compile options."""
    import triton
    from triton.backends.compiler import GPUTarget

    names = list(sig) + list(consts)
    full = {**sig, **{name: "constexpr" for name in consts}}
    aligned = {(names.index(n),): [["tt.divisibility", 16]] for n in names
               if full[n][0] == "*" or (aligned_ints and full[n] == "i32")}
    return triton.compile(triton.compiler.ASTSource(fn, full, consts, aligned), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, **options})
