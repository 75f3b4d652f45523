"""`trainer eval --prompts`: the prompt formats users evaluate on (a few lines of each, written here), read into
user turns, and real batch-1 decoding of each set through the CLI, on a tiny target saved to disk."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer.errors import DataError
from trainer.prompts import read_prompt_set

FIXTURES = Path(__file__).parent / "fixtures" / "prompts"
REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name, fmt, first", [
    ("gsm8k", "gsm8k", "count from 3 to 9"),
    ("math500", "math", "repeat twice : cat dog"),
    ("humaneval", "humaneval", 'def count ( n ) :\n    """ count from 3 to n """\n'),
    ("mbpp", "mbpp", "Write a function to count from 3 to 40.\nYour code should pass these tests:\n"
                     "assert count()[0] == 3\nassert count()[-1] == 40"),
    ("mtbench", "mt-bench", "repeat twice : cat dog fish"),
])
def test_each_format_gives_its_user_turn(name, fmt, first):
    ps = read_prompt_set(FIXTURES / f"{name}.jsonl")
    assert ps.name == name and ps.formats == (fmt,) and len(ps.prompts) == 2 and ps.prompts[0] == first


def test_chat_sharegpt_plain_lines_and_bad_lines(tmp_path):
    f = tmp_path / "mixed.txt"
    f.write_bytes(b'{"conversations": [{"role": "system", "content": "s"}, {"role": "user", "content": "a"}]}\n'
                  b'{"conversations": [{"from": "human", "value": "b"}]}\n'
                  b"plain prompt\n\n"
                  b'{"unknown": 1}\n'
                  b"\xff\xfe broken\n"
                  b'{"question": "", "answer": ""}\n')
    ps = read_prompt_set(f)
    assert ps.prompts == ("a", "b", "plain prompt") and ps.formats == ("chat", "sharegpt", "text")
    assert ps.bad_lines == (5, 6, 7)
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match="holds no prompt"):
        read_prompt_set(tmp_path / "empty.jsonl")
    with pytest.raises(DataError, match="not found"):
        read_prompt_set(tmp_path / "missing.jsonl")


def test_alpaca_prompt_and_content_part_lines_are_read(tmp_path):
    """Alpaca's instruction (+ input), a bare {"prompt": ...}, and OpenAI chat turns whose content is a list of text
    parts: formats users bring, each read as a prompt."""
    f = tmp_path / "more.jsonl"
    lines = [{"instruction": "count from 3 to 9", "input": "", "output": "3 4 5"},
             {"instruction": "repeat twice", "input": "cat dog", "output": "cat dog cat dog"},
             {"prompt": "add 2 and 3"},
             {"messages": [{"role": "user", "content": [{"type": "text", "text": "reverse"},
                                                        {"type": "text", "text": "cat dog"}]}]},
             {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}]
    f.write_text("".join(json.dumps(line) + "\n" for line in lines))
    ps = read_prompt_set(f)
    assert ps.prompts == ("count from 3 to 9", "repeat twice\n\ncat dog", "add 2 and 3", "reverse\ncat dog")
    assert ps.formats == ("alpaca", "prompt", "chat") and ps.bad_lines == (5,)  # an image part has no text to answer


def test_a_directory_is_not_a_prompt_file(tmp_path):
    with pytest.raises(DataError, match=f"^prompt file {tmp_path} is a directory, not a file$"):
        read_prompt_set(tmp_path)


def test_files_of_one_stem_are_named_apart_and_a_unique_stem_keeps_its_name(tmp_path):
    from trainer.prompts import set_names

    assert set_names(["ds/gsm8k/test.jsonl", "ds/humaneval/test.jsonl", "mtbench.jsonl"]) == \
        ["gsm8k/test", "humaneval/test", "mtbench"]
    assert set_names(["x/a/test.jsonl", "y/a/test.jsonl"]) == ["x/a/test", "y/a/test"]
    assert set_names(["d/test.jsonl", "d/test.txt", "d/test.jsonl"]) == ["test.jsonl", "test.txt", "test.jsonl#2"]
    assert set_names([str(tmp_path / "a" / "t.jsonl"), str(tmp_path / "t.jsonl")]) == ["a/t", f"{tmp_path.name}/t"]
    f = tmp_path / "gsm8k" / "test.jsonl"
    f.parent.mkdir()
    f.write_text("count from 3 to 9\n")
    assert read_prompt_set(f, "gsm8k/test").name == "gsm8k/test" and read_prompt_set(f).name == "test"


def _fit(tiny_target_dir, prompts, positions, max_new=20, limit=64):
    from transformers import AutoTokenizer

    from trainer.cli.evalform import EvalRequest
    from trainer.cli.evalprompts import fit_sets
    from trainer.prompts import PromptSet

    req = EvalRequest(form="prompts", max_new=max_new, limit=limit)
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir, local_files_only=True)
    return fit_sets(req, [PromptSet("s", tuple(prompts), ("text",))], tokenizer, positions)


def test_a_prompt_too_long_for_the_targets_positions_is_skipped_and_counted(tiny_target_dir):
    """Regenerate's rule (its rendering + --max-new within the target's positions), on the first --limit prompts:
    the short prompt renders to 10 tokens on the tiny target, the long one to 105."""
    short, long = "count from 3 to 9", "count from 3 to 9 " * 20
    [(ps, too_long)] = _fit(tiny_target_dir, [long, short, long], positions=40)
    assert ps.prompts == (short,) and too_long == 2
    [(ps, too_long)] = _fit(tiny_target_dir, [short, long], positions=40, limit=1)
    assert ps.prompts == (short,) and too_long == 0
    assert _fit(tiny_target_dir, [long], positions=None)[0][1] == 0
    with pytest.raises(DataError, match=r"^prompt set s: each of its 2 prompts and --max-new 20 exceed the target's 40 "
                                        r"positions \(the shortest renders to 105 tokens\)$") as e:
        _fit(tiny_target_dir, [long, long], positions=40)
    assert e.value.hint == "leave the set out, or shorten its prompts"
    with pytest.raises(DataError) as e:
        _fit(tiny_target_dir, [long], positions=120)
    assert e.value.hint == "pass --max-new 15 or less, or leave the set out"


@pytest.mark.slow
def test_sets_of_one_stem_and_prompts_too_long_through_the_cli(tiny_target_dir, target, tmp_path, capsys):
    """Two files named test.jsonl are two sets named apart; the prompt too long for the target's positions (here
    cut to 40) is skipped, counted in its set's DFLASH_EVAL line and in DFLASH_DONE, and the rest decode."""
    import shutil

    from tests.trainer.conftest import make_state
    from trainer.__main__ import main
    from trainer.export import ExportConfig, export_drafter

    short = shutil.copytree(tiny_target_dir, tmp_path / "short")
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 40}))
    state = make_state(target, block_size=4, seed=1)
    export_drafter(tmp_path / "export", state.drafter, ExportConfig.of(state.drafter.cfg, target, 4),
                   dtype=torch.float32)
    for sub, lines in (("gsm8k", ["count from 3 to 9", "count from 3 to 9 " * 20]), ("mbpp", ["repeat : cat dog"])):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "test.jsonl").write_text("".join(line + "\n" for line in lines))
    assert main(["eval", "prompts", "--drafter", str(tmp_path / "export"), "--target", str(short), "--prompts",
                 str(tmp_path / "gsm8k" / "test.jsonl"), str(tmp_path / "mbpp" / "test.jsonl"),
                 "--max-new", "12"]) == 0
    out = capsys.readouterr().out.splitlines()
    records = [json.loads(x.split(" ", 1)[1]) for x in out if x.startswith("DFLASH_EVAL ")]
    assert [(r["set"], r["prompts"], r["too_long"]) for r in records] == [("gsm8k/test", 1, 1), ("mbpp/test", 1, 0)]
    assert "eval gsm8k/test: 1 prompts skipped: too long for the target's 40 positions with --max-new 12" in out
    done = [json.loads(x.split(" ", 1)[1]) for x in out if x.startswith("DFLASH_DONE ")]
    assert [(d["done"], d["total"], d["too_long"], d["sets"]) for d in done] == [(2, 2, 1, ["gsm8k/test",
                                                                                           "mbpp/test"])]


