"""PURE text layout shared by the views (`status`, `runs`): lines of cells that fit a width without cutting a value.

A line is a list of cells ("pid 42", "up 1h02m"); `wrap` breaks lines between cells only, so a value is never
cut, folded or replaced by "…" (ids are copied into other commands). `columns` lays rows out as a table when its
columns fit the width, and falls back to `wrap`ped rows when they do not. Rich is imported only by `as_text`.
"""
from __future__ import annotations

from collections.abc import Sequence

Cell = tuple[str, str]                       # (text, rich style)
Line = tuple[int, list[Cell]]                # (indent, cells)
GAP = "  "


def wrap(cells: list[Cell], width: int, indent: int, hang: int) -> list[Line]:
    """`cells` as lines of at most `width` columns, first at `indent`, continuations at `hang`, broken only
    between cells (a cell wider than the line gets a line of its own)."""
    lines: list[Line] = [(indent, [])]
    used = indent
    for cell in cells:
        pad, row = lines[-1]
        need = len(cell[0]) + (len(GAP) if row else 0)
        if row and used + need > width:
            lines.append((hang, [cell]))
            used = hang + len(cell[0])
            continue
        row.append(cell)
        used += need
    return lines


def columns(header: Sequence[str], rows: Sequence[Sequence[Cell]], width: int, *, indent: int = 2,
            labels: Sequence[str] | None = None) -> list[Line]:
    """`rows` under `header`, each column as wide as its widest value, when that fits in `width`; else every row
    on its own wrapped lines (continuations 4 deeper), each value but the first after its label (`labels`, default
    the header's words: `pid 4242`), and no header. Nothing is ever cut."""
    widths = [max(len(c) for c in col) for col in zip(header, *([c for c, _ in row] for row in rows))]
    if indent + sum(widths) + len(GAP) * (len(widths) - 1) <= width:
        def padded(cells: Sequence[Cell]) -> list[Cell]:
            last = len(cells) - 1
            return [(text if i == last else text.ljust(w), style) for i, ((text, style), w) in
                    enumerate(zip(cells, widths))]

        return [(indent, padded([(h, "bold") for h in header]))] + [(indent, padded(row)) for row in rows]
    named = labels if labels is not None else header
    out: list[Line] = []
    for row in rows:
        cells = [row[0]] + [((f"{name} {text}" if name else text), style)
                            for name, (text, style) in zip(named[1:], row[1:])]
        out += wrap(cells, width, indent, indent + 4)
    return out


STATE_COLORS = {"running": "green", "exited": "cyan", "stopped": "cyan", "killed": "yellow", "lost": "red"}


def state_style(state: str, exit_code: int | None) -> str:
    """A run state's colour: a non-zero exit is red, whatever its state's colour."""
    return "red" if state == "exited" and exit_code else STATE_COLORS.get(state, "")


def as_text(lines: list[Line]):
    """The lines as one Rich Text (plain text: a value read from a host is never taken for markup)."""
    from rich.text import Text

    text = Text()
    for pad, cells in lines:
        text.append(" " * pad)
        for i, (cell, style) in enumerate(cells):
            text.append(GAP if i else "")
            text.append(cell, style=style or None)
        text.append("\n")
    text.rstrip()
    return text
