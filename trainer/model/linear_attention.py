"""Gated DeltaNet layers of hybrid targets (Qwen3-Next, Qwen3.5, Qwen3.6; dense and MoE) over packed rows.

A packed row holds several documents; HF runs each layer's short convolution and its recurrence over the whole row,
so a document would start from the previous document's state. Here every document starts as it does alone: the
convolution sees zeros before a document's first token, and the recurrent state is zero at it. Fixed shapes, no
host sync, nothing data-dependent on the host: the document layout enters only as device masks, so the step's
capture rules hold.

Why setting the state to zero at a document start is a mask and nothing more: the gated delta rule is
    S_t = exp(g_t) * S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T,   o_t = S_t^T q_t,
so a decay of exp(g_t) = 0 at a document's first token zeroes what came before it, and a document alone starts from
S = 0, where g of its first token multiplies nothing. Two forms of that:
- `packed_chunk_gated_delta_rule`, pure torch: HF's chunked algorithm, with the within-chunk decays masked to each
  document and the state read and carried only inside the document it belongs to. Exact (fp32, as HF's); the CPU
  path and the reference the other form is tested against.
- fla's chunked Triton kernels (`fla` importable, CUDA): the same rows, with g at every document start set to
  -`FLA_RESET`, so exp(g) underflows to 0 in fp32. fla's own varlen path (`cu_seqlens`) derives its chunk indices
  on the host from the lengths, which would change shapes and sync every step. The cost of the reset value: the
  decays after a start within one 64-token chunk are differences of fp32 numbers near -FLA_RESET, about 4e-6
  relative, three orders below bf16's rounding.

Decoding (trainer/decode/layers/linear.py) runs the same rule from a start state: `gated_delta_block` (one chunk),
`state_after` (the state after any prefix of that chunk), `gated_delta_step` (one token, the recurrent form), and
fla's chunked kernel given the state (`fla_gated_delta_rule_from`); the projections, gates and output are shared.

Shape legend: R rows, S tokens per row, C conv channels (2 * key dim + value dim), K conv taps, Hk / Hv key / value
heads, dk / dv head dims, N chunks of L tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from trainer.model.fp8 import project_shared

LINEAR = "linear_attention"  # HF's layer type
CHUNK = 64  # HF's and fla's chunk length
FLA_RESET = 30.0  # exp(-30 * log2(e)) underflows to 0 in fp32 inside fla's exp2


@dataclass(frozen=True)
class PackedDocs:
    """What a linear-attention layer is handed as its `attention_mask` for packed rows: the rows' doc ids [R, S]
    (integers, -1 = padding). A type of its own, so that HF's own masks (None, or a 0/1 padding mask) still take
    HF's own path."""

    doc_ids: torch.Tensor


def doc_starts(doc_ids: torch.Tensor) -> torch.Tensor:
    """[R, S] bool: True at every position whose document differs from the previous position's (and at 0)."""
    first = torch.ones_like(doc_ids[:, :1], dtype=torch.bool)
    return torch.cat([first, doc_ids[:, 1:] != doc_ids[:, :-1]], dim=1)


def packed_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, doc_ids: torch.Tensor) -> torch.Tensor:
    """HF's causal depthwise convolution + SiLU over each document alone. x [R, S, C], weight [C, K] (HF's conv1d
    weight squeezed), doc_ids [R, S] -> [R, S, C]. Tap k reads position t - k only inside t's document (zero before
    it, as HF's zero padding of a document alone)."""
    taps = weight.shape[1]
    out = x * weight[:, taps - 1].to(x.dtype)
    for k in range(1, taps):
        shifted = F.pad(x[:, :-k], (0, 0, k, 0))
        same = F.pad(doc_ids[:, k:] == doc_ids[:, :-k], (k, 0))  # [R, S]: t - k exists and is in t's document
        out = out + shifted * (weight[:, taps - 1 - k].to(x.dtype) * same[..., None])
    return F.silu(out)


