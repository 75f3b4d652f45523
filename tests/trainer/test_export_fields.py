"""The exported drafter's config.json, field by field: what SGLang's, vLLM's and SpecForge's DFlash loaders read,
asserted as one dict equality against values taken from the target's own config.json and the run's settings (never
through the export's reader or a `.get(key, default)`). The target's config.json is given values no default has
(theta, eps, positions, a list of eos ids, bos and pad), so a field read through a fallback shows."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.trainer.conftest import small_cfg

# Values no fallback produces; none of them changes a weight's shape, so the tiny target's weights still load.
DISTINCT = {"rope_parameters": {"rope_type": "default", "rope_theta": 12345.0}, "rms_norm_eps": 3e-5,
            "max_position_embeddings": 3000, "bos_token_id": 1, "eos_token_id": [0, 2], "pad_token_id": 4}


@pytest.fixture(scope="module")
def distinct_target(tiny_target_dir, tmp_path_factory) -> Path:
    out = Path(shutil.copytree(tiny_target_dir, tmp_path_factory.mktemp("distinct") / "target"))
    config = json.loads((out / "config.json").read_text())
    config.update(DISTINCT)
    (out / "config.json").write_text(json.dumps(config))
    (out / "generation_config.json").unlink(missing_ok=True)
    return out


def expected(target: Path, *, layers: int, taps: list[int], block: int, layer_types: list[str],
             window: int | None) -> dict:
    t = json.loads((target / "config.json").read_text())
    added = {a["content"]: a["id"] for a in json.loads((target / "tokenizer.json").read_text())["added_tokens"]}
    theta = t["rope_parameters"]["rope_theta"]
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": t["hidden_size"], "intermediate_size": t["intermediate_size"],
        "num_attention_heads": t["num_attention_heads"], "num_key_value_heads": t["num_key_value_heads"],
        "head_dim": t["head_dim"], "num_hidden_layers": layers, "layer_types": layer_types,
        "use_sliding_window": window is not None, "sliding_window": window, "max_window_layers": layers,
        "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0, "rms_norm_eps": t["rms_norm_eps"],
        "rope_theta": theta, "rope_scaling": None, "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "max_position_embeddings": t["max_position_embeddings"], "vocab_size": t["vocab_size"],
        "bos_token_id": t["bos_token_id"], "eos_token_id": t["eos_token_id"], "pad_token_id": t["pad_token_id"],
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "block_size": block,
        "num_target_layers": t["num_hidden_layers"],
        "dflash_config": {"mask_token_id": added["<|MASK|>"], "mask_token": "<|MASK|>", "target_layer_ids": taps,
                          "block_size": block, "num_target_layers": t["num_hidden_layers"]},
    }


@pytest.mark.parametrize("sliding", [False, True])
def test_a_runs_export_config_holds_the_targets_and_the_runs_values_exactly(distinct_target, tmp_path, sliding):
    from trainer.train import export_run, train

    sets = ["optim.max_steps=1", "model.num_draft_layers=2", "model.target_layer_ids=[1, 4]", "model.block_size=8"]
    if sliding:
        sets += ["model.draft_layer_types=[sliding_attention, full_attention]", "model.draft_sliding_window=24"]
    run = tmp_path / "run"
    train(small_cfg(distinct_target, *sets), run, environ={})
    want = expected(distinct_target, layers=2, taps=[1, 4], block=8, window=24 if sliding else None,
                    layer_types=["sliding_attention" if sliding else "full_attention", "full_attention"])
    assert json.loads((run / "export" / "config.json").read_text()) == want
    shutil.rmtree(run / "export")
    export_run(run)  # `trainer export`: the same config from the checkpoint
    assert json.loads((run / "export" / "config.json").read_text()) == want
