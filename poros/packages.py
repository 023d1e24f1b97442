"""The packages Poros runs on, in one place: the lists of names, their installed versions (read from
package metadata, never imported) and the install hint. Core: imports nothing from Poros."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys

#: The ``[train]`` extra of poros-train (a test checks this against pyproject.toml).
TRAIN_PACKAGES = ("torch", "transformers", "peft", "bitsandbytes", "safetensors", "datasets", "xxhash")
#: Reported by ``poros doctor`` when present; training does not need them.
OPTIONAL_PACKAGES = ("accelerate",)
#: The packages ``poros train`` / ``poros plan`` import: the train extra less ``datasets`` (only hub
#: datasets need it, and :mod:`poros.data.sources` reports its absence itself) and ``xxhash`` (the
#: cache falls back to crc32 without it).
RUN_PACKAGES = ("torch", "transformers", "peft", "bitsandbytes", "safetensors")
#: The packages whose versions decide the bits of a run: ranks must agree, and cache entries are keyed by them.
BITS_PACKAGES = ("torch", "transformers", "peft", "bitsandbytes")
INSTALL_HINT = "pip install 'poros-train[train]'"


def installed_version(distribution: str) -> str | None:
    """Version of an installed distribution from its metadata, or ``None``; never imports it."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions(names: tuple[str, ...], *, absent: str = "absent") -> dict[str, str]:
    """``{name: version}`` for each of ``names``, ``absent`` where one is not installed."""
    return {name: installed_version(name) or absent for name in names}


def missing_packages(names: tuple[str, ...] = RUN_PACKAGES) -> list[str]:
    """The packages of ``names`` that cannot be imported (not installed, or blocked)."""
    missing = []
    for name in names:
        if name in sys.modules and sys.modules[name] is None:  # import blocked: it raises ImportError
            missing.append(name)
            continue
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    return missing
