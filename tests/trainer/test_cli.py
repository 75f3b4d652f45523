"""The CLI end to end in subprocesses, as the runbooks call it."""
import json
import os
import subprocess
import sys

import pytest

from tests.trainer.conftest import REPO_ROOT


def run_cli(*args, cwd=None):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run([sys.executable, "-m", "trainer", *args], capture_output=True, text=True, env=env,
                          cwd=cwd or REPO_ROOT, timeout=280)


@pytest.mark.slow
def test_train_export_eval_end_to_end(tmp_path, tiny_target_dir):
    run_dir = tmp_path / "run"
    p = run_cli("train", "--recipe", "smoke", "--run-dir", str(run_dir), "--set", f"model.target={tiny_target_dir}",
                "--set", "optim.max_steps=6", "--set", "log.every=2", "--set", "ckpt.every=3", "--set",
                "data.seq_len=128", "--set", "data.max_eval_rows=4")
    assert p.returncode == 0, p.stderr
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("DFLASH_METRICS ")]
    records = [json.loads(ln[len("DFLASH_METRICS "):]) for ln in lines]
    assert [r["step"] for r in records] == [2, 4, 6]
    assert all(len(r["acc_by_pos"]) == 15 and r["tokens_per_s"] > 0 and "lr" in r for r in records)
    assert any(ln.startswith("step 2/6 ") for ln in p.stdout.splitlines())  # the human line
    done = [ln for ln in p.stdout.splitlines() if ln.startswith("DFLASH_DONE ")]
    assert len(done) == 1 and json.loads(done[0][len("DFLASH_DONE "):])["step"] == 6
    assert json.loads((run_dir / "config.json").read_text())["model"]["target"] == str(tiny_target_dir)
    assert [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()] == [2, 4, 6]
    assert sorted(p.name for p in (run_dir / "ckpt").iterdir()) == ["step_3", "step_6"]
    cfg = json.loads((run_dir / "export" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 16
    assert cfg["dflash_config"]["target_layer_ids"] == [1, 3] and cfg["num_target_layers"] == 6
    assert cfg["num_hidden_layers"] == 2

    from safetensors.torch import load_file
    names = set(load_file(str(run_dir / "export" / "model.safetensors")))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.q_proj.weight",
            "layers.0.self_attn.k_norm.weight", "layers.0.mlp.gate_proj.weight"} <= names
    assert not any("embed" in n or "lm_head" in n for n in names)

    ev = run_cli("eval", "--run-dir", str(run_dir))
    assert ev.returncode == 0, ev.stderr
    result = json.loads(next(ln for ln in ev.stdout.splitlines() if ln.startswith("DFLASH_EVAL "))[12:])
    assert 1.0 <= result["tau"] <= 16.0 and result["blocks"] > 0 and len(result["accept_by_pos"]) == 15

    ex = run_cli("export", "--run-dir", str(run_dir))
    assert ex.returncode == 0, ex.stderr
    data = REPO_ROOT / "trainer" / "assets" / "smoke.jsonl"
    ev2 = run_cli("eval", "--drafter", str(run_dir / "export"), "--target", str(tiny_target_dir), "--data", str(data))
    assert ev2.returncode == 0, ev2.stderr
    assert "DFLASH_EVAL " in ev2.stdout


def test_bad_set_is_one_clear_line_and_exit_2(tmp_path):
    p = run_cli("train", "--recipe", "smoke", "--run-dir", str(tmp_path / "r"), "--set", "optim.lrr=1")
    assert p.returncode == 2
    assert p.stderr.splitlines()[0].startswith("error: unknown config key 'optim.lrr'; valid keys here: lr,")
    assert not (tmp_path / "r").exists()


def test_bad_data_exits_3_with_line_numbers(tmp_path, tiny_target_dir):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n" * 3)
    p = run_cli("train", "--recipe", "smoke", "--run-dir", str(tmp_path / "r"), "--set",
                f"model.target={tiny_target_dir}", "--set", f"data.paths=[{bad}]")
    assert p.returncode == 3, p.stderr
    assert "bad.jsonl:1 (invalid JSON" in p.stderr and "bad.jsonl:3" in p.stderr
