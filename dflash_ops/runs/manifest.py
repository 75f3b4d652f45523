"""PURE parts of `pull`: which files of a run dir a selection means, the script that lists them with their size and
SHA-256 (run where the run lives), the parser of its answer, and where each file lands on this machine.

Every path that comes back from the remote side is checked here before it names a local file: relative, no `..`,
no empty or control-character components, so a hostile listing cannot write outside the destination directory.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from dflash_ops import names, wire
from dflash_ops.errors import RemoteFailed
from dflash_ops.runs.shellcmd import NO_RUN_DIR, path_word, q

# what -> (path under the run dir, is a directory). `ckpt` means the newest checkpoint, `ckpt/step_<N>` with the
# largest N (the trainer writes each one to a temp dir and renames it, so a listed one is complete).
WHAT = {"export": ("export", True), "metrics": ("metrics.jsonl", False), "log": ("output.log", False),
        "ckpt": ("ckpt", True)}
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


@dataclass(frozen=True)
class RemoteFile:
    rel: str          # relative to the run dir, e.g. "export/model.safetensors"
    size: int         # bytes to fetch (a file still being appended to is fetched up to this size)
    sha256: str       # of those bytes, computed where the run lives


@dataclass(frozen=True)
class Manifest:
    root: str         # the run dir's absolute path where the run lives (inside the container for --ct)
    files: tuple[RemoteFile, ...]
    missing: bool     # the selection is not there (no export yet, no checkpoint)
    links: tuple[str, ...] = ()    # symbolic links met at or in the selection: never followed, never pulled


def manifest_script(run_dir: str, what: str) -> str:
    """Bash for the target: `DFLASH_ROOT <abs run dir>`, then `DFLASH_FILE <size> <sha256> <rel path>` for every
    regular file of the selection, or `DFLASH_NONE` when there is nothing. Symbolic links are never followed: a
    link at the selection (output.log, export/, ckpt/, a ckpt/step_N) or inside it is named in a `DFLASH_LINK`
    line instead (its control characters as `?`), and a file whose name has a newline makes the answer
    `DFLASH_BADNAME`, which refuses the whole pull."""
    sub, is_dir = WHAT[what]
    head = (f"D={path_word(run_dir)}\n" + NO_RUN_DIR +
            f'cd -- "$D" || exit {wire.EXIT_FAILED}\n'
            f"printf '{wire.ROOT} %s\\n' \"$(pwd -P)\"\n"
            "one() {\n"
            '  local size sum\n'
            '  size=$(stat -c %s -- "$1") || return 1\n'
            # the hash of exactly `size` bytes: a log that grows meanwhile is pulled up to that size
            '  sum=$(head -c "$size" -- "$1" | sha256sum) || return 1\n'
            f"  printf '{wire.FILE} %s %s %s\\n' \"$size\" \"${{sum%% *}}\" \"$1\"\n"
            "}\n"
            f"link() {{ printf '{wire.LINK} %s\\n' \"${{1//[[:cntrl:]]/?}}\"; }}\n"
            f"none() {{ echo {wire.NOTHING}; exit 0; }}\n")
    if what == "ckpt":
        pick = ('[ -L ckpt ] && { link ckpt; none; }\n'
                'best=; n=-1\n'
                'for d in ckpt/step_*; do\n'
                '  [ -L "$d" ] && { link "$d"; continue; }\n'
                '  [ -d "$d" ] || continue; k=${d##*_}\n'
                '  case $k in ""|*[!0-9]*) continue;; esac\n'
                '  [ "$k" -gt "$n" ] && { n=$k; best=$d; }\n'
                'done\n'
                '[ -n "$best" ] || none\n'
                'sel=$best\n')
    else:
        pick = f"sel={q(sub)}\n" + '[ -L "$sel" ] && { link "$sel"; none; }\n'
    if is_dir:
        walk = ('[ -d "$sel" ] || none\n'
                'found=0\n'
                'while IFS= read -r -d "" f; do\n'
                f"  case $f in *$'\\n'*) echo {wire.BAD_NAME}; exit 0;; esac\n"
                f'  one "${{f#./}}" || exit {wire.EXIT_FAILED}; found=1\n'
                'done < <(find -P "./$sel" -type f -print0 | sort -z)\n'
                'while IFS= read -r -d "" f; do link "${f#./}"; done < <(find -P "./$sel" -type l -print0 | sort -z)\n'
                '[ "$found" = 1 ] || none\n')
    else:
        walk = f'[ -f "$sel" ] || none\none "$sel" || exit {wire.EXIT_FAILED}\n'
    return head + pick + walk


def safe_rel(text: str) -> str:
    """`text` if it is a plain relative path (no `..`, `.`, empty or control-character parts), else RemoteFailed."""
    parts = text.split("/")
    if (not text or text.startswith("/") or _CONTROL.search(text)
            or any(p in ("", ".", "..") for p in parts)):
        raise RemoteFailed(f"the run's file listing names an unsafe path {text!r}; nothing was pulled")
    return str(PurePosixPath(*parts))


def parse_manifest(text: str) -> Manifest:
    root, files, missing, links = None, [], False, []
    for line in text.splitlines():
        if line.startswith(wire.ROOT + " "):
            root = line[len(wire.ROOT) + 1:]
        elif line == wire.NOTHING:
            missing = True
        elif line.startswith(wire.LINK + " "):
            links.append(_CONTROL.sub("?", line[len(wire.LINK) + 1:]))
        elif line == wire.BAD_NAME:
            raise RemoteFailed("a file of the selection has a newline in its name; nothing was pulled",
                               hint="rename it in the run dir, then pull again")
        elif line.startswith(wire.FILE + " "):
            words = line.split(" ", 3)
            if len(words) != 4 or not names.is_digits(words[1]) or not re.fullmatch(r"[0-9a-f]{64}", words[2]):
                raise RemoteFailed(f"unreadable file listing line {line[:200]!r}")
            files.append(RemoteFile(rel=safe_rel(words[3]), size=int(words[1]), sha256=words[2]))
    if root is None or not root.startswith("/"):
        raise RemoteFailed("the run's file listing did not say where the run dir is")
    return Manifest(root=root, files=tuple(files), missing=missing and not files, links=tuple(links))


def destinations(manifest: Manifest, to: Path) -> list[tuple[RemoteFile, Path]]:
    """Each file and where it lands: `to/<its path in the run dir>` (checked to stay under `to`)."""
    base = to.resolve()
    out = []
    for f in manifest.files:
        dest = (base / f.rel).resolve()
        if base not in dest.parents:
            raise RemoteFailed(f"{f.rel!r} would land outside {base}; nothing was pulled")
        out.append((f, dest))
    return out
