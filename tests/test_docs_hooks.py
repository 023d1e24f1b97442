"""docs/plugins.md and poros/hookspecs.py must agree (datasette's test_plugins_documented idea).

Fails when a hook is undocumented or documented with another signature, when the docs describe
or implement a hook that does not exist, when a hook has no test, or when a descriptor field is
missing from the field table.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import fields

import pytest

from poros import hookspecs
from poros.descriptor import ArchitectureDescriptor

HOOKS = {
    name: function for name, function in vars(hookspecs).items()
    if callable(function) and getattr(function, "poros_spec", None) is not None
}


def signature_line(function) -> str:
    """``def name(arg: Annotation, ...) -> Return`` as written in hookspecs.py (annotations are strings there)."""
    signature = inspect.signature(function)
    parameters = []
    for parameter in signature.parameters.values():
        text = parameter.name
        if parameter.annotation is not inspect.Parameter.empty:
            text += f": {parameter.annotation}"
        if parameter.default is not inspect.Parameter.empty:
            text += f" = {parameter.default!r}"
        parameters.append(text)
    returns = "" if signature.return_annotation is inspect.Signature.empty else f" -> {signature.return_annotation}"
    return f"def {function.__name__}({', '.join(parameters)}){returns}"


@pytest.fixture(scope="module")
def plugins_doc(repo_root) -> str:
    return (repo_root / "docs" / "plugins.md").read_text()


def test_hookspecs_are_found():
    assert "poros_register_architectures" in HOOKS
    assert all(name.startswith("poros_") for name in HOOKS)


@pytest.mark.parametrize("hook", sorted(HOOKS))
def test_hook_is_documented_with_its_real_signature(plugins_doc, hook):
    assert f"\n### {hook}\n" in plugins_doc, f"docs/plugins.md has no '### {hook}' section"
    section = plugins_doc.split(f"\n### {hook}\n", 1)[1].split("\n#", 1)[0]
    assert signature_line(HOOKS[hook]) in section, (
        f"docs/plugins.md documents {hook} without its signature {signature_line(HOOKS[hook])!r}"
    )


def test_docs_mention_only_hooks_that_exist(plugins_doc):
    documented = set(re.findall(r"^### (poros_\w+)", plugins_doc, flags=re.MULTILINE))
    implemented = set(re.findall(r"\bdef (poros_\w+)\(", plugins_doc))
    assert documented <= set(HOOKS), f"documented hooks that do not exist: {sorted(documented - set(HOOKS))}"
    assert implemented <= set(HOOKS), f"docs define functions that are not hooks: {sorted(implemented - set(HOOKS))}"


@pytest.mark.parametrize("hook", sorted(HOOKS))
def test_hook_has_a_test(repo_root, hook):
    tests = [p for p in (repo_root / "tests").glob("test_*.py") if p.name != "test_docs_hooks.py"]
    assert any(hook in path.read_text() for path in tests), f"no test under tests/ mentions {hook}"


def test_every_descriptor_field_is_in_the_field_table(plugins_doc):
    table = set(re.findall(r"^\| `(\w+)` \|", plugins_doc, flags=re.MULTILINE))
    field_names = {f.name for f in fields(ArchitectureDescriptor)}
    assert field_names - table == set(), f"descriptor fields missing from docs/plugins.md: {sorted(field_names - table)}"
    assert table - field_names == set(), f"docs/plugins.md lists fields that do not exist: {sorted(table - field_names)}"
