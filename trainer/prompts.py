"""Prompt files in the formats users evaluate drafters on, read into the user turns to decode. Pure but for the file read.

One file is one prompt set (named by its stem); each line is recognised by its keys:
  GSM8K        {"question": ..., "answer": ...}                        -> question
  MATH-500     {"problem": ..., "solution": ...}                       -> problem
  HumanEval    {"task_id": ..., "prompt": ..., "entry_point": ...}     -> prompt (the function to complete)
  MBPP         {"task_id": ..., "text": ..., "test_list": [...]}       -> text, then its tests
  MT-Bench     {"question_id": ..., "turns": [...]}                    -> the first turn
  chat         {"conversations": [{"role": "user", "content": ...}]}   -> the first user turn
  ShareGPT     {"conversations": [{"from": "human", "value": ...}]}    -> the first human turn
  plain text   any line that is not a JSON object                      -> the line
Unreadable lines (invalid UTF-8, JSON that is no known format, an empty prompt) are counted with their line numbers.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from trainer.errors import DataError


@dataclass(frozen=True)
class PromptSet:
    name: str
    prompts: tuple[str, ...]
    formats: tuple[str, ...]  # the formats seen, in order of first appearance
    bad_lines: tuple[int, ...] = field(default=())


def prompt_of(obj) -> tuple[str, str] | None:
    """One parsed JSON line -> (format, user turn), or None when it is no known format."""
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("question"), str) and "answer" in obj:
        return "gsm8k", obj["question"]
    if isinstance(obj.get("problem"), str):
        return "math", obj["problem"]
    if isinstance(obj.get("prompt"), str) and "entry_point" in obj:
        return "humaneval", obj["prompt"]
    if isinstance(obj.get("text"), str) and isinstance(obj.get("test_list"), list):
        tests = "\n".join(str(t) for t in obj["test_list"])
        return "mbpp", f"{obj['text']}\nYour code should pass these tests:\n{tests}" if tests else obj["text"]
    if isinstance(obj.get("turns"), list) and obj["turns"] and isinstance(obj["turns"][0], str):
        return "mt-bench", obj["turns"][0]
    turns = obj.get("conversations")
    if isinstance(turns, list):
        for turn in turns:
            if not isinstance(turn, dict):
                return None
            if turn.get("role") == "user" and isinstance(turn.get("content"), str):
                return "chat", turn["content"]
            if turn.get("from") in ("human", "user") and isinstance(turn.get("value"), str):
                return "sharegpt", turn["value"]
    return None


def read_prompt_set(path: str | Path) -> PromptSet:
    """A prompt file -> its PromptSet; a missing or promptless file is one DataError."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"prompt file {path} not found")
    prompts, formats, bad = [], [], []
    for number, raw in enumerate(path.read_bytes().split(b"\n"), start=1):
        try:
            line = raw.decode("utf-8").strip()
        except UnicodeDecodeError:
            bad.append(number)
            continue
        if not line:
            continue
        found = None
        if line.startswith("{"):
            try:
                found = prompt_of(json.loads(line))
            except json.JSONDecodeError:
                found = None
        else:
            found = ("text", line)
        if found is None or not found[1].strip():
            bad.append(number)
            continue
        if found[0] not in formats:
            formats.append(found[0])
        prompts.append(found[1])
    if not prompts:
        raise DataError(f"prompt file {path} holds no prompt" + (f" ({len(bad)} unreadable lines)" if bad else ""),
                        hint="one prompt per line: GSM8K, MATH-500, HumanEval, MBPP, MT-Bench, chat or ShareGPT JSON "
                             "lines, or plain text")
    return PromptSet(name=path.stem, prompts=tuple(prompts), formats=tuple(formats), bad_lines=tuple(bad))
