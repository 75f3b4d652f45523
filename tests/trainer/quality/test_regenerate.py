"""A target pretrained here (tiny), its regenerated answers, and the trainer's data loader reading them unchanged."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from trainer.data.source import load_samples
from trainer.model.target import load_target
from trainer.quality.config import load_recipe
from trainer.decode.generate import Sampling, hf_generate
from trainer.quality.regenerate import chat_prompt_ids, prompt_sets, regenerate
from trainer.decode.reference import generate_target_only
from trainer.decode.stops import model_stop_ids


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """quality_cpu (pretraining as in the recipe), regeneration shrunk to 12 + 4 prompts of 16 tokens and 6
    continuations."""
    from trainer.quality.pretrain import make_target

    q = load_recipe("quality_cpu")
    q = dataclasses.replace(q, pretrain=dataclasses.replace(q.pretrain, budget_s=1e6),
                            regen=dataclasses.replace(q.regen, train_prompts=12, eval_prompts=4, max_new_tokens=16,
                                                      batch_size=5, continuations=6, continuation_batch_size=4,
                                                      budget_s=1e6))  # budgets off: no timing
    out = tmp_path_factory.mktemp("quality")
    pre = make_target(out / "target", q, torch.device("cpu"), log=lambda _m: None)
    regen = regenerate(out / "target", out / "data", q, torch.device("cpu"), log=lambda _m: None)
    return q, pre, regen, out


def test_pretrained_target_loads_through_the_trainer(made):
    q, pre, _regen, out = made
    target = load_target(out / "target", num_draft_layers=2, truncate=False)
    assert target.hf_config.num_hidden_layers == q.target.num_layers
    assert target.tokenizer.eos_token == "<|im_end|>"
    assert target.mask_token_id == target.tokenizer.convert_tokens_to_ids("<|MASK|>")
    assert pre.steps == q.pretrain.steps and pre.params == sum(p.numel() for p in target.model.parameters())
    corpus = json.loads((out / "target" / "corpus.json").read_text())
    assert corpus["files_heldout"] == len(corpus["heldout_files"]) >= 1


def test_regenerated_files_are_accepted_by_the_trainer_loader(made):
    _q, _pre, regen, out = made
    tok = load_target(out / "target", num_draft_layers=1, truncate=False).tokenizer
    assert 1 <= regen.continuations <= 6 and regen.train_samples == 12 + regen.continuations
    for path, n in ((regen.train_path, regen.train_samples), (regen.eval_path, 4)):
        samples, report = load_samples([path], tok, len(tok), max_bad_fraction=0.0)
        assert len(samples) == n and not report.bad
        assert all(s.loss_mask.any() for s in samples)


def test_answers_are_the_targets_greedy_continuations(made):
    """Batched left-padded generation == batch-1 KV-cache greedy decoding, prompt by prompt."""
    q, _pre, regen, out = made
    target = load_target(out / "target", num_draft_layers=1, truncate=False)
    tok = target.tokenizer
    _train, held_out = prompt_sets(q)
    prompts = [chat_prompt_ids(tok, p) for p in held_out]
    stops = model_stop_ids(target.model, tok)
    batched = hf_generate(target.model, prompts, Sampling(max_new_tokens=16), stops, tok.pad_token_id)
    for ids, answer in zip(prompts, batched):
        assert answer == generate_target_only(target, ids, 16, stops)
    lines = [json.loads(line) for line in open(regen.eval_path)]
    assert {line["conversations"][0]["content"] for line in lines} == set(held_out)
    assert all([t["role"] for t in line["conversations"]] == ["user", "assistant"] for line in lines)


def test_held_in_and_held_out_prompts_come_from_their_own_files(made):
    from trainer.quality.corpus import all_units, corpus_root, list_sources, split_heldout

    q = made[0]
    train, held_out = prompt_sets(q)
    assert len(train) == 12 and len(held_out) == 4 == len(set(held_out))
    heldin_files, heldout_files = split_heldout(list_sources(corpus_root(q.corpus), q.corpus.max_file_bytes,
                                                            q.corpus.max_files), q.corpus.heldout_every)
    assert set(train) <= {u.prompt for u in all_units(heldin_files, q.corpus)}
    assert set(held_out) <= {u.prompt for u in all_units(heldout_files, q.corpus)}
    assert set(held_out).isdisjoint({u.prompt for u in all_units(heldin_files, q.corpus)})  # truly unseen text
    assert prompt_sets(q) == (train, held_out)  # deterministic


def test_with_drafter_only_files_the_training_prompts_come_from_them_alone(made):
    """corpus.drafter_only_every: the drafter's prompts come from files the target never pretrained on, and the
    held-out prompts still differ from every prompt of a file any model trains on."""
    import dataclasses

    from trainer.quality.corpus import all_units, corpus_split

    q0 = made[0]
    q = dataclasses.replace(q0, corpus=dataclasses.replace(q0.corpus, drafter_only_every=3))
    split = corpus_split(q.corpus)
    train, held_out = prompt_sets(q, split)
    assert train and held_out
    target_prompts = {u.prompt for u in all_units(split.target, q.corpus)}
    drafter_prompts = {u.prompt for u in all_units(split.drafter, q.corpus)}
    assert set(train) <= drafter_prompts and set(train).isdisjoint(target_prompts)  # text the target never saw
    assert {f.rel for f in split.target}.isdisjoint({f.rel for f in split.drafter})
    assert set(held_out).isdisjoint(target_prompts | drafter_prompts)
    assert set(held_out) <= {u.prompt for u in all_units(split.heldout, q.corpus)}


def test_drafter_only_files_stay_out_of_pretraining(made, tmp_path):
    """make_target with corpus.drafter_only_every: fewer pretraining files, the rest counted; held-out unchanged."""
    from trainer.quality.pretrain import make_target

    q0, pre0 = made[0], made[1]
    q = dataclasses.replace(q0, corpus=dataclasses.replace(q0.corpus, drafter_only_every=3),
                            pretrain=dataclasses.replace(q0.pretrain, steps=1))
    pre = make_target(tmp_path / "target", q, torch.device("cpu"), log=lambda _m: None)
    assert pre.files_drafter_only > 0 and pre0.files_drafter_only == 0
    assert pre.files_heldin + pre.files_drafter_only == pre0.files_heldin
    assert pre.files_heldout == pre0.files_heldout and pre.corpus_tokens < pre0.corpus_tokens


def test_repeated_ngram_fraction():
    from trainer.quality.evaluate import repeated_ngram_fraction

    assert repeated_ngram_fraction([1, 2, 3, 4, 5, 6]) == 0.0
    assert repeated_ngram_fraction([7] * 10) == 6 / 7
    assert repeated_ngram_fraction([1, 2, 3, 4, 1, 2, 3, 4]) == 1 / 5
    assert repeated_ngram_fraction([1, 2]) == 0.0


def test_training_lines_are_the_targets_exact_tokens(made):
    """train.jsonl holds token ids: prompt (unsupervised) + the target's greedy answer ids (supervised), exactly."""
    _q, _pre, _regen, out = made
    target = load_target(out / "target", num_draft_layers=1, truncate=False)
    tok = target.tokenizer
    for line in list(open(out / "data" / "train.jsonl"))[:4]:  # the chat answers come first
        obj = json.loads(line)
        n_prompt = obj["loss_mask"].index(1)
        assert obj["loss_mask"] == [0] * n_prompt + [1] * (len(obj["input_ids"]) - n_prompt)
        prompt, answer = obj["input_ids"][:n_prompt], obj["input_ids"][n_prompt:]
        assert tok.decode(prompt).endswith("<|im_start|>assistant\n")
        assert answer == generate_target_only(target, prompt, 16, model_stop_ids(target.model, tok))


