"""Regenerate the drafter's training data with the target itself (DFlash recipe: the target's own greedy answers).

Prompts are function signatures + docstrings from the corpus: held-in prompts (from the files the target was
pretrained on) become the drafter's training set, held-out prompts (from held-out files) its evaluation set. Each
answer is the target's greedy continuation (batched, KV cache, stopped at a stop id of trainer/decode/stops.py --
<|im_end|>, <|endoftext|> -- or max_new_tokens).

train.jsonl holds token ids, {"input_ids": prompt + answer, "loss_mask": 0 on the prompt, 1 on the answer}: the
labels are exactly the tokens the target chose (decoding to text and re-tokenizing can merge them differently).
Optionally (`regen.continuations`) it also holds greedy continuations of random windows of held-in source text.
eval.jsonl holds chat lines {"conversations": [user, assistant]}: its prompts are decoded again at evaluation.
"""
from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer.decode.stops import model_stop_ids
from trainer.errors import DataError
from trainer.quality.config import QualityCfg, RegenCfg
from trainer.quality.corpus import ENDOFTEXT, CorpusSplit, all_units, corpus_split
from trainer.regen.engines import Answerer, answerer
from trainer.regen.plan import SamplingSettings


@dataclass(frozen=True)
class RegenResult:
    train_path: str
    eval_path: str
    train_samples: int  # chat answers + continuations
    eval_samples: int
    continuations: int  # of train_samples: continuations of source windows
    ended_with_eos: float  # fraction of answers that ended on a stop id (the rest hit max_new_tokens)
    generated_tokens: int
    seconds: float
    stopped_by: str  # "done" or "budget"
    # what generated the continuations (`Answerer.used`): "static", "hf" (regen.engine, or the static engine could
    # not be built), or "static->hf" (the static engine failed midway; HF answered the rest)
    continuation_engine: str = ""
    answer_engine: str = ""  # what answered the training prompts, likewise


def prompt_sets(q: QualityCfg, split: CorpusSplit | None = None) -> tuple[list[str], list[str]]:
    """-> (training prompts, held-out prompts): distinct texts from the drafter's files / the held-out files, the
    held-out ones never equal to a prompt of any file a model trains on; seeded shuffle, capped by the recipe.
    split: `corpus_split(q.corpus)` if already read."""
    split = split if split is not None else corpus_split(q.corpus)

    def pick(prompts: set[str], n: int, salt: int) -> list[str]:
        ordered = sorted(prompts)
        random.Random(q.seed * 1000 + salt).shuffle(ordered)
        return ordered[:n]
    def prompts_of(files) -> set[str]:
        return {u.prompt for u in all_units(files, q.corpus)}

    target = prompts_of(split.target)
    # Drafter-only files: only prompts the target never pretrained on. Otherwise the drafter's files are the target's.
    train = prompts_of(split.drafter) - target if split.drafter is not split.target else target
    # A held-out prompt whose text also occurs in a seen file (`def __repr__(self):`) is not held out: drop it.
    unseen = prompts_of(split.heldout) - target - train
    return pick(train, q.regen.train_prompts, 1), pick(unseen, q.regen.eval_prompts, 2)


def chat_prompt_ids(tokenizer, prompt: str) -> list[int]:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def token_line(prompt_ids: list[int], answer_ids: list[int]) -> str:
    return json.dumps({"input_ids": prompt_ids + answer_ids,
                       "loss_mask": [0] * len(prompt_ids) + [1] * len(answer_ids)}) + "\n"


def conversation_line(prompt: str, answer: str) -> str:
    return json.dumps({"conversations": [{"role": "user", "content": prompt},
                                         {"role": "assistant", "content": answer}]}) + "\n"


