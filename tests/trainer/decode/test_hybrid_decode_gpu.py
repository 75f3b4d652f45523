"""A hybrid target through the static decoder on CUDA with graph replay (run on the H200:
`python3 -m pytest -m gpu tests/trainer/decode/test_hybrid_decode_gpu.py`): the decode step and the speculative round
each one captured graph, the Gated DeltaNet layers' verify and commit inside the round's graph; greedy output equals
the HF-cache reference's, token for token. Qwen3.5 (dense MLPs: the whole step captures; an MoE MLP through HF's
forward is not graph-safe)."""
from __future__ import annotations

import pytest
import torch

from tests.trainer.decode.test_reference import PROMPTS, _prompt_ids
from tests.trainer.decode.test_static_decode import _WrongAt
from tests.trainer.families import build_family_target
from trainer.decode.hybrid import HybridDecoder
from trainer.decode.reference import generate_target_only
from trainer.decode.static_draft import TableProposer
from trainer.model.target import load_target

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_graph_replayed_hybrid_decoding_equals_hfs_greedy(tmp_path):
    target = load_target(build_family_target(tmp_path / "q", "qwen3_5"), num_draft_layers=2, layer_ids=(1, 3),
                         truncate=False, device="cuda", dtype="float32")
    vocab = target.embed_tokens.weight.shape[0]
    block_size, new = 5, 23
    decoder = HybridDecoder(target, capacity=64)
    assert decoder.step.graph is not None
    for text in PROMPTS[:2]:
        ids = _prompt_ids(target, text)
        want = generate_target_only(target, ids, new)
        table = torch.tensor(ids + generate_target_only(target, ids, new + block_size), device="cuda")
        assert decoder.generate_target_only(ids, new) == want, text
        for proposer, accepted in ((TableProposer(table, block_size), block_size - 1),
                                   (_WrongAt(table, block_size, 3, vocab), 2)):
            spec = HybridDecoder(target, 64, proposer, block_size)
            assert spec.round.graph is not None
            got = spec.generate_speculative(ids, new)
            assert got.tokens == want, (text, type(proposer).__name__)
            assert accepted in set(got.accepted), got.accepted


def test_graph_replayed_hybrid_batch_equals_hf_generate(tmp_path):
    from trainer.decode.generate import Sampling, hf_generate
    from trainer.decode.hybrid import HybridBatchGenerator

    target = load_target(build_family_target(tmp_path / "q", "qwen3_5"), num_draft_layers=2, layer_ids=(1, 3),
                         truncate=False, device="cuda", dtype="float32")
    prompts = [_prompt_ids(target, text) for text in PROMPTS[:3]]
    prompts[1] = prompts[1][:5]
    sampling, stops = Sampling(max_new_tokens=20), [target.tokenizer.eos_token_id]
    want = hf_generate(target.model, prompts, sampling, stops, target.tokenizer.pad_token_id)
    gen = HybridBatchGenerator(target, rows=4, max_len=64, stop_ids=stops)
    assert gen.generate(prompts, sampling) == want
    assert all(p.graph is not None for p in gen.programs.values())
