"""The graded copy of labsim: the package with a lab's references withheld.

A check names what the learner's code must not use (``Spec.forbid``, ``"module:qualname"``);
the labsim ones among them are the exercise's references and the library's routes to its
answer.  Watching for their calls inside the learner's process can be evaded (another
thread, a child process, a copy of the code or of its source text), so graded runs do not
watch for them: they run against a copy of the package in which each of them keeps its name,
signature and docstring but its body is a single ``raise withheld("module.qualname")``
(``labsim.withheld.ReferenceWithheld``).  The code and its source text are simply not there,
for any thread, process or copy.

- a function or method: its body is replaced;
- a class: every function its body defines (methods, properties, class and static methods)
  is replaced, so it cannot be used, subclassed usefully or instantiated through its own
  ``__init__``; it keeps validation (``__post_init__``), text, comparison and pickling
  methods and the generated dataclass methods, so a withheld dataclass still holds data and
  the module's own constants still build;
- ``"module:*"``: every public function and class the module defines.

Everything else is byte for byte the installed package (line numbers kept), compiled once.
``build(targets, folder)`` writes the copy and checks that every module still imports.
"""

from __future__ import annotations

import ast
import compileall
import hashlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

STUB = "from labsim.withheld import withheld as _w; raise _w({name!r})"
# Put beside the copy's ``labsim/`` (first on ``sys.path`` in a graded run): every Python
# process of the run installs the guard before anything else runs, without importing labsim.
SITECUSTOMIZE = """\
import os as _os
if _os.environ.get("LABSIM_GUARD"):
    import importlib.util as _util
    import sys as _sys
    _spec = _util.spec_from_file_location(
        "labsim.lab.guard", _os.path.join(_os.path.dirname(__file__), "labsim", "lab", "guard.py"))
    _guard = _util.module_from_spec(_spec)
    _sys.modules["labsim.lab.guard"] = _guard
    _spec.loader.exec_module(_guard)
    _guard.install()
    del _util, _sys, _spec, _guard
del _os
"""


@dataclass(frozen=True)
class GradedCopy:
    """A built copy: ``root`` goes first on ``sys.path`` (it holds ``labsim/``); ``withheld``
    lists every ``module.qualname`` replaced."""

    root: Path
    withheld: tuple[str, ...]

    @property
    def package(self) -> Path:
        return self.root / "labsim"


def source_package() -> Path:
    """The folder of the installed labsim package."""
    import labsim

    return Path(labsim.__file__).resolve().parent


def module_file(package: Path, module: str) -> Path | None:
    """The source file of ``labsim.<...>`` inside ``package`` (a module or a package's
    ``__init__.py``), or None when ``module`` is not part of labsim."""
    parts = module.split(".")
    if parts[0] != "labsim":
        return None
    base = package.joinpath(*parts[1:])
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def labsim_targets(targets: Iterable[str]) -> list[str]:
    """The labsim entries of ``"module:qualname"`` targets (torch's stay watched)."""
    return sorted({t for t in targets if t.split(":", 1)[0].split(".")[0] == "labsim"})


def _public_names(tree: ast.Module) -> list[str]:
    return [n.name for n in tree.body
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and not n.name.startswith("_")]


def _find(tree: ast.Module, qualname: str) -> ast.AST | None:
    node: ast.AST = tree
    for part in qualname.split("."):
        body = getattr(node, "body", [])
        found = None
        for child in body:
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and (
                    child.name == part):
                found = child  # the last definition wins, as at run time
        if found is None:
            return None
        node = found
    return node


# what a withheld class keeps: validation, text and comparison, pickling -- none of them
# computes an answer, and the module's own constants (presets, tables) are built with them
KEPT_DUNDERS = frozenset({
    "__post_init__", "__repr__", "__str__", "__format__", "__hash__", "__eq__", "__ne__",
    "__lt__", "__le__", "__gt__", "__ge__", "__init_subclass__", "__set_name__",
    "__class_getitem__", "__reduce__", "__getstate__", "__setstate__"})


