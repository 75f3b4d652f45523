"""Fused projections for the refilling batch generator's static target (`StaticTarget(fuse=True)`, which
`generate.BatchGenerator` builds): the linears that read one input as one GEMM, and a gated SiLU MLP's activation as
one kernel.

Why: a decode step of 256 rows is a few hundred small launches per layer, and the small-N GEMMs run far below the
tensor cores' rate (qwen3-8b on the H200: k_proj and v_proj, N = 1024, at about 220 TFLOP/s, 0.70 ms a step over 36
layers). One [Nq + Nk + Nv, D] GEMM for q/k/v, one [2I, D] GEMM for gate/up, and silu(gate) * up in one pass over the
GEMM's output remove six launches per layer and give the tensor cores wider tiles.

Where: the attention layers' q/k/v and a dense MLP's gate/up, where they are plain `nn.Linear`s of one dtype, and the
MLP's own forward is down(silu(gate(x)) * up(x)) (`fp8_target.gated_silu_mlp`; Gemma's gelu MLP keeps HF's module). An
FP8 target's q/k/v (`Fp8Linear`s, bias-free) become one e4m3 GEMM too (`JoinedFp8`: the input quantized once, as
`fp8.project_shared` does, the weights stacked by output rows with their per-channel scales: the same function); its
MLP is already one (`fp8_target.Fp8GatedMlp`). An MoE layer's shared expert (Qwen3.5-MoE, Qwen3-Next) is such an MLP
too, and its gate (one output row) joins the router's weight: one [E + 1, D] GEMM; its routed experts (layers/moe.py)
are untouched. A Gated DeltaNet layer's input linears (Qwen3.5: qkv, z, b, a; Qwen3-Next: qkvz, ba) are one GEMM
(`linear_attention.project` takes their outputs in order): at qwen3.5-35b-a3b's decode step, b and a are 32 columns
each, launches rather than work. Memory does not grow: each module's weight (and bias) becomes a
view into the joined tensor, so HF's modules, their state_dict and every other caller see the same values under the
same names.

Why not under a speculative verify (`StaticTarget(invariant=True)`): its losslessness rests on cuBLAS giving a token
the same bits at M = 1 and M = 16 for the GEMM shapes measured (kernels.py); a joined GEMM has other shapes, whose
row-invariance nobody has measured, and whose split of the K sum may differ from the separate GEMMs'. The generator
runs prefill and steps through the same joined GEMMs and needs no such equality.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from trainer.decode.layers.attention import INVARIANT, AttentionLayer
from trainer.decode.layers.linear import GatedDeltaNetDecode
from trainer.decode.layers.moe import MoeMLP
from trainer.model.fp8 import Fp8Linear, quantize_rows, scaled_mm
from trainer.model.fp8_target import gated_silu_mlp
from trainer.model.linear_attention import input_projections
from trainer.triton_device import interpreting, runs_on, triton_kernels

SILU_BLOCK = 1024  # columns of one program: the activation is elementwise, so any split gives the same bits


@triton_kernels
def _kernel(triton, tl):
    """silu_mul_rows, or None where Triton is not installed (built once, on first use)."""
    from triton.language.extra import libdevice

    @triton.jit
    def silu_mul_rows(gu_ptr, h_ptr, gu_stride, n, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
        # torch's ops, rounding for rounding: silu(g) = g / (1 + exp(-g)) in fp32 (CUDA's expf and an IEEE division,
        # not Triton's approximate exp2 and division), rounded to the dtype, then times up in fp32, rounded. The
        # interpreter has no libdevice: there numpy's exp.
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < n
        g = tl.load(gu_ptr + row * gu_stride + cols, mask=inside, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * gu_stride + n + cols, mask=inside, other=0.0).to(tl.float32)
        if LIBDEVICE:
            e = libdevice.exp(-g)
        else:
            e = tl.exp(-g)
        s = tl.math.div_rn(g, 1.0 + e).to(h_ptr.dtype.element_ty).to(tl.float32)
        tl.store(h_ptr + row * n + cols, (s * u).to(h_ptr.dtype.element_ty), mask=inside)

    return silu_mul_rows


def silu_mul(gu: torch.Tensor, n: int) -> torch.Tensor:
    """[..., 2n] ([gate | up] per row, unit column stride) -> silu(gate) * up [..., n] in gu's dtype: one kernel
    where Triton runs (CUDA, the interpreter), else torch's two ops."""
    if not (runs_on(gu.device) and _kernel() is not None and not torch.compiler.is_compiling()):
        return F.silu(gu[..., :n]) * gu[..., n:]
    import triton

    lead = gu.shape[:-1]
    gu2 = gu.reshape(-1, 2 * n)
    if gu2.stride(-1) != 1:
        gu2 = gu2.contiguous()
    h = torch.empty(gu2.shape[0], n, dtype=gu.dtype, device=gu.device)
    if gu2.shape[0]:
        _kernel()[(gu2.shape[0], triton.cdiv(n, SILU_BLOCK))](gu2, h, gu2.stride(0), n, BLOCK=SILU_BLOCK,
                                                              LIBDEVICE=not interpreting(), num_warps=4)
    return h.view(*lead, n)