def regenerate_file(target, prompts: list[str], cfg: RegenCfg, path: Path, deadline: float, log=print,
                    as_tokens: bool = False) -> tuple[int, int, int, int, str]:
    """Answer `prompts` (longest first) into `path` (chat lines, or token lines when `as_tokens`), in the order the
    answers end, through `answer_engine` -> (samples written, of them ended with a stop id, new tokens generated,
    prompts answered, the engine that answered: `Answerer.used`). Blank answers are dropped. Nothing is answered
    after `deadline` (a time.perf_counter() value)."""
    tokenizer = target.tokenizer
    encoded = sorted(((chat_prompt_ids(tokenizer, p), p) for p in prompts), key=lambda x: -len(x[0]))
    answer = answer_engine(target, cfg, [ids for ids, _ in encoded], log)
    n = with_eos = tokens = blank = answered = 0
    try:
        with Path(path).open("w", encoding="utf-8") as f:
            for i, answer_ids in answer.stream([ids for ids, _ in encoded], deadline=deadline):
                ids, prompt = encoded[i]
                ended = bool(answer_ids) and answer_ids[-1] in answer.stops
                text = tokenizer.decode(answer_ids[:-1] if ended else answer_ids, skip_special_tokens=False)
                tokens += len(answer_ids)
                answered += 1
                if text.strip():  # a blank answer has nothing to supervise (the trainer's loader rejects it)
                    f.write(token_line(ids, answer_ids) if as_tokens else conversation_line(prompt, text))
                    n, with_eos = n + 1, with_eos + ended
                else:
                    blank += 1
                if answered % cfg.batch_size == 0 or answered == len(encoded):
                    log(f"regen {Path(path).name}: {answered}/{len(encoded)} answered, {blank} blank (dropped)")
    finally:
        answer.close()
    return n, with_eos, tokens, answered, answer.used


def continuation_windows(stream: torch.Tensor, count: int, length: int, boundary_id: int, seed: int) -> list[list[int]]:
    """`count` windows of `length` tokens at seeded random offsets of `stream` [N], none crossing a document
    boundary (`boundary_id`); fewer when the stream has too few such windows."""
    if stream.numel() <= length:
        return []
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, stream.numel() - length, (count * 2,), generator=gen)
    wins = stream[starts[:, None] + torch.arange(length)]  # [2*count, length]
    keep = ~(wins == boundary_id).any(dim=1)
    return wins[keep][:count].tolist()


def continuation_engine(target, cfg: RegenCfg, eot: int, log=print, windows: int | None = None) -> Answerer:
    """The continuations' `trainer.regen.engines.Answerer` (regen.engine): windows of
    regen.continuation_prompt_tokens, answers through the first <|endoftext|>, regen.continuation_batch_size rows
    (fewer for fewer windows)."""
    rows = cfg.continuation_batch_size if windows is None else max(1, min(cfg.continuation_batch_size, windows))
    return answerer(cfg.engine, target, rows=rows,
                    max_len=cfg.continuation_prompt_tokens + cfg.continuation_new_tokens, stops=[eot],
                    sampling=SamplingSettings(max_new_tokens=cfg.continuation_new_tokens), pad_id=eot,
                    batch=cfg.continuation_batch_size, log=log)


def answer_engine(target, cfg: RegenCfg, prompts: list[list[int]], log=print) -> Answerer:
    """The chat prompts' `trainer.regen.engines.Answerer` (regen.engine): answers of at most regen.max_new_tokens
    through the target's stop ids (`stops.model_stop_ids`), regen.batch_size rows (fewer for fewer prompts)."""
    return answerer(cfg.engine, target, rows=max(1, min(cfg.batch_size, len(prompts))),
                    max_len=max(map(len, prompts), default=1) + cfg.max_new_tokens,
                    stops=model_stop_ids(target.model, target.tokenizer),
                    sampling=SamplingSettings(max_new_tokens=cfg.max_new_tokens),
                    pad_id=target.tokenizer.pad_token_id, batch=cfg.batch_size, log=log)


