"""Shared test helpers. Plugins are registered per test with poros.testing.plugins.registered_plugin."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import poros

REPO_ROOT = Path(__file__).resolve().parents[1]
#: The built-in families, in registration order (``poros.registry.DEFAULT_PLUGINS``): what a listing
#: shows before any third-party family. Written here once; tests import it (``from conftest import ...``).
BUILTIN_FAMILIES = ["qwen2", "qwen3", "qwen3_5", "qwen3_5_moe", "gemma3", "gemma4"]


class FamilyPlugin:
    """A class-based plugin that registers the descriptors it is given (llm's MockModelsPlugin idea)."""

    def __init__(self, *descriptors, name: str = "poros-test-plugin") -> None:
        self.__name__ = name
        self.descriptors = descriptors

    @poros.hookimpl
    def poros_register_architectures(self, register):
        for descriptor in self.descriptors:
            register(descriptor)


@pytest.fixture(scope="session", autouse=True)
def block_cache_in_a_temporary_directory(tmp_path_factory):
    """Runs that use the NF4 block cache (on by default for PorosTrainer) write it here, not to ~/.cache."""
    previous = os.environ.get("POROS_CACHE_DIR")
    os.environ["POROS_CACHE_DIR"] = str(tmp_path_factory.mktemp("poros-cache"))
    yield
    if previous is None:
        os.environ.pop("POROS_CACHE_DIR", None)
    else:
        os.environ["POROS_CACHE_DIR"] = previous


@pytest.fixture(autouse=True)
def each_test_in_its_own_working_directory(tmp_path_factory, monkeypatch):
    """Every test runs in an empty working directory of its own (not its ``tmp_path``, which some tests
    list), so the checkout's own ``./poros_output`` -- what the README's ``poros train`` leaves there --
    is never a test's default output_dir. Tests name repository files by absolute path (``repo_root``)."""
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))


@pytest.fixture(autouse=True)
def nothing_written_into_the_working_directory():
    """A test that trains with the default ``output_dir`` would leave ``poros_output/`` in the checkout."""
    default = Path.cwd() / "poros_output"
    existed = default.exists()
    yield
    if not existed and default.exists():
        raise AssertionError(f"the test wrote {default} (the default output_dir); give it a tmp_path")


@pytest.fixture(scope="session")
def family_plugin():
    """The :class:`FamilyPlugin` class: ``family_plugin(descriptor, ..., name=...)`` builds a plugin."""
    return FamilyPlugin


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def child_env():
    """``child_env(**overrides)``: environment for a child Python that imports this checkout's poros."""

    def make(**overrides: str) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        env.update(overrides)
        return env

    return make


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny ops run faster on one thread, and far faster when other processes share the cores (two
    OpenMP threads wait on each other at every op). Results are thread-count invariant on CPU.
    Modules opt in with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
