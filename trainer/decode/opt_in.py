"""Decode kernels (and one stream layout) written and tested on CPU (Triton's interpreter, sm_90 compiles) but not
yet measured on a GPU: each is off unless asked, so that a user's regenerate runs only what was measured on the
H200. Asked per process: the benchmarks'
`--opt-in NAME,...` (`python -m bench.generate`), a test's `enable`. A kernel leaves this list when its figures
land in docs/benchmarks.md and it becomes its module's default."""
from __future__ import annotations

KERNELS = {
    "moe": "an MoE layer's SiLU-GLU experts at decode (trainer/decode/moe_kernel.py)",
    "route": "an MoE layer's softmax top-k router and sort by expert at decode (trainer/decode/route_kernel.py)",
    "overlap": "with moe: an MoE layer's shared expert on a second CUDA stream beside the experts kernels "
               "(trainer/decode/layers/moe.py)",
    "conv": "a Gated DeltaNet layer's one-token conv, SiLU, state shift and gates (trainer/decode/conv_step.py)",
}
_asked: set[str] = set()


def enabled(name: str) -> bool:
    """Whether the opt-in kernel `name` was asked for in this process."""
    if name not in KERNELS:
        raise KeyError(f"no opt-in decode kernel {name!r}; there are {sorted(KERNELS)}")
    return name in _asked


def enable(names, on: bool = True) -> None:
    """Ask for (or, on=False, drop) these opt-in kernels, by name; an unknown name raises before any changes."""
    names = list(names)
    for name in names:
        enabled(name)
    (_asked.update if on else _asked.difference_update)(names)


def asked() -> list[str]:
    """The opt-in kernels asked for, sorted (what a benchmark line records)."""
    return sorted(_asked)


def layers_taking(static) -> dict[str, int]:
    """Of a `StaticTarget`'s layers, how many were built to take each opt-in path (what a benchmark line records
    beside what was asked): "moe" counts the MoE layers whose experts the kernels serve, "route" and "overlap" the
    MoE layers, "conv" the Gated DeltaNet layers, where asked; each still checks its shapes at every call."""
    moe = [m for m in static.mlps if hasattr(m, "router_kernel")]  # layers/moe.MoeMLP, not imported: light module
    return {"moe": sum(bool(m.kernel) for m in moe), "route": sum(bool(m.router_kernel) for m in moe),
            "overlap": sum(bool(m.overlap) for m in moe), "conv": sum(bool(m.conv_kernel) for m in static.linear)}
