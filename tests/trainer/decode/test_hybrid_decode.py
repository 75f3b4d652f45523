"""Hybrid targets (Qwen3.5 dense, Qwen3-Next and Qwen3.5-MoE with MoE MLPs) through the static engine
(`stack.StaticTarget` with its Gated DeltaNet layers): its forward against HF's forward, greedy decoding, target-only
and speculative, token for token against the HF-cache reference -- the speculative rounds keeping the recurrent state
of the accepted prefix with one target forward per round --, and batched generation against HF `generate`."""
from __future__ import annotations

import pytest
import torch

from tests.trainer.decode.test_reference import PROMPTS, _drafter, _prompt_ids
from tests.trainer.decode.test_static_decode import _WrongAt
from tests.trainer.families import build_family_target
from trainer.decode.decoders import decoders, engine_for
from trainer.decode.engine import StaticDecoder
from trainer.decode.generate import BatchGenerator, Sampling, hf_generate
from trainer.decode.layers.moe import MoeMLP
from trainer.decode.reference import DFlashProposer, generate_speculative, generate_target_only
from trainer.decode.stack import StaticTarget
from trainer.decode.static_draft import StaticDFlashProposer, TableProposer
from trainer.model.target import load_target

FAMILIES = ("qwen3_5", "qwen3_next", "qwen3_5_moe")


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrids")
    return {f: load_target(build_family_target(root / f, f), num_draft_layers=2, layer_ids=(1, 3), truncate=False)
            for f in FAMILIES}


