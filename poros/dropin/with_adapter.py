"""Load the base an adapter was trained on, add the adapter, stream it: what ``poros generate`` and a
user's inference script start from. Drop-in layer: it ends in :func:`poros.prepare`."""

from __future__ import annotations

import os

import torch

from poros.dropin.model import prepare
from poros.export.adapter_fit import check_adapter_base
from poros.loading.load import TOKENIZER_FILES, load_pretrained, read_adapter


def load_with_adapter(adapter: str | os.PathLike, *, model: str | os.PathLike | None = None,
                      device: torch.device | str | None = None, num_slots: int | None = None,
                      resident_blocks: int | None = None):
    """Load the base an adapter was trained on (4-bit, blocks on the host), add the adapter, stream it.

    The base is loaded as the training run loaded it (``quantization``, ``compute_dtype``,
    ``double_quant``, ``attn_implementation``, ``revision`` from the adapter's ``poros_config.json``;
    Poros's defaults otherwise) with :func:`load_pretrained`; the adapter with PEFT's own
    ``PeftModel.from_pretrained`` (frozen: it streams with its block). The tokenizer is the adapter
    directory's when it has one, else the base checkpoint's.

    Returns:
        ``(PorosModel, tokenizer)``; the tokenizer is None when neither directory has one.

    Raises:
        CheckpointLoadError: see :func:`read_adapter` and :func:`load_pretrained`.
        UnknownArchitectureError, and the gates of :func:`poros.prepare`.
    """
    import peft
    import transformers

    info = read_adapter(adapter, model)
    trained = info.poros_config
    check_adapter_base(info, revision=trained.get("revision"))  # another base's adapter: one line, no weight read
    loaded = load_pretrained(
        info.base_model, quantization=trained.get("quantization", "nf4"),
        compute_dtype=trained.get("compute_dtype", "bfloat16"), double_quant=trained.get("double_quant", False),
        device=device, attn_implementation=trained.get("attn_implementation"), revision=trained.get("revision"))
    peft_model = peft.PeftModel.from_pretrained(loaded.model, info.path)
    tokenizer = loaded.tokenizer
    if any((info.path / name).is_file() for name in TOKENIZER_FILES):
        tokenizer = transformers.AutoTokenizer.from_pretrained(info.path)
    return prepare(peft_model, num_slots=num_slots, resident_blocks=resident_blocks), tokenizer
