"""`python -m trainer.quality.pipeline --recipe quality_cpu` end to end, in a real subprocess."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]


def run_module(module: str, *args: str, **env_extra: str) -> subprocess.CompletedProcess:
    """`python -m module args...` from the repository root, as a user runs it (also when not pip-installed), waited
    for until it exits (the session's pytest timeout guards hangs)."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONUNBUFFERED": "1", **env_extra}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True)


def _run(*args: str) -> subprocess.CompletedProcess:
    return run_module("trainer.quality.pipeline", *args)


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """One `quality_cpu` pipeline run (its directory, its process), shared by the tests that read it; none writes
    into it (the --reuse test checks that it is never written)."""
    out = tmp_path_factory.mktemp("quality") / "q"
    return out, _run("--recipe", "quality_cpu", "--out", str(out))


@pytest.mark.slow
def test_quality_cpu_pipeline_end_to_end(cpu_run):
    out, proc = cpu_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("DFLASH_QUALITY ")]
    assert len(lines) == 1
    result = json.loads(lines[0].split(" ", 1)[1])
    assert result == json.loads((out / "quality.json").read_text())
    for stage in ("pretrain", "regenerate", "drafter", "eval"):
        assert f"== stage {stage}: " in proc.stdout
        assert result["timings_s"][stage] >= 0
    # Every stage left its artifact where the next one (and a person) finds it.
    assert (out / "target" / "config.json").is_file() and (out / "target" / "tokenizer.json").is_file()
    assert result["regen"]["train_samples"] >= 1 and (out / "data" / "eval.jsonl").stat().st_size > 0
    assert (out / "drafter" / "export" / "model.safetensors").is_file()
    assert "DFLASH_METRICS " in proc.stdout and "DFLASH_EVAL " in proc.stdout
    decode, B = result["eval"]["decode"], 8
    assert decode["block_size"] == B and decode["prompts"] >= 1
    assert decode["identical"] == decode["prompts"]  # every output == target-only greedy, and yet on a CPU
    unmet = decode["lossless"]["unmet"]  # not by construction: the HF RMSNorm and SDPA ran
    assert result["lossless_by_construction"] is False and any("attention sdpa" in u for u in unmet), unmet
    assert decode["engine"] == "static" and decode["matches_hf"] is True  # and the engine equals HF's own decoding
    # Decoding sees what training saw: every prompt's rounds, replayed teacher-forced in the training layout, accept
    # exactly what the real rounds accepted.
    assert decode["replayed_equal"] == decode["prompts"] and decode["replayed_tau"] is not None
    assert 1.0 <= result["tau"] <= B and len(result["accept_by_pos"]) == B - 1
    assert all(a >= b for a, b in zip(result["accept_by_pos"], result["accept_by_pos"][1:]))
    assert 1.0 <= result["simulated_tau"] <= B
    assert result["replayed_tau"] == decode["replayed_tau"]
    assert result["speedup"] > 0 and decode["target_s"] > 0
    # The decoding benchmark (bench/speculative.py) re-runs alone on the pipeline's artifacts.
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    again = subprocess.run([sys.executable, "-m", "bench.speculative", "--drafter", str(out / "drafter/export"),
                            "--target", str(out / "target"), "--data", str(out / "data/eval.jsonl"), "--prompts", "2",
                            "--max-new", "9", "--device", "cpu"], cwd=REPO_ROOT, env=env, capture_output=True,
                           text=True)
    assert again.returncode == 0, again.stderr[-2000:]
    line = [x for x in again.stdout.splitlines() if x.startswith("DFLASH_DECODE ")][-1]
    rerun = json.loads(line.split(" ", 1)[1])
    assert rerun["prompts"] == rerun["identical"] == 2 and rerun["tokens"] <= 18


def test_refuses_a_non_empty_out_dir_and_keeps_it(tmp_path):
    keep = tmp_path / "quality.json"
    keep.write_text('{"precious": true}\n')
    proc = _run("--recipe", "quality_cpu", "--out", str(tmp_path))
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 2 and "not empty" in proc.stderr and "hint:" in proc.stderr
    assert keep.read_text() == '{"precious": true}\n'


