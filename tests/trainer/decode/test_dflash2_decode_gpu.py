"""DFlash2 decoding on CUDA with graph replay (run on the H200: `python3 -m pytest -m gpu
tests/trainer/decode/test_dflash2_decode_gpu.py`): the captured round (the block forward with its convolutions, the
head's top-k and the selector's walk inside the graph) drafts what the same round run eagerly drafts, and decodes the
target's own greedy output."""
from __future__ import annotations

import pytest

from tests.trainer.decode.test_dflash2_decode import DRAFTERS, RecordingProposer, dflash2_drafter
from tests.trainer.decode.test_reference import PROMPTS, _prompt_ids
from trainer.decode.drafters.dflash2 import StaticDFlash2Proposer
from trainer.decode.engine import StaticDecoder
from trainer.decode.reference import generate_speculative, generate_target_only

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kind", ["perturbed", "perturbed-transformed"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_graph_replay_equals_eager_and_the_target_alone(cuda_target, autocast, kind):
    """Graph-replayed speculative decoding == the target alone (fp32 target); its drafts == the eager round's,
    round by round, bit for bit (the same kernels, replayed). With an fp32 drafter they also equal the HF
    reference proposer's."""
    drafter = dflash2_drafter(cuda_target, **DRAFTERS[kind]).cuda()
    for B in (4, 7):
        graphed = StaticDecoder(cuda_target, 192, StaticDFlash2Proposer(cuda_target, drafter, B, 192,
                                                                         autocast=autocast), B)
        assert graphed.round.graph is not None and graphed.step.graph is not None
        eager = StaticDecoder(cuda_target, 192, StaticDFlash2Proposer(cuda_target, drafter, B, 192,
                                                                       autocast=autocast), B, graphs=False)
        assert eager.round.graph is None
        for text in PROMPTS:
            ids = _prompt_ids(cuda_target, text)
            want = generate_target_only(cuda_target, ids, 41)
            assert graphed.generate_target_only(ids, 41) == want
            graph_drafts: list = []
            eager_drafts: list = []
            assert graphed.generate_speculative(ids, 41, drafts=graph_drafts).tokens == want, (B, text)
            assert eager.generate_speculative(ids, 41, drafts=eager_drafts).tokens == want, (B, text)
            assert graph_drafts == eager_drafts, (B, text)
            reference = RecordingProposer(cuda_target, drafter, B)
            reference.autocast = autocast
            assert generate_speculative(cuda_target, reference, ids, 41).tokens == want, (B, text)
            if not autocast:
                assert graph_drafts == reference.drafts, (B, text)


@pytest.mark.parametrize("compile", ["drafter", "all"])
def test_a_compiled_dflash2_round_decodes_the_target_alone(cuda_target, compile):
    """torch.compile'd draft (the selector's top-k and walk included) inside the captured round: same tokens."""
    drafter = dflash2_drafter(cuda_target, **DRAFTERS["perturbed"]).cuda()
    decoder = StaticDecoder(cuda_target, 128, StaticDFlash2Proposer(cuda_target, drafter, 4, 128), 4,
                            compile=compile)
    assert decoder.round.graph is not None
    for text in PROMPTS:
        ids = _prompt_ids(cuda_target, text)
        assert decoder.generate_speculative(ids, 33).tokens == generate_target_only(cuda_target, ids, 33), text
