"""The reference decoders over HF's DynamicCache, at batch size 1: the target alone, and DFlash speculative decoding
(z-lab `dflash_generate`). Eager and simple: the static, graph-replayed engine (trainer/decode/engine.py) is tested
against them.

Speculative round (invariant: the target KV cache and the drafter's context cache both hold exactly `start` tokens;
token `start` (the anchor / previous bonus token) is committed but not yet in either cache):
  1. draft: ONE drafter forward over [anchor, MASK x (B-1)] at positions start..start+B-1, attending to every cached
     context feature (positions < start) and to its whole block -> B-1 greedy draft tokens;
  2. verify: ONE target forward over [anchor, d_1..d_{B-1}] with the KV cache -> greedy posterior p_0..p_{B-1};
  3. accept a = leading k with d_{k+1} == p_k; commit d_1..d_a plus the bonus p_a (a + 1 new tokens);
  4. crop the target cache back to start + a + 1; the target's tapped features of the a + 1 accepted block tokens
     become the next round's new context (appended to the drafter cache); start += a + 1. A hybrid target's linear-
     attention layers keep a recurrent state, which cannot be cropped: their cache is copied before the verify and,
     after it, restored and advanced by the a + 1 accepted tokens alone (one more target forward per round).
Greedy output is therefore the target's own greedy output, token for token (up to floating-point ties).

Shape legend: L tokens, B block size, T taps, D hidden, Hkv key/value heads, Dh head dim, V vocab.
"""
from __future__ import annotations

import copy
import functools
import inspect
import time
from collections.abc import Collection
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from trainer.decode.drafters.dflash2 import attention_input, attention_output, mlp_residual, select_drafts
from trainer.decode.rounds import SpecResult, leading_matches
from trainer.decode.stops import stop_index
from trainer.model.attention import SLIDING, window_visible
from trainer.model.drafter import Drafter, apply_rope, rope_cos_sin, stream_dtype
from trainer.model.linear_attention import LINEAR
from trainer.model.target import Target


# ---------------------------------------------------------------- target forward with a KV cache

def new_cache(target: Target):
    """A DynamicCache of full layers only. Built from the config, transformers 5.24 gives sliding-window layers a
    cache that drops keys past the window and then refuses `crop` (a rejected draft could not be rolled back); full
    layers keep every key and HF's sliding mask still hides those outside the window, so the tokens are the same.
    A hybrid target's cache is built from its config (its linear-attention layers keep a convolution and a recurrent
    state instead of keys; it has no sliding layers)."""
    from transformers import DynamicCache

    return DynamicCache(config=target.hf_config) if is_hybrid(target) else DynamicCache()


def is_hybrid(target: Target) -> bool:
    """Whether the target has linear-attention (recurrent) layers, whose cache cannot be cropped."""
    return target.kinds is not None and LINEAR in target.kinds.layer_types


def crop_cache(cache, length: int) -> None:
    """Keep the first `length` tokens. A negative count is the one `crop` form that transformers 4.x, 5.17 and 5.24
    all read as "remove this many" (5.24 rejects a positive absolute length; 5.17 only warns)."""
    extra = cache.get_seq_length() - length
    if extra < 0:
        raise ValueError(f"cannot crop a cache of {cache.get_seq_length()} tokens to {length}")
    if extra:
        cache.crop(-extra)


def _cache_kwarg(model) -> str:
    """transformers 5.24 renamed `past_key_values` to `cache` (the old name warns); 5.17 knows only the old one."""
    return _cache_kwarg_of(type(model))


@functools.lru_cache(maxsize=None)
def _cache_kwarg_of(model_cls: type) -> str:
    return "cache" if "cache" in inspect.signature(model_cls.forward).parameters else "past_key_values"


