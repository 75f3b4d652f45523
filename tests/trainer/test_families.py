"""Every supported target family: the trainer's tapped features equal HF's own forward, document by document, on
packed rows (sliding windows, attention sinks, MoE experts and Gated DeltaNet layers included); each trains end to
end; unsupported families are refused in one line before any weight is read. Real tiny models of each family, saved
to disk and loaded through `load_target`."""
from __future__ import annotations

import json
import re

import pytest
import torch

from tests.trainer.conftest import small_cfg
from tests.trainer.families import FAMILIES, HYBRID_FAMILIES, MOE_FAMILIES
from trainer.errors import ConfigError
from trainer.model.linear_attention import LINEAR, PackedDocs
from trainer.model.target import load_target, packed_causal_mask


def packed_row(lengths: list[int], seq: int, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, vocab, (1, seq), generator=g)
    doc = torch.full((1, seq), -1)
    pos = torch.zeros(1, seq, dtype=torch.long)
    at = 0
    for d, n in enumerate(lengths):
        doc[0, at:at + n] = d
        pos[0, at:at + n] = torch.arange(n)
        at += n
    return ids, pos, doc


def hf_taps(target, ids: torch.Tensor, layer_ids) -> torch.Tensor:
    """HF's own forward of one document alone: hidden_states[i + 1] for each tap, concatenated."""
    out = target.model(input_ids=ids, output_hidden_states=True, use_cache=False)
    return torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)


# Documents across the linear layers' 64-token chunks: one crosses the first boundary, one starts past the second
LENGTHS, SEQ = [9, 70, 11, 64, 6], 176


@pytest.mark.parametrize("family", FAMILIES)
def test_features_equal_hf_per_document(family, family_dirs):
    # Taps 1 and 3 of 4 layers: the last layer's tap is HF's final-norm output (what serving stacks feed).
    target = load_target(family_dirs[family], num_draft_layers=2, layer_ids=(1, 3), truncate=False)
    vocab = target.embed_tokens.weight.shape[0]
    ids, pos, doc = packed_row(LENGTHS, SEQ, vocab)
    got = target.features(ids, pos, doc)
    at = 0
    for n in LENGTHS:
        want = hf_taps(target, ids[:, at:at + n], (1, 3))
        torch.testing.assert_close(got[:, at:at + n], want, atol=2e-5, rtol=1e-4)
        at += n


@pytest.mark.parametrize("family", MOE_FAMILIES + ("qwen3_next", "qwen3_5_moe"))
def test_moe_experts_run_as_grouped_gemms(family, family_dirs):
    """HF's grouped_mm experts: one GEMM per projection for every expert, no per-expert loop syncing with the host
    (the eager loop would break the captured step); the loaded model says which implementation its experts run."""
    target = load_target(family_dirs[family], num_draft_layers=2, layer_ids=(1, 3))
    assert target.model.config._experts_implementation == "grouped_mm"


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_a_recurrence_that_runs_across_documents_would_be_caught(family, family_dirs):
    """The comparison above can fail for hybrids: linear-attention layers handed the row as one document (no reset
    of the convolution and the state at a document start) differ from HF past the first document."""
    target = load_target(family_dirs[family], num_draft_layers=2, layer_ids=(1, 3), truncate=False)
    ids, pos, doc = packed_row(LENGTHS, SEQ, target.embed_tokens.weight.shape[0])
    masks = target.attention_mask(doc)
    masks[LINEAR] = PackedDocs(torch.zeros_like(doc))
    target._taps.clear()
    target.model.model(input_ids=ids, position_ids=pos, attention_mask=masks, use_cache=False)
    wrong = target.join_taps(target._taps)
    target._taps.clear()
    second = slice(LENGTHS[0], LENGTHS[0] + LENGTHS[1])
    assert not torch.allclose(wrong[:, second], hf_taps(target, ids[:, second], (1, 3)), atol=1e-3)


