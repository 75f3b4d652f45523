"""A sliding-window layer's ring cache (`trainer.decode.layers.ring`): the ring's slot and mask rule against a full
cache with slot = position, over random forwards (prefill chunks longer than the ring, padding, verifies with
rejected drafts, rows that start over on stale rings); batch generation (equal rows and refilled ones) and
speculative decoding with rollback over rings equal HF's greedy answers; the ring layers' caches hold window +
block + 1 slots, and the regen memory estimate counts exactly what the engine allocates. Real tiny models
(tests/trainer/families.py: window 4), sharpened so that a wrong key changes the tokens."""
from __future__ import annotations

import json

import pytest
import torch

from tests.trainer.decode.test_generate import prompts_of
from tests.trainer.decode.test_reference import PROMPTS, _drafter, _prompt_ids
from tests.trainer.decode.test_static_decode import assert_lossless_on
from tests.trainer.decode.test_static_families import sharp_target
from tests.trainer.families import WINDOW
from trainer.decode.engine import StaticDecoder
from trainer.decode.generate import BatchGenerator, Sampling, hf_generate
from trainer.decode.layers.attention import visible_masks
from trainer.decode.layers.ring import ring_positions, ring_size, ring_slots, ring_visible
from trainer.decode.stack import StaticTarget
from trainer.decode.static_draft import StaticDFlashProposer
from trainer.model.attention import SLIDING
from trainer.model.target import load_target
from trainer.regen import memory


# ---------------------------------------------------------------- the rule (pure)

def _forward_shape(g: torch.Generator, rows: int, W: int, block: int) -> tuple[int, list[int], list[int], list[bool]]:
    """One random forward: L tokens; per row the index of its last real token, how many tokens it commits (at
    most `block` real ones rejected, as a verify may) and whether it starts over at position 0."""
    L = int(torch.randint(1, 3 * W + 2, (), generator=g)) if torch.rand((), generator=g) < 0.4 else \
        int(torch.randint(1, block + 1, (), generator=g))
    last = [int(torch.randint(0, L, (), generator=g)) for _ in range(rows)]
    commit = [int(torch.randint(max(1, n + 1 - block), n + 2, (), generator=g)) for n in last]
    restart = [bool(torch.rand((), generator=g) < 0.1) for _ in range(rows)]
    return L, last, commit, restart


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("per_row", [True, False], ids=["per-row positions", "shared positions"])
def test_the_ring_shows_each_query_what_a_full_cache_shows(per_row, seed):
    """Each written K/V is a unique tag. Over 60 forwards, every real query sees in the ring (and the forward's new
    keys) exactly the (position, tag) pairs a full cache with slot = position shows it: the latest committed write
    of each position in its window. Shared positions: one row, its last real index a [1] tensor (a prefill's
    logits_at); per-row: three rows at their own positions."""
    g = torch.Generator().manual_seed(seed)
    window = int(torch.randint(1, 9, (), generator=g))
    block = int(torch.randint(1, 6, (), generator=g))
    W, rows = window + block, 3 if per_row else 1
    ring = torch.randint(-10 ** 6, -1, (rows, W + 1), generator=g)  # stale tags: never a visible key's
    full: list[dict[int, int]] = [{} for _ in range(rows)]  # position -> the tag written there last
    p0 = [0] * rows
    tag, wrapped = 0, False
    for _ in range(60):
        L, last, commit, restart = _forward_shape(g, rows, W, block)
        for r in range(rows):
            if restart[r]:
                p0[r], full[r] = 0, {}
        pos = torch.tensor(p0)[:, None] + torch.arange(L)  # [R, L]
        new = torch.arange(tag, tag + rows * L).view(rows, L)
        tag += rows * L
        if per_row:
            visible, slots = ring_visible(pos, W, window), ring_slots(pos, W, torch.tensor(last))
        else:
            visible, slots = ring_visible(pos[0], W, window), ring_slots(pos[0], W, torch.tensor(last))[None]
        held = ring_positions(pos[:, :1], W)  # [R, W]
        for r in range(rows):
            keys = list(zip(held[r].tolist(), ring[r, :W].tolist())) + list(zip(pos[r].tolist(), new[r].tolist()))
            for i in range(last[r] + 1):
                q = p0[r] + i
                got = {keys[c] for c in visible[min(r, visible.shape[0] - 1), 0, i].nonzero().view(-1).tolist()}
                want = {(k, full[r][k]) for k in range(max(0, q - window + 1), p0[r])} | \
                    {(k, t) for k, t in zip(pos[r, :i + 1].tolist(), new[r, :i + 1].tolist()) if k > q - window}
                assert got == want, (r, q)
            kept = slots[r][slots[r] < W]
            assert len(set(kept.tolist())) == len(kept)  # only the trash slot is written twice (any order)
            for j in range(L):
                ring[r, slots[r, j]] = new[r, j]
                full[r][p0[r] + j] = int(new[r, j])  # the full cache writes padding too, as the engine does
            wrapped |= p0[r] + last[r] >= 2 * W
            p0[r] += commit[r]
    assert wrapped  # the rings went round


