"""The packed Gated DeltaNet pieces (trainer/model/linear_attention.py) against HF's own implementations, run on each
document alone: the chunked and the token-by-token delta rule of transformers' Qwen3.5 modeling file, and torch's
depthwise conv1d. Layouts put documents across the 64-token chunks, at their edges, several inside one, one token
long, and end rows with padding."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trainer.model.linear_attention import doc_starts, packed_causal_conv1d, packed_chunk_gated_delta_rule

ROWS = [[64, 65, 63], [1, 2, 3, 60, 1, 100, 5], [192], [10, 129, 7]]  # the last two end in padding
SEQ = 200


def doc_ids_of(rows: list[list[int]], seq: int) -> torch.Tensor:
    doc = torch.full((len(rows), seq), -1, dtype=torch.long)
    for r, lengths in enumerate(rows):
        at = 0
        for d, n in enumerate(lengths):
            doc[r, at:at + n] = d
            at += n
    return doc


def spans(rows):
    for r, lengths in enumerate(rows):
        at = 0
        for n in lengths:
            yield r, slice(at, at + n)
            at += n


def rule_inputs(rows: int, seq: int, hk: int = 2, hv: int = 4, dk: int = 8, dv: int = 6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(rows, seq, hk, dk, generator=g) for _ in range(2))
    v = torch.randn(rows, seq, hv, dv, generator=g)
    decay = -F.softplus(torch.randn(rows, seq, hv, generator=g)) * 0.3  # log decays <= 0, as the layers make them
    beta = torch.rand(rows, seq, hv, generator=g)
    return q, k, v, decay, beta


@pytest.fixture(scope="module")
def hf_rules():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    return hf.torch_chunk_gated_delta_rule, hf.torch_recurrent_gated_delta_rule


def test_the_packed_rule_equals_hfs_rules_on_each_document_alone(hf_rules):
    chunk_rule, recurrent_rule = hf_rules
    q, k, v, g, beta = rule_inputs(len(ROWS), SEQ)
    got = packed_chunk_gated_delta_rule(q, k, v, g, beta, doc_starts(doc_ids_of(ROWS, SEQ)))
    assert got.shape == v.shape
    for r, span in spans(ROWS):
        args = [x[r:r + 1, span] for x in (q, k, v)]
        for rule in (chunk_rule, recurrent_rule):
            want, _ = rule(*args, g=g[r:r + 1, span], beta=beta[r:r + 1, span], use_qk_l2norm_in_kernel=True)
            torch.testing.assert_close(got[r:r + 1, span], want, atol=2e-5, rtol=1e-4)


def test_a_rule_that_carries_the_state_across_documents_would_be_caught(hf_rules):
    chunk_rule, _ = hf_rules
    q, k, v, g, beta = rule_inputs(1, SEQ)
    starts = torch.zeros(1, SEQ, dtype=torch.bool)
    starts[0, 0] = True  # the row as one document
    got = packed_chunk_gated_delta_rule(q, k, v, g, beta, starts)
    span = slice(64, 129)  # the second document of ROWS[0]
    want, _ = chunk_rule(q[:, span], k[:, span], v[:, span], g=g[:, span], beta=beta[:, span],
                         use_qk_l2norm_in_kernel=True)
    assert not torch.allclose(got[:, span], want, atol=1e-3)


def test_bf16_inputs_give_bf16_outputs_close_to_fp32():
    q, k, v, g, beta = rule_inputs(2, 96)
    starts = doc_starts(doc_ids_of([[40, 56], [96]], 96))
    want = packed_chunk_gated_delta_rule(q, k, v, g, beta, starts)
    got = packed_chunk_gated_delta_rule(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta.bfloat16(), starts)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=5e-2, rtol=5e-2)


def test_the_packed_convolution_equals_conv1d_on_each_document_alone():
    g = torch.Generator().manual_seed(1)
    channels, taps = 12, 4
    x = torch.randn(len(ROWS), SEQ, channels, generator=g)
    weight = torch.randn(channels, taps, generator=g)
    doc = doc_ids_of(ROWS, SEQ)
    got = packed_causal_conv1d(x, weight, doc)
    for r, span in spans(ROWS):
        alone = x[r:r + 1, span].transpose(1, 2)
        want = F.silu(F.conv1d(alone, weight[:, None], padding=taps - 1, groups=channels)[..., :alone.shape[-1]])
        torch.testing.assert_close(got[r:r + 1, span], want.transpose(1, 2), atol=1e-5, rtol=1e-5)
    wrong = packed_causal_conv1d(x, weight, torch.zeros_like(doc))  # no document boundaries
    assert not torch.allclose(wrong[0, 64:67], got[0, 64:67], atol=1e-3)


def test_document_starts():
    doc = doc_ids_of([[2, 3], [5]], 6)
    assert doc_starts(doc).tolist() == [[True, False, True, False, False, True], [True] + [False] * 4 + [True]]
