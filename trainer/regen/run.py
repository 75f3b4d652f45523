"""`python -m trainer regenerate`: the target answers a prompt set; the answers become the drafter's training data.

  python -m trainer regenerate --target DIR --prompts FILE [FILE...] --out FILE.jsonl
      [--max-new N] [--temperature T] [--top-p P] [--seed S] [--continuations N] [--batch R] [--limit N]
      [--enable-thinking on|off] [--chat-template-kwargs JSON] [--system TEXT] [--engine static|hf]
      [--dtype auto|float32|bfloat16] [--device auto|cpu|cuda|cuda:N] [--max-bad-fraction F]
      [--thinking keep|drop] [--drop-truncated] [--memory-gib G] [--target-fp8]

Order of work: everything that can refuse without torch (`check_before_torch`: the settings, the target directory,
--out and an earlier run's sidecar, every prompt line), then, once torch is loaded, --target-fp8's device check
(`check_target_fp8`), then the tokenizer (each prompt rendered with the target's chat template), then the memory
estimate (trainer.regen.memory: refused in one line before any weight loads),
then the model and the engine, then every pending prompt through it, longest first (a shape that does not fit
fails in the first minute, not the last; the static engine's --batch slots take the next prompt as answers end).
Each answer is one line of OUT (trainer.regen.outfile), flushed as it ends (completion order), or of
OUT.skipped.jsonl where its row is left out (trainer.regen.rows); OUT.meta.json counts them
(trainer.regen.accounting).
Progress: `DFLASH_PROGRESS` lines (trainer.metrics.JobProgress) and a bar on a TTY; the end: `DFLASH_DONE`.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path

from trainer.data.source import BadLine, BadLineFile, LoadReport, MalformedLine, enforce_bad_lines
from trainer.errors import ConfigError, DataError, TrainerError
from trainer.prompts import read_prompt_files
from trainer.regen import outfile
from trainer.regen.accounting import PROMPT_TOO_LONG, TEMPLATE_REFUSED, Failure, tally
from trainer.regen.plan import (Prompt, RegenSettings, SamplingSettings, check_settings, distinct_prompts, pending,
                                resolved_dtype, stream_of, template_kwargs)
from trainer.targetdir import TargetDir, check_answers_fit, read_target_dir, weights_fingerprint


@dataclass(frozen=True)
class Job:
    settings: RegenSettings
    target: TargetDir
    out: Path
    prompt_files: tuple[str, ...]
    prompts: list[Prompt]
    report: LoadReport
    repeats: int
    resume: outfile.Resume
    bad_file: BadLineFile

    def summary(self) -> str:
        return f"{len(self.prompts)} prompts from {self.report.lines} lines in {len(self.prompt_files)} file(s)"


def settings_of(args) -> RegenSettings:
    s = RegenSettings(
        sampling=SamplingSettings(max_new_tokens=args.max_new, temperature=args.temperature, top_p=args.top_p,
                                  seed=args.seed),
        continuations=args.continuations, chat_template_kwargs=template_kwargs(args.chat_template_kwargs,
                                                                               args.enable_thinking),
        system=args.system, engine=args.engine, dtype=args.dtype, device=args.device, batch=args.batch,
        limit=args.limit, max_bad_fraction=args.max_bad_fraction, thinking=args.thinking,
        drop_truncated=args.drop_truncated, memory_gib=args.memory_gib, target_fp8=args.target_fp8)
    check_settings(s)
    return s


def target_record(t: TargetDir) -> dict:
    return {"path": str(t.path.resolve()), "model_type": t.model_type, "config_sha256": t.config_sha256,
            "weights_fingerprint": _fingerprint(str(t.path.resolve()))}


@functools.lru_cache(maxsize=4)
def _fingerprint(path: str) -> str:
    """Once per job: the sidecar is rewritten at every progress interval."""
    return weights_fingerprint(path)


def check_before_torch(args) -> Job:
    """Every refusal that needs neither torch nor a tokenizer, in one line each: settings and target (exit 2),
    --out (exit 2: not writable, not ours, written with another target or other settings), the prompt files
    (exit 3: missing, empty, more malformed lines than --max-bad-fraction)."""
    settings = settings_of(args)
    target = read_target_dir(args.target)
    check_answers_fit(target, args.target, "regenerate", settings.sampling.max_new_tokens)
    out = Path(args.out)
    outfile.check_writable(out)
    resume = outfile.scan_out(out)
    outfile.check_same_run(resume.meta, target_record(target), settings.output_settings())
    bad_file = BadLineFile(outfile.bad_lines_path(out))
    # listed here only when refused: otherwise under OUT's lock (`prepare`), so that a job refused because another
    # holds OUT leaves that job's listing as it was
    lines, report = read_prompt_files(args.prompts, settings.max_bad_fraction, bad_file, write_always=False)
    prompts, repeats = distinct_prompts(lines, settings.system, settings.limit)
    return Job(settings=settings, target=target, out=out, prompt_files=tuple(args.prompts), prompts=prompts,
               report=report, repeats=repeats, resume=resume, bad_file=bad_file)


def render(tokenizer, turns: tuple[dict, ...], kwargs: dict) -> list[int]:
    """The prompt as the target sees it: its chat template's rendering with the generation prompt, tokenized as
    rendered (the template writes any BOS itself)."""
    try:
        text = tokenizer.apply_chat_template(list(turns), tokenize=False, add_generation_prompt=True, **kwargs)
    except Exception as e:  # noqa: BLE001 -- jinja raises what the template raises (e.g. "system role not supported")
        raise MalformedLine(f"the chat template refused it ({type(e).__name__}: {str(e).splitlines()[0][:160]})")
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def tokenize(job: Job, tokenizer) -> tuple[dict[str, list[int]], list[BadLine], list[Failure]]:
    """prompt key -> prompt ids; a prompt the template refuses or that leaves no room for --max-new tokens in the
    target's positions is a malformed line (the same rule: skipped, counted, listed) and a failed prompt."""
    ids, bad, failures = {}, [], []
    limit = job.target.max_positions
    for p in job.prompts:
        reason = TEMPLATE_REFUSED
        try:
            rendered = render(tokenizer, p.turns, job.settings.chat_template_kwargs)
            reason = PROMPT_TOO_LONG
            if limit is not None and len(rendered) + job.settings.sampling.max_new_tokens > limit:
                raise MalformedLine(f"{len(rendered)} prompt tokens + --max-new {job.settings.sampling.max_new_tokens}"
                                    f" exceed the target's {limit} positions")
        except MalformedLine as e:
            bad.append(BadLine(p.path, p.line_no, str(e)))
            failures.append(Failure(p.key, p.source, reason, str(e)))
            continue
        ids[p.key] = rendered
    return ids, bad, failures