def test_attention_sinks_through_flex_equal_hfs_eager_attention_and_dropping_them_is_caught(family_dirs):
    """gpt-oss on the flex path (tile-sized rows): its sinks enter through flex's log-sum-exp; with the sinks'
    logits pushed to -inf (no sink) the features differ, so the comparison can fail."""
    import warnings

    from tests.trainer.test_target_doc_attention import packed_doc_ids

    ref = load_target(family_dirs["gpt_oss"], num_draft_layers=2, layer_ids=(1, 3), dtype="float32")
    fast = load_target(family_dirs["gpt_oss"], num_draft_layers=2, layer_ids=(1, 3), dtype="float32", attn="flex")
    doc, pos = packed_doc_ids([[100, 28, 200, 56], [384]], 384)
    ids = torch.randint(0, ref.embed_tokens.weight.shape[0], doc.shape, generator=torch.Generator().manual_seed(0))
    want = ref.features(ids, pos, doc)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex on CPU warns that it is the unfused reference
        torch.testing.assert_close(fast.features(ids, pos, doc), want, atol=2e-5, rtol=1e-4)
        for layer in fast.model.model.layers:
            layer.self_attn.sinks.data.fill_(float("-inf"))
        assert not torch.allclose(fast.features(ids, pos, doc), want, atol=1e-3)


@pytest.mark.parametrize("family", ["qwen2", "mistral", "gemma3", "gemma2"])
def test_a_mask_without_the_window_would_be_caught(family, family_dirs):
    """The comparison above can fail: the doc-causal mask alone (the window dropped) differs from HF's forward past
    the window."""
    target = load_target(family_dirs[family], num_draft_layers=2, layer_ids=(1, 3), truncate=False)
    ids, pos, doc = packed_row([12], 16, target.embed_tokens.weight.shape[0])
    target.kinds = None  # every layer read as full attention: the windows dropped
    wrong = target.features(ids, pos, doc)[:, :12]
    assert not torch.allclose(wrong, hf_taps(target, ids[:, :12], (1, 3)), atol=1e-3)


def test_the_dense_window_rule_is_hfs():
    doc = torch.zeros(1, 6, dtype=torch.long)
    doc[0, 4:] = 1
    m = packed_causal_mask(doc, window=2)[0, 0]
    assert m.nonzero().tolist() == [[0, 0], [1, 0], [1, 1], [2, 1], [2, 2], [3, 2], [3, 3], [4, 4], [5, 4], [5, 5]]


def test_an_untapped_last_layer_is_truncated_and_a_tapped_one_kept(family_dirs):
    t = load_target(family_dirs["qwen3"], num_draft_layers=2, layer_ids=(1, 2))
    assert len(t.model.model.layers) == 3
    t = load_target(family_dirs["qwen3"], num_draft_layers=2, layer_ids=(1, 3))
    assert len(t.model.model.layers) == 4


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_trains_end_to_end(family, family_dirs, tmp_path):
    from trainer.build import build
    from trainer.loop import TrainLoop
    from trainer.train import finish

    cfg = small_cfg(family_dirs[family], "model.num_draft_layers=2", "model.target_layer_ids=[1, 3]",
                    "optim.max_steps=3", "data.seq_len=64",
                    "data.num_anchors=6")
    session = build(cfg, tmp_path / "run")
    loop = TrainLoop(session)
    result = finish(session, loop, loop.run())
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 3 and all(isinstance(x, float) and x == x for x in losses)
    exported = json.loads((tmp_path / "run" / "export" / "config.json").read_text())
    assert exported["dflash_config"]["target_layer_ids"] == list(session.state.target.layer_ids)
    assert result.step == 3 and result.export == tmp_path / "run" / "export"