@torch.no_grad()
def target_forward(target: Target, ids_1L: torch.Tensor, cache, start: int,
                   want_features: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """ids [1, L] at positions start..start+L-1, appended to `cache` -> (logits [1, L, V], tapped features
    [1, L, T*D] or None). `target` must be untruncated (the LM head needs every layer)."""
    if target.truncated:
        raise RuntimeError("speculative decoding needs the full target; load it with truncate=False")
    pos = torch.arange(start, start + ids_1L.shape[1], device=ids_1L.device)[None]
    target._taps.clear()  # filled by the layer hooks installed by load_target
    out = target.model(input_ids=ids_1L, position_ids=pos, use_cache=True, **{_cache_kwarg(target.model): cache})
    feats = target.join_taps(target._taps) if want_features else None
    target._taps.clear()
    return out.logits, feats


def keep_accepted(target: Target, cache, before, block: torch.Tensor, accepted: int, start: int):
    """The target cache after a verify of `block` [1, B] at `start`, holding exactly its first `accepted` + 1 tokens:
    `cache` cropped, or -- a hybrid target, `before` the copy of the cache taken before the verify -- `before`
    advanced by those tokens alone (a recurrent state cannot drop the tokens it has taken in)."""
    if before is None:
        crop_cache(cache, start + accepted + 1)
        return cache
    target_forward(target, block[:, :accepted + 1], before, start, want_features=False)
    return before


# ---------------------------------------------------------------- target-only greedy decoding

@torch.no_grad()
def generate_target_only(target: Target, prompt_ids: list[int], max_new: int,
                         stops: Collection[int] = ()) -> list[int]:
    """Greedy decoding with the KV cache: up to `max_new` new tokens, through the first of `stops` (kept)."""
    if max_new <= 0:
        return []
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=target.device)
    cache = new_cache(target)
    logits, _ = target_forward(target, ids, cache, 0, want_features=False)
    out: list[int] = []
    while True:
        nxt = int(logits[0, -1].argmax())  # SYNC: one per token, inherent to greedy decoding
        out.append(nxt)
        if stop_index(out, stops, max_new) is not None:
            return out
        logits, _ = target_forward(target, torch.tensor([[nxt]], device=ids.device), cache,
                                   len(prompt_ids) + len(out) - 1, want_features=False)


# ---------------------------------------------------------------- proposers (one draft per block)

class BlockProposer(Protocol):
    """What a speculative round asks of a drafter. `begin` resets per-sequence state; `propose` gets the new context
    features (target taps of the tokens that just entered the target cache, [1, n, T*D]) and all committed tokens
    [1, start + 1] (the last one is the anchor) and returns B-1 draft tokens [B-1] long."""

    block_size: int

    def begin(self) -> None: ...

    def propose(self, new_feats: torch.Tensor, committed: torch.Tensor) -> torch.Tensor: ...


class DraftContextCache:
    """Per drafter layer: K (k_norm + RoPE applied) and V of the context features only, [1, Hkv, C, Dh]."""

    def __init__(self, num_layers: int) -> None:
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.length = 0

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k[layer] is not None:
            k = torch.cat([self.k[layer], k], dim=2)
            v = torch.cat([self.v[layer], v], dim=2)
        self.k[layer], self.v[layer] = k, v
        return k, v


