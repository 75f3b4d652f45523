"""Block proposers for the static speculative round: every method is free of host syncs and value-dependent shapes,
so the round that calls them can be captured as one CUDA graph.

Protocol (what `trainer.decode.engine` asks of a proposer):
- `reset(prompt_feats [1, P, T*D])`: per sequence, eager: the prompt's context (positions 0..P-1);
- `draft(anchor [1] long, start [] long) -> [B-1] long`: the draft for the block whose first token (the anchor) sits
  at position `start`; only context at positions < start may be seen;
- `append(feats [1, B, T*D], start [] long)`: context features of the block just verified, at positions
  start..start+B-1. Only the accepted ones will become visible (positions < the next round's start); the rest are
  stale and overwritten later. `draft` may use slots >= start as scratch: `append` at the same start follows it.

Shape legend: B block, M context slots, T taps, D hidden, H / Hkv heads, Dh head dim.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from trainer.model.attention import SLIDING, window_visible
from trainer.model.drafter import Drafter, apply_rope, rope_cos_sin
from trainer.model.target import Target


class StaticDFlashProposer:
    """The trained DFlash drafter with a static context K/V cache (slot = position), the target's frozen embedding and
    LM head. Same arithmetic as `trainer.decode.reference.draft_block_hidden` (and so as `Drafter.forward`): on CUDA the
    fp32 drafter runs under bf16 autocast, as the trainer's step does."""

    def __init__(self, target: Target, drafter: Drafter, block_size: int, slots: int,
                 autocast: bool | None = None) -> None:
        """autocast: run under bf16 autocast, as training does on CUDA (default: on CUDA only)."""
        dev = drafter.fc.weight.device
        self.autocast = dev.type == "cuda" if autocast is None else autocast
        self.autocast_device = dev.type
        self.target, self.block_size = target, block_size
        self.drafter = _with_bf16_linears(drafter) if self.autocast else drafter
        # The activations' dtype, as `Drafter.forward` has it (`stream_dtype`): bf16 under autocast, else fp32.
        self.stream = torch.bfloat16 if self.autocast else drafter.fc.weight.dtype
        cfg = drafter.cfg
        self.H, self.Hkv, self.Dh, self.theta = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                                 cfg.rope_theta)
        # K/V are cached in the dtype autocast produces them in (bf16 linears on CUDA).
        kv_dtype = torch.bfloat16 if self.autocast else drafter.fc.weight.dtype
        # B spare slots: `append` writes a whole block even at the last round's start.
        shape = (1, self.Hkv, slots + block_size, self.Dh)
        self.k = [torch.zeros(shape, dtype=kv_dtype, device=dev) for _ in drafter.layers]
        self.v = [torch.zeros(shape, dtype=kv_dtype, device=dev) for _ in drafter.layers]
        self.slot_ids = torch.arange(shape[2], device=dev)
        self.capacity = slots  # positions a decoder may commit (prompt + new tokens)
        self.block_offsets = torch.arange(block_size, device=dev)
        self.mask_ids = torch.full((block_size - 1,), target.mask_token_id, dtype=torch.long, device=dev)
        self._append_fn, self._draft_fn = self.write_context, self.draft_tokens

    def _autocast(self):
        return torch.autocast(self.autocast_device, dtype=torch.bfloat16, enabled=self.autocast)

    def compile(self) -> None:
        """Route `append` and `draft` (fixed shapes, called inside the round) through torch.compile; `reset` (the
        prompt's length varies) stays eager."""
        self._append_fn = torch.compile(self.write_context, dynamic=False)
        self._draft_fn = torch.compile(self.draft_tokens, dynamic=False)

    def reset(self, prompt_feats: torch.Tensor) -> None:
        self.write_context(prompt_feats, torch.zeros((), dtype=torch.long, device=prompt_feats.device))

    def append(self, feats: torch.Tensor, start: torch.Tensor) -> None:
        self._append_fn(feats, start)

    def draft(self, anchor: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        return self._draft_fn(anchor, start)

    @torch.no_grad()
    def write_context(self, feats: torch.Tensor, start: torch.Tensor) -> None:
        """K/V of the context features `feats` [1, n, T*D] into slots start..start+n-1 of every layer."""
        d = self.drafter
        dtype = self.stream
        n = feats.shape[1]
        pos = start + torch.arange(n, device=feats.device)
        with self._autocast():
            ctx = d.hidden_norm(d.fc(feats.to(dtype)))  # [1, n, D]
            cos, sin = rope_cos_sin(pos[None], self.Dh, self.theta, dtype)
            for i, layer in enumerate(d.layers):
                attn = layer.self_attn
                k = apply_rope(attn.k_norm(attn.k_proj(ctx).view(1, n, self.Hkv, self.Dh)).transpose(1, 2), cos, sin)
                v = attn.v_proj(ctx).view(1, n, self.Hkv, self.Dh).transpose(1, 2)
                self.k[i].index_copy_(2, pos, k.to(self.k[i].dtype))
                self.v[i].index_copy_(2, pos, v.to(self.v[i].dtype))

    @torch.no_grad()
    def draft_tokens(self, anchor: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        head = self.target.lm_head
        hidden = self.draft_hidden(anchor, start)
        return head(hidden[0, 1:].to(head.weight.dtype)).argmax(-1)

    @torch.no_grad()
    def draft_hidden(self, anchor: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """-> the drafter's final-normed hidden states of the block [1, B, D]."""
        d, B, H, Hkv, Dh = self.drafter, self.block_size, self.H, self.Hkv, self.Dh
        dtype = self.stream
        block_ids = torch.cat([anchor, self.mask_ids])[None]  # [1, B]
        pos = start + self.block_offsets  # [B]
        # The block's own K/V go into its slots start..start+B-1 (the context append after the verify overwrites
        # them), so attention reads one cache: context strictly before the anchor, then the whole block
        # (bidirectional), nothing after it.
        visible = (self.slot_ids < start + B)[None, None, None]  # [1, 1, 1, M + B]
        if d.cfg.window is not None:  # sliding layers: the window ending at each query (causal in the block)
            sliding = window_visible(pos, self.slot_ids, d.cfg.window)[None, None]  # [1, 1, B, M + B]
        with self._autocast():
            x = self.target.embed_tokens(block_ids).to(dtype)
            cos, sin = rope_cos_sin(pos[None], Dh, self.theta, dtype)
            for i, layer in enumerate(d.layers):
                attn = layer.self_attn
                h, kernel = self.attention_input(layer, x)
                q = apply_rope(attn.q_norm(attn.q_proj(h).view(1, B, H, Dh)).transpose(1, 2), cos, sin)
                k_b = apply_rope(attn.k_norm(attn.k_proj(h).view(1, B, Hkv, Dh)).transpose(1, 2), cos, sin)
                v_b = attn.v_proj(h).view(1, B, Hkv, Dh).transpose(1, 2)
                self.k[i].index_copy_(2, pos, k_b.to(self.k[i].dtype))
                self.v[i].index_copy_(2, pos, v_b.to(self.v[i].dtype))
                mask = sliding if layer.kind == SLIDING else visible
                out = F.scaled_dot_product_attention(q.to(self.k[i].dtype), self.k[i], self.v[i], attn_mask=mask,
                                                     enable_gqa=H != Hkv)
                x = x + self.attention_output(layer, attn.o_proj(out.transpose(1, 2).reshape(1, B, H * Dh)), kernel)
                x = x + self.mlp_residual(layer, x)
            return d.norm(x)

    # The block's sublayers around attention and MLP: a DFlash layer's plain norms here; a DFlash2 proposer
    # (trainer/decode/drafters/dflash2.py) wraps them in its convolutions. kernel: what the output side needs.
    def attention_input(self, layer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return layer.input_layernorm(x), None

    def attention_output(self, layer, y: torch.Tensor, kernel: torch.Tensor | None) -> torch.Tensor:
        return y

    def mlp_residual(self, layer, x: torch.Tensor) -> torch.Tensor:
        return layer.mlp(layer.post_attention_layernorm(x))


def _with_bf16_linears(drafter: Drafter) -> Drafter:
    """A copy whose Linear weights are stored in bf16 (norms stay fp32). Under bf16 autocast a linear computes on
    bf16 copies of its weights anyway; storing them saves one cast kernel per linear per call, same numerics."""
    import copy

    twin = copy.deepcopy(drafter)
    for module in twin.modules():
        if isinstance(module, torch.nn.Linear):
            module.to(torch.bfloat16)
    return twin


class TableProposer:
    """Drafts from a fixed token table: the draft for the block at `start` is table[start+1 .. start+B-1]. Given the
    target's own greedy sequence it is a perfect drafter; with one entry changed, every round that reaches it stops
    there. Exists to test the static round's bookkeeping (acceptance, bonus, cache reuse) with known answers."""

    def __init__(self, table: torch.Tensor, block_size: int) -> None:
        self.table, self.block_size = table, block_size
        self.capacity = None  # no cache: any decoder capacity fits
        self.offsets = torch.arange(1, block_size, device=table.device)

    def reset(self, prompt_feats: torch.Tensor) -> None:
        pass

    def append(self, feats: torch.Tensor, start: torch.Tensor) -> None:
        pass

    def draft(self, anchor: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        idx = (start + self.offsets).clamp(max=self.table.shape[0] - 1)
        return self.table[idx]
