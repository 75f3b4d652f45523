"""GPU tier for the target's doc-causal fast path: doc-causal flex vs the dense sdpa reference on CUDA (bf16), eager and
inside a captured CUDA graph whose documents change between replays. Run: pytest -m gpu tests/trainer/gpu/test_target_doc_attention_gpu.py
"""
from __future__ import annotations

import pytest
import torch

from tests.trainer.test_target_doc_attention import packed_doc_ids
from trainer.model.target import load_target

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cuda_targets(tiny_target_dir):
    if not torch.cuda.is_available():
        pytest.fail("the gpu tier needs CUDA")
    dev = torch.device("cuda")
    ref = load_target(tiny_target_dir, num_draft_layers=2, device=dev, dtype="bfloat16")
    fast = load_target(tiny_target_dir, num_draft_layers=2, device=dev, dtype="bfloat16", attn="flex")
    return ref, fast


def test_flex_features_match_sdpa_on_cuda_also_under_graph_replay(cuda_targets):
    ref, fast = cuda_targets
    dev = ref.device
    vocab = ref.embed_tokens.weight.shape[0]
    layouts = [[[384], [100, 28, 200, 56], [128, 128, 100], [5, 300]], [[200, 184], [384], [50] * 7 + [34], [383]]]
    inputs = []
    for rows in layouts:
        doc, pos = packed_doc_ids(rows, 384)
        ids = torch.randint(0, vocab, doc.shape)
        inputs.append(tuple(t.to(dev) for t in (ids, pos, doc)))
    static = [t.clone() for t in inputs[0]]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fast.features(*static)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        out = fast.features(*static)
    for ids, pos, doc in inputs:
        want = ref.features(ids, pos, doc).float()
        eager = fast.features(ids, pos, doc).float()
        for dst, src in zip(static, (ids, pos, doc)):
            dst.copy_(src)
        g.replay()
        torch.cuda.synchronize()
        for got in (eager, out.float()):
            err = (got - want).abs().max() / want.abs().max()
            assert err < 2e-2, err  # bf16: flex and sdpa round differently, documents must not leak (error ~1)
