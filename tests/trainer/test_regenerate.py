"""`python -m trainer regenerate`: prompt files of every format -> the target's own answers as training lines, with
their provenance; resumed after a kill; refused in one line before torch on bad input; and the whole chain
regenerate -> train -> export -> eval on the tiny Qwen3 target (hf engine, CPU)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_ops.metrics_line import latest
from trainer.data.source import BadLineFile
from trainer.errors import ConfigError, DataError
from trainer.prompts import read_prompt_files
from trainer.regen import outfile
from trainer.regen.plan import (RegenSettings, SamplingSettings, check_settings, distinct_prompts, prompt_key,
                                template_kwargs)

REPO_ROOT = Path(__file__).resolve().parents[2]
SMOKE = REPO_ROOT / "trainer" / "assets" / "smoke.jsonl"
FIXTURES = Path(__file__).parent / "fixtures" / "prompts"

MIXED = (b'{"conversations": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "count from 3 '
         b'to 9"}, {"role": "assistant", "content": "3 4 5 6 7 8 9 done"}, {"role": "user", "content": "add 12 and '
         b'30"}, {"role": "assistant", "content": "42"}]}\n'
         b'{"messages": [{"role": "user", "content": "count from 5 to 8"}]}\n'
         b'{"conversations": [{"from": "human", "value": "repeat twice : cat dog"}, {"from": "gpt", "value": "x"}]}\n'
         b"\n"
         b"count from 1 to 4\n"
         b'{"question": "add 12 and 30", "answer": "42"}\n'
         b"\xff\xfe not utf-8\n"
         b'{"conversations": [{"from": "robot", "value": "hi"}]}\n'
         b'{"messages": [{"role": "assistant", "content": "no question"}]}\n'
         b'{"unknown": 1}\n')


def test_every_format_becomes_a_conversation_through_its_last_user_turn(tmp_path):
    f = tmp_path / "mixed.jsonl"
    f.write_bytes(MIXED)
    listing = BadLineFile(tmp_path / "bad.txt")
    lines, report = read_prompt_files([str(f)], 0.5, listing)
    assert [(x.line_no, x.format) for x in lines] == [(1, "chat"), (2, "chat"), (3, "sharegpt"), (5, "text"),
                                                      (6, "gsm8k")]
    first = lines[0].turns
    assert [t["role"] for t in first] == ["system", "user", "assistant", "user"] and first[-1]["content"] == \
        "add 12 and 30"  # the answer after the last user turn is what gets regenerated
    assert lines[2].turns == ({"role": "user", "content": "repeat twice : cat dog"},)
    assert report.lines == 9 and [b.line_no for b in report.bad] == [7, 8, 9, 10]
    assert listing.path.read_text().splitlines() == [
        f"{f}:7: invalid UTF-8 at byte 1 of the line (invalid start byte)",
        f"{f}:8: turn 1: unknown ShareGPT speaker 'robot'", f"{f}:9: no user turn",
        f"{f}:10: a JSON object of no known prompt format"]
    with pytest.raises(DataError, match=r"too many malformed lines \(44.4% > --max-bad-fraction=0.01\)") as e:
        read_prompt_files([str(f)], 0.01)
    assert f"{f}:7 (invalid UTF-8" in str(e.value)
    (tmp_path / "empty.txt").write_text("\n \n")
    with pytest.raises(DataError, match="prompt file .*empty.txt is empty"):
        read_prompt_files([str(f), str(tmp_path / "empty.txt")], 0.5)


def test_a_lone_surrogate_escape_is_a_malformed_prompt_line(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "ok one"}\n{"prompt": "bad \\ud800 half"}\n{"prompt": "pair \\ud83d\\ude00"}\n')
    listing = BadLineFile(tmp_path / "bad.txt")
    lines, report = read_prompt_files([str(f)], 0.5, listing)
    assert [x.line_no for x in lines] == [1, 3] and lines[1].turns[-1]["content"] == "pair \U0001F600"
    assert listing.path.read_text().splitlines() == [
        f"{f}:2: a lone surrogate escape (\\ud800-\\udfff without its pair), which UTF-8 cannot encode"]
    prompts, _ = distinct_prompts(lines, None)  # keyed by their UTF-8 bytes: no encoding error left
    assert len(prompts) == 2


def test_prompts_are_keyed_by_what_the_target_sees_and_answered_once(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("a\nb\na\nc\n")
    lines, _ = read_prompt_files([str(f)], 0.0)
    prompts, repeats = distinct_prompts(lines, None)
    assert [p.turns[-1]["content"] for p in prompts] == ["a", "b", "c"] and repeats == 1
    assert prompts[0].source == f"{f}:1" and prompts[0].key == prompt_key(({"role": "user", "content": "a"},))
    with_system, _ = distinct_prompts(lines, "be brief", limit=2)
    assert len(with_system) == 2 and with_system[0].turns[0] == {"role": "system", "content": "be brief"}
    assert with_system[0].key != prompts[0].key  # another prompt for the target, another key


@pytest.mark.parametrize("change, message", [
    (dict(continuations=2), "needs --temperature > 0"),
    (dict(sampling=SamplingSettings(top_p=0.0)), "--top-p must be in"),
    (dict(sampling=SamplingSettings(max_new_tokens=0)), "--max-new must be >= 1"),
    (dict(batch=0), "--batch must be >= 1"),
    (dict(device="gpu"), "--device must be auto, cpu, cuda or cuda:N, got 'gpu'"),
    (dict(sampling=SamplingSettings(temperature=float("inf"))), "--temperature must be a finite number >= 0"),
    (dict(sampling=SamplingSettings(temperature=float("nan"))), "--temperature must be a finite number >= 0"),
    (dict(sampling=SamplingSettings(temperature=-0.5)), "--temperature must be a finite number >= 0"),
    (dict(sampling=SamplingSettings(seed=-1)), r"--seed must be in \[0, 2\*\*64\).*got -1"),
    (dict(sampling=SamplingSettings(seed=2 ** 64)), r"--seed must be in \[0, 2\*\*64\)"),
])
def test_bad_settings_are_refused(change, message):
    check_settings(RegenSettings(sampling=SamplingSettings(temperature=0.7), continuations=3))
    with pytest.raises(ConfigError, match=message):
        check_settings(RegenSettings(**change))


def test_chat_template_options():
    assert template_kwargs(None, "off") == {"enable_thinking": False}
    assert template_kwargs('{"enable_thinking": true, "x": 1}', "on") == {"enable_thinking": True, "x": 1}
    for raw, thinking, message in (('{"enable_thinking": true}', "off", "disagree"), ("[1]", None, "JSON object"),
                                   ("{", None, "not JSON"), ('{"tokenize": true}', None, "regenerate itself")):
        with pytest.raises(ConfigError, match=message):
            template_kwargs(raw, thinking)


def test_a_torn_last_line_is_dropped_on_resume_and_foreign_files_are_refused(tmp_path):
    out = tmp_path / "out.jsonl"
    outfile.write_meta(out, {"target": {"config_sha256": "abc"}, "settings": {"sampling": {"seed": 0}}})
    whole = outfile.answer_line([1, 2], [3, 4], "k1", 0, True, "p:1") + outfile.answer_line([1], [5], "k2", 1, False,
                                                                                            "p:2")
    out.write_bytes(whole + b'{"input_ids": [1, 2')  # killed mid-write
    resume = outfile.scan_out(out)
    assert resume.answered == {("k1", 0), ("k2", 1)} and resume.torn and resume.keep_bytes == len(whole)
    writer = outfile.AnswerWriter(out, resume.keep_bytes)
    writer.write(outfile.answer_line([1], [6], "k3", 0, True, "p:3"))
    writer.close()
    assert out.read_bytes() == whole + outfile.answer_line([1], [6], "k3", 0, True, "p:3")
    outfile.check_same_run(resume.meta, {"config_sha256": "abc"}, {"sampling": {"seed": 0}})
    with pytest.raises(ConfigError, match=r"other settings \(sampling.seed 0 -> 1\)"):
        outfile.check_same_run(resume.meta, {"config_sha256": "abc"}, {"sampling": {"seed": 1}})
    with pytest.raises(ConfigError, match="another target"):
        outfile.check_same_run(resume.meta, {"config_sha256": "def", "path": "/t"}, {"sampling": {"seed": 0}})
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_text('{"input_ids": [1], "loss_mask": [1]}\n')
    with pytest.raises(ConfigError, match="was not written by regenerate"):
        outfile.scan_out(foreign)


def test_a_resume_with_other_weights_under_the_same_config_is_refused(tmp_path):
    """A fine-tune shares its base's config.json and file sizes: the sampled-bytes fingerprint tells them apart."""
    from trainer.targetdir import weights_fingerprint

    base = fake_target(tmp_path / "base", {"model_type": "qwen3"}, weights=False)
    tuned = fake_target(tmp_path / "tuned", {"model_type": "qwen3"}, weights=False)
    moved = fake_target(tmp_path / "moved", {"model_type": "qwen3"}, weights=False)
    blob = bytes(range(256)) * 4096  # 1 MiB
    (base / "model.safetensors").write_bytes(blob)
    (moved / "model.safetensors").write_bytes(blob)
    (tuned / "model.safetensors").write_bytes(blob[:700_000] + b"\x01" + blob[700_001:])  # one byte, mid-file
    fp = {d.name: weights_fingerprint(d) for d in (base, tuned, moved)}
    assert fp["base"] == fp["moved"] != fp["tuned"]
    meta = {"target": {"config_sha256": "abc", "weights_fingerprint": fp["base"], "path": str(base)}}
    outfile.check_same_run(meta, {"config_sha256": "abc", "weights_fingerprint": fp["moved"]}, {})
    with pytest.raises(ConfigError, match="other weights"):
        outfile.check_same_run(meta, {"config_sha256": "abc", "weights_fingerprint": fp["tuned"]}, {})
    shards = sharded_target(tmp_path / "shards")
    (shards / "model-00002-of-00002.safetensors").write_bytes(blob)
    before = weights_fingerprint(shards)
    (shards / "model-00002-of-00002.safetensors").write_bytes(blob[::-1])  # every shard is read
    assert weights_fingerprint(shards) != before


