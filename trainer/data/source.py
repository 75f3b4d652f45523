"""JSONL -> tokenized samples with an assistant-token loss mask. Malformed lines are counted with their line numbers.

Accepted line formats:
  {"conversations": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}   (chat; tokenized with the
      target tokenizer's chat template; loss mask = the tokens of every assistant turn's content + its end marker)
  {"input_ids": [...], "loss_mask": [...]}                                              (pre-tokenized)
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import torch

from trainer.errors import DataError

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Sample:
    input_ids: torch.Tensor  # [L] int64
    loss_mask: torch.Tensor  # [L] bool


@dataclass(frozen=True)
class BadLine:
    path: str
    line_no: int  # 1-based
    reason: str


@dataclass(frozen=True)
class LoadReport:
    lines: int
    bad: tuple[BadLine, ...] = field(default_factory=tuple)

    @property
    def bad_fraction(self) -> float:
        return len(self.bad) / self.lines if self.lines else 0.0

    def summary(self, limit: int = 10) -> str:
        head = ", ".join(f"{b.path}:{b.line_no} ({b.reason})" for b in self.bad[:limit])
        more = f" and {len(self.bad) - limit} more" if len(self.bad) > limit else ""
        return f"{len(self.bad)} of {self.lines} lines malformed: {head}{more}"


class _Bad(Exception):
    pass


def resolve_path(path: str) -> Path:
    """`bundled:NAME` -> trainer/assets/NAME; anything else is a filesystem path."""
    if path.startswith("bundled:"):
        return Path(str(resources.files("trainer") / "assets" / path.split(":", 1)[1]))
    return Path(path)


def _render(tokenizer, turns: list[dict]) -> str:
    return tokenizer.apply_chat_template(turns, tokenize=False)


def turn_end_marker(tokenizer) -> str:
    """The text a chat template puts after an assistant message (e.g. "<|im_end|>"), found with a probe render."""
    probe = "dflash-probe-answer"
    text = _render(tokenizer, [{"role": "user", "content": "dflash-probe-question"},
                               {"role": "assistant", "content": probe}])
    return text[text.rindex(probe) + len(probe):].strip()


def tokenize_conversation(tokenizer, turns: list[dict], end_marker: str | None = None) -> Sample:
    """Render the whole conversation once with the chat template; supervise every assistant turn.

    Assistant spans are found in the rendered TEXT (each content, in order, plus the template's end-of-turn marker
    right after it) and mapped to tokens with the fast tokenizer's offsets. Unlike rendering prefixes, this survives
    templates that render a turn differently once later turns exist (Qwen3 drops the empty think block of all but
    the last assistant turn). Template-inserted text before the content (a think block) is not supervised.
    """
    marker = turn_end_marker(tokenizer) if end_marker is None else end_marker
    text = _render(tokenizer, turns)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    spans, cursor = [], 0
    for turn in turns:  # walk every turn in order, so a user turn quoting the answer is never mistaken for it
        raw = turn["content"]
        if not raw.strip():
            continue
        # Supervise the content as rendered, leading indentation included (code answers start with it); fall back
        # to the stripped text for templates that strip the content they render.
        content = raw if text.find(raw, cursor) >= 0 else raw.strip()
        at = text.find(content, cursor)
        if at < 0:
            raise _Bad(f"{turn['role']} content not found in the chat-template rendering")
        cursor = at + len(content)
        if turn["role"] != "assistant":
            continue
        gap = len(text) - cursor - len(text[cursor:].lstrip(" \n"))
        end = cursor + gap + len(marker) if marker and text.startswith(marker, cursor + gap) else cursor
        spans.append((at, end))
    mask = [any(a < s_end and b > s_start for s_start, s_end in spans) for a, b in enc["offset_mapping"]]
    if not any(mask):
        raise _Bad("no assistant tokens")
    return Sample(torch.tensor(enc["input_ids"], dtype=torch.long), torch.tensor(mask, dtype=torch.bool))


def parse_line(line: str, tokenizer, vocab_size: int, end_marker: str = "") -> Sample:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise _Bad(f"invalid JSON: {e.msg}") from None
    if not isinstance(obj, dict):
        raise _Bad("not a JSON object")
    if "conversations" in obj:
        turns = obj["conversations"]
        if not isinstance(turns, list) or not turns:
            raise _Bad("'conversations' must be a non-empty list")
        for t in turns:
            if not isinstance(t, dict) or t.get("role") not in ROLES or not isinstance(t.get("content"), str):
                raise _Bad(f"each turn needs role in {ROLES} and string content")
        return tokenize_conversation(tokenizer, [{"role": t["role"], "content": t["content"]} for t in turns],
                                     end_marker)
    if "input_ids" in obj and "loss_mask" in obj:
        ids, mask = obj["input_ids"], obj["loss_mask"]
        if not isinstance(ids, list) or not isinstance(mask, list) or len(ids) != len(mask) or not ids:
            raise _Bad("'input_ids' and 'loss_mask' must be non-empty lists of equal length")
        if not all(isinstance(i, int) and 0 <= i < vocab_size for i in ids):
            raise _Bad(f"'input_ids' must be integers in [0, {vocab_size})")
        if not all(m in (0, 1, True, False) for m in mask):
            raise _Bad("'loss_mask' must hold 0/1")
        return Sample(torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.bool))
    raise _Bad("expected 'conversations' or 'input_ids' + 'loss_mask'")


def load_samples(paths: list[str] | tuple[str, ...], tokenizer, vocab_size: int,
                 max_bad_fraction: float) -> tuple[list[Sample], LoadReport]:
    """Read every file; raise DataError when a file is missing or the bad fraction exceeds max_bad_fraction."""
    marker = turn_end_marker(tokenizer)
    samples: list[Sample] = []
    bad: list[BadLine] = []
    lines = 0
    for raw in paths:
        path = resolve_path(raw)
        if not path.is_file():
            raise DataError(f"data file not found: {raw}", hint="check data.paths / data.eval_paths")
        with path.open(encoding="utf-8") as f:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                lines += 1
                try:
                    samples.append(parse_line(line, tokenizer, vocab_size, marker))
                except _Bad as e:
                    bad.append(BadLine(str(raw), line_no, str(e)))
    report = LoadReport(lines=lines, bad=tuple(bad))
    if lines == 0:
        raise DataError(f"no data lines in {list(paths)}")
    if report.bad_fraction > max_bad_fraction:
        raise DataError(f"too many malformed lines ({report.bad_fraction:.1%} > data.max_bad_fraction="
                        f"{max_bad_fraction}): {report.summary()}", hint="fix the lines or raise data.max_bad_fraction")
    return samples, report
