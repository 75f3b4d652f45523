"""The out file of a regenerate job, its provenance sidecar, and resuming from them. No torch.

OUT holds one training line per answer, in the order answers finish:
  {"input_ids": prompt + answer, "loss_mask": 0 on the prompt, 1 on the answer,
   "regen": {"key": prompt key, "sample": i, "stopped": the answer ended on a stop id,
             "truncated": it reached --max-new without one, "source": "path:line"}}
The ids are the target's own tokens (its chat template's rendering of the prompt, then exactly what it generated,
the stop id kept): decoding and re-tokenizing could merge them differently. The trainer reads these lines as
pre-tokenized data and ignores `regen`.

OUT.meta.json (the sidecar, replaced atomically) records what made them: the target directory and the SHA-256 of
its config.json, the settings that decide the answers (sampling, continuations, chat-template keyword arguments,
system turn, dtype), the dtype that resolved to (`answer_dtype`), the stop ids, the engines that ran, the prompt
files, and the counts. A restarted job checks them: the same target, settings and answer dtype continue the file,
anything else is refused (a file of mixed settings would teach the drafter two distributions).

Each line is written and flushed on its own, so a job killed mid-write loses at most that line; the torn rest it
leaves after the last newline is cut off when the job resumes. OUT.bad_lines.txt lists every malformed prompt line
(`path:line: reason`). OUT.skipped.jsonl holds, in the same line format plus `regen.skipped` (the reason), each
answer left out of the training data (`--drop-truncated`, `--thinking drop`): written and resumed as OUT is, so a
restarted job neither answers them again nor loses their count.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from trainer.errors import ConfigError

META_FORMAT = "dflash-regenerate/1"


def meta_path(out: Path) -> Path:
    return out.with_name(out.name + ".meta.json")


def bad_lines_path(out: Path) -> Path:
    return out.with_name(out.name + ".bad_lines.txt")


def skipped_path(out: Path) -> Path:
    return out.with_name(out.name + ".skipped.jsonl")


def check_writable(out: Path) -> None:
    """--out can be created and appended to (its directories made), tried for real: ConfigError (exit 2). The probe
    leaves nothing behind, the directories it made included: a job refused later (its prompt files, say) must not
    leave empty folders; `lock_out` makes them again."""
    hint = "pass an --out in a directory you can write"
    if out.is_dir():
        raise ConfigError(f"--out {out} is a directory", hint="pass a file path, e.g. --out data/regen.jsonl")
    above = next(p for p in out.parents if p.exists())
    if not above.is_dir():
        raise ConfigError(f"cannot write --out {out}: {above} is not a directory", hint=hint)
    made = not_there_yet(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        for path in (out, meta_path(out)):
            with path.open("ab"):
                pass
    except OSError as e:
        raise ConfigError(f"cannot write --out {out}: {e.strerror or e}", hint=hint) from None
    finally:
        take_back(made)


@dataclass(frozen=True)
class Made:
    """What a job on OUT may make that was not there before it (`not_there_yet`), for `take_back`."""
    out: Path
    out_new: bool
    meta_new: bool
    dirs: tuple[Path, ...]  # innermost first


def not_there_yet(out: Path) -> Made:
    return Made(out, not out.exists(), not meta_path(out).exists(), tuple(p for p in out.parents if not p.exists()))


def take_back(made: Made) -> None:
    """Remove what the job made where it holds nothing: OUT if it is new and empty, its new sidecar if empty or if
    it spoke of that OUT, the new directories if empty. A refused job leaves no trace; an answer keeps everything."""
    out, meta = made.out, meta_path(made.out)
    out_gone = made.out_new and out.is_file() and out.stat().st_size == 0
    if out_gone:
        out.unlink()
    if made.meta_new and meta.is_file() and (out_gone or meta.stat().st_size == 0):
        meta.unlink()
    for path in made.dirs:
        try:
            path.rmdir()
        except OSError:  # not made here after all, or something was written into it meanwhile: it stays
            break


@dataclass(frozen=True)
class Lines:
    """What one of regenerate's line files (OUT, OUT.skipped.jsonl) holds."""

    pairs: frozenset[tuple[str, int]] = frozenset()  # (prompt key, sample) of its complete lines
    truncated: frozenset[tuple[str, int]] = frozenset()  # those that reached --max-new without a stop id
    reasons: tuple[tuple[tuple[str, int], str], ...] = ()  # OUT.skipped.jsonl: (pair, why it was left out)
    keep_bytes: int = 0  # the file's size without a torn last line
    torn: bool = False


@dataclass(frozen=True)
class Resume:
    answered: frozenset[tuple[str, int]]  # (prompt key, sample) already in OUT
    keep_bytes: int  # OUT's size without a torn last line
    torn: bool
    meta: dict | None  # the sidecar of the earlier run
    truncated: frozenset[tuple[str, int]] = frozenset()  # answers in OUT that reached --max-new
    skipped: Lines = Lines()  # OUT.skipped.jsonl

    @property
    def done(self) -> frozenset[tuple[str, int]]:
        """Pairs not to answer again: in OUT or left out of it."""
        return self.answered | self.skipped.pairs


def _line_regen(line: bytes, out: Path, number: int) -> dict:
    try:
        regen = json.loads(line)["regen"]
        regen["key"], regen["sample"] = str(regen["key"]), int(regen["sample"])
        return regen
    except (ValueError, KeyError, TypeError):
        raise ConfigError(f"{out}:{number} is not a line regenerate writes",
                          hint="pass a new --out (regenerate appends only to its own files)") from None