def test_a_sidecar_beside_no_answer_binds_no_setting(tmp_path):
    """A start that failed before its first answer (no GPU, say) left its sidecar: the next start, with other
    settings, is not refused."""
    out = tmp_path / "out.jsonl"
    outfile.write_meta(out, {"format": outfile.META_FORMAT, "target": {"config_sha256": "abc"},
                             "settings": {"sampling": {"max_new_tokens": 512}}})
    out.touch()
    resume = outfile.scan_out(out)
    assert resume.answered == frozenset() and resume.meta is None
    outfile.check_same_run(resume.meta, {"config_sha256": "abc"}, {"sampling": {"max_new_tokens": 16}})


def test_stop_ids_are_eos_the_generation_configs_the_templates_marker_and_known_end_of_turn_tokens():
    from trainer.data.source import turn_end_marker
    from trainer.decode.stops import cut_at_stop, stop_ids
    from trainer.tiny import build_tokenizer

    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|eot_id|>", "<end_of_turn>"]})
    eos, im_end = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    eot, end_of_turn = tok.convert_tokens_to_ids(["<|eot_id|>", "<end_of_turn>"])
    assert turn_end_marker(tok) == "<|im_end|>"
    assert stop_ids(tok, (7, eos), turn_end_marker(tok)) == (eos, 7, im_end, end_of_turn, eot)
    assert cut_at_stop([5, 9, eot, 3, eos], (eos, eot)) == [5, 9, eot] and cut_at_stop([5, 9], (eos,)) == [5, 9]


