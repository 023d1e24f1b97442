"""One error hierarchy. Every message says what was found, what was expected, and the fix."""

from __future__ import annotations


class PorosError(Exception):
    """Base class of every error Poros raises on purpose."""


class UnknownArchitectureError(PorosError, LookupError):
    """A name, alias or HF ``model_type`` that no registered family claims."""


class DuplicateArchitectureError(PorosError):
    """Two plugins claim the same family name, alias or HF ``model_type``."""


class PluginError(PorosError):
    """A plugin could not be loaded or registered something invalid."""


class DescriptorError(PorosError, ValueError):
    """An ArchitectureDescriptor is malformed or does not match the model it describes."""


class UnsupportedModelError(PorosError):
    """The model handed to Poros cannot be streamed as it is (wrong class, quantization, adapters...)."""


class StreamingError(PorosError, RuntimeError):
    """The block store or executor found an inconsistent state (e.g. compute with an evicted block)."""


__all__ = [name for name in dir() if name.endswith("Error")]
