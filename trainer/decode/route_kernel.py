"""The MoE router and the sort of token copies by expert at decode (`layers/moe.py`'s `route` then `sort_by_expert`,
for the softmax_topk families) as two Triton kernels instead of about ten small torch ones.

Why: at qwen3.5-35b-a3b's decode shape (T = 64 tokens, E = 256 experts, k = 8) a layer's softmax, top-k, renorm, cast,
stable argsort, gather and searchsorted cost about 60 us on the H200 (the radix argsort alone 27 us), some 2.5 ms of a
31 ms step over 40 layers.

`route_and_sort` gives the tensors `route` + `sort_by_expert` give (experts, order, sorted experts and offsets
exactly wherever torch.topk's order is defined; the weights as "Rounding" below says):
    router     one program a token: the softmax in fp32 over the token's E logits (one tile, E <= MAX_EXPERTS), then k
               rounds of max: top-k in descending probability, on an exact tie the lowest expert index first (torch.topk
               leaves a tie's order unspecified: the two agree wherever a token's top-k probabilities, and the k-th
               against the next, are distinct); renormalised and cast to the logits' dtype as the Routing says.
    sort       a counting sort, one program an expert: it scans the S copies' experts (copy c = t * k + j) twice,
               counting the copies of lower experts (its start), then placing its own copies in copy order, each at
               start + its rank among them (a cumulative sum): the stable order, in two passes over 4 KB (decode's
               S = 512) and no loop over the other programs' tiles. offsets [E] int32: each expert's end (start +
               its copies), as searchsorted gives.
Static shapes, no host sync: both run inside the decode step's CUDA graph.

Rounding, on the GPU: the softmax is torch's persistent warp softmax (E <= 1024) operation for operation: each of
min(P, 32) lanes (P = E rounded up to a power of two) sums exp(x - max) over its elements x[lane + 32 i] in order,
then the lanes' sums add as a butterfly (lane l with l + 16, then + 8, ...); CUDA's expf (libdevice) and IEEE
division, so the probabilities are expected to equal F.softmax's bit for bit (a subnormal one, < 1.2e-38, may flush to
zero). The renorm sum is the order torch's reduction kernel (Reduce.cuh) takes over k <= 32 contiguous values: B =
k rounded down to a power of two lanes, lane l holding w[l] + w[l + B] (where l + B < k), the lanes added by
shuffles down at halving offsets (B = 8: ((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7))); then an IEEE
division and a cast rounding to nearest even, as torch's. So the weights too are expected to equal torch's bit for
bit. Were torch's reduction to take another order, a weight could differ by an fp32 ulp, which survives a cast to
bf16 only where it crosses a rounding boundary.
tests/trainer/decode/test_route_kernel_gpu.py checks these claims on the H200. Under Triton's interpreter (the CPU
tests) exp is numpy's, so there the weights are within an ulp or two of torch's, not equal.

Bounds (`usable`; beyond them moe.py keeps the torch path): E <= MAX_EXPERTS (one tile a token), k <= MAX_TOP_K,
S = T x k <= MAX_COPIES (the sort's programs each scan all S copies: E x S work, fine at decode's S).
Shape legend: T tokens, E experts, k experts a token, S = T x k copies.
"""
from __future__ import annotations

import torch

from trainer.triton_device import interpreting, runs_on, triton_kernels

MAX_EXPERTS = 1024  # torch's persistent softmax bound too: up to it the sum's order is the one reproduced here
MAX_TOP_K = 32
MAX_COPIES = 8192
SORT_CHUNK = 1024  # copies a sort program reads at a time (decode's S = 512: one chunk a pass)
NO_EXPERT = 1 << 30  # the sort's padding past S: above every expert, so neither below nor equal to any
WARP = 32  # torch's softmax lanes a row


