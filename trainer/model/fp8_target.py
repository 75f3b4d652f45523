"""The FP8 target (`model.target_fp8`): its decoder layers' linears in FP8 (`quantize_target_layers`), a gated SiLU
MLP as one module (`Fp8GatedMlp`): down(silu(gate(x)) * up(x)) with gate and up as one FP8 GEMM, and silu(gate) * up
quantized to e4m3 rows by one Triton kernel that reads the GEMM's output once.

Why: compiled, the same math is one looped Inductor reduction per layer that reads gate and up twice, once for the
row's absolute max and once to quantize (`python3 -m bench.step --shape qwen3-8b --target-fp8 1 --profile 2`: 16 ms
of the 650-ms step at 34 layers). Here one program holds a row (gate and up, I values each) in registers, so the
input is read once: at the 8B-like width 0.18 ms a layer against Inductor's 0.39 (`python3 -m bench.swiglu`).
Rows of up to ROW_KERNEL_MAX values.

Only for MLPs that compute exactly down(silu(gate(x)) * up(x)) with bias-free linears (`gated_silu_mlp`: checked on
the module itself); every other MLP keeps one `Fp8Linear` per linear. Runs on CUDA, and on CPU under Triton's
interpreter (the tests); elsewhere the same function in torch, which Inductor fuses.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from trainer.model.fp8 import E4M3, E4M3_MAX, Fp8Linear, quantize_rows
from trainer.triton_device import triton_kernels

# replaced: attention and MLP projections, and a Gated DeltaNet's (Qwen3.5 projects q/k/v and z apart, Qwen3-Next
# together; `out_proj` is read only on a Gated DeltaNet module)
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                "in_proj_qkv", "in_proj_z", "in_proj_qkvz", "out_proj")
ROW_KERNEL_MAX = 16384  # intermediate sizes the one-row-in-registers kernel takes (one power-of-two block per half)


@triton_kernels
def _kernels(triton, tl):
    """(row kernel, looped kernel), or None where Triton is not installed (built once, on first use)."""
    @triton.jit
    def swiglu_e4m3_row(gu_ptr, q_ptr, scale_ptr, gu_stride, q_stride, n: tl.constexpr, FP8_MAX: tl.constexpr,
                        BLOCK: tl.constexpr):
        """One row: h = silu(gate) * up from [gate | up] (n each), its e4m3 form at h's absolute max -> FP8_MAX."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        inside = cols < n
        base = gu_ptr + row * gu_stride
        g = tl.load(base + cols, mask=inside, other=0.0).to(tl.float32)
        u = tl.load(base + n + cols, mask=inside, other=0.0).to(tl.float32)
        h = g * tl.sigmoid(g) * u
        scale = tl.maximum(tl.max(tl.abs(h), axis=0), 1e-12) / FP8_MAX
        # NaN kept (the default max/min drop it): a NaN in the target's activations must reach the loss, which stops
        # the run, as torch's form would.
        q = tl.minimum(tl.maximum(h / scale, -FP8_MAX, propagate_nan=tl.PropagateNan.ALL), FP8_MAX,
                       propagate_nan=tl.PropagateNan.ALL)
        tl.store(q_ptr + row * q_stride + cols, q.to(q_ptr.dtype.element_ty), mask=inside)
        tl.store(scale_ptr + row, scale)

    @triton.jit
    def swiglu_e4m3_looped(gu_ptr, q_ptr, scale_ptr, gu_stride, q_stride, n: tl.constexpr, FP8_MAX: tl.constexpr,
                           BLOCK: tl.constexpr):
        """The same per row in column blocks: one pass for the max, a second (mostly from L2) to quantize."""
        row = tl.program_id(0).to(tl.int64)
        base = gu_ptr + row * gu_stride
        top = tl.zeros([BLOCK], tl.float32)
        for start in range(0, n, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < n
            g = tl.load(base + cols, mask=inside, other=0.0).to(tl.float32)
            u = tl.load(base + n + cols, mask=inside, other=0.0).to(tl.float32)
            top = tl.maximum(top, tl.abs(g * tl.sigmoid(g) * u))
        scale = tl.maximum(tl.max(top, axis=0), 1e-12) / FP8_MAX
        for start in range(0, n, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < n
            g = tl.load(base + cols, mask=inside, other=0.0).to(tl.float32)
            u = tl.load(base + n + cols, mask=inside, other=0.0).to(tl.float32)
            q = tl.minimum(tl.maximum(g * tl.sigmoid(g) * u / scale, -FP8_MAX, propagate_nan=tl.PropagateNan.ALL),
                           FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
            tl.store(q_ptr + row * q_stride + cols, q.to(q_ptr.dtype.element_ty), mask=inside)
        tl.store(scale_ptr + row, scale)

    return swiglu_e4m3_row, swiglu_e4m3_looped


def kernel_usable(device: torch.device, n: int) -> bool:
    """The row kernel can take rows of n gate (and n up) values on `device`: Triton, CUDA or the interpreter."""
    from trainer.triton_device import runs_on

    return n <= ROW_KERNEL_MAX and runs_on(device) and _kernels() is not None


def row_warps(block: int) -> int:
    """Warps for a row of `block` values per half: 8 at the 8B-like width (block 16384: 0.183 ms a call against 0.190
    at 4 warps, 0.215 at 16 and 0.224 at 32, `python3 -m bench.swiglu`), 4 for narrower rows."""
    return max(4, min(8, block // 2048))


def swiglu_e4m3_rows(gu: torch.Tensor, n: int, looped_block: int = 0, warps: int = 0,
                     out_dtype: torch.dtype = E4M3):
    """[M, 2n] ([gate | up] per row) -> (silu(gate) * up in e4m3 [M, n], row scales [M, 1] fp32), by the row kernel,
    or (looped_block > 0, for the bench) the looped one with column blocks of that size. out_dtype float32 keeps
    the scaled values before their cast (the CPU tests: Triton's interpreter rounds to e4m3 unlike the GPU)."""
    import triton

    check_gate_up(gu, n)
    if not looped_block and n > ROW_KERNEL_MAX:
        raise ValueError(f"the row kernel takes rows of at most {ROW_KERNEL_MAX} values per half, got {n}")
    kernels = _kernels()
    if kernels is None:
        raise RuntimeError("the SwiGLU kernel needs Triton, which is not installed")
    row_kernel, looped_kernel = kernels
    M = gu.shape[0]
    q = torch.empty(M, n, dtype=out_dtype, device=gu.device)
    scale = torch.empty(M, 1, dtype=torch.float32, device=gu.device)
    # Triton launches on the current device: make it gu's
    on_device = torch.cuda.device(gu.device) if gu.device.type == "cuda" else contextlib.nullcontext()
    with on_device:
        if looped_block:
            looped_kernel[(M,)](gu, q, scale, gu.stride(0), q.stride(0), n, FP8_MAX=E4M3_MAX, BLOCK=looped_block,
                                num_warps=warps or row_warps(looped_block))
        else:
            block = triton.next_power_of_2(n)
            row_kernel[(M,)](gu, q, scale, gu.stride(0), q.stride(0), n, FP8_MAX=E4M3_MAX, BLOCK=block,
                             num_warps=warps or row_warps(block))
    return q, scale


def check_gate_up(gu: torch.Tensor, n: int) -> None:
    """gu must be [M, 2n] rows of [gate | up] with unit column stride (what the kernel indexes)."""
    if gu.dim() != 2 or gu.shape[1] != 2 * n or gu.stride(1) != 1:
        raise ValueError(f"expected [M, {2 * n}] gate|up rows with unit column stride, got shape {tuple(gu.shape)} "
                         f"and strides {gu.stride()}")


@torch.library.custom_op("dflash::swiglu_e4m3", mutates_args=())
def swiglu_e4m3(gu: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The row kernel as one opaque op, so that a compiled target layer calls it as it is."""
    return swiglu_e4m3_rows(gu if gu.dim() != 2 or gu.stride(1) == 1 else gu.contiguous(), n)


@swiglu_e4m3.register_fake
def _(gu: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    if gu.dim() != 2 or gu.shape[1] != 2 * n:
        raise ValueError(f"expected [M, {2 * n}] gate|up rows, got shape {tuple(gu.shape)}")
    return gu.new_empty(gu.shape[0], n, dtype=E4M3), gu.new_empty(gu.shape[0], 1, dtype=torch.float32)


def swiglu_e4m3_reference(gu: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's function in torch: the form Inductor compiles where the kernel does not run."""
    h = F.silu(gu[:, :n].float()) * gu[:, n:].float()
    return quantize_rows(h)


def gated_silu_mlp(mlp: torch.nn.Module) -> bool:
    """`mlp` has bias-free gate/up/down linears and its own forward computes down(silu(gate(x)) * up(x)) (checked on
    random tokens of unit to thousandfold scale, in its dtype, against the same ops: equal for the HF families that
    have this MLP)."""
    linears = [getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    if not all(isinstance(lin, torch.nn.Linear) and lin.bias is None for lin in linears):
        return False
    gate, up, down = linears
    device = gate.weight.device
    probe = torch.Generator(device=device).manual_seed(0)  # the run's own random stream stays untouched
    x = torch.randn(1, 6, gate.in_features, device=device, generator=probe)
    x = (x * torch.tensor([1.0, 1.0, 10.0, 100.0, 1000.0, 1000.0], device=device)[:, None]).to(gate.weight.dtype)
    with torch.no_grad():
        try:
            got = mlp(x)
        except (TypeError, ValueError):  # a forward that takes more than x is not this form
            return False
        want = down(F.silu(gate(x)) * up(x))
    return (isinstance(got, torch.Tensor) and got.shape == want.shape
            and torch.allclose(got.float(), want.float(), rtol=1e-3, atol=1e-5))


class Fp8GatedMlp(torch.nn.Module):
    """A gated SiLU MLP in FP8: gate and up as one e4m3 GEMM (`Fp8Linear` of both, gate's rows first), silu(gate) *
    up to e4m3 rows (`swiglu_e4m3`), down on the FP8 tensor cores."""

    def __init__(self, mlp: torch.nn.Module) -> None:
        super().__init__()
        if not gated_silu_mlp(mlp):
            raise ValueError(f"{type(mlp).__name__} does not compute down(silu(gate(x)) * up(x)) with bias-free "
                             f"linears")
        self.gate_up = Fp8Linear(mlp.gate_proj, mlp.up_proj)  # [2I, D]: the kernel's [gate | up] rows
        self.down_proj = Fp8Linear(mlp.down_proj)
        self.intermediate = mlp.gate_proj.out_features
        self.kernel = kernel_usable(self.gate_up.weight_q.device, self.intermediate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        gu = self.gate_up(x).reshape(-1, 2 * self.intermediate)
        if self.kernel:
            h_q, h_scale = torch.ops.dflash.swiglu_e4m3(gu, self.intermediate)
        else:
            h_q, h_scale = swiglu_e4m3_reference(gu, self.intermediate)
        return self.down_proj.product(h_q, h_scale).reshape(*lead, self.down_proj.out_features)


def fp8_shaped(linear: torch.nn.Module) -> bool:
    """The FP8 tensor cores take this linear: both its widths multiples of 16 (`torch._scaled_mm`'s rule; every
    supported family's real shapes are). Others stay in the target's dtype."""
    return isinstance(linear, torch.nn.Linear) and linear.in_features % 16 == 0 and linear.out_features % 16 == 0


def _gdn_projections(layer) -> torch.nn.Module | None:
    """A hybrid layer's Gated DeltaNet module (HF's, also when trainer.model.linear_attention wraps it), or None."""
    mixer = getattr(layer, "linear_attn", None)
    return getattr(mixer, "inner", mixer)


def quantize_target_layers(layers) -> int:
    """Replace every decoder-layer linear named in LINEAR_NAMES by FP8, in place -> how many linears were replaced.
    The bf16 weights are freed. Covered: softmax attention's projections; a dense MLP and an MoE layer's shared
    expert (a gated SiLU MLP whole by an `Fp8GatedMlp`, else one `Fp8Linear` per linear); a Gated DeltaNet layer's
    input and output projections. Left in bf16: routed experts (3-D weights of one grouped GEMM, not linears), routers,
    the Gated DeltaNet's beta and decay projections (a handful of outputs a head, into a sigmoid and an exp), and any
    linear whose widths the FP8 tensor cores do not take (`fp8_shaped`)."""
    replaced = 0
    for layer in layers:
        mlp = getattr(layer, "mlp", None)
        mlps = [(layer, "mlp")] + ([(mlp, "shared_expert")] if hasattr(mlp, "shared_expert") else [])
        parents = [getattr(layer, "self_attn", None), _gdn_projections(layer)]
        for owner, name in mlps:
            block = getattr(owner, name, None)
            if (block is not None and all(fp8_shaped(getattr(block, n, None)) for n in ("gate_proj", "up_proj",
                                                                                        "down_proj"))
                    and gated_silu_mlp(block)):
                setattr(owner, name, Fp8GatedMlp(block))
                replaced += 3
            else:
                parents.append(block)
        for parent in parents:
            if parent is None:
                continue
            for name in LINEAR_NAMES:
                child = getattr(parent, name, None)
                if fp8_shaped(child):
                    setattr(parent, name, Fp8Linear(child))
                    replaced += 1
    return replaced
