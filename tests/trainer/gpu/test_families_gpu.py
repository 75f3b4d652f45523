"""A sliding-window family at the small shape on the GPU (run on the H200: pytest -m gpu tests/trainer/gpu): a random
Qwen2 of the bench's small shape (hidden 1024, 12 layers) with sliding-window attention on its upper 8 layers (a
window of 300 tokens, not a multiple of the flex tile), saved to disk and loaded through `load_target`. Its bf16
features through the doc-causal flex path equal HF's own forward of each document, and it trains with
step.mode=compile+graph."""
import json

import pytest
import torch

from tests.trainer.conftest import small_cfg
from tests.trainer.test_families import hf_taps, packed_row

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def qwen2_small(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trainer.tiny import build_tokenizer

    tok = build_tokenizer()
    cfg = Qwen2Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=12,
                      num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=4096,
                      use_sliding_window=True, sliding_window=300, max_window_layers=4,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("qwen2_small")
    Qwen2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_flex_features_equal_hf_per_document_in_bf16(qwen2_small):
    from trainer.model.target import load_target

    taps = (1, 6, 11)
    fast = load_target(qwen2_small, num_draft_layers=3, layer_ids=taps, device="cuda", dtype="bfloat16",
                       attn="flex", truncate=False)
    hf = load_target(qwen2_small, num_draft_layers=3, layer_ids=taps, device="cuda", dtype="bfloat16",
                     truncate=False)  # HF's own sdpa forward, its own masks
    lengths = [700, 200, 124]
    ids, pos, doc = packed_row(lengths, 1024, 151936)
    ids, pos, doc = ids.cuda(), pos.cuda(), doc.cuda()
    got = fast.features(ids, pos, doc)
    at = 0
    for n in lengths:
        want = hf_taps(hf, ids[:, at:at + n], taps)
        err = (got[:, at:at + n].float() - want.float()).abs().max().item()
        scale = want.float().abs().max().item()
        assert err <= 2e-2 * scale, (n, err, scale)  # bf16: flex and sdpa round differently, never by a window
        at += n


@pytest.mark.parametrize("draft", [(), ("model.draft_layer_types=[sliding_attention, full_attention, "
                                           "sliding_attention]", "model.draft_sliding_window=200")])
def test_trains_with_compile_and_graph(qwen2_small, tmp_path, draft):
    """Also with sliding-window drafter layers: their flex BlockMask inside the captured, compiled step."""
    from trainer.build import build
    from trainer.loop import TrainLoop
    from trainer.train import finish

    cfg = small_cfg(qwen2_small, "device=cuda", "step.mode=compile+graph", "step.attn=flex", "model.dtype=bfloat16",
                    "model.num_draft_layers=3", "model.target_layer_ids=[1, 6, 11]", "data.seq_len=1024",
                    "data.num_anchors=64", "optim.max_steps=6", "log.every=2", *draft)
    session = build(cfg, tmp_path / "run")
    assert session.state.target.kinds.window == 300
    loop = TrainLoop(session)
    finish(session, loop, loop.run())
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 3 and all(isinstance(x, float) for x in losses)
