"""Static decoding on CUDA with graph replay (run on the H200: `python3 -m pytest -m gpu tests/trainer/decode`)."""
from __future__ import annotations

import pytest
import torch

from tests.trainer.decode.test_static_decode import RecordingProposer, _WrongAt, _sharp_drafter
from tests.trainer.quality.test_speculative import PROMPTS, _prompt_ids
from trainer.decode.engine import StaticDecoder
from trainer.decode.static_draft import StaticDFlashProposer, TableProposer
from trainer.speculative import generate_speculative, generate_target_only

pytestmark = pytest.mark.gpu



def test_graph_replay_equals_hf_reference(cuda_target):
    """Graph-replayed target-only decoding == HF greedy, and so is graph-replayed speculative decoding (fp32 target,
    exact). The drafts (bf16 autocast, context-dependent drafter) equal the HF reference's round by round, except
    where bf16 rounding flips a near-tie: the masked static attention and the reference's concatenation round
    differently in the last bit, so at most a quarter of the sequences may differ."""
    drafter = _sharp_drafter(cuda_target, seed=5).cuda()
    same = total = 0
    for B in (4, 16):
        proposer = StaticDFlashProposer(cuda_target, drafter, B, slots=192)
        decoder = StaticDecoder(cuda_target, 192, proposer, B)
        assert decoder.round.graph is not None and decoder.step.graph is not None
        for text in PROMPTS:
            ids = _prompt_ids(cuda_target, text)
            want = generate_target_only(cuda_target, ids, 41)
            assert decoder.generate_target_only(ids, 41) == want
            drafts: list = []
            assert decoder.generate_speculative(ids, 41, drafts=drafts).tokens == want
            reference = RecordingProposer(cuda_target, drafter, B)
            generate_speculative(cuda_target, reference, ids, 41)
            same += drafts == reference.drafts
            total += 1
    assert same >= 0.75 * total, (same, total)


def test_graph_round_bookkeeping_with_known_answers(cuda_target):
    """Perfect table drafter: tau = B under replay; one wrong position k: every round accepts k - 1."""
    B = 16
    for text in PROMPTS:
        ids = _prompt_ids(cuda_target, text)
        greedy = generate_target_only(cuda_target, ids, 40 + B)
        table = torch.tensor(ids + greedy, device="cuda")
        perfect = StaticDecoder(cuda_target, 128, TableProposer(table, B), B).generate_speculative(ids, 40)
        assert perfect.tokens == greedy[:40] and set(perfect.accepted[:-1]) == {B - 1}
        vocab = cuda_target.embed_tokens.weight.shape[0]
        wrong = StaticDecoder(cuda_target, 128, _WrongAt(table, B, 5, vocab), B).generate_speculative(ids, 40)
        assert wrong.tokens == greedy[:40] and set(wrong.accepted) == {4}


@pytest.mark.parametrize("compile", ["drafter", "all"])
def test_compiled_round_equals_reference(cuda_target, compile):
    """torch.compile'd step and round forwards (inside the same raw graphs) decode the same tokens."""
    drafter = _sharp_drafter(cuda_target, seed=5).cuda()
    decoder = StaticDecoder(cuda_target, 128, StaticDFlashProposer(cuda_target, drafter, 16, 128), 16,
                            compile=compile)
    for text in PROMPTS:
        ids = _prompt_ids(cuda_target, text)
        want = generate_target_only(cuda_target, ids, 33)
        assert decoder.generate_target_only(ids, 33) == want
        assert decoder.generate_speculative(ids, 33).tokens == want


def test_batched_continuations_under_graph_replay(cuda_target):
    """BatchGreedy (the regen stage's continuation engine): one replay per token for the whole batch, each row the
    target's own greedy continuation (fp32)."""
    from trainer.decode.batch import BatchGreedy

    torch.manual_seed(0)
    vocab = cuda_target.embed_tokens.weight.shape[0]
    prompts = torch.randint(0, vocab - 1, (6, 10))
    gen = BatchGreedy(cuda_target, rows=4, prompt_len=10, new_tokens=12)
    assert gen.step.graph is not None
    got = torch.cat([gen.generate(prompts[:4]), gen.generate(prompts[4:])]).tolist()
    for row, prompt in zip(got, prompts.tolist()):
        assert row == generate_target_only(cuda_target, prompt, 12)
