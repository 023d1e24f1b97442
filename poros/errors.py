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


# -- gates of poros.prepare: raised before any weight moves ------------------------------------
class AlreadyPreparedError(UnsupportedModelError):
    """``prepare``/``patch_hf_model`` was called on a model that is already streamed."""


class BaseNotFrozenError(UnsupportedModelError):
    """A base (non-adapter) weight requires grad; Poros trains frozen-base adapters only."""


class TrainableInBlockError(BaseNotFrozenError):
    """A decoder block holds a trainable parameter that is not an adapter parameter."""


class OffloadedModelError(UnsupportedModelError):
    """The model was dispatched by accelerate with CPU/disk offload (``device_map``)."""


class QuantizationError(UnsupportedModelError):
    """The base is quantized in a way the block store cannot stream (e.g. bitsandbytes 8-bit)."""


class UnsupportedAdapterError(UnsupportedModelError):
    """The PEFT adapter type is not in Poros's adapter matrix."""


class CheckpointingError(UnsupportedModelError):
    """HF gradient checkpointing is configured in a way that changes the math (reentrant)."""


class TorchCompileError(UnsupportedModelError):
    """``torch.compile`` around a streamed model (inductor would bake one block's tensors into a graph)."""


class CacheDuringTrainingError(PorosError, ValueError):
    """``use_cache=True`` was passed to a training forward."""


class GuaranteeError(PorosError):
    """The guarantee label that applies is weaker than ``prepare(require=...)`` asked for."""


# -- loading, data, configuration and checkpoints -----------------------------------------------
class CheckpointLoadError(PorosError):
    """A model checkpoint cannot be loaded: missing shard or file, tensor shape mismatch, unsafe format."""


class DataError(PorosError, ValueError):
    """A dataset cannot be turned into training examples (unknown columns, no trainable tokens...)."""


class ConfigError(PorosError, ValueError):
    """A Poros configuration (``poros.yaml``, CLI override, PorosConfig field) is invalid."""


class HostMemoryError(ConfigError):
    """The run needs more host RAM than the machine has, and no plan fits it (or not with the host budget given)."""


class TrainingCheckpointError(PorosError):
    """A training checkpoint (``checkpoint-{step}/``) is missing, incomplete or does not match the run."""


class CacheEntryError(PorosError):
    """An NF4 block cache entry is damaged (truncated, a checksum differs) or does not fit the model loaded."""


class DistributedError(PorosError, RuntimeError):
    """A data-parallel run is inconsistent: world size vs batch, versions across ranks, a lost rank."""


# -- the run's surroundings: output directory, device, installed extras ---------------------------
class OutputDirError(PorosError):
    """``output_dir`` cannot take this run: it is a file, is not writable, is full, or holds another run's results."""


class RunLockedError(OutputDirError):
    """Another live run holds ``output_dir`` (its ``.poros.lock`` names the pid and host)."""


class DeviceError(PorosError, RuntimeError):
    """The requested device is not available in this install (e.g. ``--device cuda`` on a CPU-only torch), or a
    prepared model was asked to move to another device or dtype."""


class MissingDependencyError(PorosError, ImportError):
    """A package of the ``train`` extra is not installed (``pip install 'poros-train[train]'``)."""


__all__ = [name for name in dir() if name.endswith("Error")]

