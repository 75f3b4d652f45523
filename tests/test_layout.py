"""The package layout docs/architecture.md describes, checked from the code's own imports (every import statement,
module-level or inside a function, read with `ast`): no import cycle between the trainer's and the benchmarks'
modules, nothing in the product imports the benchmarks, the benchmarks import no test code, and the operator CLI never
imports torch or the trainer. The operator CLI's layers are its folders: with each top-level module and each
subpackage of dflash_ops as one node, the import graph has no cycle (an import back up the layers would make one),
and docs/architecture.md places every such folder; no two of its modules import each other round a loop, its
packages' `__init__` modules import nothing (importing a module never drags in a higher one), and only the ssh
modules dflash_ops/ssh/__init__.py names import paramiko. Three tests show that the checks find what they look
for: an import loop built on disk, a loop of folders built on disk, and a synthetic graph."""
from __future__ import annotations

import ast
from functools import partial
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


# The modules of dflash_ops that import paramiko, and no other (dflash_ops/ssh/__init__.py says what each uses it for).
PARAMIKO_MODULES = ("dflash_ops.ssh.config", "dflash_ops.ssh.connection", "dflash_ops.ssh.hostkeys", "dflash_ops.ssh.proxy")


def test_only_the_ssh_modules_that_say_so_import_paramiko():
    users = sorted(m for m, names in external_imports("dflash_ops").items()
                   if any(n == "paramiko" or n.startswith("paramiko.") for n in names))
    assert users == list(PARAMIKO_MODULES)


OPS_EMPTY_PACKAGES = ("dflash_ops", "dflash_ops.runs", "dflash_ops.ssh", "dflash_ops.gpus", "dflash_ops.multinode")


def folder_of(module: str, package: str) -> str | None:
    """The folder-level node of `module`: its top-level module or subpackage of `package` (`dflash_ops.cli.render`
    -> `dflash_ops.cli`, `dflash_ops.spec` -> itself); None for `package`'s own __init__."""
    parts = module.split(".")
    return None if module == package else ".".join(parts[:len(package.split(".")) + 1])


def folder_graph(graph: dict[str, set[str]], package: str) -> dict[str, set[str]]:
    """`graph` with each top-level module and each subpackage of `package` as one node: A -> B when a module of A
    imports one of B. A cycle here is an import that runs back up the layers."""
    out: dict[str, set[str]] = {}
    for m, deps in graph.items():
        a = folder_of(m, package)
        if a is None:
            continue
        out.setdefault(a, set())
        out[a] |= {b for b in (folder_of(n, package) for n in deps) if b is not None and b != a}
    return out


def folder_levels(graph: dict[str, set[str]]) -> dict[str, int]:
    """Each node's layer in an acyclic folder graph: 0 imports nothing of the package, else one above the highest
    node it imports."""
    levels: dict[str, int] = {}

    def level(n: str) -> int:
        if n not in levels:
            levels[n] = 1 + max((level(d) for d in graph[n]), default=-1)
        return levels[n]

    for n in graph:
        level(n)
    return levels


def ops_folders() -> dict[str, set[str]]:
    return folder_graph(import_graph(("dflash_ops",)), "dflash_ops")


def test_the_operator_clis_folders_sit_in_layers():
    """No cycle between the folders of dflash_ops (its top-level modules and subpackages): every import runs down."""
    graph = ops_folders()
    back = sorted(f"{a} -> {b}" for c in cycles(graph) for a in c for b in graph[a] if b in c)
    assert back == [], f"imports round a loop of folders (one of them runs back up): {back}"


def test_the_architecture_doc_names_every_operator_cli_folder():
    """docs/architecture.md's picture of the layers places every folder (`name/` or `name.py`) the code has."""
    section = (REPO / "docs" / "architecture.md").read_text().split("## The operator CLI")[1].split("\n## ")[0]
    short = {n.removeprefix("dflash_ops."): (REPO / n.replace(".", "/")).is_dir() for n in ops_folders()}
    missing = sorted(n for n, is_dir in short.items() if (f"{n}/" if is_dir else f"{n}.py") not in section)
    assert missing == [], f"place these in docs/architecture.md's layers: {missing}"


def test_no_import_cycle_between_operator_cli_modules():
    assert cycles(import_graph(("dflash_ops",))) == []


def test_the_operator_clis_package_inits_import_nothing():
    known = modules("dflash_ops")
    busy = {p: sorted(imported(p, known[p], known) - {"__future__"}) for p in OPS_EMPTY_PACKAGES}
    assert {p: deps for p, deps in busy.items() if deps} == {}


def test_the_layering_check_finds_what_it_looks_for():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert folder_of("dflash_ops.cli.status_view", "dflash_ops") == "dflash_ops.cli"
    assert folder_of("dflash_ops.spec", "dflash_ops") == "dflash_ops.spec"
    assert folder_of("dflash_ops", "dflash_ops") is None
    level = {n.removeprefix("dflash_ops."): i for n, i in folder_levels(ops_folders()).items()}
    assert level["errors"] == 0 and level["cli"] > level["runs"] > level["ssh"] > level["spec"] > level["noderecord"]


def write_module(root: Path, rel: str, text: str) -> None:
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).write_text(text)


def test_the_folder_check_finds_a_loop_of_folders_on_disk(tmp_path):
    """Two folders importing each other through different modules: no module-level cycle, yet a folder-level one
    (a bottom value importing from a folder above it); gone once the value moves down to a top-level module."""
    write = partial(write_module, tmp_path)
    write("pkg/__init__.py", "")
    write("pkg/spec.py", "from pkg.multi.record import Record\n")
    write("pkg/multi/__init__.py", "")
    write("pkg/multi/record.py", "Record = int\n")
    write("pkg/multi/plan.py", "from pkg.spec import Record\n")
    graph = import_graph(("pkg",), tmp_path)
    assert cycles(graph) == []
    assert cycles(folder_graph(graph, "pkg")) == [["pkg.multi", "pkg.spec"]]
    (tmp_path / "pkg/multi/record.py").rename(tmp_path / "pkg/record.py")
    write("pkg/spec.py", "from pkg.record import Record\n")
    graph = folder_graph(import_graph(("pkg",), tmp_path), "pkg")
    assert cycles(graph) == [] and folder_levels(graph) == {"pkg.record": 0, "pkg.spec": 1, "pkg.multi": 2}


def test_the_check_finds_an_import_loop_on_disk(tmp_path):
    """The loop bench/step.py <-> bench/step_run.py had (one side's import inside a function), a loop through a
    relative import, and a package __init__ re-exporting its submodules (no loop: the submodules' own imports of the
    package do not count)."""
    write = partial(write_module, tmp_path)
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
