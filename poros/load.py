"""Checkpoint loading for PorosTrainer (INTERIM: transformers' own from_pretrained; being replaced by
the streamed shard-by-shard loader with the same interface)."""

from __future__ import annotations

import pathlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from poros.descriptor import ArchitectureDescriptor


@dataclass
class LoadedModel:
    """What :func:`load_pretrained` returns.

    Attributes:
        model: the HF causal LM of the text tower (e.g. ``Qwen3ForCausalLM``), NF4 base, no adapters.
        tokenizer: the checkpoint's tokenizer (``AutoTokenizer``), or None when not asked for.
        path: the local checkpoint directory.
        descriptor: the family descriptor that streams it.
    """

    model: nn.Module
    tokenizer: Any
    path: pathlib.Path
    descriptor: ArchitectureDescriptor


def load_pretrained(
    name_or_path: str | pathlib.Path,
    *,
    quantization: str = "nf4",
    compute_dtype: torch.dtype | str = torch.bfloat16,
    double_quant: bool = False,
    device: torch.device | str | None = None,
    attn_implementation: str | None = None,
    load_tokenizer: bool = True,
    allow_pickle: bool = False,
    revision: str | None = None,
) -> LoadedModel:
    import transformers

    from poros import registry

    if isinstance(compute_dtype, str):
        compute_dtype = getattr(torch, compute_dtype)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    path = pathlib.Path(name_or_path)
    quantization_config = transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type=quantization, bnb_4bit_compute_dtype=compute_dtype,
        bnb_4bit_use_double_quant=double_quant,
    )
    extra = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=quantization_config, device_map={"": str(device)}, dtype=compute_dtype,
        **extra,
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(path) if load_tokenizer else None
    return LoadedModel(model, tokenizer, path, registry.for_config(model.config))
