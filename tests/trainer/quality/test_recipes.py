"""The quality recipes and runbook are consistent before any GPU time is spent on them (pure: YAML only)."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from trainer.errors import ConfigError
from trainer.quality.config import load_recipe

REPO_ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("name", ["quality_gpu", "quality_cpu"])
def test_recipe_validates_and_fits_its_target(name):
    q = load_recipe(name)
    drafter = q.drafter
    taps = drafter.model.target_layer_ids
    assert taps is None or max(taps) < q.target.num_layers
    assert drafter.data.num_anchors < drafter.data.seq_len
    assert q.regen.max_new_tokens + 64 < drafter.data.seq_len  # an answer + its prompt fit one packed row


def test_gpu_recipe_budgets_fit_ten_minutes():
    q = load_recipe("quality_gpu")
    assert 0 < q.total_budget_s <= 600 - 40  # the drafter's budget is derived from it; 40 s for start-up and saving
    benchmarks = 2 if q.eval.also_dtype else 1
    assert q.eval_reserve_s >= benchmarks * q.eval.budget_s + 10  # the decode loops + loading + simulated eval
    # Even with pretrain and regenerate at their budgets, the drafter keeps time to train.
    assert q.total_budget_s - q.pretrain.budget_s - q.regen.budget_s - q.eval_reserve_s >= 120


def test_drafter_budget_is_what_the_total_leaves():
    import dataclasses

    from trainer.quality.pipeline import drafter_budget

    q = load_recipe("quality_gpu")
    assert drafter_budget(q, 150.0) == q.total_budget_s - 150.0 - q.eval_reserve_s
    assert drafter_budget(q, 0.0) == q.drafter_budget_s  # never more than the drafter's own cap
    assert drafter_budget(q, q.total_budget_s) == 0.0  # nothing left: no negative budgets
    off = dataclasses.replace(q, total_budget_s=0.0)
    assert drafter_budget(off, 500.0) == q.drafter_budget_s


def test_runbook_launches_the_pipeline_with_a_bundled_recipe():
    book = yaml.safe_load((REPO_ROOT / "runbooks" / "quality.yaml").read_text())
    cmd = book["command"]
    assert cmd[:3] == ["{python}", "-m", "trainer.quality.pipeline"]
    load_recipe(cmd[cmd.index("--recipe") + 1])
    assert cmd[cmd.index("--out") + 1].startswith("{run_dir}/")  # a fresh subdirectory: never the run dir itself


def test_unknown_recipe_key_names_the_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("pretrain:\n  stepz: 3\ndrafter: {}\n")
    with pytest.raises(ConfigError, match="pretrain.stepz"):
        load_recipe(str(bad))
    bad.write_text("drafter:\n  optim:\n    lrr: 1\n")
    with pytest.raises(ConfigError, match=r"^unknown config key 'drafter.optim.lrr' \(did you mean 'drafter.optim.lr'"):
        load_recipe(str(bad))


def test_a_set_typo_gets_the_trainers_near_key():
    with pytest.raises(ConfigError, match=r"^unknown config key 'drafter.optim.lrr' \(did you mean "
                                          r"'drafter.optim.lr'\?\); valid keys here: lr,"):
        load_recipe("quality_cpu", ["drafter.optim.lrr=1"])
    with pytest.raises(ConfigError, match=r"^unknown config section 'pretrian' in --set pretrian.steps \(did you "
                                          r"mean 'pretrain'\?\)"):
        load_recipe("quality_cpu", ["pretrian.steps=1"])


def test_overrides_reach_every_section_through_one_parser():
    q = load_recipe("quality_cpu", ["pretrain.steps=7", "drafter.optim.lr=1e-3", "drafter.model.target_layer_ids=[1, 2]"])
    assert (q.pretrain.steps, q.drafter.optim.lr, q.drafter.model.target_layer_ids) == (7, 1e-3, (1, 2))
    with pytest.raises(ConfigError, match="valid sections: .*drafter"):
        load_recipe("quality_cpu", ["nosuch.x=1"])
    with pytest.raises(ConfigError, match="drafter.optim.lr must be a number"):
        load_recipe("quality_cpu", ["drafter.optim.lr=fast"])


def test_a_dflash2_drafter_is_a_quality_recipes_drafter():
    """Its decode stage decodes a DFlash2 drafter (tests/trainer/decode/test_dflash2_decode.py)."""
    q = load_recipe("quality_cpu", ["drafter.model.drafter=dflash2", "drafter.model.dflash2.selector_rank=8"])
    assert (q.drafter.model.drafter, q.drafter.model.dflash2.selector_rank) == ("dflash2", 8)
