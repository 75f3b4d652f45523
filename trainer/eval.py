"""Simulated acceptance length tau on held-out rows.

For every block (anchor a): drafted[k] = argmax of the LM head at block position k (k = 1..B-1); reference[k] = the
FULL target's greedy next token after position a+k-1 (what a greedy verifier would emit there). Per block,
tau = 1 + the number of leading k with drafted[k] == reference[k] (a position also stops the run when it leaves the
document / row or is not supervised). tau is in [1, B]; the 1 is the verifier's bonus token.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from dflash_ops.wire import EVAL_PREFIX
from trainer import rundir
from trainer.config import DataCfg
from trainer.data.batching import EpochBatches, StaticBatch
from trainer.decode.rounds import leading_matches
from trainer.errors import ConfigError
from trainer.export import load_pair
from trainer.model.attention import make_layout
from trainer.model.drafter import Drafter
from trainer.model.loss import block_input_ids, block_labels
from trainer.model.target import Target
from trainer.placement import local_device


# Attention-score and logit elements one drafter call may hold (2^28: 1 GiB in fp32). Evaluation runs the dense
# sdpa mask, whose scores are [rows, H, N*B, S + N*B]: at 1,024 anchors of 16 on 2,048-token rows, 4 rows and 16
# heads, that is 72 GiB in one call. A block attends to its own context and to itself alone, so anchors can be
# evaluated a few at a time with the same result.
EVAL_ELEMENTS = 1 << 28


def eval_chunks(rows: int, anchors: int, seq_len: int, block_size: int, heads: int, vocab: int,
                budget: int = EVAL_ELEMENTS) -> tuple[int, int]:
    """-> (rows, anchors) per drafter call: the most anchors of one row whose scores [H, n*B, S + n*B] and logits
    [n*B, V] fit `budget` elements (at least one), and when a whole row fits, as many whole rows as fit."""
    def cost(n: int) -> int:
        q = n * block_size
        return q * (heads * (seq_len + q) + vocab)

    lo, hi = 1, anchors
    while lo < hi:  # the largest n in [1, anchors] with cost(n) <= budget (or 1)
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if cost(mid) <= budget else (lo, mid - 1)
    if lo < anchors:
        return 1, lo
    return max(1, min(rows, budget // max(1, cost(anchors)))), max(1, anchors)


@torch.no_grad()
def drafted_tokens(target: Target, drafter: Drafter, batch: StaticBatch, feats: torch.Tensor, block_size: int,
                   attn: str = "sdpa", elements: int = EVAL_ELEMENTS) -> torch.Tensor:
    """-> [R, N, B] long: the LM head's argmax at every block position, the drafter run on `eval_chunks` pieces of
    the batch, so memory stays bounded however many anchors a row has."""
    B = block_size
    R, N = batch.anchor_pos.shape
    rows_per, anchors_per = eval_chunks(R, N, batch.input_ids.shape[1], B, drafter.cfg.num_attention_heads,
                                        target.embed_tokens.weight.shape[0], elements)
    drafted = torch.empty(R, N, B, dtype=torch.long, device=batch.anchor_pos.device)
    for r0 in range(0, R, rows_per):
        rows = slice(r0, r0 + rows_per)
        for a0 in range(0, N, anchors_per):
            anchors = slice(a0, a0 + anchors_per)
            anchor_pos = batch.anchor_pos[rows, anchors]
            layout = make_layout(batch.position_ids[rows], batch.doc_ids[rows], anchor_pos,
                                 batch.anchor_valid[rows, anchors], B, attn, window=drafter.cfg.window)
            noise = target.embed_tokens(block_input_ids(batch.input_ids[rows], anchor_pos, B, target.mask_token_id))
            hidden = drafter(feats[rows], noise, layout)  # [r, n*B, D]
            logits = target.lm_head(hidden.to(target.lm_head.weight.dtype))
            drafted[rows, anchors] = logits.argmax(-1).view(*anchor_pos.shape, B)
    return drafted


@torch.no_grad()
def block_acceptance(target: Target, drafter: Drafter, batch: StaticBatch, block_size: int,
                     attn: str = "sdpa", elements: int = EVAL_ELEMENTS) -> tuple[torch.Tensor, torch.Tensor]:
    """-> accepted [R, N] long (leading matches, 0..B-1) and block_valid [R, N] bool. `target` must be untruncated."""
    B = block_size
    feats, greedy = target.features_and_greedy(batch.input_ids, batch.position_ids, batch.doc_ids)
    drafted = drafted_tokens(target, drafter, batch, feats, B, attn, elements)
    _labels, valid = block_labels(batch.input_ids, batch.doc_ids, batch.loss_mask, batch.anchor_pos,
                                  batch.anchor_valid, B)
    S = batch.input_ids.shape[1]
    prev = (batch.anchor_pos[:, :, None] + torch.arange(B, device=drafted.device) - 1).clamp(0, S - 1)  # a+k-1
    reference = greedy.gather(1, prev.flatten(1)).view_as(drafted)
    return leading_matches(drafted, reference, valid), batch.anchor_valid


@torch.no_grad()
def replayed_rounds(target: Target, drafter: Drafter, prompt_ids: list[int], output_ids: list[int],
                    block_size: int) -> list[int]:
    """Replay a greedy speculative decode in the training layout: the rounds' accepted counts that the drafter
    would get on `output_ids` (the target's greedy answer to `prompt_ids`), teacher-forced.

    Every answer position is an anchor (one packed row, one document), so `block_acceptance` gives the accepted
    count a[p] of a round that starts at p. Real decoding starts at the first answer token (the prefill's bonus)
    and moves on by a[p] + 1 while tokens of the answer are left to make. Equal lists (in fp32 on CPU: every prompt)
    mean decoding sees what training saw; then a real tau below the simulated one is the rounds' own selection (a
    round starts where the last draft failed), not a defect. In bf16 a compiled drafter rounds differently from
    this eager one, so near-ties make some lists differ while the means agree. The last round can come out
    shorter here: the replay cannot look past the answer, where real decoding drafts past max_new."""
    P, n = len(prompt_ids), len(output_ids)
    if n == 0:
        return []
    dev = target.device
    ids = torch.tensor([list(prompt_ids) + list(output_ids)], dtype=torch.long, device=dev)
    S = ids.shape[1]
    loss_mask = torch.zeros(1, S, dtype=torch.bool, device=dev)
    loss_mask[:, P:] = True
    batch = StaticBatch(input_ids=ids, position_ids=torch.arange(S, device=dev)[None],
                        doc_ids=torch.zeros(1, S, dtype=torch.long, device=dev), loss_mask=loss_mask,
                        anchor_pos=torch.arange(P, S, device=dev)[None],
                        anchor_valid=torch.ones(1, n, dtype=torch.bool, device=dev))
    accepted, _valid = block_acceptance(target, drafter, batch, block_size)
    by_anchor = accepted[0].tolist()  # SYNC: eval only
    rounds, i = [], 0
    while i < n - 1:  # the round anchored at the last answer token would only make tokens past the answer
        rounds.append(by_anchor[i])
        i += by_anchor[i] + 1
    return rounds


@torch.no_grad()
def evaluate(target: Target, drafter: Drafter, rows, *, block_size: int, num_anchors: int, rows_per_batch: int,
             max_rows: int, seed: int, device: torch.device, attn: str = "sdpa") -> dict:
    """Mean tau and per-position acceptance over up to `max_rows` held-out rows (anchors drawn with `seed`)."""
    batches = EpochBatches(rows, rows_per_batch, num_anchors, seed, pad_id=0)
    n_batches = min(batches.per_epoch, max(1, -(-max_rows // rows_per_batch)))
    counts = torch.zeros(block_size, dtype=torch.long)
    blocks = 0
    tau_sum = 0
    drafter.eval()
    for i in range(n_batches):
        batch = batches.batch(i).to(device)
        accepted, valid = block_acceptance(target, drafter, batch, block_size, attn)
        acc = accepted[valid].cpu()
        blocks += acc.numel()
        tau_sum += int((acc + 1).sum())
        for k in range(1, block_size):
            counts[k] += int((acc >= k).sum())
    if blocks == 0:
        return {"tau": None, "blocks": 0, "accept_by_pos": []}
    return {"tau": round(tau_sum / blocks, 4), "blocks": blocks,
            "accept_by_pos": [round(int(c) / blocks, 4) for c in counts[1:]]}


def _emit(result: dict, stream) -> None:
    stream.write(f"{EVAL_PREFIX}{json.dumps(result)}\n")
    stream.write(f"eval: tau {result['tau']} over {result['blocks']} blocks\n")
    stream.flush()


def evaluate_run(run_dir, rows=None, stream=None) -> dict:
    """Eval a run directory: its config, its export/, the full target, its held-out split (or `rows`)."""
    from trainer.data.dataset import build_datasets

    run_dir = Path(run_dir)
    cfg = rundir.load_run_config(run_dir)
    export = rundir.require_export(run_dir)
    device = local_device(cfg.device, cpu_hint=f"the run trained with device={cfg.device}; evaluate its export here "
                                                f"with `python -m trainer eval export --drafter {export} --target "
                                                f"{cfg.model.target} --data FILE`")
    # Evaluation runs the dense sdpa block mask whatever the run trained with: same attention semantics, no static
    # mask buffers to set up, and it is off the hot path (flex needs a mask_fn that only the training step owns).
    target, drafter, _ecfg = load_pair(export, cfg.model.target, device, cfg.model.dtype)
    if rows is None:
        rows = build_datasets(cfg.data, target.tokenizer, target.embed_tokens.weight.shape[0], cfg.seed).eval
    if rows is None:
        raise ConfigError("no held-out data: data.eval_fraction is 0 and data.eval_paths is empty")
    result = evaluate(target, drafter, rows, block_size=cfg.model.block_size, num_anchors=cfg.data.num_anchors,
                      rows_per_batch=cfg.data.rows_per_step, max_rows=cfg.data.max_eval_rows, seed=cfg.seed + 1,
                      device=device, attn="sdpa")
    _emit(result, stream or sys.stdout)
    return result


def evaluate_export(drafter_dir, target_dir, data_path, *, seq_len: int = 2048, num_anchors: int = 64,
                    rows_per_batch: int = 4, max_rows: int = 64, max_bad_fraction: float = DataCfg().max_bad_fraction,
                    stream=None) -> dict:
    """Eval an export dir against a target dir on a JSONL file (all of it held out)."""
    from trainer.data.packing import pack
    from trainer.data.source import EVAL_HINT, EVAL_KNOB, load_samples

    device = local_device("auto")
    target, drafter, ecfg = load_pair(Path(drafter_dir), target_dir, device)
    # The training limit on malformed lines by default: with none, a file of nothing but bad lines gave tau None
    # and exit 0.
    samples, _report = load_samples([str(data_path)], target.tokenizer, target.embed_tokens.weight.shape[0],
                                    max_bad_fraction, knob=EVAL_KNOB, hint=EVAL_HINT)
    pad_id = target.tokenizer.pad_token_id or 0
    rows = pack(samples, seq_len, pad_id)
    result = evaluate(target, drafter, rows, block_size=ecfg.block_size, num_anchors=min(num_anchors, seq_len - 1),
                      rows_per_batch=rows_per_batch, max_rows=max_rows, seed=1, device=device)
    _emit(result, stream or sys.stdout)
    return result
