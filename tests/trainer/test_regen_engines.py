"""trainer.regen.engines.Answerer, the one way regenerate and the quality pipeline answer prompts, on the tiny Qwen3
target (CPU): the static engine's and HF's deadlines, the static engine's midway failure (the prompts it has not
answered go to HF, each once; `trainer regenerate`'s OUT, accounting and resume stay those of an uninterrupted job),
a target the static engine refuses, and close() freeing the generator.

No prompt makes the static engine fail midway on CPU while HF answers the same prompts (prompt lengths and stream
ids are checked before anything runs; an out-of-range token id breaks both engines), so the midway failure is
injected at the narrowest seam: one prefill (`BatchGenerator._fill`, where a refill's forward runs) raises as a lost
device would; every other step is the real generator's."""
from __future__ import annotations

import json
import re
import time
import weakref

import pytest
import torch

from tests.trainer.test_regenerate import SMOKE, records, regenerate
from trainer.decode.generate import BatchGenerator
from trainer.decode.reference import generate_target_only
from trainer.decode.stops import model_stop_ids
from trainer.regen import outfile
from trainer.regen.engines import answerer, load_generation_target
from trainer.regen.plan import SamplingSettings

NEW = 6
LENGTHS = (9, 7, 5, 4, 3)  # longest first, as regenerate orders them


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return load_generation_target(tiny_target_dir, torch.device("cpu"), "auto")


