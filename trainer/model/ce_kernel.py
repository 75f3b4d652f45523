"""The LM-head CE chunk (`trainer.model.loss.ce_chunk`'s contract) as one Triton kernel: one program per row of the
[C, V] logits, a first loop for the row's statistics (online max and sum of exp, first argmax, the label's logit),
a second that writes dlogits = (softmax - onehot) * s in the logits' dtype, or (step.head_fp8) in e4m3 with one
scale per row (`trainer.model.fp8.dlogits_scale`, from the probability mass off the label), so the gradient GEMM reads one byte per logit and nothing writes the bf16 gradient.
For DFlash2's candidate top-k the first loop also writes each whole chunk's max (`trainer.model.topk.fast_topk`'s
first stage) from the tile it already holds, which saves the top-k its own read of the logits.

Why a kernel of our own: under Inductor the same math (`ce_chunk_fused`) became one reduction that ran at about half
the memory bandwidth on the H200 (`python3 -m bench.step --profile`, category "lm-head softmax/CE": 12.9 of 88 ms
per step at shape (b)). Here a row (V = 152K bf16 logits: 300 KB) is read once from HBM; its second read, while the
~130 rows in flight fit the 50 MB L2, mostly hits L2.

Runs on CUDA, and on CPU under Triton's interpreter (the tests; `trainer.triton_device.CPU_UNDER_INTERPRETER`).
No host sync, no value-dependent allocation: it is captured inside the step's CUDA graph like any kernel.
"""
from __future__ import annotations

import torch

from trainer.triton_device import triton_kernels


