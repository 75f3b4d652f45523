"""Prompt files in the formats users have, read into conversations to answer. Pure but for the file read.

Each non-blank line is recognised by its keys:
  GSM8K        {"question": ..., "answer": ...}                        -> question
  MATH-500     {"problem": ..., "solution": ...}                       -> problem
  HumanEval    {"task_id": ..., "prompt": ..., "entry_point": ...}     -> prompt (the function to complete)
  MBPP         {"task_id": ..., "text": ..., "test_list": [...]}       -> text, then its tests
  MT-Bench     {"question_id": ..., "turns": [...]}                    -> the first turn
  Alpaca       {"instruction": ..., "input": ...}                      -> instruction, then input when not empty
  prompt       {"prompt": ...}                                         -> prompt
  chat         {"conversations" | "messages": [{"role": ..., "content": ...}, ...]}  (content: a string, or
               OpenAI's list of parts, whose text parts are joined)
  ShareGPT     {"conversations": [{"from": "human" | "gpt" | "system", "value": ...}, ...]}
  plain text   any line that does not start with "{"                   -> the line
The eval formats and plain lines are one user turn. A chat or ShareGPT line is its turns up to and including its
last user turn: what comes after it (the answer the file holds) is what gets answered anew. `trainer eval` decodes
the first user turn of each line (`read_prompt_set`); `trainer regenerate` answers the whole conversation
(`read_prompt_files`, under the training data's malformed-line rule).

Lines are split on b"\\n" only (trainer.data.source.read_lines). A line that is not UTF-8, starts with "{" but is
not a JSON object of a known format, or holds no non-blank user turn is malformed.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from trainer.data.source import (ROLES, BadLine, BadLineFile, LoadReport, MalformedLine, decode_line,
                                 enforce_bad_lines, json_of, read_lines)
from trainer.errors import DataError

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "system": "system",
                  "tool": "tool", "function": "tool", "observation": "tool"}
FORMATS_HINT = ("one prompt per line: GSM8K, MATH-500, HumanEval, MBPP, MT-Bench, Alpaca, {\"prompt\": ...}, chat or "
                "ShareGPT JSON lines, or plain text")


@dataclass(frozen=True)
class PromptSet:
    name: str
    prompts: tuple[str, ...]
    formats: tuple[str, ...]  # the formats seen, in order of first appearance
    bad_lines: tuple[int, ...] = field(default=())


@dataclass(frozen=True)
class PromptLine:
    """One good line of a prompt file: the conversation to answer (role/content turns, ending with a user turn)."""

    path: str
    line_no: int
    format: str
    turns: tuple[dict, ...]


def _single_turn(obj: dict) -> tuple[str, str] | None:
    """The eval formats: (format, the user turn), or None when `obj` is none of them."""
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
    if isinstance(obj.get("instruction"), str) and "conversations" not in obj and "messages" not in obj:
        extra = obj.get("input")
        return "alpaca", obj["instruction"] + (f"\n\n{extra}" if isinstance(extra, str) and extra.strip() else "")
    if isinstance(obj.get("prompt"), str) and "conversations" not in obj and "messages" not in obj:
        return "prompt", obj["prompt"]
    return None


def _text_parts(content) -> str | None:
    """OpenAI's content as a list of parts -> its text parts joined, or None when it is no such list."""
    if not isinstance(content, list) or not content:
        return None
    if not all(isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str) for c in content):
        return None
    return "\n".join(c["text"] for c in content)


def _turn(t, number: int) -> tuple[str, dict]:
    """One turn of a chat or ShareGPT list -> (format, {"role", "content"})."""
    if isinstance(t, dict) and t.get("role") in ROLES and isinstance(t.get("content"), str):
        return "chat", {"role": t["role"], "content": t["content"]}
    if isinstance(t, dict) and t.get("role") in ROLES and _text_parts(t.get("content")) is not None:
        return "chat", {"role": t["role"], "content": _text_parts(t["content"])}
    if isinstance(t, dict) and "from" in t and isinstance(t.get("value"), str):
        role = SHAREGPT_ROLES.get(str(t["from"]).lower())
        if role is None:
            raise MalformedLine(f"turn {number}: unknown ShareGPT speaker {t['from']!r}")
        return "sharegpt", {"role": role, "content": t["value"]}
    raise MalformedLine(f"turn {number}: needs role in {ROLES} and string content or text parts (chat), or from + "
                        "string value (ShareGPT)")


def conversation_of(obj) -> tuple[str, tuple[dict, ...]]:
    """One parsed JSON line -> (format, turns through the last user turn). Raises MalformedLine with the reason."""
    if not isinstance(obj, dict):
        raise MalformedLine("not a JSON object")
    single = _single_turn(obj)
    if single is not None:
        return single[0], ({"role": "user", "content": single[1]},)
    key = "conversations" if "conversations" in obj else "messages" if "messages" in obj else None
    if key is None:
        raise MalformedLine("a JSON object of no known prompt format")
    raw = obj[key]
    if not isinstance(raw, list) or not raw:
        raise MalformedLine(f"'{key}' must be a non-empty list of turns")
    parsed = [_turn(t, i) for i, t in enumerate(raw, start=1)]
    users = [i for i, (_fmt, t) in enumerate(parsed) if t["role"] == "user"]
    if not users:
        raise MalformedLine("no user turn")
    turns = tuple(t for _fmt, t in parsed[:users[-1] + 1])
    return parsed[0][0], turns


