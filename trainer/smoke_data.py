"""Deterministic generator of the bundled smoke dataset (`trainer/assets/smoke.jsonl`).

Simple, learnable chat tasks (counting, repeating, reversing, adding) so a tiny drafter's loss visibly falls.
Regenerate with: `python -m trainer.smoke_data trainer/assets/smoke.jsonl`.
"""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

WORDS = ("apple tree river stone cloud bird house green red blue light night sun moon star road book lamp door "
         "cat dog fish bread milk rain snow wind fire sea hill").split()
NUMBERS = [str(i) for i in range(0, 60)]


def _count(rng: random.Random) -> tuple[str, str]:
    a = rng.randrange(0, 30)
    b = a + rng.randrange(5, 20)
    return f"count from {a} to {b}", " ".join(str(i) for i in range(a, b + 1)) + " done"


def _repeat(rng: random.Random) -> tuple[str, str]:
    words = rng.sample(WORDS, rng.randrange(3, 6))
    return "repeat twice : " + " ".join(words), " ".join(words + words)


def _reverse(rng: random.Random) -> tuple[str, str]:
    words = rng.sample(WORDS, rng.randrange(3, 7))
    return "reverse : " + " ".join(words), " ".join(reversed(words))


def _add(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randrange(0, 30), rng.randrange(0, 29)
    return f"add {a} and {b}", f"{a} plus {b} is {a + b} . the answer is {a + b}"


TASKS = (_count, _repeat, _reverse, _add)


def conversations(n: int = 400, seed: int = 1234) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        turns = [{"role": "system", "content": "you are a helpful assistant"}] if rng.random() < 0.3 else []
        for _turn in range(rng.choice((1, 1, 2))):
            user, assistant = rng.choice(TASKS)(rng)
            turns += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        out.append({"conversations": turns})
    return out


def vocabulary_text() -> str:
    """Every word the tasks can produce (for training the tiny tokenizer)."""
    return " ".join(WORDS + NUMBERS + [str(i) for i in range(60, 120)] +
                    "count from to done repeat twice reverse add and plus is the answer you are a helpful assistant "
                    "user system : .".split())


def main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m trainer.smoke_data", description=__doc__.splitlines()[0])
    p.add_argument("out", nargs="?", default="trainer/assets/smoke.jsonl", help="where to write (default: %(default)s)")
    out = Path(p.parse_args(argv).out)
    out.write_text("".join(json.dumps(c) + "\n" for c in conversations()))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
