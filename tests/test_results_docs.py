"""Every published number comes from one source: the generated blocks of the README and the docs are
rendered from ``registry/`` and ``registry/results`` JSON by the generators in ``tools/docs/``, and a
stale block fails here."""

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GENERATORS = sorted(path.stem for path in (ROOT / "tools" / "docs").glob("gen_*.py"))
MARKER = re.compile(r"^<!-- BEGIN GENERATED: (?P<name>[^>]+?) -->$", re.M)
#: blocks a package function renders, each held equal by its own test
RENDERED_IN_THE_PACKAGE = {("docs/configuration.md", "fields"): "poros.config.fields_markdown (tests/test_config.py)"}


def generated_blocks() -> set[tuple[str, str]]:
    """``(page, block name)`` of every generated block in the README and docs/."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return {(page.relative_to(ROOT).as_posix(), match.group("name")) for page in pages
            for match in MARKER.finditer(page.read_text(encoding="utf-8"))}


def rendered_blocks(name: str) -> set[tuple[str, str]]:
    """``(page, block name)`` of every block the generator ``tools.docs.<name>`` renders."""
    module = importlib.import_module(f"tools.docs.{name}")
    page = getattr(module, "PAGE", None) or module.DOC_PATH
    blocks = module.BLOCKS if hasattr(module, "BLOCKS") else module.render_blocks() if hasattr(module, "render_blocks") else {}
    return {(page.relative_to(ROOT).as_posix(), block) for block in blocks}


@pytest.mark.parametrize("generator", GENERATORS)
def test_every_generated_page_is_current(generator, child_env):
    """The generator, run with ``--check``, would write the page as it is committed."""
    result = subprocess.run([sys.executable, "-m", f"tools.docs.{generator}", "--check"], cwd=ROOT,
                            capture_output=True, text=True, timeout=600, env=child_env(OMP_NUM_THREADS="1"))
    assert result.returncode == 0, f"python -m tools.docs.{generator}: {result.stdout}{result.stderr[-2000:]}"


def test_every_generated_block_has_its_generator():
    """No block on a page is left without a generator (a hand-edited block would never be checked)."""
    rendered = set(RENDERED_IN_THE_PACKAGE)
    for generator in GENERATORS:
        rendered |= rendered_blocks(generator)
    orphans = sorted(generated_blocks() - rendered)
    assert not orphans, f"generated blocks no generator renders: {orphans}"


def test_every_gate_record_in_the_registry_has_its_evidence():
    from poros import records

    for family in records.all_families():
        for record in records.validations(family):
            assert record["label"] in records.LABELS
            evidence = record.get("evidence")
            if evidence:
                assert (ROOT / evidence).exists(), f"{family}: {evidence} is not committed"
