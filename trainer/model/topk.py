"""An exact top-k over a wide last dimension (a vocabulary), in two narrow selections instead of one wide one. On CUDA
(and on CPU under Triton's interpreter) each stage is one Triton kernel: the chunk maxes in trainer/model/chunk_max.py
(or the CE kernel's, trainer/model/ce_kernel.py), the two selections after them in trainer/model/topk_kernel.py.
Elsewhere, and inside torch.compile's tracing, torch (`select_from_maxes`, the reference the kernel equals). Static
shapes, no host sync: CUDA-graph capturable and traceable by torch.compile(fullgraph=True).

Shape legend: N rows, V columns (the vocabulary), c chunk width, C = ceil(V / c) chunks, k selected.

torch.topk over V ~ 152K columns runs a multi-block radix select that reads the row once per digit; at DFlash2's CE
chunk (4096 rows) that costs several times the chunk's logits GEMM. Here: each chunk's max (one read of the row),
the top k chunks by their max, then the top k of those k*c gathered values. Exact: each of the k largest values lies
in a chunk whose max is at least it, and fewer than k chunks can have a larger max, so its chunk is selected.

Ties are broken by the lower column index, in both stages (so the proof above holds for the total order "value
descending, then index ascending"): the result is that order's first k, deterministic on every device. Zero's two
signs are one value. NaN is not supported (logits are finite; -inf is fine).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from trainer.model import topk_kernel
from trainer.model.chunk_max import chunk_max

# c = 128: the selections cost about C + k*c key reads a row, least near c = sqrt(V / k) (~97 for V = 151936 and
# DFlash2's k = 16), and 128 divides Qwen's 151936 (1187 chunks: no ragged tail to fill). A 128-wide bf16 chunk is
# 256 contiguous bytes, so the chunk max is a plain coalesced row reduction.
CHUNK = 128


def _ordered_bits(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Float x -> (signed ints ordered as the floats are, in int32 or int64; the bit width of x). -0.0 becomes +0.0
    first: the two compare equal and must tie."""
    x = torch.where(x == 0, torch.zeros_like(x), x)
    bits = x.element_size() * 8
    raw = x.view(torch.int16).to(torch.int32) if bits == 16 else x.view(torch.int32).to(torch.int64)
    # sign-magnitude -> two's complement order: a negative float's magnitude bits count down
    mask = (1 << (bits - 1)) - 1
    return torch.where(raw < 0, raw ^ mask, raw), bits


def _keys(x: torch.Tensor, rank: torch.Tensor, tie_bits: int) -> torch.Tensor:
    """One integer key per value: larger value first, then smaller `rank` (0 .. 2^tie_bits - 1). int64 whenever the
    value bits and tie bits do not fit 32."""
    ordered, bits = _ordered_bits(x)
    if bits + tie_bits > 32:
        ordered = ordered.to(torch.int64)
    return (ordered << tie_bits) | ((1 << tie_bits) - 1 - rank).to(ordered.dtype)


def _tie_bits(x: torch.Tensor, count: int) -> int:
    """16 when a 16-bit float's keys fit int32 (count ranks), else 32 (int64 keys)."""
    return 16 if x.element_size() == 2 and count <= 1 << 16 else 32


def chunk_maxes_used(V: int, k: int, chunk: int = CHUNK) -> int:
    """How many whole-chunk maxes `fast_topk` reads over V columns for k (V // chunk), or 0 where it selects over the
    whole row."""
    return V // chunk if -(-V // chunk) > k else 0


