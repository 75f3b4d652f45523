"""The README stays true to the code: every command of its fenced bash blocks parses (and every `dflash-ops`,
`python -m trainer` and `python -m bench.NAME` example of docs/*.md), and every relative link of the README and of
docs/*.md resolves.

A command parses when: `dflash-ops SUB` is a command whose `--help` exits 0 and names every option the line uses; a
`launch` names a runbook of runbooks/, and the arguments after `--` suit that runbook's trainer command (its options
exist; a `train` that is not a `--resume` carries the target and data its recipe lacks, as the trainer's own
`check_target` demands); `python3 -m trainer SUB` (also under `torch.distributed.run`) is a subcommand whose options
include every one the line uses, by the trainer's own argparse tree (a subcommand's nested subcommands count too,
so a command that gains them keeps its old spellings checked); every `--set KEY=VALUE` goes through the trainer's
config loader, which refuses an unknown key or a wrong type; `python3 -m bench.NAME --help` exits 0 and names every
option used. A few programs of other projects (pip, vLLM, SGLang) and `bash .ci/run` are named in ALLOWED and not
checked. The checks are pure functions over text; the self-tests at the end run them on synthetic pages, to show that
a missing flag, key, runbook or link is found."""
from __future__ import annotations

import argparse
import re
import shlex
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
# Programs the README may show that are not this repository's (checked by their own projects), by argv prefix.
ALLOWED = (("python3", "-m", "pip"), ("python", "-m", "pip"), ("vllm",), ("python", "-m", "sglang.launch_server"),
           ("bash", ".ci/run"))


@dataclass(frozen=True)
class Command:
    argv: tuple[str, ...]
    line: int  # 1-based line of the markdown where the command starts


def bash_commands(markdown: str) -> list[Command]:
    """The commands of every ```bash block: `\\` continuations joined, comments dropped (shlex, so a `#` inside quotes
    stays), `&&`, `||` and `;` splitting one line into several commands. Blocks may be indented (inside a list)."""
    out: list[Command] = []
    lines = markdown.splitlines()
    i = 0
    while i < len(lines):
        fence = re.match(r"^(\s*)```bash\s*$", lines[i])
        i += 1
        if not fence:
            continue
        pending, start = "", 0
        while i < len(lines) and not re.match(r"^\s*```\s*$", lines[i]):
            text = lines[i].strip()
            if not pending:
                start = i + 1
            if text.endswith("\\"):
                pending += text[:-1] + " "
            else:
                out += _split(shlex.split(pending + text, comments=True), start)
                pending = ""
            i += 1
        i += 1
    return out


def example_commands(markdown: str) -> list[Command]:
    """The `dflash-ops` and `python -m trainer` commands of a page's indented (4-space) example blocks, outside its
    fenced blocks, continuations joined; the reference pages show their examples that way."""
    out: list[Command] = []
    lines, fenced, i = markdown.splitlines(), False, 0
    while i < len(lines):
        if lines[i].lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"^ {4}(dflash-ops |python3? -m trainer )", lines[i]):
            start, text = i + 1, lines[i].strip()
            while text.endswith("\\") and i + 1 < len(lines):
                i += 1
                text = text[:-1] + " " + lines[i].strip()
            out += _split(shlex.split(text, comments=True), start)
        i += 1
    return out


def _split(tokens: list[str], line: int) -> list[Command]:
    parts, current = [], []
    for token in tokens + ["&&"]:
        if token in ("&&", "||", ";"):
            if current:
                parts.append(Command(tuple(current), line))
            current = []
        else:
            current.append(token)
    return parts


def options_used(args: tuple[str, ...] | list[str]) -> list[str]:
    """The options (`-x`, `--name`, `--name=value` -> `--name`) among args, up to a bare `--`."""
    found = []
    for arg in args:
        if arg == "--":
            break
        if arg.startswith("-") and arg != "-" and not re.fullmatch(r"-\d[\d.e+-]*", arg):
            found.append(arg.split("=", 1)[0])
    return found


# ---------------------------------------------------------------- dflash-ops

@cache
def ops_help(sub: str) -> tuple[int, str]:
    """(exit code, output) of `dflash-ops SUB --help`, in process through typer's CliRunner."""
    from typer.testing import CliRunner

    from dflash_ops.cli import app

    done = CliRunner().invoke(app, [sub, "--help"])
    return done.exit_code, done.output


