"""When speculative decoding is lossless, and whether a given decode met that condition.

Lossless: the speculative output is the target's own greedy output, token for token. Every committed token is the
target's argmax at its position in a verify forward over the block (B tokens); target-only decoding takes it from a
1-token step. The two are equal for every prompt by construction only if each op of the target's forward computes a
row bitwise the same whatever the number of rows beside it (row-invariant). That holds when all of these hold:

1. the static engine (`eval.engine: static`): one target forward serves both decoders (the HF-cache reference
   runs HF's own modules, which are not row-invariant);
2. every RMSNorm of the target ran the row-invariant Triton kernel (`kernels.RowInvariantRMSNorm`; off CUDA, and
   without Triton, the HF module runs, whose reduction changes with the row count);
3. attention ran the row-invariant Triton kernel (`eval.invariant: true`; SDPA is not row-invariant: 25 of
   524,288 bf16 outputs differed between 1 and 16 queries on the H200);
4. the target's forwards are not compiled (`eval.compile` none or drafter: Inductor may fuse and reorder);
5. every linear of the target (projections, MLP, LM head) gives each row bitwise the same at 1 row and at B rows
   in the decode dtype: a property of the GEMM library on this GPU, not of the code, so it is measured here
   (`gemm_rows_identical`: cuBLAS in bf16 on the H200 gives 0 differing outputs; fp32 GEMMs on the H200 and on
   CPUs differ in most outputs). The probe runs the GEMMs eagerly at the decode's shapes; the decode replays them
   inside CUDA graphs, which launch the same kernels.

Embedding, RoPE, the residual adds, the MLP's activation and the argmax work element by element or row by row.
When a condition fails, decoding can still give identical outputs (a near-tie must meet a rounding difference to
flip a token): `identical` counts what happened, per prompt.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Numerics:
    """What a decode ran (after any fallback)."""

    engine: str  # static | hf
    dtype: str  # the target's dtype while decoding
    norms: str  # invariant (every RMSNorm through the Triton kernel) | hf
    attention: str  # invariant | sdpa | hf
    target_compiled: bool
    gemm_rows_identical: bool  # measured: each linear's rows equal at 1 and B rows, bitwise


def unmet(n: Numerics) -> list[str]:
    """Pure: the conditions of the module docstring that `n` fails, one phrase each; [] = lossless by
    construction."""
    out = []
    if n.engine != "static":
        out.append(f"engine {n.engine}, not the static engine")
    if n.norms != "invariant":
        out.append("RMSNorm: the HF module, not the row-invariant kernel")
    if n.attention != "invariant":
        out.append(f"attention {n.attention}, not the row-invariant kernel")
    if n.target_compiled:
        out.append("the target's forward compiled")
    if not n.gemm_rows_identical:
        out.append(f"{n.dtype} GEMMs round a row differently at 1 and at B rows (measured here)")
    return out


def verdict(n: Numerics, same: list[bool]) -> dict:
    """Pure: the guarantee and what happened. same[i]: prompt i's speculative output equals its target-only one."""
    reasons = unmet(n)
    return {"guaranteed": not reasons, "unmet": reasons, "identical": sum(same), "prompts": len(same),
            "differing": [i for i, s in enumerate(same) if not s], **asdict(n)}


def describe(v: dict) -> str:
    """One line: is this decode lossless, and why (or why not)."""
    seen = f"{v['identical']}/{v['prompts']} outputs equal the target's"
    if v["differing"]:
        more = ", ..." if len(v["differing"]) > 10 else ""
        seen += f" (differing: prompts {', '.join(map(str, v['differing'][:10]))}{more})"
    if v["guaranteed"]:
        head = (f"lossless by construction ({v['dtype']}, static engine, row-invariant RMSNorm and attention kernels, "
                f"target uncompiled, GEMM rows identical at 1 and B rows as measured here)")
    else:
        head = f"not lossless by construction ({'; '.join(v['unmet'])})"
    return f"{head}; {seen}"


def rows_identical(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> bool:
    """fn over all rows of x [rows, ...] at once equals fn over each row alone, bitwise."""
    together = fn(x)
    alone = torch.cat([fn(x[r:r + 1]) for r in range(x.shape[0])])
    return torch.equal(together, alone)


@torch.no_grad()
def gemm_rows_identical(model: torch.nn.Module, rows: int, seed: int = 0) -> bool:
    """Every distinct linear shape of `model` (weight dtype and device as decoding runs them), on random inputs of
    `rows` rows: `rows_identical`. Random inputs suffice: the kernel, and so the order of its sums, depends on the
    shapes, not the values, and a different order shows in some of rows x out_features outputs."""
    gen = torch.Generator().manual_seed(seed)
    seen = set()
    for module in model.modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        w, b = module.weight, module.bias
        key = (tuple(w.shape), w.dtype, w.device, b is not None)
        if key in seen:
            continue
        seen.add(key)
        x = torch.randn(rows, w.shape[1], generator=gen).to(device=w.device, dtype=w.dtype)
        if not rows_identical(lambda t: F.linear(t, w, b), x):
            return False
    return True


def norm_path(static) -> str:
    """"invariant" when every RMSNorm module of the static target's model is wrapped by a `RowInvariantRMSNorm` of
    `static` that runs its kernel on the model's activations, else "hf". Read from the object, so a target family
    whose extra norms are not wrapped reads "hf"."""
    from trainer.decode.kernels import RowInvariantRMSNorm

    found = []
    for value in vars(static).values():
        items = value if isinstance(value, (list, tuple)) else [value]
        found += [n for n in items if isinstance(n, RowInvariantRMSNorm)]
    x = static.target.embed_tokens.weight
    wrapped = {id(n.module) for n in found if n.uses_kernel(x)}
    norms = [m for m in static.model.modules() if type(m).__name__.endswith("RMSNorm")]
    return "invariant" if norms and all(id(m) in wrapped for m in norms) else "hf"