def fast_topk(x: torch.Tensor, k: int, chunk: int = CHUNK, select=None,
              maxes: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, V] (a float dtype, no NaN) -> (values [N, k] in x's dtype, indices [N, k] long), sorted by value
    descending, ties by index ascending. Values equal torch.topk(x, k)'s exactly; indices equal wherever the values
    are distinct. 1 <= k <= V. Where the k chunks would be the whole row (V <= k * chunk) it is one selection over
    the row, with the same keys and so the same order. fp64 (tests' reference dtype: its keys would not fit 64 bits)
    takes a stable sort of the row: the same order, at a full sort's cost.
    select: `select_from_maxes` or a compiled copy of it (`compiled_select`; the same integers either way), for the
    torch path: where the second stage's Triton kernel runs (`topk_kernel.usable`) it is not called.
    maxes: the first stage's [N, chunk_maxes_used(V, k, chunk)] where the caller already has them (the CE kernel
    writes them while it reads the logits)."""
    N, V = x.shape
    if not 1 <= k <= V:
        raise ValueError(f"top-k needs 1 <= k <= {V}, got {k}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        values, indices = torch.sort(x, dim=-1, descending=True, stable=True)
        return values[:, :k], indices[:, :k]
    # [N, V // chunk]: one read of the row (the Triton kernel, on CUDA); None where every chunk would be selected
    used = chunk_maxes_used(V, k, chunk)
    if maxes is None and used:
        maxes = chunk_max(x, used, chunk)
    elif not used:
        maxes = None
    if maxes is not None and topk_kernel.usable(x, maxes, k, chunk):
        return topk_kernel.select(x, maxes, k, chunk)  # the whole second stage in one launch
    return (select or select_from_maxes)(x, maxes, k, chunk)


def select_from_maxes(x: torch.Tensor, maxes: torch.Tensor | None, k: int,
                      chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`fast_topk`'s two selections after its first stage: x [N, V] and the maxes of its whole chunks
    [N, V // chunk] -> (values, indices) as `fast_topk`; maxes None (k chunks or more would be the whole row): one
    selection over the row, with the same keys and so the same order. About 20 small elementwise ops and 3
    selections (key building, the chunk top-k, the gather of k*c values): a function of its own so that the compile
    modes run it as one compiled graph rather than as that many eager kernels (`compiled_select`)."""
    N, V = x.shape
    if maxes is None:
        top = torch.topk(_keys(x, torch.arange(V, device=x.device), _tie_bits(x, V)), k, dim=-1).indices
        return x.gather(1, top), top
    n_chunks, full = -(-V // chunk), V // chunk
    blocks = x[:, :full * chunk].reshape(N, full, chunk)  # a view of a row-contiguous x
    if full < n_chunks:  # the ragged tail chunk
        maxes = torch.cat([maxes, x[:, full * chunk:].amax(dim=-1, keepdim=True)], dim=1)
    chunk_ids = torch.arange(n_chunks, device=x.device)
    picked = torch.topk(_keys(maxes, chunk_ids, _tie_bits(x, n_chunks)), k, dim=-1).indices  # [N, k]
    # ascending chunk order: a candidate's position in the [N, k*c] gather then ranks it as its column does
    picked = picked.sort(dim=-1).values
    # the index broadcasts over the chunk: no [N, k*c] column tensor
    values = blocks.gather(1, picked.clamp(max=full - 1)[:, :, None].expand(N, k, chunk))  # [N, k, c]
    if full < n_chunks:
        # the tail filled with -inf at positions after every real column, so the fill ranks after any real -inf
        tail = F.pad(x[:, full * chunk:], (0, n_chunks * chunk - V), value=float("-inf"))  # [N, c]
        values = torch.where((picked == full)[:, :, None], tail[:, None, :], values)
    values = values.reshape(N, k * chunk)
    width = k * chunk
    top = torch.topk(_keys(values, torch.arange(width, device=x.device), _tie_bits(x, width)), k, dim=-1).indices
    return values.gather(1, top), picked.gather(1, top // chunk) * chunk + top % chunk


def compiled_select():
    """`select_from_maxes` under torch.compile (default mode, static shapes: one graph per chunk shape), for the
    compile modes (trainer.step.policy.compile_step). The chunk maxes stay outside it: Inductor would replace the
    Triton kernel with its own amax."""
    return torch.compile(select_from_maxes, dynamic=False, fullgraph=True)
