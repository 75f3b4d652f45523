"""Stop ids outside the built-in end-of-turn list stop regeneration: a target whose config.json names a LIST of
eos ids, one of them a plain word of its vocabulary, and one whose chat template ends a turn with a plain word.
Checked end to end (`trainer regenerate`, in process, hf engine): every answer is the target's greedy tokens --
computed here with a plain argmax loop -- cut after the first stop id of the set this test expects, and the
stop ids it records are that set; and `model_stop_ids` (the quality pipeline's) of the loaded model agrees."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

PROMPTS = ["count from 3 to 9", "add 12 and 30", "repeat twice : cat dog"]
MAX_NEW = 12


def greedy(model, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(input_ids=torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids):]


def cut(tokens: list[int], stops: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in stops:
            return tokens[:i + 1]
    return tokens


def specials(target: Path) -> dict[str, int]:
    return {a["content"]: a["id"] for a in json.loads((target / "tokenizer.json").read_text())["added_tokens"]}


def regenerate(capsys, target: Path, tmp_path: Path) -> tuple[list[dict], dict]:
    from trainer.__main__ import main
    from trainer.regen import outfile

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    out = tmp_path / "regen.jsonl"
    code = main(["regenerate", "--engine", "hf", "--target", str(target), "--prompts", str(prompts), "--out", str(out),
                 "--max-new", str(MAX_NEW), "--batch", "3"])
    capsys.readouterr()
    assert code == 0
    return [json.loads(x) for x in out.read_text().splitlines()], json.loads(outfile.meta_path(out).read_text())


def check_answers(rows: list[dict], model, stops: set[int]) -> int:
    """Every answer = the greedy tokens cut at `stops`; -> how many ended on a stop id that is not 0 or 2."""
    custom = 0
    for r in rows:
        n = len(r["loss_mask"]) - sum(r["loss_mask"])
        want = cut(greedy(model, r["input_ids"][:n], MAX_NEW), stops)
        assert r["input_ids"][n:] == want
        assert r["regen"]["stopped"] == (want[-1] in stops)
        custom += want[-1] in stops - {0, 2}
    return custom


@pytest.fixture(scope="module")
def prompt_ids(full_target):
    from trainer.regen.run import render

    tok = full_target.tokenizer
    return [render(tok, ({"role": "user", "content": p},), {}) for p in PROMPTS]


def test_a_list_of_eos_ids_in_config_json_stops_regeneration(tiny_target_dir, full_target, prompt_ids, tmp_path,
                                                              capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.decode.stops import model_stop_ids

    target = Path(shutil.copytree(tiny_target_dir, tmp_path / "target"))
    names = specials(target)
    eos, im_end = names["<|endoftext|>"], names["<|im_end|>"]
    # The stop: the greedy answer's third token, a plain word, not among the built-in end-of-turn tokens.
    answer = greedy(full_target.model, prompt_ids[0], MAX_NEW)
    word = next(t for t in answer[2:] if t not in names.values() and t not in answer[:answer.index(t)])
    config = json.loads((target / "config.json").read_text())
    config["eos_token_id"] = [eos, word]
    (target / "config.json").write_text(json.dumps(config))
    (target / "generation_config.json").unlink(missing_ok=True)  # config.json's list is the one to read

    rows, meta = regenerate(capsys, target, tmp_path)
    stops = {eos, im_end, word}
    assert set(meta["stop_ids"]) == stops
    assert check_answers(rows, full_target.model, stops) >= 1  # the listed word did end an answer
    model = AutoModelForCausalLM.from_pretrained(target, local_files_only=True)
    assert set(model_stop_ids(model, AutoTokenizer.from_pretrained(target, local_files_only=True))) == stops


def test_a_chat_templates_own_end_of_turn_word_stops_regeneration(tiny_target_dir, full_target, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.decode.stops import model_stop_ids
    from trainer.regen.run import render

    target = Path(shutil.copytree(tiny_target_dir, tmp_path / "target"))
    names = specials(target)
    eos, im_end = names["<|endoftext|>"], names["<|im_end|>"]
    tok = AutoTokenizer.from_pretrained(target, local_files_only=True)
    vocab = {v: k for k, v in tok.get_vocab().items()}
    # A template ending each turn with a plain word instead of <|im_end|>; the word is one the target says in its
    # answer to one of the prompts rendered with that very template (tried prompt by prompt, word by word until one
    # is: which word the tiny target says where depends on its random weights, which transformers' init draws).
    def first_marker():
        for prompt in PROMPTS:
            for candidate in greedy(full_target.model, render(tok, ({"role": "user", "content": prompt},), {}),
                                    MAX_NEW):
                if candidate in names.values():
                    continue
                tok.chat_template = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
                                     "{{ message['content'] }} " + vocab[candidate] + "\n{% endfor %}"
                                     "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
                answer = greedy(full_target.model, render(tok, ({"role": "user", "content": prompt},), {}), MAX_NEW)
                if candidate in answer[1:] and not {eos, im_end} & set(answer[:answer.index(candidate)]):
                    return candidate
        pytest.fail("no word of the answers to use as the end-of-turn marker")

    candidate = first_marker()
    tok.save_pretrained(target)

    rows, meta = regenerate(capsys, target, tmp_path)
    stops = {eos, im_end, candidate}
    assert set(meta["stop_ids"]) == stops
    assert check_answers(rows, full_target.model, stops) >= 1  # the template's word did end an answer
    model = AutoModelForCausalLM.from_pretrained(target, local_files_only=True)
    assert set(model_stop_ids(model, AutoTokenizer.from_pretrained(target, local_files_only=True))) == stops
