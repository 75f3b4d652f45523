"""The decode kernels (and one stream layout) the refilling batch generator's target takes where they serve a layer
(`StaticTarget(fuse=True)`: regenerate, the quality pipeline's answers, bench.generate; never a speculative verify's,
see fused.py): each on by default, each can be switched off. For a process, by the environment variable
DFLASH_DECODE_KERNELS_OFF=NAME,... (a GPU on which one misbehaves; `python -m trainer` refuses an unknown name before
it starts) or by `python -m bench.generate --kernels-off NAME,...` (each one's share of a figure); in a test, by
`switch_off`. Where one is off, its module's torch path runs: the same arithmetic, more launches. Light: no torch
import."""
from __future__ import annotations

import os

from dflash_ops.wire import DECODE_KERNELS_OFF_VAR

KERNELS = {
    "moe": "an MoE layer's SiLU-GLU experts at decode, and the combine of a prefill's grouped expert GEMMs "
           "(trainer/decode/moe_kernel.py)",
    "route": "an MoE layer's softmax top-k router and sort by expert at decode (trainer/decode/route_kernel.py)",
    "overlap": "with moe: an MoE layer's shared expert on a second CUDA stream beside the experts kernels "
               "(trainer/decode/layers/moe.py)",
    "conv": "a Gated DeltaNet layer's one-token conv, SiLU, state shift and gates (trainer/decode/conv_step.py), and "
            "a prefill's conv and SiLU (trainer/decode/conv_prefill.py)",
}
ENV = DECODE_KERNELS_OFF_VAR
_off: set[str] | None = None  # read from ENV at the first question


def parse(text: str, source: str = ENV) -> list[str]:
    """'moe,route' -> ['moe', 'route']; an unknown name raises ValueError, one line naming `source`."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in KERNELS]
    if unknown:
        raise ValueError(f"{source}: no decode kernel {unknown[0]!r}; the names are {', '.join(KERNELS)}")
    return names


def _switched_off() -> set[str]:
    global _off
    if _off is None:
        _off = set(parse(os.environ.get(ENV, "")))
    return _off


def check_environment() -> None:
    """Read DFLASH_DECODE_KERNELS_OFF now: an unknown name raises ValueError here, before anything heavy starts."""
    _switched_off()


def on(name: str) -> bool:
    """Whether the decode kernel `name` runs where it serves (not switched off in this process)."""
    if name not in KERNELS:
        raise KeyError(f"no decode kernel {name!r}; there are {sorted(KERNELS)}")
    return name not in _switched_off()


def switch_off(names, off: bool = True) -> None:
    """Switch these decode kernels off (or, off=False, back on), by name; an unknown name raises before any changes."""
    names = list(names)
    for name in names:
        on(name)
    (_switched_off().update if off else _switched_off().difference_update)(names)


def switched_off() -> list[str]:
    """The decode kernels switched off, sorted (what a benchmark line records)."""
    return sorted(_switched_off())


def layers_taking(static) -> dict[str, int]:
    """Of a `StaticTarget`'s layers, how many were built to take each kernel's path (what a benchmark line records:
    a kernel that does not serve a layer cannot pass unseen in a figure): "moe" counts the MoE layers whose experts
    the kernels serve, "route" those of the softmax_topk routing where on, "overlap" those with a shared expert
    beside the experts kernels where on, "conv" the Gated DeltaNet layers where on; each still checks its shapes at
    every call."""
    moe = [m for m in static.mlps if hasattr(m, "router_kernel")]  # layers/moe.MoeMLP, not imported: light module
    return {"moe": sum(bool(m.kernel) for m in moe),
            "route": sum(bool(m.router_kernel) and m.routing.order == "softmax_topk" for m in moe),
            "overlap": sum(bool(m.overlap and m.kernel) and m.shared is not None for m in moe),
            "conv": sum(bool(m.conv_kernel) for m in static.linear)}
