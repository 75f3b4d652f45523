"""The MoE MLP at decode: the family's router, then the experts as grouped GEMMs over token copies sorted by expert,
with static shapes and no host sync, so a decode step or a verify that runs it can be captured in a CUDA graph.

For T = R x L tokens and top-k experts each there are S = T x k token copies, always S rows: the copies are sorted
by expert (a stable argsort), each expert's rows end at `offsets[e]` (a device tensor, found by searchsorted), and
one GEMM per projection covers every expert: `torch.nn.functional.grouped_mm` on CUDA for bf16 weights (the kernel the
training target runs through transformers' `grouped_mm` experts, `model/target.load_options`), else the exact torch
rule, each copy times its expert's gathered weight (S x in x out of memory: a reference, not a fast path). Other
dtypes take torch's grouped_mm fallback, which reads the offsets on the host and so cannot be captured; they run the
exact rule. A decode step's few copies an expert take `moe_kernel.py`'s kernels instead, where they serve the
experts (SiLU-GLU, bf16 on CUDA; unless switched off, `switches.py`): the same arithmetic, one weight read an expert;
there a prefill's many copies take the grouped GEMMs, then `moe_kernel.combine_sorted`: the routing weights, the
copies' order back and their sum in one pass over the GEMMs' output instead of three.
The arithmetic after the GEMMs is transformers' grouped experts forward: biases per copy, the experts module's own
gate (`_apply_gate`: SiLU-GLU, gpt-oss's clamped GLU), the routing weight on each copy's output, the copies back in
token order, summed over k. A shared expert (Qwen3-Next, Qwen3.5-MoE) adds its sigmoid-gated output.

Routing, per family (`ROUTING`, from the config's model type):
    softmax_topk   softmax over all experts in fp32, top-k, renormalised to sum 1 where the family does (`renorm`),
                   cast back to the logits' dtype where the family does (Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE; Mixtral
                   keeps fp32)
    topk_softmax   top-k of the (biased) logits, softmax over those k in the logits' dtype (gpt-oss)
Where Triton runs (CUDA; unless the kernel "route" is switched off, `switches.py`), softmax_topk's router and
the sort by expert are two kernels giving the same tensors (`trainer/decode/route_kernel.py`: its docstring says where
the weights' last bit may differ, and which expert an exact tie picks); elsewhere, and beyond the kernels' sizes, the
torch ops.

Shape legend: R rows, L tokens, T = R x L, k experts per token, S = T x k copies, E experts, D hidden.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trainer.decode import moe_kernel, route_kernel, switches


@dataclass(frozen=True)
class Routing:
    """A family's router rule (see the module docstring)."""

    order: str  # softmax_topk | topk_softmax
    renorm: bool = False
    cast: bool = False


def routing_of(cfg) -> Routing | None:
    """The router rule of an MoE config, or None for a family this module has no rule for."""
    model_type = getattr(cfg, "model_type", None)
    if model_type in ("qwen3_moe", "qwen3_next"):
        return Routing("softmax_topk", renorm=bool(getattr(cfg, "norm_topk_prob", False)), cast=True)
    if model_type in ("qwen3_5_moe", "qwen3_5_moe_text"):
        return Routing("softmax_topk", renorm=True, cast=True)
    if model_type == "mixtral":
        return Routing("softmax_topk", renorm=True, cast=False)
    if model_type == "gpt_oss":
        return Routing("topk_softmax")
    return None


def route(logits: torch.Tensor, k: int, routing: Routing) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k], experts [T, k] long), as the family's HF router computes them."""
    if routing.order == "topk_softmax":
        top, experts = torch.topk(logits, k, dim=-1)
        return F.softmax(top, dim=-1, dtype=top.dtype), experts
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, k, dim=-1)
    if routing.renorm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights.to(logits.dtype) if routing.cast else weights), experts


