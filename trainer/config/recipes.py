"""Where config trees come from: a bundled recipe NAME (trainer/recipes/NAME.yaml) or a PATH.yaml, parsed into a raw
mapping, and what kind of recipe it is (a trainer recipe, or a quality-pipeline recipe that nests a whole TrainCfg).
Pure but for reading the recipe files.
"""
from __future__ import annotations

import dataclasses
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from trainer.config.schema import TrainCfg
from trainer.errors import ConfigError


def recipe_text(recipe: str) -> tuple[str, str]:
    """Return (source, yaml text) for a bundled recipe NAME or a PATH.yaml."""
    if recipe.endswith((".yaml", ".yml")) or "/" in recipe:
        path = Path(recipe)
        if path.is_dir():
            raise ConfigError(f"recipe {recipe} is a folder, not a recipe file",
                              hint="pass a bundled recipe NAME or the path of a .yaml file")
        if not path.is_file():
            raise ConfigError(f"recipe file not found: {recipe}")
        try:
            return str(path), path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"recipe {recipe} is not UTF-8 text (byte {e.start + 1}: {e.reason})",
                              hint="save the recipe as UTF-8") from None
        except OSError as e:
            raise ConfigError(f"cannot read recipe {recipe}: {e.strerror or e}") from None
    res = resources.files("trainer") / "recipes" / f"{recipe}.yaml"
    if not res.is_file():
        names = sorted(p.name[:-5] for p in (resources.files("trainer") / "recipes").iterdir() if p.name.endswith(".yaml"))
        raise ConfigError(f"unknown recipe {recipe!r}; bundled recipes: {', '.join(names)} (or pass a PATH.yaml)")
    return f"bundled:{recipe}", res.read_text()


def recipe_tree(recipe: str) -> tuple[str, dict[str, Any]]:
    """(source, parsed mapping) of a bundled recipe NAME or a PATH.yaml."""
    source, text = recipe_text(recipe)
    try:
        tree = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"recipe {source} is not valid YAML: {yaml_problem(e)}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"recipe {source} must be a mapping of sections")
    return source, tree


def yaml_problem(e: yaml.YAMLError) -> str:
    """A YAML error in one line: its problem and where (PyYAML's own message spans five, with a caret under a copy
    of the text). Pure."""
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    mark = getattr(e, "problem_mark", None)
    return f"{problem} (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else problem


# A recipe with this section is a quality-pipeline recipe: trainer/quality/config.py nests a whole TrainCfg under it.
PIPELINE_SECTION = "drafter"
PIPELINE_COMMAND = "python -m trainer.quality.pipeline"


def recipe_kind(tree: dict[str, Any]) -> str:
    """Pure: "train" (every top-level key is a TrainCfg field), "pipeline" (it has the pipeline's `drafter` section),
    or "unknown"."""
    if PIPELINE_SECTION in tree:
        return "pipeline"
    names = {f.name for f in dataclasses.fields(TrainCfg)}
    return "train" if set(tree) <= names else "unknown"


def bundled_recipes() -> dict[str, str]:
    """Every bundled recipe name -> its `recipe_kind` (a recipe that does not parse counts as "unknown")."""
    out = {}
    for res in sorted((resources.files("trainer") / "recipes").iterdir(), key=lambda r: r.name):
        if not res.name.endswith(".yaml"):
            continue
        try:
            tree = yaml.safe_load(res.read_text()) or {}
        except yaml.YAMLError:
            tree = None
        out[res.name[:-5]] = recipe_kind(tree) if isinstance(tree, dict) else "unknown"
    return out


def pipeline_recipe_error(recipe: str) -> ConfigError:
    return ConfigError(f"{recipe} is a quality-pipeline recipe, not a trainer recipe: run "
                       f"{PIPELINE_COMMAND} --recipe {recipe} --out DIR")