def test_a_gpu_recipe_without_a_gpu_is_refused_before_any_stage(tmp_path):
    """quality_gpu on a machine without CUDA (here: none visible) is one line, exit 2, and nothing written: it must
    not start pretraining on the CPU."""
    proc = run_module("trainer.quality.pipeline", "--recipe", "quality_gpu", "--out", str(tmp_path / "q"),
                      CUDA_VISIBLE_DEVICES="")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "error: recipe quality_gpu needs a CUDA GPU: drafter.step.attn=flex has no CPU path, and this run is on the cpu",
        "hint: run it on a GPU machine; on a CPU the tiny variant is --recipe quality_cpu"]
    assert proc.stdout == "" and not (tmp_path / "q").exists()


def test_bad_override_is_one_clear_line(tmp_path):
    proc = _run("--recipe", "quality_cpu", "--out", str(tmp_path / "q"), "--set", "drafter.optim.bogus=1")
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: unknown config key 'drafter.optim.bogus'")
    assert not (tmp_path / "q").exists()


@pytest.mark.slow
def test_reuse_trains_a_new_drafter_on_an_earlier_runs_target_and_data(cpu_run, tmp_path):
    """--reuse skips pretrain + regenerate, reads the earlier run without writing it, and a run whose regenerate
    stage never finished cannot be reused."""
    (first, proc), second = cpu_run, tmp_path / "second"
    small = ("--set", "eval.prompts=1",)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stages = json.loads((first / "stages.json").read_text())
    assert set(stages) == {"pretrain", "regenerate", "drafter", "eval"}
    before = {p: p.stat().st_mtime_ns for p in (first / "target").iterdir()} | {
        p: p.stat().st_mtime_ns for p in (first / "data").iterdir()}
    proc = _run("--recipe", "quality_cpu", "--out", str(second), "--reuse", str(first), *small,
                "--set", "drafter.model.block_size=4", "--set", "eval.engine=hf", "--set", "eval.also_dtype=float32",
                "--set", "total_budget_s=100", "--set", "eval_reserve_s=10")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "drafter budget: " in proc.stdout and "total_budget_s 100 - " in proc.stdout
    assert "== stage pretrain" not in proc.stdout and "== stage regenerate" not in proc.stdout
    result = json.loads((second / "quality.json").read_text())
    assert result["reused_from"] == str(first.resolve())
    assert result["target"]["path"] == str(first.resolve() / "target")
    assert result["eval"]["decode"]["block_size"] == 4 and result["identical"].split("/")[0] == \
        result["identical"].split("/")[1]
    # The second decoding benchmark (eval.also_dtype), through the reference engine this time.
    assert result["eval"]["decode"]["engine"] == result["eval"]["decode_also"]["engine"] == "hf"
    assert result["also"]["target_dtype"] == "float32" and result["also"]["tau"] == result["tau"]
    assert not (second / "target").exists() and (second / "drafter" / "export" / "model.safetensors").is_file()
    # Under --reuse the budget counts the reused stages' own time, as the original run's drafter had it.
    used = result["target"]["seconds"] + result["regen"]["seconds"]
    assert f"total_budget_s 100 - {used:.0f}s used by the reused stages - eval_reserve_s 10)" in proc.stdout

    # A total budget that leaves the drafter no time: it trains no step, says so, and the run still ends.
    no_time = tmp_path / "no_time"
    proc = _run("--recipe", "quality_cpu", "--out", str(no_time), "--reuse", str(first), *small,
                "--set", "total_budget_s=1", "--set", "eval_reserve_s=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    drafted = json.loads((no_time / "quality.json").read_text())["drafter"]
    assert drafted["steps"] == 0 and drafted["stopped_by"] == "budget" and "drafter budget: 0s" in proc.stdout
    assert {p: p.stat().st_mtime_ns for p in before} == before  # the earlier run is read, never written
    # A reusing run can itself be reused (its stages.json carries the reused records).
    reused = json.loads((second / "stages.json").read_text())
    assert reused["pretrain"]["reused_from"] == str(first.resolve()) and "drafter" in reused
    # A run without a finished regenerate stage: one clear line, exit 2, nothing created.
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "stages.json").write_text(json.dumps({"pretrain": stages["pretrain"]}))
    proc = _run("--recipe", "quality_cpu", "--out", str(tmp_path / "third"), "--reuse", str(tmp_path / "broken"))
    assert proc.returncode == 2 and proc.stderr.startswith("error: --reuse ") and "regenerate" in proc.stderr
    assert not (tmp_path / "third").exists()