@triton_kernels
def _kernel(triton, tl):
    """The jitted kernel, or None where Triton is not installed (built once, on first use)."""
    @triton.jit
    def ce_rows(x_ptr, y_ptr, s_ptr, g_ptr, gs_ptr, loss_ptr, correct_ptr, max_ptr, stride, n_cols: tl.constexpr,
                WANT_GRAD: tl.constexpr, FP8_GRAD: tl.constexpr, FP8_MAX: tl.constexpr, BLOCK: tl.constexpr,
                LANE_STEPS: tl.constexpr, N_CHUNKS: tl.constexpr, CHUNK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * stride
        lanes = tl.arange(0, BLOCK)
        # Online softmax with a running max per lane, reduced across lanes once at the end (measured on the H200
        # against one running max per row with exp2: 10.9 against 11.8 ms per step at shape (b) -- the per-iteration
        # cross-lane max cost more than the second exp). One exp per element: with d = x - m, exp(-|d|) is either
        # the new term (d <= 0) or the old sum's rescale (d > 0, the new term then being exactly 1). The running max
        # starts finite, so d is never -inf - -inf.
        y = tl.load(y_ptr + row)
        m = tl.full([BLOCK], -1e30, tl.float32)
        total = tl.zeros([BLOCK], tl.float32)
        best_at = tl.zeros([BLOCK], tl.int32)
        for start in range(0, n_cols, BLOCK):
            cols = start + lanes
            x = tl.load(base + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
            if N_CHUNKS > 0:  # the whole chunks of this tile: BLOCK // CHUNK maxes (exact in the logits' dtype)
                ids = start // CHUNK + tl.arange(0, BLOCK // CHUNK)
                chunk_maxes = tl.max(tl.reshape(x, [BLOCK // CHUNK, CHUNK]), axis=1)
                tl.store(max_ptr + row * N_CHUNKS + ids, chunk_maxes.to(max_ptr.dtype.element_ty), mask=ids < N_CHUNKS)
            d = x - m
            e = tl.exp(-tl.abs(d))
            up = d > 0  # strict: a lane keeps its first maximum (lanes visit columns in increasing order)
            total = tl.where(up, total * e + 1.0, total + e)
            m = tl.where(up, x, m)
            best_at = tl.where(up, cols, best_at)
        row_max = tl.max(m, axis=0)
        lane_w = tl.exp(m - row_max)
        sum_exp = tl.sum(total * lane_w, axis=0)
        lse = row_max + tl.log(sum_exp)
        argmax = tl.min(tl.where(m == row_max, best_at, n_cols), axis=0)  # torch.argmax: the first index of the max
        s = tl.load(s_ptr + row)
        picked = tl.load(base + y).to(tl.float32)
        tl.store(loss_ptr + row, (lse - picked) * s)
        tl.store(correct_ptr + row, (argmax == y).to(tl.int8))
        if WANT_GRAD:
            g_base = g_ptr + row * n_cols
            mult = s
            rest = 0.0
            if FP8_GRAD:  # the row's largest |dlogit| is the label's, s * (1 - p_label): map it to e4m3's maximum
                # 1 - p_label as the mass off the label, summed, never as a difference: a confident row's p_label
                # rounds to 1 in fp32, its 1 - p_label to 0. Every lane but the label's holds no label term; the
                # label's lane (its n_cols / BLOCK columns) is summed again here without it, which keeps the first
                # loop's per-element work that of the bf16 gradient.
                label_lane = y % BLOCK
                rest = tl.sum(tl.where(lanes == label_lane, 0.0, total * lane_w), axis=0)
                lane_cols = label_lane + tl.arange(0, LANE_STEPS) * BLOCK
                xl = tl.load(base + lane_cols, mask=(lane_cols < n_cols) & (lane_cols != y), other=float("-inf"))
                rest = (rest + tl.sum(tl.exp(xl.to(tl.float32) - row_max), axis=0)) / sum_exp
                g_scale = tl.maximum(s * rest, 1e-30) / FP8_MAX  # trainer.model.fp8.dlogits_scale
                tl.store(gs_ptr + row, g_scale)
                mult = s / g_scale
            for start in range(0, n_cols, BLOCK):
                cols = start + lanes
                inside = cols < n_cols
                x = tl.load(base + cols, mask=inside, other=0.0).to(tl.float32)
                if FP8_GRAD:  # the label's entry p_label - 1 as -rest: exact where p_label rounds to 1
                    g = tl.where(cols == y, -rest, tl.exp(x - lse)) * mult
                    g = tl.minimum(tl.maximum(g, -FP8_MAX), FP8_MAX)
                else:
                    g = (tl.exp(x - lse) - (cols == y).to(tl.float32)) * mult
                tl.store(g_base + cols, g.to(g_ptr.dtype.element_ty), mask=inside)

    return ce_rows


def available() -> bool:
    """Triton is installed (the kernel can be built)."""
    return _kernel() is not None


def usable_on(device: torch.device) -> bool:
    """The kernel can run on tensors of `device`: CUDA with Triton, or CPU under the interpreter (tests)."""
    from trainer.triton_device import runs_on

    return available() and runs_on(device)


BLOCK = 4096  # columns per iteration; 8 warps (a power of two: triton.arange)


def writes_chunk_maxes(vocab: int, chunk: int) -> bool:
    """`ce_chunk_triton` can write the maxes of `chunk`-wide column chunks of a row of `vocab` logits: a power-of-two
    chunk that divides the kernel's tile."""
    import triton

    return chunk > 0 and chunk & (chunk - 1) == 0 and _block(vocab, triton) % chunk == 0


def _block(vocab: int, triton) -> int:
    return min(BLOCK, max(16, triton.next_power_of_2(vocab)))


def ce_chunk_triton(logits: torch.Tensor, y: torch.Tensor, s: torch.Tensor, want_grad: bool,
                    grad_fp8: bool = False, maxes: torch.Tensor | None = None, chunk: int = 0):
    """`trainer.model.loss.ce_chunk`'s contract (DFlash's loss: no D-PACE): logits [C, V], labels y [C], loss scale
    s [C] -> (sum(ce * s) fp32 scalar, correct [C] bool, dlogits [C, V] in the logits' dtype, or None; grad_fp8:
    (dlogits in e4m3, row scales [C, 1])). Row losses are summed by torch, in a fixed order: the loss is
    deterministic. maxes [C, n] (contiguous, the logits' dtype) and chunk (`writes_chunk_maxes`): the kernel also
    writes the max of columns [j * chunk, (j + 1) * chunk) into maxes[:, j] for each j < n (n * chunk <= V)."""
    from trainer.model.fp8 import E4M3, E4M3_MAX

    kernel = _kernel()
    C, V = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    loss_rows = torch.empty(C, dtype=torch.float32, device=logits.device)
    correct = torch.empty(C, dtype=torch.int8, device=logits.device)
    fp8 = want_grad and grad_fp8
    if want_grad:
        grad = torch.empty_like(logits, dtype=E4M3 if fp8 else logits.dtype)
    else:
        grad = loss_rows  # a placeholder pointer when unused
    grad_scale = torch.empty(C, 1, dtype=torch.float32, device=logits.device) if fp8 else loss_rows
    import triton

    block = _block(V, triton)
    if maxes is not None and not (writes_chunk_maxes(V, chunk) and maxes.shape[0] == C and maxes.is_contiguous()
                                  and maxes.shape[1] * chunk <= V and maxes.dtype == logits.dtype):
        raise ValueError(f"ce_chunk_triton: cannot write {tuple(maxes.shape)} {maxes.dtype} maxes of {chunk}-wide "
                         f"chunks of [{C}, {V}] {logits.dtype} logits")
    kernel[(C,)](logits, y, s.float(), grad, grad_scale, loss_rows, correct, loss_rows if maxes is None else maxes,
                 logits.stride(0), V, WANT_GRAD=want_grad, FP8_GRAD=fp8, FP8_MAX=E4M3_MAX, BLOCK=block,
                 LANE_STEPS=triton.next_power_of_2(triton.cdiv(V, block)),
                 N_CHUNKS=0 if maxes is None else maxes.shape[1], CHUNK=max(chunk, 1), num_warps=8)
    if not want_grad:
        return loss_rows.sum(), correct.bool(), None
    return loss_rows.sum(), correct.bool(), ((grad, grad_scale) if fp8 else grad)