def _functions(node: ast.AST, qualname: str, in_class: bool = False
               ) -> list[tuple[ast.AST, str]]:
    """(function node, its qualname) to stub for a target node."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return [] if in_class and node.name in KEPT_DUNDERS else [(node, qualname)]
    out: list[tuple[ast.AST, str]] = []
    for child in getattr(node, "body", []):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out += _functions(child, f"{qualname}.{child.name}", True)
    return out


def _stub_lines(lines: list[str], func: ast.FunctionDef, shown: str) -> None:
    """Replace ``func``'s body (after its docstring) in ``lines`` (0-based list of source
    lines with their endings), keeping the number of lines."""
    body = func.body
    keep = 1 if (body and isinstance(body[0], ast.Expr) and isinstance(
        getattr(body[0], "value", None), ast.Constant) and isinstance(
        body[0].value.value, str)) else 0
    first = body[keep] if len(body) > keep else None
    end = func.end_lineno  # 1-based, inclusive
    stub = STUB.format(name=shown)
    if first is None:  # a docstring only: add the raise after it
        line = lines[end - 1]
        indent = " " * (body[0].col_offset if body else func.col_offset + 4)
        lines[end - 1] = line.rstrip("\n") + "\n" + indent + stub + "\n"
        return
    start = first.lineno  # 1-based
    if start == func.lineno:  # "def f(): return x" on one line
        line = lines[start - 1]
        lines[start - 1] = line[:first.col_offset] + stub + "\n"
        for i in range(start, end):
            lines[i] = "\n"
        return
    indent = " " * first.col_offset
    head = lines[start - 1][:first.col_offset]
    if head.strip():  # the body shares its first line with something else: start afresh
        indent = " " * (func.col_offset + 4)
    lines[start - 1] = indent + stub + "\n"
    for i in range(start, end):
        lines[i] = "\n"


def stub_source(text: str, module: str, qualnames: Sequence[str]) -> tuple[str, list[str]]:
    """``text`` with the bodies of ``qualnames`` (``"*"``: every public name) replaced;
    returns the new text and the ``module.qualname`` of every function replaced."""
    tree = ast.parse(text)
    wanted: list[str] = []
    for q in qualnames:
        wanted += _public_names(tree) if q == "*" else [q]
    funcs: dict[int, tuple[ast.AST, str]] = {}
    missing = []
    for q in dict.fromkeys(wanted):
        node = _find(tree, q)
        if node is None:
            missing.append(q)
            continue
        for func, qual in _functions(node, q):
            funcs[id(func)] = (func, qual)
    if missing:
        raise ValueError(f"{module}: no definition of {', '.join(missing)} to withhold")
    # innermost last: an enclosing function's stub removes what it contains
    chosen = sorted(funcs.values(), key=lambda fq: (fq[0].lineno, -fq[0].end_lineno))
    outer: list[tuple[ast.AST, str]] = []
    for func, qual in chosen:
        if any(o.lineno <= func.lineno and func.end_lineno <= o.end_lineno for o, _ in outer):
            continue
        outer.append((func, qual))
    lines = text.splitlines(keepends=True)
    for func, qual in sorted(outer, key=lambda fq: -fq[0].lineno):
        _stub_lines(lines, func, f"{module}.{qual}")
    return "".join(lines), [f"{module}.{q}" for _, q in outer]


def fingerprint(package: Path, targets: Sequence[str]) -> str:
    """A digest of the package's sources and the targets (names a cached copy)."""
    h = hashlib.sha256("\n".join(sorted(targets)).encode())
    for path in sorted(package.rglob("*.py")):
        h.update(str(path.relative_to(package)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def build(targets: Iterable[str], folder: Path, package: Path | None = None,
          verify: bool = True) -> GradedCopy:
    """Write the graded copy of ``package`` (default: the installed labsim) under
    ``folder`` with the labsim ``targets`` withheld; ``ValueError`` naming a target that does
    not exist or a module that no longer imports."""
    package = Path(package or source_package())
    folder = Path(folder)
    dest = folder / "labsim"
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(package, dest, ignore=shutil.ignore_patterns(
        "__pycache__", "*.pyc", "*.egg-info"))
    by_module: dict[str, list[str]] = {}
    for target in labsim_targets(targets):
        module, _, qual = target.partition(":")
        by_module.setdefault(module, []).append(qual or "*")
    replaced: list[str] = []
    for module, quals in sorted(by_module.items()):
        path = module_file(dest, module)
        if path is None:
            raise ValueError(f"cannot withhold {module}: no such labsim module")
        text, done = stub_source(path.read_text(encoding="utf-8"), module, quals)
        path.write_text(text, encoding="utf-8")
        replaced += done
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE, encoding="utf-8")
    compileall.compile_dir(str(dest), quiet=1, workers=1)
    for dirpath, _dirnames, filenames in os.walk(folder):
        os.chmod(dirpath, 0o755)
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), 0o644)
    copy = GradedCopy(folder, tuple(sorted(replaced)))
    if verify:
        problem = import_problem(copy, sorted(by_module))
        if problem:
            raise ValueError(f"the graded copy does not import: {problem}")
    return copy


def import_problem(copy: GradedCopy, modules: Sequence[str]) -> str:
    """"" if ``labsim``, its checks and every withheld module import from ``copy``, else
    the error (run in a fresh interpreter, so this process keeps the real package)."""
    names = ["labsim", "labsim.checks", *modules]
    code = ("import importlib, sys\n"
            f"sys.path.insert(0, {str(copy.root)!r})\n"
            f"for m in {names!r}:\n"
            "    importlib.import_module(m)\n"
            "import labsim\n"
            f"assert labsim.__file__.startswith({str(copy.root)!r}), labsim.__file__\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=300)
    if proc.returncode == 0:
        return ""
    return (proc.stderr.strip().splitlines() or ["no message"])[-1]


__all__ = ["GradedCopy", "build", "fingerprint", "import_problem", "labsim_targets",
           "module_file", "source_package", "stub_source"]