@pytest.mark.parametrize("seed", range(4))
def test_the_ring_mask_is_visible_masks_rule_over_positions(seed):
    """The same positions are visible as through `visible_masks`' sliding rule over a full cache: per-row positions,
    and shared positions of a left-padded batch (a query sees nothing before its row's start, a padding query
    itself)."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(20):
        window, block = int(torch.randint(1, 9, (), generator=g)), int(torch.randint(1, 6, (), generator=g))
        W, L = window + block, int(torch.randint(1, 20, (), generator=g))
        p0 = torch.randint(0, 40, (3, 1), generator=g)
        row_start = torch.randint(0, 50, (3,), generator=g)
        for pos, start in ((p0 + torch.arange(L), None), (p0[0] + torch.arange(L), row_start)):
            span = int(pos.max()) + 1
            want = visible_masks(torch.arange(span), pos, span, start, window)[SLIDING][:, 0]  # [R, L, span]
            got = ring_visible(pos, W, window, start)[:, 0]  # [R, L, W + L]
            at = pos if pos.dim() == 2 else pos[None]
            keys = torch.cat([ring_positions(at[:, :1], W), at], 1)  # [R or 1, W + L]
            for r in range(want.shape[0]):
                k = keys[min(r, keys.shape[0] - 1)]
                for i in range(L):
                    assert set(k[got[r, i]].tolist()) == set(want[r, i].nonzero().view(-1).tolist()), (r, i)


def test_a_ring_only_where_it_is_smaller():
    assert ring_size(None, 4, 100) is None
    assert ring_size(128, 16, 145) is None and ring_size(128, 16, 146) == 144


def test_padding_and_all_but_the_last_ring_of_real_tokens_go_to_the_trash():
    pos = torch.arange(10, 20)
    assert ring_slots(pos, 4).tolist() == [4] * 6 + [0, 1, 2, 3]
    assert ring_slots(pos, 4, torch.tensor([6])).tolist() == [4] * 3 + [1, 2, 3, 0] + [4] * 3
    per_row = torch.stack([pos, pos + 1])
    assert ring_slots(per_row, 4, torch.tensor([1, 9])).tolist() == [[2, 3] + [4] * 8, [4] * 6 + [1, 2, 3, 0]]


# ---------------------------------------------------------------- the engine over rings

LONG = (13, 29, 8, 21, 17, 6, 25)  # prompts of 1.2 to 6 rings (window 4 + block 1)


@pytest.mark.parametrize("family", ["gpt_oss", "gemma3", "mistral"])
def test_batch_generation_over_rings_equals_hf_and_the_full_cache(family, family_dirs, monkeypatch):
    """Seven prompts longer than the ring, 24 new tokens each: in one batch of seven rows (one prefill chunk of 32
    with padding), refilled through three rows (prefill chunks of 16: a chunk at 16 reads the ring the first one
    left), and through three rows with full caches, every answer is HF `generate`'s."""
    from trainer.decode import prefill_plan

    target = sharp_target(family_dirs, family)
    prompts = prompts_of(target, LONG, seed=5)
    sampling = Sampling(max_new_tokens=24)
    want = hf_generate(target.model, prompts, sampling, [], target.tokenizer.pad_token_id)
    assert len({tuple(a) for a in want}) == len(want)  # the answers differ: the test can tell rows apart
    batch = BatchGenerator(target, rows=len(prompts), max_len=64, stop_ids=[])
    assert batch.static.ring == WINDOW + 1
    assert batch.generate(prompts, sampling) == want
    monkeypatch.setattr(prefill_plan, "PREFILL_CHUNK", 16)
    refilled = BatchGenerator(target, rows=3, max_len=64, stop_ids=[])
    assert dict(refilled.generate_stream(prompts, sampling)) == dict(enumerate(want)) and refilled.refilled >= 4
    full = BatchGenerator(target, rows=3, max_len=64, stop_ids=[], ring=False)
    assert full.static.ring is None and full.generate(prompts, sampling) == want


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_speculative_decoding_over_rings_equals_the_target_alone(family, family_dirs):
    """Sliding-window targets (Mistral: every layer; Gemma 2: alternating, soft-capped, eager attention) through the
    static decoder with blocks of 4 (rings of 8 slots + trash): target-only, a DFlash drafter, a table drafter wrong
    at block position 3 (every round rejects a draft: rollback) and a perfect one all give HF's greedy tokens."""
    target = sharp_target(family_dirs, family)
    B, new = 4, 30
    decoder = StaticDecoder(target, 96, StaticDFlashProposer(target, _drafter(target), B, 96), B)
    for text in PROMPTS[:2]:
        assert_lossless_on(target, decoder, _prompt_ids(target, text), new)
    assert decoder.static.ring == WINDOW + B