def answer_dtype(job: Job) -> str:
    """The dtype this start's target answers in (--dtype, auto resolved on its device). Answers of one OUT come from
    one: a resume of answers made in another (auto is bfloat16 on CUDA, float32 on a CPU) is one ConfigError."""
    from trainer.placement import local_device

    device = local_device(job.settings.device)
    dtype = resolved_dtype(job.settings.dtype, device.type)
    was = (job.resume.meta or {}).get("answer_dtype")
    if was is not None and was != dtype:
        raise ConfigError(f"--out {job.out} holds answers the target made in {was}; this start would answer in "
                          f"{dtype} (--dtype {job.settings.dtype} on {device})",
                          hint=f"resume on the kind of device it ran on, or pass another --out for {dtype} answers")
    return dtype


def meta_record(job: Job, stops, engines: list[str], answers: int, total: int, state: str,
                accounting: dict | None = None, dtype: str | None = None) -> dict:
    return {"target": target_record(job.target), "settings": job.settings.output_settings(), "answer_dtype": dtype,
            "stop_ids": list(stops), "engines": engines, "engine_asked": job.settings.engine,
            "prompts": [str(Path(p).resolve()) for p in job.prompt_files], "answers": answers, "total": total,
            "state": state, "accounting": accounting}


def prepare(job: Job, console):
    """-> (tokenizer, stop ids, prompt key -> prompt ids, the (prompt, sample) pairs to answer, longest prompt
    first, the failed prompts). The malformed-line rule is applied again with the lines the tokenizer found."""
    from transformers import AutoTokenizer

    from trainer.decode.stops import stop_ids

    s = job.settings
    with console.phase(f"loading the tokenizer and rendering {len(job.prompts)} prompts") as notes:
        tokenizer = AutoTokenizer.from_pretrained(job.target.path, local_files_only=True)
        stops = stop_ids(tokenizer, job.target.generation_eos_ids)
        ids, token_bad, failures = tokenize(job, tokenizer)
        bad = list(job.report.bad) + token_bad
        job.bad_file.write(bad)
        report = enforce_bad_lines(job.prompt_files, job.report.lines, bad, s.max_bad_fraction, None, what="prompt",
                                   knob="--max-bad-fraction", hint="check --prompts")
        job.bad_file.finish()
        if not ids:  # every prompt of the job refused by the template or too long: nothing to answer is no success
            raise DataError(f"no prompt to answer in {list(job.prompt_files)}: {report.summary()}",
                            hint=f"every one listed in {job.bad_file.path}")
        todo = [(p, i) for p, i in pending(job.prompts, s.continuations, job.resume.done) if p.key in ids]
        todo.sort(key=lambda pi: -len(ids[pi[0].key]))  # stable: longest first, file order among equals
        notes.append(f"stop ids {list(stops)}")
        if job.repeats:
            notes.append(f"{job.repeats} repeated prompts answered once")
    if bad:
        console.say(f"warning: skipped {report.summary()} (every one listed in {job.bad_file.path})")
    if not stops:
        raise ConfigError(f"target {job.target.path}: no stop id (no EOS, no end-of-turn token)",
                          hint="set eos_token_id in its generation_config.json")
    return tokenizer, stops, ids, todo, failures