@torch.no_grad()
def draft_block_hidden(drafter: Drafter, cache: DraftContextCache, new_feats: torch.Tensor,
                       block_emb: torch.Tensor) -> torch.Tensor:
    """One drafter forward for one block with cached context. new_feats [1, n, T*D] sit at positions
    cache.length..cache.length+n-1; the block [1, B, D] right after them. Appends the n context K/V to `cache`
    (block K/V are never cached) -> final-normed hidden [1, B, D].

    Same arithmetic as `Drafter.forward` for a single anchor whose visible context is everything cached (a sliding
    layer: the window ending at each query, as in training); a DFlash2 drafter's convolutions run over the block's B
    positions (trainer/decode/drafters/dflash2.py).
    """
    cfg = drafter.cfg
    dtype = stream_dtype(drafter.fc.weight.dtype, new_feats.device.type)  # as in training: bf16 under autocast
    H, Hkv, Dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    ctx = drafter.hidden_norm(drafter.fc(new_feats.to(dtype)))  # [1, n, D]
    n, B = ctx.shape[1], block_emb.shape[1]
    start = cache.length + n
    dev = ctx.device
    rope_c = rope_cos_sin(torch.arange(cache.length, start, device=dev)[None], Dh, cfg.rope_theta, dtype)
    rope_q = rope_cos_sin(torch.arange(start, start + B, device=dev)[None], Dh, cfg.rope_theta, dtype)
    x = block_emb.to(dtype)
    sliding = None
    if cfg.window is not None:
        sliding = window_visible(torch.arange(start, start + B, device=dev), torch.arange(start + B, device=dev),
                                 cfg.window)[None, None]
    for i, layer in enumerate(drafter.layers):
        attn = layer.self_attn
        k_c = apply_rope(attn.k_norm(attn.k_proj(ctx).view(1, n, Hkv, Dh)).transpose(1, 2), *rope_c)
        v_c = attn.v_proj(ctx).view(1, n, Hkv, Dh).transpose(1, 2)
        k_ctx, v_ctx = cache.append(i, k_c, v_c)
        h, kernel = attention_input(layer, x)
        q = apply_rope(attn.q_norm(attn.q_proj(h).view(1, B, H, Dh)).transpose(1, 2), *rope_q)
        k_b = apply_rope(attn.k_norm(attn.k_proj(h).view(1, B, Hkv, Dh)).transpose(1, 2), *rope_q)
        v_b = attn.v_proj(h).view(1, B, Hkv, Dh).transpose(1, 2)
        # Full layers: no mask, the block sees all cached context (strictly before the anchor) and itself,
        # bidirectionally.
        mask = sliding if layer.kind == SLIDING else None
        out = F.scaled_dot_product_attention(q, torch.cat([k_ctx, k_b], 2), torch.cat([v_ctx, v_b], 2),
                                             attn_mask=mask, enable_gqa=H != Hkv)
        x = x + attention_output(layer, attn.o_proj(out.transpose(1, 2).reshape(1, B, H * Dh)), kernel)
        x = x + mlp_residual(layer, x)
    cache.length = start
    return drafter.norm(x)


class DFlashProposer(nn.Module):
    """The trained drafter + the target's frozen embedding and LM head, with its own context K/V cache. A DFlash
    drafter proposes the head's argmax at each mask position; a DFlash2 drafter its selector's greedy walk over the
    head's top-k (trainer/decode/drafters/dflash2.py `select_drafts`)."""

    def __init__(self, target: Target, drafter: Drafter, block_size: int, autocast: bool | None = None) -> None:
        """autocast: run the drafter under bf16 autocast, as training does on CUDA (default: on CUDA only)."""
        super().__init__()
        self.target, self.drafter, self.block_size = target, drafter, block_size
        self.autocast = autocast
        self.cache = DraftContextCache(len(drafter.layers))

    def begin(self) -> None:
        self.cache = DraftContextCache(len(self.drafter.layers))

    def _autocast(self, device: torch.device):
        # Same numerics as training: the trainer's CUDA step runs the fp32 drafter under bf16 autocast.
        # CUDA's autocast only: on CPU `autocast=True` changes nothing, as the DFlash proposer always had it.
        enabled = device.type == "cuda" if self.autocast is None else self.autocast
        return torch.autocast("cuda", dtype=torch.bfloat16, enabled=enabled)

    @torch.no_grad()
    def draft_hidden(self, new_feats: torch.Tensor, committed: torch.Tensor) -> torch.Tensor:
        """[B - 1, D]: the drafter's final-normed hidden states at the block's mask positions (advances the
        context cache)."""
        block = torch.full((1, self.block_size), self.target.mask_token_id, dtype=torch.long, device=committed.device)
        block[0, 0] = committed[0, -1]
        with self._autocast(block.device):
            return draft_block_hidden(self.drafter, self.cache, new_feats, self.target.embed_tokens(block))[0, 1:]

    @torch.no_grad()
    def draft_logits(self, new_feats: torch.Tensor, committed: torch.Tensor) -> torch.Tensor:
        """[B - 1, vocab]: the LM head's logits at the block's mask positions (advances the context cache)."""
        return self._head(self.draft_hidden(new_feats, committed))

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.target.lm_head
        return head(hidden.to(head.weight.dtype))

    @torch.no_grad()
    def propose(self, new_feats: torch.Tensor, committed: torch.Tensor) -> torch.Tensor:
        if self.drafter.cfg.dflash2 is None:
            return self.draft_logits(new_feats, committed).argmax(-1)
        hidden = self.draft_hidden(new_feats, committed)
        logits = self._head(hidden)
        with self._autocast(hidden.device):
            return select_drafts(self.drafter, logits, hidden, committed[0, -1:])


