import json
from pathlib import Path

import pytest
import torch

from trainer.config import DataCfg
from trainer.data.anchors import anchor_candidates, sample_anchors
from trainer.data.batching import EpochBatches
from trainer.data.dataset import build_datasets
from trainer.data.packing import assign_rows, pack
from trainer.data.source import Sample, load_samples, tokenize_conversation
from trainer.errors import DataError


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


VOCAB = 177  # rows of the tiny target embedding (asserted below)
GOOD = json.dumps({"conversations": [{"role": "user", "content": "count from 1 to 3"},
                                     {"role": "assistant", "content": "1 2 3 done"}]})


def test_assistant_tokens_are_exactly_the_loss_mask(target):
    tok = target.tokenizer
    turns = [{"role": "system", "content": "you are a helpful assistant"},
             {"role": "user", "content": "add 2 and 3"}, {"role": "assistant", "content": "2 plus 3 is 5"},
             {"role": "user", "content": "reverse : cat dog"}, {"role": "assistant", "content": "dog cat"}]
    s = tokenize_conversation(tok, turns)
    toks = tok.convert_ids_to_tokens(s.input_ids.tolist())
    masked = [t for t, m in zip(toks, s.loss_mask.tolist()) if m]
    assert masked == ["2", "plus", "3", "is", "5", "<|im_end|>", "dog", "cat", "<|im_end|>"]
    assert s.input_ids.tolist() == tok(tok.apply_chat_template(turns, tokenize=False),
                                       add_special_tokens=False)["input_ids"]


QWEN3_LIKE = (  # like Qwen3: only the LAST assistant turn carries the (empty) think block
    "{% for m in messages %}{% if m.role == 'assistant' %}<|im_start|>assistant\n"
    "{% if loop.last %}<think>\n\n</think>\n\n{% endif %}{{ m.content }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
)


def test_multi_turn_with_a_history_rewriting_template(target):
    import copy

    tok = copy.deepcopy(target.tokenizer)
    tok.chat_template = QWEN3_LIKE
    turns = [{"role": "user", "content": "repeat twice : cat dog"}, {"role": "assistant", "content": "cat dog cat dog"},
             {"role": "user", "content": "reverse : cat dog"}, {"role": "assistant", "content": "dog cat"}]
    s = tokenize_conversation(tok, turns)
    toks = tok.convert_ids_to_tokens(s.input_ids.tolist())
    masked = [t for t, m in zip(toks, s.loss_mask.tolist()) if m]
    assert masked == ["cat", "dog", "cat", "dog", "<|im_end|>", "dog", "cat", "<|im_end|>"]
    think = [m for t, m in zip(toks, s.loss_mask.tolist()) if t == "<unk>"]  # <think> words are not in the vocab
    assert think and not any(think)  # the think block is rendered, and unsupervised


def test_user_turn_quoting_the_answer_is_not_supervised(target):
    tok = target.tokenizer
    s = tokenize_conversation(tok, [{"role": "user", "content": "repeat twice : cat"},
                                    {"role": "assistant", "content": "cat"}])
    toks = tok.convert_ids_to_tokens(s.input_ids.tolist())
    assert [i for i, m in enumerate(s.loss_mask.tolist()) if m] == [len(toks) - 2, len(toks) - 1]
    assert toks[-2:] == ["cat", "<|im_end|>"] and toks.count("cat") == 2


def test_malformed_lines_are_reported_with_line_numbers(tmp_path, target):
    lines = [GOOD, "{not json", GOOD, json.dumps({"conversations": [{"role": "user", "content": "hi"}]}), "",
             json.dumps({"input_ids": [1, 2, 3], "loss_mask": [0, 1]}), json.dumps({"input_ids": [5, 6, 7],
                                                                                  "loss_mask": [0, 1, 1]})]
    path = write_lines(tmp_path / "d.jsonl", lines)
    samples, report = load_samples([path], target.tokenizer, VOCAB, max_bad_fraction=0.5)
    assert len(samples) == 3 and report.lines == 6
    assert [b.line_no for b in report.bad] == [2, 4, 6]
    assert "invalid JSON" in report.bad[0].reason and "no assistant tokens" in report.bad[1].reason
    with pytest.raises(DataError, match=r"d.jsonl:2 .*d.jsonl:4"):
        load_samples([path], target.tokenizer, VOCAB, max_bad_fraction=0.4)


