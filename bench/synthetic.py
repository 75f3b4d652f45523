"""Synthetic micro-batches at the bench shape, built by the trainer's own data code (pure given the seed).

Random token ids, a few documents per row packed by `trainer.data.packing.pack` (rows filled exactly, no padding,
positions restarting per document), anchors drawn by `EpochBatches` / `sample_anchors` (sorted, all valid when every
row has >= anchors candidates). So the packed masks of the target and the drafter are exercised as in training.
"""
from __future__ import annotations

import torch

from trainer.data.batching import EpochBatches, StaticBatch
from trainer.data.packing import pack
from trainer.data.source import Sample


def doc_lengths(seq: int, docs: int, gen: torch.Generator) -> list[int]:
    """`docs` random lengths (each >= seq // (3 * docs)) summing to exactly seq."""
    share = torch.rand(docs, generator=gen) + 0.5
    lengths = (share / share.sum() * seq).floor().long().tolist()
    lengths[-1] = seq - sum(lengths[:-1])
    return lengths


def synthetic_batches(n: int, rows: int, seq: int, anchors: int, vocab: int, *, seed: int,
                      docs_per_row: int = 3) -> list[StaticBatch]:
    """n micro-batches of [rows, seq] on the CPU (int64/bool fields, as EpochBatches yields them)."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(n * rows):
        for length in doc_lengths(seq, docs_per_row, gen):
            ids = torch.randint(0, vocab, (length,), generator=gen)
            samples.append(Sample(input_ids=ids, loss_mask=torch.ones(length, dtype=torch.bool)))
    packed = pack(samples, seq, pad_id=0)
    assert packed.num_rows == n * rows, "rows are filled exactly, one row per docs_per_row samples"
    batches = EpochBatches(packed, rows, anchors, seed, pad_id=0)
    return [batches.batch(m) for m in range(n)]


def target_pairs(batch: StaticBatch, window: int | None = None) -> float:
    """Causal query-key pairs inside documents (padding excluded): a token at document position p sees p + 1 keys,
    at most `window` of them in a sliding-window layer."""
    seen = batch.position_ids + 1
    if window is not None:
        seen = seen.clamp(max=window)
    return float((seen * (batch.doc_ids >= 0)).sum())


def draft_pairs(batch: StaticBatch, block: int) -> float:
    """Query-key pairs the drafter's block mask allows (trainer.model.attention.dense_block_mask, counted in closed
    form): each of an anchor's `block` queries sees its own block, plus, for a valid anchor, the anchor's document
    position p context keys (the document's tokens strictly before it)."""
    rows, n = batch.anchor_pos.shape
    ctx = (batch.position_ids.gather(1, batch.anchor_pos) * batch.anchor_valid).sum()
    return float(block * ctx + rows * n * block * block)