def hf_logits(target, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return target.model(input_ids=ids).logits.float()


@pytest.mark.parametrize("family", FAMILIES)
def test_static_forward_verify_and_commit_equal_hfs_forward(targets, family):
    target = targets[family]
    ids = torch.tensor([_prompt_ids(target, PROMPTS[0])])
    P = ids.shape[1]
    block = torch.tensor([[5, 9, 11, 13]])
    nxt = torch.tensor([[17]])
    static = StaticTarget(target, slots=64, block=4)
    assert isinstance(static.mlps[1], MoeMLP) == (family != "qwen3_5")  # MoE MLPs through the stack's layer
    zero = torch.zeros((), dtype=torch.long)
    logits, feats = static.forward(ids, zero)
    want = hf_logits(target, ids)
    torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)
    assert feats.shape == (1, P, 2 * target.hf_config.hidden_size)

    verified, _ = static.forward(block, zero + P, verify=True)
    torch.testing.assert_close(verified, hf_logits(target, torch.cat([ids, block], 1))[:, P:], atol=1e-4, rtol=1e-4)
    static.commit(torch.tensor([2]))  # the state of prompt + block[:2]; block[2:]'s K/V are stale slots
    stepped, _ = static.forward(nxt, zero + P + 2, want_features=False)
    want = hf_logits(target, torch.cat([ids, block[:, :2], nxt], 1))[:, -1:]
    torch.testing.assert_close(stepped, want, atol=1e-4, rtol=1e-4)
    # a new prompt from position 0 starts the recurrent states afresh
    again, _ = static.forward(ids, zero)
    torch.testing.assert_close(again, hf_logits(target, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_target_only_and_speculative_equal_hfs_greedy_decoding(targets, family):
    target = targets[family]
    vocab = target.embed_tokens.weight.shape[0]
    block_size, new = 5, 23
    for text in PROMPTS[:2]:
        ids = _prompt_ids(target, text)
        want = generate_target_only(target, ids, new)
        greedy = generate_target_only(target, ids, new + block_size)  # the last round drafts past `new`
        table = torch.tensor(ids + greedy)
        plain = StaticDecoder(target, capacity=64, graphs=False)
        assert plain.generate_target_only(ids, new) == want, (family, text)
        perfect = StaticDecoder(target, 64, TableProposer(table, block_size), block_size, graphs=False)
        got = perfect.generate_speculative(ids, new)
        assert got.tokens == want and set(got.accepted[:-1]) == {block_size - 1}, (family, text, got.accepted)
        wrong = StaticDecoder(target, 64, _WrongAt(table, block_size, 3, vocab), block_size, graphs=False)
        forwards = []  # the target's forwards (the table proposer embeds nothing)
        handle = target.embed_tokens.register_forward_hook(lambda *args: forwards.append(1))
        try:
            got = wrong.generate_speculative(ids, new)
        finally:
            handle.remove()
        assert got.tokens == want and set(got.accepted) == {2}, (family, text, got.accepted)
        assert len(forwards) == 1 + len(got.accepted)  # the prefill, then one verify per round: no second forward
        drafter = StaticDFlashProposer(target, _drafter(target), block_size, slots=64 + block_size)
        got = StaticDecoder(target, 64, drafter, block_size, graphs=False).generate_speculative(ids, new)
        assert got.tokens == want, (family, text)


def test_the_decoders_for_a_hybrid_equal_the_hf_engines(targets):
    drafter = _drafter(target := targets["qwen3_5"])
    made = decoders(target, drafter, 4, capacity=64)
    assert (made.compile, made.attention, made.norms) == ("none", "sdpa", "hf")
    ids = _prompt_ids(target, PROMPTS[1])
    want = generate_speculative(target, DFlashProposer(target, drafter, 4), ids, 20)
    assert made.target_only(ids, 20) == want.tokens == generate_target_only(target, ids, 20)
    got = made.speculative(ids, 20)
    assert got.tokens == want.tokens and got.accepted == want.accepted  # the same drafter proposes the same blocks


def test_decoders_keep_every_hybrid_on_the_static_engine(targets):
    """`decoders.engine_for` keeps the static engine for every hybrid, dense or MoE, with no note; `decoders.decoders`
    builds them uncompiled, one note saying compile/invariant do not apply."""
    notes: list[str] = []
    for family in FAMILIES:
        assert engine_for("static", targets[family], notes.append) == "static", family
    assert notes == []
    target = targets["qwen3_next"]
    made = decoders(target, _drafter(target), 4, 64, compile="drafter", invariant=True, log=notes.append)
    assert (made.compile, made.attention, made.norms) == ("none", "sdpa", "hf")
    assert notes == ["note: a hybrid target decodes uncompiled, with SDPA attention "
                     "(compile=drafter, invariant not applied)"]
    ids = _prompt_ids(target, PROMPTS[0])
    assert made.speculative(ids, 12).tokens == made.target_only(ids, 12) == generate_target_only(target, ids, 12)
    notes.clear()
    decoders(target, _drafter(target), 4, 64, log=notes.append)
    assert notes == []


@pytest.mark.parametrize("family", FAMILIES)
def test_a_batch_of_different_prompt_lengths_equals_hf_generate(targets, family):
    """Left-padded rows: each row's padding enters the linear layers as zeros and attention skips it, so every row
    continues as HF's generate (its own left padding and mask) continues it."""
    target = targets[family]
    prompts = [_prompt_ids(target, text) for text in PROMPTS[:3]]
    prompts[0], prompts[1] = prompts[0] + prompts[2], prompts[1][:5]  # lengths far apart
    assert len({len(p) for p in prompts}) == 3
    sampling = Sampling(max_new_tokens=12)
    stops = [target.tokenizer.eos_token_id]
    want = hf_generate(target.model, prompts, sampling, stops, target.tokenizer.pad_token_id)
    gen = BatchGenerator(target, rows=4, max_len=64, stop_ids=stops, graphs=False)
    assert gen.generate(prompts, sampling) == want
    for p, w in zip(prompts, want):  # and each row as it decodes alone
        assert w == generate_target_only(target, p, 12, stops)
    # the logits too, of a prefill padded with a real token (the pad id's embedding row is zero, which would hide
    # padding that reached the recurrent state)
    P = max(map(len, prompts))
    static = StaticTarget(target, slots=64, rows=3, padded=True)
    static.row_start.copy_(torch.tensor([P - len(p) for p in prompts]))
    ids = torch.tensor([[prompts[0][0]] * (P - len(p)) + p for p in prompts])
    logits, _ = static.forward(ids, torch.zeros((), dtype=torch.long), want_features=False)
    for r, p in enumerate(prompts):
        torch.testing.assert_close(logits[r:r + 1, P - len(p):], hf_logits(target, torch.tensor([p])), atol=1e-4,
                                   rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_refilled_slots_reset_and_prefill_each_rows_linear_states(targets, family):
    """Seven prompts of 2..30 tokens through 2 rows, ending at a stop id or max_new at different times: a refilled
    row's conv and recurrent states start from zero and take its prompt alone (the other row's untouched), so every
    answer is HF's; sampled, a prompt refilled into a busy batch draws what it draws in a batch of one."""
    from tests.trainer.decode.test_generate import prompts_of, stops_inside

    target = targets[family]
    prompts = prompts_of(target, (2, 30, 5, 17, 9, 3, 25), seed=3)
    stops = stops_inside(target, prompts, 16)
    gen = BatchGenerator(target, rows=2, max_len=60, stop_ids=stops, graphs=False)
    greedy = Sampling(max_new_tokens=16)
    assert gen.generate(prompts, greedy) == hf_generate(target.model, prompts, greedy, stops,
                                                        target.tokenizer.pad_token_id)
    assert gen.refilled == 5
    hot = Sampling(max_new_tokens=16, temperature=1.0, seed=2)
    busy = gen.generate(prompts, hot, streams=list(range(10, 17)))
    alone = BatchGenerator(target, rows=1, max_len=60, stop_ids=stops, graphs=False)
    assert alone.generate([prompts[5]], hot, streams=[15]) == [busy[5]]
