"""Config -> packed train/eval rows (the data pipeline's one entry point)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from trainer.config import DataCfg
from trainer.data.anchors import anchor_candidates
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
    check_trainable(train, cfg.seq_len)
    ev = pack(held, cfg.seq_len, pad_id) if held else None
    return Datasets(train=train, eval=ev, reports=tuple(reports), num_train_samples=len(samples),
                    num_eval_samples=len(held))


def check_trainable(train: PackedRows, seq_len: int) -> None:
    """Every line has a supervised token (source.py), but truncation to seq_len can cut them all, and a block needs
    two in a row (its anchor and a label: data/anchors.py). Without one the run would train nothing and still
    export a drafter: refuse it, before any model is built."""
    cut = f" ({train.truncated} samples truncated to data.seq_len={seq_len})" if train.truncated else ""
    if not bool(train.loss_mask.any()):
        raise DataError(f"no supervised token left in the training data after packing{cut}",
                        hint="raise data.seq_len, or check the loss_mask / assistant turns of data.paths")
    if not bool(anchor_candidates(train.loss_mask, train.doc_ids).any()):
        raise DataError(f"no block to train: no two consecutive supervised tokens in any training sample{cut}",
                        hint="a block's anchor and its first label are both supervised tokens; check the loss_mask "
                             "of data.paths" + (", or raise data.seq_len" if cut else ""))
