"""The target's forward over static buffers (`StaticTarget`), assembled per layer from a plan read from the config
alone (layer_plan.py): the family's layout and norms, each layer's mixer kind and MLP kind. Each kind is computed by
its decode layer on the HF model's own submodules (same weights, norms and projections), with no Python-side shape
or length state: the write position is a device tensor.

    layouts   plain     x += mixer(norm(x)); x += mlp(norm(x))             (Qwen3/2, Llama, Mistral, Qwen3-MoE,
                                                                          Mixtral, gpt-oss; the hybrids)
              sandwich  x += norm(mixer(norm(x))); x += norm(mlp(norm(x)))  (Gemma 2/3: scaled embeddings, the HF
                                                                          embedding module scales)
    norms     plain     w * x / rms(x)                   both one row-invariant kernel (kernels.RowInvariantRMSNorm)
              offset    (1 + w) * x / rms(x) in fp32     where it runs; elsewhere the HF modules (offset: Gemma,
                                                         the hybrids)
    mixers    attention        softmax attention, full or sliding-window, soft-capped (Gemma 2) or with sinks
                               (gpt-oss): layers/attention.py
              gated_attention  the hybrids' output-gated softmax attention with partial RoPE: the same layer, gated
              linear           Gated DeltaNet over static recurrent state: layers/linear.py
    MLPs      dense     the HF module (`fuse`, the refilling generator's: gate/up one GEMM, SiLU one kernel: fused.py)
              moe       router top-k and grouped expert GEMMs: layers/moe.py (`fuse`: a decode step's experts,
                        router and sort as Triton kernels, moe_kernel.py, route_kernel.py, unless switched off)

`check_supported` refuses a plan with a kind that has no decode layer, so the hf-engine fallback
(`decoders.engine_for`) follows from the plan. Gemma 2 soft-caps the final logits too.

A target with linear layers (the hybrids: Qwen3.5, Qwen3.6, Qwen3-Next; dense and MoE MLPs) adds a recurrent state
per linear layer, and `forward` tells those layers what it is (`layers/linear.py` `LinearCall`):
- a forward of one token (a decode step) takes it into every linear layer's state;
- a prefill (`logits_at` or `last_only` given, or more than one token) takes its tokens into the state (with
  `logits_at`: tokens 0..logits_at, leaving `engine.Prefill`'s bucket padding out); at position 0 it first zeroes
  the state (a new sequence);
- `verify=True` (a speculative verify of up to `block` tokens) leaves the state as it was and keeps the block, and
  `commit(accepted [R])` then moves each row's state past its accepted prefix, on the device: no second forward.
The attention layers write K/V at slot = position (a sliding layer's ring: at p mod W, layers/ring.py), so a
rejected draft's K/V need no undo. `forward_rows` (per-row positions, the refilling batch generator) steps every
row's linear states (or some rows': a compacted step), or prefills a chunk of some rows alone: their states
gathered, zeroed where the chunk starts a sequence, advanced by each row's real tokens, written back.

Shape legend: L tokens, M cache slots, R rows, T taps, D hidden, V vocab.
"""
from __future__ import annotations

import torch

from trainer.decode import step_kernel
from trainer.decode.fused import fuse_layers
from trainer.decode.kernels import RowInvariantRMSNorm, head_dim_supported, usable_for
from trainer.decode.layer_plan import DYNAMIC_ROPE, FAMILIES, HINT, layer_plan, layers_of, rope_types, text_cfg
from trainer.decode.layers.attention import (EAGER, INVARIANT, SDPA, AttentionLayer, Step, identity,
                                             rope_from_inv_freq, ropes_of, visible_masks)
from trainer.decode.layers.linear import PREFILL, STEP, VERIFY, GatedDeltaNetDecode, LinearCall, kernel_for
from trainer.decode.layers.moe import MoeMLP
from trainer.decode.layers.ring import ring_size, ring_step
from trainer.errors import ConfigError
from trainer.model.attention import SLIDING
from trainer.model.linear_attention import LINEAR
from trainer.model.target import Target, attention_kinds


def _attention_layer(static: StaticTarget, i: int, layer) -> AttentionLayer:
    attn = layer.self_attn
    return AttentionLayer(attn, static.kinds[i], static.q_norms[i], static.k_norms[i], static.rows, static.slots,
                          static.heads, static.kv_heads, static.head_dim, static.dtype, static.device,
                          gated=static.plan.mixers[i] == "gated_attention",
                          ring=static.ring if static.kinds[i] == SLIDING else None)


