"""JSONL -> tokenized samples with an assistant-token loss mask. Malformed lines are counted with their line numbers.

Accepted line formats:
  {"conversations": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}   (chat; tokenized with the
      target tokenizer's chat template; loss mask = the tokens of every assistant turn's content + its end marker;
      "messages", OpenAI's name for the list, is read the same)
  {"input_ids": [...], "loss_mask": [...]}   (pre-tokenized: ids are non-negative integers below the target's
      vocabulary size, never true/false; the mask holds 0/1 or true/false)

Lines are split on b"\n" only, so a line number is what `sed -n Np` shows, whatever carriage returns a line holds.
A line that is not UTF-8, not one JSON object, or not one of the formats is malformed, as is one with no supervised
token (a loss_mask without a 1, a conversation the tokenizer finds no assistant token in). A file that is one JSON
array (a `.json` dump, on one line or pretty-printed) is refused whole, with how to convert it. Two passes share these
rules: `scan` (no tokenizer, no torch: the CLI runs it before anything heavy) and `load_samples` (then
tokenization). Every malformed line goes to a `BadLineFile` (the run's bad_lines.txt) when one is given; messages
number the first ten.
"""
from __future__ import annotations

import json
import re
import shlex
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from trainer.errors import DataError

if TYPE_CHECKING:
    import torch

ROLES = ("system", "user", "assistant", "tool")
_BOM = b"\xef\xbb\xbf"
_MASK_TYPES = {int, bool}  # a loss_mask entry: 0/1 or false/true
_PROGRESS_EVERY = 256  # lines between progress callbacks


@dataclass(frozen=True)
class Sample:
    input_ids: torch.Tensor  # [L] int64
    loss_mask: torch.Tensor  # [L] bool


@dataclass(frozen=True)
class BadLine:
    path: str
    line_no: int  # 1-based
    reason: str

    def render(self) -> str:
        return f"{self.path}:{self.line_no}: {self.reason}"


@dataclass(frozen=True)
class LoadReport:
    lines: int
    bad: tuple[BadLine, ...] = field(default_factory=tuple)
    listed_in: str = ""  # the file holding every bad line ("" = none written)

    @property
    def bad_fraction(self) -> float:
        return len(self.bad) / self.lines if self.lines else 0.0

    def summary(self, limit: int = 10) -> str:
        head = ", ".join(f"{b.path}:{b.line_no} ({b.reason})" for b in self.bad[:limit])
        more = f" and {len(self.bad) - limit} more" if len(self.bad) > limit else ""
        where = f" (every one listed in {self.listed_in})" if self.listed_in else ""
        return f"{len(self.bad)} of {self.lines} lines malformed: {head}{more}{where}"


class BadLineFile:
    """Every malformed line of one start, `path:line: reason` per line. The first write of a start replaces what an
    earlier start left; `finish` removes an earlier start's file when this one found nothing."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.written = False

    def write(self, bad: tuple[BadLine, ...] | list[BadLine]) -> str:
        if not bad:
            return str(self.path) if self.written else ""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a" if self.written else "w", encoding="utf-8") as f:
            f.writelines(b.render() + "\n" for b in bad)
        self.written = True
        return str(self.path)

    def finish(self) -> None:
        if not self.written and self.path.is_file():
            self.path.unlink()


class MalformedLine(Exception):
    """One line breaks the format rules; its message is the reason reported with path:line."""


def resolve_path(path: str) -> Path:
    """`bundled:NAME` -> trainer/assets/NAME; anything else is a filesystem path."""
    if path.startswith("bundled:"):
        return Path(str(resources.files("trainer") / "assets" / path.split(":", 1)[1]))
    return Path(path)


def _open(raw: str, what: str, hint: str):
    path = resolve_path(raw)
    if not path.is_file():
        raise DataError(f"{what} file not found: {raw}" if not path.exists() else f"{what} path is not a file: {raw}",
                        hint=hint)
    try:
        return path.open("rb")
    except OSError as e:
        raise DataError(f"cannot read {what} file {raw}: {e.strerror}", hint="check the file's permissions") from None


def read_lines(raw: str, what: str = "data",
               hint: str = "check data.paths / data.eval_paths") -> Iterator[tuple[int, bytes]]:
    """(1-based number, bytes) of every line of one file, split on b"\n" only (binary mode); a UTF-8 byte-order
    mark before the first line is dropped. `what` ("data", "prompt") and `hint` word the errors. A file whose first
    non-blank line opens a JSON array is one DataError: its lines are pieces of one document, not records."""
    with _open(raw, what, hint) as f:
        try:
            seen_content = False
            for line_no, line in enumerate(f, start=1):
                if line_no == 1 and line.startswith(_BOM):
                    line = line[len(_BOM):]
                if not seen_content and line.strip():
                    seen_content = True
                    if _opens_json_array(line):
                        raise DataError(f"{what} file {raw} is one JSON array, not one JSON object per line",
                                        hint=f"convert it to JSON lines: {to_json_lines_command(raw)}")
                yield line_no, line
        except OSError as e:
            raise DataError(f"cannot read {what} file {raw}: {e.strerror}") from None


# Reads the array (argv[1]) and writes one line per element into a file it creates (argv[2]; mode "x" refuses an
# existing one): the input is never opened for writing, whatever names are given.
_TO_JSON_LINES = ('import json, sys; rows = json.load(open(sys.argv[1], encoding="utf-8")); '
                  'out = open(sys.argv[2], "x", encoding="utf-8"); [out.write(json.dumps(r) + "\\n") for r in rows]; out.close()')


def to_json_lines_command(raw: str) -> str:
    """The shell command that converts the JSON-array file `raw` into JSON lines beside it, into a name that does
    not exist yet (NAME.jsonl, else NAME.lines.jsonl, NAME.lines-2.jsonl, ...), quoted for the shell."""
    path = Path(raw)
    out = path.with_name(f"{path.stem}.jsonl")
    n = 1
    while out.exists() or out == path:
        out = path.with_name(f"{path.stem}.lines{'' if n == 1 else f'-{n}'}.jsonl")
        n += 1
    return shlex.join(["python3", "-c", _TO_JSON_LINES, raw, str(out)])


def _opens_json_array(line: bytes) -> bool:
    """`[`, `[{`, `[[` or `["` first: a JSON array of records (a plain-text prompt such as "[INST] ..." is not)."""
    text = line.strip()
    return text == b"[" or text[:2] in (b"[{", b"[[", b'["')


def decode_line(line: bytes) -> str:
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise MalformedLine(f"invalid UTF-8 at byte {e.start + 1} of the line ({e.reason})") from None


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def json_of(text: str):
    """A line's text -> its JSON value. Raises MalformedLine for invalid JSON and for a lone surrogate escape (as
    `\\ud800`, left by a cut emoji in scraped dumps): json accepts it, but no UTF-8 text holds it, so the tokenizer and
    every file written after would fail on it."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise MalformedLine(f"invalid JSON: {e}") from None
    if _SURROGATE_ESCAPE.search(text):  # a pair decodes to one code point: only an unpaired half is left in a string
        try:
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise MalformedLine("a lone surrogate escape (\\ud800-\\udfff without its pair), which UTF-8 cannot "
                                "encode") from None
    return obj