def build_engine(job: Job, tokenizer, stops, prompt_ids: list[list[int]], console):
    """Load the full target and build the engine for min(--batch, prompts) rows -> Answerer."""
    from trainer.decode.decoders import capacity_for
    from trainer.placement import local_device
    from trainer.regen.engines import answerer, load_generation_target

    s = job.settings
    device = local_device(s.device)
    rows = min(s.batch, len(prompt_ids))
    check_memory(job, device, rows, prompt_ids, console)
    with console.phase(f"loading the target {job.target.path}") as notes:
        target = load_generation_target(job.target.path, device, s.dtype)
        notes.append(f"{job.target.model_type}, {target.num_layers} layers, {device}, "
                     f"{target.embed_tokens.weight.dtype}")
    if s.target_fp8:
        from trainer.model.fp8_target import quantize_target_layers

        with console.phase("the target's decoder linears to FP8") as notes:
            notes.append(f"{quantize_target_layers(target.model.model.layers)} linears; routed experts, routers, the "
                         f"embedding and the head stay in {target.embed_tokens.weight.dtype}")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    with console.phase(f"building the {s.engine} engine ({rows} rows)") as notes:
        engine = answerer(s.engine, target, rows=rows, stops=stops, sampling=s.sampling, pad_id=pad,
                          max_len=capacity_for(prompt_ids, s.sampling.max_new_tokens), log=console.say)
        notes.append(f"engine {engine.used}")
    return engine, rows