def joinable(linears) -> bool:
    """Plain `nn.Linear`s (no FP8 form) of one input width, dtype and device, all with a bias or none."""
    if not all(type(lin) is torch.nn.Linear for lin in linears):
        return False
    w0 = linears[0].weight
    return (w0.is_floating_point() and w0.element_size() >= 2
            and all(lin.weight.dtype == w0.dtype and lin.weight.device == w0.device
                    and lin.in_features == linears[0].in_features for lin in linears)
            and len({lin.bias is None for lin in linears}) == 1)


def _join(params) -> torch.Tensor:
    """One tensor whose leading slices are `params` (Parameters of one trailing shape), each Parameter's data then a
    view into it. Where they already sit end to end in one storage (a target joined before), that storage is
    viewed as it is: joining twice allocates nothing."""
    first = params[0]
    shape = (sum(p.shape[0] for p in params), *first.shape[1:])
    ends = [p.storage_offset() + p.numel() for p in params[:-1]]
    if all(p.is_contiguous() and p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
           and p.storage_offset() == end for p, end in zip(params[1:], ends)) and first.is_contiguous():
        return first.detach().as_strided(shape, torch.empty(shape, device="meta").stride())
    joined = torch.cat([p.detach() for p in params])
    at = 0
    for p in params:
        p.data = joined[at:at + p.shape[0]]
        at += p.shape[0]
    return joined


class Joined:
    """Linears that read one input, as one GEMM: x [..., D] -> their outputs, in order (views of one [..., sum N]
    tensor). Their modules' weights and biases become views into the joined ones (`_join`)."""

    def __init__(self, linears) -> None:
        if not joinable(linears):
            raise ValueError("only plain nn.Linears of one input width, dtype and device, with a bias on all or none, "
                             "are joined")
        self.sizes = [lin.out_features for lin in linears]
        self.weight = _join([lin.weight for lin in linears])
        self.bias = None if linears[0].bias is None else _join([lin.bias for lin in linears])

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        return list(F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1))


class JoinedFp8:
    """Bias-free `Fp8Linear`s of one input width and output dtype that read one input, as one e4m3 GEMM: x [..., D]
    quantized once by rows -> their outputs, in order. Their `weight_q` buffers become views into the stacked one
    (`_join`); the per-channel scales ([1, N] fp32 each) are copied side by side."""

    def __init__(self, linears) -> None:
        if not joinable_fp8(linears):
            raise ValueError("only bias-free Fp8Linears of one input width and output dtype are joined")
        self.sizes = [lin.out_features for lin in linears]
        self.in_features, self.out_dtype = linears[0].in_features, linears[0].out_dtype
        self.weight_q = _join([lin.weight_q for lin in linears])
        self.weight_scale = torch.cat([lin.weight_scale for lin in linears], dim=1)

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        lead = x.shape[:-1]
        x_q, x_scale = quantize_rows(x.reshape(-1, self.in_features))
        out = scaled_mm(x_q, x_scale, self.weight_q.t(), self.weight_scale, self.out_dtype)
        return list(out.reshape(*lead, sum(self.sizes)).split(self.sizes, dim=-1))


