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


def recurrent_reference(q, k, v, g, beta) -> torch.Tensor:
    """The gated delta rule token by token over ONE document from a zero state, written from its definition
    (S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - S_{t-1}^T k_t exp(g_t)))^T, o_t = S_t^T q_t, q and k L2-normalized,
    q scaled by dk^-1/2): plain loops, no chunking, nothing of the code under test or of transformers.
    q, k [T, Hk, dk]; v [T, Hv, dv]; g, beta [T, Hv] -> [T, Hv, dv] (fp32)."""
    hv, hk, dk = v.shape[1], k.shape[1], k.shape[2]
    out = torch.zeros(v.shape[0], hv, v.shape[2])
    for h in range(hv):
        state = torch.zeros(dk, v.shape[2])
        for t in range(v.shape[0]):
            qt, kt = q[t, h // (hv // hk)].float(), k[t, h // (hv // hk)].float()
            qt = qt / torch.sqrt((qt * qt).sum() + 1e-6) * dk ** -0.5
            kt = kt / torch.sqrt((kt * kt).sum() + 1e-6)
            state = state * torch.exp(g[t, h].float())
            delta = (v[t, h].float() - state.T @ kt) * beta[t, h].float()
            state = state + torch.outer(kt, delta)
            out[t, h] = state.T @ qt
    return out


# Documents that END 1, 2 and 3 tokens before a 64-token chunk boundary and exactly at it, a two-token document that
# closes a chunk, and one that crosses a boundary a token after starting: where the state of a document that ends
# inside a chunk would reach the next one with little decay left to hide it.
NEAR_EDGES = [[61, 5, 62, 4, 63, 2, 3], [64, 63, 1, 62, 10], [2, 61, 3, 60, 2, 2, 70]]


@pytest.mark.parametrize("decay_scale", [0.3, 0.01])
def test_documents_ending_just_before_a_chunk_boundary_leak_nothing_into_the_next(decay_scale):
    """Against the token-by-token rule of each document alone (`recurrent_reference`). decay_scale 0.01: decays
    near 1, so state that crosses a document boundary is not hidden by decay either."""
    seq = max(sum(r) for r in NEAR_EDGES)
    q, k, v, g, beta = rule_inputs(len(NEAR_EDGES), seq, seed=3)
    g = g / 0.3 * decay_scale
    got = packed_chunk_gated_delta_rule(q, k, v, g, beta, doc_starts(doc_ids_of(NEAR_EDGES, seq)))
    ends = set()
    for r, span in spans(NEAR_EDGES):
        ends.add(span.stop % 64)
        want = recurrent_reference(q[r, span], k[r, span], v[r, span], g[r, span], beta[r, span])
        torch.testing.assert_close(got[r, span], want, atol=2e-5, rtol=1e-4, msg=f"row {r}, tokens {span}")
    assert {61, 62, 63, 0} <= ends  # the layouts do end documents where they say


def test_a_block_from_a_start_state_and_the_state_after_each_prefix_are_hfs(hf_rules):
    """`gated_delta_block` (one chunk from a start state), `state_after` (the state after any prefix of it) and
    `gated_delta_step` (one token) against HF's rules given an initial state, every row with its own prefix."""
    from trainer.model.linear_attention import gated_delta_block, gated_delta_step, state_after

    chunk_rule, recurrent_rule = hf_rules
    rows, length = 3, 7
    q, k, v, g, beta = rule_inputs(rows, length, seed=5)
    start = torch.randn(rows, 4, 8, 6, generator=torch.Generator().manual_seed(6))
    out, terms = gated_delta_block(q, k, v, g, beta, start)
    want, final = chunk_rule(q, k, v, g=g, beta=beta, initial_state=start, output_final_state=True,
                             use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)
    for n in range(length + 1):
        prefix = [x[:, :n] for x in (q, k, v, g, beta)]
        want_state = start if n == 0 else recurrent_rule(*prefix[:3], g=prefix[3], beta=prefix[4], initial_state=start,
                                                         output_final_state=True, use_qk_l2norm_in_kernel=True)[1]
        got = state_after(start, terms, torch.full((rows,), n))
        torch.testing.assert_close(got, want_state, atol=2e-5, rtol=1e-4)
    mixed = state_after(start, terms, torch.tensor([0, 3, length]))  # each row its own count
    torch.testing.assert_close(mixed[2], final[2], atol=2e-5, rtol=1e-4)
    step_out, step_state = gated_delta_step(*(x[:, :1] for x in (q, k, v, g, beta)), start)
    want_out, want_state = recurrent_rule(*(x[:, :1] for x in (q, k, v)), g=g[:, :1], beta=beta[:, :1],
                                          initial_state=start, output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(step_out, want_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(step_state, want_state, atol=2e-5, rtol=1e-4)