@pytest.mark.parametrize("engine", ["static", "hf"])
def test_continuations_are_greedy_and_stay_inside_one_document(made, tmp_path, engine):
    from trainer.quality.pretrain import token_stream
    from trainer.quality.regenerate import continuation_engine, continuation_windows, write_continuations

    q, _pre, _regen, out = made
    target = load_target(out / "target", num_draft_layers=1, truncate=False)
    tok = target.tokenizer
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    stream = token_stream(tok, ["def f(x):\n    return x + 1\n" * 8, "import os\nprint(os.getcwd())\n" * 8])
    windows = continuation_windows(stream, 6, 12, eot, seed=3)
    assert len(windows) == 6 and all(len(w) == 12 and eot not in w for w in windows)
    assert windows == continuation_windows(stream, 6, 12, eot, seed=3)  # seeded
    cfg = dataclasses.replace(q.regen, continuation_new_tokens=8, continuation_batch_size=4, engine=engine,
                              continuation_prompt_tokens=12)
    path = tmp_path / "cont.jsonl"
    notes: list[str] = []
    answer = continuation_engine(target, cfg, eot, notes.append)
    with path.open("w") as f:
        n, tokens, answered = write_continuations(answer, windows, cfg, f, float("inf"), eot, notes.append)
    assert not [m for m in notes if m.startswith("note:")] and answer.used == engine  # no fall-back
    lines = [json.loads(line) for line in open(path)]
    assert answered == 6 and n == len(lines) >= 1 and tokens >= n
    for obj in lines:
        prompt, answer = obj["input_ids"][:12], obj["input_ids"][12:]
        assert prompt in windows and obj["loss_mask"] == [0] * 12 + [1] * len(answer)
        assert answer == generate_target_only(target, prompt, 8, (eot,))
    samples, report = load_samples([str(path)], tok, len(tok), max_bad_fraction=0.0)
    assert len(samples) == n and not report.bad


