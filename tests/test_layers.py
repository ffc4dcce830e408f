"""labsim's layers import one way only, and each library stays in the layer that owns it.

Every module of the package belongs to exactly one layer (``docs/architecture.md``):

* values: the modules at the package root and the ``collectives`` and ``step`` packages
  (numbers, closed forms, plain data; no torch, simpy, matplotlib or ipywidgets);
* sim: ``sim/`` (simpy);  presentation: ``plots/`` (matplotlib), ``widgets/`` (ipywidgets);
* beside them, for the real exercises: ``lab/`` (infrastructure), ``parallel/`` (the
  torch.distributed reference code), ``experiments/`` (measurements a lab shows), ``checks/``
  (contract, reference, cases); and ``course/`` (release, grade), ``cli/`` (the command line).

A layer may import the layers it is allowed below (``ALLOWED``) and nothing above.  The
package's own ``__init__`` is the public API (``../shared/docs/api.md``): it re-exports names
of the values and simulation layers only.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from .conftest import ROOT

PKG = ROOT / "labsim"
VALUE_PACKAGES = {"collectives", "step"}
SUBPACKAGES = {"sim", "plots", "widgets", "lab", "parallel", "experiments", "checks", "course",
               "cli"}
ALLOWED: dict[str, set[str]] = {  # labsim layers each layer may import
    "api": {"values", "sim"},
    "values": {"values"},
    "sim": {"values", "sim"},
    "plots": {"values", "sim", "plots"},
    "widgets": {"values", "sim", "plots", "widgets"},
    "lab": {"values", "lab"},
    "parallel": {"values", "lab", "parallel"},
    "experiments": {"values", "sim", "lab", "parallel", "experiments"},
    "checks": {"values", "lab", "parallel", "experiments", "checks"},
    "course": {"values", "checks", "course"},
    "cli": SUBPACKAGES | {"values"},
}
FORBIDDEN_LIBS: dict[str, set[str]] = {  # third-party libraries each layer must not import
    "api": {"torch", "matplotlib", "ipywidgets", "IPython"},
    "values": {"torch", "simpy", "matplotlib", "ipywidgets", "IPython"},
    "sim": {"torch", "matplotlib", "ipywidgets", "IPython"},
    "plots": {"torch", "ipywidgets"},
    "widgets": {"torch"},
    "lab": {"simpy", "matplotlib", "ipywidgets"},
    "parallel": {"simpy", "matplotlib", "ipywidgets"},
    "experiments": {"matplotlib", "ipywidgets"},
    "checks": {"simpy", "matplotlib", "ipywidgets"},
    "course": {"torch", "simpy", "matplotlib", "ipywidgets"},
    "cli": set(),
}


def layer_of(path: Path) -> str:
    rel = path.relative_to(PKG).parts
    if rel == ("__init__.py",):
        return "api"
    if len(rel) == 1 or rel[0] in VALUE_PACKAGES:
        return "values"
    if rel[0] in SUBPACKAGES:
        return rel[0]
    raise AssertionError(f"{path} is in no layer: add its folder to tests/test_layers.py and "
                         f"docs/architecture.md")


def labsim_layer(module: str) -> str | None:
    """The layer a ``labsim...`` module name belongs to (None for non-labsim names)."""
    parts = module.split(".")
    if parts[0] != "labsim" or len(parts) == 1:
        return None
    return parts[1] if parts[1] in SUBPACKAGES else "values"


def imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            if node.module == "labsim":  # from labsim import sim, plots, ...
                found.update(f"labsim.{a.name}" for a in node.names if a.name in SUBPACKAGES)
    return found


MODULES = sorted(p for p in PKG.rglob("*.py") if p.name != "__main__.py")


def test_every_module_has_a_layer() -> None:
    assert {layer_of(p) for p in MODULES} == set(ALLOWED)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PKG)))
def test_imports_point_down_only(path: Path) -> None:
    layer = layer_of(path)
    problems = []
    for name in sorted(imports(path)):
        target = labsim_layer(name)
        if target is not None and target not in ALLOWED[layer]:
            problems.append(f"{layer} imports {name} ({target})")
        if name.split(".")[0] in FORBIDDEN_LIBS[layer]:
            problems.append(f"{layer} imports {name}")
    assert not problems, f"{path.relative_to(ROOT)}: " + "; ".join(problems)


def test_the_rules_catch_an_upward_import(tmp_path: Path) -> None:
    """The checker itself: a values module importing plots, or torch, is reported."""
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\nfrom labsim.plots import gantt\nfrom labsim import sim\n")
    names = imports(bad)
    assert {labsim_layer(n) for n in names} >= {"plots", "sim"}
    assert not ALLOWED["values"] & {"plots", "sim"} and "torch" in FORBIDDEN_LIBS["values"]


def test_no_module_level_mutable_state_in_the_simulator() -> None:
    """Every simulation owns its own simpy.Environment: no module creates one at import."""
    for path in MODULES:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in tree.body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                src = ast.unparse(node.value) if node.value is not None else ""
                assert "Environment(" not in src, f"{path}: module-level simpy.Environment"


def test_library_code_never_prints() -> None:
    offenders = []
    for path in MODULES:
        if path.relative_to(PKG).parts[0] in ("cli",):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id == "print"):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    allowed = {"labsim/checks/_core.py"}  # the one PASS line a check cell shows
    assert [o for o in offenders if o.split(":")[0] not in allowed] == []


def test_no_pyplot_in_the_package() -> None:
    """Figures are made one way (``labsim.plots._figure.new_figure``): pyplot's global figure
    list would keep every figure alive and show it twice in a notebook."""
    users = [str(p.relative_to(ROOT)) for p in MODULES
             if any(n == "matplotlib.pyplot" for n in imports(p))]
    assert users == []


def test_one_stem_per_topic() -> None:
    """No module stem appears in two value-layer places (a topic has one name), and the
    value-layer package ``collectives`` has no same-named module beside it."""
    root_stems = {p.stem for p in PKG.glob("*.py")}
    assert not root_stems & {p.name for p in PKG.iterdir() if p.is_dir()}


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(paths: list[Path], root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the labsim modules it imports, at the top or inside a function (imports
    under ``if TYPE_CHECKING:`` are annotations only and left out); ``from labsim.x import y``
    counts as importing ``labsim.x.y`` when that is a module, else ``labsim.x``."""
    names = {_module_name(p, root): p for p in paths}

    def owner(name: str) -> str | None:
        while name and name not in names:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        typing_only = {id(sub) for node in ast.walk(tree) if isinstance(node, ast.If)
                       and "TYPE_CHECKING" in ast.unparse(node.test) for sub in ast.walk(node)}
        targets: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    targets.add(owner(full) if full in names else owner(node.module) or "")
            elif isinstance(node, ast.Import):
                targets.update(owner(a.name) or "" for a in node.names)
        graph[name] = {t for t in targets if t and t != name and t.startswith("labsim")}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm), sorted;
    imports of the package root (``labsim``, which re-exports everything) left aside."""
    edges = {m: {t for t in ts if t != "labsim"} for m, ts in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(found)


def test_no_two_modules_import_each_other() -> None:
    """A step is built in one direction: no import cycle anywhere in labsim, lazy imports
    inside functions included (they only hide a cycle from the interpreter)."""
    assert import_cycles(import_graph(MODULES)) == []


def test_the_cycle_finder_sees_a_lazy_cycle(tmp_path: Path) -> None:
    pkg = tmp_path / "labsim"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from labsim.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from labsim.a import g\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from labsim.a import g\n")
    paths = sorted(pkg.glob("*.py"))
    graph = import_graph(paths, tmp_path)
    assert import_cycles(graph) == [["labsim.a", "labsim.b"]] and graph["labsim.c"] == set()


MAX_LINES = 500


def test_the_value_and_simulation_modules_stay_small() -> None:
    """Every module of the values and simulation layers (the step's whole line, from the
    model to its time) reads in one sitting: at most ``MAX_LINES`` lines."""
    long = {str(p.relative_to(ROOT)): n for p in MODULES
            if layer_of(p) in ("values", "sim", "api")
            and (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert long == {}
