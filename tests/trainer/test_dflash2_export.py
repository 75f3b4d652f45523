"""The DFlash2 export against what the serving stacks' DFlash2 loaders read, and the DFlash export unchanged.

LOADERS below is taken from the loaders' sources (docs/dflash2.md cites the same places):
- SGLang, python/sglang/srt/models/dflash.py: `DFlashDraftModel.__init__` builds `layers.{i}` with
  `attention_conv=grouped_conv()` and `mlp_conv=grouped_conv()` when `dflash_config.conv_kernel_size` is set;
  `DFlashGroupedConv.__init__` registers `base_kernel` [2, taps, hidden] and `kernel_projection` Linear(hidden,
  2 * taps * (hidden // conv_group_size), bias=False); `DFlash2DraftModel.__init__` adds `candidate_selector`
  (`CandidateSelector.__init__`: `predecessor_codebook` and `successor_codebook` [vocab, selector_rank],
  `hidden_projection` Linear(hidden, selector_rank, bias=False)) with `top_k=selector_top_k`;
  `_transform_unary_logits` reads `output_multiplier` and `final_logit_softcapping`.
- vLLM, vllm/model_executor/models/qwen3_dflash2.py: `DFlash2Qwen3DecoderLayer.__init__` reads
  `dflash_config["conv_kernel_size"]` and `["conv_group_size"]` into `attention_conv` / `mlp_conv`
  (`DFlashGroupedConv.__init__`: the same two tensors and shapes); `DFlash2Qwen3Model.__init__` reads
  `["selector_rank"]` and `["selector_top_k"]` into `candidate_selector` (`CandidateSelector.__init__`: the same three
  tensors) and `.get("input_embedding_scale", 1.0)`; `DFlash2Qwen3ForCausalLM.__init__` reads
  `.get("output_multiplier", 1.0)` and `.get("final_logit_softcapping")`; the registry maps the architecture
  "DFlash2DraftModel" to it.
"""
from __future__ import annotations

import hashlib
import json

import torch
from safetensors.torch import load_file

from trainer.export import ExportConfig, export_drafter, load_exported
from trainer.model.drafter import Dflash2Config, Drafter, DrafterConfig

H, V, B, LAYERS = 16, 40, 4, 2
TAPS, GROUP, RANK, TOP_K = 2, 4, 6, 5

ARCHITECTURE = "DFlash2DraftModel"
# dflash_config field -> type, read by both loaders
CONFIG_FIELDS = {"block_size": int, "conv_kernel_size": int, "conv_group_size": int, "selector_rank": int,
                 "selector_top_k": int}
# tensor name -> shape, from the loaders' module trees (module docstring); {i} is every drafter layer
LOADERS = {
    "layers.{i}.attention_conv.base_kernel": (2, TAPS, H),
    "layers.{i}.attention_conv.kernel_projection.weight": (2 * TAPS * (H // GROUP), H),
    "layers.{i}.mlp_conv.base_kernel": (2, TAPS, H),
    "layers.{i}.mlp_conv.kernel_projection.weight": (2 * TAPS * (H // GROUP), H),
    "candidate_selector.predecessor_codebook": (V, RANK),
    "candidate_selector.successor_codebook": (V, RANK),
    "candidate_selector.hidden_projection.weight": (RANK, H),
}


class _Hf:
    hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, head_dim = H, 32, 2, 1, 8
    rms_norm_eps, rope_theta, num_hidden_layers = 1e-6, 10000.0, 4


def export_config(dflash2: Dflash2Config | None) -> ExportConfig:
    cfg = DrafterConfig.from_target(_Hf, num_layers=LAYERS, num_taps=2, dflash2=dflash2)
    return ExportConfig(drafter=cfg, block_size=B, target_layer_ids=(1, 2), num_target_layers=4, mask_token_id=39,
                        vocab_size=V, max_position_embeddings=4096, mask_token="<|MASK|>", bos_token_id=None,
                        eos_token_id=[1, 2], pad_token_id=0)


def fixed_drafter(cfg: DrafterConfig) -> Drafter:
    drafter = Drafter(cfg)
    with torch.no_grad():
        for i, p in enumerate(drafter.parameters()):
            p.copy_(torch.linspace(-1, 1, p.numel()).view_as(p) * (i + 1))
    return drafter


def d2(**over) -> Dflash2Config:
    return Dflash2Config(**{**dict(block_size=B, vocab_size=V, conv_kernel_size=TAPS, conv_group_size=GROUP,
                                   selector_rank=RANK, selector_top_k=TOP_K), **over})


def test_a_dflash2_export_holds_every_tensor_and_field_the_loaders_read(tmp_path):
    ecfg = export_config(d2())
    out = export_drafter(tmp_path / "e", fixed_drafter(ecfg.drafter), ecfg)
    config = json.loads((out / "config.json").read_text())
    tensors = load_file(str(out / "model.safetensors"))
    assert config["architectures"] == [ARCHITECTURE]
    dflash = config["dflash_config"]
    assert {k: (type(dflash[k]), dflash[k]) for k in CONFIG_FIELDS} == {
        "block_size": (int, B), "conv_kernel_size": (int, TAPS), "conv_group_size": (int, GROUP),
        "selector_rank": (int, RANK), "selector_top_k": (int, TOP_K)}
    assert "output_multiplier" not in dflash and "final_logit_softcapping" not in dflash  # the loaders' defaults
    want = {name.format(i=i): shape for name, shape in LOADERS.items() for i in range(LAYERS)}
    assert {k: tuple(tensors[k].shape) for k in want} == want
    # and the rest is the DFlash drafter's, as the DFlash export writes it
    dflash_names = set(Drafter(export_config(None).drafter).state_dict())
    assert set(tensors) == dflash_names | set(want)


def test_the_unary_transform_is_written_where_set_and_an_export_reads_back_to_the_same_drafter(tmp_path):
    ecfg = export_config(d2(output_multiplier=0.5, final_logit_softcapping=30.0))
    drafter = fixed_drafter(ecfg.drafter)
    with torch.no_grad():
        for p in drafter.parameters():
            p.mul_(0.02)
    out = export_drafter(tmp_path / "e", drafter, ecfg, dtype=torch.float32)
    dflash = json.loads((out / "config.json").read_text())["dflash_config"]
    assert dflash["output_multiplier"] == 0.5 and dflash["final_logit_softcapping"] == 30.0
    back, bcfg = load_exported(out)
    assert bcfg.drafter == ecfg.drafter
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), drafter.state_dict().values()))


# sha256 of the DFlash export of `export_config(None)` and `fixed_drafter`, as the trainer wrote it before DFlash2
DFLASH_CONFIG_SHA = "76b177ceb34bd7b20068bd40118303009cf08f134053ca543139168b3f8c6bcd"
DFLASH_WEIGHTS_SHA = "41ee57d98be1f6cd431a993a14bb08531508828fb5c46e3b715acd0404e8b546"


def test_a_dflash_export_is_byte_for_byte_what_it_was(tmp_path):
    ecfg = export_config(None)
    out = export_drafter(tmp_path / "e", fixed_drafter(ecfg.drafter), ecfg)
    assert hashlib.sha256((out / "config.json").read_bytes()).hexdigest() == DFLASH_CONFIG_SHA
    assert hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest() == DFLASH_WEIGHTS_SHA
