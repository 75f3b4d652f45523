"""A real corpus present on every machine: the Python standard library's own sources.

- `list_sources`: deterministic file order (sorted relative paths), tests / site-packages / caches / huge files skipped;
- `split_heldout`: a stable split by crc32 of the relative path (held-out files are seen by nobody: not the target's
  pretraining, not the drafter's training); `split_corpus` optionally also keeps some files from pretraining for the
  drafter's data alone (`corpus.drafter_only_every`);
- `function_units`: (signature + docstring, body) pairs from the AST, used as chat prompts and answers;
- `build_tokenizer`: byte-level BPE trained on the held-in text, with Qwen-style chat special tokens and `<|MASK|>`.
Everything but `build_tokenizer` is pure given the file contents.
"""
from __future__ import annotations

import ast
import sysconfig
import textwrap
import zlib
from dataclasses import dataclass
from pathlib import Path

from trainer.quality.config import CorpusCfg
from trainer.tiny import CHAT_TEMPLATE

SKIP_DIRS = frozenset({"test", "tests", "site-packages", "dist-packages", "__pycache__", "idle_test", "lib2to3"})
ENDOFTEXT, IM_START, IM_END, MASK = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, MASK)


@dataclass(frozen=True)
class SourceFile:
    rel: str  # posix path relative to the corpus root
    text: str


@dataclass(frozen=True)
class Unit:
    """One function: the user turn (signature + docstring) and the assistant turn (the rest of the body)."""

    prompt: str
    body: str


def corpus_root(cfg: CorpusCfg) -> Path:
    return Path(cfg.root) if cfg.root else Path(sysconfig.get_paths()["stdlib"])


def list_sources(root: Path, max_file_bytes: int, max_files: int = 0) -> list[SourceFile]:
    """Every eligible *.py under root, sorted by relative path; unreadable / non-UTF-8 files are skipped."""
    found = []
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        rel = path.relative_to(root)
        if SKIP_DIRS.intersection(rel.parts[:-1]) or rel.name.startswith("test_"):
            continue
        try:
            if not path.is_file() or path.stat().st_size > max_file_bytes:
                continue
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        found.append(SourceFile(rel.as_posix(), text))
        if max_files and len(found) >= max_files:
            break
    return found


def is_heldout(rel: str, every: int) -> bool:
    return zlib.crc32(rel.encode()) % every == 0


def split_heldout(files: list[SourceFile], every: int) -> tuple[list[SourceFile], list[SourceFile]]:
    """-> (held-in, held-out), each in the input order."""
    return [f for f in files if not is_heldout(f.rel, every)], [f for f in files if is_heldout(f.rel, every)]


@dataclass(frozen=True)
class CorpusSplit:
    """Who sees which files. `target`: pretraining. `drafter`: the prompts and source windows whose regenerated
    answers train the drafter. `heldout`: nobody (evaluation prompts only). Without drafter-only files, `drafter` is
    `target`; with them, the two are disjoint, so the drafter learns what the target writes on text it never saw --
    the situation of every held-out prompt."""

    target: list[SourceFile]
    drafter: list[SourceFile]
    heldout: list[SourceFile]

    @property
    def seen(self) -> list[SourceFile]:
        """Every file some model trains on (target and drafter files, each once, in input order)."""
        in_target = {f.rel for f in self.target}
        return self.target + [f for f in self.drafter if f.rel not in in_target]


def is_drafter_only(rel: str, every: int) -> bool:
    # A second, salted hash: independent of the held-out choice.
    return every > 0 and zlib.crc32(b"drafter:" + rel.encode()) % every == 0


def split_corpus(files: list[SourceFile], heldout_every: int, drafter_only_every: int = 0) -> CorpusSplit:
    """Held-out files by `is_heldout`; of the rest, `is_drafter_only` ones go to the drafter alone (0: none)."""
    heldin, heldout = split_heldout(files, heldout_every)
    if not drafter_only_every:
        return CorpusSplit(target=heldin, drafter=heldin, heldout=heldout)
    return CorpusSplit(target=[f for f in heldin if not is_drafter_only(f.rel, drafter_only_every)],
                       drafter=[f for f in heldin if is_drafter_only(f.rel, drafter_only_every)], heldout=heldout)


def corpus_split(cfg: CorpusCfg) -> CorpusSplit:
    """The recipe's corpus, read from disk and split."""
    return split_corpus(list_sources(corpus_root(cfg), cfg.max_file_bytes, cfg.max_files), cfg.heldout_every,
                        cfg.drafter_only_every)


def function_units(text: str, max_prompt_lines: int, max_body_lines: int) -> list[Unit]:
    """Functions and methods (source order), dedented. Prompt = lines up to the end of the docstring (or the
    signature); body = the remaining lines. Files that do not parse give no units."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines()
    units = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not node.body:
            continue
        first = node.body[0]
        has_doc = isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant) \
            and isinstance(first.value.value, str)
        split = first.end_lineno if has_doc else first.lineno - 1  # 1-based last line of the prompt
        if has_doc and len(node.body) == 1:
            continue  # a docstring and nothing else: no answer
        start, end = node.lineno - 1, node.end_lineno
        n_prompt, n_body = split - start, end - split
        if not 1 <= n_prompt <= max_prompt_lines or not 2 <= n_body <= max_body_lines:
            continue
        block = textwrap.dedent("\n".join(lines[start:end])).split("\n")
        units.append(Unit(prompt="\n".join(block[:n_prompt]), body="\n".join(block[n_prompt:])))
    units.sort(key=lambda u: u.prompt)  # ast.walk order is breadth-first; make it independent of nesting
    return units


def all_units(files: list[SourceFile], cfg: CorpusCfg) -> list[Unit]:
    return [u for f in files for u in function_units(f.text, cfg.max_prompt_lines, cfg.max_body_lines)]


def chat_text(unit: Unit) -> str:
    """The unit as one rendered conversation (the same template the tokenizer carries)."""
    return f"{IM_START}user\n{unit.prompt}{IM_END}\n{IM_START}assistant\n{unit.body}{IM_END}\n"


def pretraining_documents(files: list[SourceFile], cfg: CorpusCfg) -> list[str]:
    """Raw sources (the language) + their functions as conversations (the chat format the drafter data uses)."""
    return [f.text for f in files] + [chat_text(u) for u in all_units(files, cfg)]


def build_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE trained on `texts` -> PreTrainedTokenizerFast with chat template; eos = <|im_end|> (the end of an
    assistant turn, as in Qwen3), pad = <|endoftext|>, mask = <|MASK|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # A newline is always its own pre-token: "assistant\n" then tokenizes the same whatever the answer starts with
    # (indentation would otherwise merge with it), so chat prefixes stay prefixes (the trainer's loss mask needs it).
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split("\n", behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token=ENDOFTEXT, mask_token=MASK,
                                   additional_special_tokens=[IM_START])
    fast.chat_template = CHAT_TEMPLATE
    return fast