def test_a_lone_surrogate_escape_is_a_malformed_line_and_a_pair_is_text(tmp_path, target):
    """json accepts `\\ud800` alone (a cut emoji in scraped dumps); the tokenizer would fail on it mid-load."""
    pair = json.dumps({"conversations": [{"role": "user", "content": "smile"},
                                         {"role": "assistant", "content": "\U0001F600 ok"}]})  # escaped as a pair
    lone = pair.replace("\\ude00", "")
    assert "\\ud83d\\ude00" in pair and "\\ude00" not in lone
    path = write_lines(tmp_path / "d.jsonl", [GOOD, lone, pair])
    samples, report = load_samples([path], target.tokenizer, VOCAB, max_bad_fraction=0.5)
    assert len(samples) == 2 and [b.line_no for b in report.bad] == [2]
    assert "a lone surrogate escape" in report.bad[0].reason


def test_vocab_constant_matches_the_tiny_target(target):
    assert target.embed_tokens.weight.shape[0] == VOCAB


def test_pretokenized_lines_are_accepted(tmp_path, target):
    path = write_lines(tmp_path / "p.jsonl", [json.dumps({"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]})])
    (s,), _ = load_samples([path], target.tokenizer, VOCAB, 0.0)
    assert s.input_ids.tolist() == [5, 6, 7] and s.loss_mask.tolist() == [False, True, True]


def sample(n, start=10):
    return Sample(torch.arange(start, start + n), torch.ones(n, dtype=torch.bool))


def test_packing_fixed_rows_doc_ids_positions_and_truncation():
    samples = [sample(5), sample(7), sample(4), sample(12), sample(3)]
    rows = pack(samples, seq_len=10, pad_id=0)
    assert rows.input_ids.shape == (3, 10) and rows.truncated == 1
    assert assign_rows([5, 7, 4, 12, 3], 10) == [[0, 2], [1, 4], [3]]
    assert rows.doc_ids[0].tolist() == [0] * 5 + [1] * 4 + [-1]
    assert rows.position_ids[0, :9].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3]
    assert rows.input_ids[0, 5:9].tolist() == [10, 11, 12, 13] and rows.input_ids[0, 9] == 0
    assert not rows.loss_mask[0, 9]
    assert rows.doc_ids[2].tolist() == [0] * 10  # truncated to seq_len


def first_fit_by_scan(lengths, seq_len, close_below=2):
    """First-fit written the plain way (scan every open row in order), the reference for assign_rows."""
    rows, free = [], []
    for i, n in enumerate(lengths):
        n = min(n, seq_len)
        r = next((r for r in range(len(rows)) if free[r] >= close_below and free[r] >= n), None)
        if r is None:
            rows.append([])
            free.append(seq_len)
            r = len(rows) - 1
        rows[r].append(i)
        free[r] -= n
    return rows


@pytest.mark.parametrize("seq_len, short, long", [(64, 1, 70), (2048, 20, 230), (2048, 900, 2100), (16, 1, 3)])
def test_packing_is_first_fit_over_the_rows_in_opening_order(seq_len, short, long):
    """Through the tree's doublings (thousands of rows), rows that close on their last free token, and lengths
    above seq_len."""
    gen = torch.Generator().manual_seed(seq_len + short)
    lengths = torch.randint(short, long + 1, (6000,), generator=gen).tolist()
    assert assign_rows(lengths, seq_len) == first_fit_by_scan(lengths, seq_len)


def test_anchors_valid_first_sorted_and_only_candidates():
    lm = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1, 0, 0]], dtype=torch.bool)
    doc = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, -1, -1]])
    cand = anchor_candidates(lm, doc)
    # 1 and 5: the anchor token itself is not supervised (a prompt's last token: a block inference never runs);
    # 4 -> 5 crosses documents; 7 -> 8 leaves the supervised answer.
    assert cand[0].nonzero().flatten().tolist() == [2, 3, 6]
    pos, valid = sample_anchors(lm, doc, 8, torch.Generator().manual_seed(0))
    assert valid[0].tolist() == [True] * 3 + [False] * 5
    assert pos[0].tolist() == [2, 3, 6, 0, 0, 0, 0, 0]
    pos, valid = sample_anchors(lm, doc, 2, torch.Generator().manual_seed(0))
    assert valid.all() and pos[0].tolist() == sorted(pos[0].tolist()) and set(pos[0].tolist()) <= {2, 3, 6}


