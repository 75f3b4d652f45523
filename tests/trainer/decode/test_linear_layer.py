"""The Gated DeltaNet decode layer (trainer/decode/layers/linear.py) against HF's own layer of each hybrid family's
tiny model, in fp32: HF's forward over the whole sequence (no cache) gives the outputs, HF's cache after a token-by-
token decode the states. A verify followed by a commit must leave exactly the state of decoding the accepted prefix
alone, for every accepted count, rows at different depths."""
from __future__ import annotations

import functools
import inspect

import pytest
import torch

from tests.trainer.families import HYBRID_FAMILIES, family_config
from trainer.decode.layers.linear import GatedDeltaNetDecode, decode_layers

ROWS, DIM = 3, 64


@pytest.fixture(scope="module", params=HYBRID_FAMILIES)
def model(request):
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng():
        torch.manual_seed(0)
        hf = AutoModelForCausalLM.from_config(family_config(request.param, 64)).float().eval()
    return hf


def inputs(rows: int, seq: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, seq, DIM, generator=torch.Generator().manual_seed(seed))


def hf_out(inner, x: torch.Tensor) -> torch.Tensor:
    """HF's layer over whole sequences from a zero state (no cache)."""
    with torch.no_grad():
        return inner(x)


def assert_near(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within fp32 rounding of the chunked and the token-by-token forms (the outputs' scale is ~1e-2)."""
    assert got.shape == want.shape
    err, scale = (got - want).abs().max().item(), want.abs().max().item()
    assert err <= 1e-4 * scale, (err, scale)


def test_prefill_then_steps_equal_hfs_forward_and_hfs_cache(model):
    from transformers import DynamicCache

    inner = model.model.layers[0].linear_attn
    x = inputs(ROWS, 90, seed=1)
    layer = GatedDeltaNetDecode(inner, ROWS, block=4)
    with torch.no_grad():
        outs = [layer.prefill(x[:, :70])]  # crosses a 64-token chunk, from the zero state
        outs += [layer.step(x[:, t:t + 1]) for t in range(70, 90)]
    assert_near(torch.cat(outs, 1), hf_out(inner, x))

    # HF's cached path, token by token after the same prefill: its states are ours (HF keeps K conv inputs)
    cache = DynamicCache(config=model.config)
    name = "cache" if "cache" in inspect.signature(type(inner).forward).parameters else "cache_params"
    with torch.no_grad():
        inner(x[:, :70], **{name: cache})
        for t in range(70, 90):
            inner(x[:, t:t + 1], **{name: cache})
    hf_layer = cache.layers[inner.layer_idx]
    torch.testing.assert_close(layer.conv, hf_layer.conv_states[0][..., 1:], atol=0, rtol=0)
    torch.testing.assert_close(layer.state, hf_layer.recurrent_states[0], atol=1e-6, rtol=1e-4)


def test_a_verify_then_commit_equals_decoding_the_accepted_prefix_alone(model):
    inner = model.model.layers[0].linear_attn
    block, rounds = 6, 4
    prompt = inputs(ROWS, 11, seed=2)
    layer = GatedDeltaNetDecode(inner, ROWS, block=block + 2)  # a verify shorter than the buffers hold
    buffers = [t.data_ptr() for t in (layer.conv, layer.state, layer.window, layer.terms.k, layer.terms.v_new)]
    kept = [prompt[r] for r in range(ROWS)]  # each row's committed inputs
    accepted_per_round = [[0, 3, 6], [6, 1, 2], [2, 0, 5], [1, 6, 0]]
    with torch.no_grad():
        layer.prefill(prompt)
        for i in range(rounds):
            drafts = inputs(ROWS, block, seed=10 + i)
            out = layer.forward(drafts)
            for r in range(ROWS):  # each block position's output: the layer over the committed prefix + the block
                want = hf_out(inner, torch.cat([kept[r], drafts[r]])[None])[:, -block:]
                assert_near(out[r:r + 1], want)
            accepted = torch.tensor(accepted_per_round[i])
            layer.commit(accepted)
            kept = [torch.cat([kept[r], drafts[r, :accepted[r]]]) for r in range(ROWS)]
        # the states are those of the accepted prefixes: the next steps continue each row's own sequence
        nxt = inputs(ROWS, 3, seed=99)
        outs = torch.cat([layer.step(nxt[:, t:t + 1]) for t in range(3)], 1)
    for r in range(ROWS):
        assert_near(outs[r:r + 1], hf_out(inner, torch.cat([kept[r], nxt[r]])[None])[:, -3:])
    assert [t.data_ptr() for t in (layer.conv, layer.state, layer.window, layer.terms.k, layer.terms.v_new)] == \
        buffers


def test_a_commit_of_the_wrong_count_would_be_caught(model):
    inner = model.model.layers[0].linear_attn
    prompt, drafts, nxt = inputs(1, 9, seed=3), inputs(1, 5, seed=4), inputs(1, 1, seed=5)
    want = hf_out(inner, torch.cat([prompt, drafts[:, :2], nxt], 1))[:, -1:]
    got = {}
    for a in (2, 3):
        layer = GatedDeltaNetDecode(inner, 1, block=5)
        with torch.no_grad():
            layer.prefill(prompt)
            layer.forward(drafts)
            layer.commit(torch.tensor([a]))
            got[a] = layer.step(nxt)
    assert_near(got[2], want)
    assert (got[3] - want).abs().max() > 1e-2 * want.abs().max()


def test_rows_of_different_lengths_prefill_right_padded(model):
    inner = model.model.layers[0].linear_attn
    lengths = [5, 80, 1]
    padded = inputs(ROWS, 80, seed=6)  # the padding is real-looking input: only the valid counts keep it out
    steps = inputs(ROWS, 4, seed=7)
    layer = GatedDeltaNetDecode(inner, ROWS, block=2)
    with torch.no_grad():
        first = layer.prefill(padded, valid=torch.tensor(lengths))
        outs = torch.cat([layer.step(steps[:, t:t + 1]) for t in range(4)], 1)
    for r, n in enumerate(lengths):
        want = hf_out(inner, torch.cat([padded[r, :n], steps[r]])[None])
        assert_near(first[r:r + 1, :n], want[:, :n])
        assert_near(outs[r:r + 1], want[:, n:])


def test_reset_starts_the_chosen_rows_afresh_and_leaves_the_others(model):
    inner = model.model.layers[0].linear_attn
    x, y = inputs(ROWS, 12, seed=8), inputs(ROWS, 3, seed=9)
    layer = GatedDeltaNetDecode(inner, ROWS, block=1)
    with torch.no_grad():
        layer.prefill(x)
        layer.reset(torch.tensor([True, False, True]))
        out = layer.prefill(y)
    assert_near(out[[0, 2]], hf_out(inner, y[[0, 2]]))
    assert_near(out[1:2], hf_out(inner, torch.cat([x[1:2], y[1:2]], 1))[:, -3:])


def test_bf16_buffers_keep_hfs_dtypes_and_stay_near_fp32(model):
    import copy

    inner = copy.deepcopy(model.model.layers[0].linear_attn).to(torch.bfloat16)
    layer = GatedDeltaNetDecode(inner, ROWS, block=4)
    assert layer.conv.dtype == torch.bfloat16 and layer.state.dtype == torch.float32
    x = inputs(ROWS, 20, seed=10)
    with torch.no_grad():
        got = torch.cat([layer.prefill(x[:, :16].bfloat16()), layer.step(x[:, 16:17].bfloat16())], 1)
    want = hf_out(model.model.layers[0].linear_attn, x[:, :17])
    assert got.dtype == torch.bfloat16
    assert (got.float() - want).abs().max() <= 3e-2 * want.abs().max()


def test_decode_layers_finds_every_linear_layer_and_refuses_a_long_block(model):
    layers = decode_layers(model, rows=2, block=3)
    expected = [i for i, kind in enumerate(model.config.layer_types) if kind == "linear_attention"]
    assert sorted(layers) == expected
    with pytest.raises(ValueError, match="longer than this layer keeps"):
        layers[expected[0]].forward(torch.zeros(2, 4, DIM))


@pytest.mark.slow
def test_a_verify_and_commit_trace_as_one_graph_without_host_syncs():
    """torch.compile(fullgraph=True) fails on a graph break: a host sync (.item(), .tolist()) or a value-dependent
    shape in the verify or the commit would fail here, as it would break a CUDA graph capture."""
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng():
        torch.manual_seed(0)
        hf = AutoModelForCausalLM.from_config(family_config("qwen3_5", 64)).float().eval()
    inner = hf.model.layers[0].linear_attn
    layer, eager = GatedDeltaNetDecode(inner, 2, block=4), GatedDeltaNetDecode(inner, 2, block=4)

    def verify_commit(target, x, accepted):
        out = target.forward(x)
        target.commit(accepted)
        return out

    # a fresh Dynamo: compiled entries and frames skipped by earlier tests of this worker process do not carry over
    torch._dynamo.reset()
    compiled = torch.compile(functools.partial(verify_commit, layer), fullgraph=True, dynamic=False)
    x, accepted = inputs(2, 4, seed=11), torch.tensor([1, 4])
    with torch.no_grad():
        got, want = compiled(x, accepted), verify_commit(eager, x, accepted)
    assert_near(got, want)
    torch.testing.assert_close(layer.state, eager.state, atol=1e-6, rtol=1e-5)
