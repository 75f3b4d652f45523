"""`python -m trainer.quality.sweep`: variants of the quality pipeline side by side, sharing one target."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.trainer.quality.test_pipeline import run_module
from trainer.errors import ConfigError
from trainer.quality.sweep import Variant, check_variants, parse_slots, parse_variant, shares_target

REPO_ROOT = Path(__file__).resolve().parents[3]
SMALL = "regen.train_prompts=12 regen.continuations=4 eval.prompts=1"


def test_a_variant_is_a_name_and_overrides():
    assert parse_variant("base") == Variant("base")
    assert parse_variant("taps 'drafter.model.target_layer_ids=[1, 4, 6]' eval.prompts=48") == Variant(
        "taps", ("drafter.model.target_layer_ids=[1, 4, 6]", "eval.prompts=48"))
    for bad in ("", "../x", "-x a=1", "name not-a-setting", "name =1", "name 'unclosed"):
        with pytest.raises(ConfigError):
            parse_variant(bad)


def test_slots():
    assert parse_slots(None, ["2", "3"]) == ["2", "3"] and parse_slots(None, []) == ["cpu"]
    assert parse_slots("1,0", []) == ["1", "0"] and parse_slots("cpu:3", []) == ["cpu"] * 3
    for bad in ("0,0", "gpu0", "cpu:0", "1,"):
        with pytest.raises(ConfigError):
            parse_slots(bad, ["0", "1"])


def test_default_slots_follow_cuda_visible_devices(monkeypatch):
    from trainer.quality.sweep import _visible_gpus

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert _visible_gpus() == ["2", "3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert _visible_gpus() == []


def test_variants_share_a_target_only_when_they_build_it_alike():
    base, small = Variant("a", ("regen.continuations=4",)), Variant("b", ("regen.continuations=4", "eval.prompts=3"))
    assert shares_target([base, small])
    assert not shares_target([base, Variant("c", ("eval.prompts=3",))])
    assert not shares_target([Variant("a"), Variant("d", ("pretrain.steps=9",))])
    assert shares_target([Variant("a"), Variant("e", ("drafter.model.num_draft_layers=4", "total_budget_s=100"))])


def test_bad_overrides_and_duplicate_names_are_refused_before_anything_runs(tmp_path):
    with pytest.raises(ConfigError, match="--variant b: .*drafter.optim.bogus"):
        check_variants("quality_cpu", [Variant("a"), Variant("b", ("drafter.optim.bogus=1",))])
    with pytest.raises(ConfigError, match="its own name"):
        check_variants("quality_cpu", [Variant("a"), Variant("a")])


def test_a_dflash2_variant_is_checked_against_the_target_before_anything_runs():
    """A DFlash2 variant (the drafter kind as an override) whose groups do not divide quality_cpu's width of 64."""
    bad = Variant("d2", ("drafter.model.drafter=dflash2", "drafter.model.dflash2.conv_group_size=24"))
    with pytest.raises(ConfigError, match=r"^--variant d2: drafter\.model\.dflash2\.conv_group_size=24 does not "
                                          r"divide the drafter's width \(the target's hidden size 64\)$"):
        check_variants("quality_cpu", [Variant("a"), bad])
    check_variants("quality_cpu", [Variant("a"), Variant("d2", ("drafter.model.drafter=dflash2",
                                                               "drafter.optim.name=muon"))])


def test_the_table_names_each_variants_drafter_and_optimizer(tmp_path):
    """From quality.json's drafter record; a run that did not record them (an older pipeline) shows a dash."""
    from trainer.quality.sweep import Job, summarize, table

    jobs = []
    for name, drafter in (("d2", {"steps": 3, "kind": "dflash2", "optim": "muon"}), ("old", {"steps": 4})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "quality.json").write_text(json.dumps({"tau": 2.0, "drafter": drafter}))
        jobs.append(Job(Variant(name), None, tmp_path / name, tmp_path / f"{name}.log", rc=0))
    d2, old = rows = [summarize(job) for job in jobs]
    assert (d2["drafter"], d2["optim"], d2["drafter_steps"]) == ("dflash2", "muon", 3)
    assert (old["drafter"], old["optim"], old["drafter_steps"]) == (None, None, 4)
    header, first, second = (line.split() for line in table(rows).splitlines())
    assert header[:5] == ["variant", "status", "drafter", "optim", "tau"]
    assert first[:5] == ["d2", "ok", "dflash2", "muon", "2.0"] and second[:5] == ["old", "ok", "-", "-", "2.0"]


