import json

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
