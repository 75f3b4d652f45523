"""MoE and sink targets on the static engine under CUDA graph replay (run on the H200: `python3 -m pytest -m gpu
tests/trainer/decode/test_static_moe_gpu.py`). The tiny Qwen3-MoE, Mixtral and gpt-oss targets
(tests/trainer/families.py) in fp32 against HF (the exact expert rule inside the graphs): in bf16 a router's top-k can
flip on a near tie between two computations that round differently, and a token then differs by more than any
rounding. In bf16 (the grouped GEMM kernel inside the graphs) the replayed engine against the same engine run eagerly,
the same kernels in the same order."""
from __future__ import annotations

import pytest
import torch

from tests.trainer.decode.test_reference import PROMPTS, _drafter, _prompt_ids
from tests.trainer.decode.test_static_moe import redrawn_block
from trainer.decode.engine import StaticDecoder
from trainer.decode.layers.moe import MoeMLP, grouped_available, routing_of
from trainer.decode.reference import generate_target_only
from trainer.decode.static_draft import StaticDFlashProposer
from trainer.model.target import load_target

pytestmark = pytest.mark.gpu
MOE = ("qwen3_moe", "mixtral", "gpt_oss")


def cuda_family(family_dirs, family: str, dtype: str = "float32"):
    if not torch.cuda.is_available():
        pytest.fail("the gpu tier needs CUDA")
    return load_target(family_dirs[family], num_draft_layers=2, layer_ids=(1, 3), device="cuda", dtype=dtype,
                       truncate=False)


@pytest.mark.parametrize("family", MOE)
def test_graph_replay_equals_hf(family, family_dirs):
    """The captured decode step and speculative round (the grouped expert GEMMs inside the graphs) give HF's greedy
    tokens, target-only and speculative."""
    target = cuda_family(family_dirs, family)
    assert not grouped_available(target.device, torch.float32)
    B = 4
    decoder = StaticDecoder(target, 128, StaticDFlashProposer(target, _drafter(target).cuda(), B, 128), B)
    assert decoder.round.graph is not None and decoder.step.graph is not None
    assert not any(m.grouped for m in decoder.static.mlps if isinstance(m, MoeMLP))
    for text in PROMPTS:
        ids = _prompt_ids(target, text)
        want = generate_target_only(target, ids, 41)
        assert decoder.generate_target_only(ids, 41) == want, (family, text)
        assert decoder.generate_speculative(ids, 41).tokens == want, (family, text)


@pytest.mark.parametrize("family", MOE)
def test_batched_generation_under_graph_replay_equals_hf(family, family_dirs):
    """BatchGenerator (regenerate's engine) on prompts of different lengths: one replay per token for the batch,
    each row HF's greedy continuation."""
    from trainer.decode.generate import BatchGenerator, Sampling

    target = cuda_family(family_dirs, family)
    g = torch.Generator().manual_seed(0)
    vocab = target.embed_tokens.weight.shape[0]
    prompts = [torch.randint(10, vocab, (n,), generator=g).tolist() for n in (3, 11, 7, 5)]
    gen = BatchGenerator(target, rows=4, max_len=32, stop_ids=[])
    got = gen.generate(prompts, Sampling(max_new_tokens=16))
    assert all(p.graph is not None for p in gen.programs.values())
    for row, prompt in zip(got, prompts):
        assert row == generate_target_only(target, prompt, 16), family


@pytest.mark.parametrize("family", MOE)
def test_grouped_kernel_under_graph_replay_equals_the_eager_engine(family, family_dirs, kernels_off):
    """bf16: the grouped expert GEMMs captured in the decode step, the speculative round and the batch step (with its
    decode kernels switched off, then with them at their default) give the tokens the same engine gives run eagerly
    (graphs=False)."""
    from trainer.decode.generate import BatchGenerator, Sampling

    target = cuda_family(family_dirs, family, "bfloat16")
    B = 4
    drafter = _drafter(target).cuda()
    graphed = StaticDecoder(target, 128, StaticDFlashProposer(target, drafter, B, 128), B)
    eager = StaticDecoder(target, 128, StaticDFlashProposer(target, drafter, B, 128), B, graphs=False)
    assert graphed.round.graph is not None and eager.round.graph is None
    assert all(m.grouped for m in graphed.static.mlps if isinstance(m, MoeMLP))
    for text in PROMPTS:
        ids = _prompt_ids(target, text)
        assert graphed.generate_target_only(ids, 41) == eager.generate_target_only(ids, 41), (family, text)
        assert (graphed.generate_speculative(ids, 41).tokens == eager.generate_speculative(ids, 41).tokens), \
            (family, text)
    g = torch.Generator().manual_seed(0)
    vocab = target.embed_tokens.weight.shape[0]
    prompts = [torch.randint(10, vocab, (n,), generator=g).tolist() for n in (3, 11, 7, 5)]
    for off in (True, False):
        kernels_off(["moe", "route"], off=off)
        rows = [BatchGenerator(target, rows=4, max_len=32, stop_ids=[], graphs=graphs).generate(
            prompts, Sampling(max_new_tokens=16)) for graphs in (True, False)]
        assert rows[0] == rows[1], (family, off)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_grouped_gemms_equal_the_exact_rule_on_cuda(dtype, tol, family_dirs):
    """grouped_mm on the device against the per-copy rule, on redrawn weights (tokens spread over the experts)."""
    for family in MOE:
        target = cuda_family(family_dirs, family)
        block, _ = redrawn_block(target)
        block.to(dtype)
        k = target.hf_config.num_experts_per_tok
        x = torch.randn(4, 16, target.hf_config.hidden_size, device="cuda", dtype=dtype)
        routing = routing_of(target.hf_config)
        got = MoeMLP(block, routing, k, grouped=True)(x).float()
        want = MoeMLP(block, routing, k, grouped=False)(x).float()
        assert (got - want).abs().max() <= tol * want.abs().max(), family