def test_anchor_fraction_scales_each_rows_anchors_with_its_supervised_tokens():
    # row 0: 12 supervised tokens in one document (11 candidates); row 1: 3 (2 candidates); row 2: padding
    lm = torch.zeros(3, 16, dtype=torch.bool)
    lm[0, 2:14] = True
    lm[1, 5:8] = True
    doc = torch.where(lm, 0, -1)
    doc[0, :2] = 0
    gen = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    per_row = sample_anchors(lm, doc, 8, gen())
    assert per_row[1].sum(1).tolist() == [8, 2, 0]  # as many as the slots or the candidates allow
    pos, valid = sample_anchors(lm, doc, 8, gen(), fraction=0.25)
    assert pos.shape == valid.shape == (3, 8)  # the slots stay: one captured shape
    assert valid.sum(1).tolist() == [3, 1, 0]  # ceil(0.25 x 12), ceil(0.25 x 3)
    cand = anchor_candidates(lm, doc)
    for r in range(2):
        got = pos[r][valid[r]].tolist()
        assert got == sorted(got) and all(cand[r, p] for p in got) and not valid[r, len(got):].any()
    assert sample_anchors(lm, doc, 8, gen(), fraction=1.0)[1].sum(1).tolist() == [8, 2, 0]  # capped by the slots
    # the kept anchors are a uniform draw: over many draws every candidate of row 0 is taken about 3/11 of the time
    hits = torch.zeros(16)
    for seed in range(400):
        p, v = sample_anchors(lm, doc, 8, torch.Generator().manual_seed(seed), fraction=0.25)
        hits.index_add_(0, p[0][v[0]], torch.ones(int(v[0].sum())))
    share = hits[cand[0]] / 400
    assert share.min() > 0.18 and share.max() < 0.37, share


def test_epoch_batches_apply_the_anchor_fraction():
    rows = pack([sample(20), sample(6), sample(30)], seq_len=32, pad_id=0)
    batch = EpochBatches(rows, 3, 16, seed=0, pad_id=0, anchor_fraction=0.5).batch(0)
    got = batch.anchor_valid.sum(1)
    want = torch.ceil(batch.loss_mask.sum(1) / 2).clamp(max=16)
    assert torch.equal(got, want.long()) and sorted(got.tolist()) == [0, 13, 15]  # ceil(26 / 2), ceil(30 / 2), padding
    with pytest.raises(Exception, match="anchor_fraction"):
        DataCfg(anchor_fraction=0.0)


def test_every_batch_has_identical_shapes_and_is_reproducible(target):
    cfg = DataCfg(seq_len=128, rows_per_step=3, num_anchors=16, eval_fraction=0.1)
    ds = build_datasets(cfg, target.tokenizer, VOCAB, seed=0)
    batches = EpochBatches(ds.train, 3, 16, seed=0, pad_id=0)
    sigs = {batches.batch(i).signature() for i in range(2 * batches.per_epoch + 1)}
    assert len(sigs) == 1 and ds.train.num_rows % 3 != 0  # includes a padded last batch
    last = batches.batch(batches.per_epoch - 1)
    assert (last.doc_ids[-1] == -1).all() and not last.anchor_valid[-1].any()
    a, b = batches.batch(5), batches.batch(5)
    assert all(torch.equal(x, y) for x, y in zip(a.tensors().values(), b.tensors().values()))
    e0, e1 = batches.batch(0), batches.batch(batches.per_epoch)
    assert not torch.equal(e0.anchor_pos, e1.anchor_pos)  # re-sampled every epoch


def test_eval_split_is_disjoint_and_deterministic(target):
    cfg = DataCfg(seq_len=128, rows_per_step=2, num_anchors=8, eval_fraction=0.1)
    a = build_datasets(cfg, target.tokenizer, VOCAB, seed=3)
    b = build_datasets(cfg, target.tokenizer, VOCAB, seed=3)
    assert torch.equal(a.eval.input_ids, b.eval.input_ids)
    assert a.num_eval_samples == 40 and a.num_train_samples == 360