def check_memory(job: Job, device, rows: int, prompt_ids: list[list[int]], console) -> None:
    """trainer.regen.memory against --memory-gib, else the GPU's free memory (on CPU without it: nothing)."""
    import json

    import torch

    from trainer.decode.decoders import capacity_for
    from trainer.regen.memory import GIB, dtype_bytes, estimate, check_fits, weight_bytes

    s = job.settings
    if s.memory_gib:
        budget, where = int(s.memory_gib * GIB), "--memory-gib"
    elif device.type == "cuda":
        budget, where = torch.cuda.mem_get_info(device)[0], f"{device} (free)"
    else:
        return
    size = dtype_bytes(s.dtype, device.type)
    slots = capacity_for(prompt_ids, s.sampling.max_new_tokens)
    config = json.loads((job.target.path / "config.json").read_text(encoding="utf-8"))
    est = estimate(config, weight_bytes(job.target.path, size), slots, max(map(len, prompt_ids)), size)
    check_fits(est, rows, budget, where, slots)
    console.say(f"memory: about {est.total(rows) / GIB:.1f} GiB planned for {rows} rows of {slots} slots, "
                f"{budget / GIB:.1f} GiB in {where}")


def check_target_fp8(settings: RegenSettings) -> None:
    """--target-fp8 where the FP8 tensor cores run it, else one ConfigError (exit 2) before the tokenizer and any
    weight load: the device check needs torch, so it is the first thing after torch loads."""
    if not settings.target_fp8:
        return
    from trainer.model.fp8 import fp8_refusal
    from trainer.placement import local_device

    why = fp8_refusal(local_device(settings.device), "--target-fp8")
    if why:
        raise ConfigError(why, hint="leave out --target-fp8 (the target runs in --dtype), or run on an H100/H200")


def run(job: Job, console) -> dict:
    """Tokenize, load, answer every pending (prompt, sample) into OUT -> the DFLASH_DONE record. OUT is held for this
    job alone from before the target loads to the end (outfile.lock_out)."""
    check_target_fp8(job.settings)
    made = outfile.not_there_yet(job.out)
    with outfile.lock_out(job.out):
        try:
            # read again under the lock: a job that held OUT while this one was checked may have appended since
            resume = outfile.scan_out(job.out)
            outfile.check_same_run(resume.meta, target_record(job.target), job.settings.output_settings())
            return _run(dataclasses.replace(job, resume=resume), console)
        except TrainerError:  # refused once OUT was ours (--device, the memory estimate, no prompt to answer, ...):
            outfile.take_back(made)  # under the lock, so no other job can be writing the OUT it removes
            raise


def row_rule(job: Job, tokenizer):
    """-> (prompt ids, answer ids, stopped) -> trainer.regen.rows.Row, under --thinking and --drop-truncated.
    --thinking drop on a tokenizer without `<think>` / `</think>` tokens is one ConfigError."""
    from trainer.regen.rows import finish, thinking_markers

    s = job.settings
    markers = thinking_markers(tokenizer) if s.thinking == "drop" else None
    if s.thinking == "drop" and markers is None:
        raise ConfigError(f"--thinking drop: the tokenizer of {job.target.path} has no <think> and </think> tokens",
                          hint="leave --thinking at keep for a target without a reasoning segment")

    @functools.lru_cache(maxsize=None)
    def is_blank(token: int) -> bool:
        return not tokenizer.decode([token]).strip()

    return lambda prompt, answer, stopped: finish(prompt, answer, stopped, thinking=s.thinking, markers=markers,
                                                  drop_truncated=s.drop_truncated, is_blank=is_blank)


