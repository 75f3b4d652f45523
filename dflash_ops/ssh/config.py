"""The OpenSSH client config (`~/.ssh/config`, then `/etc/ssh/ssh_config`) read the way `ssh` reads it, `Include`
included.

paramiko parses `Host`/`Match` blocks but ignores `Include`; this module follows it and hands paramiko one flat
text whose blocks mean what the split files meant. OpenSSH semantics (readconf.c, ssh_config(5)):

- `Include PATH...`: several paths per line; `~` expanded; a relative path is under `~/.ssh/`; globs expand in
  sorted order; a path that matches nothing is skipped silently; nesting deeper than 16 (READCONF_MAX_DEPTH) is
  refused, and so is a cycle (ssh only notices it at depth 16; we name the files).
- The system file is read after the user's, so for each key the user's value wins; its relative `Include`s are
  under its own directory (`/etc/ssh/`). `$DFLASH_OPS_SSH_SYSTEM_CONFIG` names another system file (empty: none).
  An explicit `path` is read alone, as `ssh -F FILE` reads it.
- An `Include` inside a `Host`/`Match` block applies only when that block matches. The included file may open
  its own `Host`/`Match` blocks: ssh evaluates them only if the enclosing block matched (else they "never match"),
  and once the file ends the enclosing block is in force again. So every block carries a GUARD, the conjunction of
  its own condition and the ones it was included under; a guard of more than one condition is written for
  paramiko as one `Match` line (`Host a b` becomes `originalhost a,b`, which is what `Host` tests).
- For each key the first value wins; `IdentityFile` accumulates (paramiko's lookup does both on the flat text).
- `ProxyJump` and `ProxyCommand` compete (ssh_config(5): the first found wins; OpenSSH 9.2's `ssh -G` shows the
  detail: a `ProxyJump none` found first still lets a later `ProxyCommand` apply). paramiko must neither expand
  their tokens (unquoted) nor lose their order, so each goes to paramiko under a private key as `<line index>:
  <raw value, hex>`; `lookup` decides from the first of each and returns at most one of them, raw (routing.py
  expands ProxyCommand tokens, quoting each value).

Not done: ssh's refusal of group/world-writable config files.
Pure apart from reading files; paramiko is imported only by `lookup` (keeps `--help` light).
"""

from __future__ import annotations

import fnmatch
import glob
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from dflash_ops.errors import ConfigError

MAX_INCLUDE_DEPTH = 16  # OpenSSH's READCONF_MAX_DEPTH
SYSTEM_CONFIG = Path("/etc/ssh/ssh_config")
SYSTEM_CONFIG_ENV = "DFLASH_OPS_SSH_SYSTEM_CONFIG"
_LINE_RE = re.compile(r"(\w+)(?:\s*=\s*|\s+)(.+)")  # `Key value` or `Key=value`, as ssh and paramiko split it
_PROXY_KEYS = {"proxyjump": "xdflashopsproxyjump", "proxycommand": "xdflashopsproxycommand"}  # in paramiko's text


@dataclass(frozen=True)
class Condition:
    """One `Host` or `Match` line: `keyword` is "host" or "match", `value` the rest of the line as written."""

    keyword: str
    value: str

    def patterns(self) -> tuple[str, ...]:
        """A `Host` line's patterns (ssh splits on whitespace, honouring quotes)."""
        return tuple(_words(self.value))


@dataclass(frozen=True)
class Section:
    """Option lines that apply when every condition of `guard` holds (outermost first; () = every host)."""

    guard: tuple[Condition, ...]
    lines: tuple[str, ...] = ()