def joinable_fp8(linears) -> bool:
    first = linears[0]
    return (all(type(lin) is Fp8Linear and lin.bias is None for lin in linears)
            and all(lin.in_features == first.in_features and lin.out_dtype == first.out_dtype
                    and lin.weight_q.device == first.weight_q.device and lin.weight_q.is_contiguous()
                    for lin in linears))


def joined(linears) -> Joined | JoinedFp8 | None:
    """Linears that read one input as one GEMM (bf16 or FP8), or None where they are neither plain linears nor
    bias-free FP8 ones."""
    if joinable(linears):
        return Joined(linears)
    return JoinedFp8(linears) if joinable_fp8(linears) else None


def joined_qkv(attn) -> Joined | JoinedFp8 | None:
    """An attention module's q/k/v projection as one GEMM, or None (`joined`)."""
    return joined([attn.q_proj, attn.k_proj, attn.v_proj])


def join_router(mlp: MoeMLP) -> None:
    """An MoE layer's router and its shared expert's gate (one output row), both bias-free weights of one dtype, as
    one [E + 1, D] weight (`MoeMLP.router_gate`); the modules' weights become views of it."""
    gate = getattr(mlp.block, "shared_expert_gate", None)
    router = mlp.router.weight
    if (mlp.shared is None or type(gate) is not torch.nn.Linear or gate.bias is not None
            or getattr(mlp.router, "bias", None) is not None or gate.weight.dtype != router.dtype
            or gate.weight.device != router.device or gate.weight.shape[1] != router.shape[1]):
        return
    mlp.router_gate = _join([mlp.router.weight, gate.weight])


class SiluMlp:
    """A dense gated SiLU MLP as down(silu_mul(gate_up(x))): gate and up one GEMM (gate's rows first), the
    activation one kernel. The HF module's own linears, joined."""

    def __init__(self, mlp: torch.nn.Module) -> None:
        self.gate_up = Joined([mlp.gate_proj, mlp.up_proj])
        self.down_proj = mlp.down_proj
        self.intermediate = mlp.gate_proj.out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gu = F.linear(x, self.gate_up.weight, self.gate_up.bias)
        return self.down_proj(silu_mul(gu, self.intermediate))


def fused_mlp(mlp: torch.nn.Module):
    """`SiluMlp` of a dense MLP that computes down(silu(gate(x)) * up(x)) with plain bias-free linears, else the
    module as it is."""
    linears = [getattr(mlp, name, None) for name in ("gate_proj", "up_proj")]
    if all(isinstance(lin, torch.nn.Linear) for lin in linears) and joinable(linears) and gated_silu_mlp(mlp):
        return SiluMlp(mlp)
    return mlp


def fuse_layers(static) -> None:
    """Join a `StaticTarget`'s attention q/k/v projections, its linear layers' input projections and its MoE
    layers' routers with their shared experts' gates, and replace its dense gated SiLU MLPs and MoE layers' shared
    experts (the module docstring says where each applies). Refused for a target built for a verify
    (`invariant` asked)."""
    if static.attention == INVARIANT or static.fallback is not None:
        raise ValueError("fuse: joined GEMMs are not the shapes whose bits a lossless verify relies on")
    for mixer in static.mixers:
        if isinstance(mixer, AttentionLayer):
            mixer.project = joined_qkv(mixer.module)
        elif isinstance(mixer, GatedDeltaNetDecode):
            mixer.joined = joined(input_projections(mixer.inner))
    static.mlps = [fused_mlp(mlp) if kind == "dense" else mlp for kind, mlp in zip(static.plan.mlps, static.mlps)]
    for mlp in static.mlps:
        if isinstance(mlp, MoeMLP) and mlp.shared is not None:
            mlp.shared = fused_mlp(mlp.shared)
            join_router(mlp)
