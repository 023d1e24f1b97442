"""The package's shape: no import circle in ``poros/`` (function-local imports count), the layers
import only downward (core -> families; engine <- drop-in <- trainer <- CLI), no module over 700
lines, and each module says at its head what it owns. ``docs/architecture.md`` draws the picture."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "poros"
MAX_LINES = 700


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


#: each layer may import its own and the layers after it in this list, never one before it
LAYERS = [
    ("cli", lambda m: m.startswith("poros.cli") or m in {"poros.validation", "poros.__main__"}),  # -m poros: the CLI
    ("trainer", lambda m: m in {"poros.trainer", "poros.training", "poros.run_plan", "poros.bench", "poros.merge",
                                "poros.gpu_probe", "poros.run_lock"}
     or m.startswith(("poros.bench.", "poros.training."))),
    ("drop-in", lambda m: m in {"poros.model", "poros.probe", "poros.testing", "poros.load", "poros.checkpoint",
                                "poros.integrations", "poros.cache", "poros.cache_blocks",
                                "poros.testing_distributed"}
     or m.startswith("poros.testing.")),
    ("engine", lambda m: m.startswith("poros.stream")),
]
ENGINE = "poros.stream"


def _layer(module: str) -> int | None:
    for position, (_, member) in enumerate(LAYERS):
        if member(module):
            return position
    return None


@pytest.mark.parametrize("module", sorted(MODULES))
def test_layers_import_downward(module):
    """The engine (poros/stream) never imports the drop-in, the trainer or the CLI; the drop-in never
    the trainer or the CLI; the trainer never the CLI. The core (config, descriptor, registry,
    errors...) never imports a layer above it that has a place in this list, except the package's
    lazy ``poros`` namespace."""
    own = _layer(module)
    for target in GRAPH[module]:
        theirs = _layer(target)
        if theirs is None:
            continue
        if own is None:
            assert module == "poros" or module.startswith("poros.families"), (
                f"core module {module} imports {target} ({LAYERS[theirs][0]})")
            assert theirs == len(LAYERS) - 1 or module == "poros", f"{module} imports {target}"
        else:
            assert theirs >= own, f"{module} ({LAYERS[own][0]}) imports {target} ({LAYERS[theirs][0]}): upward"


def test_families_import_only_the_core():
    for module in MODULES:
        if module.startswith("poros.families"):
            for target in GRAPH[module]:
                assert _layer(target) is None, f"{module} imports {target}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_size_and_docstring(module):
    path = MODULES[module]
    lines = path.read_text().count("\n")
    assert lines <= MAX_LINES, f"{path.relative_to(PACKAGE.parent)} has {lines} lines (at most {MAX_LINES}): split it by job"
    if path.stat().st_size:
        assert ast.get_docstring(ast.parse(path.read_text())), f"{module} has no module docstring saying what it owns"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_private_name_is_imported_from_another_module(module):
    """A ``_name`` is its module's own: what another module needs is public (or moves)."""
    tree = ast.parse(MODULES[module].read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("poros"):
            private = [alias.name for alias in node.names
                       if alias.name.startswith("_") and not alias.name.startswith("__")]
            assert not private, f"{module} imports {private} from {node.module}"