# ---------------------------------------------------------------- bad input: one line, before torch

def fake_target(root: Path, config: dict, template: bool = True, weights: bool = True, tokenizer: bool = True) -> Path:
    """A target directory as far as the checks before torch read it (config.json, the chat template, that weight
    and tokenizer files are there)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    if template:
        (root / "chat_template.jinja").write_text("{{ messages }}")
    if weights:
        (root / "model.safetensors").write_bytes(b"")
    if tokenizer:
        (root / "tokenizer.json").write_text("{}")
    return root


def sharded_target(root: Path) -> Path:
    """Two shards in the index, one of them not downloaded."""
    fake_target(root, {"model_type": "qwen3"}, weights=False)
    index = {"weight_map": {"a.weight": "model-00001-of-00002.safetensors",
                            "b.weight": "model-00002-of-00002.safetensors"}}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    (root / "model-00001-of-00002.safetensors").write_bytes(b"")
    return root


def _case(tmp_path: Path, name: str) -> tuple[list[str], int, str]:
    good = fake_target(tmp_path / "good", {"model_type": "qwen3", "num_hidden_layers": 2})
    prompts = tmp_path / "p.txt"
    prompts.write_text("count from 1 to 4\n")
    out = str(tmp_path / "out.jsonl")
    cases = {
        "missing target": (["--target", str(tmp_path / "nope")], 2, "error: target directory "),
        "no chat template": (["--target", str(fake_target(tmp_path / "base", {"model_type": "llama"}, False))], 2,
                             "error: target "),
        "unknown family": (["--target", str(fake_target(tmp_path / "odd", {"model_type": "no-such-family"}))], 2,
                           "error: target "),
        "state-space hybrid": (["--target", str(fake_target(tmp_path / "hyb", {"model_type": "jamba"}))], 2,
                               "error: target family 'jamba'"),
        "quantized": (["--target", str(fake_target(tmp_path / "gptq", {"model_type": "qwen3", "quantization_config": {
            "quant_method": "gptq"}}))], 2, "error: target " + str(tmp_path / "gptq") + ": its weights are quantized"),
        "multimodal": (["--target", str(fake_target(tmp_path / "mm", {"model_type": "gemma3", "vision_config": {
            "model_type": "siglip_vision_model"}, "text_config": {"num_hidden_layers": 2}}))], 2,
                       "error: target " + str(tmp_path / "mm") + ": 'gemma3' is a multimodal checkpoint"),
        "no weights": (["--target", str(fake_target(tmp_path / "now", {"model_type": "qwen3"}, weights=False))], 2,
                       "error: target " + str(tmp_path / "now") + ": no weights"),
        "a shard missing": (["--target", str(sharded_target(tmp_path / "shard"))], 2,
                            "error: target " + str(tmp_path / "shard") + ": shard model-00002-of-00002.safetensors"),
        "no tokenizer": (["--target", str(fake_target(tmp_path / "notok", {"model_type": "qwen3"}, tokenizer=False))],
                         2, "error: target " + str(tmp_path / "notok") + ": no tokenizer files"),
        "empty prompt file": (["--prompts", str(tmp_path / "empty.txt")], 3, "error: prompt file "),
        "invalid UTF-8": (["--prompts", str(tmp_path / "bytes.txt")], 3, "error: too many malformed lines"),
        "out not writable": (["--out", "/sys/dflash-regen.jsonl"], 2, "error: cannot write --out /sys/"),
        "greedy continuations": (["--continuations", "2"], 2, "error: --continuations 2 needs --temperature > 0"),
        "infinite temperature": (["--temperature", "inf"], 2, "error: --temperature must be a finite number >= 0"),
        "seed out of range": (["--seed", "-1"], 2, "error: --seed must be in [0, 2**64)"),
        "max-new past the positions": (["--target", str(fake_target(tmp_path / "short", {
            "model_type": "qwen3", "max_position_embeddings": 64})), "--max-new", "64"], 2,
                                       "error: --max-new 64 leaves no room for a prompt in the target's 64 positions"),
    }
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "bytes.txt").write_bytes(b"\xff one\n\xc3\x28 two\n")
    extra, code, start = cases[name]
    args = {"--target": str(good), "--prompts": str(prompts), "--out": out, **dict(zip(extra[::2], extra[1::2]))}
    return [a for kv in args.items() for a in kv], code, start


@pytest.mark.parametrize("name", ["missing target", "no chat template", "unknown family", "state-space hybrid",
                                  "quantized",
                                  "multimodal", "no weights", "a shard missing", "no tokenizer",
                                  "empty prompt file", "invalid UTF-8", "out not writable", "greedy continuations",
                                  "infinite temperature", "seed out of range", "max-new past the positions"])
def test_bad_input_is_one_line_and_an_exit_code_before_torch(tmp_path, name):
    from tests.trainer.test_cli import imported

    argv, code, start = _case(tmp_path, name)
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "trainer", "regenerate", *argv], cwd=REPO_ROOT,
                          env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)), capture_output=True, text=True)
    errors = [ln for ln in proc.stderr.splitlines() if not ln.startswith(("import time:", "hint:"))]
    assert proc.returncode == code and len(errors) == 1 and errors[0].startswith(start), proc.stderr[-2000:]
    assert "torch" not in imported(proc.stderr) and "transformers" not in imported(proc.stderr)
    assert not (tmp_path / "out.jsonl").exists() and not (tmp_path / "out.jsonl.meta.json").exists()


def test_a_refused_job_leaves_no_folder_its_out_would_have_needed(tmp_path):
    """--out a/b/o.jsonl with a prompt file that is not there: exit 3, and neither a/ nor a/b/ is left behind by the
    probe of --out (a job that goes on makes them again when it takes --out)."""
    target = fake_target(tmp_path / "good", {"model_type": "qwen3", "num_hidden_layers": 2})
    out = tmp_path / "a" / "b" / "o.jsonl"
    proc = subprocess.run([sys.executable, "-m", "trainer", "regenerate", "--target", str(target), "--out", str(out),
                           "--prompts", str(tmp_path / "missing.txt")], cwd=REPO_ROOT,
                          env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)), capture_output=True, text=True)
    assert proc.returncode == 3 and f"error: prompt file not found: {tmp_path / 'missing.txt'}" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good"]
    outfile.check_writable(out)
    assert not (tmp_path / "a").exists()
    outfile.lock_out(out).close()
    assert out.is_file()


# ---------------------------------------------------------------- the real thing, on the tiny target

def regenerate(capsys, *args: str, engine: str = "hf") -> tuple[int, list[str], str]:
    """`python -m trainer regenerate --engine ENGINE ARGS` in this process (the same CLI function) -> (exit code,
    stdout lines, stderr)."""
    from trainer.__main__ import main

    code = main(["regenerate", "--engine", engine, *args])
    captured = capsys.readouterr()
    return code, captured.out.splitlines(), captured.err


def records(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_answers_are_the_targets_own_tokens_and_a_restart_goes_on(tiny_target_dir, full_target, tmp_path, capsys):
    from trainer.data.source import load_samples
    from trainer.decode.reference import generate_target_only
    from trainer.decode.stops import cut_at_stop
    from trainer.regen.run import render

    prompts = tmp_path / "mixed.jsonl"
    prompts.write_bytes(MIXED)
    out = tmp_path / "data" / "regen.jsonl"
    # A target whose generation_config.json would sample, and penalise repeats: only the job's settings apply.
    target_dir = Path(shutil.copytree(tiny_target_dir, tmp_path / "target"))
    (target_dir / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.01, "top_k": 1, "repetition_penalty": 5.0, "eos_token_id": [0, 2]}))
    common = ["--target", str(target_dir), "--out", str(out), "--max-new", "12", "--batch", "2",
              "--max-bad-fraction", "0.5"]
    code, lines, _ = regenerate(capsys, "--prompts", str(prompts), "--limit", "2", *common)
    assert code == 0
    first = out.read_bytes()
    assert len(records(out)) == 2
    out.write_bytes(first + b'{"input_ids": [1, 2, 3')  # what a kill in the middle of a write leaves
    code, lines, _ = regenerate(capsys, "--prompts", str(prompts), str(FIXTURES / "gsm8k.jsonl"), *common)
    assert code == 0
    assert out.read_bytes().startswith(first)  # earlier answers kept as they were, the torn line gone
    rows = records(out)
    keys = [(r["regen"]["key"], r["regen"]["sample"]) for r in rows]
    # 5 distinct prompts of mixed.jsonl + "count from 3 to 9" of gsm8k.jsonl ("add 12 and 30" is there twice)
    assert len(rows) == 6 and len(set(keys)) == 6
    assert any("a torn last line (killed mid-write) dropped" in x and "2 answers kept" in x for x in lines)
    assert any(f"warning: skipped 4 of 11 lines malformed: {prompts}:7 (invalid UTF-8" in x for x in lines)
    meta = json.loads(outfile.meta_path(out).read_text())
    assert meta["state"] == "done" and meta["answers"] == meta["total"] == 6 and meta["engines"] == ["hf"]
    assert meta["settings"]["sampling"] == {"max_new_tokens": 12, "temperature": 0.0, "top_p": 1.0, "seed": 0}
    assert meta["target"]["config_sha256"] and meta["stop_ids"] == [0, 2]  # <|endoftext|>, <|im_end|>
    assert outfile.bad_lines_path(out).read_text().count("\n") == 4

    # Each line: the chat template's rendering of the prompt, then exactly the target's greedy tokens.
    tok = full_target.tokenizer
    by_source = {r["regen"]["source"]: r for r in rows}
    multi = by_source[f"{prompts}:1"]
    lines_, _ = read_prompt_files([str(prompts)], 0.5)
    prompt_ids = render(tok, lines_[0].turns, {})
    assert multi["input_ids"][:len(prompt_ids)] == prompt_ids and sum(multi["loss_mask"]) == \
        len(multi["input_ids"]) - len(prompt_ids) and "3 4 5 6 7 8 9 done" in tok.decode(prompt_ids)
    for r in rows:
        n = len(r["loss_mask"]) - sum(r["loss_mask"])
        want = cut_at_stop(generate_target_only(full_target, r["input_ids"][:n], 12), meta["stop_ids"])
        assert r["input_ids"][n:] == want and r["regen"]["stopped"] == (want[-1] in meta["stop_ids"])
    # The trainer reads the file as it is (`regen` is ignored), every line supervised on its answer only.
    samples, report = load_samples([str(out)], tok, len(tok), max_bad_fraction=0.0)
    assert len(samples) == 6 and not report.bad

    # What `dflash-ops status` reads from the log: the last progress line, done.
    parsed = latest(lines)
    assert parsed.job == "regenerate" and parsed.done == parsed.total == 6 and parsed.finished
    # Other settings on the same file are refused; the file is untouched.
    before = out.read_bytes()
    code, _, err = regenerate(capsys, "--prompts", str(prompts), *common, "--enable-thinking", "off")
    assert code == 2 and out.read_bytes() == before
    assert "error: --out was written with other settings (chat_template_kwargs.enable_thinking None -> False)" in err


def test_sampled_continuations_and_the_chain_to_a_drafter(tiny_target_dir, tmp_path, capsys):
    """N sampled answers per prompt; then regenerate -> train -> export -> eval, the user's whole path, on CPU."""
    from trainer.__main__ import main

    sampled = tmp_path / "sampled.jsonl"
    code, _, err = regenerate(capsys, "--target", str(tiny_target_dir), "--prompts", str(FIXTURES / "mtbench.jsonl"),
                         "--out", str(sampled), "--max-new", "8", "--temperature", "1.5", "--top-p", "0.9",
                         "--continuations", "3", "--seed", "7")
    rows = records(sampled)
    assert code == 0 and sorted((r["regen"]["source"][-1], r["regen"]["sample"]) for r in rows) == \
        [(n, i) for n in "12" for i in range(3)]
    assert len({tuple(r["input_ids"]) for r in rows}) > 2  # sampled: not all equal

    data = tmp_path / "regen.jsonl"
    code, _, err = regenerate(capsys, "--target", str(tiny_target_dir), "--prompts", str(SMOKE), "--limit", "24",
                         "--out", str(data), "--max-new", "24", "--batch", "8")
    assert code == 0 and len(records(data)) == 24
    run = tmp_path / "run"
    sets = [f"model.target={tiny_target_dir}", f'data.paths=["{data}"]', "data.seq_len=128", "data.rows_per_step=2",
            "data.num_anchors=8", "optim.max_steps=3", "log.every=3", "ckpt.every=0", "eval_at_end=false"]
    assert main(["train", "--recipe", "smoke", "--run-dir", str(run), *[a for s in sets for a in ("--set", s)]]) == 0
    assert [r["step"] for r in records(run / "metrics.jsonl")] == [3]
    assert main(["export", "--run-dir", str(run)]) == 0
    capsys.readouterr()
    assert main(["eval", "--drafter", str(run / "export"), "--target", str(tiny_target_dir), "--prompts",
                 str(FIXTURES / "gsm8k.jsonl"), "--limit", "1", "--max-new", "8"]) == 0
    evals = [json.loads(x.split(" ", 1)[1]) for x in capsys.readouterr().out.splitlines()
             if x.startswith("DFLASH_EVAL ")]
    assert len(evals) == 1 and evals[0]["identical"] == 1 and evals[0]["tau"] >= 1.0