def _linear_layer(static: StaticTarget, i: int, layer) -> GatedDeltaNetDecode:
    return GatedDeltaNetDecode(layer.linear_attn, static.rows, static.block, static.kernel,
                               conv_kernel=static.decode_kernels)


# mixer kind -> its decode layer's builder, (StaticTarget, layer index, HF layer) -> a callable (h [R, L, D] normed,
# Step, layer kind) -> [R, L, D] that owns its static buffers. None would be a kind with no decode layer yet, which
# check_supported refuses.
MIXERS = {"attention": _attention_layer, "gated_attention": _attention_layer, "linear": _linear_layer}



def check_supported(cfg) -> None:
    """Refuse, in one line and from the config alone, a target whose layers `StaticTarget.forward` would compute
    differently from HF (target-only and speculative decoding would then agree with each other while both being
    wrong), or has no decode layer for."""
    cfg = text_cfg(cfg)
    model_type = getattr(cfg, "model_type", None)
    if model_type not in FAMILIES:
        raise ConfigError(f"static decoding supports {', '.join(FAMILIES)} targets, not {model_type!r}", hint=HINT)
    dynamic = sorted(t for t in rope_types(cfg) if any(d in t for d in DYNAMIC_ROPE))
    if dynamic:
        raise ConfigError(f"static decoding does not support rope_type {dynamic[0]!r} (its frequencies change with "
                          f"the sequence length)", hint=HINT)
    if getattr(cfg, "use_bidirectional_attention", False):
        raise ConfigError(f"static decoding is causal; this {model_type} target uses bidirectional attention",
                          hint=HINT)
    plan = layer_plan(cfg)
    for kind in dict.fromkeys(plan.mixers):
        if MIXERS[kind] is None:
            raise ConfigError(f"static decoding has no decode layer for {kind} mixers ({model_type} layers "
                              f"{layers_of(plan.mixers, kind)})", hint=HINT)
    if "moe" in plan.mlps and plan.routing is None:
        raise ConfigError(f"static decoding has no MoE router rule for {model_type} (layers "
                          f"{layers_of(plan.mlps, 'moe')})", hint=HINT)


