"""Each chunk's max along a row, the first stage of `trainer.model.topk.fast_topk`, as one Triton kernel.

Why a kernel of our own: aten's `amax(dim=-1)` over [N, C, c] with c = 128 (each of its N x C outputs reduces only
128 values) ran far below the memory bandwidth on the H200: 13 of DFlash2's 96 ms small step (`python3 -m
bench.step --shape small --modes compile+graph --drafter dflash2 --profile 3`, the bf16 MaxNan reduction). Here one
program reads one row once, GROUP chunks per tile. Max is exact, so the kernel and amax agree bit for bit.

Runs on CUDA, and on CPU under Triton's interpreter (the tests); inside torch.compile, and wherever the kernel cannot
run, amax (Inductor fuses its own reduction). No host sync: it is captured in the step's CUDA graph like any kernel.
"""
from __future__ import annotations

import torch

from trainer.triton_device import triton_kernels

GROUP = 32  # chunks per tile: 32 x 128 bf16 = 8 KB a load, 8 warps


@triton_kernels
def _kernel(triton, tl):
    """The jitted kernel, or None where Triton is not installed (built once, on first use)."""
    @triton.jit
    def chunk_max_rows(x_ptr, out_ptr, stride, N_CHUNKS: tl.constexpr, CHUNK: tl.constexpr, GROUP: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * stride
        group = tl.arange(0, GROUP)
        cols = tl.arange(0, CHUNK)
        for start in range(0, N_CHUNKS, GROUP):
            ids = start + group
            inside = ids < N_CHUNKS
            x = tl.load(base + ids[:, None] * CHUNK + cols[None, :], mask=inside[:, None], other=float("-inf"))
            tl.store(out_ptr + row * N_CHUNKS + ids, tl.max(x, axis=1), mask=inside)

    return chunk_max_rows


def usable_on(device: torch.device) -> bool:
    from trainer.triton_device import runs_on

    return _kernel() is not None and runs_on(device)


def chunk_max(x: torch.Tensor, n_chunks: int, chunk: int) -> torch.Tensor:
    """x [N, V] (unit column stride) -> [N, n_chunks] in x's dtype: the max of columns [j * chunk, (j + 1) * chunk)
    for each chunk j < n_chunks (n_chunks * chunk <= V; the columns after them are not read)."""
    N = x.shape[0]
    blocks = x[:, :n_chunks * chunk]
    compiling = torch.compiler.is_compiling()
    if compiling or chunk & (chunk - 1) or x.stride(1) != 1 or not usable_on(x.device):
        return blocks.reshape(N, n_chunks, chunk).amax(dim=-1)
    out = torch.empty(N, n_chunks, dtype=x.dtype, device=x.device)
    _kernel()[(N,)](x, out, x.stride(0), N_CHUNKS=n_chunks, CHUNK=chunk, GROUP=GROUP, num_warps=8)
    return out
