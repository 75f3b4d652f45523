"""Building a config from what a user wrote: a raw tree (a recipe's YAML, a run's config.json) and `--set a.b=v`
overrides -> a validated config dataclass (trainer/config/schema.py), checked key by key against the dataclass tree:
an unknown key or section is one ConfigError listing the valid ones (and the near one, for a typo). `from_tree` is the
one parser; `load_config` / `load_resumed_config` are the trainer's entry points, trainer/quality/config.py's
`load_recipe` the quality pipeline's. Pure but for reading the recipe or config.json.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import os
import types
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypeVar

import yaml

from trainer.config.recipes import pipeline_recipe_error, recipe_kind, recipe_tree, yaml_problem
from trainer.config.schema import TrainCfg
from trainer.errors import ConfigError

T = TypeVar("T")


def near(name: str, valid: Iterable[str], prefix: str = "") -> str:
    """' (did you mean 'PREFIXkey'?)' for the valid name closest to a mistyped `name` (difflib), or ''. Pure."""
    match = difflib.get_close_matches(name, list(valid), n=1)
    return f" (did you mean {prefix + match[0]!r}?)" if match else ""


def _resolved_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(value: Any, hint: Any, key: str) -> Any:
    """Type-check one leaf against its annotation; lists become tuples. Raises ConfigError naming the key."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{key}: bad value {value!r}")
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        args = typing.get_args(hint)
        item = args[0]
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(v, item, key) for v in value)
        if len(value) != len(args):
            raise ConfigError(f"{key} must have {len(args)} items, got {value!r}")
        return tuple(_coerce(v, a, key) for v, a in zip(value, args))
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-4" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported type {hint!r}")


def from_dict(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """Build a config dataclass from nested dicts, rejecting unknown keys with the list of valid ones."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix[:-1] or 'config'} must be a mapping, got {data!r}")
    hints = _resolved_hints(cls)
    valid = [f.name for f in dataclasses.fields(cls)]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in valid:
            raise ConfigError(f"unknown config key {path!r}{near(key, valid, prefix)}; valid keys here: "
                              f"{', '.join(valid)}")
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            kwargs[key] = from_dict(hint, value, prefix=f"{path}.")
        else:
            kwargs[key] = _coerce(value, hint, path)
    return cls(**kwargs)


def to_dict(cfg: Any) -> dict[str, Any]:
    """JSON-ready dict (tuples become lists)."""
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def set_override(tree: dict[str, Any], dotted: str, raw: str, root: type) -> None:
    """Apply one `--set a.b=v` to a raw config tree, checking the path against the dataclass tree under `root`
    (unknown sections and keys are refused with the valid ones). The value is parsed as YAML; types are checked
    later, by `from_dict`."""
    node = tree
    parts = dotted.split(".")
    cls: type = root
    for depth, part in enumerate(parts[:-1]):
        fields = {f.name: f for f in dataclasses.fields(cls)}
        hint = _resolved_hints(cls).get(part)
        if part not in fields or not dataclasses.is_dataclass(hint):
            path = ".".join(parts[:depth + 1])
            if part in fields:
                raise ConfigError(f"--set {dotted}: {path!r} is a value, not a section; set it with --set {path}=...")
            sections = [f.name for f in dataclasses.fields(cls) if dataclasses.is_dataclass(_resolved_hints(cls)[f.name])]
            if sections:
                raise ConfigError(f"unknown config section {part!r} in --set {dotted}{near(part, sections)}; "
                                  f"valid sections: {', '.join(sections)}")
            raise ConfigError(f"unknown config key {path!r} in --set {dotted}; {'.'.join(parts[:depth])} has no "
                              f"sections; valid keys here: {', '.join(fields)}")
        if not isinstance(node.get(part, {}), dict):
            raise ConfigError(f"--set {dotted}: {part!r} is not a mapping in this recipe")
        node = node.setdefault(part, {})
        cls = hint
    leaf, section = parts[-1], "".join(f"{part}." for part in parts[:-1])
    valid = [f.name for f in dataclasses.fields(cls)]
    if leaf not in valid:
        raise ConfigError(f"unknown config key {dotted!r}{near(leaf, valid, section)}; valid keys here: "
                          f"{', '.join(valid)}")
    if dataclasses.is_dataclass(_resolved_hints(cls)[leaf]):
        raise ConfigError(f"--set {dotted}: {leaf!r} is a section; set one of its keys, e.g. {dotted}.<key>=...")
    try:
        node[leaf] = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {dotted}: cannot parse value {raw!r} as YAML: {yaml_problem(e)}") from None


def parse_overrides(items: list[str]) -> list[tuple[str, str]]:
    out = []
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set expects key=value (e.g. --set optim.lr=3e-4), got {item!r}")
        key, raw = item.split("=", 1)
        out.append((key.strip(), raw))
    return out


def apply_overrides(tree: dict[str, Any], items: list[str], root: type) -> dict[str, Any]:
    """`--set` items on a raw tree whose schema is the dataclass `root` (in place; returns the tree)."""
    for key, raw in parse_overrides(list(items)):
        set_override(tree, key, raw, root)
    return tree


def from_tree(root: type[T], tree: dict[str, Any], overrides: Iterable[str] = ()) -> T:
    """A raw config tree (a recipe's, a run's config.json) with the `--set` overrides on top -> the validated config
    of the dataclass `root`: the one parser of every config this trainer reads."""
    return from_dict(root, apply_overrides(tree, list(overrides), root))


def load_config(recipe: str, overrides: list[str] = ()) -> TrainCfg:
    """Recipe (bundled name or YAML path) + `a.b=v` overrides -> validated TrainCfg. A quality-pipeline recipe is
    refused in one line that names the pipeline's command."""
    _source, tree = recipe_tree(recipe)
    if recipe_kind(tree) == "pipeline":
        raise pipeline_recipe_error(recipe)
    return with_home_expanded(from_tree(TrainCfg, tree, overrides))


def load_resumed_config(config_json: Path, overrides: list[str] = ()) -> TrainCfg:
    """A resumed run's config: the config.json it started with, and the `--set` overrides on top (which may change
    only rundir.RESUME_MAY_CHANGE, and rundir.RESUME_MAY_MOVE to where the same files moved: the resume check refuses
    any other difference). So `--resume` needs no --set."""
    try:
        tree = json.loads(Path(config_json).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"--resume: cannot read {config_json} ({type(e).__name__})",
                          hint="resume a run directory that this trainer wrote") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"--resume: {config_json} is not a JSON object")
    return with_home_expanded(from_tree(TrainCfg, tree, overrides))


def user_path(path: str) -> str:
    """`~` and `~user` at the start of a path, expanded as a shell would: in `--set model.target=~/m` or
    `--out=~/x.jsonl` the shell leaves it alone. Pure but for the home directory."""
    return os.path.expanduser(path) if path.startswith("~") else path


def with_home_expanded(cfg: TrainCfg) -> TrainCfg:
    """The path settings (model.target, data.paths, data.eval_paths) through `user_path`."""
    m, d = cfg.model, cfg.data
    return dataclasses.replace(
        cfg, model=dataclasses.replace(m, target=user_path(m.target)),
        data=dataclasses.replace(d, paths=tuple(map(user_path, d.paths)),
                                 eval_paths=tuple(map(user_path, d.eval_paths))))


