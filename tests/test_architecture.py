"""The package's shape: no import circle in ``poros/`` (function-local imports count), each layer (a
folder) imports only the layers its package docstring names, no module over 500 lines, at most 16
modules at the package root, no function over 100 lines of code, and each module says at its head
what it owns. The planner is a layer of its own and the only one that builds a ``Workload``; each
streaming setting is declared once (``poros.settings``). ``docs/architecture.md`` draws the picture and
is checked against the same rule. The tools beside the package (``tools/``) keep modules under 700
lines and functions under 100, never edit ``sys.path`` and import the harness's pieces, not its
command line."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "poros"
MAX_LINES = 500
MAX_TOOL_LINES = 700
MAX_TOP_LEVEL = 16


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(name: str) -> str | None:
    """The module of ``poros`` that ``name`` (a module or a name inside one) lives in."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str) -> set[str]:
    """Every ``poros`` module ``module`` imports, at any depth of its code (functions, TYPE_CHECKING
    blocks included); ``from poros import x`` counts ``poros.x`` when x is a module, else ``poros``."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            names = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            if name == "poros" or name.startswith("poros."):
                target = _resolve(name)
                if target and target != module:
                    found.add(target)
    return found


GRAPH = {module: imports_of(module) for module in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return out


def test_the_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_in_poros():
    # the package's __init__ re-exports lazily; an edge into it is an edge into the whole package
    graph = {m: {t for t in targets if t != "poros"} for m, targets in GRAPH.items()}
    assert _cycles(graph) == []


# -- the layer rule, read from the package itself -------------------------------------------------
# A layer is a folder of poros/ whose ``__init__`` docstring says ``May import: ...``; the folders it
# names (``poros.X``) are the layers below it. Every other module is the core, which imports only the
# core (a core module may name layers in its own ``May import:`` line, as ``poros.__main__`` does).

def _allowed(module: str) -> tuple[str, ...] | None:
    """The layers named by the ``May import:`` line of ``module``'s docstring (None: it has no line)."""
    doc = ast.get_docstring(ast.parse(MODULES[module].read_text())) or ""
    match = re.search(r"May import:(.*?)(?:\.\s*$|\.\n\n|\Z)", doc, re.S | re.M)
    if not match:
        return None
    return tuple(sorted(set(re.findall(r"poros\.[a-z_]+", match.group(1)))))


#: layer (a folder's package name) -> the layers it may import
LAYERS = {module: _allowed(module) for module in MODULES
          if MODULES[module].name == "__init__.py" and module.count(".") == 1 and _allowed(module) is not None}


def layer_of(module: str) -> str | None:
    """The layer ``module`` belongs to: the folder it is in, if that folder is a layer; else None (core)."""
    top = ".".join(module.split(".")[:2])
    return top if top in LAYERS else None


def may_import(module: str) -> set[str]:
    """The layers ``module`` may import besides its own and the core."""
    own = layer_of(module)
    return set(LAYERS[own] if own else (_allowed(module) or ()))


def test_every_layer_declares_what_it_may_import():
    expected = {"poros.cli", "poros.doctor", "poros.training", "poros.testing", "poros.dropin", "poros.export",
                "poros.plan", "poros.loading", "poros.stream", "poros.families", "poros.data"}
    assert set(LAYERS) == expected
    for layer, allowed in LAYERS.items():
        assert set(allowed) <= set(LAYERS), f"{layer} names layers that do not exist: {set(allowed) - set(LAYERS)}"


def test_the_layers_form_no_circle():
    assert _cycles({layer: set(allowed) for layer, allowed in LAYERS.items()}) == []


def test_layers_import_downward():
    """A module imports its own layer, the core, and only the layers its folder's docstring names;
    the lazy ``poros`` namespace may name anything."""
    offenders = [f"{module} imports {target} ({layer_of(module) or 'the core'} may import only "
                 f"{sorted(may_import(module)) or 'the core'})"
                 for module in sorted(MODULES) if module != "poros" for target in GRAPH[module]
                 if layer_of(target) not in (None, layer_of(module)) and layer_of(target) not in may_import(module)]
    assert not offenders, "imports against the layers (each package docstring's 'May import:' line):\n" + "\n".join(
        offenders)


def test_families_import_only_the_core():
    for module in MODULES:
        if module.startswith("poros.families"):
            for target in GRAPH[module]:
                assert layer_of(target) in (None, "poros.families"), f"{module} imports {target}"


def test_the_package_root_holds_few_modules():
    top = [p for p in PACKAGE.glob("*.py")]
    assert len(top) <= MAX_TOP_LEVEL, f"poros/ holds {len(top)} modules (at most {MAX_TOP_LEVEL}): put them in a layer"


