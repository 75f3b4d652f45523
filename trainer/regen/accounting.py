"""The counts of a regenerate job, written into OUT.meta.json as `accounting`. Pure: no torch.

The unit is one answer, a (prompt, sample) pair; the job's pairs are its distinct prompts x --continuations. Each
pair is exactly one of
  answered   a row of OUT (the training data), `truncated` among them those that reached --max-new
  failed     its prompt could not be answered: the chat template refused it, or its rendering leaves no room for
             --max-new tokens in the target's positions (each failing prompt listed with key, source and reason)
  skipped    answered but left out of the training data (OUT.skipped.jsonl, by reason: trainer.regen.rows)
  pending    not answered yet (0 once `state` is `done`)
so answered + failed + skipped + pending = expected. Lines of the prompt files that are no prompt (malformed) or
repeat an earlier one are counted apart (`prompt_lines`). The counts are read back from OUT and OUT.skipped.jsonl
on every start, so a resumed job's accounting is that of the files, not of the starts.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

TEMPLATE_REFUSED = "chat template refused"
PROMPT_TOO_LONG = "prompt too long"


@dataclass(frozen=True)
class Failure:
    key: str
    source: str  # path:line
    reason: str  # TEMPLATE_REFUSED | PROMPT_TOO_LONG
    detail: str


def tally(keys: list[str], continuations: int, failures: list[Failure], rows: frozenset, truncated: frozenset,
          skipped: tuple[tuple[tuple[str, int], str], ...], *, lines: int, malformed: int, repeats: int) -> dict:
    """The `accounting` record. keys: the job's distinct prompt keys; rows / truncated: the (key, sample) pairs of
    OUT and those of them truncated; skipped: (pair, reason) of OUT.skipped.jsonl. Pairs outside the job (a prompt
    file dropped on resume) are counted only in `out_rows`."""
    pairs = {(k, i) for k in keys for i in range(continuations)}
    answered = rows & pairs
    left_out = {pair: reason for pair, reason in skipped if pair in pairs and pair not in answered}
    failed_keys = {f.key for f in failures}
    failed = {(k, i) for k, i in pairs if k in failed_keys} - answered - set(left_out)
    by_reason = Counter(reason for pair, reason in left_out.items())
    failures_by = Counter()
    for f in failures:
        failures_by[f.reason] += sum((f.key, i) in failed for i in range(continuations))
    return {
        "unit": "answers", "expected": len(pairs), "answered": len(answered), "failed": len(failed),
        "skipped": len(left_out), "pending": len(pairs) - len(answered) - len(failed) - len(left_out),
        "truncated": {"kept": len(truncated & answered), "skipped": by_reason.get("truncated", 0)},
        "failures": dict(sorted(failures_by.items())),
        "failed_prompts": [{"key": f.key, "source": f.source, "reason": f.reason, "detail": f.detail}
                           for f in failures],
        "skipped_reasons": dict(sorted(by_reason.items())),
        "prompt_lines": {"read": lines, "malformed": malformed, "repeats": repeats, "prompts": len(keys)},
        "out_rows": len(rows),
    }