@pytest.mark.slow
def test_real_decoding_of_every_set_through_the_cli(tiny_target_dir, target, tmp_path):
    from tests.trainer.conftest import make_state
    from trainer.export import ExportConfig, export_drafter

    state = make_state(target, block_size=4, seed=1)
    export_drafter(tmp_path / "export", state.drafter, ExportConfig.of(state.drafter.cfg, target, 4),
                   dtype=torch.float32)
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), CUDA_VISIBLE_DEVICES="")
    files = [str(FIXTURES / f"{n}.jsonl") for n in ("gsm8k", "math500", "humaneval", "mbpp", "mtbench")]
    proc = subprocess.run([sys.executable, "-m", "trainer", "eval", "--drafter", str(tmp_path / "export"),
                           "--target", str(tiny_target_dir), "--prompts", *files, "--max-new", "12"],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(x.split(" ", 1)[1]) for x in proc.stdout.splitlines() if x.startswith("DFLASH_EVAL ")]
    assert [r["set"] for r in records] == ["gsm8k", "math500", "humaneval", "mbpp", "mtbench"]
    # The tiny target's EOS is <|endoftext|>, its template ends a turn with <|im_end|>: answers stop on both, as
    # regenerate's do (trainer/decode/stops.py); decoding on EOS alone ran every answer to --max-new.
    tok = target.tokenizer
    assert all(r["stop_ids"] == list(tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])) for r in records)
    assert sum(r["ended_on_stop"] for r in records) >= 2
    assert any(r["tokens"] < r["prompts"] * 12 for r in records)
    # Like train, eval says its phases and its progress as a job (DFLASH_PROGRESS, then DFLASH_DONE).
    lines = proc.stdout.splitlines()
    phases = [x for x in lines if re.match(r"^\[ *\d+\.\ds\] ", x)]
    for what in ("reading 5 prompt file(s)", "loading torch", "loading the drafter", "decoding gsm8k: 2 prompts",
                 "decoding mtbench: 2 prompts"):
        assert [x for x in phases if what in x and x.endswith(" ...")], (what, phases)
        assert [x for x in phases if what in x and re.search(r": \d+\.\ds( \(.*\))?$", x)], (what, phases)
    progress = [json.loads(x.split(" ", 1)[1]) for x in lines if x.startswith("DFLASH_PROGRESS ")]
    assert progress[0]["job"] == "eval" and progress[0]["unit"] == "prompts" and progress[-1]["done"] == 10
    done = [json.loads(x.split(" ", 1)[1]) for x in lines if x.startswith("DFLASH_DONE ")]
    assert done == [{"job": "eval", "done": 10, "total": 10, "tokens": sum(r["tokens"] for r in records),
                     "sets": ["gsm8k", "math500", "humaneval", "mbpp", "mtbench"], "too_long": 0}]
    for r in records:
        assert r["prompts"] == 2 and r["identical"] == 2  # equal outputs, though not lossless by construction:
        assert 1.0 <= r["tau"] <= 4 and len(r["accept_by_pos"]) == 3 and r["speedup"] > 0
        v = r["lossless"]  # on a CPU the HF RMSNorm and SDPA run, fp32
        assert not v["guaranteed"] and (v["identical"], v["prompts"], v["differing"]) == (2, 2, [])
        assert (v["norms"], v["attention"], v["dtype"]) == ("hf", "sdpa", "float32")
    assert "eval gsm8k: tau " in proc.stdout
    verdicts = [x for x in proc.stdout.splitlines() if x.startswith("eval gsm8k: not lossless by construction (")]
    assert len(verdicts) == 1 and "attention sdpa, not the row-invariant kernel" in verdicts[0], proc.stdout
    assert verdicts[0].endswith("; 2/2 outputs equal the target's")


