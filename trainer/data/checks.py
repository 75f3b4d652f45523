"""What a run's data says before it trains: token ids its target's embedding must hold, and the warnings a user
should read (rows dropped as bad, samples truncated, data too small for one optimizer step). Rank 0 warns."""
from __future__ import annotations

import sys

from trainer.config import TrainCfg
from trainer.data.dataset import Datasets
from trainer.errors import DataError
from trainer.placement import DistEnv


def check_ids_fit(datasets: Datasets, rows: int) -> None:
    """Token ids were checked against the config's vocab_size; an embedding with fewer rows must still hold them."""
    for name, packed in (("data.paths", datasets.train), ("data.eval_paths", datasets.eval)):
        if packed is not None and int(packed.input_ids.max()) >= rows:
            raise DataError(f"{name}: token id {int(packed.input_ids.max())} is not a row of the target's "
                            f"embedding (0..{rows - 1})")


def warn_data(datasets: Datasets, cfg: TrainCfg, env: DistEnv) -> None:
    if not env.is_main:
        return
    for report in datasets.reports:
        if report.bad:
            print(f"warning: {report.summary()}", file=sys.stderr, flush=True)
    if datasets.train.truncated:
        print(f"warning: {datasets.train.truncated} samples longer than data.seq_len={cfg.data.seq_len} were truncated",
              file=sys.stderr, flush=True)
    warning = small_data_warning(datasets.train.num_rows, datasets.num_eval_samples, cfg, env.world)
    if warning:
        print(f"warning: {warning}", file=sys.stderr, flush=True)


def small_data_warning(rows: int, held_out: int, cfg: TrainCfg, world: int) -> str | None:
    """Data that packs into fewer rows than one optimizer step takes: every step trains on all of it again (the rest
    of the step is padding), which looks like training and learns the rows by heart. Pure."""
    d = cfg.data
    need = d.rows_per_step * cfg.optim.accum_steps * world
    if rows >= need:
        return None
    return (f"the training data packs into {rows} row(s) of data.seq_len={d.seq_len} tokens, less than one optimizer "
            f"step's {need} (data.rows_per_step x optim.accum_steps x ranks): every step reuses the same row(s), and "
            f"{held_out} sample(s) are held out{' (no simulated tau)' if not held_out else ''}; add data, or lower "
            "data.seq_len / data.rows_per_step")
