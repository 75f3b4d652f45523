import dataclasses
import json

import pytest

from trainer.config import TrainCfg, from_dict, load_config, to_dict
from trainer.errors import ConfigError


def test_recipes_load_and_roundtrip():
    for name in ("smoke", "gpu", "cpu"):
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
    ("loss.dpace_alpha=1.5", "loss.dpace_alpha must be in [0, 1]"),
    ("loss.dpace_norm=tokens", "loss.dpace_norm must be one of"),
    ("loss.selector_alpha=-1", "loss.selector_alpha must be a finite number >= 0"),
    ("optim=3", "is a section"),
    ("novalue", "expects key=value"),
])
def test_bad_overrides_name_the_fix(item, needle):
    with pytest.raises(ConfigError, match=None) as e:
        load_config("smoke", [item])
    assert needle in str(e.value)


@pytest.mark.parametrize("item, near", [
    ("optim.lrr=1", "unknown config key 'optim.lrr' (did you mean 'optim.lr'?); valid keys here: lr, betas"),
    ("step.mdoe=graph", "unknown config key 'step.mdoe' (did you mean 'step.mode'?); valid keys here: mode,"),
    ("seeed=1", "unknown config key 'seeed' (did you mean 'seed'?); valid keys here: model,"),
    ("optm.lr=1", "unknown config section 'optm' in --set optm.lr (did you mean 'optim'?); valid sections: model,"),
    ("optim.zzz=1", "unknown config key 'optim.zzz'; valid keys here: lr,"),  # nothing near: no guess
])
def test_a_set_typo_names_the_near_key_in_its_one_line(item, near):
    with pytest.raises(ConfigError) as e:
        load_config("smoke", [item])
    assert str(e.value).startswith(near) and "\n" not in str(e.value)


