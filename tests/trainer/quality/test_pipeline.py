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
    """target.family=qwen3_5: a Gated DeltaNet hybrid pretrained, regenerating and decoding through the hf engine
    (one note each: the static engine does not serve it), every output equal to the target's alone."""
    out = tmp_path / "q"
    proc = _run("--recipe", "quality_cpu", "--out", str(out), "--set", "target.family=qwen3_5",
                "--set", "pretrain.steps=30", "--set", "regen.train_prompts=16", "--set", "regen.continuations=8",
                "--set", "eval.prompts=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "quality.json").read_text())
    assert json.loads((out / "target" / "config.json").read_text())["model_type"] == "qwen3_5_text"
    decode = result["eval"]["decode"]
    assert decode["engine"] == "hf" and decode["prompts"] == 2 and decode["identical"] == 2
    assert decode["replayed_equal"] == 2 and result["regen"]["continuation_engine"] == "static->hf"
    assert "note: the static engine cannot serve this target" in proc.stdout