def test_docs_architecture_shows_every_layer_and_what_it_may_import():
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    for layer, allowed in LAYERS.items():
        row = next((line for line in text.splitlines() if line.startswith(f"| `{layer.replace('.', '/')}/`")), None)
        assert row, f"docs/architecture.md has no table row for {layer}"
        named = set(re.findall(r"poros/([a-z_]+)/", row.split("|")[2]))
        assert {f"poros.{name}" for name in named} == set(allowed), (
            f"docs/architecture.md says {layer} may import {sorted(named)}; its docstring says {list(allowed)}")


def _calls_named(path: Path, name: str) -> list[int]:
    """Lines of ``path`` that call something named ``name`` (``name(...)`` or ``x.name(...)``)."""
    return [node.lineno for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Call) and (
        (isinstance(node.func, ast.Name) and node.func.id == name)
        or (isinstance(node.func, ast.Attribute) and node.func.attr == name))]


def test_the_planner_is_a_layer_and_the_only_one_that_builds_a_workload():
    """``poros.plan`` builds the step a run is planned for (``poros.plan.entry.workload_of``); prepare, the
    trainer, ``poros plan``, ``poros doctor`` and the tools ask it, so none of them can drop a field."""
    assert "poros.plan" in LAYERS
    builders = [f"{path.relative_to(PACKAGE.parent).as_posix()}:{line}"
                for path in [*sorted(PACKAGE.rglob("*.py")), *sorted(TOOLS.rglob("*.py"))]
                if not path.is_relative_to(PACKAGE / "plan") for line in _calls_named(path, "Workload")]
    assert not builders, f"{builders} build a Workload; call poros.plan.entry.workload_of (or plan_config) instead"


def test_each_streaming_setting_is_declared_once():
    """``poros.settings.STREAMING`` holds each streaming setting's name, type, default, doc and check; the config
    fields and prepare's keywords (``StreamOptions``) are built from it and declare none of their own."""
    import dataclasses

    from poros.config import PorosConfig
    from poros.settings import STREAMING
    from poros.stream.options import StreamOptions

    names = {setting.name for setting in STREAMING}
    for path, cls in ((PACKAGE / "config.py", "PorosConfig"), (PACKAGE / "stream" / "options.py", "StreamOptions")):
        body = next(node for node in ast.walk(ast.parse(path.read_text()))
                    if isinstance(node, ast.ClassDef) and node.name == cls).body
        declared = {node.target.id for node in body if isinstance(node, ast.AnnAssign)} & names
        assert not declared, f"{cls} declares {sorted(declared)} itself; they are rows of poros.settings.STREAMING"
    config = {f.name: f for f in dataclasses.fields(PorosConfig)}
    options = {f.name: f for f in dataclasses.fields(StreamOptions)}
    assert list(options) == [setting.name for setting in STREAMING]
    for setting in STREAMING:
        assert options[setting.name].default == setting.prepare_default
        if setting.where == "both":
            assert (config[setting.name].default, config[setting.name].metadata["doc"]) == (setting.default, setting.doc)
        else:
            assert setting.name not in config
    tiers = [path for path in PACKAGE.rglob("*.py") for line in path.read_text().splitlines()
             if line.startswith("HOST_TIERS =")]
    assert len(tiers) == 1, f"HOST_TIERS is defined in {tiers}; it lives in poros/settings.py"


def test_old_module_paths_are_the_moved_modules():
    import importlib

    import poros

    for old, new in poros.MOVED_MODULES.items():
        assert new in MODULES, f"{old} points to {new}, which does not exist"
        assert old not in MODULES, f"{old} exists again beside its new home {new}"
    assert importlib.import_module("poros.run_lock") is importlib.import_module("poros.training.run_lock")


def test_module_size_and_docstring():
    """Every module holds at most MAX_LINES lines and opens with a docstring saying what it owns."""
    long = [f"{path.relative_to(PACKAGE.parent).as_posix()} ({n} lines)" for path in MODULES.values()
            if (n := path.read_text().count("\n")) > MAX_LINES]
    undocumented = [module for module, path in sorted(MODULES.items())
                    if path.stat().st_size and not ast.get_docstring(ast.parse(path.read_text()))]
    assert not long, f"over {MAX_LINES} lines: {sorted(long)}; split each by job"
    assert not undocumented, f"no module docstring saying what it owns: {undocumented}"