@cache
def ops_valued_options(sub: str | None) -> frozenset[str]:
    """The options of `dflash-ops SUB` (of dflash-ops itself for None) that take a value (so the word after one is
    no positional argument)."""
    import typer.main

    from dflash_ops.cli import app

    root = typer.main.get_command(app)
    command = root if sub is None else root.commands[sub]
    return frozenset(o for p in command.params if p.param_type_name == "option" and not p.is_flag
                     for o in p.opts + p.secondary_opts)


def mentions(help_text: str, option: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", help_text) is not None


def runbook(name: str, runbooks: Path) -> dict | None:
    path = runbooks / f"{name}.yaml"
    return yaml.safe_load(path.read_text()) if path.is_file() else None


def ops_problems(argv: tuple[str, ...], runbooks: Path) -> list[str]:
    rest, valued = list(argv[1:]), ops_valued_options(None)
    while rest and rest[0].startswith("-"):  # the root options (--inventory FILE, --version) before the command
        rest = rest[2:] if rest[0] in valued else rest[1:]
    if not rest:
        return []
    sub, args = rest[0], rest[1:]
    code, text = ops_help(sub)
    if code != 0:
        return [f"`dflash-ops {sub} --help` exits {code}: no such command"]
    problems = [f"`dflash-ops {sub}` has no option {opt}" for opt in options_used(args) if not mentions(text, opt)]
    if sub == "launch":
        problems += launch_problems(args, runbooks)
    return problems


def launch_problems(args: list[str], runbooks: Path) -> list[str]:
    """`launch RUNBOOK [options] [-- ARGS]`: the runbook exists, and its command with ARGS appended parses."""
    valued = ops_valued_options("launch")
    positional, i = [], 0
    head = args[:args.index("--")] if "--" in args else args
    while i < len(head):
        if head[i] in valued:
            i += 2
            continue
        if not head[i].startswith("-"):
            positional.append(head[i])
        i += 1
    if not positional:
        return ["`dflash-ops launch` without a runbook"]
    book = runbook(positional[0], runbooks)
    if book is None:
        return [f"no runbook {positional[0]!r} in {runbooks.name}/"]
    extra = args[args.index("--") + 1:] if "--" in args else []
    # the placeholders launch fills in (docs/contracts.md section 1), as plain words
    argv = [str(a).replace("{python}", "python3").replace("{run_dir}", "RUN_DIR") for a in book["command"]] + extra
    if "trainer" in argv and argv[argv.index("trainer") - 1] == "-m":
        return trainer_problems(tuple(argv[argv.index("trainer") + 1:]), f"runbook {positional[0]}")
    return []


# ---------------------------------------------------------------- python -m trainer

@cache
def trainer_parser() -> argparse.ArgumentParser:
    from trainer.cli.parser import build_parser

    return build_parser()


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return {name: p for action in parser._actions if isinstance(action, argparse._SubParsersAction)
            for name, p in action.choices.items()}


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    """Every option of a parser and of its nested subcommands (a subcommand split into sub-subcommands keeps its old
    spellings accepted, so its old options still count)."""
    found = {s for action in parser._actions for s in action.option_strings}
    for child in subcommands(parser).values():
        found |= option_strings(child)
    return found


def trainer_problems(args: tuple[str, ...], where: str = "python3 -m trainer") -> list[str]:
    if not args:
        return [f"{where}: no trainer subcommand"]
    subs = subcommands(trainer_parser())
    sub = args[0]
    if sub not in subs:
        return [f"{where}: no trainer subcommand {sub!r} (there are {', '.join(subs)})"]
    known = option_strings(subs[sub])
    problems = [f"{where}: `trainer {sub}` has no option {opt}" for opt in options_used(args[1:])
                if opt not in known]
    if sub == "train" and not problems:
        problems += train_config_problems(args[1:], where)
    return problems


def train_config_problems(args: tuple[str, ...], where: str) -> list[str]:
    """The `--set` values go through the trainer's loader (unknown keys, wrong types), onto the named recipe, or onto
    `gpu` for a `--resume` (whose run's own config.json is not at hand here); a fresh start must carry a target and
    data (the trainer's check_target)."""
    from trainer import config
    from trainer.errors import ConfigError
    from trainer.targetdir import check_target

    try:
        parsed = trainer_parser().parse_args(["train", *args])
    except SystemExit:  # argparse's own refusal (a missing value), already printed on stderr
        return [f"{where}: `trainer train {shlex.join(args)}` does not parse"]
    try:
        cfg = config.load_config(parsed.recipe or "gpu", parsed.overrides)
        if not parsed.resume:
            check_target(cfg)
    except ConfigError as e:
        return [f"{where}: {e}"]
    return []


# ---------------------------------------------------------------- python -m bench.NAME

@cache
def bench_help(module: str) -> tuple[int, str]:
    """(exit code, output) of `python -m bench.NAME --help`, run from the repository root as the docs say."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=300)
    return done.returncode, done.stdout + done.stderr


def bench_problems(module: str, args: tuple[str, ...]) -> list[str]:
    code, text = bench_help(module)
    if code != 0:
        return [f"`python -m {module} --help` exits {code}"]
    return [f"`python -m {module}` has no option {opt}" for opt in options_used(args) if not mentions(text, opt)]


# ---------------------------------------------------------------- one command, and the links

def command_problems(command: Command, runbooks: Path = REPO / "runbooks") -> list[str]:
    argv = command.argv
    while argv and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=\S*", argv[0]):  # `NAME=value cmd ...`: the command
        argv = argv[1:]
    if any(argv[:len(prefix)] == prefix for prefix in ALLOWED):
        return []
    if argv[0] == "dflash-ops":
        problems = ops_problems(argv, runbooks)
    elif argv[0] in ("python3", "python") and "trainer" in argv and argv[argv.index("trainer") - 1] == "-m":
        problems = trainer_problems(argv[argv.index("trainer") + 1:])
    elif argv[0] in ("python3", "python") and argv[1:2] == ("-m",) and argv[2].startswith("bench."):
        problems = bench_problems(argv[2], argv[3:])
    else:
        problems = [f"a command this test does not know: {shlex.join(argv)} (check it, or add it to ALLOWED)"]
    return [f"line {command.line}: {p}" for p in problems]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but `-` and `_` dropped, spaces -> `-`."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    inside, found = False, set()
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            inside = not inside
        elif not inside and (m := re.match(r"^#{1,6} (.+)$", line)):
            found.add(slug(m.group(1)))
    return found


def link_problems(path: Path, markdown: str) -> list[str]:
    """Every relative `[text](target)` of a markdown file names a file (relative to the file), and its `#anchor`, if
    any, a heading of the file it names (or of itself)."""
    problems = []
    for target in re.findall(r"\]\(([^)\s]+)\)", markdown):
        if re.match(r"^[a-z]+:", target):
            continue  # https:, mailto:
        file, _, anchor = target.partition("#")
        dest = (path.parent / file) if file else path
        if not dest.is_file():
            problems.append(f"{path.name}: link {target} names no file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            problems.append(f"{path.name}: link {target}: no heading #{anchor} in {dest.name}")
    return problems


# ---------------------------------------------------------------- the real README and docs

def test_every_command_of_the_readme_parses():
    commands = bash_commands((REPO / "README.md").read_text())
    assert any(c.argv[0] == "dflash-ops" for c in commands) and any("trainer" in c.argv for c in commands)
    problems = [p for c in commands for p in command_problems(c)]
    assert not problems, "\n".join(problems)


def test_the_quick_start_commands_are_the_ones_ci_runs():
    argvs = [c.argv for c in bash_commands((REPO / "README.md").read_text())]
    assert ("python3", "-m", "pip", "install", "torch==2.13.0", "-e", ".[trainer]") in argvs
    assert ("dflash-ops", "launch", "smoke", "--follow") in argvs
    assert ("bash", ".ci/run") in argvs


def test_every_dflash_ops_trainer_and_bench_example_of_the_docs_parses():
    """The reference pages' own examples, fenced or indented: each launch carries what its runbook needs, each
    benchmark's options exist."""
    checked, problems = 0, []
    for page in sorted((REPO / "docs").glob("*.md")):
        text = page.read_text()
        for c in bash_commands(text) + example_commands(text):
            if c.argv[0] == "dflash-ops" or "trainer" in c.argv or any(a.startswith("bench.") for a in c.argv[:4]):
                checked += 1
                problems += [f"{page.name}: {p}" for p in command_problems(c)]
    assert checked >= 40 and not problems, "\n".join(problems)


def test_every_relative_link_of_the_readme_and_docs_resolves():
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    problems = [p for page in pages for p in link_problems(page, page.read_text())]
    assert not problems, "\n".join(problems)


def test_every_runbook_the_docs_name_exists():
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    named = {m for page in pages for m in re.findall(r"runbooks/([\w.-]+)\.yaml", page.read_text())}
    assert named and not {n for n in named if not (REPO / "runbooks" / f"{n}.yaml").is_file()}


# ---------------------------------------------------------------- the checks find what they look for

def problems_of(readme: str) -> list[str]:
    return [p for c in bash_commands(readme) for p in command_problems(c)]


def test_a_missing_flag_key_runbook_or_subcommand_is_found():
    good = "```bash\ndflash-ops launch smoke --follow   # a comment with --no-such-flag\n```\n"
    assert problems_of(good) == []
    [flag] = problems_of("```bash\ndflash-ops launch smoke --no-such-flag\n```\n")
    assert "has no option --no-such-flag" in flag and flag.startswith("line 2:")
    assert problems_of("```bash\ndflash-ops -i inv.yaml --runbooks rb launch smoke --follow\n```\n") == []
    [root] = problems_of("```bash\ndflash-ops --inventory inv.yaml launch nope\n```\n")
    assert "no runbook 'nope'" in root
    [cmd] = problems_of("```bash\ndflash-ops lanuch smoke\n```\n")
    assert "no such command" in cmd
    [book] = problems_of("```bash\ndflash-ops launch no-such-runbook --host pve1 --ct 200\n```\n")
    assert "no runbook 'no-such-runbook'" in book
    [key] = problems_of("   ```bash\n   python3 -m trainer train --recipe smoke --run-dir r \\\n"
                        "       --set optim.lrr=1e-4\n   ```\n")
    assert "optim.lrr" in key and "optim.lr" in key
    [opt] = problems_of("```bash\npython3 -m trainer eval --run-dir r --no-such-option\n```\n")
    assert "`trainer eval` has no option --no-such-option" in opt
    [sub] = problems_of("```bash\npython3 -m trainer trian --recipe smoke\n```\n")
    assert "no trainer subcommand 'trian'" in sub
    [bench] = problems_of("```bash\npython3 -m bench.step --shape tiny --quick\n```\n")
    assert "`python -m bench.step` has no option --quick" in bench


def test_a_launch_that_lacks_what_its_runbook_needs_is_found():
    [target] = problems_of("```bash\ndflash-ops launch graphwarm --host pve1 --ct 200\n```\n")
    assert "model.target is empty" in target
    [data] = problems_of("```bash\ndflash-ops launch graphwarm --host pve1 --ct 200 -- "
                         "--set model.target=/models/Qwen3-8B\n```\n")
    assert "data.paths is empty" in data
    [typo] = problems_of("```bash\ndflash-ops launch regenerate -- --target T --prompt p.jsonl\n```\n")
    assert "`trainer regenerate` has no option --prompt" in typo
    assert problems_of("```bash\ndflash-ops launch graphwarm -- --run-dir ../gw-1 --resume\n```\n") == []
    page = ("Text\n\n    dflash-ops launch graphwarm --host pve1 \\\n        --ct 200   # no target\n\n"
            "```bash\n    dflash-ops launch smoke\n```\n")
    [indented] = example_commands(page)            # the fenced block is bash_commands' alone
    assert indented.line == 3 and indented.argv[-1] == "200"
    assert "model.target is empty" in command_problems(indented)[0]


def test_an_unknown_program_is_reported_not_skipped():
    [unknown] = problems_of("```bash\nrm -rf runs && dflash-ops runs\n```\n")
    assert "does not know: rm -rf runs" in unknown


def test_a_broken_link_or_anchor_is_found(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "cli.md").write_text("# Reference\n\n## `launch RUNBOOK [-- ARGS...]`\n\n## Multi-node runs\n")
    page = tmp_path / "README.md"
    ok = "[a](docs/cli.md) [b](docs/cli.md#multi-node-runs) [c](docs/cli.md#launch-runbook----args) [d](https://x.y)"
    assert link_problems(page, ok) == []
    bad = link_problems(page, "[a](docs/nope.md) and [b](docs/cli.md#multinode-runs) and [c](#nothing)")
    assert len(bad) == 3 and "names no file" in bad[0] and "no heading #multinode-runs" in bad[1], bad
