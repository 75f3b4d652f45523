"""The target's fast attention path: document-causal flex attention over packed rows, with a static BlockMask.

Why: `packed_causal_mask` hands HF's sdpa a dense bool [R, 1, S, S] mask, which at S = 3072 rules out the flash
kernel (sdpa falls to the memory-efficient one and reads the whole mask). Here the same rule -- key j visible to
query i iff j <= i and doc_ids[i] == doc_ids[j] (padding, doc -1, attends causally to padding) -- is a flex BlockMask
whose 128 x 128 tiles are classified on the device: tiles strictly below the diagonal inside one document are *full*
(no mask_mod), the diagonal tiles and the tiles a document boundary crosses are *partial*, the rest are skipped. A
row holding one document therefore visits exactly the causal tiles, as causal flash does.

Assumes what packing guarantees (trainer.data.packing): each document, and the padding, is ONE contiguous run of a
row. Tile rule (k-tile before q-tile, both inside the row): they share a document iff the doc at the k-tile's last
position equals the doc at the q-tile's first position (a run covering both covers the positions between).

Sliding-window layers add HF's window rule, i - j < window: a k-tile entirely inside the window of every query of
the q-tile stays full, one entirely outside it is skipped, the tiles the window's edge crosses are partial.

gpt-oss's attention sinks scale flex's output by sigmoid(lse - sink) (`with_sinks`): the same softmax over keys and
sink that HF's eager attention computes, without a dense mask.

Static buffers, no host sync: `DocCausalMask.update_(doc_ids)` rewrites doc ids and every BlockMask table IN PLACE,
so a CUDA graph captured over the target forward sees each new batch's documents on replay (same pattern as
trainer.model.flex.FlexBlockMask). The attention function is registered with HF's AttentionInterface under
ATTN_NAME; it uses flex only when handed a BlockMask and otherwise defers to HF's sdpa (the reference path).
"""
from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from trainer.model.flex import block_mask_tensors, tuned_options, use_tuned_options

ATTN_NAME = "doc_causal"  # must not contain "flash": HF treats such names as hub flash kernels
TILE = 128  # flex's kernel block


