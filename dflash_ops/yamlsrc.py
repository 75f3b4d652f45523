"""YAML -> plain values that remember where they came from, so every config error can say file:line."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_ops.errors import ConfigError


class Node:
    """A mapping/sequence/scalar value plus its 1-based line in `path`."""

    __slots__ = ("value", "line", "path")

    def __init__(self, value: Any, line: int, path: str) -> None:
        self.value, self.line, self.path = value, line, path

    def where(self) -> str:
        return f"{self.path}:{self.line}"

    def fail(self, message: str) -> ConfigError:
        return ConfigError(f"{self.where()}: {message}")

    def plain(self) -> Any:
        if isinstance(self.value, dict):
            return {k: v.plain() for k, v in self.value.items()}
        if isinstance(self.value, list):
            return [v.plain() for v in self.value]
        return self.value


def load(path: Path) -> Node:
    """Parse `path`; malformed YAML (bad UTF-8, a control character, an alias loop) raises ConfigError with
    file:line."""
    import yaml  # lazy: keeps `--help` light

    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text (byte {data[exc.start]:#04x})") from None
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)  # its reader checks every character first
        return Node({}, 1, str(path)) if root is None else _Converter(str(path), yaml).convert(root)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else 1
        raise ConfigError(f"{path}:{line}: malformed YAML: {exc.problem or exc.context}") from None
    except yaml.reader.ReaderError as exc:  # a character YAML refuses (a control character): its index and ord
        line = text.count("\n", 0, exc.position) + 1
        raise ConfigError(f"{path}:{line}: malformed YAML: character U+{exc.character:04X} is not allowed") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: malformed YAML: {exc}") from None
    except RecursionError:  # composing and converting recurse once per level of nesting
        raise ConfigError(f"{path}: malformed YAML: nested too deeply") from None


# Values in one file once its aliases are expanded: far more than any inventory or runbook holds, and a "billion
# laughs" file (aliases of aliases, each level multiplying it) stops here instead of filling memory.
MAX_VALUES = 100_000


class _Converter:
    """Composed YAML -> Node. An alias is the very node it names (PyYAML's safe_dump writes them for shared
    values), so one inside the value it names is a loop, and expanding aliases is counted."""

    def __init__(self, path: str, yaml: Any) -> None:
        self.path, self.yaml, self.count = path, yaml, 0
        self.open: set[int] = set()   # ids of the nodes being converted (this node's ancestors)

    def convert(self, node: Any) -> Node:
        line = node.start_mark.line + 1
        self.count += 1
        if self.count > MAX_VALUES:
            raise ConfigError(f"{self.path}:{line}: more than {MAX_VALUES} values once YAML aliases are expanded")
        if id(node) in self.open:
            raise ConfigError(f"{self.path}:{line}: the value anchored here contains an alias of itself (a loop)")
        self.open.add(id(node))
        try:
            return Node(self._value(node), line, self.path)
        finally:
            self.open.discard(id(node))

    def _value(self, node: Any) -> Any:
        yaml, path = self.yaml, self.path
        if isinstance(node, yaml.MappingNode):
            out: dict[Any, Node] = {}
            for key_node, value_node in node.value:
                key = _scalar(key_node, path, yaml, "key ")
                if not isinstance(key, str) and str(key) != key_node.value:  # `yes` reads as True: a key is a name
                    raise _rewritten(key_node, key, path, "key ")
                if key in out:
                    raise ConfigError(f"{path}:{key_node.start_mark.line + 1}: duplicate key {key!r}")
                out[key] = self.convert(value_node)
            return out
        if isinstance(node, yaml.SequenceNode):
            return [self.convert(v) for v in node.value]
        return _scalar(node, path, yaml)


def _scalar(node: Any, path: str, yaml: Any, what: str = "") -> Any:
    if not isinstance(node, yaml.ScalarNode):
        raise ConfigError(f"{path}:{node.start_mark.line + 1}: expected a plain value here")
    try:
        value = yaml.SafeLoader(" ").construct_object(node)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}:{node.start_mark.line + 1}: {exc}") from None
    if type(value) is int and str(value) != node.value:
        # YAML 1.1 reads `port: 0022` as octal 18, `1_000` as 1000, `2:00` as 120: a number is meant as written
        raise _rewritten(node, value, path, what)
    return value


def _rewritten(node: Any, value: Any, path: str, what: str) -> ConfigError:
    return ConfigError(f"{path}:{node.start_mark.line + 1}: {what}{node.value!r} reads as {value!r} in YAML: quote "
                       "it, or write it as it reads")


@dataclass(frozen=True)
class Fields:
    """Typed access to a mapping Node; every failure names file:line and the field."""

    node: Node
    what: str

    @staticmethod
    def of(node: Node, what: str) -> "Fields":
        if not isinstance(node.value, dict):
            raise node.fail(f"{what} must be a mapping")
        return Fields(node, what)

    def check_keys(self, allowed: set[str]) -> None:
        for key, value in self.node.value.items():
            if key not in allowed:
                raise value.fail(f"{self.what}: unknown field {key!r} (known: {', '.join(sorted(allowed))})")

    def get(self, key: str) -> Node | None:
        found = self.node.value.get(key)
        return None if found is None or found.value is None else found

    def require(self, key: str) -> Node:
        found = self.get(key)
        if found is None:
            raise self.node.fail(f"{self.what} is missing required field {key!r}")
        return found

    def str(self, key: str, default: str | None = None, *, required: bool = False) -> str | None:
        found = self.require(key) if required else self.get(key)
        if found is None:
            return default
        if isinstance(found.value, bool) or not isinstance(found.value, (str, int, float)):
            raise found.fail(f"{self.what}: {key!r} must be a string")
        return str(found.value)

    def bool(self, key: str, default: bool = False) -> bool:
        found = self.get(key)
        if found is None:
            return default
        if not isinstance(found.value, bool):
            raise found.fail(f"{self.what}: {key!r} must be true or false")
        return found.value

    def number(self, key: str, default: float | None = None, *, positive: bool = False,
               most: float | None = None) -> float | None:
        """A finite number >= 0 (> 0 with `positive`, <= `most`): `.inf` and `.nan` are YAML floats too."""
        found = self.get(key)
        if found is None:
            return default
        value = found.value
        ok = not isinstance(value, bool) and isinstance(value, (int, float))
        try:
            value = float(value) if ok else math.nan
        except OverflowError:  # an int too large for a float
            value = math.inf
        if not (math.isfinite(value) and (value > 0 if positive else value >= 0) and (most is None or value <= most)):
            bound = f" up to {most:g}" if most is not None else ""
            raise found.fail(f"{self.what}: {key!r} must be a {'positive' if positive else 'non-negative'} "
                             f"number{bound}")
        return value

    def str_map(self, key: str) -> tuple[tuple[str, str], ...]:
        from dflash_ops.names import ENV_KEY_RE

        found = self.get(key)
        if found is None:
            return ()
        if not isinstance(found.value, dict):
            raise found.fail(f"{self.what}: {key!r} must be a mapping of NAME: value")
        pairs = []
        for k, v in found.value.items():
            if not isinstance(k, str) or not ENV_KEY_RE.fullmatch(k):
                raise v.fail(f"{self.what}: invalid variable name {k!r} in {key!r}")
            if v.value is None or isinstance(v.value, (dict, list, bool)):
                raise v.fail(f"{self.what}: {key}.{k} must be a string (quote it, e.g. \"1\")")
            pairs.append((k, _text(v.value)))
        return tuple(pairs)

    def str_list(self, key: str, *, required: bool = False) -> tuple[str, ...]:
        found = self.require(key) if required else self.get(key)
        if found is None:
            return ()
        if not isinstance(found.value, list):
            raise found.fail(f"{self.what}: {key!r} must be a list")
        for item in found.value:
            if item.value is None or isinstance(item.value, (dict, list, bool)):
                raise item.fail(f"{self.what}: every item of {key!r} must be a string (quote yes/no/true/false)")
        return tuple(_text(item.value) for item in found.value)


def _text(value: Any) -> str:
    """Numbers become their YAML spelling; booleans were refused before (yes/on/true are ambiguous)."""
    return str(value)