def parse_record(line: bytes) -> dict:
    """One non-blank line -> its JSON object, checked against the formats (everything but tokenization)."""
    obj = json_of(decode_line(line))
    if not isinstance(obj, dict):
        raise MalformedLine("not a JSON object")
    key = "conversations" if "conversations" in obj else "messages" if "messages" in obj else None
    if key is not None:
        turns = obj[key]
        if not isinstance(turns, list) or not turns:
            raise MalformedLine(f"'{key}' must be a non-empty list")
        for t in turns:
            if not isinstance(t, dict) or t.get("role") not in ROLES or not isinstance(t.get("content"), str):
                raise MalformedLine(f"each turn needs role in {ROLES} and string content")
        return obj if key == "conversations" else {**obj, "conversations": turns}
    if "input_ids" in obj and "loss_mask" in obj:
        ids, mask = obj["input_ids"], obj["loss_mask"]
        if not isinstance(ids, list) or not isinstance(mask, list) or len(ids) != len(mask) or not ids:
            raise MalformedLine("'input_ids' and 'loss_mask' must be non-empty lists of equal length")
        # bool is an int in Python: `true` must not pass as token id 1 (nor 1.0 as a mask's 1). The checks run over
        # types and values by builtins, not element by element in Python: a pre-tokenized corpus has millions.
        if set(map(type, ids)) != {int} or min(ids) < 0:
            raise MalformedLine("'input_ids' must hold non-negative integers (not true/false, not floats)")
        if not set(map(type, mask)) <= _MASK_TYPES or not set(mask) <= {0, 1}:
            raise MalformedLine("'loss_mask' must hold 0/1 or true/false")
        if 1 not in mask:  # True == 1: a mask of false/0 only would train nothing
            raise MalformedLine("no supervised token ('loss_mask' holds no 1)")
        return obj
    raise MalformedLine("expected 'conversations' (or 'messages') or 'input_ids' + 'loss_mask'")


def enforce_bad_lines(paths, lines: int, bad: list[BadLine], max_bad_fraction: float,
                      bad_file: BadLineFile | None, *, write_always: bool = True, what: str = "data",
                      knob: str = "data.max_bad_fraction",
                      hint: str = "check data.paths / data.eval_paths") -> LoadReport:
    """Write the bad lines (always, or only when refusing), then refuse no lines or more malformed lines than
    allowed (the one rule for training data and prompt files; `what`, `knob` and `hint` word the errors)."""
    failing = lines == 0 or len(bad) / lines > max_bad_fraction
    listed = bad_file.write(bad) if bad_file is not None and bad and (write_always or failing) else ""
    report = LoadReport(lines=lines, bad=tuple(bad), listed_in=listed)
    if lines == 0:
        raise DataError(f"no {what} lines in {list(paths)}", hint=hint)
    if failing:
        raise DataError(f"too many malformed lines ({report.bad_fraction:.1%} > {knob}="
                        f"{max_bad_fraction}): {report.summary()}", hint=f"fix the lines or raise {knob}")
    return report