def test_regenerate_and_eval_take_their_stop_ids_from_one_rule(tiny_target_dir, full_target):
    """Regenerate reads the target directory's generation eos ids (before torch); eval and the quality pipeline
    read a loaded model's generation config: the same ids, in the same order, through the same function."""
    from trainer.decode.stops import model_stop_ids, stop_ids
    from trainer.targetdir import read_target_dir

    regen = stop_ids(full_target.tokenizer, read_target_dir(tiny_target_dir).generation_eos_ids)
    assert regen == model_stop_ids(full_target.model, full_target.tokenizer)
    assert full_target.tokenizer.convert_ids_to_tokens(list(regen)) == ["<|endoftext|>", "<|im_end|>"]


def test_a_bad_prompt_file_is_one_line_before_any_model(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "trainer", "eval", "--drafter", str(tmp_path), "--target",
                           str(tmp_path), "--prompts", str(tmp_path / "missing.jsonl")], cwd=REPO_ROOT,
                          env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)), capture_output=True, text=True)
    assert proc.returncode == 3 and proc.stderr.splitlines()[0].startswith("error: prompt file ")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama", "mistral", "gemma3", "gemma2"])
def test_every_prompt_format_decodes_on_every_family(family, family_dirs, tmp_path, capsys):
    """`trainer eval --prompts` (in process: the same CLI function) on a tiny random target of each family, every
    fixture format, one prompt each. The static engine serves the families it supports and says in one line that it
    hands the others to the hf engine; either way speculative output equals the target's alone."""
    from tests.trainer.conftest import make_state
    from trainer.__main__ import main
    from trainer.export import ExportConfig, export_drafter
    from trainer.model.target import load_target

    target = load_target(family_dirs[family], num_draft_layers=2, layer_ids=(1, 3))
    state = make_state(target, block_size=4, seed=1)
    export_drafter(tmp_path / "export", state.drafter, ExportConfig.of(state.drafter.cfg, target, 4),
                   dtype=torch.float32)
    files = [str(FIXTURES / f"{n}.jsonl") for n in ("gsm8k", "math500", "humaneval", "mbpp", "mtbench")]
    assert main(["eval", "--drafter", str(tmp_path / "export"), "--target", str(family_dirs[family]), "--prompts",
                 *files, "--limit", "1", "--max-new", "6"]) == 0
    out = capsys.readouterr().out.splitlines()
    records = [json.loads(x.split(" ", 1)[1]) for x in out if x.startswith("DFLASH_EVAL ")]
    assert [r["set"] for r in records] == ["gsm8k", "math500", "humaneval", "mbpp", "mtbench"]
    assert all(r["prompts"] == 1 and r["identical"] == 1 and 1.0 <= r["tau"] <= 4 for r in records)
    notes = [x for x in out if x.startswith("note: the static engine cannot serve this target")]
    # the static engine serves every supported family: no fallback to hf
    assert {r["engine"] for r in records} == {"static"} and not notes


