"""labsim's three layers import one way only, and plotting stays in the presentation layer."""

from __future__ import annotations

import ast
from pathlib import Path

from .conftest import ROOT

PKG = ROOT / "labsim"
SIM = {"simpy"}
PRESENTATION_LIBS = {"matplotlib", "ipywidgets", "IPython"}
HIGHER = {
    "values": {"labsim.sim", "labsim.plots", "labsim.widgets"},
    "sim": {"labsim.plots", "labsim.widgets"},
}


def layer_of(path: Path) -> str | None:
    rel = path.relative_to(PKG).parts
    if len(rel) == 1:
        return "values"
    if rel[0] == "sim":
        return "sim"
    return None  # presentation, lab helpers, checks, course tooling, cli


def imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def test_lower_layers_never_import_higher_ones() -> None:
    problems = []
    for path in sorted(PKG.rglob("*.py")):
        layer = layer_of(path)
        if layer is None or path.name in ("__init__.py", "__main__.py"):
            continue
        for name in imports(path):
            top = name.split(".")[0]
            banned = PRESENTATION_LIBS | (SIM if layer == "values" else set())
            if top in banned or any(name == h or name.startswith(h + ".")
                                    for h in HIGHER[layer]):
                problems.append(f"{path.relative_to(ROOT)} ({layer}) imports {name}")
    assert not problems, "\n".join(problems)


def test_library_code_never_prints() -> None:
    offenders = []
    for path in sorted(PKG.rglob("*.py")):
        if path.relative_to(PKG).parts[0] in ("cli",) or path.name == "__main__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id == "print"):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    allowed = {"labsim/checks/_core.py"}  # the one PASS line a check cell shows
    assert [o for o in offenders if o.split(":")[0] not in allowed] == []
