"""Static-cache decoding equals the HF DynamicCache reference (`trainer.decode.reference`), token for token.

Real components only: the session's tiny Qwen3 target (saved to disk, loaded through `load_target`), a real `Drafter`,
and a table proposer holding the target's own greedy output (a perfect drafter) or a corrupted copy of it.
"""
from __future__ import annotations

import pytest
import torch

from tests.trainer.decode.test_reference import PROMPTS, _drafter, _prompt_ids
from trainer.decode.engine import StaticDecoder, prefill_buckets
from trainer.decode.static_draft import StaticDFlashProposer, TableProposer
from trainer.decode.stack import StaticTarget
from trainer.decode.rounds import acceptance_stats
from trainer.decode.reference import (DFlashProposer, DraftContextCache, draft_block_hidden,
                                 generate_speculative, generate_target_only, new_cache, target_forward)


def test_static_forward_equals_hf_cache_forward(full_target):
    """Prefill then two incremental chunks: logits and tapped features equal HF's forward with a DynamicCache, and a
    chunk re-run at an earlier position (stale slots beyond it) still equals HF's cropped cache."""
    ids = torch.tensor([_prompt_ids(full_target, PROMPTS[1])])
    static = StaticTarget(full_target, slots=64)
    cache = new_cache(full_target)
    P = ids.shape[1]
    chunks = [(ids, 0), (torch.tensor([[5, 9, 11]]), P), (torch.tensor([[7]]), P + 3)]
    for chunk, pos in chunks:
        want_logits, want_feats = target_forward(full_target, chunk, cache, pos)
        got_logits, got_feats = static.forward(chunk, torch.tensor(pos))
        torch.testing.assert_close(got_logits, want_logits.float(), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got_feats, want_feats, rtol=1e-4, atol=1e-4)
    from trainer.decode.reference import crop_cache

    crop_cache(cache, P + 1)  # reject two of the three chunk tokens; static slots P+1.. keep stale K/V
    redo = torch.tensor([[3, 4]])
    want_logits, _ = target_forward(full_target, redo, cache, P + 1)
    got_logits, _ = static.forward(redo, torch.tensor(P + 1))
    torch.testing.assert_close(got_logits, want_logits.float(), rtol=1e-4, atol=1e-4)


def test_static_draft_equals_reference_draft(full_target):
    """The drafter over its static context cache == `draft_block_hidden` over the exact context, also when slots at and
    beyond the anchor hold stale features."""
    B, S = 4, 9
    drafter = _drafter(full_target, seed=3)
    T_D = len(full_target.layer_ids) * full_target.hf_config.hidden_size
    torch.manual_seed(1)
    feats = torch.randn(1, S + B, T_D)
    anchor = torch.tensor([17])
    block = full_target.embed_tokens(torch.cat([anchor, torch.full((B - 1,), full_target.mask_token_id)]))[None]
    want = draft_block_hidden(drafter, DraftContextCache(len(drafter.layers)), feats[:, :S], block)
    proposer = StaticDFlashProposer(full_target, drafter, B, slots=32)
    proposer.reset(feats[:, :5])
    proposer.append(feats[:, 5:5 + B], torch.tensor(5))  # slots 5..8 real context
    # Stale context beyond the block (slots S+B..): the draft at start S writes only S..S+B-1, so these stay and
    # must stay invisible.
    proposer.append(feats[:, S:S + B] * 3, torch.tensor(S + B))
    got = proposer.draft_hidden(anchor, torch.tensor(S))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_static_draft_under_bf16_autocast_equals_reference(full_target):
    """The CUDA arithmetic (bf16 autocast, bf16 copies of the linears, bf16 K/V cache) checked on CPU's autocast:
    equal to the reference draft under the same autocast within bf16 rounding."""
    B, S = 4, 9
    drafter = _sharp_drafter(full_target, seed=4)
    T_D = len(full_target.layer_ids) * full_target.hf_config.hidden_size
    torch.manual_seed(2)
    feats = torch.randn(1, S, T_D)
    anchor = torch.tensor([17])
    block = full_target.embed_tokens(torch.cat([anchor, torch.full((B - 1,), full_target.mask_token_id)]))[None]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = draft_block_hidden(drafter, DraftContextCache(len(drafter.layers)), feats, block)
    proposer = StaticDFlashProposer(full_target, drafter, B, slots=32, autocast=True)
    assert proposer.drafter.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    assert drafter.layers[0].self_attn.q_proj.weight.dtype == torch.float32  # the trained drafter is untouched
    proposer.reset(feats)
    got = proposer.draft_hidden(anchor, torch.tensor(S))
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=0.03, atol=0.05)


