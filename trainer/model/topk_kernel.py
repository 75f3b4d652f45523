"""The second stage of `trainer.model.topk.fast_topk` (its `select_from_maxes`) as one Triton kernel, one program a row.

Why: on the H200 torch.topk's radix select (three multi-block launches per selection, two selections) plus the key
building and gathers around it cost ~1.8 ms of DFlash2's step at N = 4096 rows, V = 151936, k = 16. Here one program
reads its row's chunk maxes (and the ragged tail chunk's columns), picks the k chunks by k rounds of extract-max over
the keys, loads those k * c values and picks the k largest by k more rounds: one block reduction (an int64 max) a round.

Keys: a value's order-preserving integer (fp32 bits; bf16 and fp16 widen to fp32 exactly, and -0.0 becomes +0.0 so
the two signs tie) in the high 32 bits of an int64, and 2^31 - 1 - (chunk or column index) in the low bits, so one
max picks the larger value and, among equal values, the lower index: `select_from_maxes`'s order, so the same
integers. A taken or padded slot holds a sentinel below every key (-inf included; NaN is not supported).

Runs on CUDA, and on CPU under Triton's interpreter (the tests); inside torch.compile, and wherever the kernel cannot
run, `fast_topk` keeps the torch path. No host sync, static shapes: CUDA-graph capturable.
"""
from __future__ import annotations

import torch

from trainer.triton_device import triton_kernels

# Below every real key: its value part (-2^31 + 1) is below -inf's ordered bits (-2^31 + 2^23 - 1).
SENTINEL = -((2 ** 31 - 1) << 32)
LOW = 2 ** 31 - 1  # the low bits' rank: LOW - index, so the lower index is the larger key
MAX_SLOTS = 1 << 14  # the widest vector a program holds (chunks, or k rounded up times c); wider takes torch


@triton_kernels
def _kernel(triton, tl):
    """The jitted kernel, or None where Triton is not installed (built once, on first use)."""
    @triton.jit
    def select_rows(x_ptr, maxes_ptr, values_ptr, indices_ptr, x_stride, maxes_stride, V: tl.constexpr,
                    N_FULL: tl.constexpr, CHUNK: tl.constexpr, K: tl.constexpr, K_P: tl.constexpr,
                    NP: tl.constexpr, SENT: tl.constexpr, LOW: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * x_stride
        n_chunks: tl.constexpr = (V + CHUNK - 1) // CHUNK
        lane = tl.arange(0, CHUNK)

        # stage 1: one key per chunk; the ragged tail chunk (index N_FULL) takes its max here, as select_from_maxes
        ids = tl.arange(0, NP)
        mx = tl.load(maxes_ptr + row * maxes_stride + ids, mask=ids < N_FULL, other=0.0).to(tl.float32)
        if N_FULL < n_chunks:
            tail = tl.load(base + N_FULL * CHUNK + lane, mask=N_FULL * CHUNK + lane < V, other=float("-inf"))
            mx = tl.where(ids == N_FULL, tl.max(tail.to(tl.float32), axis=0), mx)
        bits = tl.where(mx == 0.0, 0.0, mx).to(tl.int32, bitcast=True)
        ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
        key = tl.where(ids < n_chunks, (ordered << 32) | (LOW - ids).to(tl.int64), SENT)
        # each candidate slot's chunk, written as the chunks are taken: stage 2 stays one flat vector
        cand = tl.arange(0, K_P * CHUNK)
        group = cand // CHUNK
        picked = tl.zeros([K_P * CHUNK], dtype=tl.int32)
        for i in range(K):
            top = tl.max(key, axis=0)
            picked = tl.where(group == i, (LOW - (top & 0x7FFFFFFF)).to(tl.int32), picked)
            key = tl.where(key == top, SENT, key)

        # stage 2: the k chunks' k * c values, ranked among equals by their global column
        cols = picked * CHUNK + cand % CHUNK
        real = (group < K) & (cols < V)
        v = tl.load(base + cols, mask=real, other=0.0).to(tl.float32)
        bits2 = tl.where(v == 0.0, 0.0, v).to(tl.int32, bitcast=True)
        ordered2 = tl.where(bits2 < 0, bits2 ^ 0x7FFFFFFF, bits2).to(tl.int64)
        key2 = tl.where(real, (ordered2 << 32) | (LOW - cols).to(tl.int64), SENT)
        slot = tl.arange(0, K_P)
        best = tl.zeros([K_P], dtype=tl.int64)
        for i in range(K):
            top = tl.max(key2, axis=0)
            best = tl.where(slot == i, LOW - (top & 0x7FFFFFFF), best)
            key2 = tl.where(key2 == top, SENT, key2)

        out = slot < K
        tl.store(indices_ptr + row * K + slot, best, mask=out)
        # the values from x itself: a -0.0 stays -0.0, as select_from_maxes' gather keeps it
        tl.store(values_ptr + row * K + slot, tl.load(base + best, mask=out), mask=out)

    return select_rows


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def usable(x: torch.Tensor, maxes: torch.Tensor | None, k: int, chunk: int) -> bool:
    """The kernel can select for this call: outside torch.compile's tracing, on a device Triton runs on here, a
    power-of-two chunk, unit column strides, and vectors of at most MAX_SLOTS."""
    from trainer.triton_device import runs_on

    N, V = x.shape
    n_chunks = -(-V // chunk)
    return (not torch.compiler.is_compiling() and _kernel() is not None and runs_on(x.device)
            and chunk & (chunk - 1) == 0 and x.stride(1) == 1 and (maxes is None or maxes.stride(1) == 1)
            and k < n_chunks and _pow2(n_chunks) <= MAX_SLOTS and _pow2(k) * chunk <= MAX_SLOTS)


def select(x: torch.Tensor, maxes: torch.Tensor, k: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`select_from_maxes(x, maxes, k, chunk)` in one launch (where `usable`): x [N, V], maxes [N, V // chunk] (the
    whole chunks' maxes) -> (values [N, k] in x's dtype, indices [N, k] long), value descending, ties index
    ascending; the same values bit for bit and the same indices."""
    N, V = x.shape
    values = torch.empty(N, k, dtype=x.dtype, device=x.device)
    indices = torch.empty(N, k, dtype=torch.long, device=x.device)
    if N == 0:
        return values, indices
    n_chunks = -(-V // chunk)
    width = _pow2(k) * chunk
    _kernel()[(N,)](x, maxes, values, indices, x.stride(0), maxes.stride(0), V=V, N_FULL=V // chunk, CHUNK=chunk,
                    K=k, K_P=_pow2(k), NP=_pow2(n_chunks), SENT=SENTINEL, LOW=LOW,
                    num_warps=8 if max(width, _pow2(n_chunks)) >= 2048 else 4)
    return values, indices
