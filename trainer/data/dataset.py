"""Config -> packed train/eval rows (the data pipeline's one entry point)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from trainer.config import DataCfg
from trainer.data.packing import PackedRows, pack
from trainer.data.source import BadLineFile, LoadReport, load_samples
from trainer.errors import DataError


@dataclass(frozen=True)
class Datasets:
    train: PackedRows
    eval: PackedRows | None
    reports: tuple[LoadReport, ...]
    num_train_samples: int
    num_eval_samples: int


def build_datasets(cfg: DataCfg, tokenizer, vocab_size: int, seed: int, *, bad_file: BadLineFile | None = None,
                   progress: Callable[[int, int], None] | None = None) -> Datasets:
    """Load, split (eval_paths, else a seeded eval_fraction hold-out), shuffle with the seed, pack. bad_file gets
    every malformed line of both sets; progress(bytes read, bytes in the files) follows the training files."""
    samples, report = load_samples(cfg.paths, tokenizer, vocab_size, cfg.max_bad_fraction, bad_file=bad_file,
                                   progress=progress)
    reports = [report]
    order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(seed)).tolist()
    samples = [samples[i] for i in order]
    if cfg.eval_paths:
        held, eval_report = load_samples(cfg.eval_paths, tokenizer, vocab_size, cfg.max_bad_fraction,
                                         bad_file=bad_file)
        reports.append(eval_report)
    else:
        n_eval = int(len(samples) * cfg.eval_fraction)
        held, samples = samples[:n_eval], samples[n_eval:]
    if not samples:
        raise DataError("no training samples left after the eval split",
                        hint="add data to data.paths or lower data.eval_fraction")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    train = pack(samples, cfg.seq_len, pad_id)
    ev = pack(held, cfg.seq_len, pad_id) if held else None
    return Datasets(train=train, eval=ev, reports=tuple(reports), num_train_samples=len(samples),
                    num_eval_samples=len(held))