def causal_conv1d_window(window: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """HF's causal depthwise convolution + SiLU of one sequence whose first K-1 inputs are the state it continues:
    window [R, K-1+L, C], weight [C, K] -> [R, L, C] (`packed_causal_conv1d` of a single document, without its
    per-tap document masks: one depthwise conv1d, as HF's `causal_conv1d_fn`)."""
    out = F.conv1d(window.transpose(1, 2), weight[:, None].to(window.dtype), groups=weight.shape[0])
    return F.silu(out).transpose(1, 2)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)  # HF's (and fla's) normalization


def _heads_first(q, k, v, g, beta):
    """q, k [R, S, Hk, dk]; v [R, S, Hv, dv]; g, beta [R, S, Hv] -> the same in fp32, heads first ([R, Hv, S, ...]),
    q / k repeated to the value heads (each query/key head serves Hv // Hk consecutive value heads), L2-normalized
    (HF's `use_qk_l2norm_in_kernel=True`), q scaled by dk ** -0.5."""
    hk, dk, hv = k.shape[2], k.shape[3], v.shape[2]
    if hv != hk:
        q, k = (x.repeat_interleave(hv // hk, dim=2) for x in (q, k))
    q, k, v, g, beta = (x.transpose(1, 2).float() for x in (q, k, v, g, beta))
    return _l2norm(q) * dk ** -0.5, _l2norm(k), v, g, beta


def _within_chunk(q, k, v, beta, decay, entry):
    """HF's UT transform of a chunk of L positions (heads-first fp32, [..., L, d]). decay [..., L, L]: exp of the log
    decay from position j to i (0 where j does not reach i); entry [..., L]: each position's decay from the state
    entering the chunk (0 where it does not read it). -> (new_values, k_cumdecay, intra, q_state), so that from the
    entering state S: v_new = new_values - k_cumdecay @ S, out = q_state @ S + intra @ v_new."""
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    ut = (k_beta @ k.transpose(-1, -2)) * decay
    new_values = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut, k_beta * entry[..., None], upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay
    return new_values, k_cumdecay, intra, q * entry[..., None]


def packed_chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                  beta: torch.Tensor, starts: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """The gated delta rule with q/k L2-normalized (HF's `use_qk_l2norm_in_kernel=True`), every document from a zero
    state. q, k [R, S, Hk, dk]; v [R, S, Hv, dv]; g, beta [R, S, Hv]; starts [R, S] bool -> [R, S, Hv, dv] in v's
    dtype. HF's `torch_chunk_gated_delta_rule` for one document alone; here any number of documents per row."""
    out_dtype = v.dtype
    rows, seq = k.shape[:2]
    hv = v.shape[2]
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)
    pad = (chunk - seq % chunk) % chunk
    if pad:  # trailing positions of their own: they start a document, so they touch nothing real
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
        starts = F.pad(starts, (0, pad), value=True)
    n = (seq + pad) // chunk
    q, k, v = (x.reshape(rows, hv, n, chunk, -1) for x in (q, k, v))
    beta, g = (x.reshape(rows, hv, n, chunk) for x in (beta, g))
    # seg[i]: how many documents start at or before position i of its chunk; 0 = the document running in from before
    seg = starts.reshape(rows, 1, n, chunk).cumsum(-1)
    same = seg[..., :, None] == seg[..., None, :]  # [R, 1, N, L, L]
    alive = (seg == 0).float()  # reads (and is read by) the state carried in
    tail = (seg == seg[..., -1:]).float()  # in the document that runs on into the next chunk
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    cum = g.cumsum(-1)  # [R, H, N, L]
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~(lower & same), float("-inf")).exp()

    # decay is block-diagonal per document, so the UT system is too
    new_values, k_cumdecay, intra, q_state = _within_chunk(q, k, v, beta, decay, cum.exp() * alive)
    k_tail = k * ((cum[..., -1:] - cum).exp() * tail)[..., None]
    carry = (cum[..., -1].exp() * alive[..., -1])[..., None, None]  # 0 when a document starts in the chunk

    state = q.new_zeros(rows, hv, k.shape[-1], v.shape[-1])
    outs = []
    for i in range(n):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        outs.append(q_state[:, :, i] @ state + intra[:, :, i] @ v_new)
        state = state * carry[:, :, i] + k_tail[:, :, i].transpose(-1, -2) @ v_new
    out = torch.stack(outs, dim=2).reshape(rows, hv, n * chunk, -1)[:, :, :seq]
    return out.transpose(1, 2).to(out_dtype).contiguous()


