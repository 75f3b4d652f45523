"""`trainer eval prompts`: real batch-1 decoding of each prompt file, after checks.check_eval_prompts read them.

Importing this module imports no torch: decode_sets imports the decoders when it runs (the entry module calls it
after its "loading torch and transformers" phase)."""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from trainer.cli.evalform import EvalRequest
from trainer.errors import DataError

# What a DFLASH_EVAL line carries of decode_benchmark's result, beside the set's name and formats.
RECORD_KEYS = ("tau", "accept_by_pos", "speedup", "identical", "prompts", "tokens", "rounds", "target_tok_s",
               "speculative_tok_s", "engine", "attention", "norms", "device", "lossless", "stop_ids", "ended_on_stop")


def warn_unreadable(sets) -> None:
    """One stderr warning per prompt set that skipped unreadable lines (their first ten line numbers)."""
    for ps in sets:
        if ps.bad_lines:
            print(f"warning: {ps.name}: {len(ps.bad_lines)} unreadable lines skipped (lines "
                  f"{', '.join(map(str, ps.bad_lines[:10]))}{', ...' if len(ps.bad_lines) > 10 else ''})",
                  file=sys.stderr, flush=True)


def fit_sets(req: EvalRequest, sets, tokenizer, positions: int | None) -> list[tuple]:
    """Each set's first --limit prompts less those whose rendering (the chat template's, as decoded) and --max-new
    tokens exceed the target's positions (regenerate's rule) -> (the set of the prompts that fit, how many did not);
    a set left with none is one DataError (exit 3), before any weight loads."""
    from trainer.quality.regenerate import chat_prompt_ids

    out = []
    for ps in sets:
        taken = ps.prompts[:req.limit]
        lengths = [len(chat_prompt_ids(tokenizer, p)) for p in taken]
        fit = tuple(p for p, n in zip(taken, lengths) if positions is None or n + req.max_new <= positions)
        if not fit:
            raise DataError(f"prompt set {ps.name}: each of its {len(taken)} prompts and --max-new {req.max_new} "
                            f"exceed the target's {positions} positions (the shortest renders to {min(lengths)} "
                            f"tokens)", hint=f"pass --max-new {positions - min(lengths)} or less, or leave the set out"
                            if positions - min(lengths) >= 2 else "leave the set out, or shorten its prompts")
        out.append((dataclasses.replace(ps, prompts=fit), len(taken) - len(fit)))
    return out


def decode_sets(req: EvalRequest, sets, console) -> int:
    """Decode each set's prompts that fit the target's positions (`fit_sets`, before any weight loads): its phases
    and DFLASH_PROGRESS lines as a job (`eval`, in prompts), one DFLASH_EVAL line and its human lines per set, then
    DFLASH_DONE -> exit code 0. Every answer ends at the stop rule's first stop id
    (trainer/decode/stops.py, as regenerate's and a server's) or at --max-new."""
    from dflash_ops.wire import EVAL_PREFIX
    from trainer.decode.decoders import engine_for
    from trainer.decode.lossless import describe
    from trainer.export import load_pair
    from trainer.metrics import JobProgress
    from trainer.placement import local_device
    from trainer.quality.config import EvalCfg
    from trainer.quality.evaluate import decode_benchmark

    from transformers import AutoTokenizer

    from trainer.targetdir import read_target_dir

    positions = read_target_dir(req.target).max_positions
    with console.phase("rendering the prompts with the target's chat template") as notes:
        tokenizer = AutoTokenizer.from_pretrained(req.target, local_files_only=True)
        fitted = fit_sets(req, sets, tokenizer, positions)
        skipped = sum(k for _ps, k in fitted)
        if skipped:
            notes.append(f"{skipped} too long for the target's {positions} positions with --max-new {req.max_new}, "
                         "skipped")
    device = local_device("auto")
    with console.phase(f"loading the drafter {req.drafter} and the target {req.target} on {device}"):
        target, drafter, ecfg = load_pair(Path(req.drafter), req.target, device, req.target_dtype)
    # The serving-like configuration the quality recipe measures: the row-invariant attention and norms (lossless by
    # construction where the family allows it; a note and SDPA where not) and the compiled drafter.
    cfg = EvalCfg(prompts=req.limit, max_new_tokens=req.max_new, warmup=1, budget_s=float("inf"),
                  engine=engine_for(req.engine, target, lambda m: print(m, flush=True)), invariant=True,
                  compile="drafter")
    total = sum(len(ps.prompts) for ps, _k in fitted)
    progress = JobProgress("eval", total, "prompts", console)
    done = tokens = 0
    for ps, too_long in fitted:
        n = len(ps.prompts)
        with console.phase(f"decoding {ps.name}: {n} prompts, target alone then speculative ({cfg.engine} engine)"):
            r = decode_benchmark(target, drafter, ecfg.block_size, list(ps.prompts), cfg, log=lambda m: None,
                                 progress=lambda k, t: progress.update(done + k, tokens + t))
        done, tokens = done + r["prompts"], tokens + r["tokens"]
        record = {"set": ps.name, "formats": list(ps.formats), **{k: r[k] for k in RECORD_KEYS},
                  "too_long": too_long}
        console.write(f"{EVAL_PREFIX}{json.dumps(record)}\n"
                      f"eval {ps.name}: tau {r['tau']}, speedup {r['speedup']}x at batch 1 ({r['target_tok_s']} -> "
                      f"{r['speculative_tok_s']} tokens/s), {r['identical']}/{r['prompts']} outputs equal the "
                      f"target's, {r['ended_on_stop']}/{r['prompts']} ended on a stop id (the others at --max-new "
                      f"{req.max_new})\n"
                      f"eval {ps.name}: {describe(r['lossless'])}\n"
                      + (f"eval {ps.name}: {too_long} prompts skipped: too long for the target's {positions} "
                         f"positions with --max-new {req.max_new}\n" if too_long else ""))
    progress.done({"done": done, "total": total, "tokens": tokens, "sets": [ps.name for ps in sets],
                   "too_long": skipped},
                  f"evaluated {done} prompts of {len(sets)} set(s) ({tokens:,} new tokens each way)"
                  + (f"; {skipped} skipped as too long for the target's positions" if skipped else ""))
    return 0
