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
    assert [e.value for e in tb.Scalars("eval/tau")] == pytest.approx([first["eval"]["tau"], second["eval"]["tau"]])

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
