"""`python -m trainer.quality.pipeline --recipe quality_cpu` end to end, in a real subprocess."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "trainer.quality.pipeline", *args], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=280)


@pytest.mark.slow
def test_quality_cpu_pipeline_end_to_end(tmp_path):
    out = tmp_path / "q"
    proc = _run("--recipe", "quality_cpu", "--out", str(out))
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
    assert decode["identical"] == decode["prompts"]  # lossless: every output == target-only greedy
    assert 1.0 <= result["tau"] <= B and len(result["accept_by_pos"]) == B - 1
    assert all(a >= b for a, b in zip(result["accept_by_pos"], result["accept_by_pos"][1:]))
    assert 1.0 <= result["simulated_tau"] <= B
    assert result["speedup"] > 0 and decode["target_s"] > 0
    # The decoding benchmark re-runs alone on the pipeline's artifacts.
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    again = subprocess.run([sys.executable, "-m", "trainer.quality.evaluate", "--drafter", str(out / "drafter/export"),
                            "--target", str(out / "target"), "--data", str(out / "data/eval.jsonl"), "--prompts", "2",
                            "--max-new", "9", "--device", "cpu"], cwd=REPO_ROOT, env=env, capture_output=True,
                           text=True, timeout=120)
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


def test_bad_override_is_one_clear_line(tmp_path):
    proc = _run("--recipe", "quality_cpu", "--out", str(tmp_path / "q"), "--set", "drafter.optim.bogus=1")
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: unknown config key 'drafter.optim.bogus'")
    assert not (tmp_path / "q").exists()
