"""Experiment tracking (track.backends): a real run logs to TensorBoard event files, an offline W&B run and an MLflow
file store, each read back with the backend's own reader; a resumed run continues the same tracked run."""
from __future__ import annotations

import json

import pytest

from tests.trainer.conftest import small_cfg
from trainer.tracking import scalars


def run(target_dir, run_dir, stop_at: int = 0, resume=False):
    from trainer.loop import StopRule
    from trainer.train import train

    cfg = small_cfg(target_dir, "track.backends=[tensorboard, wandb, mlflow]", "optim.max_steps=4", "ckpt.every=2",
                    "log.every=1", "eval_at_end=true")
    return train(cfg, run_dir, resume=resume, environ={}, stop=StopRule(steps=stop_at))


def metrics(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


@pytest.mark.slow
def test_every_backend_sees_the_run_and_a_resume_continues_it(tiny_target_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the reader below opens the same local store
    run_dir = tmp_path / "run"
    first = run(tiny_target_dir, run_dir, stop_at=2)
    ids = json.loads((run_dir / "tracking" / "runs.json").read_text())
    assert set(ids) == {"wandb", "mlflow"}
    second = run(tiny_target_dir, run_dir, resume=True)
    assert json.loads((run_dir / "tracking" / "runs.json").read_text()) == ids  # the same tracked runs, continued
    want = metrics(run_dir)
    assert sorted(want) == [1, 2, 3, 4]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(run_dir / "tracking" / "tensorboard"))
    tb.Reload()
    events = tb.Scalars("train/loss")
    assert [e.step for e in events] == [1, 2, 3, 4]
    assert [e.value for e in events] == pytest.approx([want[s] for s in (1, 2, 3, 4)], rel=1e-6)
    assert "train/acc_by_pos/1" in tb.Tags()["scalars"]
    assert [e.value for e in tb.Scalars("eval/tau")] == pytest.approx([first.tau, second.tau])

    from mlflow import MlflowClient

    client = MlflowClient((run_dir / "tracking" / "mlruns").as_uri())
    history = client.get_metric_history(ids["mlflow"], "train/loss")
    assert sorted(m.step for m in history) == [1, 2, 3, 4]
    assert {m.step: m.value for m in history} == pytest.approx(want, rel=1e-6)
    assert client.get_run(ids["mlflow"]).info.status == "FINISHED"

    offline = list((run_dir / "tracking" / "wandb").glob(f"offline-run-*-{ids['wandb']}"))
    assert len(offline) == 2 and all(list(d.glob("*.wandb")) for d in offline)  # one per process, one run id


def test_records_flatten_to_named_scalars():
    got = scalars({"step": 3, "loss": 1.5, "acc": 0.25, "acc_by_pos": [0.5, None, 0.1], "lr": 1e-3, "world": 1,
                   "tokens_per_s": 10})
    assert got == {"train/loss": 1.5, "train/acc": 0.25, "train/acc_by_pos/1": 0.5, "train/acc_by_pos/3": 0.1,
                   "train/lr": 1e-3, "train/tokens_per_s": 10.0}


def test_an_unknown_backend_is_refused_by_the_config():
    from trainer.config import load_config
    from trainer.errors import ConfigError

    with pytest.raises(ConfigError, match="track.backends: unknown"):
        load_config("smoke", ["track.backends=[comet]"])


def test_a_backend_whose_package_is_absent_is_refused_before_torch(tmp_path, tiny_target_dir):
    """The package made unimportable the way a missing one is (sys.modules[name] = None: find_spec gives None,
    import raises ImportError), before the trainer starts."""
    import os
    import subprocess
    import sys

    from tests.trainer.conftest import REPO_ROOT
    from tests.trainer.test_cli import error_lines, imported

    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['wandb'] = None\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hide), str(REPO_ROOT)])}
    p = subprocess.run([sys.executable, "-X", "importtime", "-m", "trainer", "train", "--recipe", "smoke", "--run-dir",
                        str(tmp_path / "r"), "--set", f"model.target={tiny_target_dir}", "--set",
                        "track.backends=[tensorboard, wandb]"], capture_output=True, text=True, env=env, cwd=REPO_ROOT)
    assert p.returncode == 2, p.stderr[-2000:]
    assert error_lines(p.stderr) == ["error: track.backends names wandb, but the wandb package is not installed: pip "
                                     "install wandb, or drop wandb from track.backends"]
    assert "torch" not in imported(p.stderr) and not (tmp_path / "r").exists()