@pytest.mark.slow
def test_a_hybrid_target_goes_through_every_stage_and_decodes_losslessly(tmp_path):
    """target.family=qwen3_5: a Gated DeltaNet hybrid pretrained, regenerating and decoding through the static engine
    (its layer stack; no fallback note), every output equal to the target's alone."""
    out = tmp_path / "q"
    proc = _run("--recipe", "quality_cpu", "--out", str(out), "--set", "target.family=qwen3_5",
                "--set", "pretrain.steps=30", "--set", "regen.train_prompts=16", "--set", "regen.continuations=8",
                "--set", "eval.prompts=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "quality.json").read_text())
    assert json.loads((out / "target" / "config.json").read_text())["model_type"] == "qwen3_5_text"
    decode = result["eval"]["decode"]
    assert decode["engine"] == "static" and decode["prompts"] == 2 and decode["identical"] == 2
    assert decode["replayed_equal"] == 2 and result["regen"]["continuation_engine"] == "static"
    assert result["regen"]["answer_engine"] == "static"
    assert "note: the static engine cannot serve this target" not in proc.stdout


DFLASH2_MUON = ("--set", "drafter.model.drafter=dflash2", "--set", "drafter.optim.name=muon")


@pytest.mark.parametrize("sets, message", [
    (("drafter.model.dflash2.selector_top_k=4",),
     "error: model.dflash2.selector_top_k is a DFlash2 option and model.drafter=dflash"),
    (("drafter.model.drafter=dflash2", "drafter.model.dflash2.conv_kernel_size=9"),
     "error: model.dflash2.conv_kernel_size=9 is longer than the block (model.block_size=8)"),
    pytest.param(("drafter.model.drafter=dflash2", "drafter.model.dflash2.conv_group_size=24"),
                 "error: drafter.model.dflash2.conv_group_size=24 does not divide the drafter's width (the target's "
                 "hidden size 64)"),
    pytest.param(("drafter.model.drafter=dflash2", "drafter.model.dflash2.selector_top_k=1000"),
                 "error: drafter.model.dflash2.selector_top_k=1000 is more than the target's vocabulary (512)"),
])
def test_what_a_dflash2_drafter_cannot_run_is_one_line_exit_2_before_torch(tmp_path, sets, message):
    """quality_cpu's target: hidden size 64, a vocabulary of at most 512; its drafter's block: 8."""
    from tests.trainer.test_cli import imported

    args = [x for s in sets for x in ("--set", s)]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "trainer.quality.pipeline", "--recipe",
                           "quality_cpu", "--out", str(tmp_path / "q"), *args], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True)
    errors = [ln for ln in proc.stderr.splitlines() if not ln.startswith(("import time:", "hint:"))]
    assert proc.returncode == 2 and len(errors) == 1 and errors[0].startswith(message), proc.stderr[-2000:]
    assert "torch" not in imported(proc.stderr) and not (tmp_path / "q").exists()


