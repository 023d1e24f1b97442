"""The pluggy hook specifications of Poros. Every hook is named ``poros_*``.

This file is the contract for plugin authors: each docstring says what the hook receives, when
it is called, and what it returns. ``docs/plugins.md`` documents the same signatures and a test
checks that the two agree.
"""

from __future__ import annotations

from typing import Callable

import pluggy

hookspec = pluggy.HookspecMarker("poros")
hookimpl = pluggy.HookimplMarker("poros")


@hookspec
def poros_register_architectures(register: Callable[..., None]) -> None:
    """Register model families.

    Called once, when the registry is first used, for every loaded plugin (built-in families
    included). Call ``register(descriptor)`` once per family with a
    :class:`poros.descriptor.ArchitectureDescriptor`. ``register`` validates the descriptor and
    rejects a name, alias or HF ``model_type`` that another plugin already registered
    (:class:`poros.errors.DuplicateArchitectureError`, naming both plugins). Return nothing.
    """