@dataclass(frozen=True)
class BlockTerms:
    """What rebuilds the state after any prefix of a block computed by `gated_delta_block` (heads-first fp32):
    k [R, Hv, L, dk] (normalized keys), v_new [R, Hv, L, dv] (the corrected values), cum [R, Hv, L] (the inclusive
    cumulative log decays)."""

    k: torch.Tensor
    v_new: torch.Tensor
    cum: torch.Tensor


def gated_delta_block(q, k, v, g, beta, state: torch.Tensor) -> tuple[torch.Tensor, BlockTerms]:
    """The gated delta rule over a block of L tokens (one chunk of HF's chunked algorithm, of any length) from a
    start state [R, Hv, dk, dv] fp32, q/k L2-normalized. Same arguments as `packed_chunk_gated_delta_rule`, without
    documents: the block continues the sequence the state summarizes. -> (out [R, L, Hv, dv] in v's dtype, the
    terms `state_after` reads). The state is not changed."""
    out_dtype = v.dtype
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)
    length = k.shape[2]
    cum = g.cumsum(-1)  # [R, H, L]
    lower = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    new_values, k_cumdecay, intra, q_state = _within_chunk(q, k, v, beta, decay, cum.exp())
    v_new = new_values - k_cumdecay @ state
    out = q_state @ state + intra @ v_new
    return out.transpose(1, 2).to(out_dtype).contiguous(), BlockTerms(k, v_new, cum)