def write_continuations(answer, windows: list[list[int]], cfg: RegenCfg, f, deadline: float, eot: int,
                        log=print) -> tuple[int, int, int]:
    """Greedy continuations (`answer.stream`, from `continuation_engine`) of equal-length windows (no padding
    needed), appended to `f` as token lines (loss on the continuation only) as they end, until `deadline` -> (samples
    written, tokens generated, windows answered)."""
    n = tokens = answered = 0
    for i, answer_ids in answer.stream(windows, deadline=deadline):
        tokens += len(answer_ids)
        if answer_ids and answer_ids != [eot]:
            f.write(token_line(windows[i], answer_ids))
            n += 1
        answered += 1
        if answered % cfg.continuation_batch_size == 0 or answered == len(windows):
            log(f"regen continuations: {answered}/{len(windows)} answered")
    return n, tokens, answered


def regenerate(target_dir: Path, out_dir: Path, q: QualityCfg, device: torch.device, log=print) -> RegenResult:
    """Write out_dir/train.jsonl (prompts and source windows of the drafter's files) and out_dir/eval.jsonl
    (held-out prompts); eval is answered first so a time-budget cut only shortens the training set."""
    from trainer.model.target import load_target

    t0 = time.perf_counter()
    target = load_target(target_dir, num_draft_layers=1, device=device, truncate=False)
    split = corpus_split(q.corpus)
    train_prompts, eval_prompts = prompt_sets(q, split)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    deadline = t0 + q.regen.budget_s
    tok = target.tokenizer
    n_eval, eos_eval, tok_eval, _, _ = regenerate_file(target, eval_prompts, q.regen, out_dir / "eval.jsonl",
                                                       float("inf"), log)
    n_train, eos_train, tok_train, answered, answered_by = regenerate_file(
        target, train_prompts, q.regen, out_dir / "train.jsonl", deadline, log, as_tokens=True)
    n_cont = tok_cont = cont_answered = 0
    windows: list = []
    engine_used = ""
    if q.regen.continuations and time.perf_counter() < deadline:
        from trainer.quality.pretrain import token_stream

        eot = tok.convert_tokens_to_ids(ENDOFTEXT)
        windows = continuation_windows(token_stream(tok, [f.text for f in split.drafter]), q.regen.continuations,
                                       q.regen.continuation_prompt_tokens, eot, q.seed)
        answer = continuation_engine(target, q.regen, eot, log, windows=len(windows))
        try:
            with (out_dir / "train.jsonl").open("a", encoding="utf-8") as f:
                n_cont, tok_cont, cont_answered = write_continuations(answer, windows, q.regen, f, deadline, eot,
                                                                      log)
        finally:
            answer.close()
        engine_used = answer.used
    result = RegenResult(train_path=str(out_dir / "train.jsonl"), eval_path=str(out_dir / "eval.jsonl"),
                         train_samples=n_train + n_cont, eval_samples=n_eval, continuations=n_cont,
                         ended_with_eos=round((eos_eval + eos_train) / max(1, n_eval + n_train), 4),
                         generated_tokens=tok_eval + tok_train + tok_cont, seconds=round(time.perf_counter() - t0, 1),
                         stopped_by="budget" if answered < len(train_prompts) or cont_answered < len(windows)
                         or (q.regen.continuations and not windows) else "done", continuation_engine=engine_used,
                         answer_engine=answered_by)
    if not n_train or not n_eval:
        raise DataError(f"regeneration left {n_train} training and {n_eval} held-out answers (blank answers are "
                        f"dropped)", hint="train the target longer (pretrain.steps) or raise regen.budget_s")
    log(f"regen done: {n_train} train answers + {n_cont} continuations / {n_eval} eval answers, "
        f"{result.generated_tokens:,} tokens, {result.ended_with_eos:.0%} of the answers ended with EOS, "
        f"{result.seconds}s ({result.stopped_by})")
    return result
