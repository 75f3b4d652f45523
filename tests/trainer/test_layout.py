"""The package layout docs/architecture.md describes, checked from the code's own imports (every import statement,
module-level or inside a function, read with `ast`): no import cycle between trainer modules, nothing in the
product imports the benchmarks, and the operator CLI never imports torch."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def modules(package: str) -> dict[str, Path]:
    out = {}
    for path in sorted((REPO / package).rglob("*.py")):
        rel = path.relative_to(REPO).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        out[".".join(parts)] = path
    return out


def imported(path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of `known` (or external top-level names) that `path` imports."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in known}
    return names


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_between_trainer_modules():
    known = modules("trainer")
    # A package's own __init__ is imported by every submodule: only its explicit imports count as its edges.
    graph = {m: {n for n in imported(p, known) if n in known and n != m} for m, p in known.items()}
    graph = {m: {n for n in deps if not m.startswith(n + ".")} for m, deps in graph.items()}
    assert cycles(graph) == []


def test_the_product_never_imports_the_benchmarks():
    for package in ("trainer", "dflash_ops"):
        known = modules(package)
        offenders = {m for m, p in known.items() if any(n == "bench" or n.startswith("bench.")
                                                        for n in imported(p, known))}
        assert offenders == set(), offenders


def test_the_operator_cli_never_imports_torch():
    known = modules("dflash_ops")
    offenders = {m for m, p in known.items() if any(n == "torch" or n.startswith("torch.") or n.startswith("trainer")
                                                    for n in imported(p, known))}
    assert offenders == set(), offenders


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
