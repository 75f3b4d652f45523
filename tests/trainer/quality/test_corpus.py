"""The stdlib corpus, its held-out split, function units, and the BPE tokenizer built from them (real files)."""
from __future__ import annotations

import pytest

from trainer.data.source import tokenize_conversation
from trainer.model.target import resolve_mask_token_id
from trainer.quality.config import CorpusCfg
from trainer.quality.corpus import (MASK, all_units, build_tokenizer, chat_text, corpus_root, function_units,
                                    is_heldout, list_sources, pretraining_documents, split_heldout)

SOURCE = '''
import os


def documented(a, b):
    """Add two numbers.

    Long description.
    """
    total = a + b
    return total


class Box:
    def method(self, x):
        y = x * 2
        return y

    def only_doc(self):
        """Nothing else."""


def one_liner():
    return 1
'''


def test_function_units_split_signature_docstring_and_body():
    units = {u.prompt.splitlines()[0]: u for u in function_units(SOURCE, max_prompt_lines=6, max_body_lines=10)}
    assert set(units) == {"def documented(a, b):", "def method(self, x):"}  # only_doc, one_liner: no 2-line body
    doc = units["def documented(a, b):"]
    assert doc.prompt.endswith('Long description.\n    """')
    assert doc.body == "    total = a + b\n    return total"
    assert units["def method(self, x):"].prompt == "def method(self, x):"  # dedented out of the class
    assert units["def method(self, x):"].body == "    y = x * 2\n    return y"
    assert function_units("def broken(:\n", 6, 10) == []
    assert function_units(SOURCE, max_prompt_lines=1, max_body_lines=10)[0].prompt == "def method(self, x):"


def test_list_sources_is_ordered_and_skips_tests_and_huge_files(tmp_path):
    for rel, text in {"b.py": "x = 1\n", "a/z.py": "y = 2\n", "a/test_m.py": "t = 0\n", "tests/t.py": "t = 1\n",
                      "big.py": "#" * 500 + "\n", "notes.txt": "no\n"}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    (tmp_path / "latin1.py").write_bytes(b"s = '\xe9'\n")
    files = list_sources(tmp_path, max_file_bytes=100)
    assert [f.rel for f in files] == ["a/z.py", "b.py"]
    assert list_sources(tmp_path, max_file_bytes=100, max_files=1)[0].rel == "a/z.py"


def test_heldout_split_is_stable_and_disjoint():
    files = list_sources(corpus_root(CorpusCfg()), 200_000, max_files=120)
    assert len(files) == 120 and all("/test/" not in f"/{f.rel}" for f in files)
    heldin, heldout = split_heldout(files, 10)
    assert heldout and heldin and len(heldin) + len(heldout) == len(files)
    assert {f.rel for f in heldin}.isdisjoint({f.rel for f in heldout})
    assert all(is_heldout(f.rel, 10) for f in heldout)
    assert split_heldout(list_sources(corpus_root(CorpusCfg()), 200_000, max_files=120), 10)[1] == heldout


def test_drafter_only_files_are_kept_from_pretraining_and_from_evaluation():
    from trainer.quality.corpus import is_drafter_only, split_corpus

    files = list_sources(corpus_root(CorpusCfg()), 200_000, max_files=120)
    off = split_corpus(files, 10)
    assert off.target == off.drafter == split_heldout(files, 10)[0] and off.seen == off.target
    on = split_corpus(files, 10, drafter_only_every=3)
    target, drafter, heldout = ({f.rel for f in part} for part in (on.target, on.drafter, on.heldout))
    assert on.heldout == off.heldout  # the held-out choice does not move
    assert target.isdisjoint(drafter) and drafter.isdisjoint(heldout) and target.isdisjoint(heldout)
    assert target | drafter | heldout == {f.rel for f in files}
    assert all(is_drafter_only(r, 3) for r in drafter) and not any(is_drafter_only(r, 3) for r in target)
    assert 0.2 < len(drafter) / (len(drafter) + len(target)) < 0.45  # about a third
    assert {f.rel for f in on.seen} == target | drafter and len(on.seen) == len(target) + len(drafter)
    with pytest.raises(Exception, match="drafter_only_every"):
        CorpusCfg(drafter_only_every=1)


@pytest.fixture(scope="module")
def stdlib_slice():
    cfg = CorpusCfg(max_files=25, vocab_size=600)
    files = list_sources(corpus_root(cfg), cfg.max_file_bytes, cfg.max_files)
    return cfg, files


def test_tokenizer_round_trips_and_keeps_chat_prefixes(stdlib_slice):
    cfg, files = stdlib_slice
    docs = pretraining_documents(files, cfg)
    tok = build_tokenizer(docs, cfg.vocab_size)
    assert len(tok) == cfg.vocab_size
    for text in (files[0].text, files[-1].text, "  x = 'é ☃'\n\tpass\r\n"):
        assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    for special in ("<|im_start|>", "<|im_end|>", "<|endoftext|>", MASK):
        assert len(tok(special, add_special_tokens=False)["input_ids"]) == 1
    assert resolve_mask_token_id(tok, len(tok), None) == tok.convert_tokens_to_ids(MASK)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    units = all_units(files, cfg)
    assert len(units) > 20
    for unit in units[:40]:
        turns = [{"role": "user", "content": unit.prompt}, {"role": "assistant", "content": unit.body}]
        assert tok.apply_chat_template(turns, tokenize=False) == chat_text(unit)
        sample = tokenize_conversation(tok, turns)  # raises when the template is not prefix-stable
        answer = tok.decode(sample.input_ids[sample.loss_mask].tolist())
        # The trainer supervises the answer exactly as rendered (its leading indentation too) through the
        # end-of-turn marker.
        assert answer == unit.body + "<|im_end|>"
