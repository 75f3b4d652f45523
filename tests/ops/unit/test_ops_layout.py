"""The operator CLI's layout as docs/architecture.md draws it, checked from the code's own imports (every import
statement, module-level or inside a function, read with `ast`): its modules sit in layers, each importing only
its own layer and those below; no import cycle between them; the packages' `__init__` modules import nothing, so
importing a module never drags in a higher one; and nothing imports torch or the trainer."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

# Bottom first. A module is placed by its longest listed prefix ("cli" covers every command module).
LAYERS = (
    # values and vocabulary: frozen dataclasses, names, the wire protocol, the parsers of the trainer's lines
    ("errors", "names", "spec", "wire", "multinode.record", "yamlsrc", "metrics_line", "logview"),
    # pure builders of what is sent and parsers of what comes back, and the configuration they are built from
    ("runs.shellcmd", "runs.parse", "runs.pull", "runs.runbooks", "gpus.facts", "gpus.scripts", "ssh.config",
     "ssh.routing", "inventory", "multinode.rendezvous", "multinode.state"),
    # effects: SSH and local processes, threads over many hosts, the multi-node records on this machine
    ("ssh.transport", "fanout", "multinode.recordfile"),
    # use cases: they return values and raise OpsError
    ("runs.lifecycle", "hoststatus", "gpus.reset", "multinode.fan", "multinode.plan", "multinode.launch",
     "multinode.watch"),
    # the commands and their views (one error boundary: cli/_common.py)
    ("cli", "__main__"),
)
EMPTY_PACKAGES = ("dflash_ops", "dflash_ops.runs", "dflash_ops.ssh", "dflash_ops.gpus", "dflash_ops.multinode")


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted((REPO / "dflash_ops").rglob("*.py")):
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


def graph() -> dict[str, set[str]]:
    """module -> the dflash_ops modules it imports (a package's own `__init__` is no edge of its submodules)."""
    known = modules()
    edges = {m: {n for n in imported(p, known) if n in known and n != m} for m, p in known.items()}
    return {m: {n for n in deps if not m.startswith(n + ".")} for m, deps in edges.items()}


def layer(module: str) -> int | None:
    short = module.removeprefix("dflash_ops.")
    best = None
    for i, members in enumerate(LAYERS):
        for prefix in members:
            if (short == prefix or short.startswith(prefix + ".")) and (best is None or len(prefix) > best[1]):
                best = (i, len(prefix))
    return None if best is None else best[0]


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g[v]:
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

    for v in g:
        if v not in index:
            visit(v)
    return found


def test_every_module_has_a_layer():
    unplaced = [m for m in modules() if m not in EMPTY_PACKAGES and layer(m) is None]
    assert unplaced == [], f"place these in LAYERS (and in docs/architecture.md's picture): {unplaced}"


def test_no_module_imports_a_higher_layer():
    upward = sorted(f"{m} (layer {layer(m)}) imports {n} (layer {layer(n)})"
                    for m, deps in graph().items() if m not in EMPTY_PACKAGES
                    for n in deps if n not in EMPTY_PACKAGES and layer(n) > layer(m))
    assert upward == []


def test_no_import_cycle_between_its_modules():
    assert cycles(graph()) == []


def test_the_packages_init_modules_import_nothing():
    known = modules()
    busy = {p: sorted(imported(known[p], known) - {"__future__"}) for p in EMPTY_PACKAGES}
    assert {p: deps for p, deps in busy.items() if deps} == {}


def test_it_never_imports_torch_or_the_trainer():
    known = modules()
    offenders = {m for m, p in known.items() if any(n.split(".")[0] in ("torch", "trainer", "bench")
                                                    for n in imported(p, known))}
    assert offenders == set(), offenders


def test_the_checks_find_what_they_look_for():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert layer("dflash_ops.cli.status_view") == len(LAYERS) - 1 and layer("dflash_ops.spec") == 0
    assert layer("dflash_ops.multinode.record") == 0 and layer("dflash_ops.multinode.launch") == 3