@pytest.mark.slow
@pytest.mark.parametrize("family, engine", [("qwen3_5", "static"), ("qwen3_next", "static"), ("gpt_oss", "static"),
                                            ("qwen3_moe", "static"), ("mixtral", "static"), ("qwen3_5_moe", "static"),
                                            ("llama_dynamic", "hf")])
def test_the_2026_families_decode_losslessly(family, engine, family_dirs, tmp_path, capsys):
    """Attention sinks, MoE and the hybrids, dense and MoE, on the static engine (its layer stack; a hybrid with SDPA
    attention, not the invariant kernel eval asks for); a target the stack refuses (dynamic RoPE): the
    static engine says in one line that it hands it to the hf engine. Either way speculative output equals the
    target's alone."""
    from tests.trainer.conftest import make_state
    from tests.trainer.families import build_family_target
    from trainer.__main__ import main
    from trainer.export import ExportConfig, export_drafter
    from trainer.model.target import load_target

    if family not in family_dirs:  # the refused one
        family_dirs = {family: build_family_target(tmp_path / family, family)}
    target = load_target(family_dirs[family], num_draft_layers=2, layer_ids=(1, 3))
    state = make_state(target, block_size=4, seed=1)
    export_drafter(tmp_path / "export", state.drafter, ExportConfig.of(state.drafter.cfg, target, 4),
                   dtype=torch.float32)
    assert main(["eval", "--drafter", str(tmp_path / "export"), "--target", str(family_dirs[family]), "--prompts",
                 str(FIXTURES / "gsm8k.jsonl"), str(FIXTURES / "mtbench.jsonl"), "--limit", "1",
                 "--max-new", "12"]) == 0
    out = capsys.readouterr().out.splitlines()
    records = [json.loads(x.split(" ", 1)[1]) for x in out if x.startswith("DFLASH_EVAL ")]
    assert [r["set"] for r in records] == ["gsm8k", "mtbench"]
    assert all(r["identical"] == 1 and r["engine"] == engine for r in records), records
    fallbacks = [x for x in out if x.startswith("note: the static engine cannot serve this target")]
    assert len(fallbacks) == (0 if engine == "static" else 1), out
    if family.startswith("qwen3_5") or family == "qwen3_next":
        assert {(r["attention"], r["norms"]) for r in records} == {("sdpa", "hf")}, records
