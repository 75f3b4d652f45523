"""The quality pipeline's prompt sets as prompt files, for the user's path on its target (regenerate -> train ->
export -> eval; docs/regenerate.md).

  python -m trainer.quality.prompt_files --recipe quality_gpu|quality_cpu|PATH.yaml --out DIR [--set a.b=v]...

Writes DIR/train.jsonl (the prompts the pipeline regenerates the drafter's answers for) and DIR/heldout.jsonl (its
held-out prompts), one chat line {"conversations": [{"role": "user", "content": ...}]} each: the same sets, in the
same order, that `trainer.quality.regenerate.prompt_sets` gives the pipeline for that recipe and this Python's
standard library.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from trainer.errors import ConfigError, run_cli


def write_prompt_files(recipe: str, out: Path, overrides: list[str] = ()) -> dict[str, int]:
    from trainer.quality.config import load_recipe
    from trainer.quality.corpus import corpus_split
    from trainer.quality.regenerate import prompt_sets

    q = load_recipe(recipe, list(overrides))
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"output directory {out} is not empty", hint="pass a new --out directory")
    train, heldout = prompt_sets(q, corpus_split(q.corpus))
    out.mkdir(parents=True, exist_ok=True)
    counts = {}
    for name, prompts in (("train", train), ("heldout", heldout)):
        with (out / f"{name}.jsonl").open("w", encoding="utf-8") as f:
            f.writelines(json.dumps({"conversations": [{"role": "user", "content": p}]}) + "\n" for p in prompts)
        counts[name] = len(prompts)
    return counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.quality.prompt_files", description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", required=True, help="quality_gpu, quality_cpu, or a PATH.yaml")
    p.add_argument("--out", required=True, help="output directory (must be new or empty)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args(argv)

    def command() -> int:
        counts = write_prompt_files(args.recipe, Path(args.out), args.overrides)
        print(f"{counts['train']} training and {counts['heldout']} held-out prompts written to {args.out}", flush=True)
        return 0

    return run_cli(command)


if __name__ == "__main__":
    sys.exit(main())