@pytest.mark.parametrize("graphs", [True, False])  # on CPU both run eagerly; the flag must not matter there
def test_target_only_equals_hf_greedy(full_target, graphs):
    decoder = StaticDecoder(full_target, capacity=128, graphs=graphs)
    for text in PROMPTS:
        ids = _prompt_ids(full_target, text)
        assert decoder.generate_target_only(ids, 23) == generate_target_only(full_target, ids, 23)


def _sharp_drafter(target, seed: int):
    """A random drafter whose drafts depend on its context (linear weights ~N(0, 0.3); at the usual 0.02 init every
    draft is the same token whatever the context, and a broken context cache would go unnoticed)."""
    drafter = _drafter(target, seed=seed)
    with torch.no_grad():
        for module in drafter.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.normal_(0.0, 0.3)
    return drafter


class RecordingProposer(DFlashProposer):
    """The reference proposer, keeping every round's drafts."""

    def __init__(self, *args):
        super().__init__(*args)
        self.drafts: list[list[int]] = []

    def propose(self, new_feats, committed):
        draft = super().propose(new_feats, committed)
        self.drafts.append(draft.tolist())
        return draft


@pytest.mark.parametrize("block_size", [2, 5, 16])
def test_speculative_equals_reference_round_by_round(full_target, block_size):
    """Same drafter weights: every round drafts the same tokens and accepts the same count as the HF reference
    (so the context cache and its append are exercised: the drafts depend on them); both outputs equal target-only
    greedy decoding."""
    drafter = _sharp_drafter(full_target, seed=5)
    proposer = StaticDFlashProposer(full_target, drafter, block_size, slots=128)
    decoder = StaticDecoder(full_target, capacity=128, proposer=proposer, block_size=block_size)
    distinct = set()
    for text in PROMPTS:
        ids = _prompt_ids(full_target, text)
        for max_new in (1, 7, 23):
            reference = RecordingProposer(full_target, drafter, block_size)
            want = generate_speculative(full_target, reference, ids, max_new)
            drafts: list[list[int]] = []
            got = decoder.generate_speculative(ids, max_new, drafts=drafts)
            assert got == want, (text, max_new)
            assert drafts == reference.drafts, (text, max_new)
            assert got.tokens == decoder.generate_target_only(ids, max_new)
            distinct.update(tuple(d) for d in drafts)
    assert len(distinct) > 3  # the drafts really vary with the context


def test_a_context_cache_that_misses_appends_is_caught(full_target):
    """Guard for the test above: a proposer whose append does nothing drafts differently from the reference."""
    drafter = _sharp_drafter(full_target, seed=5)
    proposer = StaticDFlashProposer(full_target, drafter, 4, slots=128)
    proposer._append_fn = lambda feats, start: None
    decoder = StaticDecoder(full_target, capacity=128, proposer=proposer, block_size=4)
    ids = _prompt_ids(full_target, PROMPTS[0])
    reference = RecordingProposer(full_target, drafter, 4)
    generate_speculative(full_target, reference, ids, 23)
    drafts: list[list[int]] = []
    decoder.generate_speculative(ids, 23, drafts=drafts)
    assert drafts != reference.drafts