# ---------------------------------------------------------------- the cache's size

def test_ring_layers_hold_window_plus_block_slots(family_dirs):
    target = load_target(family_dirs["gpt_oss"], num_draft_layers=2, layer_ids=(1, 3), truncate=False)
    static = StaticTarget(target, slots=64, block=4)
    assert [k.shape[2] for k in static.k] == [WINDOW + 4 + 1 if kind == SLIDING else 64 for kind in static.kinds]
    assert [v.shape for v in static.v] == [k.shape for k in static.k] and SLIDING in static.kinds
    tight = StaticTarget(target, slots=WINDOW + 4 + 1, block=4)  # a ring would be no smaller
    assert tight.ring is None and {k.shape[2] for k in tight.k} == {WINDOW + 4 + 1}


@pytest.mark.parametrize("family", ["gpt_oss", "mistral", "qwen2", "gemma3", "qwen3"])
def test_the_memory_estimate_counts_what_the_engine_allocates(family, family_dirs):
    """regen's per-row cache estimate from config.json equals the batch generator's K/V bytes per row: rings for
    the sliding layers (Mistral's config.json names no layer_types: every layer slides), every slot for the
    others."""
    target = load_target(family_dirs[family], num_draft_layers=2, layer_ids=(1, 3), truncate=False)
    config = json.loads((family_dirs[family] / "config.json").read_text())
    gen = BatchGenerator(target, rows=2, max_len=64, stop_ids=[])
    allocated = sum(t.numel() * t.element_size() for t in gen.static.k + gen.static.v if t is not None) // 2
    size = target.embed_tokens.weight.element_size()
    assert memory.row_bytes(config, 64, 1, size)["cache"] == allocated
    assert (gen.static.ring is not None) == (family != "qwen3")