def test_an_mxfp4_checkpoint_loads_as_its_dequantized_weights(tmp_path):
    """gpt-oss as released (MXFP4 experts): every weight the trainer computes with equals the bf16 twin's, and so do
    the features."""
    from tests.trainer.families import build_mxfp4_pair
    from trainer.targetdir import read_target_dir

    plain, packed = build_mxfp4_pair(tmp_path)
    read_target_dir(packed)  # accepted before torch
    a = load_target(plain, num_draft_layers=2, layer_ids=(1, 3), truncate=False)
    b = load_target(packed, num_draft_layers=2, layer_ids=(1, 3), truncate=False)
    got = dict(b.model.named_parameters())
    assert sorted(got) == sorted(n for n, _ in a.model.named_parameters())
    for name, p in a.model.named_parameters():
        assert torch.equal(p, got[name].to(p.dtype)), name
    ids, pos, doc = packed_row(LENGTHS, SEQ, a.embed_tokens.weight.shape[0])
    torch.testing.assert_close(b.features(ids, pos, doc), a.features(ids, pos, doc), atol=0, rtol=0)


def test_qwen35s_multimodal_checkpoint_trains_as_its_language_model(tmp_path):
    """Qwen3.5 ships as an image-text model: its language model loads alone (transformers' causal-LM mapping) and
    gives the features of the same text model saved on its own."""
    import transformers as tf

    from tests.trainer.families import family_config
    from trainer.targetdir import read_target_dir
    from trainer.tiny import build_tokenizer

    tok = build_tokenizer()
    text = family_config("qwen3_5", len(tok)).to_dict()
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text["hidden_size"])
    torch.manual_seed(0)
    vlm = tf.Qwen3_5ForConditionalGeneration(tf.Qwen3_5Config(text_config=text, vision_config=vision))
    vlm.save_pretrained(tmp_path / "vlm")
    tok.save_pretrained(tmp_path / "vlm")
    assert read_target_dir(tmp_path / "vlm").model_type == "qwen3_5"
    target = load_target(tmp_path / "vlm", num_draft_layers=2, layer_ids=(1, 3), truncate=False)
    assert target.hf_config.model_type == "qwen3_5_text" and target.num_layers == 4
    ids, pos, doc = packed_row(LENGTHS, SEQ, target.embed_tokens.weight.shape[0])
    got = target.features(ids, pos, doc)
    at = 0
    for n in LENGTHS:
        out = vlm.model.language_model(input_ids=ids[:, at:at + n], output_hidden_states=True, use_cache=False)
        want = torch.cat([out.hidden_states[2], out.hidden_states[4]], dim=-1)
        torch.testing.assert_close(got[:, at:at + n], want, atol=2e-5, rtol=1e-4)
        at += n


@pytest.mark.parametrize("model_type, extra, needle", [
    ("jamba", {}, "target family 'jamba'"),
    ("qwen3", {"layer_types": ["linear_attention", "full_attention"]}, "layer types ['linear_attention']"),
])
def test_other_linear_mixers_are_refused_before_any_weight(tmp_path, model_type, extra, needle):
    """State-space hybrids, and linear-attention layers in a family whose layers this trainer does not know as
    Gated DeltaNet ones (a linear layer of Qwen3's would be some other mixer)."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(model_type, num_hidden_layers=2, **extra)
    cfg.save_pretrained(tmp_path)  # a config and no weights: the refusal must come before they are read
    with pytest.raises(ConfigError, match=re.escape(needle)) as e:
        load_target(tmp_path, num_draft_layers=1)
    assert "Gated DeltaNet hybrid" in e.value.hint


def test_an_unknown_model_type_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "no-such-family", "num_hidden_layers": 2}')
    with pytest.raises(ConfigError, match="transformers cannot read its config.json"):
        load_target(tmp_path, num_draft_layers=1)


def test_chat_data_without_a_chat_template_is_one_line_and_token_data_needs_none(tmp_path):
    from trainer.data.source import load_samples
    from trainer.errors import DataError
    from trainer.tiny import build_tokenizer

    tok = build_tokenizer()
    tok.chat_template = None  # a base model's tokenizer
    chat = tmp_path / "chat.jsonl"
    chat.write_text('{"conversations": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n')
    with pytest.raises(DataError, match="needs the target tokenizer's chat template"):
        load_samples([str(chat)], tok, len(tok), 0.0)
    ids = tmp_path / "ids.jsonl"
    ids.write_text('{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}\n')
    samples, _report = load_samples([str(ids)], tok, len(tok), 0.0)
    assert samples[0].input_ids.tolist() == [5, 6, 7]