def test_a_failing_static_engine_falls_back_to_hf_generate(made, monkeypatch):
    from trainer.decode import generate
    from trainer.quality.regenerate import continuation_engine

    q, _pre, _regen, out = made
    target = load_target(out / "target", num_draft_layers=1, truncate=False)
    eot = target.tokenizer.convert_tokens_to_ids("<|endoftext|>")

    def broken(*_a, **_k):
        raise RuntimeError("capture failed")

    monkeypatch.setattr(generate.BatchGenerator, "__init__", broken)
    cfg = dataclasses.replace(q.regen, continuation_new_tokens=5, continuation_batch_size=2,
                              continuation_prompt_tokens=6, engine="static")
    notes: list[str] = []
    answer = continuation_engine(target, cfg, eot, notes.append)
    windows = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]]
    first, again = (dict(answer.stream(windows, deadline=float("inf"))) for _ in range(2))
    assert notes == ["note: the static engine cannot serve this target (RuntimeError: capture failed); generating "
                     "with the hf engine"]
    assert first == again == dict(enumerate(generate_target_only(target, w, 5, (eot,)) for w in windows))
    assert answer.used == "hf" and answer.gen is None  # never built: the hf engine answered everything


def test_a_static_stream_failing_midway_leaves_the_rest_to_hf_and_stops_at_the_deadline(made, monkeypatch):
    """The continuations' stream: the static generator answers one window, then raises; the note is logged once and
    HF `generate` answers the others, each window once, every answer the target's greedy one. A deadline already
    passed ends the stream after its first answer."""
    from trainer.decode import generate
    from trainer.quality.regenerate import continuation_engine

    q, _pre, _regen, out = made
    target = load_target(out / "target", num_draft_layers=1, truncate=False)
    eot = target.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    real = generate.BatchGenerator.generate_stream

    def breaks_after_one(self, *args, **kwargs):
        stream = real(self, *args, **kwargs)
        yield next(stream)
        raise RuntimeError("device lost")

    cfg = dataclasses.replace(q.regen, continuation_new_tokens=5, continuation_batch_size=2,
                              continuation_prompt_tokens=6, engine="static")
    windows = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16], [17, 18, 19, 20, 21, 22]]
    want = [generate_target_only(target, w, 5, (eot,)) for w in windows]
    assert len(list(continuation_engine(target, cfg, eot).stream(windows, deadline=0.0))) == 1
    monkeypatch.setattr(generate.BatchGenerator, "generate_stream", breaks_after_one)
    notes: list[str] = []
    answer = continuation_engine(target, cfg, eot, notes.append)
    got = dict(answer.stream(windows, deadline=float("inf")))
    assert got == dict(enumerate(want)) and answer.used == "static->hf"
    assert notes == ["note: the static engine failed (RuntimeError: device lost) after 1 of 3 answers; the hf engine "
                     "answers the other 2"]


def test_the_pipelines_prompt_sets_as_files_feed_trainer_regenerate(made, tmp_path, capsys):
    """The user's path on the quality target starts here: its prompt sets as chat prompt files (the same prompts the
    pipeline answered), answered again by `trainer regenerate`."""
    from trainer.__main__ import main
    from trainer.quality.prompt_files import write_prompt_files

    q, _pre, _regen, out = made
    counts = write_prompt_files("quality_cpu", tmp_path / "prompts",
                                ["regen.train_prompts=12", "regen.eval_prompts=4"])
    train, held_out = prompt_sets(q)
    files = {n: [json.loads(x)["conversations"][0]["content"]
                 for x in (tmp_path / "prompts" / f"{n}.jsonl").read_text().splitlines()] for n in ("train", "heldout")}
    assert files == {"train": train, "heldout": held_out} and counts == {"train": 12, "heldout": 4}
    assert main(["regenerate", "--engine", "hf", "--target", str(out / "target"), "--prompts",
                 str(tmp_path / "prompts" / "train.jsonl"), "--out", str(tmp_path / "regen.jsonl"), "--limit", "3",
                 "--max-new", "8"]) == 0
    assert len((tmp_path / "regen.jsonl").read_text().splitlines()) == 3 and "DFLASH_DONE " in capsys.readouterr().out