def test_no_private_name_is_imported_from_another_module():
    """A ``_name`` is its module's own: what another module needs is public (or moves)."""
    offenders = [f"{module} imports {alias.name} from {node.module}" for module in sorted(MODULES)
                 for node in ast.walk(ast.parse(MODULES[module].read_text()))
                 if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("poros")
                 for alias in node.names if alias.name.startswith("_") and not alias.name.startswith("__")]
    assert not offenders, f"private names imported across modules: {offenders}"


# -- function size, and the tools beside the package ----------------------------------------------
TOOLS = Path(__file__).resolve().parents[1] / "tools"
TOOL_MODULES = sorted(TOOLS.rglob("*.py"))
MAX_FUNCTION_LINES = 100
#: Functions over MAX_FUNCTION_LINES that other engineers are splitting now (issue #28); the lead
#: empties this set at merge. Nothing joins it: split a long function by job instead.
LONG_FUNCTIONS_BEING_SPLIT: set[str] = set()


def code_lines(function: ast.FunctionDef | ast.AsyncFunctionDef, source: list[str]) -> int:
    """Lines of code in ``function``'s body: not blank, not a comment, its docstring left out (the
    lines of functions nested in it count)."""
    body = function.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    if not body:
        return 0
    first = min([body[0].lineno, *(d.lineno for d in getattr(body[0], "decorator_list", []))])
    return sum(1 for line in source[first - 1:function.end_lineno] if line.strip() and not line.strip().startswith("#"))