def test_the_static_engine_answers_as_hf_and_a_resumed_sampled_job_draws_the_same_samples(tiny_target_dir, tmp_path,
                                                                                            capsys):
    """--engine static (the default) on CPU: greedy answers equal the hf engine's line for line; sampled, a job cut
    after its first batch and resumed (other batches) writes the samples an uninterrupted job writes."""
    args = ["--target", str(tiny_target_dir), "--prompts", str(SMOKE), "--limit", "6", "--max-new", "10",
            "--batch", "4"]
    outs = {}
    for engine in ("hf", "static"):
        outs[engine] = tmp_path / f"{engine}.jsonl"
        code, lines, _ = regenerate(capsys, *args, "--out", str(outs[engine]), engine=engine)
        assert code == 0 and not any("note:" in x for x in lines)  # console lines: "[  1.2s] note: ..."
        assert json.loads(outfile.meta_path(outs[engine]).read_text())["engines"] == [engine]
    by_key = {e: {r["regen"]["key"]: r["input_ids"] for r in records(o)} for e, o in outs.items()}
    assert len(by_key["static"]) == 6 and by_key["static"] == by_key["hf"]

    sampled = [*args, "--temperature", "1.5", "--continuations", "2", "--seed", "3"]
    whole, cut = tmp_path / "whole.jsonl", tmp_path / "cut.jsonl"
    assert regenerate(capsys, *sampled, "--out", str(whole), engine="static")[0] == 0
    assert regenerate(capsys, *sampled, "--out", str(cut), engine="static")[0] == 0
    kept = cut.read_text().splitlines(keepends=True)[:5]  # as if killed after 5 of 12 answers
    cut.write_text("".join(kept))
    assert regenerate(capsys, *sampled, "--out", str(cut), engine="static")[0] == 0

    def samples(path):
        return {(r["regen"]["key"], r["regen"]["sample"]): r["input_ids"] for r in records(path)}
    assert len(samples(whole)) == 12 and samples(cut) == samples(whole)
    assert len({tuple(v) for v in samples(whole).values()}) > 6  # sampled: the answers differ


