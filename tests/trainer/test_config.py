import json

import pytest

from trainer.config import TrainCfg, from_dict, load_config, to_dict
from trainer.errors import ConfigError


def test_recipes_load_and_roundtrip():
    for name in ("smoke", "gpu"):
        cfg = load_config(name)
        assert from_dict(TrainCfg, json.loads(json.dumps(to_dict(cfg)))) == cfg
    gpu = load_config("gpu")
    assert (gpu.optim.lr, gpu.model.block_size, gpu.model.loss_gamma, gpu.data.num_anchors) == (6e-4, 16, 7.0, 512)
    assert gpu.data.tokens_per_step * gpu.optim.accum_steps == 49152  # the seed's budget per optimizer step


def test_set_overrides_with_types():
    cfg = load_config("smoke", ["optim.lr=1e-4", "step.mode=graph", "model.target_layer_ids=[1, 2]",
                                "data.paths=[a.jsonl, b.jsonl]", "model.mask_token_id=null"])
    assert cfg.optim.lr == 1e-4 and cfg.step.mode == "graph"
    assert cfg.model.target_layer_ids == (1, 2) and cfg.data.paths == ("a.jsonl", "b.jsonl")


@pytest.mark.parametrize("item, needle", [
    ("optim.lrr=1", "valid keys here: lr, betas"),
    ("nosuch.x=1", "valid sections: model, data"),
    ("optim.lr=fast", "optim.lr must be a number"),
    ("data.seq_len=1.5", "data.seq_len must be an integer"),
    ("step.mode=turbo", "step.mode must be one of"),
    ("optim.accum_steps=0", "optim.accum_steps must be >= 1"),
    ("optim=3", "is a section"),
    ("novalue", "expects key=value"),
])
def test_bad_overrides_name_the_fix(item, needle):
    with pytest.raises(ConfigError, match=None) as e:
        load_config("smoke", [item])
    assert needle in str(e.value)


def test_unknown_recipe_lists_bundled():
    with pytest.raises(ConfigError, match=r"bundled recipes: gpu, (.*, )?smoke"):  # quality_* recipes sit between
        load_config("nope")


def test_non_eager_mode_on_cpu_is_a_clear_error(tmp_path, tiny_target_dir):
    from tests.trainer.conftest import small_cfg
    from trainer.build import build

    with pytest.raises(ConfigError, match="step.mode=graph needs a CUDA device"):
        build(small_cfg(tiny_target_dir, "step.mode=graph"), tmp_path / "run")
    with pytest.raises(ConfigError, match="step.attn=flex needs a CUDA device"):
        build(small_cfg(tiny_target_dir, "step.attn=flex"), tmp_path / "run")
    assert not (tmp_path / "run" / "config.json").exists()  # refused before anything was written
