"""Anchor coverage: for each anchor setting, what fraction of the supervised tokens one epoch anchors, through the
trainer's own packing (`trainer.data.packing.pack`) and batches (`EpochBatches`, the density rule of
`trainer.data.anchors`). CPU only, no model.

    python -m bench.anchors --data runs/quality-1/data/train.jsonl --seq-len 2048 \
        --setting 512 --setting 1024 --setting 1024:0.5
    python -m bench.anchors --synthetic 96:128:150000 --synthetic 40:150:5000 --seq-len 2048 --setting 512

A setting is NUM_ANCHORS (that many per packed row: `data.num_anchors`) or NUM_ANCHORS:FRACTION
(`data.anchor_fraction`: ceil(FRACTION x the row's supervised tokens), at most NUM_ANCHORS). `--data` reads
pre-tokenized lines (`input_ids` + `loss_mask`, what the quality pipeline's regenerate stage writes);
`--synthetic PROMPT:ANSWER:COUNT` makes COUNT samples of PROMPT unsupervised and ANSWER supervised tokens.

Prints one `ANCHORS {json}` line: rows, supervised tokens, anchor candidates, and per setting the valid anchors of
one epoch, as a fraction of the supervised tokens and of the candidates, and the share of anchor slots in use (the
step computes every slot, used or not).
"""
from __future__ import annotations

import argparse
import json
import sys

import torch


def coverage(rows, num_anchors: int, fraction: float | None, rows_per_step: int = 8, seed: int = 0) -> dict:
    """One epoch of `EpochBatches` over packed `rows` -> valid anchors and their shares. Pure given the seed."""
    from trainer.data.anchors import anchor_candidates
    from trainer.data.batching import EpochBatches

    batches = EpochBatches(rows, rows_per_step, num_anchors, seed, pad_id=0, anchor_fraction=fraction)
    anchors = 0
    for micro in range(batches.per_epoch):
        anchors += int(batches.batch(micro).anchor_valid.sum())
    supervised = int(rows.loss_mask.sum())
    candidates = int(anchor_candidates(rows.loss_mask, rows.doc_ids.long()).sum())
    slots = batches.per_epoch * rows_per_step * num_anchors
    return {"anchors": anchors, "of_supervised": round(anchors / max(1, supervised), 4),
            "of_candidates": round(anchors / max(1, candidates), 4), "slots_used": round(anchors / max(1, slots), 4)}


def parse_setting(text: str) -> tuple[int, float | None]:
    head, _, tail = text.partition(":")
    n = int(head)
    f = float(tail) if tail else None
    if n < 1 or (f is not None and not 0 < f <= 1):
        raise ValueError(text)
    return n, f


def synthetic_samples(spec: str):
    from trainer.data.source import Sample

    prompt, answer, count = (int(x) for x in spec.split(":"))
    if prompt < 0 or answer < 2 or count < 1:
        raise ValueError(spec)
    mask = torch.cat([torch.zeros(prompt, dtype=torch.bool), torch.ones(answer, dtype=torch.bool)])
    ids = torch.zeros(prompt + answer, dtype=torch.long)
    return [Sample(input_ids=ids, loss_mask=mask) for _ in range(count)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.anchors", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", nargs="*", default=[], help="pre-tokenized JSONL files")
    p.add_argument("--synthetic", action="append", default=[], metavar="PROMPT:ANSWER:COUNT")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--rows-per-step", type=int, default=8)
    p.add_argument("--setting", action="append", default=[], metavar="N[:FRACTION]")
    args = p.parse_args(argv)
    try:
        settings = [parse_setting(s) for s in args.setting or ["512"]]
        synthetic = [s for spec in args.synthetic for s in synthetic_samples(spec)]
    except ValueError as e:
        p.error(f"bad --setting or --synthetic {e}: N >= 1, 0 < FRACTION <= 1; PROMPT >= 0, ANSWER >= 2, COUNT >= 1")
    if not args.data and not synthetic:
        p.error("give --data FILE... or --synthetic PROMPT:ANSWER:COUNT")
    if any(n >= args.seq_len for n, _ in settings):
        p.error("each setting's N must be below --seq-len")
    from trainer.data.packing import pack
    from trainer.data.source import load_samples
    from trainer.errors import TrainerError

    try:
        samples = load_samples(args.data, None, sys.maxsize, 0.0)[0] if args.data else []
    except TrainerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    rows = pack(samples + synthetic, args.seq_len, pad_id=0)
    report = {"rows": rows.num_rows, "seq_len": args.seq_len, "supervised": int(rows.loss_mask.sum()),
              "settings": {(f"{n}" if f is None else f"{n}:{f}"): coverage(rows, n, f, args.rows_per_step)
                           for n, f in settings}}
    print("ANCHORS " + json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