class OracleProposer(nn.Module):
    """A perfect drafter: proposes the target's own greedy continuation (no cache; recomputed from all tokens).
    Its acceptance length must be exactly B; used to test the verifier's bookkeeping."""

    def __init__(self, target: Target, block_size: int) -> None:
        super().__init__()
        self.target, self.block_size = target, block_size

    def begin(self) -> None:
        pass

    @torch.no_grad()
    def propose(self, new_feats: torch.Tensor, committed: torch.Tensor) -> torch.Tensor:
        toks = generate_target_only(self.target, committed[0].tolist(), self.block_size - 1)
        return torch.tensor(toks, dtype=torch.long, device=committed.device)


# ---------------------------------------------------------------- speculative decoding

@torch.no_grad()
def generate_speculative(target: Target, proposer: BlockProposer, prompt_ids: list[int], max_new: int,
                         stops: Collection[int] = (), host_s: dict[str, float] | None = None) -> SpecResult:
    """Greedy DFlash speculative decoding at batch 1 (see the module docstring for the round).

    host_s: if given, host seconds are added under "draft" (proposer), "verify" (target forward) and "accept" (the
    round's one sync and its bookkeeping). At batch 1 the GPU waits on the host, so these split the round's wall
    time without adding a sync."""
    clock = time.perf_counter
    spent = host_s if host_s is not None else {}
    if max_new <= 0:
        return SpecResult(tokens=[])
    B = proposer.block_size
    dev = target.device
    cache = new_cache(target)
    recurrent = is_hybrid(target)
    committed = torch.tensor([prompt_ids], dtype=torch.long, device=dev)
    logits, new_feats = target_forward(target, committed, cache, 0)
    first = logits[:, -1:].argmax(-1)
    committed = torch.cat([committed, first], dim=1)
    new_host = first[0].tolist()  # SYNC: the committed new tokens, mirrored on the host for the stop rule
    start = len(prompt_ids)
    proposer.begin()
    accepted: list[int] = []
    while stop_index(new_host, stops, max_new) is None:
        t0 = clock()
        draft = proposer.propose(new_feats, committed)  # [B-1]
        t1 = clock()
        block = torch.cat([committed[:, -1:], draft[None]], dim=1)  # [1, B]
        before = copy.deepcopy(cache) if recurrent else None  # the state at `start`, to advance by the accepted
        logits, feats = target_forward(target, block, cache, start)
        t2 = clock()
        post = logits[0].argmax(-1)  # [B]: the target's greedy token after each block position
        reference = torch.cat([block[0, :1], post[:-1]])  # what the target emits at each block position
        a_dev = leading_matches(block[0], reference, torch.ones_like(reference, dtype=torch.bool))
        # SYNC: one per round -- the accepted count and the tokens it commits, in one transfer.
        host = torch.cat([a_dev.view(1), block[0], post]).tolist()
        a, block_h, post_h = host[0], host[1:B + 1], host[B + 1:]
        accepted.append(a)
        committed = torch.cat([committed, block[:, 1:a + 1], post[None, a:a + 1]], dim=1)
        new_host += block_h[1:a + 1] + [post_h[a]]
        cache = keep_accepted(target, cache, before, block, a, start)
        start += a + 1
        new_feats = feats[:, :a + 1]
        t3 = clock()
        for key, dt in (("draft", t1 - t0), ("verify", t2 - t1), ("accept", t3 - t2)):
            spent[key] = spent.get(key, 0.0) + dt
    return SpecResult(tokens=new_host[:stop_index(new_host, stops, max_new)], accepted=accepted)
