"""regenerate's accounting (answered + failed + skipped + pending = the job's answers, across a resume), rows that
reach --max-new (marked, or left out with --drop-truncated), --thinking keep|drop on a chat template with a
reasoning segment, and the memory estimate made before any weight loads."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from trainer.errors import ConfigError
from trainer.regen import memory, outfile
from trainer.regen.accounting import PROMPT_TOO_LONG, TEMPLATE_REFUSED, Failure, tally
from trainer.regen.rows import (NO_ANSWER, TRUNCATED, UNCLOSED_THINKING, Row, ThinkMarkers, drop_thinking,
                                finish)

REPO_ROOT = Path(__file__).resolve().parents[2]
SMOKE = REPO_ROOT / "trainer" / "assets" / "smoke.jsonl"

# Qwen3's rule, cut to what matters here: thinking on, the model opens <think> itself; off, an empty block is given
QWEN3_THINKING = (
    "{% for message in messages %}{% if message['role'] == 'system' and loop.index0 > 0 %}"
    "{{ raise_exception('System message must be at the beginning.') }}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}")
# Thinking-only models (Qwen3-...-Thinking-2507) open the segment in the generation prompt
OPENS_THINKING = QWEN3_THINKING.replace("{% if enable_thinking is defined and not enable_thinking %}"
                                        "<think>\n\n</think>\n\n{% endif %}", "<think>\n")


def thinking_tokenizer(template: str = QWEN3_THINKING):
    from trainer.tiny import build_tokenizer

    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|MASK|>", "<think>",
                                                         "</think>"]})
    tok.chat_template = template
    return tok


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------- rows: --thinking, --drop-truncated (pure)

def test_thinking_keep_and_drop_on_a_qwen3_style_template():
    from trainer.regen.rows import thinking_markers
    from trainer.regen.run import render

    tok = thinking_tokenizer()
    m = thinking_markers(tok)
    assert m == ThinkMarkers(*tok.convert_tokens_to_ids(["<think>", "</think>"]))
    turns = ({"role": "user", "content": "count from 1 to 4"},)
    prompt = render(tok, turns, {"enable_thinking": True})
    answer = ids(tok, "<think> count from 1 to 4 </think> 1 2 3 4 <|im_end|>")
    kept = finish(prompt, answer, True, thinking="keep", markers=m)
    assert (kept.prompt, kept.answer, kept.skipped) == (prompt, answer, None)
    dropped = finish(prompt, answer, True, thinking="drop", markers=m)
    assert dropped.prompt == prompt and dropped.answer == ids(tok, "1 2 3 4 <|im_end|>") and not dropped.skipped
    # reasoning that reached --max-new: left out under drop, with the answer as generated
    open_only = ids(tok, "<think> count from 1")
    row = finish(prompt, open_only, False, thinking="drop", markers=m)
    assert (row.answer, row.skipped) == (open_only, UNCLOSED_THINKING)
    assert finish(prompt, ids(tok, "<think> 1 </think>"), False, thinking="drop", markers=m).skipped == NO_ANSWER
    # nothing after </think> but its stop id: no answer either (a row of only <|im_end|> would teach nothing)
    bare = ids(tok, "<think> 1 </think> <|im_end|>")
    assert finish(prompt, bare, True, thinking="drop", markers=m) == Row(prompt, bare, NO_ANSWER)
    # thinking off: the template closes an empty block in the prompt; the answer has none and stays whole
    off = render(tok, turns, {"enable_thinking": False})
    assert off[-2:] == [m.open_id, m.close_id]
    plain = ids(tok, "1 2 3 4 <|im_end|>")
    assert finish(off, plain, True, thinking="drop", markers=m) == finish(off, plain, True)
    # a template that opens the segment itself: the prompt is cut before its <think>
    opener = thinking_tokenizer(OPENS_THINKING)
    prompt2 = render(opener, turns, {})
    assert prompt2[-1] == m.open_id
    row = finish(prompt2, ids(opener, "count from 1 </think> 1 2 <|im_end|>"), True, thinking="drop", markers=m)
    assert row.prompt == prompt2[:-1] and row.answer == ids(opener, "1 2 <|im_end|>")
    # blank tokens after </think> go with it (Qwen3 renders an earlier turn's answer so)
    blank = ids(tok, "0")[0]
    row = drop_thinking([], [blank, m.open_id, 7, m.close_id, blank, blank, 9], m, lambda t: t == blank)
    assert row.answer == [9] and not row.skipped


def test_drop_truncated_leaves_the_row_out_and_keeps_the_rest():
    assert finish([1], [5, 6], False, drop_truncated=True).skipped == TRUNCATED
    assert finish([1], [5, 6], True, drop_truncated=True).skipped is None
    assert finish([1], [5, 6], False).skipped is None
    with pytest.raises(ValueError, match="<think>"):
        finish([1], [5], True, thinking="drop")


# ---------------------------------------------------------------- accounting (pure)

def test_every_answer_is_answered_failed_skipped_or_pending():
    fail = [Failure("c", "p:3", PROMPT_TOO_LONG, "900 prompt tokens ..."), Failure("d", "p:4", TEMPLATE_REFUSED, "x")]
    t = tally(["a", "b", "c", "d", "e"], 2, fail, rows=frozenset({("a", 0), ("a", 1), ("b", 0), ("z", 0)}),
              truncated=frozenset({("a", 1), ("z", 0)}), skipped=((("b", 1), TRUNCATED), (("e", 0), "x")),
              lines=7, malformed=1, repeats=1)
    assert (t["expected"], t["answered"], t["failed"], t["skipped"], t["pending"]) == (10, 3, 4, 2, 1)
    assert t["answered"] + t["failed"] + t["skipped"] + t["pending"] == t["expected"]
    assert t["truncated"] == {"kept": 1, "skipped": 1} and t["out_rows"] == 4  # ("z", 0): not this job's
    assert t["failures"] == {PROMPT_TOO_LONG: 2, TEMPLATE_REFUSED: 2}
    assert [f["key"] for f in t["failed_prompts"]] == ["c", "d"] and t["failed_prompts"][0]["source"] == "p:3"
    assert t["skipped_reasons"] == {TRUNCATED: 1, "x": 1}
    assert t["prompt_lines"] == {"read": 7, "malformed": 1, "repeats": 1, "prompts": 5}


# ---------------------------------------------------------------- memory sizing (pure)

def family_config(shape: str) -> dict:
    """config.json as transformers writes it for a family shape of bench/shapes.py (layer_types filled in)."""
    from bench.shapes import target_config

    return target_config(shape, 4096).to_dict()


@pytest.mark.parametrize("shape, cache, states", [
    # 1000 slots x 36 layers x K and V x 8 KV heads x 128 x bf16
    ("qwen3-8b", 1000 * 36 * 2 * 8 * 128 * 2, 0),
    # 1000 x 48 layers x 2 x 4 x 128 x 2
    ("qwen3-30b-a3b", 1000 * 48 * 2 * 4 * 128 * 2, 0),
    # (1000 slots x 12 full layers + 130 x 12 sliding ones: the window of 128 + 1 + the trash slot) x 2 x 8 x 64 x 2
    ("gpt-oss-20b", (1000 * 12 + 130 * 12) * 2 * 8 * 64 * 2, 0),
    # 8 of 32 layers full attention (2 x 4 x 256 x 2); 24 Gated DeltaNet layers: conv (2*16*128 + 32*128) x 4 at bf16
    # + a 32 x 128 x 128 fp32 state
    ("qwen3.5-9b", 1000 * 8 * 2 * 4 * 256 * 2, 24 * ((2 * 16 * 128 + 32 * 128) * 4 * 2 + 32 * 128 * 128 * 4)),
    ("qwen3.5-35b-a3b", 1000 * 10 * 2 * 2 * 256 * 2, 30 * ((2 * 16 * 128 + 32 * 128) * 4 * 2 + 32 * 128 * 128 * 4)),
])
def test_a_rows_cache_and_states_per_family(shape, cache, states):
    cfg = family_config(shape)
    part = memory.row_bytes(cfg, slots=1000, prompt_tokens=10, dtype_size=2)
    assert part["cache"] == cache and part["linear_states"] == states
    assert part["logits"] == 4 * cfg["vocab_size"] * 4
    # a config.json without layer_types: the hybrid's every 4th layer is full attention (transformers' default);
    # gpt-oss's layers then count every slot (more than the engine keeps, never less)
    bare = {k: v for k, v in cfg.items() if k != "layer_types"}
    assert memory.row_bytes(bare, 1000, 10, 2)["cache"] == \
        (1000 * 24 * 2 * 8 * 64 * 2 if shape == "gpt-oss-20b" else part["cache"])
    # a multimodal Qwen3.5 config holds the language model in text_config
    if shape.startswith("qwen3.5"):
        wrapped = {"model_type": shape.replace("-", "_"), "text_config": cfg}
        wrapped["model_type"] = "qwen3_5" if "a3b" not in shape else "qwen3_5_moe"
        assert memory.row_bytes(wrapped, 1000, 10, 2) == part


def test_the_refusal_names_a_batch_that_fits():
    cfg = family_config("qwen3-8b")
    est = memory.estimate(cfg, weights=16 * memory.GIB, slots=32_768 + 1024, prompt_tokens=1024, dtype_size=2)
    budget = int(139 * memory.GIB)
    fits = est.rows_within(budget)
    assert 1 <= fits < 64 and est.total(fits) <= budget * memory.USABLE < est.total(fits + 1)
    memory.check_fits(est, fits, budget, "cuda:0 (free)", 33_792)
    with pytest.raises(ConfigError, match=rf"--batch 64 does not fit: 64 rows need about .* GiB \(weights 16.0 GiB "
                                          rf"\+ 64 x .* MiB a row for 33792 cache slots .*cuda:0 \(free\) has 139.0 "
                                          rf"GiB; --batch {fits} fits") as e:
        memory.check_fits(est, 64, budget, "cuda:0 (free)", 33_792)
    assert e.value.hint == f"pass --batch {fits}, or a smaller --max-new"
    with pytest.raises(ConfigError, match="not even --batch 1 fits"):
        memory.check_fits(est, 1, int(17 * memory.GIB), "--memory-gib", 33_792)


def test_weights_are_counted_from_the_safetensors_headers(tmp_path):
    import torch
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text("{}")
    save_file({"a.weight": torch.zeros(4, 8, dtype=torch.float32), "b.weight": torch.zeros(3, dtype=torch.bfloat16),
               "experts.down_proj_blocks": torch.zeros(2, 16, dtype=torch.uint8),  # MXFP4: two values a byte
               "experts.down_proj_scales": torch.zeros(2, dtype=torch.uint8)}, str(tmp_path / "model.safetensors"))
    assert memory.safetensors_elements(tmp_path / "model.safetensors") == 32 + 3 + 64
    assert memory.weight_bytes(tmp_path, 2) == 2 * 99
    assert memory.dtype_bytes("auto", "cuda") == 2 and memory.dtype_bytes("auto", "cpu") == 4


# ---------------------------------------------------------------- the real job, on the tiny target

def regenerate(capsys, *args: str) -> tuple[int, list[str], str]:
    from trainer.__main__ import main

    code = main(["regenerate", "--engine", "hf", *args])
    captured = capsys.readouterr()
    return code, captured.out.splitlines(), captured.err


def records(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def accounting(out: Path) -> dict:
    return json.loads(outfile.meta_path(out).read_text())["accounting"]


def test_truncated_rows_are_marked_or_left_out_and_a_resumed_job_counts_as_an_uninterrupted_one(
        tiny_target_dir, tmp_path, capsys):
    """--max-new 6: some answers end on a stop id, the others are truncated. Kept, they are marked; with
    --drop-truncated they go to OUT.skipped.jsonl. A job cut mid-write (a torn line in each file) and resumed ends
    with the files and counts of the uninterrupted job, and failed prompts (too long for the target's positions,
    refused by the template) are listed with their reason."""
    target = Path(shutil.copytree(tiny_target_dir, tmp_path / "target"))
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 40}))
    (target / "chat_template.jinja").write_text(QWEN3_THINKING.replace("\\n", "\n"))
    prompts = tmp_path / "p.jsonl"
    words = ("bird", "bread", "lamp", "house", "cloud", "moon")
    asks = [f"repeat twice : {w} stone sun" for w in words] + [f"add {i} and {i + 1}" for i in range(6)]
    smoke = [{"messages": [{"role": "user", "content": ask}]} for ask in asks]
    long_one = {"messages": [{"role": "user", "content": " ".join(["count from 1 to 4"] * 12)}]}
    late_system = {"messages": [{"role": "user", "content": "add 2 and 3"}, {"role": "assistant", "content": "5"},
                                {"role": "system", "content": "be brief"}, {"role": "user", "content": "add 1"}]}
    prompts.write_text("".join(json.dumps(x) + "\n" for x in [*smoke, long_one, late_system]))
    common = ["--target", str(target), "--prompts", str(prompts), "--max-new", "6", "--batch", "4",
              "--max-bad-fraction", "0.5"]

    kept = tmp_path / "kept.jsonl"
    assert regenerate(capsys, *common, "--out", str(kept))[0] == 0
    rows = records(kept)
    assert len(rows) == 12 and all(r["regen"]["truncated"] == (not r["regen"]["stopped"]) for r in rows)
    n_truncated = sum(r["regen"]["truncated"] for r in rows)
    assert 0 < n_truncated < 12, "the case needs both kinds of answer"
    a = accounting(kept)
    assert (a["expected"], a["answered"], a["failed"], a["skipped"], a["pending"]) == (14, 12, 2, 0, 0)
    assert a["truncated"] == {"kept": n_truncated, "skipped": 0}
    assert a["failures"] == {PROMPT_TOO_LONG: 1, TEMPLATE_REFUSED: 1}
    assert sorted(f["source"] for f in a["failed_prompts"]) == [f"{prompts}:13", f"{prompts}:14"]
    assert not outfile.skipped_path(kept).exists()

    whole, cut = tmp_path / "whole.jsonl", tmp_path / "cut.jsonl"
    assert regenerate(capsys, *common, "--drop-truncated", "--out", str(whole))[0] == 0
    assert regenerate(capsys, *common, "--drop-truncated", "--out", str(cut))[0] == 0
    left = records(outfile.skipped_path(whole))
    assert len(records(whole)) == 12 - n_truncated and len(left) == n_truncated
    assert all(r["regen"]["skipped"] == TRUNCATED and r["regen"]["truncated"] for r in left)
    assert not any(r["regen"]["truncated"] for r in records(whole))
    w = accounting(whole)
    assert (w["answered"], w["skipped"], w["failed"], w["pending"]) == (12 - n_truncated, n_truncated, 2, 0)
    assert w["truncated"] == {"kept": 0, "skipped": n_truncated}

    # killed mid-write: the first lines of each file and a torn one after them
    for path in (cut, outfile.skipped_path(cut)):
        lines = path.read_bytes().splitlines(keepends=True)
        path.write_bytes(b"".join(lines[:len(lines) // 2]) + lines[len(lines) // 2][:9])
    code, out, _ = regenerate(capsys, *common, "--drop-truncated", "--out", str(cut))
    assert code == 0 and any("a torn last line (killed mid-write) dropped" in x for x in out)

    def pairs(path):
        return sorted((r["regen"]["key"], r["regen"]["sample"], tuple(r["input_ids"])) for r in records(path))
    assert pairs(cut) == pairs(whole) and pairs(outfile.skipped_path(cut)) == pairs(outfile.skipped_path(whole))
    assert accounting(cut) == w
    # the row options are settings: resuming with another one is refused, the files untouched
    before = cut.read_bytes()
    code, _, err = regenerate(capsys, *common, "--out", str(cut))
    assert code == 2 and "drop_truncated True -> None" in err and cut.read_bytes() == before


def thinking_target(root: Path, template: str) -> Path:
    """A random tiny Qwen3 whose tokenizer has <think> and </think> and a chat template with thinking."""
    import torch
    from transformers import AutoModelForCausalLM

    from trainer.tiny import model_config

    tok = thinking_tokenizer(template)
    cfg = model_config("qwen3", len(tok), 2, 64, True, pad_token_id=tok.pad_token_id,
                       eos_token_id=tok.eos_token_id, bos_token_id=None)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(root)
    tok.save_pretrained(root)
    return root


def test_thinking_drop_on_a_template_that_opens_the_segment(tmp_path, capsys):
    """The generation prompt ends in <think>: with --thinking drop an answer whose reasoning never closed is left
    out (counted), one that closed loses it; --thinking keep writes every answer whole; a tokenizer without the
    markers is refused."""
    target = thinking_target(tmp_path / "target", OPENS_THINKING)
    prompts = tmp_path / "p.txt"
    prompts.write_text("count from 1 to 4\nadd 2 and 3\ncount from 5 to 8\nadd 12 and 30\n")
    common = ["--target", str(target), "--prompts", str(prompts), "--max-new", "8"]
    keep, drop = tmp_path / "keep.jsonl", tmp_path / "drop.jsonl"
    assert regenerate(capsys, *common, "--out", str(keep))[0] == 0
    assert regenerate(capsys, *common, "--out", str(drop), "--thinking", "drop")[0] == 0
    open_id, close_id = thinking_tokenizer().convert_tokens_to_ids(["<think>", "</think>"])
    whole = {r["regen"]["key"]: r["input_ids"] for r in records(keep)}
    assert len(whole) == 4 and all(open_id in v for v in whole.values())
    left = records(outfile.skipped_path(drop))
    for r in left:  # as generated: the prompt's open <think> and no </think> after it
        assert r["regen"]["skipped"] == UNCLOSED_THINKING and close_id not in r["input_ids"]
        assert r["input_ids"] == whole[r["regen"]["key"]]
    for r in records(drop):
        assert open_id not in r["input_ids"] and close_id not in r["input_ids"]
    a = accounting(drop)
    assert a["answered"] + a["skipped"] == 4 and a["skipped"] == len(left) >= 1
    assert a["skipped_reasons"].get(UNCLOSED_THINKING, 0) == sum(r["regen"]["skipped"] == UNCLOSED_THINKING
                                                                  for r in left)
    meta = json.loads(outfile.meta_path(drop).read_text())
    assert meta["settings"]["thinking"] == "drop" and "thinking" not in json.loads(
        outfile.meta_path(keep).read_text())["settings"]


def test_thinking_drop_needs_the_markers(tiny_target_dir, tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("count from 1 to 4\n")
    out = tmp_path / "new" / "o.jsonl"
    code, _, err = regenerate(capsys, "--target", str(tiny_target_dir), "--prompts", str(prompts), "--out",
                              str(out), "--thinking", "drop")
    assert code == 2 and "error: --thinking drop: the tokenizer of" in err and "no <think> and </think>" in err
    assert not (tmp_path / "new").exists()  # refused once OUT was its own: nothing left, the folder it made included


def test_a_batch_that_does_not_fit_is_refused_before_the_weights_load_naming_one_that_does(tiny_target_dir,
                                                                                           tmp_path, capsys):
    """--memory-gib on CPU: the estimate of 64 rows does not fit, the one line names a --batch that does, and that
    --batch runs."""
    config = json.loads((tiny_target_dir / "config.json").read_text())
    prompts = tmp_path / "p.txt"
    prompts.write_text("".join(f"count from {i} to {i + 3}\n" for i in range(1, 65)))
    weights = memory.weight_bytes(tiny_target_dir, 4)
    from transformers import AutoTokenizer

    from trainer.decode.decoders import capacity_for
    from trainer.regen.run import render

    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    rendered = [render(tok, ({"role": "user", "content": f"count from {i} to {i + 3}"},), {}) for i in range(1, 13)]
    longest, slots = max(map(len, rendered)), capacity_for(rendered, 100)
    row = sum(memory.row_bytes(config, slots, longest, 4).values())
    budget_gib = (weights + memory.WORKSPACE_BYTES + 10.5 * row) / memory.USABLE / memory.GIB
    args = ["--target", str(tiny_target_dir), "--prompts", str(prompts), "--out", str(tmp_path / "o.jsonl"),
            "--max-new", "100", "--device", "cpu", "--memory-gib", f"{budget_gib:.6f}", "--limit", "12"]
    code, out, err = regenerate(capsys, *args, "--batch", "64")
    errors = [x for x in err.splitlines() if x.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "--batch 12 does not fit" in errors[0], err
    assert not (tmp_path / "o.jsonl").exists() and not outfile.meta_path(tmp_path / "o.jsonl").exists()
    fits = int(errors[0].rsplit("--batch ", 1)[1].split()[0])
    assert fits == 10 and "hint: pass --batch 10" in err
    assert not any("loading the target" in x for x in out)  # refused before the model
    code, out, err = regenerate(capsys, *args, "--batch", str(fits))
    assert code == 0 and any("memory: about" in x for x in out), err


@pytest.mark.slow
def test_a_job_interrupted_for_real_says_what_it_did_and_its_resume_adds_up(tiny_target_dir, tmp_path, capsys):
    """SIGINT into a running `python -m trainer regenerate`: it exits 130 with the sidecar `stopped` and its counts
    those of the files (answered + skipped + pending = expected); the same command then ends where an uninterrupted
    job ends."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from dflash_ops.wire import EXIT_INTERRUPTED

    asks = [f"repeat twice : {w} {v}" for w in ("bird", "bread", "lamp", "house") for v in ("stone", "sun", "moon")]
    asks += [f"add {i} and {i + 2}" for i in range(12)]
    prompts = tmp_path / "p.txt"
    prompts.write_text("".join(a + "\n" for a in asks))
    common = ["--target", str(tiny_target_dir), "--prompts", str(prompts), "--max-new", "6", "--drop-truncated",
              "--batch", "1"]
    cut, whole = tmp_path / "cut.jsonl", tmp_path / "whole.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "trainer", "regenerate", "--engine", "hf", *common, "--out",
                             str(cut)], cwd=REPO_ROOT, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while len(records(cut)) + len(records(outfile.skipped_path(cut))) < 3 and proc.poll() is None:
        assert time.monotonic() < deadline, "no answer within 10 minutes"
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_INTERRUPTED and "interrupted" in err, err[-2000:]
    meta = json.loads(outfile.meta_path(cut).read_text())
    a = meta["accounting"]
    assert meta["state"] == "stopped" and 0 < a["pending"] < 24
    assert a["answered"] == len(records(cut)) and a["skipped"] == len(records(outfile.skipped_path(cut)))
    assert a["answered"] + a["skipped"] + a["failed"] + a["pending"] == a["expected"] == 24

    assert regenerate(capsys, *common, "--out", str(cut))[0] == 0
    assert regenerate(capsys, *common, "--out", str(whole))[0] == 0
    assert json.loads(outfile.meta_path(cut).read_text())["state"] == "done"
    assert accounting(cut) == accounting(whole) and accounting(cut)["pending"] == 0
    assert accounting(cut)["answered"] + accounting(cut)["skipped"] == 24
