"""One-token decode attention for the refilling batch generator's step: every row one query at its own position,
grouped-query heads read together, as one Triton kernel.

Why: rows at their own positions need per-row visibility; SDPA with a mask reads the whole span (the longest live
row's) for every row, and the row-invariant kernel of `kernels.py` reads a KV head's slots once per query head. Here
one program serves one (row, KV head): its G query heads as one [G, Dh] tile against the row's slots 0..p in blocks,
fp32 online softmax, so each row reads its own K/V once and no further than its position. Not row-invariant (the
dot products are tensor-core tiles); the batch generator needs no invariance (it never verifies). The queries may
be some of the cache's rows (the generator's compacted steps): query i reads cache row rows[i], one pointer load.

Runs on CUDA, and on CPU under Triton's interpreter (the tests; there the tiles are cast to fp32 first, as the
interpreter's tl.dot mishandles bf16). No host sync: captured in the step's graph.
Shape legend: R rows, H / Hkv query / KV heads, G = H / Hkv, Dh head dim, S cache slots.
"""
from __future__ import annotations

import torch

from trainer.triton_device import triton_kernels

# slots a block, software-pipeline stages, warps: the fastest of 7 configurations on the H200 at qwen3-8b's heads
# (head dim 128; 256 rows, 512 and 2048 slots; docs/benchmarks.md, "The steps' attention alone")
BLOCK_S, STAGES, WARPS = 128, 2, 4
TILE_ELEMS = BLOCK_S * 128  # a K or V block's size at that head dim: wider heads take fewer slots a block