def _run(job: Job, console) -> dict:
    import time

    from trainer.metrics import JobProgress

    dtype = answer_dtype(job)
    tokenizer, stops, ids, todo, failures = prepare(job, console)
    row_of = row_rule(job, tokenizer)
    total = len(ids) * job.settings.continuations
    done = total - len(todo)
    earlier = list((job.resume.meta or {}).get("engines", []))  # of the starts before this one
    if done:
        torn = ", a torn last line (killed mid-write) dropped" if job.resume.torn or job.resume.skipped.torn else ""
        console.say(f"resuming {job.out}: {done} answers kept{torn}")
    # what OUT and OUT.skipped.jsonl hold, kept up to date as lines are written: the accounting is read from them
    rows, truncated = set(job.resume.answered), set(job.resume.truncated)
    skipped = list(job.resume.skipped.reasons)

    def meta(state: str) -> dict:
        counts = tally(list(dict.fromkeys(p.key for p in job.prompts)), job.settings.continuations, failures,
                       frozenset(rows), frozenset(truncated), tuple(skipped), lines=job.report.lines,
                       malformed=len(job.report.bad), repeats=job.repeats)
        # this start's engine as it is now: "static" becomes "static->hf" where the static engine fails midway
        now = [engine.used] if engine is not None and engine.used not in earlier else []
        return meta_record(job, stops, earlier + now, done, total, state, counts, dtype)

    writer = outfile.AnswerWriter(job.out, job.resume.keep_bytes)
    left_out = outfile.AnswerWriter(outfile.skipped_path(job.out), job.resume.skipped.keep_bytes)
    tokens = stopped = answered = dropped = 0
    engine = None
    try:
        outfile.write_meta(job.out, meta("running"))
        if todo:
            engine, _ = build_engine(job, tokenizer, stops, [ids[p.key] for p, _ in todo], console)
            outfile.write_meta(job.out, meta("running"))
        t0 = time.perf_counter()
        progress = JobProgress("regenerate", total, "answers", console, resumed=done)
        progress.update(done, 0)
        streams = [stream_of(p.key, sample) for p, sample in todo]
        # every pending prompt through the engine at once: a static engine's slots refill across what used to be
        # batch boundaries; each answer is written as it ends (completion order), so an interrupted job loses the
        # answers in flight only. A static engine that fails midway hands the pairs it has not answered to HF:
        # each pair still comes once, so the counts below hold
        answers = engine.stream([ids[p.key] for p, _ in todo], streams) if todo else iter(())
        used = engine.used if engine is not None else None
        for at, answer in answers:
            if engine.used != used:  # the static engine failed midway: a job killed from here on says HF wrote too
                used = engine.used
                outfile.write_meta(job.out, meta("running"))
            p, sample = todo[at]
            ended = bool(answer) and answer[-1] in stops
            row = row_of(ids[p.key], answer, ended)
            pair = (p.key, sample)
            if row.skipped:
                left_out.write(outfile.answer_line(row.prompt, row.answer, p.key, sample, ended, p.source,
                                                   skipped=row.skipped))
                skipped.append((pair, row.skipped))
                dropped += 1
            else:
                writer.write(outfile.answer_line(row.prompt, row.answer, p.key, sample, ended, p.source))
                rows.add(pair)
                if not ended:
                    truncated.add(pair)
            tokens, stopped, answered = tokens + len(answer), stopped + ended, answered + 1
            done += 1
            progress.update(done, tokens)
    finally:
        writer.close()
        left_out.close()
        # counted from the files as they are: an interrupt between a line's write and its count is no miscount
        ended_with = outfile.scan_out(job.out)
        rows, truncated = set(ended_with.answered), set(ended_with.truncated)
        skipped = list(ended_with.skipped.reasons)
        outfile.write_meta(job.out, meta("done" if done == total else "stopped"))
    record = {"done": done, "total": total, "new": answered, "left_out": dropped, "out": str(job.out),
              "meta": str(outfile.meta_path(job.out)), "engine": engine.used if engine else "none", "tokens": tokens,
              "stopped_frac": round(stopped / answered, 4) if answered else None,
              "seconds": round(time.perf_counter() - t0, 1)}
    ended = f", {stopped / answered:.0%} of them ended on a stop id" if answered else ""
    out_of = f", {dropped} left out of the training data ({outfile.skipped_path(job.out)})" if dropped else ""
    progress.done(record, f"regenerated {answered} new answers ({done}/{total} in all) into {job.out}{ended}"
                          f"{out_of}; provenance in {outfile.meta_path(job.out)}")
    return record