def doc_tile_states(doc_ids: torch.Tensor, tile: int = TILE,
                    window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """doc_ids [R, S] (S a multiple of tile) -> (partial, full) bool tile tables [R, 1, S/tile, S/tile].
    Pure, device-side, no sync."""
    r, s = doc_ids.shape
    n = s // tile
    tiles = doc_ids.view(r, n, tile)
    first, last = tiles[:, :, 0], tiles[:, :, -1]  # [R, n]
    uniform = first == last  # one run covers the whole tile
    qi = torch.arange(n, device=doc_ids.device)
    below = qi[None, :] < qi[:, None]  # [q, k]: k-tile strictly before q-tile
    shared = last[:, None, :] == first[:, :, None]  # [R, q, k]: the run at k's end reaches q's start
    gap = qi[:, None] - qi[None, :]  # [q, k] in tiles
    if window is None:
        inside, reached = below, below
    else:
        inside = below & (gap * tile + tile - 1 < window)  # the farthest pair of the two tiles is in the window
        reached = below & ((gap - 1) * tile + 1 < window)  # the nearest pair is
    full = inside & shared & uniform[:, None, :] & uniform[:, :, None]
    diag = torch.eye(n, dtype=torch.bool, device=doc_ids.device).expand(r, n, n)
    partial = (reached & shared & ~full) | diag
    return partial.unsqueeze(1), full.unsqueeze(1)


class DocCausalMask:
    """Static doc-id buffer + a BlockMask over it for rows of shape [rows, seq]; `update_` rewrites both in place.
    window: HF's sliding window (a query sees the `window` keys ending at itself), None for full attention."""

    def __init__(self, rows: int, seq: int, device: torch.device | str, tile: int = TILE,
                 window: int | None = None) -> None:
        if seq % tile:
            raise ValueError(f"DocCausalMask needs seq ({seq}) to be a multiple of the tile ({tile})")
        self.rows, self.seq, self.tile, self.window = rows, seq, tile, window
        self.doc_ids = torch.zeros(rows, seq, dtype=torch.int32, device=device)
        use_tuned_options(torch.device(device))
        tensors = block_mask_tensors(*doc_tile_states(self.doc_ids, tile, window))
        self.block_mask = BlockMask.from_kv_blocks(
            tensors["kv_num_blocks"], tensors["kv_indices"], tensors["full_kv_num_blocks"],
            tensors["full_kv_indices"], BLOCK_SIZE=tile, mask_mod=self._mask_mod(), seq_lengths=(seq, seq))

    def _mask_mod(self):
        doc = self.doc_ids  # the static buffer, read at kernel time
        window = self.window

        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (doc[b, q_idx] == doc[b, kv_idx])

        def sliding_mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (q_idx - kv_idx < window) & (doc[b, q_idx] == doc[b, kv_idx])

        return mask_mod if window is None else sliding_mask_mod

    def update_(self, doc_ids: torch.Tensor) -> BlockMask:
        """Write this batch's documents and tile tables in place; returns the (same) BlockMask. Capturable."""
        if tuple(doc_ids.shape) != (self.rows, self.seq):
            raise ValueError(f"DocCausalMask.update_: doc_ids {tuple(doc_ids.shape)}, expected {(self.rows, self.seq)}")
        self.doc_ids.copy_(doc_ids)
        tensors = block_mask_tensors(*doc_tile_states(self.doc_ids, self.tile, self.window))
        for name, t in tensors.items():
            getattr(self.block_mask, name).copy_(t)
        return self.block_mask


def doc_causal_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """HF attention-interface function. query [R, H, S, Dh], key/value [R, Hkv, S, Dh] -> ([R, S, H, Dh], None).

    A BlockMask -> flex (compiled on CUDA, the process-wide instance; plain flex inside an outer torch.compile and
    on CPU, where it is the reference math), with the layer's score soft cap (Gemma 2) or attention sinks (gpt-oss)
    when it has them. Anything else -> HF's own path for this model (sdpa; eager for soft-capped and sink families),
    unchanged.
    """
    sinks = kwargs.get("s_aux")
    if not isinstance(attention_mask, BlockMask):
        if kwargs.get("softcap") or sinks is not None:
            return _eager_of(module)(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                     **kwargs)
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    from trainer.model.flex import compiled_flex_attention

    use_compiled = query.is_cuda and not torch.compiler.is_compiling()
    fn = compiled_flex_attention() if use_compiled else flex_attention
    softcap = kwargs.get("softcap")
    out = fn(query, key, value, block_mask=attention_mask, scale=scaling, enable_gqa=query.shape[1] != key.shape[1],
             score_mod=_softcapped(softcap) if softcap else None, kernel_options=tuned_options("target", query),
             return_lse=sinks is not None)
    if sinks is not None:
        out = with_sinks(*out, sinks)
    return out.transpose(1, 2).contiguous(), None


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention sinks (gpt-oss) from flex's output over the real keys: one more logit per head, `sinks[h]`, in the
    softmax's denominator and with no value. softmax over [scores, sink] restricted to the keys is the keys' own
    softmax times exp(lse) / (exp(lse) + exp(sink)) = sigmoid(lse - sink). out [R, H, S, Dh], lse [R, H, S] (natural
    log), sinks [H]."""
    keep = torch.sigmoid(lse - sinks.float()[None, :, None])
    return (out.float() * keep[..., None]).to(out.dtype)


_SOFTCAPS: dict[float, object] = {}


def _softcapped(cap: float):
    """Gemma 2's attention-score soft cap as a flex score_mod; one function per cap value, so the compiled kernel
    is not rebuilt per call."""
    if cap not in _SOFTCAPS:
        def score_mod(score, b, h, q_idx, kv_idx):
            return cap * torch.tanh(score / cap)

        _SOFTCAPS[cap] = score_mod
    return _SOFTCAPS[cap]


def _eager_of(module):
    """The eager attention function of the module's own modeling file (soft-capped families define their own)."""
    import sys

    return sys.modules[type(module).__module__].eager_attention_forward


def use_doc_causal_attention(model) -> None:
    """Register ATTN_NAME with HF (idempotent) and switch `model` to it (the layers read config._attn_implementation
    at every forward). Some transformers versions vet names in set_attn_implementation against their own list or
    only warn: then the config attribute is set directly; anything else is an error."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, doc_causal_attention)
    try:
        model.set_attn_implementation(ATTN_NAME)
    except Exception:  # noqa: BLE001 -- version-specific vetting; the attribute checked below is what layers read
        pass
    if model.config._attn_implementation != ATTN_NAME:
        model.config._attn_implementation = ATTN_NAME
    if model.config._attn_implementation != ATTN_NAME:
        raise RuntimeError(f"could not switch the target to the {ATTN_NAME} attention implementation")