def test_ranks_take_disjoint_rows_of_the_same_permutation(target):
    cfg = DataCfg(seq_len=128, rows_per_step=2, num_anchors=8, eval_fraction=0.0)
    rows = build_datasets(cfg, target.tokenizer, VOCAB, seed=0).train
    single = EpochBatches(rows, 2, 8, seed=0, pad_id=0)
    ranks = [EpochBatches(rows, 2, 8, seed=0, pad_id=0, rank=r, world_size=3) for r in range(3)]
    assert ranks[0].per_epoch == -(-rows.num_rows // 6)
    seen = []
    for micro in range(ranks[0].per_epoch):
        for b in ranks:
            batch = b.batch(micro)
            assert batch.signature() == single.batch(0).signature()
            seen += [tuple(r.tolist()) for r, d in zip(batch.input_ids, batch.doc_ids) if (d >= 0).any()]
    assert len(seen) == rows.num_rows == len(set(seen))  # every row exactly once per epoch, across ranks


def test_a_carriage_return_inside_a_line_does_not_shift_later_line_numbers(tmp_path, target):
    bad_cr = '{"conversations": [{"role": "user", "content": "a\rb"}]}'  # a raw CR: invalid inside a JSON string
    path = tmp_path / "cr.jsonl"
    path.write_bytes("\n".join([GOOD, bad_cr, GOOD, "{broken", GOOD]).encode() + b"\r\n")
    samples, report = load_samples([str(path)], target.tokenizer, VOCAB, max_bad_fraction=0.5)
    assert len(samples) == 3 and report.lines == 5
    assert [b.line_no for b in report.bad] == [2, 4]
    # The whole JSON error, position included.
    at = bad_cr.index("\r")
    assert report.bad[0].reason == f"invalid JSON: Invalid control character at: line 1 column {at + 1} (char {at})"


def test_json_true_is_not_a_token_id(tmp_path, target):
    lines = [json.dumps({"input_ids": [5, True, 7], "loss_mask": [0, 1, 1]}),
             json.dumps({"input_ids": [5, 6.0, 7], "loss_mask": [0, 1, 1]}),
             json.dumps({"input_ids": [5, 6, 7], "loss_mask": [0, 1.0, 1]}),
             json.dumps({"input_ids": [5, 6, VOCAB], "loss_mask": [0, 1, 1]}),
             json.dumps({"input_ids": [5, 6, 7], "loss_mask": [False, True, 1]})]
    path = write_lines(tmp_path / "p.jsonl", lines)
    samples, report = load_samples([path], target.tokenizer, VOCAB, max_bad_fraction=1.0)
    assert [b.line_no for b in report.bad] == [1, 2, 3, 4]
    assert "not true/false" in report.bad[0].reason and f"below the vocabulary size {VOCAB}" in report.bad[3].reason
    assert len(samples) == 1 and samples[0].loss_mask.tolist() == [False, True, True]


def test_scan_checks_every_file_without_a_tokenizer_and_lists_every_bad_line(tmp_path):
    from trainer.data.source import BadLineFile, scan

    path = write_lines(tmp_path / "d.jsonl", [GOOD] * 5 + ["[1, 2]"] * 12 + ["", GOOD])
    listing = BadLineFile(tmp_path / "run" / "bad_lines.txt")
    assert scan([path], max_bad_fraction=0.9, bad_file=listing).lines == 18
    assert not listing.path.exists()  # within the limit: the full load writes the list
    with pytest.raises(DataError) as e:
        scan([path], max_bad_fraction=0.5, bad_file=listing)
    assert "12 of 18 lines malformed" in str(e.value) and f"d.jsonl:6 (not a JSON object)" in str(e.value)
    assert f"and 2 more (every one listed in {listing.path})" in str(e.value)
    assert listing.path.read_text().splitlines() == [f"{path}:{n}: not a JSON object" for n in range(6, 18)]
    with pytest.raises(DataError, match="data file not found: .*nope.jsonl"):
        scan([str(tmp_path / "nope.jsonl")], 0.5)
    with pytest.raises(DataError, match="data path is not a file"):
        scan([str(tmp_path)], 0.5)


def test_a_clean_start_removes_an_earlier_starts_bad_line_list(tmp_path, target):
    from trainer.data.source import BadLineFile

    listing = BadLineFile(tmp_path / "bad_lines.txt")
    listing.path.write_text("d.jsonl:3: from an earlier start\n")
    load_samples([write_lines(tmp_path / "ok.jsonl", [GOOD])], target.tokenizer, VOCAB, 0.0, bad_file=listing)
    listing.finish()
    assert not listing.path.exists()


def test_loading_reports_its_progress_and_the_console_draws_it_only_on_a_tty(tmp_path, target, monkeypatch):
    import io
    import sys

    from trainer.metrics import Console

    path = write_lines(tmp_path / "d.jsonl", [GOOD] * 600)
    calls = []
    load_samples([path], target.tokenizer, VOCAB, 0.0, progress=lambda done, total: calls.append((done, total)))
    size = (tmp_path / "d.jsonl").stat().st_size
    assert [c[0] for c in calls] == [256 * (len(GOOD) + 1), 512 * (len(GOOD) + 1), size] and {c[1] for c in calls} == {size}

    class Tty(io.StringIO):
        def isatty(self):
            return True

    for tty, drawn in ((io.StringIO(), False), (Tty(), True)):
        monkeypatch.setattr(sys, "stderr", tty)
        out = io.StringIO()
        console = Console(out)
        with console.phase("reading and tokenizing the data"):
            console.bytes_bar("tokenizing")(2**20, 2**21)
        assert ("[###############...............] tokenizing 1.0/2.0 MiB" in tty.getvalue()) == drawn
        assert tty.getvalue().endswith("\r\033[K") == drawn  # the bar is wiped before the next line
        lines = out.getvalue().splitlines()
        assert lines[0].endswith("] reading and tokenizing the data ...") and ": 0.0s" in lines[1]


def test_a_pretokenized_line_with_no_supervised_token_is_malformed(tmp_path, target):
    from trainer.data.source import scan

    good = json.dumps({"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]})
    lines = [good, json.dumps({"input_ids": [5, 6, 7], "loss_mask": [0, 0, 0]}), good,
             json.dumps({"input_ids": [5, 6], "loss_mask": [False, False]})]
    path = write_lines(tmp_path / "p.jsonl", lines)
    samples, report = load_samples([path], target.tokenizer, VOCAB, max_bad_fraction=0.5)
    assert len(samples) == 2 and [b.line_no for b in report.bad] == [2, 4]
    assert {b.reason for b in report.bad} == {"no supervised token ('loss_mask' holds no 1)"}
    assert [b.line_no for b in scan([path], 0.5).bad] == [2, 4]  # found before torch too
    for check in (lambda: scan([path], 0.4), lambda: load_samples([path], target.tokenizer, VOCAB, 0.4)):
        with pytest.raises(DataError, match=r"too many malformed lines .*p.jsonl:2 \(no supervised token"):
            check()


def pretokenized(tmp_path, masks):
    return (write_lines(tmp_path / "p.jsonl", [json.dumps({"input_ids": [5 + i for i in range(len(m))],
                                                           "loss_mask": m}) for m in masks]),)


def test_data_whose_supervised_tokens_are_all_truncated_away_is_refused(tmp_path, target):
    paths = pretokenized(tmp_path, [[0] * 10 + [1, 1]] * 4)  # every answer past the first 8 tokens
    with pytest.raises(DataError) as e:
        build_datasets(DataCfg(paths=paths, seq_len=8, num_anchors=4, eval_fraction=0.0), target.tokenizer, VOCAB, 0)
    assert str(e.value) == ("no supervised token left in the training data after packing (4 samples truncated to "
                            "data.seq_len=8)") and "raise data.seq_len" in e.value.hint
    ds = build_datasets(DataCfg(paths=paths, seq_len=16, num_anchors=4, eval_fraction=0.0), target.tokenizer, VOCAB, 0)
    assert int(ds.train.loss_mask.sum()) == 8


def test_data_with_no_two_consecutive_supervised_tokens_is_refused(tmp_path, target):
    """Such data has supervised tokens, but no block: an anchor and its first label are both supervised."""
    cfg = DataCfg(paths=pretokenized(tmp_path, [[0, 1, 0, 1, 0, 1]] * 3), seq_len=32, num_anchors=4, eval_fraction=0.0)
    with pytest.raises(DataError, match="^no block to train: no two consecutive supervised tokens in any training "
                                        "sample$"):
        build_datasets(cfg, target.tokenizer, VOCAB, 0)
    cfg = DataCfg(paths=pretokenized(tmp_path, [[0, 1, 0, 1, 0, 1]] * 2 + [[0, 0, 1, 1]]), seq_len=32, num_anchors=4,
                  eval_fraction=0.0)
    assert build_datasets(cfg, target.tokenizer, VOCAB, 0).train.num_rows == 1


@pytest.mark.parametrize("text", [
    "[" + ", ".join([GOOD] * 3) + "]\n",                                  # a compact dump: one line
    json.dumps([json.loads(GOOD)] * 3, indent=2) + "\n",                   # pretty-printed: "[" alone first
    "\n  [\n" + GOOD + "\n]\n",                                         # blank lines before it
])
def test_a_json_array_file_is_refused_whole_with_how_to_convert_it(tmp_path, text):
    from trainer.data.source import scan
    from trainer.prompts import read_prompt_files

    path = tmp_path / "dump.json"
    path.write_text(text)
    for read in (lambda: scan([str(path)], 0.5), lambda: read_prompt_files([str(path)], 0.5)):
        with pytest.raises(DataError, match="is one JSON array, not one JSON object per line") as e:
            read()
        assert "dump.jsonl" in e.value.hint


def test_the_json_array_hint_run_as_given_keeps_the_input_and_writes_a_loadable_new_file(tmp_path, monkeypatch):
    """The issue's case: prompts.jsonl holding one array. The hinted command, run by a shell exactly as printed,
    must not write onto its input (a `> prompts.jsonl` would empty it before python reads it) nor onto any existing
    file; what it writes is read by training and by the prompt readers."""
    import subprocess

    from trainer.data.source import scan
    from trainer.prompts import read_prompt_files

    monkeypatch.chdir(tmp_path)
    array = json.dumps([json.loads(GOOD)] * 3, indent=2) + "\n"
    Path("prompts.jsonl").write_text(array)
    Path("prompts.lines.jsonl").write_text("mine\n")  # a file of the user's that the new name must avoid
    with pytest.raises(DataError) as e:
        scan(["prompts.jsonl"], 0.0)
    command = e.value.hint.removeprefix("convert it to JSON lines: ")
    assert command != e.value.hint and "> " not in command
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert Path("prompts.jsonl").read_text() == array and Path("prompts.lines.jsonl").read_text() == "mine\n"
    made = sorted(set(p.name for p in tmp_path.iterdir()) - {"prompts.jsonl", "prompts.lines.jsonl"})
    assert made == ["prompts.lines-2.jsonl"]
    assert scan(["prompts.lines-2.jsonl"], 0.0).lines == 3
    assert len(read_prompt_files(["prompts.lines-2.jsonl"], 0.0)[0]) == 3
    again = subprocess.run(["bash", "-c", command], capture_output=True, text=True)  # the output exists now
    assert again.returncode != 0 and "FileExistsError" in again.stderr
    assert scan(["prompts.lines-2.jsonl"], 0.0).lines == 3 and Path("prompts.jsonl").read_text() == array


def test_a_plain_text_prompt_that_starts_with_a_bracket_is_still_a_prompt(tmp_path):
    from trainer.prompts import read_prompt_files

    path = write_lines(tmp_path / "p.txt", ["[INST] count to 3 [/INST]", "[draft] add 2 and 3"])
    good, _report = read_prompt_files([path], 0.0)
    assert [line.turns[-1]["content"] for line in good] == ["[INST] count to 3 [/INST]", "[draft] add 2 and 3"]


def test_messages_is_read_as_conversations(tmp_path, target):
    as_messages = json.dumps({"messages": json.loads(GOOD)["conversations"]})
    a, _ = load_samples([write_lines(tmp_path / "c.jsonl", [GOOD])], target.tokenizer, VOCAB, 0.0)
    b, _ = load_samples([write_lines(tmp_path / "m.jsonl", [as_messages])], target.tokenizer, VOCAB, 0.0)
    assert torch.equal(a[0].input_ids, b[0].input_ids) and torch.equal(a[0].loss_mask, b[0].loss_mask)