def test_a_recipe_typo_names_the_near_key_too(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("optim:\n  warmup_ratoi: 0.1\n")
    with pytest.raises(ConfigError, match=r"^unknown config key 'optim.warmup_ratoi' \(did you mean "
                                          r"'optim.warmup_ratio'\?\); valid keys here: lr,"):
        load_config(str(recipe))


def test_unknown_recipe_lists_bundled():
    with pytest.raises(ConfigError, match=r"bundled recipes: cpu, gpu, (.*, )?smoke"):  # quality_* recipes sit between
        load_config("nope")


def test_non_eager_mode_on_cpu_is_a_clear_error(tmp_path, tiny_target_dir):
    from tests.trainer.conftest import small_cfg
    from trainer.build import build

    with pytest.raises(ConfigError, match="step.mode=graph needs a CUDA device"):
        build(small_cfg(tiny_target_dir, "step.mode=graph"), tmp_path / "run")
    with pytest.raises(ConfigError, match="step.attn=flex needs a CUDA device"):
        build(small_cfg(tiny_target_dir, "step.attn=flex"), tmp_path / "run")
    assert not (tmp_path / "run" / "config.json").exists()  # refused before anything was written


@pytest.mark.parametrize("item, needle", [
    ("optim.eps=-1", "optim.eps must be a finite number > 0, got -1.0"),
    ("optim.eps=0", "optim.eps must be a finite number > 0"),
    ("optim.eps=.inf", "optim.eps must be a finite number > 0, got inf"),
    ("optim.weight_decay=nan", "optim.weight_decay must be a finite number >= 0, got nan"),
    ("optim.weight_decay=-0.1", "optim.weight_decay must be a finite number >= 0"),
    ("optim.lr=.inf", "optim.lr must be a finite number > 0"),
])
def test_optimizer_numbers_torch_would_refuse_or_turn_into_nan_are_config_errors(item, needle):
    with pytest.raises(ConfigError) as e:
        load_config("smoke", [item])
    assert needle in str(e.value)


def test_a_block_longer_than_a_row_is_refused():
    with pytest.raises(ConfigError, match=r"model.block_size=300 does not fit in a row of data.seq_len=128 tokens"):
        load_config("smoke", ["model.block_size=300", "data.seq_len=128"])
    assert load_config("smoke", ["model.block_size=128", "data.seq_len=128"]).model.block_size == 128


@pytest.mark.parametrize("item, needle", [
    ("optim.foo.bar=1", "unknown config key 'optim.foo' in --set optim.foo.bar; optim has no sections; "
                        "valid keys here: lr, betas, eps,"),
    ("optim.lr.x=1", "--set optim.lr.x: 'optim.lr' is a value, not a section; set it with --set optim.lr=..."),
])
def test_a_path_through_a_section_without_sections_names_its_keys(item, needle):
    with pytest.raises(ConfigError) as e:
        load_config("smoke", [item])
    assert needle in str(e.value) and "valid sections: ;" not in str(e.value) + ";"


def test_on_cpu_resets_every_cuda_only_setting_and_nothing_else():
    from trainer.config import cuda_only, on_cpu

    gpu = load_config("gpu", ["pipeline.enabled=true", "pipeline.target_device=cuda:local", "dist.backend=nccl",
                              "step.head_fp8=true", "model.target_fp8=true"])
    assert len(cuda_only(gpu)) == 5
    cpu = on_cpu(gpu)
    assert cuda_only(cpu) == [] and cpu.device == "cpu" and cpu.dist.backend == "gloo"
    assert (cpu.pipeline.enabled, cpu.pipeline.target_device, cpu.step.mode, cpu.step.attn) == \
        (False, "same", "eager", "sdpa")
    assert (cpu.model, cpu.data, cpu.optim, cpu.loss) == (
        dataclasses.replace(gpu.model, target_fp8=False), gpu.data, gpu.optim, gpu.loss)
    compiled = load_config("gpu", ["step.mode=compile", "step.attn=sdpa"])  # compile and head_fp8=auto run on a CPU
    assert on_cpu(compiled) == dataclasses.replace(compiled, device="cpu")


def test_the_gpu_recipe_has_no_data_and_a_start_without_it_is_refused():
    from trainer.targetdir import check_target

    gpu = load_config("gpu", ["model.target=/models/x"])
    assert gpu.data.paths == ()
    with pytest.raises(ConfigError, match=r"^data.paths is empty: name the training JSONL files with "
                                          r"--set 'data.paths=\[...\]'$"):
        check_target(gpu)
    check_target(load_config("gpu", ["model.target=/models/x", "data.paths=[a.jsonl]"]))



@pytest.mark.parametrize("sets, needle", [
    (["model.target_layer_ids=[1, 6]"], "model.target_layer_ids gives [1, 6]; taps must be distinct, ascending and "
                                        "within 0..5"),
    (["model.num_draft_layers=5"], "the default tap spacing for 6 target layers and 5 draft layers gives"),
    (["model.mask_token_id=100000"], "mask token id 100000 (model.mask_token_id) is not a row of the target "
                                     "embedding (0..176)"),
])
def test_taps_and_mask_id_are_checked_against_the_targets_config_json(tiny_target_dir, sets, needle):
    from trainer.targetdir import check_target_dir

    vocab = json.loads((tiny_target_dir / "config.json").read_text())["vocab_size"]
    with pytest.raises(ConfigError) as e:
        check_target_dir(load_config("smoke", [f"model.target={tiny_target_dir}", *sets]))
    assert needle.replace("176", str(vocab - 1)) in str(e.value)
    check_target_dir(load_config("smoke", [f"model.target={tiny_target_dir}", "model.target_layer_ids=[1, 5]",
                                           f"model.mask_token_id={vocab - 1}"]))


@pytest.mark.parametrize("item, needle", [
    ("seed=99999999999999999999999", "seed must be in [0, 2**63), got 99999999999999999999999"),
    ("seed=-1", "seed must be in [0, 2**63), got -1"),
    ("data.max_eval_rows=0", "data.max_eval_rows must be >= 1, got 0"),
    ("data.max_eval_rows=-1", "data.max_eval_rows must be >= 1, got -1"),
])
def test_numbers_torch_would_overflow_on_or_that_mean_nothing_are_refused(item, needle):
    """A seed past torch.manual_seed's signed 64 bits failed with a traceback after the build; max_eval_rows <= 0
    evaluated one batch anyway."""
    with pytest.raises(ConfigError) as e:
        load_config("smoke", [item])
    assert str(e.value) == needle
    assert load_config("smoke", [f"seed={2**63 - 1}", "data.max_eval_rows=1"]).seed == 2**63 - 1


@pytest.mark.parametrize("text, needle", [
    (b"model:\n", "model must be a mapping, got None"),
    (b"model:\n  target: [\n", "is not valid YAML: expected the node content, but found '<stream end>' (line 3, "
                               "column 1)"),
    (b"model:\n  target: \xff\xfe\n", "is not UTF-8 text (byte 18: invalid start byte)"),
])
def test_a_broken_recipe_is_one_line_naming_the_problem(tmp_path, text, needle):
    recipe = tmp_path / "r.yaml"
    recipe.write_bytes(text)
    with pytest.raises(ConfigError) as e:
        load_config(str(recipe))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_a_recipe_path_that_is_a_folder_is_called_one(tmp_path):
    (tmp_path / "somedir.yaml").mkdir()
    with pytest.raises(ConfigError, match=r"^recipe \S+somedir.yaml is a folder, not a recipe file$"):
        load_config(str(tmp_path / "somedir.yaml"))


def test_a_set_value_that_is_not_yaml_is_one_line_with_its_column():
    with pytest.raises(ConfigError) as e:
        load_config("smoke", ["model.target=["])
    assert str(e.value) == ("--set model.target: cannot parse value '[' as YAML: expected the node content, but found "
                            "'<stream end>' (line 1, column 2)")