# How the malformed-line errors name the limit and the files: the training config's settings, or eval --data's flags.
TRAIN_KNOB, TRAIN_HINT = "data.max_bad_fraction", "check data.paths / data.eval_paths"
EVAL_KNOB, EVAL_HINT = "--max-bad-fraction", "check --data"


def scan(paths: list[str] | tuple[str, ...], max_bad_fraction: float,
         bad_file: BadLineFile | None = None, *, knob: str = TRAIN_KNOB, hint: str = TRAIN_HINT) -> LoadReport:
    """Every file exists and is readable; every line is UTF-8, JSON, one of the formats. Raise DataError (missing
    file, no lines, more malformed lines than allowed: a tokenizer could only find more) -> the report.
    No tokenizer, no torch: what the CLI checks before it loads either. The bad lines are written only when it
    refuses (otherwise the full load that follows writes them). `knob` and `hint`: the setting that allows more
    malformed lines and where the files are named, in the errors (eval's flags, not the training config's)."""
    bad: list[BadLine] = []
    lines = 0
    for raw in paths:
        for line_no, line in read_lines(raw, hint=hint):
            if not line.strip():
                continue
            lines += 1
            try:
                parse_record(line)
            except MalformedLine as e:
                bad.append(BadLine(str(raw), line_no, str(e)))
    return enforce_bad_lines(paths, lines, bad, max_bad_fraction, bad_file, write_always=False, knob=knob, hint=hint)


def _render(tokenizer, turns: list[dict]) -> str:
    if not getattr(tokenizer, "chat_template", None):
        # Every chat line would fail the same way: one line for the run, not one malformed line each.
        raise DataError("chat data needs the target tokenizer's chat template, and this tokenizer has none",
                        hint="use a chat (instruct) target, add a chat_template to its tokenizer_config.json, or "
                             "give pre-tokenized input_ids + loss_mask lines")
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
            raise MalformedLine(f"{turn['role']} content not found in the chat-template rendering")
        cursor = at + len(content)
        if turn["role"] != "assistant":
            continue
        gap = len(text) - cursor - len(text[cursor:].lstrip(" \n"))
        end = cursor + gap + len(marker) if marker and text.startswith(marker, cursor + gap) else cursor
        spans.append((at, end))
    mask = [any(a < s_end and b > s_start for s_start, s_end in spans) for a, b in enc["offset_mapping"]]
    if not any(mask):
        raise MalformedLine("no assistant tokens")
    import torch

    return Sample(torch.tensor(enc["input_ids"], dtype=torch.long), torch.tensor(mask, dtype=torch.bool))


def to_sample(obj: dict, tokenizer, vocab_size: int, end_marker: str = "") -> Sample:
    """A record `parse_record` accepted -> Sample (token ids are checked against the vocabulary here)."""
    import torch

    if "conversations" in obj:
        return tokenize_conversation(tokenizer, [{"role": t["role"], "content": t["content"]}
                                                 for t in obj["conversations"]], end_marker)
    ids, mask = obj["input_ids"], obj["loss_mask"]
    if max(ids) >= vocab_size:
        raise MalformedLine(f"'input_ids' must be below the vocabulary size {vocab_size} (found {max(ids)})")
    return Sample(torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.bool))


def parse_line(line: str | bytes, tokenizer, vocab_size: int, end_marker: str = "") -> Sample:
    raw = line.encode("utf-8") if isinstance(line, str) else line
    return to_sample(parse_record(raw), tokenizer, vocab_size, end_marker)


def load_samples(paths: list[str] | tuple[str, ...], tokenizer, vocab_size: int, max_bad_fraction: float, *,
                 bad_file: BadLineFile | None = None, progress: Callable[[int, int], None] | None = None,
                 knob: str = TRAIN_KNOB, hint: str = TRAIN_HINT) -> tuple[list[Sample], LoadReport]:
    """Read and tokenize every file; raise DataError when a file is missing or unreadable, or the bad fraction
    exceeds max_bad_fraction (`knob`, `hint`: as `scan`'s). progress(bytes read, bytes in all files) is called as
    lines are tokenized."""
    marker: str | None = None  # found on the first chat line: pre-tokenized data needs no chat template
    samples: list[Sample] = []
    bad: list[BadLine] = []
    lines = 0
    total = sum(resolve_path(raw).stat().st_size for raw in paths if resolve_path(raw).is_file())
    done = 0
    for raw in paths:
        for line_no, line in read_lines(raw, hint=hint):
            done += len(line)
            if progress is not None and line_no % _PROGRESS_EVERY == 0:
                progress(done, total)
            if not line.strip():
                continue
            lines += 1
            try:
                record = parse_record(line)
                if marker is None and "conversations" in record:
                    marker = turn_end_marker(tokenizer)
                samples.append(to_sample(record, tokenizer, vocab_size, marker or ""))
            except MalformedLine as e:
                bad.append(BadLine(str(raw), line_no, str(e)))
    if progress is not None:
        progress(done, total)
    return samples, enforce_bad_lines(paths, lines, bad, max_bad_fraction, bad_file, knob=knob, hint=hint)