def scan_lines(path: Path) -> Lines:
    """Read one of regenerate's line files (reads only; a torn last line is noted, not cut)."""
    if not path.is_file():
        return Lines()
    pairs, truncated, reasons = set(), set(), []
    keep, torn = 0, False
    with path.open("rb") as f:
        for number, line in enumerate(f, start=1):
            if not line.endswith(b"\n"):
                torn = True  # killed mid-write: this line goes
                break
            keep += len(line)
            if not line.strip():
                continue
            regen = _line_regen(line, path, number)
            pair = (regen["key"], regen["sample"])
            pairs.add(pair)
            # a line from before `truncated` was written: not stopped is the same fact
            if regen.get("truncated", not regen.get("stopped", True)):
                truncated.add(pair)
            if "skipped" in regen:
                reasons.append((pair, str(regen["skipped"])))
    return Lines(frozenset(pairs), frozenset(truncated), tuple(reasons), keep, torn)


def _empty(path: Path) -> bool:
    return not path.is_file() or path.stat().st_size == 0


def scan_out(out: Path) -> Resume:
    """What an earlier run left in OUT (reads only; nothing is cut here). An OUT with lines but no sidecar is not
    one of ours: refused. A sidecar beside no answer, in OUT or OUT.skipped.jsonl (a start that failed before its
    first), binds nothing: it is ignored, so the next start may change any setting."""
    if _empty(out) and _empty(skipped_path(out)):
        return Resume(frozenset(), 0, False, None)
    meta = None
    if meta_path(out).is_file() and meta_path(out).stat().st_size:
        try:
            meta = json.loads(meta_path(out).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"cannot read {meta_path(out)}: {e}", hint="pass a new --out") from None
    if meta is None or meta.get("format") != META_FORMAT:
        raise ConfigError(f"--out {out} exists and was not written by regenerate (no {meta_path(out).name})",
                          hint="pass a new --out, or remove the file")
    rows = scan_lines(out)
    return Resume(rows.pairs, rows.keep_bytes, rows.torn, meta, rows.truncated, scan_lines(skipped_path(out)))


def check_same_run(meta: dict | None, target: dict, settings: dict) -> None:
    """A resumed OUT continues only with the target and settings that wrote it."""
    if meta is None:
        return
    was_target = meta.get("target", {})
    if was_target.get("config_sha256") != target["config_sha256"]:
        raise ConfigError(f"--out was written with another target ({was_target.get('path')}, a "
                          "different config.json)", hint="pass a new --out for this target")
    # an --out from before weights were fingerprinted has none: its config.json is all it can be checked by
    was_weights, now_weights = was_target.get("weights_fingerprint"), target.get("weights_fingerprint")
    if was_weights and now_weights and was_weights != now_weights:
        raise ConfigError(f"--out was written with other weights ({was_target.get('path')}: the same config.json, "
                          "other weight files)", hint="pass a new --out for this target")
    was, now = _leaves(meta.get("settings") or {}), _leaves(settings)
    diff = [f"{k} {was.get(k)!r} -> {now.get(k)!r}" for k in sorted(set(was) | set(now)) if was.get(k) != now.get(k)]
    if diff:
        raise ConfigError(f"--out was written with other settings ({'; '.join(diff)})",
                          hint="resume with the same settings, or pass a new --out")


def _leaves(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict) and prefix == "":
            out.update(_leaves(v, f"{k}."))
        else:
            out[prefix + k] = v
    return out


def write_meta(out: Path, record: dict) -> None:
    path = meta_path(out)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"format": META_FORMAT, **record, "updated_at": round(time.time(), 1)}, indent=1)
                   + "\n", encoding="utf-8")
    os.replace(tmp, path)


def answer_line(prompt_ids: list[int], answer_ids: list[int], key: str, sample: int, stopped: bool,
                source: str, skipped: str | None = None) -> bytes:
    """One training line; `skipped` (the reason) for a line of OUT.skipped.jsonl. An answer that did not end on a
    stop id reached --max-new: `truncated`."""
    regen = {"key": key, "sample": sample, "stopped": stopped, "truncated": not stopped, "source": source}
    if skipped is not None:
        regen["skipped"] = skipped
    return (json.dumps({"input_ids": prompt_ids + answer_ids,
                        "loss_mask": [0] * len(prompt_ids) + [1] * len(answer_ids), "regen": regen},
                       separators=(",", ":")) + "\n").encode("utf-8")


def lock_out(out: Path):
    """Hold OUT (created if missing) for this job alone: an exclusive flock on it, or one ConfigError when another
    regenerate holds it (two jobs appending to one OUT would interleave and repeat answers). The lock goes with the
    returned file, and with the process."""
    import fcntl

    out.parent.mkdir(parents=True, exist_ok=True)  # check_writable took back the directories it made
    f = out.open("ab")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise ConfigError(f"another regenerate is writing --out {out}",
                          hint="wait for it to end (a restart then goes on where it stopped), or pass another "
                               "--out") from None
    return f


class AnswerWriter:
    """Appends answer lines to a line file (OUT, OUT.skipped.jsonl), one write + flush each, after cutting a torn
    last line off. A file that is not there is made at the first line."""

    def __init__(self, out: Path, keep_bytes: int) -> None:
        self.path, self.f = out, None
        if out.exists():
            self._open()
            if self.f.tell() != keep_bytes:
                self.f.truncate(keep_bytes)
                self.f.seek(keep_bytes)

    def _open(self) -> None:
        self.f = self.path.open("ab")

    def write(self, line: bytes) -> None:
        if self.f is None:
            self._open()
        self.f.write(line)
        self.f.flush()

    def close(self) -> None:
        if self.f is not None:
            self.f.close()