def gated_delta_step(q, k, v, g, beta, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule for one token (HF's recurrent form; `gated_delta_block` of L = 1 up to rounding) from `state`
    [R, Hv, dk, dv] fp32: q, k [R, 1, Hk, dk]; v [R, 1, Hv, dv]; g, beta [R, 1, Hv] -> (out [R, 1, Hv, dv] in v's
    dtype, the new state: S = exp(g) S; S += k (beta (v - S^T k))^T; out = S^T q)."""
    out_dtype = v.dtype
    q, k, v, g, beta = (x[:, :, 0] for x in _heads_first(q, k, v, g, beta))  # [R, H, d] / [R, H]
    state = state * g.exp()[..., None, None]
    delta = (v - (state * k[..., None]).sum(-2)) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    out = (state * q[..., None]).sum(-2)
    return out[:, None].to(out_dtype), state


def state_after(state: torch.Tensor, terms: BlockTerms, n: torch.Tensor) -> torch.Tensor:
    """The state after the first n[r] tokens (0..L, a long device tensor [R]) of the block `terms` describes, which
    started from `state` [R, Hv, dk, dv]: exp(C_n) S + sum_{i<n} exp(C_n - C_{i+1}) k_i v_new_i^T, with C_j the
    sum of the first j log decays (for n = L, HF's update at a chunk's end). A new tensor; no host sync."""
    rows, heads, length = terms.cum.shape
    cum0 = F.pad(terms.cum, (1, 0))  # C_0 = 0
    c_n = cum0.gather(-1, n.view(rows, 1, 1).expand(rows, heads, 1))  # [R, H, 1]
    beyond = torch.arange(length, device=n.device) >= n.view(rows, 1, 1)  # [R, 1, L]: tokens not kept
    weights = (c_n - terms.cum).masked_fill(beyond, float("-inf")).exp()
    return state * c_n.exp()[..., None] + (terms.k * weights[..., None]).transpose(-1, -2) @ terms.v_new


def fla_available() -> bool:
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except ImportError:
        return False
    return True


@torch.library.custom_op("dflash::gated_delta_rule_fla", mutates_args=())
def _fla_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          starts: torch.Tensor) -> torch.Tensor:
    # An opaque op for torch.compile: Dynamo does not trace fla's autotuned kernels, the graph capture records them.
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    reset = g.masked_fill(starts[..., None], -FLA_RESET)
    out, _state = chunk_gated_delta_rule(q, k, v, g=reset, beta=beta, initial_state=None, output_final_state=False,
                                         use_qk_l2norm_in_kernel=True)
    return out


@_fla_gated_delta_rule.register_fake
def _(q, k, v, g, beta, starts):
    return torch.empty_like(v)


@torch.library.custom_op("dflash::gated_delta_rule_fla_from", mutates_args=())
def fla_gated_delta_rule_from(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                              beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's chunked rule over one sequence per row from a start state [R, Hv, dk, dv] fp32 (g fp32, beta in q's
    dtype) -> (out [R, S, Hv, dv], the final state fp32). An opaque op, as `_fla_gated_delta_rule`."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    # contiguous: fla's Triton path copies its inputs so itself, but a backend it dispatches to first (FlashQLA on
    # sm_90) takes them as they are, and the decode prefill hands over views of one [R, S, C] tensor
    q, k, v = (t.contiguous() for t in (q, k, v))
    out, final = chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True,
                                        use_qk_l2norm_in_kernel=True)
    return out, final


@fla_gated_delta_rule_from.register_fake
def _(q, k, v, g, beta, state):
    return torch.empty_like(v), torch.empty_like(state)


def gated_delta_rule(q, k, v, g, beta, starts, *, kernel: str) -> torch.Tensor:
    """kernel: "fla" (CUDA, fla installed) or "torch" (`packed_chunk_gated_delta_rule`). Same arguments."""
    if kernel == "fla":
        return _fla_gated_delta_rule(q, k, v, g.float(), beta.to(q.dtype), starts)
    return packed_chunk_gated_delta_rule(q, k, v, g, beta, starts)


def input_projections(m: nn.Module) -> list[nn.Module]:
    """HF layer `m`'s input linears, in the order `project` takes their outputs: Qwen3-Next's in_proj_qkvz and
    in_proj_ba, Qwen3.5's in_proj_qkv, in_proj_z, in_proj_b and in_proj_a."""
    if hasattr(m, "in_proj_qkvz"):
        return [m.in_proj_qkvz, m.in_proj_ba]
    return [m.in_proj_qkv, m.in_proj_z, m.in_proj_b, m.in_proj_a]


def project(m: nn.Module, x: torch.Tensor, joined=None):
    """HF layer `m`'s input projections. x [R, S, D] -> (qkv [R, S, C], z [R, S, Hv, dv], b [R, S, Hv],
    a [R, S, Hv]). The two families differ only here: Qwen3-Next projects q, k, v, z interleaved per key head (its
    own `fix_query_key_value_ordering` undoes that), Qwen3.5 projects each apart. joined: the `input_projections`
    as one callable (the batch generator's one GEMM, `decode/fused.py`) -> their outputs in that order."""
    rows, seq, _ = x.shape
    if joined is not None:
        outs = joined(x)
    elif hasattr(m, "in_proj_qkvz"):
        outs = [m.in_proj_qkvz(x), m.in_proj_ba(x)]
    else:
        outs = project_shared(x, [m.in_proj_qkv, m.in_proj_z]) + [m.in_proj_b(x), m.in_proj_a(x)]  # FP8: x once
    if hasattr(m, "in_proj_qkvz"):  # Qwen3-Next
        q, k, v, z, b, a = m.fix_query_key_value_ordering(*outs)
        qkv = torch.cat([t.reshape(rows, seq, -1) for t in (q, k, v)], dim=-1)
        return qkv, z, b, a
    qkv, z, b, a = outs
    return qkv, z.reshape(rows, seq, -1, m.head_v_dim), b, a


def split_heads(m: nn.Module, qkv: torch.Tensor):
    """The convolved qkv [R, S, C] -> q, k [R, S, Hk, dk], v [R, S, Hv, dv]."""
    rows, seq, _ = qkv.shape
    q, k, v = torch.split(qkv, [m.key_dim, m.key_dim, m.value_dim], dim=-1)
    return (q.reshape(rows, seq, -1, m.head_k_dim), k.reshape(rows, seq, -1, m.head_k_dim),
            v.reshape(rows, seq, -1, m.head_v_dim))


def gates(m: nn.Module, a: torch.Tensor, b: torch.Tensor):
    """-> (g, the log decay in fp32 as HF computes it; beta = sigmoid(b)), each [R, S, Hv]."""
    return -m.A_log.float().exp() * F.softplus(a.float() + m.dt_bias), b.sigmoid()


def gated_output(m: nn.Module, core: torch.Tensor, z: torch.Tensor, norm=None) -> torch.Tensor:
    """The rule's output core [R, S, Hv, dv] -> the gated norm (z the gate), then the output projection: [R, S, D].
    norm: a callable in place of the layer's own gated norm module (the decode layer's one-kernel form,
    `decode/gated_norm.GatedRMSNorm`), given z [R, S, Hv, dv] as it is (it reads a strided gate without a copy)."""
    rows, seq = core.shape[:2]
    gate = z.reshape(rows, seq, -1, m.head_v_dim) if norm is not None else z.reshape(-1, m.head_v_dim)
    out = (norm or m.norm)(core.reshape(-1, m.head_v_dim), gate)
    return m.out_proj(out.reshape(rows, seq, -1))


class PackedGatedDeltaNet(nn.Module):
    """One HF Gated DeltaNet layer (its weights, untouched, as `inner`) computed over packed rows: every document as
    it is alone, when `attention_mask` is a PackedDocs (as `trainer.model.target.Target.attention_mask` hands every
    linear-attention layer). Any other mask (HF's own, a cache in the arguments) runs HF's own forward unchanged.
    Projections (`project`), convolution, gates, the delta rule, the gated norm, the output projection: HF's
    computation of one document."""

    def __init__(self, inner: nn.Module, kernel: str = "torch") -> None:
        super().__init__()
        if kernel not in ("torch", "fla"):
            raise ValueError(f"kernel must be 'torch' or 'fla', got {kernel!r}")
        self.inner, self.kernel = inner, kernel

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, **kwargs):
        if not isinstance(attention_mask, PackedDocs):
            return self.inner(hidden_states, attention_mask=attention_mask, **kwargs)
        doc_ids = attention_mask.doc_ids
        m = self.inner
        qkv, z, b, a = project(m, hidden_states)
        q, k, v = split_heads(m, packed_causal_conv1d(qkv, m.conv1d.weight.squeeze(1), doc_ids))
        g, beta = gates(m, a, b)
        return gated_output(m, gated_delta_rule(q, k, v, g, beta, doc_starts(doc_ids), kernel=self.kernel), z)


def is_linear_attention_layer(layer: nn.Module) -> bool:
    return hasattr(layer, "linear_attn")


def use_packed_linear_attention(model: nn.Module, device: torch.device) -> str | None:
    """Wrap every Gated DeltaNet layer of `model` in PackedGatedDeltaNet; returns the kernel chosen (fla on CUDA
    where it imports, else torch), or None when the model has no such layer. Idempotent."""
    layers = [layer for layer in model.model.layers if is_linear_attention_layer(layer)]
    if not layers:
        return None
    kernel = "fla" if device.type == "cuda" and fla_available() else "torch"
    for layer in layers:
        inner = layer.linear_attn.inner if isinstance(layer.linear_attn, PackedGatedDeltaNet) else layer.linear_attn
        layer.linear_attn = PackedGatedDeltaNet(inner, kernel)
    return kernel
