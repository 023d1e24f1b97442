"""Poros: fine-tune large LLMs (QLoRA) on small GPUs by streaming the frozen NF4 base block by block.

Importing ``poros`` never imports torch: the public API is resolved lazily (PEP 562), so
``import poros``, ``poros --help``, ``poros list-architectures`` and ``poros doctor`` work on a
machine without the ML stack.
"""

from __future__ import annotations

import importlib
from typing import Any

from poros.hookspecs import hookimpl

__version__ = "0.1.0"

_LAZY = {
    "ArchitectureDescriptor": "poros.descriptor",
    "CarriedState": "poros.descriptor",
    "HostAdamW": "poros.stream.host_optimizer",
    "PorosConfig": "poros.config",
    "PorosModel": "poros.model",
    "PorosCallback": "poros.integrations",
    "prepare_trainer": "poros.integrations",
    "PorosTrainer": "poros.trainer",
    "prepare": "poros.model",
    "patch_hf_model": "poros.model",
    "registry": "poros.registry",
    "errors": "poros.errors",
    "PorosError": "poros.errors",
}

__all__ = ["__version__", "hookimpl", *sorted(_LAZY)]


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
