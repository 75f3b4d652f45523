"""The trainer's own pieces on CUDA for the gpu tier's step-level tests: the session's tiny target, a drafter state
built by `trainer.build.build_state`, and real micro-batches of the bundled smoke data packed by trainer.data."""
from __future__ import annotations

import torch

from tests.trainer.conftest import small_cfg
from trainer.build import build_state, load_run_target, target_attn
from trainer.data.batching import EpochBatches
from trainer.data.dataset import build_datasets

DEV = torch.device("cuda:0")
SETS = ("device=cuda", "data.seq_len=256", "data.num_anchors=16", "data.rows_per_step=2", "step.attn=flex",
        "step.loss_chunk=160")


def cfg_of(target_dir, *sets: str):
    return small_cfg(target_dir, *SETS, *sets)


def fresh(target_dir, *sets: str):
    """-> (cfg, state, batches): a new drafter + optimizer (seeded by the config) and the data's micro-batches."""
    cfg = cfg_of(target_dir, *sets)
    target = load_run_target(cfg, DEV, truncate=True, attn=target_attn(DEV))
    state = build_state(cfg, target, DEV)
    data = build_datasets(cfg.data, target.tokenizer, target.embed_tokens.weight.shape[0], cfg.seed)
    batches = EpochBatches(data.train, cfg.data.rows_per_step, cfg.data.num_anchors, cfg.seed,
                           target.tokenizer.pad_token_id or 0)
    return cfg, state, batches


def params(state) -> list[torch.Tensor]:
    return [p for p in state.drafter.parameters() if p.requires_grad]


def max_diff(a, b) -> float:
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b))
