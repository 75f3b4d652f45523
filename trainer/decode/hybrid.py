"""A hybrid target (Qwen3.5, Qwen3.6, Qwen3-Next: Gated DeltaNet layers beside gated full attention) over static
buffers, the batch-1 decoder (`HybridDecoder`) and the batch generator (`HybridBatchGenerator`) over it: what
`engine.StaticDecoder` and `generate.BatchGenerator` need to serve hybrids, kept apart from `stack.py` until its
`MIXERS` takes this linear layer at its `linear` slot (docs/architecture.md, "Decode layers per mixer").

`HybridStaticTarget.forward` has `StaticTarget.forward`'s contract, plus what a recurrent layer needs:
- a forward of one token (a decode step) takes it into every linear layer's state;
- a forward with `logits_at` (a prefill, `engine.Prefill`'s padded bucket) takes tokens 0..logits_at into the state
  and leaves the bucket's padding out; at position 0 it first zeroes the state (a new sequence);
- `verify=True` (a speculative verify of B tokens) leaves the state as it was and keeps the block, and
  `commit(accepted [R])` then moves each row's state past its accepted prefix (`layers/linear.py`), on the device.
The attention layers write K/V at slot = position as `StaticTarget` does, so a rejected draft's K/V need no undo.
`HybridStaticTarget.forward_rows` has `StaticTarget.forward_rows`' contract (per-row positions: the batch generator's
refilled slots); a prefill chunk of some rows gathers their linear states (zeroed at a prompt's first chunk),
advances them by each row's real tokens and writes them back.

Full attention here is the hybrids' own: a sigmoid output gate from the doubled q projection, q/k RMSNorms, the
family's partial RoPE (HF's rotary module and `apply_rotary_pos_emb`). Norms and MLPs run as HF's modules (an MoE
MLP through HF's own forward: eager here; a captured MoE MLP is `layers/moe.py`'s).

Shape legend: R rows, L tokens, M cache slots, H / Hkv query / key-value heads, Dh head dim, D hidden, V vocab.
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from trainer.decode.engine import StaticDecoder
from trainer.decode.generate import BatchGenerator
from trainer.decode.layers.linear import GatedDeltaNetDecode, decode_layers, kernel_for
from trainer.decode.stack import head_and_taps
from trainer.errors import ConfigError
from trainer.model.target import Target

HYBRID_MODEL_TYPES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
# what `hybrid_decoder` and `batch_generator` serve on every device: dense MLPs. An MoE MLP runs HF's forward,
# eager-correct but not known to be graph-safe; MoE hybrids join when the stack's MoE layer (layers/moe.py) takes
# their MLPs.
SERVED_MODEL_TYPES = ("qwen3_5_text",)


def check_hybrid(cfg) -> None:
    """Refuse, in one line and from the config alone, a target this module does not compute as HF does."""
    model_type = getattr(cfg, "model_type", None)
    if model_type not in HYBRID_MODEL_TYPES:
        raise ConfigError(f"the hybrid static target takes {', '.join(HYBRID_MODEL_TYPES)} targets, not "
                          f"{model_type!r}", hint="use eval.engine=hf for this target")


def rope_position_ids(rotary, pos_RL: torch.Tensor) -> torch.Tensor:
    """Text positions pos_RL [R, L] in the form HF rotary module `rotary` takes on every supported transformers
    release. Qwen3.5's is multimodal RoPE (it has `mrope_section`): position ids [3, R, L], one row per section
    (temporal, height, width), equal for text; some releases index them as [3, R, L] only (`position_ids[:, :, None,
    :]`), others expand [R, L] themselves, so the explicit 3-D form serves both. Qwen3-Next's is plain RoPE: [R, L]."""
    if hasattr(rotary, "mrope_section"):
        return pos_RL[None].expand(3, -1, -1)
    return pos_RL