def test_a_dflash2_drafter_is_checked_against_the_recipes_target_or_the_reused_one(tmp_path):
    """check_drafter_fits_target: the width and vocabulary of the target the recipe builds, or under --reuse those of
    the reused target's config.json (which the recipe's target section then does not describe)."""
    import dataclasses

    from trainer.errors import ConfigError
    from trainer.quality.config import check_drafter_fits_target, load_recipe

    def with_drafter(**dflash2):
        q = load_recipe("quality_cpu")
        model = dataclasses.replace(q.drafter.model, drafter="dflash2",
                                    dflash2=dataclasses.replace(q.drafter.model.dflash2, **dflash2))
        object.__setattr__(q, "drafter", dataclasses.replace(q.drafter, model=model))
        return q

    check_drafter_fits_target(with_drafter())  # 16 divides 64, 16 candidates of at most 512
    with pytest.raises(ConfigError, match=r"^drafter\.model\.dflash2\.conv_group_size=24 does not divide .* 64\)$"):
        check_drafter_fits_target(with_drafter(conv_group_size=24))
    with pytest.raises(ConfigError, match=r"^drafter\.model\.dflash2\.selector_top_k=600 is more than .*\(512\)$"):
        check_drafter_fits_target(with_drafter(selector_top_k=600))
    reused = tmp_path / "target"
    reused.mkdir()
    (reused / "config.json").write_text(json.dumps({"hidden_size": 48, "vocab_size": 1000, "num_hidden_layers": 6}))
    check_drafter_fits_target(with_drafter(selector_top_k=600), str(reused))  # the reused vocabulary is larger
    with pytest.raises(ConfigError, match="conv_group_size=32 does not divide the drafter's width .* 48"):
        check_drafter_fits_target(with_drafter(conv_group_size=32), str(reused))


@pytest.mark.slow
def test_a_dflash2_drafter_with_muon_trains_and_exports_through_the_drafter_stage(cpu_run, tmp_path):
    """The pipeline's drafter stage (drafter_train_cfg, train_drafter) on a reused run's target and data trains a
    DFlash2 drafter with Muon, records both, and exports it as DFlash2DraftModel; the simulated eval reads it. (The
    decode stage: test_a_dflash2_muon_variant_runs_end_to_end_on_a_reused_target.)"""
    import dataclasses

    import torch

    from trainer.eval import evaluate_run
    from trainer.quality.config import load_recipe
    from trainer.quality.pipeline import drafter_train_cfg, heldout_rows, reused_stages, train_drafter

    first, proc = cpu_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    pre, regen = reused_stages(first, tmp_path / "out")
    cfg = drafter_train_cfg(load_recipe("quality_cpu"), Path(pre.path), regen, torch.device("cpu"))
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, drafter="dflash2"),
                              optim=dataclasses.replace(cfg.optim, name="muon", max_steps=4))
    drafted = train_drafter(cfg, tmp_path / "drafter", budget_s=300)
    assert (drafted.kind, drafted.optim, drafted.steps, drafted.stopped_by) == ("dflash2", "muon", 4, "steps")
    exported = json.loads((tmp_path / "drafter" / "export" / "config.json").read_text())
    assert exported["architectures"] == ["DFlash2DraftModel"]
    assert exported["dflash_config"]["selector_top_k"] == 16
    simulated = evaluate_run(tmp_path / "drafter", rows=heldout_rows(cfg, Path(pre.path)))
    assert 1.0 <= simulated["tau"] <= 8


@pytest.mark.slow
def test_a_dflash2_muon_variant_runs_end_to_end_on_a_reused_target(cpu_run, tmp_path):
    """The variant the sweep runs: a DFlash2 drafter trained with Muon on the first run's target and data, decoded
    speculatively, every output the target's own; quality.json names the drafter kind and the optimizer."""
    first, proc = cpu_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "dflash2"
    proc = _run("--recipe", "quality_cpu", "--out", str(out), "--reuse", str(first), "--set", "eval.prompts=2",
                *DFLASH2_MUON)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "quality.json").read_text())
    assert (result["drafter"]["kind"], result["drafter"]["optim"]) == ("dflash2", "muon")
    assert json.loads((out / "drafter" / "export" / "config.json").read_text())["architectures"] == [
        "DFlash2DraftModel"]
    decode = result["eval"]["decode"]
    assert decode["prompts"] == 2 and decode["identical"] == 2 and 1.0 <= result["tau"] <= 8
    assert 1.0 <= result["simulated_tau"] <= 8 and result["speedup"] > 0