class StaticTarget:
    """A full (untruncated) `Target` plus its static buffers (each layer's K/V cache of `slots` positions) for `rows`
    sequences that advance together (batch-1 decoding: rows = 1; a batch of prompts: rows = R, `padded` when their
    lengths differ).

    `forward` is free of host syncs and allocates nothing that depends on values, so it can run inside a CUDA graph
    capture for a fixed L (and span).

    `attention` says what computes attention: "invariant" (the row-invariant Triton kernel, asked for with
    `invariant`), "sdpa", or "eager" (soft-capped scores, sinks); `fallback` why an `invariant` request got another
    one.

    block: the longest verify a linear layer keeps (a speculative decoder's block size; 1 for a target that only
    steps); kernel: a linear layer's prefill kernel (`layers/linear.py`; default: fla on CUDA where it imports).
    In a padded batch a linear layer takes a padding token as zeros. ring: a sliding-window layer keeps a ring of
    window + block slots (+ a trash slot) where that is fewer than `slots` (`self.ring`: W, or None; False: every
    layer keeps `slots`); `k` / `v` then hold [R, Hkv, W + 1, Dh] for it."""

    def __init__(self, target: Target, slots: int, rows: int = 1, invariant: bool = False,
                 padded: bool = False, block: int = 1, kernel: str | None = None, row_kernel: bool = False,
                 ring: bool = True, fuse: bool = False) -> None:
        if target.truncated:
            raise RuntimeError("static decoding needs the full target; load it with truncate=False")
        cfg = target.hf_config
        check_supported(cfg)
        self.plan = layer_plan(cfg)
        self.target = target
        self.model = target.model
        self.layers = list(self.model.model.layers)
        kinds = attention_kinds(cfg)
        self.kinds = kinds.layer_types  # per layer: FULL or SLIDING (LINEAR for a linear mixer)
        self.window = kinds.window
        attn0 = next(layer.self_attn for layer in self.layers if hasattr(layer, "self_attn"))
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = attn0.head_dim
        self.slots, self.rows, self.padded, self.block = slots, rows, padded, block
        # the decode kernels (switches.py) in the refilling generator's target (fuse), never under a verify: a
        # speculative decode is lossless where a step and a verify compute a token alike (fused.py says why)
        self.decode_kernels = None if fuse else False
        self.ring = ring_size(self.window, block, slots) if ring and SLIDING in self.kinds else None
        weight = target.embed_tokens.weight
        self.kernel = kernel or (kernel_for(weight.device) if "linear" in self.plan.mixers else "torch")
        self.dtype = weight.dtype
        self.slot_ids = torch.arange(slots, device=weight.device)
        softmax = tuple(k for k in kinds.kinds if k != LINEAR)
        self.ropes = {kind: (inv.to(self.device), scale) for kind, (inv, scale) in ropes_of(self.model,
                                                                                             softmax).items()}
        self.inv_freq, self.rope_scaling = self.ropes[softmax[0]]
        self.softcap = getattr(cfg, "attn_logit_softcapping", None)
        self.final_softcap = getattr(cfg, "final_logit_softcapping", None)
        self.sinks = any(hasattr(getattr(layer, "self_attn", None), "sinks") for layer in self.layers)
        self.sandwich = self.plan.layout == "sandwich"
        # invariant: attention through the row-invariant Triton kernel (trainer/decode/kernels.py), so that a verify
        # computes each token bitwise as a decode step does, in bf16 too (SDPA does not: docs/quality.md, "Exact
        # bf16"). The kernel computes plain causal softmax attention with plain RMSNorms; where it cannot run, SDPA
        # (eager attention for soft-capped scores and sinks), and `fallback` says why.
        self.fallback = self._why_not_invariant(weight) if invariant else None
        self.attention = INVARIANT if invariant and self.fallback is None else \
            EAGER if self.softcap or self.sinks else SDPA
        # row_kernel: per-row one-token steps (`forward_rows`, the refilling batch generator) run step_kernel.py's
        # kernel where it computes this target's attention: each row reads its own slots up to its position, where
        # SDPA with a mask reads the whole span for every row (`python3 -m bench.decode_attention`).
        self.row_kernel = row_kernel and not (self.softcap or self.sinks or SLIDING in self.kinds) and \
            head_dim_supported(self.head_dim) and self.heads % self.kv_heads == 0 and usable_for(weight) and \
            step_kernel.usable_for(weight, self.head_dim, self.heads // self.kv_heads)
        # whole_prefill: a per-row prefill from position 0 runs its attention as causal SDPA over its own keys
        # (layers/attention.py), so it may take whole prompts (decode/prefill_plan.py)
        self.whole_prefill = self.attention == SDPA and SLIDING not in self.kinds
        # padded: row r's first real token sits at slot row_start[r] (the caller writes it before the prefill).
        self.row_start = torch.zeros(rows, dtype=torch.long, device=self.device)
        self.taps = set(target.layer_ids)

        # RMSNorms run as one row-invariant kernel each where it can run (trainer/decode/kernels.py): a verify forward
        # over 16 tokens must compute each token exactly as a 1-token step does, and one kernel replaces about eight.
        def wrap(module):
            if module is None:
                return None
            return RowInvariantRMSNorm(module, offset=self.plan.norms == "offset")

        def attn_norm(layer, name):
            return wrap(getattr(getattr(layer, "self_attn", None), name, None)) or identity

        self.input_norms = [wrap(layer.input_layernorm) for layer in self.layers]
        self.post_norms = [wrap(layer.post_attention_layernorm) for layer in self.layers]
        self.pre_ff_norms = [wrap(layer.pre_feedforward_layernorm) if self.sandwich else None for layer in self.layers]
        self.post_ff_norms = [wrap(layer.post_feedforward_layernorm) if self.sandwich else None
                              for layer in self.layers]
        self.q_norms = [attn_norm(layer, "q_norm") for layer in self.layers]
        self.k_norms = [attn_norm(layer, "k_norm") for layer in self.layers]
        self.final_norm = wrap(self.model.model.norm)
        self.mixers = [MIXERS[kind](self, i, layer) for i, (kind, layer) in enumerate(zip(self.plan.mixers,
                                                                                          self.layers))]
        self.mlps = [MoeMLP(layer.mlp, self.plan.routing, self.plan.top_k, kernel=self.decode_kernels,
                            router_kernel=self.decode_kernels, overlap=self.decode_kernels)
                     if kind == "moe" else layer.mlp for kind, layer in zip(self.plan.mlps, self.layers)]
        if fuse:  # q/k/v and gate/up as one GEMM each: the refilling generator's target, never a verify's
            fuse_layers(self)
        self.linear = [m for m in self.mixers if isinstance(m, GatedDeltaNetDecode)]
        # the K/V caches by layer (None for a layer without one), as the row-invariance probe (bench.invariance) reads
        self.k = [getattr(m, "k", None) for m in self.mixers]
        self.v = [getattr(m, "v", None) for m in self.mixers]

    def _why_not_invariant(self, weight: torch.Tensor) -> str | None:
        if self.softcap:
            return "the target soft-caps its attention scores"
        if self.sinks:
            return "the target's attention has sinks"
        if SLIDING in self.kinds:
            return "the target has sliding-window layers"
        if self.plan.norms != "plain":
            return "the target's (1 + w) RMSNorms"
        if "moe" in self.plan.mlps:
            return "the target's MoE experts (grouped GEMMs, not probed for equal rows at 1 and B tokens)"
        if self.padded:
            return "rows of different prompt lengths"
        if not (head_dim_supported(self.head_dim) and self.heads % self.kv_heads == 0):
            return f"head dim {self.head_dim} (the kernel takes powers of two >= 16)"
        if not usable_for(weight):
            return "the Triton kernel cannot run here (no Triton, or not CUDA)"
        return None

    @property
    def device(self) -> torch.device:
        return self.slot_ids.device

    def _step(self, pos: torch.Tensor, span: int, dtype: torch.dtype, linear: LinearCall | None,
              last: torch.Tensor | None) -> Step:
        rope_pos = pos[None, :] - self.row_start[:, None] if self.padded else pos
        ropes = {kind: rope_from_inv_freq(rope_pos, inv, scale, dtype) for kind, (inv, scale) in self.ropes.items()}
        row_start = self.row_start if self.padded else None
        # the invariant kernel masks by position itself (full causal attention, rows unpadded)
        masks = None if self.attention == INVARIANT else visible_masks(self.slot_ids, pos, span, row_start,
                                                                       self._slot_window())
        ring = ring_step(pos, self.ring, self.window, row_start, last) if self.ring else None
        return Step(pos, ropes, masks, span, self.attention, self.softcap, self.padded, linear, ring=ring)

    def _slot_window(self) -> int | None:
        """The window of sliding layers that keep every slot (None: none does; a ring masks by layers/ring.py)."""
        return self.window if SLIDING in self.kinds and not self.ring else None

    def _linear_call(self, pos: torch.Tensor, rows: int, logits_at: torch.Tensor | None, last_only: bool,
                     verify: bool) -> LinearCall | None:
        """What this forward asks of the linear layers (the module docstring), or None for a target without any."""
        if not self.linear:
            return None
        L = pos.shape[0]
        mode = VERIFY if verify else STEP if L == 1 and logits_at is None and not last_only else PREFILL
        valid = None if logits_at is None else (logits_at.view(-1)[-1:] + 1).expand(rows)
        real = pos[None, :] >= self.row_start[:, None] if self.padded else None  # [R, L]
        return LinearCall(mode, pos[0] == 0, valid, real)

    def _rows_call(self, pos_RL: torch.Tensor, rows: torch.Tensor, last_at: torch.Tensor | None) -> LinearCall | None:
        """What `forward_rows` asks of the linear layers (None: it has none): a step of all rows or of cache rows
        `rows` (one token, no last_at), else a prefill chunk of cache rows `rows` (row i takes its first last_at[i]
        + 1 tokens; a row whose chunk starts at position 0 starts from zero states)."""
        if not self.linear:
            return None
        R, L = pos_RL.shape
        if last_at is None and L == 1:
            return LinearCall(STEP, pos_RL[0, 0] == 0, None, None, None if R == self.rows else rows)
        return LinearCall(PREFILL, pos_RL[:, 0] == 0, None if last_at is None else last_at + 1, None, rows)

    @torch.no_grad()
    def forward(self, ids_RL: torch.Tensor, pos0: torch.Tensor, want_features: bool = True,
                last_only: bool = False, logits_at: torch.Tensor | None = None, span: int | None = None,
                verify: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids [R, L] (R = rows) at slots pos0..pos0+L-1 (pos0: 0-dim long device tensor) -> (logits [R, L, V]
        fp32 -- [R, 1, V] of the last position when `last_only`, of index `logits_at` ([1] long device tensor: the
        last real token, a ring writes none after it) when given --, tapped features [R, L, T*D] or None). Writes
        the layers' buffers at slots pos0..pos0+L-1; pos0 + L <= slots. span: attention reads slots 0..span-1 only
        (pos0 + L <= span; default: every slot), so a short sequence in a long cache does not pay for the whole
        cache. verify: a speculative verify (the linear layers keep their state; `commit` follows; the module
        docstring)."""
        R, L = ids_RL.shape
        span = self.slots if span is None else span
        pos = pos0 + torch.arange(L, device=ids_RL.device)  # [L] slots
        x = self.target.embed_tokens(ids_RL)
        step = self._step(pos, span, x.dtype, self._linear_call(pos, R, logits_at, last_only, verify), logits_at)
        x, taps = self._layers(x, step, want_features)
        return head_and_taps(self.target, self.final_norm, x, taps, logits_at=logits_at, last_only=last_only,
                             want_features=want_features, softcap=self.final_softcap)

    @torch.no_grad()
    def forward_rows(self, ids_RL: torch.Tensor, pos_RL: torch.Tensor, rows: torch.Tensor, span: int,
                     last_at: torch.Tensor | None = None, fresh: bool = False) -> torch.Tensor:
        """Per-row positions (layers/attention.py): ids [R', L] of cache rows `rows` ([R'] long device, ascending;
        all R rows: arange) at positions pos [R', L] (each < span) -> the logits [R', V] fp32 after column
        last_at[i] of row i ([R'] long device; default the last column). Writes those rows' K/V at their
        positions, reads their slots <= each query's position; other rows are untouched. No host sync. fresh:
        every row's positions start at 0 (their own keys only: `whole_prefill`'s attention where it holds)."""
        if self.attention == INVARIANT:
            raise RuntimeError("per-row positions run through SDPA or eager attention, not the invariant kernel")
        x = self.target.embed_tokens(ids_RL)
        ropes = {kind: rope_from_inv_freq(pos_RL, inv, scale, x.dtype) for kind, (inv, scale) in self.ropes.items()}
        linear = self._rows_call(pos_RL, rows, last_at)
        if self.row_kernel and ids_RL.shape[1] == 1 and last_at is None:  # a step: every row or a compacted one
            step = Step(pos_RL, ropes, None, span, INVARIANT, None, True, linear, rows)
        else:
            fresh = fresh and self.whole_prefill
            masks = None if fresh else visible_masks(self.slot_ids, pos_RL, span, None, self._slot_window())
            ring = ring_step(pos_RL, self.ring, self.window, None, last_at) if self.ring else None
            step = Step(pos_RL, ropes, masks, span, self.attention, self.softcap, True, linear, rows, ring, fresh)
        x, _ = self._layers(x, step, False)
        if last_at is not None:
            x = x.gather(1, last_at.view(-1, 1, 1).expand(-1, 1, x.shape[-1]))
        logits, _ = head_and_taps(self.target, self.final_norm, x, {}, logits_at=None, last_only=True,
                                  want_features=False, softcap=self.final_softcap)
        return logits[:, -1]

    def _layers(self, x: torch.Tensor, step: Step, want_features: bool) -> tuple[torch.Tensor, dict]:
        """The decoder layers over the embedded tokens x [R, L, D] -> (the last hidden state, the tapped ones)."""
        taps: dict[int, torch.Tensor] = {}
        h, n = None, len(self.layers)  # h: the next layer's normed input where the add before it gave it
        for i in range(n):
            out = self.mixers[i](self.input_norms[i](x) if h is None else h, step, self.kinds[i])
            if self.sandwich:
                x = x + self.post_norms[i](out)
                x = x + self.post_ff_norms[i](self.mlps[i](self.pre_ff_norms[i](x)))
            else:  # a residual add and the norm after it: one kernel, the two ops' bits, so on every path
                x, h = self.post_norms[i].add(x, out)
                x, h = self.input_norms[i + 1].add(x, self.mlps[i](h)) if i + 1 < n else (x + self.mlps[i](h), None)
            if want_features and i in self.taps:
                taps[i] = x
        return x, taps

    def commit(self, accepted: torch.Tensor) -> None:
        """After a `verify` forward: row r keeps the first accepted[r] tokens of the block (device tensor [R]) in
        its linear layers' states. Nothing to do for a target without linear layers (its K/V sit at slot =
        position, or in a ring that a rejected draft cannot reach: layers/ring.py)."""
        for layer in self.linear:
            layer.commit(accepted)


def head_and_taps(target: Target, final_norm, x: torch.Tensor, taps: dict, *, logits_at: torch.Tensor | None,
                  last_only: bool, want_features: bool, softcap: float | None = None):
    """A static forward's end: the head's fp32 logits at the positions asked for and the joined taps (or None).
    last_only: a batch prefill needs only the next token ([R, P, V] fp32 logits would be GBs); logits_at: a padded
    prefill needs the next token after its last real one."""
    if logits_at is not None:
        x_out = x.index_select(1, logits_at)
    else:
        x_out = x[:, -1:] if last_only else x
    logits = target.lm_head(final_norm(x_out))
    if softcap:  # HF's order: in the model dtype, before the fp32 cast
        logits = torch.tanh(logits / softcap) * softcap
    feats = target.join_taps(taps, final_norm) if want_features else None
    return logits.float(), feats