@pytest.fixture(scope="module")
def prompts(target) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    vocab = target.embed_tokens.weight.shape[0]
    return [torch.randint(10, vocab, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def want(target, prompts) -> dict[int, list[int]]:
    """Each prompt's greedy answer, batch 1 with the KV cache."""
    stops = model_stop_ids(target.model, target.tokenizer)
    return {i: generate_target_only(target, p, NEW, stops) for i, p in enumerate(prompts)}


def build(target, engine: str, notes: list[str], rows: int = 2, batch: int | None = None):
    return answerer(engine, target, rows=rows, max_len=max(LENGTHS) + NEW,
                    stops=model_stop_ids(target.model, target.tokenizer),
                    sampling=SamplingSettings(max_new_tokens=NEW), pad_id=target.tokenizer.pad_token_id,
                    batch=batch, log=notes.append)


def failing(fill, at: int, error: Exception | None = None):
    """`fill` (BatchGenerator._fill, bound or not) raising on its `at`-th call (default: as a device lost at that
    prefill)."""
    calls = [0]

    def fill_or_fail(*args, **kwargs):
        calls[0] += 1
        if calls[0] == at:
            raise error or RuntimeError("device lost")
        return fill(*args, **kwargs)
    return fill_or_fail


def arm(answer, at: int, error: Exception | None = None) -> weakref.ref:
    """The answerer's generator fails at its `at`-th prefill -> a weak reference to the generator."""
    answer.gen._fill = failing(answer.gen._fill, at, error)
    return weakref.ref(answer.gen)


@pytest.mark.parametrize("error", [RuntimeError("CUDA error: an illegal memory access was encountered"),
                                   RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered")],
                         ids=["torch", "triton"])
def test_a_cuda_error_is_not_handed_to_hf(target, prompts, error):
    """After a CUDA error (torch's wording, or Triton's launcher's for our kernels) the device's context is lost for
    HF too: the stream raises the static engine's own error (the answers before it were yielded), no note, no
    fallback."""
    notes: list[str] = []
    answer = build(target, "static", notes, rows=1)
    arm(answer, 2, error)
    got = []
    with pytest.raises(type(error), match=re.escape(str(error))):
        for pair in answer.stream(prompts):
            got.append(pair)
    assert [i for i, _ in got] == [0] and notes == [] and answer.used == "static"


def test_a_static_engine_failing_midway_leaves_the_rest_to_hf_once_and_is_freed(target, prompts, want):
    """One slot: the static engine answers prompts 0 and 1, then the prefill of prompt 2 raises. One note, HF answers
    2, 3 and 4 in order, each prompt once and every answer the target's greedy one; the failed generator is freed at
    once (its cache must not sit beside HF's), and later streams are HF's alone, without another note."""
    notes: list[str] = []
    answer = build(target, "static", notes, rows=1, batch=2)
    gen = arm(answer, 3)
    got = list(answer.stream(prompts))
    assert [i for i, _ in got] == [0, 1, 2, 3, 4] and dict(got) == want
    assert notes == ["note: the static engine failed (RuntimeError: device lost) after 2 of 5 answers; the hf engine "
                     "answers the other 3"]
    assert answer.used == "static->hf" and answer.gen is None and gen() is None
    assert answer.answer(prompts) == [want[i] for i in range(5)] and len(notes) == 1


def test_a_failure_before_the_first_answer_hands_every_prompt_to_hf(target, prompts, want):
    notes: list[str] = []
    answer = build(target, "static", notes)
    arm(answer, 1)
    assert dict(answer.stream(prompts)) == want and answer.used == "static->hf"
    assert notes == ["note: the static engine failed (RuntimeError: device lost) after 0 of 5 answers; the hf engine "
                     "answers the other 5"]


def test_the_static_stream_ends_after_the_first_answer_past_the_deadline_and_serves_again(target, prompts, want):
    notes: list[str] = []
    answer = build(target, "static", notes)
    (i, tokens), = list(answer.stream(prompts, deadline=0.0))
    assert tokens == want[i] and answer.used == "static"
    # the stream cut short leaves the generator whole: a later stream answers every prompt on it
    assert dict(answer.stream(prompts, deadline=float("inf"))) == want
    assert notes == [] and answer.used == "static"


def test_hf_starts_no_batch_after_the_deadline(target, prompts, want):
    """Batches of 2: a deadline already passed answers nothing; one that passes while the first batch's answers are
    read ends the stream after that batch, every one of its answers given."""
    answer = build(target, "hf", [], batch=2)
    assert answer.used == "hf" and answer.gen is None
    assert list(answer.stream(prompts, deadline=0.0)) == []
    deadline = time.perf_counter() + 1.0
    stream = answer.stream(prompts, deadline=deadline)
    first = [next(stream), next(stream)]
    while time.perf_counter() <= deadline:  # the clock passes the deadline between batches
        time.sleep(0.05)
    assert first == [(0, want[0]), (1, want[1])] and list(stream) == []
    assert dict(answer.stream(prompts)) == want


def test_close_frees_the_static_generator(target, prompts, want):
    answer = build(target, "static", [])
    assert dict(answer.stream(prompts)) == want
    gen = weakref.ref(answer.gen)
    answer.close()
    assert gen() is None and answer.gen is None
    with pytest.raises(RuntimeError, match="closed"):
        list(answer.stream(prompts))


def test_a_target_the_static_engine_refuses_is_answered_by_hf_after_one_note(tmp_path):
    from tests.trainer.families import REFUSED_BY_STATIC, build_family_target
    from trainer.decode.generate import Sampling, hf_generate

    refused = load_generation_target(build_family_target(tmp_path / "refused", REFUSED_BY_STATIC),
                                     torch.device("cpu"), "auto")
    notes: list[str] = []
    answer = answerer("static", refused, rows=2, max_len=16, stops=[0], sampling=SamplingSettings(max_new_tokens=4),
                      pad_id=0, log=notes.append)
    assert answer.used == "hf" and answer.gen is None
    assert len(notes) == 1 and notes[0].startswith("note: the static engine cannot serve this target (")
    assert "rope_type 'dynamic'" in notes[0] and notes[0].endswith("; generating with the hf engine")
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    assert answer.answer(prompts) == hf_generate(refused.model, prompts[:2], Sampling(max_new_tokens=4), [0], 0) + \
        hf_generate(refused.model, prompts[2:], Sampling(max_new_tokens=4, seed=1), [0], 0)  # batches of rows


def test_regenerate_goes_on_with_hf_after_a_midway_static_failure_and_resumes(tiny_target_dir, tmp_path, capsys,
                                                                              monkeypatch):
    """--batch 1, the third prefill raising: OUT holds every prompt's answer once, equal to an hf job's; the
    accounting counts 6 answered, none pending; the engine is recorded as static->hf. A resume after 3 lines fails
    again midway and still ends with the uninterrupted job's lines."""
    args = ["--target", str(tiny_target_dir), "--prompts", str(SMOKE), "--limit", "6", "--max-new", "10",
            "--batch", "1"]
    reference = tmp_path / "hf.jsonl"
    assert regenerate(capsys, *args, "--out", str(reference), engine="hf")[0] == 0
    by_key = {r["regen"]["key"]: r["input_ids"] for r in records(reference)}
    real = BatchGenerator._fill

    def job(out, pending: int) -> dict:
        monkeypatch.setattr(BatchGenerator, "_fill", failing(real, 3))
        code, lines, err = regenerate(capsys, *args, "--out", str(out), engine="static")
        assert code == 0, err
        assert [x.split("] ", 1)[-1] for x in lines if "note:" in x] == [  # console lines: "[  1.2s] note: ..."
            f"note: the static engine failed (RuntimeError: device lost) after 2 of {pending} answers; the hf engine "
            f"answers the other {pending - 2}"]
        rows = records(out)
        assert len(rows) == 6 and {r["regen"]["key"]: r["input_ids"] for r in rows} == by_key
        meta = json.loads(outfile.meta_path(out).read_text())
        counts = meta["accounting"]
        assert meta["state"] == "done" and meta["engines"] == ["static->hf"] and meta["engine_asked"] == "static"
        assert (counts["expected"], counts["answered"], counts["failed"], counts["skipped"], counts["pending"]) == \
            (6, 6, 0, 0, 0)
        done, = [json.loads(x.split(" ", 1)[1]) for x in lines if x.startswith("DFLASH_DONE ")]
        assert done["engine"] == "static->hf" and done["new"] == pending and done["done"] == 6
        return meta

    out = tmp_path / "out.jsonl"
    job(out, 6)
    out.write_text("".join(out.read_text().splitlines(keepends=True)[:3]))  # as if killed after 3 answers
    job(out, 3)