def test_more_prompts_than_slots_are_all_answered_with_their_provenance_and_a_resume_skips_them(
        tiny_target_dir, full_target, tmp_path, capsys):
    """6 prompts through --batch 2 static slots (each slot refilled): every prompt answered once, each line's key,
    source and prompt tokens its own prompt's (the file is in completion order, not prompt order); a resume after 3
    lines answers only the other 3 and ends with the lines an uninterrupted job wrote."""
    from trainer.regen.run import render

    out, cut = tmp_path / "all.jsonl", tmp_path / "cut.jsonl"
    args = ["--target", str(tiny_target_dir), "--prompts", str(SMOKE), "--limit", "6", "--max-new", "10",
            "--batch", "2"]
    assert regenerate(capsys, *args, "--out", str(out), engine="static")[0] == 0
    lines_, _ = read_prompt_files([str(SMOKE)], 0.0)
    prompts, _ = distinct_prompts(lines_, None, 6)
    by_key = {p.key: p for p in prompts}
    rows = records(out)
    assert sorted(r["regen"]["key"] for r in rows) == sorted(by_key) and len(rows) == 6
    for r in rows:
        p = by_key[r["regen"]["key"]]
        prompt_ids = render(full_target.tokenizer, p.turns, {})
        assert r["regen"]["source"] == p.source and r["input_ids"][:len(prompt_ids)] == prompt_ids
        assert sum(r["loss_mask"]) == len(r["input_ids"]) - len(prompt_ids) and r["regen"]["sample"] == 0

    assert regenerate(capsys, *args, "--out", str(cut), engine="static")[0] == 0
    kept = cut.read_text().splitlines(keepends=True)[:3]  # as if killed after 3 of 6 answers
    cut.write_text("".join(kept))
    code, lines, _ = regenerate(capsys, *args, "--out", str(cut), engine="static")
    assert code == 0 and any("3 answers kept" in x for x in lines)
    resumed = records(cut)
    assert cut.read_text().startswith("".join(kept)) and len(resumed) == 6
    assert {r["regen"]["key"]: r["input_ids"] for r in resumed} == {r["regen"]["key"]: r["input_ids"] for r in rows}
    assert latest(lines).done == 6


