"""The hybrid targets through the static engine on CUDA with graph replay (run on the H200:
`python3 -m pytest -m gpu tests/trainer/decode/test_hybrid_decode_gpu.py`): the decode step and the speculative round
each one captured graph, the Gated DeltaNet layers' verify and commit inside the round's graph; greedy output equals
the HF-cache reference's, token for token, and a batch equals HF `generate`. Qwen3.5 (dense MLPs), Qwen3-Next and
Qwen3.5-MoE (MoE MLPs through the stack's `layers/moe.py`, a shared expert beside the routed ones), in fp32: in bf16
an MoE router's top-k can flip on a near tie against HF's eager forward."""
from __future__ import annotations

import pytest
import torch

from tests.trainer.decode.test_reference import PROMPTS, _prompt_ids
from tests.trainer.decode.test_static_decode import _WrongAt
from tests.trainer.families import build_family_target
from trainer.decode.engine import StaticDecoder
from trainer.decode.generate import BatchGenerator, Sampling, hf_generate
from trainer.decode.reference import generate_target_only
from trainer.decode.static_draft import TableProposer
from trainer.model.target import load_target

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
FAMILIES = ("qwen3_5", "qwen3_next", "qwen3_5_moe")


def cuda_target(tmp_path, family: str):
    return load_target(build_family_target(tmp_path / family, family), num_draft_layers=2, layer_ids=(1, 3),
                       truncate=False, device="cuda", dtype="float32")


@pytest.mark.parametrize("family", FAMILIES)
def test_graph_replayed_hybrid_decoding_equals_hfs_greedy(tmp_path, family):
    target = cuda_target(tmp_path, family)
    vocab = target.embed_tokens.weight.shape[0]
    block_size, new = 5, 23
    decoder = StaticDecoder(target, capacity=64)
    assert decoder.step.graph is not None and decoder.static.linear
    for text in PROMPTS[:2]:
        ids = _prompt_ids(target, text)
        want = generate_target_only(target, ids, new)
        table = torch.tensor(ids + generate_target_only(target, ids, new + block_size), device="cuda")
        assert decoder.generate_target_only(ids, new) == want, (family, text)
        for proposer, accepted in ((TableProposer(table, block_size), block_size - 1),
                                   (_WrongAt(table, block_size, 3, vocab), 2)):
            spec = StaticDecoder(target, 64, proposer, block_size)
            assert spec.round.graph is not None
            got = spec.generate_speculative(ids, new)
            assert got.tokens == want, (family, text, type(proposer).__name__)
            assert accepted in set(got.accepted), got.accepted


@pytest.mark.parametrize("family", FAMILIES)
def test_graph_replayed_hybrid_batch_equals_hf_generate(tmp_path, family):
    target = cuda_target(tmp_path, family)
    prompts = [_prompt_ids(target, text) for text in PROMPTS[:3]]
    prompts[0], prompts[1] = prompts[0] + prompts[2], prompts[1][:5]  # lengths far apart
    sampling, stops = Sampling(max_new_tokens=20), [target.tokenizer.eos_token_id]
    want = hf_generate(target.model, prompts, sampling, stops, target.tokenizer.pad_token_id)
    gen = BatchGenerator(target, rows=4, max_len=64, stop_ids=stops)
    assert gen.generate(prompts, sampling) == want, family
    assert all(p.graph is not None for p in gen.programs.values())
