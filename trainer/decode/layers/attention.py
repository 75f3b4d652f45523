"""The softmax attention decode layer: one HF attention module over its static K/V cache, full or sliding-window,
with soft-capped scores (Gemma 2) or attention sinks (gpt-oss) where the family has them, or output-gated with a
partial RoPE (`gated`: the hybrids' full-attention layers, Qwen3-Next and Qwen3.5, whose q_proj gives each head its
query and a gate; the output is multiplied by sigmoid(gate) before o_proj, and RoPE turns the first dims only).

Slot = absolute position. A forward over tokens at positions p0..p0+L-1 first writes their K/V into slots
p0..p0+L-1, then lets each query at position p attend to slots <= p (and, in a sliding-window layer, only to the
`window` slots ending at p: HF's rule). Slots beyond p may hold stale K/V of rejected draft tokens; the mask hides
them and a later forward overwrites them, so "cropping" the cache costs nothing.

A sliding-window layer whose window is short against the cache (`ring`: the stack's `ring_size`) keeps a ring of
W = window + block slots plus a trash slot instead (layers/ring.py): position p lives in slot p mod W; a forward
reads the ring and its own new K/V, with the mask of `Step.ring`, before it writes the new K/V into the ring, so its
cache is [R, Hkv, W + 1, Dh] and never `slots` long. A forward's `span` does not apply to it (it reads the W slots).

Per-row positions (`Step.pos` [R', L], `Step.rows` [R']: the refilling batch generator): row i of the forward is
cache row rows[i] and its tokens sit at its own positions pos[i]; its K/V go to those slots of that cache row only
(other rows untouched), and its queries read that cache row's slots <= their position. Each row is then its own
unpadded sequence from slot 0, and a forward over a few rows (a refill's prefill) leaves the others as they are.
Where every row of such a forward starts at position 0 (`Step.fresh`: a whole-prompt prefill, decode/prefill_plan.py)
a full-attention layer's queries see the forward's own keys only: causal SDPA over them, no mask, no cache read.

Rows of different prompt lengths (`padded`): each row's prompt is left-padded to a common length and starts at its
own slot `row_start[r]`; a query sees no slot before its row's start, and RoPE takes the position slot - row_start
(HF `generate`'s left padding: positions count real tokens only).

Shape legend: L tokens, M cache slots, R rows, H / Hkv query / key-value heads, Dh head dim, D hidden.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from trainer.decode.kernels import decode_attention
from trainer.decode.step_inputs import fits as step_inputs_fit, step_inputs
from trainer.decode.step_kernel import step_attention
from trainer.model.attention import FULL, SLIDING
from trainer.model.drafter import apply_rope
from trainer.model.fp8 import project_shared

# What computes a layer's scores: the row-invariant Triton kernel, SDPA, or HF's eager math (soft-capped scores,
# sinks), which SDPA cannot compute.
INVARIANT, SDPA, EAGER = "invariant", "sdpa", "eager"


class Step(NamedTuple):
    """What every mixer of one forward shares (built once per forward by the stack). Device tensors only."""

    pos: torch.Tensor  # [L] long: the slots written and read (per-row positions: [R', L])
    ropes: dict  # layer kind -> (cos, sin), [1 or R, 1, L, Dh]
    masks: dict | None  # layer kind -> visible [R or 1, 1, L, span] bool; None under the invariant kernel
    span: int  # attention reads slots 0..span-1
    how: str  # INVARIANT | SDPA | EAGER
    softcap: float | None  # Gemma 2's attention score cap
    padded: bool  # rows of different prompt lengths
    linear: object = None  # what the Gated DeltaNet layers are asked (layers/linear.py `LinearCall`); None: none
    rows: torch.Tensor | None = None  # per-row positions: the cache rows [R'] the forward's rows are (see below)
    ring: object = None  # the ring layers' write slots and mask (layers/ring.py `Ring`); None: no ring layer
    # per-row positions from 0 (a whole-prompt prefill) of a target whose every attention layer is full, through SDPA,
    # no ring (the stack sets it only where `StaticTarget.whole_prefill` holds): each attends over the new keys alone
    fresh: bool = False


def ropes_of(hf_model, kinds) -> dict[str, tuple[torch.Tensor, float]]:
    """Per layer kind: (inv_freq [Dh/2] fp32, attention_scaling) from the HF rotary module(s). Gemma 3 keeps one
    per layer type (`sliding_attention_inv_freq`, ...; transformers 4.x: a second module, `rotary_emb_local`)."""
    model = hf_model.model
    ropes = {}
    for kind in kinds:
        rotary = model.rotary_emb
        if kind == SLIDING and hasattr(model, "rotary_emb_local"):
            rotary = model.rotary_emb_local
        if hasattr(rotary, f"{kind}_inv_freq"):
            inv, scale = getattr(rotary, f"{kind}_inv_freq"), getattr(rotary, f"{kind}_attention_scaling", 1.0)
        else:
            inv, scale = rotary.inv_freq, getattr(rotary, "attention_scaling", 1.0)
        ropes[kind] = (inv.float(), float(scale))
    return ropes


def rope_from_inv_freq(pos: torch.Tensor, inv_freq: torch.Tensor, scaling: float,
                       dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """pos [L] (or [R, L]) long -> cos, sin [1, 1, L, Dh] (or [R, 1, L, Dh]) in `dtype` (HF rotate_half layout,
    HF's arithmetic; gpt-oss's half-split rotation computes the same products)."""
    freqs = pos.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)
    if pos.dim() == 1:
        return cos[None, None], sin[None, None]
    return cos[:, None], sin[:, None]


def key_visible(keys: torch.Tensor, pos: torch.Tensor, row_start: torch.Tensor | None,
                window: int | None) -> torch.Tensor:
    """The visibility rule, over positions: keys [K] or [R or 1, K] (each key's position; negative: no key), queries
    at positions pos [L] (or [R, L]: per-row positions) -> visible [R or 1, L, K] bool: 0 <= key <= query, and in a
    sliding-window layer (`window`) key > query - window (HF's rule). A padded row (`row_start` [R] given, pos [L])
    sees no key before the row's start, except its own when the query is padding itself (a query that sees nothing
    would turn into NaN, and NaN K/V in a masked slot still poison the rows through 0 * NaN)."""
    at = (pos if pos.dim() == 2 else pos[None])[..., None]  # [R or 1, L, 1]
    k = (keys if keys.dim() == 2 else keys[None])[:, None, :]  # [R or 1, 1, K]
    lo = 0 if row_start is None else torch.minimum(row_start[:, None], pos[None, :])[..., None]  # [R, L, 1]
    visible = (k >= lo) & (k <= at)
    if window:
        visible = visible & (k > at - window)
    return visible


def visible_masks(slot_ids: torch.Tensor, pos: torch.Tensor, span: int, row_start: torch.Tensor | None,
                  window: int | None) -> dict[str, torch.Tensor]:
    """Per layer kind: visible [R or 1, 1, L, span] bool over slots 0..span-1 (slot = position; SLIDING only when
    `window`) for queries at positions pos [L] (or [R, L]: per-row positions, each row from slot 0), by
    `key_visible`'s rule (a ring's mask: layers/ring.py)."""
    s = slot_ids[:span]
    masks = {FULL: key_visible(s, pos, row_start, None)[:, None]}
    if window:
        masks[SLIDING] = key_visible(s, pos, row_start, window)[:, None]
    return masks


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float,
                    cap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """HF's eager attention, for what SDPA cannot compute. q [R, H, L, Dh], k / v [R, Hkv, M, Dh], visible [R or 1,
    1, L, M] bool -> [R, L, H, Dh].
    cap (Gemma 2): scores * scale -> cap * tanh(scores / cap) -> masked -> fp32 softmax, cast back -> @ v.
    sinks [H] (gpt-oss): one extra logit per head beside the keys, in the softmax (minus the row max, in the scores'
    dtype) and then dropped, so a query can give weight to no key.
    Each KV head's G query heads are laid out as G x L query rows of that head (head h uses KV head h // G, HF's
    repeat_kv), so the K/V span is read as it is cached, not copied G times."""
    R, H, L, Dh = q.shape
    Hkv, M = k.shape[1], k.shape[2]
    G = H // Hkv
    scores = torch.matmul(q.reshape(R, Hkv, G * L, Dh), k.transpose(2, 3)) * scale  # [R, Hkv, G*L, M]
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    rows = visible.shape[0]
    mask = visible[:, :, None].expand(rows, 1, G, L, M).reshape(rows, 1, G * L, M)
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    if sinks is None:
        weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    else:
        sink = sinks.reshape(1, Hkv, G, 1, 1).expand(R, Hkv, G, L, 1).reshape(R, Hkv, G * L, 1)
        combined = torch.cat([scores, sink.to(scores.dtype)], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        weights = F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1].to(v.dtype)
    return torch.matmul(weights, v).reshape(R, H, L, Dh).transpose(1, 2)


def grouped_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """SDPA for grouped-query attention with a mask, without `enable_gqa`: on CUDA only SDPA's math backend takes
    a mask together with enable_gqa (it copies the K/V span per group and materializes the scores), while each KV
    head's G query heads, laid out as G x L query rows of one head, reach the memory-efficient kernel. For one query
    per row (a batch decode step) SDPA with enable_gqa is the faster one on the H200 (qwen3-8b's heads, 256 rows x 512
    slots: 136 us against 224, the K/V read alone 112; `AttentionLayer` picks it there). q [R, H, L,
    Dh] (head h uses KV head h // G, HF's repeat_kv), k / v [R, Hkv, M, Dh], visible [R or 1, 1, L, M] ->
    [R, L, H, Dh]."""
    R, H, L, Dh = q.shape
    Hkv, M = k.shape[1], k.shape[2]
    G = H // Hkv
    rows = visible.shape[0]
    mask = visible[:, :, None].expand(rows, 1, G, L, M).reshape(rows, 1, G * L, M)
    out = F.scaled_dot_product_attention(q.reshape(R, Hkv, G * L, Dh), k, v, attn_mask=mask, scale=scale)
    return out.reshape(R, H, L, Dh).transpose(1, 2)


# A whole-prompt prefill's attention: not cuDNN's, which builds an execution plan for each new shape (a refill's rows
# and width vary from one to the next), flash attention first.
PREFILL_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def causal_self_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [R, H, L, Dh], k / v [R, Hkv, L, Dh] (head h reads KV head h // G) -> causal attention over those keys alone,
    [R, L, H, Dh]: a whole-prompt prefill's (`Step.fresh`)."""
    with sdpa_kernel(PREFILL_BACKENDS):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2)


def partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first cos.shape[-1] dims of the head (all of them for most families), the rest passed through."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return apply_rope(x, cos, sin)
    return torch.cat([apply_rope(x[..., :rot], cos, sin), x[..., rot:]], dim=-1)


def identity(x: torch.Tensor) -> torch.Tensor:
    """Stands for a q/k norm the layer does not have."""
    return x


class AttentionLayer:
    """One HF attention module (`q_proj`, `k_proj`, `v_proj`, `o_proj`, `scaling`; `sinks` where the family has
    them) over its own K/V cache [R, Hkv, M, Dh]. q_norm / k_norm: the callables that stand for the module's q/k
    norms (the stack's row-invariant wrappers), or None. `kind` (FULL or SLIDING) picks the RoPE and mask of a
    `Step`; the stack may change it (the layer reads it at each call), except on a ring layer. gated: see the module
    docstring. ring: W, a sliding layer's ring of W + 1 slots in place of `slots` (module docstring), or None."""

    def __init__(self, module, kind: str, q_norm, k_norm, rows: int, slots: int, heads: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device, gated: bool = False,
                 ring: int | None = None) -> None:
        self.module, self.kind, self.gated = module, kind, gated
        self.q_norm, self.k_norm = q_norm or identity, k_norm or identity
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.sinks = getattr(module, "sinks", None)
        self.ring = ring
        self.project = None  # the stack's joined q/k/v projection (decode/fused.py), or None: the module's own
        self.fused_steps = 0  # per-row one-token forwards through step_inputs.py's kernel (a graph's capture: one)
        self.fused_prefills = 0  # whole-prompt prefill forwards through it
        shape = (rows, kv_heads, slots if ring is None else ring + 1, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def __call__(self, h: torch.Tensor, step: Step, kind: str | None = None) -> torch.Tensor:
        """h [R, L, D] (the normed input) -> the attention output after o_proj, [R, L, D]. Writes the tokens' K/V
        into slots step.pos first. kind: the layer kind to compute as (default: this layer's)."""
        attn, kind = self.module, kind or self.kind
        R, L, _ = h.shape
        H, Hkv, Dh = self.heads, self.kv_heads, self.head_dim
        cos, sin = step.ropes[kind]
        # FP8: h quantized once for the three; `project`: one joined GEMM
        q, k, v = self.project(h) if self.project else project_shared(h, [attn.q_proj, attn.k_proj, attn.v_proj])
        if self.gated:
            q, gate = q.view(R, L, H, 2 * Dh).chunk(2, dim=-1)
        else:
            q, gate = q.view(R, L, H, Dh), None
        if self._fuses(q, step, cos, L):  # the refilling generator's per-row step: its inputs as one kernel
            q = step_inputs(q[:, 0], k.view(R, Hkv, Dh), v.view(R, Hkv, Dh), self.k, self.v, step.pos, cos, sin,
                            *self._norms(), rows=step.rows)
            self.fused_steps += 1
            return self._output(step_attention(q, self.k, self.v, step.pos, attn.scaling, step.rows), gate)
        fresh = step.fresh
        turned = self._fresh_inputs(q, k, v, step, cos, sin) if fresh else None
        if turned is not None:  # every row from position 0: causal SDPA over the forward's own keys (CUDA: flash)
            return self._output(causal_self_attention(*turned, v.view(R, L, Hkv, Dh).transpose(1, 2), attn.scaling),
                                gate)
        q = self.q_norm(q).transpose(1, 2)
        k = self.k_norm(k.view(R, L, Hkv, Dh)).transpose(1, 2)
        v = v.view(R, L, Hkv, Dh).transpose(1, 2)
        q = partial_rope(q, cos, sin)
        k = partial_rope(k, cos, sin)
        if self.ring is not None:
            if kind != SLIDING:  # a ring holds the window only: it cannot compute full attention
                raise ValueError(f"a sliding-window ring cache cannot compute {kind} attention")
            keys, values = self._read_then_write(step, k, v)
        elif fresh:
            self._write(step, k, v, read=False)
        else:
            keys, values = self._write(step, k, v)
        if fresh:  # every row from position 0: the keys are the forward's own, causal SDPA needs no mask
            out = causal_self_attention(q, k, v, attn.scaling)
        elif step.how == INVARIANT and step.pos.dim() == 2 and L == 1:  # the refilling generator's per-row step
            out = step_attention(q, self.k, self.v, step.pos, attn.scaling, step.rows)  # [R, 1, H, Dh]
        elif step.how == INVARIANT:
            out = decode_attention(q, self.k, self.v, step.pos, attn.scaling)  # [R, L, H, Dh]
        else:
            visible = step.ring.visible if self.ring is not None else step.masks[kind]
            if step.softcap or self.sinks is not None:
                out = eager_attention(q, keys, values, visible, attn.scaling, step.softcap, self.sinks)
            elif step.padded and H != Hkv and L > 1:  # the batched generator's prefill chunks
                out = grouped_sdpa(q, keys, values, visible, attn.scaling)
            else:
                out = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, scale=attn.scaling,
                                                     enable_gqa=H != Hkv).transpose(1, 2)
        return self._output(out, gate)

    def _output(self, out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """The heads' outputs [R, L, H, Dh] -> gated (a gated layer) and through o_proj, [R, L, D]."""
        R, L = out.shape[:2]
        out = out.reshape(R, L, -1)
        if gate is not None:  # the sigmoid reads the strided gate (a chunk of q's projection): no copy of it first
            out = out * torch.sigmoid(gate).reshape(R, L, -1)
        return self.module.o_proj(out)

    def _norms(self) -> tuple:
        """The q/k norms as step_inputs.py takes them: None for one the layer does not have."""
        return tuple(None if n is identity else n for n in (self.q_norm, self.k_norm))

    def _fresh_inputs(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step, cos: torch.Tensor,
                      sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A whole-prompt prefill's q/k norms, RoPE and K/V cache writes as step_inputs.py's kernel (its R' x L
        tokens as one-token rows: the torch form's bits, one launch a layer instead of about fifteen) -> q and k
        turned, [R', H, L, Dh] and [R', Hkv, L, Dh]; None where the kernel does not compute them. CUDA only: under
        the CPU interpreter the prefill stays the torch form (the kernel's tests run it there)."""
        R, L, H, Dh = q.shape
        Hkv, N = self.kv_heads, R * L
        flat_cos, flat_sin = cos.reshape(N, 1, 1, -1), sin.reshape(N, 1, 1, -1)
        if not (q.is_cuda and step.rows is not None
                and step_inputs_fit(q.reshape(N, 1, H, Dh), self.k, flat_cos, *self._norms())):
            return None
        k_out = torch.empty(N, Hkv, Dh, dtype=q.dtype, device=q.device)
        q = step_inputs(q.reshape(N, H, Dh), k.view(N, Hkv, Dh), v.view(N, Hkv, Dh), self.k, self.v,
                        step.pos.reshape(N, 1), flat_cos, flat_sin, *self._norms(),
                        rows=step.rows.repeat_interleave(L), k_out=k_out)
        self.fused_prefills += 1
        return q.view(R, L, H, Dh).transpose(1, 2), k_out.view(R, L, Hkv, Dh).transpose(1, 2)

    def _fuses(self, q: torch.Tensor, step: Step, cos: torch.Tensor, L: int) -> bool:
        """This forward is the refilling generator's per-row one-token step over cache rows step.rows (every row in
        order, or a compacted step's; the branch of step_attention below) and step_inputs.py's kernel computes its
        q/k norms, RoPE and cache writes: no ring, q / cache / RoPE of one dtype, norms it knows (step_inputs.fits)."""
        return (step.how == INVARIANT and step.pos.dim() == 2 and L == 1 and self.ring is None
                and step.rows is not None and step_inputs_fit(q, self.k, cos, *self._norms()))

    def _write(self, step: Step, k: torch.Tensor, v: torch.Tensor,
               read: bool = True) -> tuple[torch.Tensor, torch.Tensor] | None:
        """k / v [R', Hkv, L, Dh] (k turned) into their slots -> the keys and values the queries read, [R', Hkv,
        span, Dh] (None: `read` False). Per-row positions: each row's own slots of its cache row (index_put_
        through the [R, M, Hkv, Dh] view), and the read gathers those cache rows."""
        if step.pos.dim() == 1:
            self.k.index_copy_(2, step.pos, k)
            self.v.index_copy_(2, step.pos, v)
            return self.k[:, :, :step.span], self.v[:, :, :step.span]
        at = (step.rows[:, None].expand_as(step.pos), step.pos)
        self.k.transpose(1, 2).index_put_(at, k.transpose(1, 2))
        self.v.transpose(1, 2).index_put_(at, v.transpose(1, 2))
        if not read:
            return None
        if step.rows.shape[0] == self.k.shape[0]:  # every row, in order (the decode step)
            return self.k[:, :, :step.span], self.v[:, :, :step.span]
        return self.k[:, :, :step.span].index_select(0, step.rows), self.v[:, :, :step.span].index_select(0, step.rows)

    def _read_then_write(self, step: Step, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A ring layer's k / v [R', Hkv, L, Dh] -> the keys and values the queries read, [R', Hkv, W + L, Dh]: the
        forward's rows' ring then the new ones (copied before the new tokens go into their ring slots)."""
        W = self.ring
        every = step.rows is None or step.rows.shape[0] == self.k.shape[0]  # every row, in order
        ring_k, ring_v = (self.k[:, :, :W], self.v[:, :, :W]) if every else \
            (self.k[:, :, :W].index_select(0, step.rows), self.v[:, :, :W].index_select(0, step.rows))
        keys, values = torch.cat([ring_k, k], dim=2), torch.cat([ring_v, v], dim=2)
        if step.ring.slots.dim() == 1:
            self.k.index_copy_(2, step.ring.slots, k)
            self.v.index_copy_(2, step.ring.slots, v)
        else:
            at = (step.rows[:, None].expand_as(step.ring.slots), step.ring.slots)
            self.k.transpose(1, 2).index_put_(at, k.transpose(1, 2))
            self.v.transpose(1, 2).index_put_(at, v.transpose(1, 2))
        return keys, values