def test_a_second_job_on_the_same_out_is_refused_while_the_first_holds_it(tiny_target_dir, tmp_path, capsys):
    """Two regenerate jobs appending to one --out would interleave and repeat answers: the second is refused while
    the first holds OUT, and once it is gone the same command goes on."""
    import fcntl

    prompts = tmp_path / "p.txt"
    prompts.write_text('count from 1 to 4\nadd 2 and 3\n{"unknown": 1}\n')
    out = tmp_path / "regen.jsonl"
    listing = outfile.bad_lines_path(out)
    listing.write_text("the first job's listing\n")
    args = ("--target", str(tiny_target_dir), "--prompts", str(prompts), "--out", str(out), "--max-new", "4",
            "--max-bad-fraction", "0.5")
    with out.open("ab") as held:  # as the first job's lock_out holds it
        fcntl.flock(held.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        code, _out, err = regenerate(capsys, *args)
        assert code == 2 and f"error: another regenerate is writing --out {out}" in err, err
        assert out.read_bytes() == b""
        assert listing.read_text() == "the first job's listing\n"  # the refused job's own lines are not its
    code, _out, err = regenerate(capsys, *args)
    assert code == 0, err
    assert len(records(out)) == 2
    assert listing.read_text() == f"{prompts}:3: a JSON object of no known prompt format\n"


def test_a_resume_answers_in_the_dtype_its_answers_were_made_in(tiny_target_dir, tmp_path, capsys):
    """--dtype auto is bfloat16 on CUDA and float32 on a CPU: the sidecar records what it resolved to, and a resume
    that would answer in another (an OUT begun on a GPU, resumed on a CPU) is refused, OUT as it was."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("count from 1 to 4\n")
    out = tmp_path / "regen.jsonl"
    args = ("--target", str(tiny_target_dir), "--prompts", str(prompts), "--out", str(out), "--max-new", "4")
    assert regenerate(capsys, *args)[0] == 0
    meta = json.loads(outfile.meta_path(out).read_text())
    assert meta["answer_dtype"] == "float32" and meta["settings"]["dtype"] == "auto"
    outfile.meta_path(out).write_text(json.dumps({**meta, "answer_dtype": "bfloat16"}))  # as a GPU start wrote it
    prompts.write_text("count from 1 to 4\nadd 2 and 3\n")
    before = out.read_bytes()
    code, _out, err = regenerate(capsys, *args)
    assert code == 2 and f"error: --out {out} holds answers the target made in bfloat16; this start would answer in " \
        "float32 (--dtype auto on cpu)" in err, err
    assert out.read_bytes() == before


def test_a_job_whose_every_prompt_fails_is_refused_not_done(tiny_target_dir, tmp_path, capsys):
    """Every prompt too long for the target's positions (a reading --max-bad-fraction 1 allows): exit 3 after the
    tokenizer, before any weight loads, not a `done` job of no answer that a pipeline would train on."""
    target = Path(shutil.copytree(tiny_target_dir, tmp_path / "target"))
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 40}))
    prompts = tmp_path / "p.txt"
    prompts.write_text(" ".join(["count from 1 to 4"] * 12) + "\n")
    out = tmp_path / "regen.jsonl"
    code, _out, err = regenerate(capsys, "--target", str(target), "--prompts", str(prompts), "--out", str(out),
                                 "--max-new", "6", "--max-bad-fraction", "1")
    assert code == 3, err
    assert f"error: no prompt to answer in ['{prompts}']: 1 of 1 lines malformed: {prompts}:1 (" in err, err
    assert "loading the target" not in err
    assert outfile.bad_lines_path(out).read_text().startswith(f"{prompts}:1: ")
    assert not out.exists() and not outfile.meta_path(out).exists()  # no empty OUT a pipeline could train on


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_5", "gpt_oss"])
def test_the_whole_path_on_a_2026_family(family, family_dirs, tmp_path, capsys):
    """regenerate (a dense hybrid and gpt-oss on the static engine's layer stack) -> train -> export -> eval on a hybrid and on gpt-oss, and the export loads into SpecForge's DFlash drafter
    (an implementation written elsewhere) with every weight used."""
    from trainer.__main__ import main

    target = str(family_dirs[family])
    data = tmp_path / "regen.jsonl"
    code, out, _err = regenerate(capsys, "--target", target, "--prompts", str(SMOKE), "--limit", "8",
                                 "--out", str(data), "--max-new", "16", "--batch", "4", engine="static")
    assert code == 0 and len(records(data)) == 8
    assert not any("note: the static engine cannot serve this target" in x for x in out), out
    run = tmp_path / "run"
    sets = [f"model.target={target}", f'data.paths=["{data}"]', "data.seq_len=128", "data.rows_per_step=2",
            "data.num_anchors=8", "optim.max_steps=2", "log.every=2", "ckpt.every=0", "eval_at_end=false",
            "model.num_draft_layers=2", "model.target_layer_ids=[1, 3]"]
    assert main(["train", "--recipe", "smoke", "--run-dir", str(run), *[a for s in sets for a in ("--set", s)]]) == 0
    assert main(["export", "--run-dir", str(run)]) == 0
    capsys.readouterr()
    assert main(["eval", "--drafter", str(run / "export"), "--target", target, "--prompts",
                 str(FIXTURES / "gsm8k.jsonl"), "--limit", "1", "--max-new", "8"]) == 0
    evals = [json.loads(x.split(" ", 1)[1]) for x in capsys.readouterr().out.splitlines()
             if x.startswith("DFLASH_EVAL ")]
    assert len(evals) == 1 and evals[0]["identical"] == 1
    from tests.trainer.test_interop import specforge_drafter

    specforge_drafter(run / "export")