@dataclass(frozen=True)
class SshConfig:
    """The expanded config: its blocks in file order, includes spliced in, each with its full guard."""

    sections: tuple[Section, ...] = ()
    source: str = "~/.ssh/config"

    def text(self) -> str:
        """One flat config that paramiko reads with the meaning the split files had for ssh."""
        out: list[str] = []
        for section in self.sections:
            out.append(_header(section.guard))
            for line in section.lines:
                out.append(f"  {_for_paramiko(line, len(out))}")  # len(out): this line's index, in file order
        return "\n".join(out) + "\n"

    def lookup(self, alias: str) -> dict:
        """paramiko's lookup of `alias` (keys lower-case: hostname, port, user, identityfile (a list), ...)."""
        if not self.sections:
            return {}
        import paramiko  # lazy: only when a host is really resolved

        try:
            found = dict(paramiko.SSHConfig.from_text(self.text()).lookup(alias))
        except paramiko.ssh_exception.ConfigParseError as exc:
            raise ConfigError(f"{self.source} (with its includes): {exc}") from None
        except ImportError:  # paramiko runs `Match exec` through invoke, an optional package of its own
            raise ConfigError(f"{self.source} (with its includes) has a `Match exec` block, and paramiko evaluates "
                              "it with the Python package invoke, which is not installed",
                              hint="pip install invoke, or move that host out of the Match exec block") from None
        first = {key: _decode(found.pop(private, None)) for key, private in _PROXY_KEYS.items()}
        winner = _proxy_winner(first["proxyjump"], first["proxycommand"])
        if winner is not None:
            found[winner] = first[winner][1]
        return found

    def has_alias(self, word: str) -> bool:
        """True iff some `Host` line names `word` literally (not by a wildcard, not negated) and every block it
        sits in matches `word` too. `Host *` names nothing; a `Match` around it is not evaluated (it may run
        commands): it counts as holding."""
        if any(ch in word for ch in "*?!"):  # a pattern, not a name
            return False
        for section in self.sections:
            if not section.guard or section.guard[-1].keyword != "host":
                continue
            named = section.guard[-1].patterns()
            if word in named and all(_condition_may_hold(c, word) for c in section.guard):
                return True
        return False


def read(path: Path | None = None, *, home: Path | None = None, system: Path | None = None) -> SshConfig:
    """Read `path` (default `~/.ssh/config`), then `system` (default when `path` is not given: system_config()),
    each with everything it includes. A missing file is empty. `home`: whose `~` and `~/.ssh/` resolve `Include`
    paths (default: this HOME). Bad includes raise ConfigError."""
    home = home if home is not None else Path.home()
    if path is None and system is None:
        system = system_config()
    path = path if path is not None else home / ".ssh" / "config"
    sections: list[Section] = []
    read_files = []
    for top, base in ((path, home / ".ssh"), (system, system.parent if system else None)):
        if top is not None and top.is_file():
            _read_file(top, (), (), home, base, sections)
            read_files.append(str(top))
    return SshConfig(sections=tuple(sections), source=" and ".join(read_files) or str(path))


def system_config() -> Path | None:
    """`/etc/ssh/ssh_config`, or `$DFLASH_OPS_SSH_SYSTEM_CONFIG` when set (empty: no system file)."""
    override = os.environ.get(SYSTEM_CONFIG_ENV)
    if override is None:
        return SYSTEM_CONFIG
    return Path(override) if override else None


def _read_file(path: Path, outer: tuple[Condition, ...], chain: tuple[Path, ...], home: Path, base: Path,
               out: list[Section]) -> None:
    """Append `path`'s blocks to `out`. `outer`: the guard in force at the `Include` that named `path` (it is in
    force again after the file ends); `chain`: the files including it, outermost first; `base`: where relative
    `Include` paths are (`~/.ssh` for the user's files, `/etc/ssh` for the system's)."""
    chain = (*chain, path.resolve())
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise ConfigError(f"cannot read ssh config {path}: {exc.strerror or exc}") from None
    guard = outer
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _LINE_RE.fullmatch(line)
        if m is None:
            raise ConfigError(f"{path}:{number}: unparsable ssh config line {line!r}")
        keyword, value = m.group(1).lower(), m.group(2).strip()
        if keyword in ("host", "match"):
            guard = (*outer, Condition(keyword, value))
            out.append(Section(guard))
        elif keyword == "include":
            for included in _include_paths(value, home, base, f"{path}:{number}"):
                _check_nesting(included, chain, f"{path}:{number}")
                _read_file(included, guard, chain, home, base, out)
        elif out and out[-1].guard == guard:
            out[-1] = Section(guard, (*out[-1].lines, line))
        else:
            out.append(Section(guard, (line,)))


