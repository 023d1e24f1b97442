"""Test helpers: tiny real models per family, QLoRA loading as the reference does it, the descriptor contract.

Everything here builds the *real* transformers classes (``Qwen2ForCausalLM``, ``Gemma4ForCausalLM``...)
from shrunken configs with random weights; nothing is downloaded. Poros's own tests and third-party
family plugins use the same helpers::

    from poros.testing import assert_descriptor_matches, qlora_model, tiny_model

    def test_my_family(tmp_path):
        assert_descriptor_matches(MY_DESCRIPTOR, tiny_model("qwen3"))
        model = qlora_model("qwen3", tmp_path=tmp_path)   # NF4 base + LoRA, as the parity reference

Notable choices:

* **Families declare their tiny variants** (``TINY_VARIANTS`` in the family module, next to its
  descriptor: :mod:`poros.tiny`), so :func:`tiny_config` builds a tiny model for any registered
  family, a plugin's included; the descriptor contract lives in :mod:`poros.testing.descriptor_check`.
* Tiny configs switch every special feature of the family on and represent every layer kind
  the layer count allows (sliding windows shorter than test sequences, soft-capping, KV sharing,
  per-layer inputs, MoE...), so a streaming bug that ignores a quirk shows up as a difference.
* Models are built with the model's own ``dtype`` argument, never ``.to(bfloat16)`` afterwards:
  that would round the fp32 rotary ``inv_freq`` buffers and change cos/sin.
* Norm weights, biases, other 1-D parameters and Gemma 4's ``layer_scalar`` buffers are perturbed
  (deterministically from the seed) so that ``1 + w`` offsets, biases and scalars matter.
* :func:`load_qlora` keeps the model in ``train()`` mode: bitsandbytes on AVX512-BF16 CPUs repacks
  NF4 weights in place when run in eval mode without grad, which breaks later training.

Importing ``poros.testing`` imports nothing heavy: each helper is looked up on first use (PEP 562),
and the models' module (:mod:`poros.testing.models`) imports torch, transformers, PEFT and bitsandbytes;
``poros.testing.plugins`` stays torch-free.

May import: poros.plan, poros.stream, poros.families, poros.data, and the core.
"""

from __future__ import annotations

import importlib
from typing import Any

#: what lives where; everything else is in :mod:`poros.testing.models`
_ELSEWHERE = {"registered_plugin": "poros.testing.plugins", "builtin_families": "poros.testing.plugins"}

__all__ = [
    "MULTIMODAL_FAMILIES",
    "tiny_vlm",
    "TINY_VARIANTS",
    "all_linear_targets",
    "assert_bitwise_training",
    "assert_descriptor_matches",
    "builtin_families",
    "check_descriptor",
    "load_qlora",
    "mapping_memory",
    "qlora_model",
    "registered_plugin",
    "save_tiny_checkpoint",
    "tiny_config",
    "tiny_model",
    "train_adamw",
    "trainable_parameters",
]


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    module = importlib.import_module(_ELSEWHERE.get(name, "poros.testing.models"))
    try:
        value = getattr(module, name)
    except AttributeError:
        raise AttributeError(f"module 'poros.testing' has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
