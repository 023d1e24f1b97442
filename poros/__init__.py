"""Poros: fine-tune large LLMs (QLoRA) on small GPUs by streaming the frozen NF4 base block by block.

Importing ``poros`` never imports torch: the public API is resolved lazily (PEP 562), so
``import poros``, ``poros --help``, ``poros list-architectures`` and ``poros doctor`` work on a
machine without the ML stack.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from typing import Any

from poros.hookspecs import hookimpl

__version__ = "0.1.0"

_LAZY = {
    "ArchitectureDescriptor": "poros.descriptor",
    "CarriedState": "poros.descriptor",
    "HostAdamW": "poros.stream.host_optimizer",
    "PorosConfig": "poros.config",
    "StreamOptions": "poros.stream.options",
    "PorosModel": "poros.dropin.model",
    "PorosCallback": "poros.dropin.integrations",
    "prepare_trainer": "poros.dropin.integrations",
    "PorosTrainer": "poros.training.trainer",
    "prepare": "poros.dropin.model",
    "from_pretrained": "poros.loading.host_blocks",
    "quantize_experts": "poros.loading.experts",
    "patch_hf_model": "poros.dropin.model",
    "registry": "poros.registry",
    "errors": "poros.errors",
    "PorosError": "poros.errors",
}

__all__ = ["__version__", "hookimpl", *sorted(_LAZY)]

#: Old module paths (before the layers became folders) -> where the module lives now. ``import
#: poros.load`` gives the very module object ``poros.loading.load`` (so a monkeypatch through
#: either name patches both), and ``python -m poros.testing_distributed`` still runs.
MOVED_MODULES = {
    "poros.cache": "poros.loading.cache",
    "poros.cache_blocks": "poros.loading.cache_blocks",
    "poros.checkpoint": "poros.training.checkpoint",
    "poros.descriptor_check": "poros.testing.descriptor_check",
    "poros.diagnostics": "poros.doctor.diagnostics",
    "poros.evaluation": "poros.training.evaluation",
    "poros.generate": "poros.export.generate",
    "poros.gpu_probe": "poros.doctor.gpu_probe",
    "poros.host_tiers": "poros.plan.host_tiers",
    "poros.integrations": "poros.dropin.integrations",
    "poros.load": "poros.loading.load",
    "poros.merge": "poros.export.merge",
    "poros.model": "poros.dropin.model",
    "poros.loading.host_tiers": "poros.plan.host_tiers",
    "poros.plugin_testing": "poros.testing.plugins",
    "poros.probe": "poros.doctor.probe",
    "poros.progress": "poros.training.progress",
    "poros.run_lock": "poros.training.run_lock",
    "poros.run_plan": "poros.plan.run_plan",
    "poros.stop": "poros.training.stop",
    "poros.stream.attention": "poros.plan.attention",
    "poros.stream.chunk_choice": "poros.plan.chunk_choice",
    "poros.stream.footprint": "poros.plan.footprint",
    "poros.stream.planner": "poros.plan.budget",
    "poros.stream.step_time": "poros.plan.step_time",
    "poros.stream.units": "poros.spellings",
    "poros.testing_distributed": "poros.testing.distributed",
    "poros.tracking": "poros.training.tracking",
    "poros.training.plan": "poros.plan.run_plan",
    "poros.trainer": "poros.training.trainer",
    "poros.validation": "poros.training.validation",
}
#: names that moved out of an old module into another layer: old module -> {name: its module now}
MOVED_NAMES = {"poros.loading.load": {"load_with_adapter": "poros.dropin.with_adapter"}}


class _MovedModuleLoader(importlib.abc.Loader):
    """Loads an old module path as the module that now holds it (the same object)."""

    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        module = importlib.import_module(self.target)
        for name, home in MOVED_NAMES.get(self.target, {}).items():
            if not hasattr(module, name):
                setattr(module, name, getattr(importlib.import_module(home), name))
        return module

    def exec_module(self, module: Any) -> None:
        """The module is already executed under its new name."""

    def get_code(self, fullname: str) -> Any:  # ``python -m <old path>`` (runpy)
        spec = importlib.util.find_spec(self.target)
        return spec.loader.get_code(self.target)


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        new = MOVED_MODULES.get(fullname)
        return importlib.machinery.ModuleSpec(fullname, _MovedModuleLoader(new)) if new else None


if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModuleFinder())


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'poros' has no attribute {name!r}")
    module = importlib.import_module(module_name)
    value = module if module_name.rsplit(".", 1)[-1] == name else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def _quiet_on_import() -> None:
    """A Python script sees what ``poros train`` shows: the known third-party notices hidden (``poros.noise``;
    ``POROS_VERBOSE=1`` keeps them)."""
    from poros.noise import quiet_on_import

    quiet_on_import()


_quiet_on_import()