def _include_paths(value: str, home: Path, base: Path, where: str) -> list[Path]:
    """The files one `Include` line names, in ssh's order: each argument in turn, its glob matches sorted."""
    try:
        args = shlex.split(value)
    except ValueError as exc:
        raise ConfigError(f"{where}: bad Include line: {exc}") from None
    found: list[Path] = []
    for arg in args:
        if arg == "~" or arg.startswith("~/"):
            pattern = str(home) + arg[1:]
        elif arg.startswith("~"):
            pattern = os.path.expanduser(arg)  # ~otheruser/...
        elif os.path.isabs(arg):
            pattern = arg
        else:
            pattern = str(base / arg)
        # no match is not an error for ssh; a directory reads as an empty file
        found.extend(Path(p) for p in sorted(glob.glob(pattern)) if os.path.isfile(p))
    return found


def _check_nesting(included: Path, chain: tuple[Path, ...], where: str) -> None:
    if included.resolve() in chain:
        loop = " -> ".join(str(p) for p in (*chain[chain.index(included.resolve()):], included.resolve()))
        raise ConfigError(f"{where}: ssh config Include cycle: {loop}",
                          hint="remove the Include that leads back to a file already being read")
    if len(chain) > MAX_INCLUDE_DEPTH:
        raise ConfigError(f"{where}: ssh config Includes nested more than {MAX_INCLUDE_DEPTH} deep "
                          f"(ssh refuses this too)")


def _for_paramiko(line: str, index: int) -> str:
    m = _LINE_RE.fullmatch(line)
    private = _PROXY_KEYS.get(m.group(1).lower()) if m else None
    if private is None:
        return line
    return f"{private} {index}:{m.group(2).strip().encode('utf-8').hex()}"


def _decode(value: str | None) -> tuple[int, str] | None:
    if value is None:
        return None
    index, _, raw = value.partition(":")
    return int(index), bytes.fromhex(raw).decode("utf-8")


def _proxy_winner(jump: tuple[int, str] | None, command: tuple[int, str] | None) -> str | None:
    """Which of the first ProxyJump / first ProxyCommand (line index, value) ssh uses: a ProxyCommand (even
    `none`) found first shuts ProxyJump out; a ProxyJump found first shuts ProxyCommand out unless it is `none`."""
    if jump is None or command is None:
        return "proxyjump" if jump else "proxycommand" if command else None
    if command[0] < jump[0] or jump[1].strip().lower() == "none":
        return "proxycommand"
    return "proxyjump"


def _header(guard: tuple[Condition, ...]) -> str:
    if not guard:
        return "Host *"
    if len(guard) == 1:
        return f"{guard[0].keyword.capitalize()} {guard[0].value}"
    criteria: list[str] = []
    for c in guard:
        if c.keyword == "host":
            criteria += ["originalhost", shlex.quote(",".join(c.patterns()))]
        else:  # `all` is true and may not be combined with other criteria
            criteria += [shlex.quote(w) for w in _words(c.value) if w.lower() != "all"]
    return "Match " + " ".join(criteria) if criteria else "Host *"


def _words(value: str) -> list[str]:
    try:
        return shlex.split(value)
    except ValueError:
        return value.split()


def _condition_may_hold(c: Condition, word: str) -> bool:
    """`Host` patterns as ssh tests them: some positive pattern matches and no negated one does."""
    if c.keyword != "host":
        return True
    pats = c.patterns()
    if any(p.startswith("!") and fnmatch.fnmatchcase(word, p[1:]) for p in pats):
        return False
    return any(not p.startswith("!") and fnmatch.fnmatchcase(word, p) for p in pats)