def test_wandb_without_a_login_is_one_config_error_not_a_traceback(tmp_path, tiny_target_dir, monkeypatch):
    """No WANDB_MODE, no API key, a HOME without a .netrc (tests/conftest.py): wandb.init refuses at once, offline."""
    from tests.trainer.test_cli import error_lines, run_cli

    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_DISABLED", "WANDB_OFFLINE", "WANDB_CONFIG_DIR"):
        monkeypatch.delenv(var, raising=False)
    sets = [f"model.target={tiny_target_dir}", "track.backends=[wandb]", "data.seq_len=96", "data.rows_per_step=2",
            "data.num_anchors=8", "optim.max_steps=1", "ckpt.every=0", "eval_at_end=false"]
    args = [x for s in sets for x in ("--set", s)]
    p = run_cli("train", "--recipe", "smoke", "--run-dir", str(tmp_path / "r"), *args)
    assert p.returncode == 2, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    assert error_lines(p.stderr)[-1:] == ["error: track.backends: wandb could not start a run (No API key configured. "
                                          "Use `wandb login` to log in.); log in (wandb login, or WANDB_API_KEY), or "
                                          "run offline with WANDB_MODE=offline, or drop wandb from track.backends"]
    # the failed start took back what it wrote (config.json, tracking/), so the same command may run again
    assert not (tmp_path / "r").exists()


def test_runs_sharing_a_track_dir_each_get_their_own_folder_and_a_fresh_run_never_continues_another(
        tmp_path, tiny_target_dir, monkeypatch):
    """track.dir shared by runs: each run's tracking goes to track.dir/<run-dir name> (its own TensorBoard folder and
    MLflow run); a fresh run whose folder holds another run's tracking is refused before torch, with that tracking
    untouched; a track.dir that is a file is refused before torch too."""
    from tests.trainer.test_cli import error_lines, imported, run_cli, snapshot

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    shared = tmp_path / "tracking"
    sets = [f"model.target={tiny_target_dir}", "track.backends=[tensorboard, mlflow]", f"track.dir={shared}",
            "data.seq_len=96", "data.rows_per_step=2", "data.num_anchors=8", "optim.max_steps=2", "log.every=1",
            "ckpt.every=0", "eval_at_end=false"]
    args = [x for s in sets for x in ("--set", s)]
    for name in ("r1", "r2"):
        p = run_cli("train", "--recipe", "smoke", "--run-dir", str(tmp_path / name), *args)
        assert p.returncode == 0, p.stderr[-3000:]
    ids = {name: json.loads((shared / name / "runs.json").read_text()) for name in ("r1", "r2")}
    assert ids["r1"]["mlflow"] != ids["r2"]["mlflow"]  # the second run opened its own, not the first one's
    assert all(list((shared / name / "tensorboard").glob("events.*")) for name in ("r1", "r2"))
    assert sorted(p.name for p in shared.iterdir()) == ["r1", "r2"]

    before = snapshot(shared)
    p = run_cli("train", "--recipe", "smoke", "--run-dir", str(tmp_path / "elsewhere" / "r1"), *args,
                flags=("-X", "importtime"))
    assert p.returncode == 2, p.stderr[-2000:]
    assert error_lines(p.stderr)[0] == (f"error: track.dir: {shared / 'r1'} already holds the tracking of another run "
                                        "(mlruns, runs.json, tensorboard); a fresh run would write into that run's "
                                        "tracked runs")
    assert "torch" not in imported(p.stderr) and snapshot(shared) == before
    assert not (tmp_path / "elsewhere").exists()

    (tmp_path / "afile").write_text("mine\n")
    p = run_cli("train", "--recipe", "smoke", "--run-dir", str(tmp_path / "r3"), *args, "--set",
                f"track.dir={tmp_path / 'afile'}", flags=("-X", "importtime"))
    assert p.returncode == 2, p.stderr[-2000:]
    assert error_lines(p.stderr)[0] == f"error: track.dir: {tmp_path / 'afile'} is a file, not a directory"
    assert "torch" not in imported(p.stderr) and (tmp_path / "afile").read_text() == "mine\n"