def test_a_gpu_recipe_on_cpu_slots_is_refused_before_anything_runs(tmp_path):
    check_variants("quality_gpu", [Variant("a")], ["0", "1"])  # GPU slots: it runs there
    proc = _sweep("--recipe", "quality_gpu", "--out", str(tmp_path / "s"), "--variant", "a", "--slots", "cpu")
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[0] == ("error: --variant a: recipe quality_gpu needs a CUDA GPU: "
                                           "drafter.step.attn=flex has no CPU path, and this run is on the cpu")
    assert proc.stdout == "" and not (tmp_path / "s").exists()


def _sweep(*args: str) -> subprocess.CompletedProcess:
    return run_module("trainer.quality.sweep", *args)


@pytest.mark.slow
def test_two_variants_side_by_side_on_one_target(tmp_path):
    """Two CPU slots: the first variant runs the whole pipeline; the second waits for its regenerate stage, then trains
    its own drafter (block size 4) on that target and data. One table, one DFLASH_SWEEP line, sweep.json."""
    out = tmp_path / "sweep"
    proc = _sweep("--recipe", "quality_cpu", "--out", str(out), "--slots", "cpu:2", "--variant", f"base {SMALL}",
                  "--variant", f"b4 {SMALL} drafter.model.block_size=4")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(proc.stdout.split("DFLASH_SWEEP ", 1)[1])
    assert result == json.loads((out / "sweep.json").read_text())
    assert result["shared_target"] is True
    base, b4 = result["variants"]
    assert base["status"] == b4["status"] == "ok" and base["reused_from"] is None
    assert (base["drafter"], base["optim"], b4["drafter"], b4["optim"]) == ("dflash", "adamw", "dflash", "adamw")
    assert b4["reused_from"] == str(out / "base")
    q4 = json.loads((out / "b4" / "quality.json").read_text())
    assert q4["reused_from"] == str((out / "base").resolve()) and q4["eval"]["decode"]["block_size"] == 4
    assert 1.0 <= b4["tau"] <= 4 and 1.0 <= base["tau"] <= 8
    assert "== stage pretrain" in (out / "base.log").read_text()
    assert "== stage pretrain" not in (out / "b4.log").read_text()
    assert "variant" in proc.stdout and "simulated_tau" in proc.stdout  # the table's header
    # The operator CLI's runbook proves a sweep alive by this pattern: it must match what the sweep prints.
    book = yaml.safe_load((REPO_ROOT / "runbooks" / "quality-sweep.yaml").read_text())
    assert re.search(book["liveness"]["pattern"], proc.stdout.splitlines()[0])
    assert book["command"][:3] == ["{python}", "-m", "trainer.quality.sweep"]
    assert book["command"][book["command"].index("--out") + 1].startswith("{run_dir}/")


def _processes_mentioning(text: str) -> list[int]:
    """PIDs whose command line contains `text` (read from /proc; nothing is signalled)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_stopping_the_sweep_stops_the_pipelines_it_started(tmp_path):
    """SIGTERM to the sweep alone (not its group): it terminates the pipeline it runs and exits 130; no process of
    the sweep is left."""
    out = tmp_path / "sweep"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONUNBUFFERED": "1"}
    sweep = subprocess.Popen([sys.executable, "-m", "trainer.quality.sweep", "--recipe", "quality_cpu", "--out",
                              str(out), "--variant", "base", "--variant", "b2 eval.prompts=1"], cwd=REPO_ROOT,
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        while not (out / "base.log").exists() or len(_processes_mentioning(str(out / "base"))) < 1:
            assert sweep.poll() is None, "the sweep ended before its first pipeline started"
            time.sleep(0.2)
        sweep.send_signal(signal.SIGTERM)
        _, err = sweep.communicate()
        assert sweep.returncode == 130 and "interrupted" in err
        deadline = time.monotonic() + 60  # the sweep waited for them: they are gone, or about to be
        while _processes_mentioning(str(out)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _processes_mentioning(str(out)) == []
    finally:
        if sweep.poll() is None:
            os.killpg(sweep.pid, signal.SIGKILL)


def test_a_non_empty_out_dir_is_refused_and_kept(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    proc = _sweep("--recipe", "quality_cpu", "--out", str(tmp_path), "--variant", "a")
    assert proc.returncode == 2 and "not empty" in proc.stderr
    assert (tmp_path / "keep.txt").read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]