def block_for(head_dim: int) -> int:
    """Slots a block at this head dim: BLOCK_S up to head dim 128, then fewer, so that the pipelined K and V blocks
    (2 x STAGES of them, bf16: 128 KB at 128 x 128) stay well inside a Hopper SM's 227 KB of shared memory."""
    return max(16, min(BLOCK_S, TILE_ELEMS // head_dim))


MIN_ROWS = 16  # tl.dot's smallest tile side: the G query heads are padded to it


@triton_kernels
def _kernel(triton, tl):
    """The jitted kernel, or None where Triton is not installed."""
    @triton.jit
    def step_attention(q_ptr, k_ptr, v_ptr, pos_ptr, rows_ptr, o_ptr, scale, sq_r, sq_h, sk_r, sk_h, sk_s, so_r, so_h,
                       N_SLOTS: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, HEAD_DIM: tl.constexpr,
                       BLOCK: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, LOADED_BOUND: tl.constexpr,
                       STAGES: tl.constexpr):
        # The running max starts finite, so a block whose slots are all past p (weights exp(-inf) = 0) never
        # computes -inf - -inf.
        r = tl.program_id(0).to(tl.int64)
        c = tl.load(rows_ptr + r).to(tl.int64)  # the cache row query r reads
        kv = tl.program_id(1)
        g = tl.arange(0, GP)
        d = tl.arange(0, HEAD_DIM)
        real = g < G
        q = tl.load(q_ptr + r * sq_r + (kv * G + g)[:, None] * sq_h + d[None, :], mask=real[:, None], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        p = tl.load(pos_ptr + r)
        m = tl.full([GP], -1e30, tl.float32)
        den = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, HEAD_DIM], tl.float32)
        k_base = k_ptr + c * sk_r + kv * sk_h
        v_base = v_ptr + c * sk_r + kv * sk_h
        # On the GPU the loop stops at the row's position, a loaded bound, so the compiler pipelines the blocks'
        # loads (an `if s0 <= p` around the body defeats that: 96 against 86 us at qwen3-8b's heads, 256 rows of
        # 128-511 positions in 512 slots on the H200). Triton's interpreter (the CPU tests) cannot loop to a loaded
        # bound: it runs every block, and one past p adds exactly nothing (weights 0, alpha 1).
        for s0 in tl.range(0, p + 1 if LOADED_BOUND else N_SLOTS, BLOCK, num_stages=STAGES):
            s = s0 + tl.arange(0, BLOCK)
            inside = (s < N_SLOTS) & (s <= p)
            k = tl.load(k_base + s[:, None] * sk_s + d[None, :], mask=inside[:, None], other=0.0)
            v = tl.load(v_base + s[:, None] * sk_s + d[None, :], mask=inside[:, None], other=0.0)
            if UPCAST:
                k, v = k.to(tl.float32), v.to(tl.float32)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [GP, BLOCK] fp32
            scores = tl.where(inside[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            alpha = tl.exp(m - m_new)
            w = tl.exp(scores - m_new[:, None])
            acc = acc * alpha[:, None] + tl.dot(w.to(v.dtype), v, input_precision=PRECISION)
            den = den * alpha + tl.sum(w, axis=1)
            m = m_new
        out = acc / den[:, None]
        tl.store(o_ptr + r * so_r + (kv * G + g)[:, None] * so_h + d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=real[:, None])

    return step_attention


def query_rows(groups: int) -> int:
    """The query tile's rows: the G query heads of a KV head, padded to a power of two >= MIN_ROWS."""
    return max(MIN_ROWS, 1 << (groups - 1).bit_length())


def shared_bytes(head_dim: int, element_size: int, groups: int = 1) -> int:
    """Shared memory a program asks for, at most: its K and V blocks and its query tile (exact at G <= MIN_ROWS:
    bf16 at head dim 128 72 KB, fp32 144 KB, beyond a 99 KB SM's such as an RTX 4090's or an L40S's); doubled for
    each doubling of the query tile past MIN_ROWS rows, which holds what the compiler asked for at 32 and 64."""
    rows = query_rows(groups)
    return 2 * (block_for(head_dim) + rows) * head_dim * element_size * (rows // MIN_ROWS)


def usable_for(x: torch.Tensor, head_dim: int, groups: int = 1) -> bool:
    """The kernel can run on `x` here (CUDA, or the interpreter; not under torch.compile) for this head dim (a power
    of two >= 16: one [G, Dh] tile) and G query heads a KV head, its blocks within the device's shared memory."""
    from trainer.triton_device import runs_on, shared_memory_limit

    return (_kernel() is not None and runs_on(x.device) and not torch.compiler.is_compiling()
            and head_dim >= 16 and head_dim & (head_dim - 1) == 0
            and shared_bytes(head_dim, x.element_size(), groups) <= shared_memory_limit(x.device))


def step_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, scale: float,
                   rows: torch.Tensor | None = None) -> torch.Tensor:
    """q [R', H, 1, Dh], k / v [R, Hkv, S, Dh] caches (slot = position), pos [R', 1] long (each query's position,
    < S), rows [R'] long (query i reads cache row rows[i]; default: every row in order, R' = R) -> [R', 1, H, Dh] in
    q's dtype: each query over its cache row's slots 0..p (head h reads KV head h // G). The loop bound is the cache
    size (one compilation per cache), the blocks past p are skipped."""
    R, H, L, Dh = q.shape
    Hkv = k.shape[1]
    if rows is None:
        rows = torch.arange(R, device=q.device)
    if (L != 1 or pos.shape != (R, 1) or rows.shape != (R,) or R > k.shape[0] or H % Hkv or k.stride(-1) != 1
            or k.stride() != v.stride()):
        raise ValueError(f"step_attention: one query a row over a shared cache layout, got q {tuple(q.shape)}, "
                         f"cache {tuple(k.shape)}, pos {tuple(pos.shape)}, rows {tuple(rows.shape)}")
    from trainer.triton_device import interpreting

    G = H // Hkv
    q = q.contiguous()
    out = torch.empty(R, 1, H, Dh, dtype=q.dtype, device=q.device)
    o = out[:, 0]  # [R, H, Dh]
    _kernel()[(R, Hkv)](q, k, v, pos.contiguous(), rows.contiguous(), o, scale, q.stride(0), q.stride(1),
                        k.stride(0), k.stride(1), k.stride(2), o.stride(0), o.stride(1), N_SLOTS=k.shape[2], G=G,
                        GP=query_rows(G), UPCAST=interpreting(),
                        # fp32 products stay fp32 (tl.dot would round fp32 inputs to TF32); bf16 ones take the default
                        PRECISION="ieee" if interpreting() or q.dtype == torch.float32 else "tf32",
                        HEAD_DIM=Dh, BLOCK=block_for(Dh), LOADED_BOUND=not interpreting(), STAGES=STAGES,
                        num_warps=WARPS)
    return out
