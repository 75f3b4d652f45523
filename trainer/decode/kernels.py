"""Row-invariant operations for the static target: a row's result does not depend on how many rows are computed
together.

Why: speculative decoding is lossless only if the target's 16-token verify forward computes, for each token, exactly
what a 1-token decode step computes. Measured op by op on the H200 (docs/quality.md, "Exact bf16"): in bf16, cuBLAS
gives bitwise the same rows at M = 1 and M = 16 for the target's linears, while two ops do not:
- the HF RMSNorm: its `mean` is a PyTorch reduction whose thread layout changes with the number of rows (512
  threads on one row, 32 per row on 16), so the fp32 sums round differently;
- SDPA: 25 of 524,288 bf16 attention outputs differed between 1 and 16 queries.
Here each is a Triton kernel in which one program computes one row (one norm row, one query of one head) with a loop
and reductions shaped only by the row length (norm) or the query's position (attention), so a row's result is the
same whatever the batch.

The kernels run on CUDA, and on CPU under Triton's interpreter (`trainer.triton_device`, which the CPU tests switch
on). Where they cannot run (no Triton, CPU, inside `torch.compile`), callers fall back to the HF module and SDPA.
"""
from __future__ import annotations

import torch

from trainer.triton_device import runs_on, triton_kernels