class HybridStaticTarget:
    """A full (untruncated) hybrid `Target` with static buffers for `rows` rows: K/V caches of `slots` positions
    for the attention layers, a `GatedDeltaNetDecode` (verify blocks up to `block` tokens) per linear layer.

    padded: rows of different prompt lengths, left-padded, as `StaticTarget(padded=True)`: row r's first real token
    at slot `row_start[r]`; attention sees no slot before it, RoPE takes slot - row_start, and a padding token enters
    a linear layer as zeros (HF's `apply_mask_to_padding_states`), which leaves the zero state of a new sequence
    zero, so each row computes what it would alone."""

    def __init__(self, target: Target, slots: int, rows: int = 1, block: int = 16, kernel: str | None = None,
                 padded: bool = False) -> None:
        if target.truncated:
            raise RuntimeError("static decoding needs the full target; load it with truncate=False")
        check_hybrid(target.hf_config)
        self.target, self.model = target, target.model
        self.layers = list(self.model.model.layers)
        dev = target.embed_tokens.weight.device
        dtype = target.embed_tokens.weight.dtype
        kernel = kernel or kernel_for(dev)
        self.slots, self.rows = slots, rows
        self.linear = decode_layers(self.model, rows, block, kernel)
        self.k, self.v = {}, {}
        for i, layer in enumerate(self.layers):
            if i not in self.linear:
                attn = layer.self_attn
                shape = (rows, attn.k_proj.out_features // attn.head_dim, slots, attn.head_dim)
                self.k[i] = torch.zeros(shape, dtype=dtype, device=dev)
                self.v[i] = torch.zeros(shape, dtype=dtype, device=dev)
        # HF's RoPE application of the family's modeling file (partial rotary: the first dims of each head)
        self.apply_rope = sys.modules[type(self.model.model).__module__].apply_rotary_pos_emb
        self.slot_ids = torch.arange(slots, device=dev)
        self.padded = padded
        self.row_start = torch.zeros(rows, dtype=torch.long, device=dev)
        self.heads = target.hf_config.num_attention_heads
        self.row_kernel = False  # forward_rows' steps run SDPA (the gated attention is HF's)
        self.taps = set(target.layer_ids)
        self.final_norm = self.model.model.norm

    @property
    def device(self) -> torch.device:
        return self.slot_ids.device

    def rope(self, x: torch.Tensor, pos_RL: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """HF's rotary module at positions pos_RL [R, L] -> (cos, sin), in the form its `apply_rotary_pos_emb`
        takes (`rope_position_ids`)."""
        rotary = self.model.model.rotary_emb
        return rotary(x, rope_position_ids(rotary, pos_RL))

    def _attention(self, i: int, attn, h: torch.Tensor, pos: torch.Tensor, rope, visible: torch.Tensor,
                   span: int) -> torch.Tensor:
        """HF's gated attention of layer i over the static cache: h [R, L, D] at slots `pos` [L] -> [R, L, D]."""
        R, L, _ = h.shape
        Dh = attn.head_dim
        q, gate = torch.chunk(attn.q_proj(h).view(R, L, -1, Dh * 2), 2, dim=-1)
        q = attn.q_norm(q).transpose(1, 2)
        k = attn.k_norm(attn.k_proj(h).view(R, L, -1, Dh)).transpose(1, 2)
        v = attn.v_proj(h).view(R, L, -1, Dh).transpose(1, 2)
        q, k = self.apply_rope(q, k, *rope)
        self.k[i].index_copy_(2, pos, k)
        self.v[i].index_copy_(2, pos, v)
        out = F.scaled_dot_product_attention(q, self.k[i][:, :, :span], self.v[i][:, :, :span], attn_mask=visible,
                                             scale=attn.scaling, enable_gqa=q.shape[1] != k.shape[1])
        out = out.transpose(1, 2).reshape(R, L, -1) * torch.sigmoid(gate.reshape(R, L, -1))
        return attn.o_proj(out)

    def _linear(self, layer: GatedDeltaNetDecode, h: torch.Tensor, pos0: torch.Tensor, logits_at, verify: bool):
        R, L, _ = h.shape
        if verify:
            return layer.forward(h)
        if L == 1 and logits_at is None:
            return layer.step(h)
        layer.reset((pos0 == 0).expand(R))  # a prefill from position 0 starts a new sequence
        valid = None if logits_at is None else (logits_at.view(-1)[-1:] + 1).expand(R)
        return layer.prefill(h, valid)

    @torch.no_grad()
    def forward(self, ids_RL: torch.Tensor, pos0: torch.Tensor, want_features: bool = True, last_only: bool = False,
                logits_at: torch.Tensor | None = None, span: int | None = None, verify: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`StaticTarget.forward`'s arguments and results (logits [R, L, V] fp32 or one position's, features
        [R, L, T*D] or None), rows unpadded; verify: see the module docstring (then `commit`)."""
        R, L = ids_RL.shape
        span = self.slots if span is None else span
        pos = pos0 + torch.arange(L, device=ids_RL.device)
        x = self.target.embed_tokens(ids_RL)
        s = self.slot_ids[:span]
        visible = (s[None, :] <= pos[:, None])[None, None]  # [1, 1, L, span]
        if self.padded:
            real = pos[None, :] >= self.row_start[:, None]  # [R, L]
            rope = self.rope(x, pos[None, :] - self.row_start[:, None])
            # a padding query sees its own slot (one that sees nothing would be NaN), a real one no slot before
            # its row's start (StaticTarget's rule)
            lo = torch.minimum(self.row_start[:, None], pos[None, :])  # [R, L]
            visible = visible & (s[None, None, None, :] >= lo[:, None, :, None])  # [R, 1, L, span]
        else:
            real = None
            rope = self.rope(x, pos[None].expand(R, L))
        taps = {}
        for i, layer in enumerate(self.layers):
            h = layer.input_layernorm(x)
            if i in self.linear:
                h = h if real is None else h * real[..., None].to(h.dtype)
                x = x + self._linear(self.linear[i], h, pos0, logits_at, verify)
            else:
                x = x + self._attention(i, layer.self_attn, h, pos, rope, visible, span)
            mlp = layer.mlp(layer.post_attention_layernorm(x))
            x = x + (mlp[0] if isinstance(mlp, tuple) else mlp)
            if want_features and i in self.taps:
                taps[i] = x
        return head_and_taps(self.target, self.final_norm, x, taps, logits_at=logits_at, last_only=last_only,
                             want_features=want_features)

    @torch.no_grad()
    def forward_rows(self, ids_RL: torch.Tensor, pos_RL: torch.Tensor, rows: torch.Tensor, span: int,
                     last_at: torch.Tensor | None = None) -> torch.Tensor:
        """`StaticTarget.forward_rows` (per-row positions, the refilling batch generator): ids [R', L] of cache rows
        `rows` at positions pos [R', L] -> the logits [R', V] after column last_at[i] of row i. A one-token forward
        of every row is a decode step of each row's linear states; any other is a prefill chunk of those rows alone:
        a row whose chunk starts at position 0 starts from zero states, and row i takes its first last_at[i] + 1
        tokens into them (the rest is padding)."""
        R, L = ids_RL.shape
        x = self.target.embed_tokens(ids_RL)
        s = self.slot_ids[:span]
        visible = (s[None, None, :] <= pos_RL[:, :, None])[:, None]  # [R', 1, L, span]
        rope = self.rope(x, pos_RL)
        step = L == 1 and R == self.rows
        valid = None if last_at is None else last_at + 1
        for i, layer in enumerate(self.layers):
            h = layer.input_layernorm(x)
            if i in self.linear:
                out = self.linear[i].step(h) if step else self._prefill_rows(self.linear[i], h, pos_RL, rows, valid)
            else:
                out = self._attention_rows(i, layer.self_attn, h, pos_RL, rows, rope, visible, span)
            x = x + out
            mlp = layer.mlp(layer.post_attention_layernorm(x))
            x = x + (mlp[0] if isinstance(mlp, tuple) else mlp)
        if last_at is not None:
            x = x.gather(1, last_at.view(-1, 1, 1).expand(-1, 1, x.shape[-1]))
        logits, _ = head_and_taps(self.target, self.final_norm, x, {}, logits_at=None, last_only=True,
                                  want_features=False)
        return logits[:, -1]

    def _prefill_rows(self, layer: GatedDeltaNetDecode, h: torch.Tensor, pos_RL: torch.Tensor, rows: torch.Tensor,
                      valid: torch.Tensor | None) -> torch.Tensor:
        """A prefill chunk of cache rows `rows` only: their conv and recurrent states gathered (zeroed where the chunk
        starts a sequence), advanced by the chunk's valid tokens, and written back; other rows untouched."""
        conv, state = layer.conv, layer.state
        fresh = pos_RL[:, 0] == 0
        layer.conv = conv.index_select(0, rows).masked_fill(fresh.view(-1, 1, 1), 0)
        layer.state = state.index_select(0, rows).masked_fill(fresh.view(-1, 1, 1, 1), 0)
        try:
            out = layer.prefill(h, valid)
            conv.index_copy_(0, rows, layer.conv)
            state.index_copy_(0, rows, layer.state)
        finally:
            layer.conv, layer.state = conv, state
        return out

    def _attention_rows(self, i: int, attn, h: torch.Tensor, pos_RL: torch.Tensor, rows: torch.Tensor, rope,
                        visible: torch.Tensor, span: int) -> torch.Tensor:
        """`_attention` with per-row positions: K/V into each row's own slots of its cache row, queries over that
        cache row's slots (layers/attention.py)."""
        R, L, _ = h.shape
        Dh = attn.head_dim
        q, gate = torch.chunk(attn.q_proj(h).view(R, L, -1, Dh * 2), 2, dim=-1)
        q = attn.q_norm(q).transpose(1, 2)
        k = attn.k_norm(attn.k_proj(h).view(R, L, -1, Dh)).transpose(1, 2)
        v = attn.v_proj(h).view(R, L, -1, Dh).transpose(1, 2)
        q, k = self.apply_rope(q, k, *rope)
        at = (rows[:, None].expand_as(pos_RL), pos_RL)
        self.k[i].transpose(1, 2).index_put_(at, k.transpose(1, 2))
        self.v[i].transpose(1, 2).index_put_(at, v.transpose(1, 2))
        keys, values = self.k[i][:, :, :span], self.v[i][:, :, :span]
        if R != self.rows:
            keys, values = keys.index_select(0, rows), values.index_select(0, rows)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, scale=attn.scaling,
                                             enable_gqa=q.shape[1] != k.shape[1])
        out = out.transpose(1, 2).reshape(R, L, -1) * torch.sigmoid(gate.reshape(R, L, -1))
        return attn.o_proj(out)

    def commit(self, accepted: torch.Tensor) -> None:
        """After a `verify` forward: row r keeps the first accepted[r] tokens of the block (device tensor [R])."""
        for layer in self.linear.values():
            layer.commit(accepted)


class HybridDecoder(StaticDecoder):
    """`StaticDecoder` (target-only and speculative greedy decoding at batch 1, its host loops and its graphs) over
    a `HybridStaticTarget`: the round verifies with `verify=True` and commits the anchor plus the accepted drafts.
    Uncompiled; the attention runs through SDPA."""

    def _static_target(self, target: Target, slots: int, block_size: int, invariant: bool) -> "HybridStaticTarget":
        return HybridStaticTarget(target, slots, block=block_size)

    def _spec_round(self) -> None:
        draft = self.proposer.draft(self.anchor, self.start)  # [B-1]
        block = torch.cat([self.anchor, draft])  # [B]
        logits, feats = self.static.forward(block[None], self.start, verify=True)
        post = logits[0].argmax(-1)
        a = (block[1:] == post[:-1]).long().cumprod(0).sum()  # leading accepted drafts
        self.static.commit((a + 1).view(1))  # the anchor and the accepted drafts enter the recurrent states
        self.proposer.append(feats, self.start)
        self.result.copy_(torch.cat([a[None], block, post]))
        self.anchor.copy_(post.gather(0, a[None]))
        self.start.add_(a + 1)


def serves(cfg) -> bool:
    """Whether `hybrid_decoder` decodes this target (from its config alone)."""
    return getattr(cfg, "model_type", None) in SERVED_MODEL_TYPES


def hybrid_decoder(target: Target, drafter, block_size: int, capacity: int) -> HybridDecoder:
    """What `decoders.decoders` decodes a hybrid target it serves (`serves`) with: a `HybridDecoder` with the drafter
    kind's static proposer; uncompiled, SDPA attention, HF's norms."""
    from trainer.decode.drafters.dflash2 import StaticDFlash2Proposer
    from trainer.decode.static_draft import StaticDFlashProposer

    check_hybrid(target.hf_config)
    proposer_cls = StaticDFlashProposer if drafter.cfg.dflash2 is None else StaticDFlash2Proposer
    proposer = proposer_cls(target, drafter, block_size, capacity)
    return HybridDecoder(target, capacity, proposer, block_size)


class HybridBatchGenerator(BatchGenerator):
    """`BatchGenerator` (refilled slots, one graph replay per token for every slot) over a `HybridStaticTarget`'s
    `forward_rows`: a refilled row's linear-attention states start from zero and take its prompt alone."""

    def _static_target(self, target: Target, rows: int, max_len: int) -> "HybridStaticTarget":
        return HybridStaticTarget(target, max_len, rows=rows, block=1, padded=True)


def batch_generator(target: Target, rows: int, max_len: int, stop_ids, graphs: bool = True) -> BatchGenerator:
    """The static batch generator for `target`: `HybridBatchGenerator` for a hybrid it serves (`serves`), else
    `BatchGenerator` (which refuses, as it does, the families it does not compute)."""
    cls = HybridBatchGenerator if serves(target.hf_config) else BatchGenerator
    return cls(target, rows, max_len, stop_ids, graphs=graphs)
