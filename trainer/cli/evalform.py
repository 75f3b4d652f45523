"""`trainer eval`'s three forms, and the flags each takes: pure, before torch.

    eval run     --run-dir D                                   simulated tau on the run's held-out split
    eval export  --drafter EXPORT --target T --data F          simulated tau on a training-format JSONL
    eval prompts --drafter EXPORT --target T --prompts FILE... real batch-1 decoding of prompt files

The form-less spellings (`eval --run-dir D`, `eval --drafter E --target T --data F`, `eval --drafter E --target T
--prompts FILE...`) name the same forms: `legacy_form` infers which from the flags. Every form's parser accepts every
eval flag (parser.py), so that one given to the wrong form is refused here, in one line naming the form it belongs
to, rather than dropped or answered with argparse's usage.
"""
from __future__ import annotations

from dataclasses import dataclass

from trainer.errors import ConfigError

FORMS = ("run", "export", "prompts")
PROMPT_DEFAULTS = {"limit": 64, "max_new": 256, "engine": "static", "target_dtype": "auto"}
# Every eval flag -> its argparse dest, and the form it belongs to (--drafter and --target: export and prompts).
FLAGS = {"--run-dir": "run_dir", "--drafter": "drafter", "--target": "target", "--data": "data",
         "--max-bad-fraction": "max_bad_fraction", "--prompts": "prompts", "--limit": "limit", "--max-new": "max_new",
         "--engine": "engine", "--target-dtype": "target_dtype"}
OWNER = {"--run-dir": "run", "--data": "export", "--max-bad-fraction": "export", "--prompts": "prompts",
         "--limit": "prompts", "--max-new": "prompts", "--engine": "prompts", "--target-dtype": "prompts"}
REQUIRED = {"run": ("--run-dir",), "export": ("--drafter", "--target", "--data"),
            "prompts": ("--drafter", "--target", "--prompts")}
PAIR = ("--drafter", "--target")


@dataclass(frozen=True)
class Spelling:
    """How the messages name the forms: `name` (after `eval `), `usage` (a whole command after `eval `) and
    `export_hint` (how eval run's refusal of --drafter / --target points at the export form)."""

    name: dict[str, str]
    usage: dict[str, str]
    export_hint: str


NEW = Spelling(name={f: f for f in FORMS},
               usage={"run": "run --run-dir D", "export": "export --drafter EXPORT_DIR --target T --data F",
                      "prompts": "prompts --drafter EXPORT_DIR --target T --prompts FILE..."},
               export_hint="eval export --drafter EXPORT_DIR --target T --data F")
LEGACY = Spelling(name={"run": "--run-dir", "export": "--data", "prompts": "--prompts"},
                  usage={"run": "--run-dir D", "export": "--drafter EXPORT_DIR --target T --data F",
                         "prompts": "--drafter EXPORT_DIR --target T --prompts FILE..."},
                  export_hint="--drafter EXPORT_DIR --target T --data F")
LEGACY_USAGE = "eval needs --run-dir D, or --drafter EXPORT_DIR --target T with --data F or --prompts FILE..."


@dataclass(frozen=True)
class EvalRequest:
    """One checked eval: its form and the flags it uses, the prompt form's defaults applied. `max_bad_fraction` is
    None unless given (the export form's checks apply the training data's default)."""

    form: str
    run_dir: str | None = None  # paths as given (`~` expanded: config.user_path)
    drafter: str | None = None
    target: str | None = None
    data: str | None = None
    max_bad_fraction: float | None = None
    prompts: tuple[str, ...] = ()
    limit: int = PROMPT_DEFAULTS["limit"]
    max_new: int = PROMPT_DEFAULTS["max_new"]
    engine: str = PROMPT_DEFAULTS["engine"]
    target_dtype: str = PROMPT_DEFAULTS["target_dtype"]


def given_flags(args) -> dict[str, object]:
    """The eval flags the user gave (parser.py leaves the others unset), in FLAGS' order."""
    return {flag: getattr(args, dest) for flag, dest in FLAGS.items() if getattr(args, dest, None) is not None}


def legacy_form(given: dict[str, object]) -> str:
    """The form a form-less `eval` asks for, by its one form flag (--run-dir, --data or --prompts); a bare `eval` is
    told the forms."""
    if not given:
        raise ConfigError(f"eval needs a form: {' | '.join('eval ' + NEW.usage[f] for f in FORMS)}",
                          hint="python -m trainer eval FORM --help lists a form's flags")
    forms = [f for f in FORMS if LEGACY.name[f] in given]
    if not forms:
        raise ConfigError(LEGACY_USAGE)
    if len(forms) > 1:
        raise ConfigError(f"eval takes one of --run-dir, --data and --prompts, not "
                          f"{' and '.join(LEGACY.name[f] for f in forms)} together: {LEGACY_USAGE}")
    return forms[0]


def check_eval(form: str, given: dict[str, object], spelling: Spelling = NEW) -> EvalRequest:
    """The flags of one form, or one ConfigError naming the form a misplaced flag belongs to (a flag dropped
    silently would run an eval the user did not ask for), a missing flag, or a value out of range."""
    name, usage = spelling.name, spelling.usage
    for owner in ("prompts", "export", "run"):
        foreign = [f for f in given if OWNER.get(f) == owner and owner != form]
        if foreign:
            verb = "applies" if len(foreign) == 1 else "apply"
            raise ConfigError(f"{', '.join(foreign)} {verb} only to eval {name[owner]}, not to eval {name[form]}")
    fraction = given.get("--max-bad-fraction")
    if fraction is not None and not 0.0 <= fraction <= 1.0:
        raise ConfigError(f"--max-bad-fraction must be in [0, 1], got {fraction}")
    pair = [f for f in PAIR if f in given]
    if form == "run" and pair:
        raise ConfigError(f"eval {name['run']} evaluates the run's own export against the run's own target: drop "
                          f"{' and '.join(pair)}, or evaluate an export with {spelling.export_hint}")
    missing = [f for f in REQUIRED[form] if f not in given]
    if missing:
        raise ConfigError(f"eval {name[form]} needs {' and '.join(missing)}: eval {usage[form]}")
    if "--limit" in given and given["--limit"] < 1:
        raise ConfigError(f"--limit must be >= 1, got {given['--limit']}")
    # The target's first new token comes from the prompt's forward alone: with one, no block is drafted or measured.
    if "--max-new" in given and given["--max-new"] < 2:
        raise ConfigError(f"--max-new must be >= 2 (the first new token is the target's alone: one drafts nothing "
                          f"to measure), got {given['--max-new']}")
    values = {FLAGS[f]: v for f, v in given.items()}
    if "prompts" in values:
        values["prompts"] = tuple(values["prompts"])
    return EvalRequest(form=form, **values)


def eval_request(args) -> EvalRequest:
    """The parsed `eval` command line -> its EvalRequest: `args.form` where a form was named, else the form its
    flags name (the form-less spelling, whose messages keep its own words)."""
    given = given_flags(args)
    if args.form is not None:
        return check_eval(args.form, given, NEW)
    return check_eval(legacy_form(given), given, LEGACY)