def functions(tree: ast.AST, prefix: str = ""):
    """``(qualified name, node)`` of every function and method in ``tree``, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
            yield from functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from functions(node, f"{prefix}{node.name}.")
        else:
            yield from functions(node, prefix)


def test_the_line_counter_counts_code_only():
    source = ('def outer(x):\n    """Doc\n\n    more doc."""\n    # a comment\n\n    y = (x +\n         1)\n'
              '    def inner():\n        return y\n    return inner\n\n\ndef empty():\n    """Only a docstring."""\n')
    found = {name: code_lines(node, source.splitlines()) for name, node in functions(ast.parse(source))}
    assert found == {"outer": 5, "outer.inner": 1, "empty": 0}


def test_no_function_over_100_lines_of_code():
    long = {}
    for path in [*sorted(PACKAGE.rglob("*.py")), *TOOL_MODULES]:
        source = path.read_text()
        where = path.relative_to(PACKAGE.parent).as_posix()
        long |= {f"{where}::{name}": n for name, node in functions(ast.parse(source))
                 if (n := code_lines(node, source.splitlines())) > MAX_FUNCTION_LINES}
    unexpected = {name: n for name, n in long.items() if name not in LONG_FUNCTIONS_BEING_SPLIT}
    assert not unexpected, (f"{unexpected}: lines of code over {MAX_FUNCTION_LINES} (blank lines, comments and the "
                            "docstring not counted); split the function by job")


def tool_name(path: Path) -> str:
    return path.relative_to(TOOLS.parent).as_posix()


def test_tool_module_size_and_docstring():
    """Every tool module holds at most MAX_TOOL_LINES lines and opens with a docstring saying what it does."""
    long = [f"{tool_name(p)} ({n} lines)" for p in TOOL_MODULES if (n := p.read_text().count("\n")) > MAX_TOOL_LINES]
    undocumented = [tool_name(p) for p in TOOL_MODULES if not ast.get_docstring(ast.parse(p.read_text()))]
    assert not long, f"over {MAX_TOOL_LINES} lines: {long}; split each by job"
    assert not undocumented, f"no docstring saying what it does: {undocumented}"


def sys_path_uses(tree: ast.AST) -> list[int]:
    """Lines of ``tree`` that touch ``sys.path`` (``sys.path...`` or ``from sys import path``)."""
    touched = [node.lineno for node in ast.walk(tree)
               if isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
               and node.value.id == "sys"]
    return touched + [node.lineno for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                      and node.module == "sys" and any(alias.name == "path" for alias in node.names)]


def test_no_test_or_tool_edits_sys_path():
    """The tools are a package run as ``python -m tools.<job>.<name>`` from the repository root, and pytest puts the
    root on the path (``pythonpath`` in pyproject.toml): no tool and no test needs ``sys.path``."""
    tests = sorted(Path(__file__).resolve().parent.rglob("*.py"))
    offenders = [f"{path.relative_to(TOOLS.parent).as_posix()}:{line}" for path in [*TOOL_MODULES, *tests]
                 for line in sys_path_uses(ast.parse(path.read_text()))]
    assert not offenders, (f"sys.path used at {offenders}; import the tools as a package (from tools.bench.shapes "
                           "import ...), run a tool as python -m tools.<job>.<name>")


def test_tools_import_the_harness_pieces_not_its_command_line():
    """``tools.bench.harness`` is the command line over shapes, models, arms, timeline, provenance and
    report; another tool imports those (public names only), never the command line."""
    offenders = []
    for path in TOOL_MODULES:
        if path.parent.name == "bench" and path.stem in ("harness", "__main__"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tools"):
                names = [alias.name for alias in node.names]
                if node.module == "tools.bench.harness" or "harness" in names:
                    offenders.append(f"{tool_name(path)} imports the harness")
                offenders += [f"{tool_name(path)} imports {name} from {node.module}" for name in names
                              if name.startswith("_")]
    assert not offenders, (f"{offenders}; import the piece from tools.bench.shapes, tools.bench.models, "
                           "tools.bench.arms, tools.bench.timeline, tools.bench.provenance or tools.bench.report")


# -- family facts live with the family, not in tests ------------------------------------------------
def family_branches(tree: ast.AST) -> list[int]:
    """Lines where a branch (``if``, a conditional expression, a comprehension's ``if``, ``while``) tests a
    name ``family`` against a string: a family's fact written in a test instead of in its declaration."""
    tests = [node.test for node in ast.walk(tree) if isinstance(node, (ast.If, ast.IfExp, ast.While))]
    tests += [condition for node in ast.walk(tree) if isinstance(node, ast.comprehension) for condition in node.ifs]
    return sorted({compare.lineno for test in tests for compare in ast.walk(test)
                   if isinstance(compare, ast.Compare) and isinstance(compare.left, ast.Name)
                   and compare.left.id == "family"
                   and any(isinstance(c, (ast.Constant, ast.Tuple, ast.List, ast.Set)) for c in compare.comparators)})


def test_the_family_branch_finder_finds_branches_only():
    source = ('x = 1 if family == "qwen2" else 2\nif family in ("a", "b"):\n    pass\n'
              'ys = [f for f in fs if family != "c"]\nassert family == "qwen2"\n')
    assert family_branches(ast.parse(source)) == [1, 2, 4]


def test_no_family_branch_in_tests():
    """What a family needs from a test (layers, head_dim rule, chunk length, packing...) is declared by the
    family (its descriptor, its ``TinyVariant``: ``poros.testing.strategies`` reads it), never as an
    ``if family == ...`` in a test."""
    offenders = [f"tests/{path.name}:{line}" for path in sorted(Path(__file__).resolve().parent.glob("*.py"))
                 for line in family_branches(ast.parse(path.read_text()))]
    assert not offenders, (f"family branches at {offenders}; declare the fact in the family's descriptor or "
                           "TinyVariant and read it (poros.testing.strategies)")


# -- measured numbers live in registry/results, not in the package ----------------------------------
MEASURED_WORD = re.compile(r"\b(H200|measured|measurements?)\b", re.I)
#: a figure as the results pages write one: decimal GB (budgets are spelled in GiB), seconds, ratios, percent
FIGURE = re.compile(r"(?<![\w.])\d+(\.\d+)?([-–]\d+(\.\d+)?)?(x| ?(GB|GB/s|ms|s|%|tokens/s|TFLOPS?))(?![\w/])")


def measured_figures(tree: ast.AST, window: int = 120) -> list[tuple[int, str]]:
    """``(line, text)`` of each string constant (docstrings included) that writes a figure with its unit
    within ``window`` characters of "H200" or "measured": a measurement copied into the code."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            for word in MEASURED_WORD.finditer(node.value):
                near = node.value[max(0, word.start() - window):word.end() + window]
                if FIGURE.search(near):
                    found.append((node.lineno, " ".join(near.split())[:100]))
                    break
    return found


def test_the_measured_figure_finder():
    source = ('"""Peaks at 7.9 GB on the H200."""\nA = "within 3 % of the H200 measurements"\n'
              'B = "the H200 (docs/results-h200.md)"\nC = "e.g. --vram-budget 8GiB"\n')
    assert [line for line, _ in measured_figures(ast.parse(source))] == [1, 2]


def test_no_measured_number_in_package_strings():
    """A number the H200 measured is published from registry/results through a generated block; the
    package's strings and docstrings link the results page (docs/results-h200.md) instead of copying it."""
    offenders = [f"{path.relative_to(PACKAGE.parent).as_posix()}:{line}: {text}"
                 for path in sorted(PACKAGE.rglob("*.py")) for line, text in measured_figures(ast.parse(path.read_text()))]
    assert not offenders, "measured figures in the package's strings (link docs/results-h200.md):\n" + "\n".join(offenders)
