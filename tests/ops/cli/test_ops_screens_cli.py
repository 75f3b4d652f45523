"""Small things a new user reads first: the dry run's one-line summary, `launch --help`'s example, the exit codes
of docs/cli.md."""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from dflash_ops import errors
from dflash_ops.cli.render import argv_summary

REPO = Path(__file__).resolve().parents[3]


def test_the_dry_run_summary_never_cuts_a_token(ops_env):
    # 40 tokens of 9 characters: the 120-character budget ends inside one of them
    args = [f"--a{i:02d}=xyz" for i in range(40)]
    done = ops_env.cli("launch", "job", "--dry-run", "--", *args)
    assert done.exit_code == 0, done.output
    [summary] = [line for line in done.stderr.splitlines() if line.startswith("# dry run: would launch ")]
    inner = summary.split(" (", 1)[1].rsplit("); nothing was run", 1)[0]
    assert inner.endswith(" …") and len(inner) <= 122, summary
    shown = shlex.split(inner[:-2])
    argv = json.loads(ops_env.cli("launch", "job", "--dry-run", "--json", "--", *args).stdout)["argv"]
    assert 0 < len(shown) < len(argv) and shown == argv[:len(shown)]   # whole tokens, the last one too


def test_argv_summary_keeps_whole_tokens_and_quotes_them():
    assert argv_summary(["python3", "-m", "trainer"]) == "python3 -m trainer"
    assert argv_summary(["a", "it's", "b"], limit=13) == "a 'it'\"'\"'s' …"
    assert argv_summary(["a", "it's here", "b"], limit=12) == "a …"
    assert argv_summary(["x" * 200, "y"], limit=10) == "x" * 200 + " …"


def test_the_launch_help_example_is_accepted_by_the_trainer(ops_env):
    from trainer import config

    done = ops_env.cli("launch", "--help")
    example = " ".join(done.stdout.split()).split("Example:", 1)[1].split("Two nodes:", 1)[0]
    words = shlex.split(example)  # as the user's shell reads the pasted example
    sets = [words[i + 1] for i, word in enumerate(words[:-1]) if word == "--set"]
    assert sets, example
    recipe = next(a for a in Path(REPO / "runbooks" / "graphwarm.yaml").read_text().split('"') if a in ("gpu",))
    cfg = config.load_config(recipe, sets)           # raises ConfigError on an unknown key (as the trainer would)
    key, value = sets[0].split("=", 1)
    section, leaf = key.split(".")
    assert str(getattr(getattr(cfg, section), leaf)) == value


def test_the_cli_reference_lists_every_exit_code_the_cli_can_end_with():
    text = (REPO / "docs" / "cli.md").read_text()
    section = text.split("\n## Exit codes\n", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| (\d+) \| (.+) \|$", section, re.MULTILINE))
    codes = {c.exit_code for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.OpsError)}
    for code in sorted(codes | {0, 130, 141}):
        assert str(code) in rows, f"docs/cli.md's exit codes leave out {code}: {sorted(rows)}"
    assert re.search(r"unexpected|failed", rows["1"]), rows["1"]
