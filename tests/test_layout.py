"""The package layout docs/architecture.md describes, checked from the code's own imports (every import statement,
module-level or inside a function, read with `ast`): no import cycle between the trainer's and the benchmarks'
modules, nothing in the product imports the benchmarks, the benchmarks import no test code, and the operator CLI never
imports torch or the trainer. The operator CLI's modules sit in layers, each importing only its own layer and those
below, with no cycle between them, and its packages' `__init__` modules import nothing (importing a module never
drags in a higher one). Two tests show that the checks find what they look for: an import loop built on disk, and
a synthetic graph and layering."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def modules(package: str, root: Path = REPO) -> dict[str, Path]:
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        rel = path.relative_to(root).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        out[".".join(parts)] = path
    return out


def imported(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of `known` (or external top-level names) that `module` (at `path`) imports."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the importing module's package, `level - 1` packages up
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            if base:
                names.add(base)
            names |= {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known}
    return names


def import_graph(packages: tuple[str, ...], root: Path = REPO) -> dict[str, set[str]]:
    """module -> the modules of `packages` it imports. A package's own __init__ is imported by every submodule: only
    its explicit imports count as its edges."""
    known = {m: p for package in packages for m, p in modules(package, root).items()}
    graph = {m: {n for n in imported(m, p, known) if n in known and n != m} for m, p in known.items()}
    return {m: {n for n in deps if not m.startswith(n + ".")} for m, deps in graph.items()}


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


def external_imports(package: str) -> dict[str, set[str]]:
    known = modules(package)
    return {m: imported(m, p, known) for m, p in known.items()}


def test_no_import_cycle_between_trainer_and_bench_modules():
    assert cycles(import_graph(("trainer", "bench"))) == []


def test_the_product_never_imports_the_benchmarks():
    for package in ("trainer", "dflash_ops"):
        offenders = {m for m, names in external_imports(package).items()
                     if any(n == "bench" or n.startswith("bench.") for n in names)}
        assert offenders == set(), offenders


def test_the_benchmarks_import_no_test_code():
    offenders = {m for m, names in external_imports("bench").items()
                 if any(n == "tests" or n.startswith("tests.") for n in names)}
    assert offenders == set(), offenders


def test_the_operator_cli_never_imports_torch():
    offenders = {m for m, names in external_imports("dflash_ops").items()
                 if any(n == "torch" or n.startswith("torch.") or n.startswith("trainer") for n in names)}
    assert offenders == set(), offenders


# The operator CLI's layers, bottom first. A module is placed by its longest listed prefix ("cli" covers every
# command module).
OPS_LAYERS = (
    # values and vocabulary: frozen dataclasses, names, the wire protocol, the parsers of the trainer's lines
    ("errors", "names", "spec", "wire", "multinode.record", "yamlsrc", "metrics_line", "logview"),
    # pure builders of what is sent and parsers of what comes back, and the configuration they are built from
    ("runs.shellcmd", "runs.launch_scripts", "runs.stop_scripts", "runs.read_scripts", "runs.parse",
     "runs.manifest", "runs.prune", "runs.runbooks", "gpus.facts", "gpus.scripts", "ssh.config",
     "ssh.routing", "inventory", "multinode.rendezvous", "multinode.state"),
    # effects: SSH and local processes, threads over many hosts, the multi-node records on this machine
    ("ssh.transport", "fanout", "multinode.recordfile"),
    # use cases: they return values and raise OpsError
    ("runs.lifecycle", "runs.follow", "runs.pull", "hoststatus", "gpus.reset", "multinode.fan", "multinode.plan",
     "multinode.launch", "multinode.watch"),
    # the commands and their views (one error boundary: cli/_common.py)
    ("cli", "__main__"),
)
OPS_EMPTY_PACKAGES = ("dflash_ops", "dflash_ops.runs", "dflash_ops.ssh", "dflash_ops.gpus", "dflash_ops.multinode")


def ops_layer(module: str) -> int | None:
    short = module.removeprefix("dflash_ops.")
    best = None
    for i, members in enumerate(OPS_LAYERS):
        for prefix in members:
            if (short == prefix or short.startswith(prefix + ".")) and (best is None or len(prefix) > best[1]):
                best = (i, len(prefix))
    return None if best is None else best[0]


def test_every_operator_cli_module_has_a_layer():
    unplaced = [m for m in modules("dflash_ops") if m not in OPS_EMPTY_PACKAGES and ops_layer(m) is None]
    assert unplaced == [], f"place these in OPS_LAYERS (and in docs/architecture.md's picture): {unplaced}"


def test_no_operator_cli_module_imports_a_higher_layer():
    upward = sorted(f"{m} (layer {ops_layer(m)}) imports {n} (layer {ops_layer(n)})"
                    for m, deps in import_graph(("dflash_ops",)).items() if m not in OPS_EMPTY_PACKAGES
                    for n in deps if n not in OPS_EMPTY_PACKAGES and ops_layer(n) > ops_layer(m))
    assert upward == []


def test_no_import_cycle_between_operator_cli_modules():
    assert cycles(import_graph(("dflash_ops",))) == []


def test_the_operator_clis_package_inits_import_nothing():
    known = modules("dflash_ops")
    busy = {p: sorted(imported(p, known[p], known) - {"__future__"}) for p in OPS_EMPTY_PACKAGES}
    assert {p: deps for p, deps in busy.items() if deps} == {}


def test_the_layering_check_finds_what_it_looks_for():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert ops_layer("dflash_ops.cli.status_view") == len(OPS_LAYERS) - 1 and ops_layer("dflash_ops.spec") == 0
    assert ops_layer("dflash_ops.multinode.record") == 0 and ops_layer("dflash_ops.multinode.launch") == 3


def test_the_check_finds_an_import_loop_on_disk(tmp_path):
    """The loop bench/step.py <-> bench/step_run.py had (one side's import inside a function), a loop through a
    relative import, and a package __init__ re-exporting its submodules (no loop: the submodules' own imports of the
    package do not count)."""
    def write(rel: str, text: str) -> None:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)

    write("pkg/__init__.py", "from pkg.sub import VALUE\n")
    write("pkg/step.py", "def run_child():\n    from pkg.step_run import run_mode\n    return run_mode\n")
    write("pkg/step_run.py", "from pkg import sub\n\n\ndef run_mode():\n    from pkg.step import HEAD_FP8\n")
    write("pkg/sub/__init__.py", "from .left import VALUE\n")
    write("pkg/sub/left.py", "from . import right\nVALUE = 1\n")
    write("pkg/sub/right.py", "from ..sub.left import VALUE\nfrom pkg import sub\n")
    assert sorted(cycles(import_graph(("pkg",), tmp_path))) == [["pkg.step", "pkg.step_run"],
                                                                ["pkg.sub.left", "pkg.sub.right"]]
    write("pkg/step_run.py", "from pkg import sub\n\n\ndef run_mode():\n    pass\n")
    write("pkg/sub/right.py", "from pkg import sub\n")
    assert cycles(import_graph(("pkg",), tmp_path)) == []