@triton_kernels
def _kernels(triton, tl):
    """(route_topk, sort_copies), or None where Triton is not installed."""
    from triton.language.extra import libdevice

    @triton.jit
    def route_topk(logits_ptr, w_ptr, e_ptr, stride_t, E: tl.constexpr, LANES: tl.constexpr, ITERS: tl.constexpr,
                   K: tl.constexpr, KP: tl.constexpr, RENORM: tl.constexpr, BF16_OUT: tl.constexpr,
                   LIBDEVICE: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        rows = tl.arange(0, ITERS)
        lanes = tl.arange(0, LANES)
        idx = rows[:, None] * LANES + lanes[None, :]  # [ITERS, LANES]: element lane + LANES * i, torch's layout
        inside = idx < E
        x = tl.load(logits_ptr + t * stride_t + idx, mask=inside, other=float("-inf")).to(tl.float32)
        m = tl.max(tl.max(x, axis=1), axis=0)
        if LIBDEVICE:
            ex = libdevice.exp(x - m)  # CUDA's expf, as torch's softmax (Triton's exp is an approximate exp2)
        else:
            ex = tl.exp(x - m)
        # Each lane's sum in order over its elements (row i picked out exactly: the other rows add zeros), then the
        # lanes as a butterfly: torch's order, so the same bits.
        acc = tl.zeros([LANES], tl.float32)
        for i in tl.static_range(ITERS):
            acc += tl.sum(tl.where(rows[:, None] == i, ex, 0.0), axis=0)
        half: tl.constexpr = LANES // 2
        if half >= 16:
            acc = tl.sum(tl.reshape(acc, [2, 16]), axis=0)
        if half >= 8:
            acc = tl.sum(tl.reshape(acc, [2, 8]), axis=0)
        if half >= 4:
            acc = tl.sum(tl.reshape(acc, [2, 4]), axis=0)
        if half >= 2:
            acc = tl.sum(tl.reshape(acc, [2, 2]), axis=0)
        total = tl.sum(acc, axis=0)  # the last pair (or the one lane)
        p = tl.where(inside, tl.math.div_rn(ex, total), -1.0)  # padding below any probability: never picked
        slots = tl.arange(0, KP)
        w = tl.zeros([KP], tl.float32)
        picked = tl.zeros([KP], tl.int32)
        for j in tl.static_range(K):
            best = tl.max(tl.max(p, axis=1), axis=0)
            at = tl.min(tl.min(tl.where(p == best, idx, E), axis=1), axis=0)  # a tie: the lowest index
            at = tl.minimum(at, E - 1)  # NaN logits match nothing: an expert in range all the same
            w = tl.where(slots == j, best, w)
            picked = tl.where(slots == j, at, picked)
            p = tl.where(idx == at, -1.0, p)
        if RENORM:
            # torch's sum over k contiguous values: B = k rounded down to a power of two lanes, lane l adding
            # w[l] + w[l + B], then the lanes by shuffles down at halving offsets: lane l + lane l + B / 2, then
            # + lane l + B / 4, ... (w is zero past k: exact)
            B: tl.constexpr = KP if KP == K else KP // 2
            s = w
            if B < KP:
                s = tl.sum(tl.reshape(s, [2, B]), axis=0)
            if B >= 32:
                s = tl.sum(tl.reshape(s, [2, 16]), axis=0)
            if B >= 16:
                s = tl.sum(tl.reshape(s, [2, 8]), axis=0)
            if B >= 8:
                s = tl.sum(tl.reshape(s, [2, 4]), axis=0)
            if B >= 4:
                s = tl.sum(tl.reshape(s, [2, 2]), axis=0)
            w = tl.math.div_rn(w, tl.sum(s, axis=0))
        keep = slots < K
        if BF16_OUT:
            # round to nearest even by hand: the interpreter's fp32 -> bf16 cast truncates (weights are finite, >= 0)
            bits = w.to(tl.int32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            tl.store(w_ptr + t * K + slots, bits.to(tl.int16).to(tl.bfloat16, bitcast=True), mask=keep)
        else:
            tl.store(w_ptr + t * K + slots, w.to(w_ptr.dtype.element_ty), mask=keep)
        tl.store(e_ptr + t * K + slots, picked.to(tl.int64), mask=keep)

    @triton.jit
    def sort_copies(experts_ptr, order_ptr, sorted_ptr, offsets_ptr, S: tl.constexpr, CHUNK: tl.constexpr,
                    PAD: tl.constexpr):
        b = tl.program_id(0)  # this program's expert
        within = tl.arange(0, CHUNK)
        # first pass: the copies of lower experts, where this expert's copies start
        start = tl.full([], 0, tl.int32)
        for c0 in tl.range(0, S, CHUNK):
            e = tl.load(experts_ptr + c0 + within, mask=c0 + within < S, other=PAD)
            start += tl.sum((e < b).to(tl.int32), axis=0)
        # second pass: this expert's copies in copy order (stable), each at start + its rank among them
        at = start
        for c0 in tl.range(0, S, CHUNK):
            c = c0 + within
            e = tl.load(experts_ptr + c, mask=c < S, other=PAD)
            mine = (e == b).to(tl.int32)
            place = at + tl.cumsum(mine, axis=0) - 1
            tl.store(order_ptr + place, c.to(tl.int64), mask=mine == 1)
            tl.store(sorted_ptr + place, e, mask=mine == 1)
            at += tl.sum(mine, axis=0)
        tl.store(offsets_ptr + b, at)

    return route_topk, sort_copies


def usable(logits: torch.Tensor, routing, k: int) -> bool:
    """The kernels can route these logits [T, E] by `routing` (layers/moe.py's Routing, not imported: moe.py imports
    this module) here: CUDA, or CPU under the interpreter (the tests); not under torch.compile; the softmax_topk rule;
    1 <= k <= min(E, MAX_TOP_K), E <= MAX_EXPERTS, 1 <= T x k <= MAX_COPIES; fp32, bf16 or fp16 logits."""
    return (routing.order == "softmax_topk" and logits.dim() == 2 and 0 < k <= min(MAX_TOP_K, logits.shape[1])
            and logits.shape[1] <= MAX_EXPERTS and 0 < logits.shape[0] * k <= MAX_COPIES
            and logits.dtype in (torch.float32, torch.bfloat16, torch.float16) and runs_on(logits.device)
            and not torch.compiler.is_compiling() and _kernels() is not None)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def sort_chunk(S: int) -> int:
    """Copies a sort program reads at a time: S rounded up to a power of two (>= 16), at most SORT_CHUNK."""
    return max(16, min(SORT_CHUNK, _pow2(S)))


def route_and_sort(logits: torch.Tensor, k: int, routing
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] (the logits' dtype where routing.cast, else fp32), experts [T, k] long,
    order [S] long, sorted_experts [S] long, offsets [E] int32): `route` then `sort_by_expert`, two launches (see the
    module docstring for ties and rounding). Call where `usable` holds."""
    T, E = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    route_topk, sort_copies = _kernels()
    out_dtype = logits.dtype if routing.cast else torch.float32
    weights = torch.empty(T, k, dtype=out_dtype, device=logits.device)
    experts = torch.empty(T, k, dtype=torch.long, device=logits.device)
    P = _pow2(E)
    lanes = min(P, WARP)
    route_topk[(T,)](logits, weights, experts, logits.stride(0), E=E, LANES=lanes, ITERS=P // lanes, K=k,
                     KP=_pow2(k), RENORM=routing.renorm, BF16_OUT=out_dtype == torch.bfloat16,
                     LIBDEVICE=not interpreting(), num_warps=1 if P <= 256 else 4)
    S = T * k
    order = torch.empty(S, dtype=torch.long, device=logits.device)
    sorted_experts = torch.empty(S, dtype=torch.long, device=logits.device)
    offsets = torch.empty(E, dtype=torch.int32, device=logits.device)
    sort_copies[(E,)](experts, order, sorted_experts, offsets, S=S, CHUNK=sort_chunk(S), PAD=NO_EXPERT,
                      num_warps=4)
    return weights, experts, order, sorted_experts, offsets
