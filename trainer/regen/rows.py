"""What one generated answer becomes: a training row of OUT, or a row left out of the training data with its reason
(it goes to OUT.skipped.jsonl, as generated). Pure: no torch.

  --drop-truncated   an answer that reached --max-new without a stop id is left out (reason `truncated`); without
                     it the row is kept and marked `truncated` (trainer.regen.outfile).
  --thinking keep    the reasoning segment (`<think>` ... `</think>`, Qwen3-style) stays in the row: the drafter
                     learns to draft the reasoning the target writes when it is served with thinking on.
  --thinking drop    the segment is cut out of the row, with the blank tokens after `</think>` (as the Qwen3 chat
                     template renders an earlier assistant turn); where the generation prompt itself opened the
                     segment (templates that end it with `<think>`), the prompt is cut before that `<think>`. An
                     answer whose reasoning never closed (it reached --max-new inside it) is left out (reason
                     `unclosed thinking`), as is one with nothing after `</think>` but blanks and its stop id
                     (reason `no answer after thinking`).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

THINKING_MODES = ("keep", "drop")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TRUNCATED = "truncated"
UNCLOSED_THINKING = "unclosed thinking"
NO_ANSWER = "no answer after thinking"


@dataclass(frozen=True)
class ThinkMarkers:
    open_id: int
    close_id: int


@dataclass(frozen=True)
class Row:
    prompt: list[int]
    answer: list[int]
    skipped: str | None = None  # why it is left out of the training data; None: a row of OUT


def thinking_markers(tokenizer) -> ThinkMarkers | None:
    """The tokenizer's `<think>` and `</think>` ids where both are single tokens of its vocabulary, else None."""
    vocab = tokenizer.get_vocab()
    if THINK_OPEN in vocab and THINK_CLOSE in vocab:
        return ThinkMarkers(vocab[THINK_OPEN], vocab[THINK_CLOSE])
    return None


def _open_at_end(prompt: list[int], m: ThinkMarkers) -> int | None:
    """The index of a `<think>` the prompt leaves open (no `</think>` after it), else None."""
    for i in range(len(prompt) - 1, -1, -1):
        if prompt[i] == m.close_id:
            return None
        if prompt[i] == m.open_id:
            return i
    return None


def drop_thinking(prompt: list[int], answer: list[int], m: ThinkMarkers,
                  is_blank: Callable[[int], bool], stopped: bool = False) -> Row:
    """The row without its reasoning segment (module docstring); an answer with none is returned as it is. `stopped`:
    the answer's last token is its stop id, which alone after `</think>` is no answer."""
    opened = _open_at_end(prompt, m)
    if opened is not None:
        prompt, body = prompt[:opened], answer
    else:
        first = next((i for i, t in enumerate(answer) if not is_blank(t)), len(answer))
        if first == len(answer) or answer[first] != m.open_id:
            return Row(prompt, answer)
        body = answer[first + 1:]
    if m.close_id not in body:
        return Row(prompt, answer, UNCLOSED_THINKING)
    rest = body[body.index(m.close_id) + 1:]
    start = next((i for i, t in enumerate(rest) if not is_blank(t)), len(rest))
    rest = rest[start:]
    return Row(prompt, rest) if rest[:-1 if stopped else None] else Row(prompt, answer, NO_ANSWER)


def finish(prompt: list[int], answer: list[int], stopped: bool, *, thinking: str = "keep",
           markers: ThinkMarkers | None = None, drop_truncated: bool = False,
           is_blank: Callable[[int], bool] = lambda _t: False) -> Row:
    """One answer -> its Row. A row left out keeps the prompt and answer as generated."""
    if drop_truncated and not stopped:
        return Row(prompt, answer, TRUNCATED)
    if thinking == "drop":
        if markers is None:
            raise ValueError("--thinking drop needs the tokenizer's <think> and </think> ids")
        row = drop_thinking(prompt, answer, markers, is_blank, stopped)
        return Row(prompt, answer, row.skipped) if row.skipped else row
    return Row(prompt, answer)