@triton_kernels
def _kernels(triton, tl):
    """(triton, rms_norm_rows, attention_rows), or None where Triton is not installed. Built once, lazily, so that
    importing this module costs nothing where no kernel runs."""
    @triton.jit
    def rms_norm_rows(x_ptr, w_ptr, y_ptr, n_cols, eps, r_ptr, s_ptr, BLOCK: tl.constexpr, OFFSET: tl.constexpr,
                      RESIDUAL: tl.constexpr):
        # HF's arithmetic: fp32 mean of squares, rsqrt(var + eps), then (plain: Llama, Qwen3) cast to the input dtype
        # and times the weight, or (OFFSET: Gemma, the Qwen3.5 / Qwen3-Next hybrids) times 1 + w in fp32, then cast.
        # RESIDUAL: the row normed is x + r (the residual stream plus a layer's output), rounded to x's dtype first
        # as torch's add rounds it, and also stored at s_ptr: from there on the arithmetic is that of the sum loaded.
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        inside = cols < n_cols
        x = tl.load(x_ptr + row * n_cols + cols, mask=inside, other=0.0)
        if RESIDUAL:
            r = tl.load(r_ptr + row * n_cols + cols, mask=inside, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(s_ptr.dtype.element_ty)
            tl.store(s_ptr + row * n_cols + cols, x, mask=inside)
        x = x.to(tl.float32)
        var = tl.sum(x * x, axis=0) / n_cols
        w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        if OFFSET:
            y = x * tl.rsqrt(var + eps) * (1.0 + w)
        else:
            normed = (x * tl.rsqrt(var + eps)).to(y_ptr.dtype.element_ty)
            y = w * normed.to(tl.float32)
        tl.store(y_ptr + row * n_cols + cols, y.to(y_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def attention_rows(q_ptr, k_ptr, v_ptr, pos_ptr, o_ptr, scale,
                       sq_r, sq_h, sq_l, sk_r, sk_h, sk_s, so_r, so_h, so_l, sp_r,
                       N_SLOTS: tl.constexpr, GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr):
        # One query (row l, head h, sequence r) at position p against cache slots 0..p, in slot blocks of BLOCK_S
        # from slot 0, fp32 online softmax; the slots of the last block after p are masked (weight exp(-inf) = 0).
        # Blocks wholly after p are skipped: which blocks run depends on p alone, and such a block would add exactly
        # 0 anyway (alpha = exp(0) = 1, weights 0). So a query's arithmetic depends on its position and the cache,
        # never on how many queries were launched. (`range(0, p + 1, ...)` would say it shorter, but Triton's
        # interpreter, which the CPU tests use, cannot loop to a loaded bound.)
        l = tl.program_id(0)
        h = tl.program_id(1)
        r = tl.program_id(2).to(tl.int64)
        kv = h // GROUPS
        d = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + r * sq_r + h * sq_h + l * sq_l + d).to(tl.float32)
        p = tl.load(pos_ptr + r * sp_r + l)  # sp_r 0: one position per query for every row
        m = -1e30  # finite, so exp(m - m_new) is never NaN
        den = 0.0
        acc = tl.zeros((HEAD_DIM,), tl.float32)
        k_base = k_ptr + r * sk_r + kv * sk_h
        v_base = v_ptr + r * sk_r + kv * sk_h
        for s0 in range(0, N_SLOTS, BLOCK_S):
            if s0 <= p:
                s = s0 + tl.arange(0, BLOCK_S)
                inside = (s < N_SLOTS) & (s <= p)
                # Both loads before any arithmetic: one wait on memory per block, not two.
                k = tl.load(k_base + s[:, None] * sk_s + d[None, :], mask=inside[:, None], other=0.0).to(tl.float32)
                v = tl.load(v_base + s[:, None] * sk_s + d[None, :], mask=inside[:, None], other=0.0).to(tl.float32)
                scores = tl.where(inside, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
                m_new = tl.maximum(m, tl.max(scores, axis=0))
                alpha = tl.exp(m - m_new)
                w = tl.exp(scores - m_new)
                acc = acc * alpha + tl.sum(w[:, None] * v, axis=0)
                den = den * alpha + tl.sum(w, axis=0)
                m = m_new
        tl.store(o_ptr + r * so_r + h * so_h + l * so_l + d, (acc / den).to(o_ptr.dtype.element_ty))

    return triton, rms_norm_rows, attention_rows


def head_dim_supported(head_dim: int) -> bool:
    """The attention kernel loads a head as one power-of-two vector; 16 and up keeps the compiled kernel the same
    for every launch (Triton specializes integer arguments by their divisibility by 16)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def usable_for(x: torch.Tensor) -> bool:
    """The kernels can run on `x` here (CUDA, or the interpreter) and are not being traced by torch.compile."""
    return runs_on(x.device) and _kernels() is not None and not torch.compiler.is_compiling()


def norm_eps(module: torch.nn.Module) -> float:
    """An HF RMSNorm module's epsilon (`variance_epsilon` in most families, `eps` in Gemma's and the hybrids')."""
    return float(getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6)))


def norm_warps(block: int) -> int:
    """Warps of a one-row norm program over `block` columns: from the row length only, so the reduction tree does not
    change with the row count."""
    return max(1, min(8, block // 256))


class RowInvariantRMSNorm:
    """Wraps an HF RMSNorm module (`weight`, `variance_epsilon` or `eps`); callable like it. Also one kernel instead of
    about eight, which makes a decode step faster. offset: the module's rule is (1 + w) * norm(x) in fp32 (Gemma's,
    the hybrids')."""

    def __init__(self, module: torch.nn.Module, offset: bool = False) -> None:
        self.module = module
        self.offset = offset
        self.weight = module.weight
        self.eps = norm_eps(module)

    def uses_kernel(self, x: torch.Tensor) -> bool:
        return usable_for(x) and self.weight.dtype == x.dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.uses_kernel(x):
            return self.module(x)
        return self._launch(x, None)[1]

    def add(self, x: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + out, this norm of it): a residual add and the norm that follows it, as one kernel where the norm's
        runs (one launch, and the sum is read back by no second kernel). Its bits are those of the add and then the
        norm: the sum rounds to x's dtype before the norm reads it, and the norm's arithmetic is the same code, so
        the row-invariance a verify relies on holds as it did."""
        if not (self.uses_kernel(x) and out.dtype == x.dtype and out.shape == x.shape):
            s = x + out
            return s, self(s)
        return self._launch(x, out)

    def _launch(self, x: torch.Tensor, out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        triton, kernel, _ = _kernels()
        n = x.shape[-1]
        x2 = x.contiguous().view(-1, n)
        y = torch.empty_like(x2)
        s = x2 if out is None else torch.empty_like(x2)
        if x2.shape[0] > 0:
            r = x2 if out is None else out.contiguous().view(-1, n)
            block = triton.next_power_of_2(n)
            kernel[(x2.shape[0],)](x2, self.weight, y, n, self.eps, r, s, BLOCK=block, OFFSET=self.offset,
                                   RESIDUAL=out is not None, num_warps=norm_warps(block))
        return s.view(x.shape), y.view(x.shape)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Causal attention of L queries over a static cache, row-invariant. q [R, H, L, Dh] (last dim contiguous), k / v
    [R, Hkv, S, Dh] caches (slot = position; H a multiple of Hkv), pos [L] long positions of the queries (or [R, L]:
    each row's own, the refilling batch generator's) -> [R, L, H, Dh] in q's dtype (the layout the output projection
    reads). A query at position p sees slots <= p, and the slot blocks after p are not read: a row's cost follows its
    own length, not the cache's."""
    triton, _, kernel = _kernels()
    R, H, L, Dh = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if q.stride(-1) != 1 or k.stride(-1) != 1 or k.stride() != v.stride() or pos.stride(-1) != 1:
        raise ValueError("decode_attention needs contiguous head dims and positions, and k / v of one layout")
    if k.shape[0] != R or k.shape[-1] != Dh or pos.shape not in ((L,), (R, L)):
        raise ValueError(f"decode_attention: q {tuple(q.shape)}, cache {tuple(k.shape)} and pos {tuple(pos.shape)} "
                         f"disagree")
    if not head_dim_supported(Dh) or H % Hkv:
        raise ValueError(f"decode_attention needs a power-of-two head dim >= 16 and H % Hkv == 0, got {Dh}, {H}/{Hkv}")
    out = torch.empty(R, L, H, Dh, dtype=q.dtype, device=q.device)
    o = out.transpose(1, 2)  # [R, H, L, Dh] view of the output
    # N_SLOTS is a compile-time constant (one compilation per cache size; a decoder has one): the loop bound then
    # is the same for every query, whatever L.
    kernel[(L, H, R)](q, k, v, pos, o, scale, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
                      k.stride(2), o.stride(0), o.stride(1), o.stride(2), pos.stride(0) if pos.dim() == 2 else 0,
                      N_SLOTS=S, GROUPS=H // Hkv, HEAD_DIM=Dh,
                      BLOCK_S=64, num_warps=4)
    return out