def test_perfect_table_drafter_reaches_tau_equal_block_size(full_target):
    """Drafting from the target's own greedy output accepts every draft: tau = B, one round per B new tokens."""
    for block_size in (4, 16):
        results = []
        for text in PROMPTS:
            ids = _prompt_ids(full_target, text)
            greedy = generate_target_only(full_target, ids, 37 + block_size)  # the last round drafts past 37
            table = torch.tensor(ids + greedy)
            decoder = StaticDecoder(full_target, capacity=128, proposer=TableProposer(table, block_size),
                                    block_size=block_size)
            got = decoder.generate_speculative(ids, 37)
            assert got.tokens == greedy[:37]
            results.append(got)
        stats = acceptance_stats(results, block_size)
        assert stats["tau"] == block_size and stats["accept_by_pos"] == [1.0] * (block_size - 1)
        assert stats["rounds"] == len(PROMPTS) * -(-(37 - 1) // block_size)


def test_table_drafter_wrong_at_one_position_accepts_exactly_before_it(full_target):
    """A table drafter whose every k-th draft is wrong: each round accepts exactly k - 1 (bonus bookkeeping, stale
    cache slots from the rejected tail, and the anchor hand-over are all exercised every round)."""
    B, k = 8, 3
    for text in PROMPTS:
        ids = _prompt_ids(full_target, text)
        greedy = generate_target_only(full_target, ids, 30 + B)
        seq = ids + greedy
        proposer = _WrongAt(torch.tensor(seq), B, k, full_target.embed_tokens.weight.shape[0])
        decoder = StaticDecoder(full_target, capacity=128, proposer=proposer, block_size=B)
        got = decoder.generate_speculative(ids, 30)
        assert got.tokens == greedy[:30]
        assert set(got.accepted) == {k - 1}


class _WrongAt(TableProposer):
    """The perfect table drafter with draft position k (1-based) replaced by another token."""

    def __init__(self, table, block_size, k, vocab):
        super().__init__(table, block_size)
        self.k, self.vocab = k, vocab

    def draft(self, anchor, start):
        d = super().draft(anchor, start).clone()
        d[self.k - 1] = (d[self.k - 1] + 1) % self.vocab
        return d


def assert_lossless_on(target, decoder: StaticDecoder, ids: list[int], new: int) -> None:
    """`decoder` (a static decoder over `target` with a drafter) against HF's greedy decoding of prompt `ids`:
    target-only and speculative equal it, and so do a table drafter wrong at block position 3 (every round accepts
    exactly 2: rollback) and a perfect one (every round accepts all B - 1)."""
    B = decoder.block_size
    want = generate_target_only(target, ids, new)
    assert decoder.generate_target_only(ids, new) == want
    assert decoder.generate_speculative(ids, new).tokens == want
    table = torch.tensor(ids + generate_target_only(target, ids, new + B))
    vocab = target.embed_tokens.weight.shape[0]
    wrong = StaticDecoder(target, decoder.capacity, _WrongAt(table, B, 3, vocab), B).generate_speculative(ids, new)
    assert wrong.tokens == want and set(wrong.accepted[:-1]) == {2}
    perfect = StaticDecoder(target, decoder.capacity, TableProposer(table, B), B).generate_speculative(ids, new)
    assert perfect.tokens == want and set(perfect.accepted[:-1]) == {B - 1}


def test_eos_stops_inside_a_round(full_target):
    ids = _prompt_ids(full_target, PROMPTS[0])
    free = generate_target_only(full_target, ids, 30)
    eos = free[6]
    want = free[:free.index(eos) + 1]
    table = torch.tensor(ids + free + [0] * 16)
    decoder = StaticDecoder(full_target, capacity=128, proposer=TableProposer(table, 16), block_size=16)
    assert decoder.generate_speculative(ids, 30, stops=(eos,)).tokens == want
    assert decoder.generate_target_only(ids, 30, stops=(eos,)) == want


def test_prefill_buckets_cover_every_prompt_that_fits():
    assert prefill_buckets(144) == [16, 32, 64, 128, 144]
    assert prefill_buckets(16) == [16] and prefill_buckets(10) == [10]


@pytest.mark.parametrize("block_size", [None, 4])
def test_padded_prefill_is_independent_of_the_bucket_and_its_leftovers(full_target, block_size):
    """Prompts are padded up to their prefill bucket, over whatever the last prompt left in it. Lengths 1, a bucket's
    exact size and one past it, each after a longer prompt of the same bucket: every output equals HF's greedy
    decoding (target-only) and the target-only output (speculative, with a real drafter)."""
    proposer = None if block_size is None else StaticDFlashProposer(full_target, _drafter(full_target), block_size, 128)
    decoder = StaticDecoder(full_target, capacity=128, proposer=proposer, block_size=block_size or 16)
    assert decoder.prefill.buckets == [16, 32, 64, 128, 128 + (block_size or 16)]
    torch.manual_seed(5)
    vocab = full_target.embed_tokens.weight.shape[0] - 1
    for length in (1, 16, 17, 31, 32, 33):
        junk = torch.randint(0, vocab, (max(length, 32) if length <= 32 else 64,)).tolist()
        decoder.generate_target_only(junk, 3)  # fills the bucket with other tokens
        ids = torch.randint(0, vocab, (length,)).tolist()
        want = generate_target_only(full_target, ids, 9)
        assert decoder.generate_target_only(ids, 9) == want, length
        if proposer is not None:
            decoder.generate_speculative(junk, 3)
            assert decoder.generate_speculative(ids, 9).tokens == want, length


def test_capacity_is_checked_before_any_work(full_target):
    decoder = StaticDecoder(full_target, capacity=16)
    with pytest.raises(ValueError, match="capacity"):
        decoder.generate_target_only(list(range(10)), 7)


def test_mismatched_proposer_is_refused(full_target):
    drafter = _drafter(full_target)
    with pytest.raises(ValueError, match="block_size"):
        StaticDecoder(full_target, 64, StaticDFlashProposer(full_target, drafter, 8, 64), block_size=16)
    with pytest.raises(ValueError, match="caches hold 32"):
        StaticDecoder(full_target, 64, StaticDFlashProposer(full_target, drafter, 16, 32), block_size=16)


def test_a_failing_compilation_falls_back_to_the_uncompiled_engine(full_target, monkeypatch):
    """Compiling is an optimisation: if the compiler raises while the graphs are built, decoding goes on uncompiled
    and says so in one line."""
    from trainer.decode.decoders import capacity_for, decoders

    def broken(self):
        raise RuntimeError("inductor exploded\nsecond line")

    monkeypatch.setattr(StaticDFlashProposer, "compile", broken)
    notes: list[str] = []
    ids = _prompt_ids(full_target, PROMPTS[0])
    target_only, speculative, compiled, attention, _norms = decoders(full_target, _drafter(full_target), 4,
                                                                     capacity_for([ids], 9), compile="drafter",
                                                                     log=notes.append)
    assert compiled == "none" and attention == "sdpa"  # what is reported is what ran
    assert len(notes) == 1 and "compile=drafter failed (RuntimeError: inductor exploded)" in notes[0]
    assert speculative(ids, 9).tokens == target_only(ids, 9) == generate_target_only(full_target, ids, 9)
    with pytest.raises(ValueError, match="compile must be"):
        StaticDecoder(full_target, 64, compile="yes")


def test_row_invariant_rmsnorm_falls_back_to_the_hf_module_off_cuda():
    """On CPU (outside the kernel tests' interpreter) the HF module itself runs: the CPU engine stays HF's arithmetic
    exactly."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from trainer.decode.kernels import RowInvariantRMSNorm

    module = Qwen3RMSNorm(32, eps=1e-6)
    module.weight.data.normal_(1.0, 0.2)
    norm = RowInvariantRMSNorm(module)
    x = torch.randn(3, 5, 32)
    assert not norm.uses_kernel(x)
    assert torch.equal(norm(x), module(x))
    assert norm.eps == 1e-6


def test_invariant_attention_where_the_kernel_cannot_run_says_so(full_target):
    """Invariant attention on CPU (no interpreter): SDPA decodes, the note says so, and the decoders report
    "sdpa"."""
    from trainer.decode.decoders import capacity_for, decoders

    notes: list[str] = []
    ids = _prompt_ids(full_target, PROMPTS[0])
    made = decoders(full_target, _drafter(full_target), 4, capacity_for([ids], 5), invariant=True,
                    log=notes.append)
    assert made.attention == "sdpa" and made.compile == "none"
    assert len(notes) == 1 and "invariant attention" in notes[0] and "SDPA" in notes[0]
    assert made.speculative(ids, 5).tokens == made.target_only(ids, 5)
