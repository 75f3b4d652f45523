"""Experiment tracking beside metrics.jsonl, where users look: TensorBoard event files (local, no account), and
Weights & Biases / MLflow when installed (their offline modes need no network: WANDB_MODE=offline, MLflow's file
store, the default here). Config `track.backends`; one trainer run is one tracked run, and a resumed run continues
it (the backend's run id is kept in the tracking directory, runs.json; TensorBoard drops the events past the
checkpoint). The tracking directory is <run_dir>/tracking, or with `track.dir` set, track.dir/<run-dir name>: each
run its own folder, so `tensorboard --logdir TRACK_DIR` shows the runs side by side. Only a resume reads runs.json;
a fresh run refuses a folder that already holds another run's tracking (`check_tracking_dir`, before torch).

What is logged, per log interval: loss, accuracy overall and per block position, tokens/s, step time, memory, LR;
at the end, the simulated acceptance length tau and the acceptance per position. Rank 0 only.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from trainer.config import TrackCfg
from trainer.errors import ConfigError
from trainer.metrics import MetricsSink

SCALARS = ("loss", "acc", "tokens_per_s", "step_time_s", "peak_mem_gib", "lr", "epoch")
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}  # backend -> the module it imports


def not_installed(backend: str) -> ConfigError:
    module = PACKAGES[backend]
    return ConfigError(f"track.backends names {backend}, but the {module} package is not installed: pip install "
                       f"{module}, or drop {backend} from track.backends")


def check_installed(cfg: TrackCfg) -> None:
    """Every backend's package can be imported (found, not imported: no torch, no start-up cost), so that a missing
    one is refused before the run is built rather than when its tracker opens, after the build."""
    for name in cfg.backends:
        if importlib.util.find_spec(PACKAGES[name]) is None:
            raise not_installed(name)


def scalars(record: dict, prefix: str = "train/") -> dict[str, float]:
    """A metrics (or eval) record -> flat {name: number}: lists become name/k (k = block position). Pure."""
    out = {}
    for key, value in record.items():
        if key in SCALARS and isinstance(value, (int, float)) and not isinstance(value, bool):
            out[prefix + key] = float(value)
        elif key in ("acc_by_pos", "accept_by_pos") and isinstance(value, list):
            out.update({f"{prefix}{key}/{k}": float(v) for k, v in enumerate(value, start=1) if v is not None})
        elif key == "tau" and isinstance(value, (int, float)):
            out[prefix + key] = float(value)
    return out


def tracking_dir(cfg: TrackCfg, run_dir: Path) -> Path:
    """Where the backends write: <run_dir>/tracking, or track.dir/<run-dir name> (a run's own folder in a directory
    that several runs share)."""
    return Path(cfg.dir) / Path(run_dir).resolve().name if cfg.dir else Path(run_dir) / "tracking"


def check_tracking_dir(cfg: TrackCfg, run_dir: Path, resume: bool) -> None:
    """Before the run is built: the tracking directory is one, or can be made (not a file, nor inside one); a fresh
    run's is new or empty, since another run's runs.json there would make this run write into that run's tracked
    runs (a resume continues its own). No torch."""
    if not cfg.backends:
        return
    where = tracking_dir(cfg, run_dir)
    for path in (where, *where.parents):
        if path.exists():
            if not path.is_dir():
                raise ConfigError(f"track.dir: {path} is a file, not a directory",
                                  hint="set track.dir to a directory (or leave it empty: <run-dir>/tracking)")
            break
    if resume or not where.is_dir():
        return
    held = sorted(p.name for p in where.iterdir())
    if held:
        raise ConfigError(f"track.dir: {where} already holds the tracking of another run ({', '.join(held[:4])}); a "
                          "fresh run would write into that run's tracked runs",
                          hint="give this run a --run-dir of another name (its tracking goes to track.dir/<run-dir "
                               "name>), or another track.dir; or --resume that run")


class Tracker:
    """Fan-out to the configured backends. `log` per interval, `finish` with the run's result, then closed."""

    def __init__(self, cfg: TrackCfg, run_dir: Path, config: dict, start_step: int, resume: bool = False) -> None:
        check_tracking_dir(cfg, run_dir, resume)
        self.dir = tracking_dir(cfg, run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.ids_path = self.dir / "runs.json"
        ids = _read_ids(self.ids_path) if resume else {}  # a fresh run opens tracked runs of its own
        self.backends = []
        try:
            for name in cfg.backends:
                self.backends.append(_open(name, cfg, self.dir, Path(run_dir).name, config, start_step, ids))
        except BaseException:  # the ones already open would keep writing (W&B: a background process) after the error
            for b in self.backends:
                b.close()
            raise
        self.ids_path.write_text(json.dumps({b.name: b.run_id for b in self.backends if b.run_id}) + "\n")

    def log(self, record: dict) -> None:
        step = int(record["step"])
        values = scalars(record)
        for b in self.backends:
            b.log(values, step)

    def finish(self, result: dict) -> None:
        step = int(result.get("step", 0))
        values = scalars(result.get("eval") or {}, prefix="eval/")
        for b in self.backends:
            if values:
                b.log(values, step)
            b.close()


def _read_ids(path: Path) -> dict:
    """runs.json's backend -> run id; {} where there is none or it cannot be read (the resume opens new runs)."""
    try:
        ids = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return ids if isinstance(ids, dict) else {}


def _open(name: str, cfg: TrackCfg, root: Path, run_name: str, config: dict, start_step: int, ids: dict):
    if name == "tensorboard":
        return _TensorBoard(root, start_step)
    if name == "wandb":
        return _WandB(root, cfg.project, run_name, config, ids.get("wandb"))
    if name == "mlflow":
        return _MLflow(root, cfg.project, run_name, config, ids.get("mlflow"))
    raise ConfigError(f"unknown tracking backend {name!r}", hint="use tensorboard, wandb or mlflow")


def _need(backend: str):
    import importlib

    try:
        return importlib.import_module(PACKAGES[backend])
    except ImportError:
        raise not_installed(backend) from None


class _TensorBoard:
    name, run_id = "tensorboard", None

    def __init__(self, root: Path, start_step: int) -> None:
        _need("tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: a resumed run re-trains the steps after its checkpoint; their old events are dropped.
        self.writer = SummaryWriter(log_dir=str(root / "tensorboard"), purge_step=start_step + 1 if start_step else None)

    def log(self, values: dict, step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _WandB:
    name = "wandb"

    def __init__(self, root: Path, project: str, run_name: str, config: dict, run_id: str | None) -> None:
        wandb = _need("wandb")
        try:
            self.run = wandb.init(project=project, name=run_name, dir=str(root), config=config, id=run_id,
                                  resume="allow", reinit="create_new")
        except wandb.errors.Error as e:  # no API key, a refused login, an unreachable server: the user's to fix
            reason = (str(e).splitlines() or [type(e).__name__])[0][:200]
            raise ConfigError(f"track.backends: wandb could not start a run ({reason}); log in (wandb login, or "
                              "WANDB_API_KEY), or run offline with WANDB_MODE=offline, or drop wandb from "
                              "track.backends") from None
        self.run_id = self.run.id

    def log(self, values: dict, step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class _MLflow:
    name = "mlflow"

    def __init__(self, root: Path, project: str, run_name: str, config: dict, run_id: str | None) -> None:
        import os

        mlflow = _need("mlflow")
        # MLFLOW_TRACKING_URI (a server, a database) wins; else a local file store beside the run, which MLflow 3
        # keeps working but refuses unless asked for (the database store needs SQLAlchemy, not in mlflow-skinny).
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (root / "mlruns").as_uri()
        self.client = mlflow.MlflowClient(uri)
        if run_id is None:
            exp = self.client.get_experiment_by_name(project)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(project)
            run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id
            self.client.log_dict(run_id, config, "config.json")
        self.run_id = run_id

    def log(self, values: dict, step: int) -> None:
        from mlflow.entities import Metric
        import time

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class TrackedSink(MetricsSink):
    """The metrics sink that also feeds a Tracker: every interval's record, and the run's result at the end."""

    def __init__(self, path: Path, stream, tracker: Tracker, **sink_options) -> None:
        super().__init__(path, stream, **sink_options)
        self.tracker = tracker

    def emit(self, record: dict) -> None:
        super().emit(record)
        self.tracker.log(record)

    def done(self, record: dict) -> None:
        super().done(record)
        self.tracker.finish(record)

    def stopped(self, record: dict) -> None:
        super().stopped(record)
        self.tracker.finish(record)