def parse_prompt_line(line: bytes) -> tuple[str, tuple[dict, ...]]:
    """One non-blank line -> (format, turns). Raises MalformedLine with the reason."""
    text = decode_line(line).strip()
    if text.startswith("{"):
        fmt, turns = conversation_of(json_of(text))
    else:
        fmt, turns = "text", ({"role": "user", "content": text},)
    if not turns[-1]["content"].strip():
        raise MalformedLine("an empty prompt")
    return fmt, turns


def set_names(paths) -> list[str]:
    """The name of each prompt file's set: its stem, or where stems collide, the stem under the fewest parent
    directories that tell those files apart ("gsm8k/test", "humaneval/test"), else the file name under them
    ("test.jsonl", "test.txt"); a file given again gets "#2" and so on. A unique stem stays the name."""
    full = [Path(os.path.abspath(p)) for p in paths]
    by_stem: dict[str, list[Path]] = {}
    for p in dict.fromkeys(full):
        by_stem.setdefault(p.stem, []).append(p)
    name_of = {}
    for stem, group in by_stem.items():
        name_of.update(zip(group, [stem] if len(group) == 1 else _apart(group)))
    seen: dict[Path, int] = {}
    names = []
    for p in full:
        seen[p] = seen.get(p, 0) + 1
        names.append(name_of[p] if seen[p] == 1 else f"{name_of[p]}#{seen[p]}")
    return names


def _apart(group: list[Path]) -> list[str]:
    """Distinct absolute paths of one stem -> the shortest names that tell them apart (the whole path at worst)."""
    depth = max(len(q.parts) for q in group)
    for leaf, first in (("stem", 1), ("name", 0)):
        for k in range(first, depth):
            names = ["/".join((*q.parent.parts[1:][max(0, len(q.parts) - 2 - k):], getattr(q, leaf))) for q in group]
            if len(set(names)) == len(names):
                return names
    raise AssertionError(group)  # distinct paths differ in full


def read_prompt_set(path: str | Path, name: str | None = None) -> PromptSet:
    """A prompt file -> its PromptSet of first user turns (eval), named `name` (default: the file's stem); a
    missing, non-file or promptless file is one DataError."""
    path = Path(path)
    if path.is_dir():
        raise DataError(f"prompt file {path} is a directory, not a file", hint=f"pass the files in it: {path}/*.jsonl")
    if not path.is_file():
        raise DataError(f"prompt file {path} not found")
    prompts, formats, bad = [], [], []
    for number, raw in read_lines(str(path), "prompt", "check --prompts"):
        if not raw.strip():
            continue
        try:
            fmt, turns = parse_prompt_line(raw)
        except MalformedLine:
            bad.append(number)
            continue
        first = next(t["content"] for t in turns if t["role"] == "user")
        if not first.strip():
            bad.append(number)
            continue
        if fmt not in formats:
            formats.append(fmt)
        prompts.append(first)
    if not prompts:
        raise DataError(f"prompt file {path} holds no prompt" + (f" ({len(bad)} unreadable lines)" if bad else ""),
                        hint=FORMATS_HINT)
    return PromptSet(name=name or path.stem, prompts=tuple(prompts), formats=tuple(formats), bad_lines=tuple(bad))


def read_prompt_files(paths: list[str] | tuple[str, ...], max_bad_fraction: float,
                      bad_file: BadLineFile | None = None, *, write_always: bool = True
                      ) -> tuple[list[PromptLine], LoadReport]:
    """Every line of every prompt file -> the good lines and the report; malformed lines are skipped under the
    training data's rule (more than `max_bad_fraction` of them, or none left: DataError, exit 3), and a file with no
    line at all is refused on its own. The malformed lines go to `bad_file` always, or with `write_always` False only
    when refused (a caller that may still be refused for another reason writes them itself later)."""
    good: list[PromptLine] = []
    bad: list[BadLine] = []
    lines = 0
    for raw_path in paths:
        in_file = 0
        for line_no, line in read_lines(raw_path, "prompt", "check --prompts"):
            if not line.strip():
                continue
            in_file += 1
            try:
                fmt, turns = parse_prompt_line(line)
            except MalformedLine as e:
                bad.append(BadLine(str(raw_path), line_no, str(e)))
                continue
            good.append(PromptLine(str(raw_path), line_no, fmt, turns))
        if not in_file:
            raise DataError(f"prompt file {raw_path} is empty", hint=FORMATS_HINT)
        lines += in_file
    report = enforce_bad_lines(paths, lines, bad, max_bad_fraction, bad_file, write_always=write_always,
                               what="prompt", knob="--max-bad-fraction", hint="check --prompts")
    if not good:
        raise DataError(f"no readable prompt in {list(paths)}: {report.summary()}", hint=FORMATS_HINT)
    return good, report