def sort_by_expert(experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """experts [T, k] -> (order [S]: copy indices sorted by expert, stably; expert of each sorted copy [S];
    offsets [E] int32: where each expert's rows end, grouped_mm's `offs`). Static shapes, no host sync."""
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    bounds = torch.arange(num_experts, device=flat.device, dtype=flat.dtype)
    offsets = torch.searchsorted(sorted_experts, bounds, right=True).to(torch.int32)
    return order, sorted_experts, offsets


def grouped_available(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether the grouped GEMM kernel serves weights of this dtype on this device: bf16 on CUDA at compute
    capability 8.0 or above with `torch.nn.functional.grouped_mm`. Elsewhere (CPU, fp32) the exact rule runs."""
    return (device.type == "cuda" and dtype == torch.bfloat16 and hasattr(F, "grouped_mm")
            and torch.cuda.get_device_capability(device) >= (8, 0))


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, transposed: bool, offsets: torch.Tensor,
                   sorted_experts: torch.Tensor, grouped: bool) -> torch.Tensor:
    """x [S, in] sorted by expert; weight [E, out, in] ([E, in, out] when `transposed`, gpt-oss's layout) ->
    [S, out]: each row times its expert's weight. grouped: one grouped_mm over `offsets`; else the exact rule."""
    w = weight if transposed else weight.transpose(-2, -1)  # [E, in, out]
    x = x.to(w.dtype)
    if grouped:
        return F.grouped_mm(x, w, offs=offsets)
    return torch.bmm(x[:, None], w[sorted_experts]).squeeze(1)


def gated_sum(y: torch.Tensor, gate: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """The routed experts' sum y plus the shared expert's output weighted by the sigmoid of its gate logit (what
    `moe_kernel.combine` computes in one kernel, given the sigmoid)."""
    return y + torch.sigmoid(gate) * shared


@functools.lru_cache(maxsize=None)
def side_stream(device: torch.device) -> torch.cuda.Stream:
    """One stream a device for every MoE layer's shared expert: of high priority (its small GEMMs first), so from
    another pool than the normal-priority streams the graphs are captured on (torch hands those out round-robin: a
    per-layer stream could be the capture stream itself, and the overlap silently serial)."""
    return torch.cuda.Stream(device, priority=-1)


class MoeMLP:
    """An HF sparse MoE block (`gate` or `router`: weight [E, D], bias where the family has one; `experts`:
    gate_up_proj / down_proj as 3-D tensors, their biases where the family has them, `_apply_gate`; a
    `shared_expert` with `shared_expert_gate` where the family has one) computed at decode. Callable like a dense
    MLP: h [R, L, D] -> [R, L, D]. grouped: None picks the grouped GEMM where it serves the weights' device; kernel:
    True takes `moe_kernel`'s experts kernels where they serve the experts, for calls of few copies an expert;
    router_kernel: True takes `route_kernel`'s router and sort where usable, on one-token steps; overlap: True runs
    the shared expert on a second CUDA stream beside the experts kernels (None, each: unless its kernel, "moe",
    "route" or "overlap", is switched off, `switches.py`)."""

    def __init__(self, block, routing: Routing, top_k: int, grouped: bool | None = None,
                 kernel: bool | None = None, router_kernel: bool | None = None,
                 overlap: bool | None = None) -> None:
        experts = getattr(block, "experts", None)
        if not (isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor) and experts.gate_up_proj.dim() == 3):
            raise RuntimeError(f"{type(block).__name__}: the static engine needs the experts as 3-D weight tensors "
                               f"(transformers 5); this one keeps them another way")
        self.block, self.experts, self.routing, self.top_k = block, experts, routing, top_k
        self.router = getattr(block, "gate", None) or block.router
        self.num_experts = experts.gate_up_proj.shape[0]
        self.transposed = bool(getattr(experts, "is_transposed", False))
        weight = experts.gate_up_proj
        self.grouped = grouped_available(weight.device, weight.dtype) if grouped is None else grouped
        self.kernel = (switches.on("moe") if kernel is None else kernel) and moe_kernel.serves(experts)
        self.router_kernel = switches.on("route") if router_kernel is None else router_kernel
        self.overlap = switches.on("overlap") if overlap is None else overlap
        self.side = None  # the shared expert's CUDA stream (`side_stream`), once it ran there
        self.shared = getattr(block, "shared_expert", None)
        # the router's weight and the shared expert's gate as one [E + 1, D] weight (decode/fused.py), or None
        self.router_gate: torch.Tensor | None = None

    def _bias(self, name: str, sorted_experts: torch.Tensor) -> torch.Tensor | None:
        bias = getattr(self.experts, f"{name}_bias", None)
        return None if bias is None else bias[sorted_experts]

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        R, L, D = h.shape
        x = h.reshape(R * L, D)
        logits, gate = self._route_logits(x)
        # the router kernel on one-token steps only: its sort compiles per count of copies, fixed at a step's rows
        if self.router_kernel and L == 1 and route_kernel.usable(logits, self.routing, self.top_k):
            weights, _, order, sorted_experts, offsets = route_kernel.route_and_sort(logits, self.top_k, self.routing)
        else:
            weights, experts = route(logits, self.top_k, self.routing)
            order, sorted_experts, offsets = sort_by_expert(experts, self.num_experts)
        if self.kernel and not torch.compiler.is_compiling():
            if moe_kernel.few_copies(order.shape[0], self.num_experts):
                return self._kernel_experts(x, order, offsets, weights, gate, h.dtype).view(R, L, D)
            return self._grouped_combined(x, order, sorted_experts, offsets, weights, gate, h.dtype).view(R, L, D)
        out = self._grouped_sorted(x, order, sorted_experts, offsets)
        y = self._weighted_in_token_order(out, order, weights).sum(dim=1).to(h.dtype)
        return self._with_shared(y, x, gate).view(R, L, D)

    def _grouped_combined(self, x: torch.Tensor, order: torch.Tensor, sorted_experts: torch.Tensor,
                          offsets: torch.Tensor, weights: torch.Tensor, gate: torch.Tensor | None,
                          dtype: torch.dtype) -> torch.Tensor:
        """A prefill's many copies where the kernels serve the experts: the grouped GEMMs, then the routing weights,
        the copies' order back, their sum and the shared expert as `moe_kernel.combine_sorted`'s one pass over the
        GEMMs' output (the grouped path's roundings) -> y [T, D]."""
        out = self._grouped_sorted(x, order, sorted_experts, offsets)
        if self.shared is None:
            return moe_kernel.combine_sorted(out, order, weights, dtype)
        factor, shared = self._shared_beside(x, gate, beside=False)()
        if factor.dtype == shared.dtype == dtype:
            return moe_kernel.combine_sorted(out, order, weights, dtype, factor, shared)
        return self._weighted_in_token_order(out, order, weights).sum(dim=1).to(dtype) + factor * shared

    def _weighted_in_token_order(self, out: torch.Tensor, order: torch.Tensor, weights: torch.Tensor
                                 ) -> torch.Tensor:
        """The experts' output out [S, D] in expert order -> [T, k, D]: each copy times its routing weight, in token
        order."""
        out = out * weights.reshape(-1)[order].unsqueeze(-1)
        unsorted = torch.empty_like(out).index_copy_(0, order, out)  # copy order back: token t's k copies adjacent
        return unsorted.view(-1, self.top_k, out.shape[-1])

    def _grouped_sorted(self, x: torch.Tensor, order: torch.Tensor, sorted_experts: torch.Tensor,
                        offsets: torch.Tensor) -> torch.Tensor:
        """The copies through their experts as grouped GEMMs (or the exact rule), biases and gate included -> [S, D]
        in expert order, before the routing weights."""
        copies = x[order // self.top_k]  # [S, D]
        up = grouped_linear(copies, self.experts.gate_up_proj, self.transposed, offsets, sorted_experts,
                            self.grouped)
        bias = self._bias("gate_up_proj", sorted_experts)
        if bias is not None:
            up = up + bias
        act = self.experts._apply_gate(up)
        out = grouped_linear(act, self.experts.down_proj, self.transposed, offsets, sorted_experts, self.grouped)
        bias = self._bias("down_proj", sorted_experts)
        return out if bias is None else out + bias

    def _kernel_experts(self, x: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor,
                        gate: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """The copies through `moe_kernel`'s experts kernels, then their sum and the shared expert as its one
        combining kernel where their dtypes are the layer's -> y [T, D]."""
        joined = None if self.shared is None else self._shared_beside(x, gate)
        out = moe_kernel.experts_forward(self.experts, x.to(self.experts.gate_up_proj.dtype), order, offsets,
                                         weights)
        if joined is None:
            return moe_kernel.combine(out, dtype)
        factor, shared = joined()
        if factor.dtype == shared.dtype == dtype:
            return moe_kernel.combine(out, dtype, factor, shared)
        return out.sum(dim=1).to(dtype) + factor * shared

    def _shared_beside(self, x: torch.Tensor, gate: torch.Tensor | None, beside: bool = True):
        """The shared expert and its gate's sigmoid (the gate logit where the joined router did not give it) -> a
        call that returns them (factor [T, 1], shared [T, D]). Where on (the kernel "overlap", switches.py) and on CUDA,
        they start now on a second stream, beside the routed experts' kernels (memory-bound: the small GEMMs hide in
        their time), and the call joins that stream back: a fork and a join in a captured graph, the same
        arithmetic. Else (or beside=False) they run at the call."""
        def factor_and_shared() -> tuple[torch.Tensor, torch.Tensor]:
            return torch.sigmoid(self.block.shared_expert_gate(x) if gate is None else gate), self.shared(x)

        if not (beside and self.overlap and x.is_cuda):
            return factor_and_shared
        main = torch.cuda.current_stream(x.device)
        self.side = side_stream(x.device)
        self.side.wait_stream(main)
        with torch.cuda.stream(self.side):
            factor, shared = factor_and_shared()

        def join() -> tuple[torch.Tensor, torch.Tensor]:
            main.wait_stream(self.side)
            for t in (factor, shared):  # used on the main stream now: not reused before its work there is done
                t.record_stream(main)
            return factor, shared
        return join

    def _route_logits(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [T, D] -> (router logits [T, E], the shared expert's gate logit [T, 1] where the joined weight gave it
        in the same GEMM, else None)."""
        if self.router_gate is not None:
            both = F.linear(x, self.router_gate)
            return both[:, :self.num_experts], both[:, self.num_experts:]
        return F.linear(x, self.router.weight, getattr(self.router, "bias", None)), None

    def _with_shared(self, y: torch.Tensor, x: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """The routed experts' sum y [T, D] plus the sigmoid-gated shared expert where the family has one (gate: its
        gate logit where already computed)."""
        if self.shared is None:
            return y
        gate = self.block.shared_expert_gate(x) if gate is None else gate
        return gated_sum(y, gate, self.shared(x))
