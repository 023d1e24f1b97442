"""docs/quickstart.md's Python snippet, as a user runs it: twice in one directory, in a fresh Python each time.

The snippet is read from the page (the ```python block that trains the bundled model), with its ``steps``
lowered so the test stays cheap; everything else is the page's. Both runs succeed (the second replaces the
first: ``overwrite=True``), every file lands under the one ``output_dir``, and stderr holds none of the
third-party notices ``import poros`` hides (:mod:`poros.noise`); with ``POROS_VERBOSE=1`` they show.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("bitsandbytes")

ROOT = Path(__file__).resolve().parents[1]
NOTICES = ("Failed to load CPU gemm_4bit_forward", "is_gradient_checkpointing", "Loading weights")


def quickstart_snippet() -> str:
    page = (ROOT / "docs" / "quickstart.md").read_text(encoding="utf-8")
    (snippet,) = [block for block in re.findall(r"```python\n(.*?)```", page, flags=re.S) if "poros-tiny-qwen3" in block]
    assert "steps=100" in snippet and "overwrite=True" in snippet and "trainer.save()" in snippet
    return snippet.replace("steps=100", "steps=2")


def test_the_python_quickstart_runs_twice_in_one_directory(tmp_path, child_env):
    """Twice in one Python (the imports once: the test stays cheap); each run is the page's snippet whole."""
    snippet = quickstart_snippet()
    twice = f"snippet = {snippet!r}\nexec(snippet, {{}})\nprint('POROS-FIRST-RUN-DONE', flush=True)\nexec(snippet, {{}})\n"
    result = subprocess.run([sys.executable, "-c", twice], cwd=tmp_path, capture_output=True, text=True,
                            timeout=600, env=child_env(OMP_NUM_THREADS="1", POROS_LOAD_PLUGINS=""), check=False)
    assert result.returncode == 0 and "POROS-FIRST-RUN-DONE" in result.stdout, result.stderr[-3000:]
    for notice in NOTICES:
        assert notice not in result.stdout + result.stderr, notice
    written = sorted(path.name for path in tmp_path.iterdir())
    assert written == ["tiny-lora"], written  # nothing beside the one output_dir
    names = {path.name for path in (tmp_path / "tiny-lora").iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "poros_config.json", "metrics.jsonl"} <= names
    assert "overwrite=True: removed the earlier run's" in result.stderr  # the second replaced the first whole


def test_poros_verbose_shows_the_known_notices(tmp_path, child_env):
    """(Hidden by default: the quickstart test above imports bitsandbytes through poros and sees none.)
    bitsandbytes prints its kernels-community notice only on a CPU with AVX-512 BF16 (the one its CPU kernel
    needs); elsewhere there is nothing to show."""
    from bitsandbytes.functional import has_avx512bf16

    verbose = bool(has_avx512bf16())
    env = child_env(POROS_VERBOSE="1")
    env.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)
    result = subprocess.run([sys.executable, "-c", "import poros, bitsandbytes"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=300, env=env, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert ("Failed to load CPU gemm_4bit_forward" in result.stderr) is verbose, result.stderr[-3000:]
