"""The tiny real models and the parity helpers behind :mod:`poros.testing` (see its docstring)."""

from __future__ import annotations

import pathlib
from typing import Any

import torch
import transformers
from torch import nn

from poros.adapters import lora_target_modules
from poros.testing.descriptor_check import assert_descriptor_matches, check_descriptor  # noqa: F401 (re-exported)
from poros.testing.plugins import registered_plugin  # noqa: F401 (re-exported)
from poros.tiny import TINY_SLIDING_WINDOW, TinyShape, tiny_multimodal, tiny_variants  # noqa: F401 (re-exported)


def _builtin_tiny_variants() -> dict[str, tuple[str, ...]]:
    from poros import registry

    out = {}
    for descriptor in registry.iter_descriptors():
        names = tuple(v.name for v in tiny_variants(descriptor.name))
        if names:
            out[descriptor.name] = names
    return out


def _multimodal_families() -> tuple[str, ...]:
    from poros import registry

    return tuple(d.name for d in registry.iter_descriptors() if tiny_multimodal(d.name) is not None)


def __getattr__(name: str) -> Any:
    if name == "MULTIMODAL_FAMILIES":
        #: the registered families whose module declares a tiny multimodal model (``TINY_MULTIMODAL``).
        value = _multimodal_families()
        globals()["MULTIMODAL_FAMILIES"] = value
        return value
    if name == "TINY_VARIANTS":
        #: family name -> its tiny variants (declared by each family module as ``TINY_VARIANTS``, see
        #: :mod:`poros.tiny`), for every registered family that declares some; read at first use.
        value = _builtin_tiny_variants()
        globals()["TINY_VARIANTS"] = value
        return value
    raise AttributeError(f"module 'poros.testing.models' has no attribute {name!r}")


def tiny_config(
    family: str,
    variant: str = "default",
    *,
    num_layers: int | None = None,
    hidden_size: int | None = None,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    vocab_size: int = 256,
    attn_implementation: str = "sdpa",
    **overrides: Any,
) -> transformers.PretrainedConfig:
    """The family's real HF text config, shrunk, with every special feature on.

    Defaults: hidden 64, 4 heads, 2 KV heads, intermediate ``2 * hidden``, vocab 256, sliding
    window :data:`TINY_SLIDING_WINDOW` (8), and per variant the layer count and head dim its
    family declares (``TINY_VARIANTS`` of the family module, :class:`poros.tiny.TinyVariant`). Every layer kind of the family is present whenever ``num_layers`` allows
    (``qwen3_5`` with 2 layers: linear, full; ``gemma3`` with 2 layers: sliding, full); Gemma
    configs soft-cap the logits at 30.

    Args:
        family: a registered family whose module declares tiny variants (a key of :data:`TINY_VARIANTS`).
        variant: one of ``TINY_VARIANTS[family]``; ``"default"`` means the first one.
        num_layers: decoder layers (>= 1). ``gemma4`` ``e2b`` shares KV in the last
            ``num_layers // 2`` layers when ``num_layers >= 3`` (override with
            ``num_kv_shared_layers``; at least 2 layers must stay unshared).
        hidden_size: model width; must be a multiple of ``num_heads``.
        num_heads: query heads (>= 1).
        num_kv_heads: key/value heads; must divide ``num_heads``.
        head_dim: per-head width; even (rotary pairs). ``qwen3_5`` and ``gemma4`` (partial
            rotary, factor 0.25) need a multiple of 8. ``qwen2`` derives it from
            ``hidden_size // num_heads`` and rejects any other value.
        vocab_size: vocabulary (>= 8; token ids 0..2 are pad/eos/bos).
        attn_implementation: ``"sdpa"`` or ``"eager"``; set on ``config._attn_implementation``.
        **overrides: any other config field, applied last (e.g. ``final_logit_softcapping=None``).

    Raises:
        ValueError: unknown family/variant or an impossible shape combination; the message says
            which rule failed.
    """
    from poros.errors import UnknownArchitectureError

    try:
        declared = tiny_variants(family)
    except UnknownArchitectureError:
        declared = ()
    if not declared:
        raise ValueError(f"no tiny config for family {family!r}; known: {sorted(_builtin_tiny_variants())}")
    by_name = {v.name: v for v in declared}
    if variant == "default":
        variant = declared[0].name
    if variant not in by_name:
        raise ValueError(f"family {family!r} has no tiny variant {variant!r}; known: {list(by_name)}")
    tiny = by_name[variant]
    num_layers = tiny.num_layers if num_layers is None else num_layers
    hidden_size = 64 if hidden_size is None else hidden_size
    num_heads = 4 if num_heads is None else num_heads
    num_kv_heads = min(2, num_heads) if num_kv_heads is None else num_kv_heads
    if tiny.head_dim_from_hidden:
        if head_dim is not None and head_dim * num_heads != hidden_size:
            raise ValueError(
                f"{family} has no separate head_dim: it is hidden_size // num_heads = {hidden_size} // {num_heads}, "
                f"got head_dim={head_dim}; pass hidden_size={head_dim * num_heads} instead"
            )
        head_dim = hidden_size // max(num_heads, 1)
    head_dim = tiny.head_dim if head_dim is None else head_dim
    _validate_shape(family, num_layers=num_layers, hidden_size=hidden_size, num_heads=num_heads,
                    num_kv_heads=num_kv_heads, head_dim=head_dim, vocab_size=vocab_size,
                    head_dim_multiple=tiny.head_dim_multiple)
    if attn_implementation not in ("sdpa", "eager"):
        raise ValueError(f"attn_implementation must be 'sdpa' or 'eager', got {attn_implementation!r}")

    shape = TinyShape(num_layers=num_layers, hidden_size=hidden_size, num_heads=num_heads,
                      num_kv_heads=num_kv_heads, head_dim=head_dim, vocab_size=vocab_size)
    kwargs = dict(shape.common(), **tiny.fields(shape, overrides))
    kwargs.update(overrides)
    config_class = getattr(transformers, tiny.config_class)
    config = config_class(**kwargs)
    config._attn_implementation = attn_implementation
    return config


def _validate_shape(family: str, *, num_layers: int, hidden_size: int, num_heads: int, num_kv_heads: int,
                    head_dim: int, vocab_size: int, head_dim_multiple: int = 2) -> None:
    problems = []
    if num_layers < 1:
        problems.append(f"num_layers must be >= 1, got {num_layers}")
    if num_heads < 1 or num_kv_heads < 1:
        problems.append(f"num_heads and num_kv_heads must be >= 1, got {num_heads} and {num_kv_heads}")
    elif num_heads % num_kv_heads:
        problems.append(f"num_kv_heads={num_kv_heads} must divide num_heads={num_heads}")
    if num_heads >= 1 and (hidden_size < 1 or hidden_size % num_heads):
        problems.append(f"hidden_size={hidden_size} must be a positive multiple of num_heads={num_heads}")
    if head_dim < 2 or head_dim % 2:
        problems.append(f"head_dim={head_dim} must be even and >= 2 (rotary rotates pairs of channels)")
    elif head_dim % head_dim_multiple:
        problems.append(f"{family} rotates a quarter of each head: head_dim={head_dim} must be a multiple of "
                        f"{head_dim_multiple}")
    if vocab_size < 8:
        problems.append(f"vocab_size={vocab_size} must be >= 8 (ids 0, 1, 2 are pad, eos, bos)")
    if problems:
        raise ValueError(f"impossible tiny {family} config: " + "; ".join(problems))


def tiny_model(
    family: str,
    variant: str = "default",
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    config: transformers.PretrainedConfig | None = None,
    **config_kwargs: Any,
) -> transformers.PreTrainedModel:
    """The family's real ``*ForCausalLM`` with random weights (``torch.manual_seed(seed)``), in ``dtype``.

    Built with ``AutoModelForCausalLM.from_config(config, dtype=dtype)``, which keeps the fp32
    rotary buffers. Every 1-D parameter (norm weights, biases, router scales, ``A_log``...) gets
    ``N(0, 0.1^2)`` noise and every ``layer_scalar`` buffer a value in ``[0.6, 1.4)``, both from
    a generator seeded with ``seed``, so that norm offsets, biases and scalars matter.

    Args:
        config: a config to use instead of ``tiny_config(family, variant, **config_kwargs)``.
        **config_kwargs: forwarded to :func:`tiny_config`.

    Raises:
        TypeError: both ``config`` and ``config_kwargs`` were given.
    """
    if config is None:
        config = tiny_config(family, variant, **config_kwargs)
    elif config_kwargs:
        raise TypeError(f"pass either config or config keywords, not both (got {sorted(config_kwargs)})")
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        config, dtype=dtype, attn_implementation=config._attn_implementation,
    )
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, parameter in sorted(model.named_parameters()):
            if parameter.ndim == 1:
                noise = torch.randn(parameter.shape, generator=generator) * 0.1
                parameter.add_(noise.to(parameter.dtype))
        for name, buffer in sorted(model.named_buffers()):
            if name.rsplit(".", 1)[-1] == "layer_scalar":
                buffer.copy_((0.6 + 0.8 * torch.rand(buffer.shape, generator=generator)).to(buffer.dtype))
    return model


def save_tiny_checkpoint(
    path: str | pathlib.Path,
    family: str,
    variant: str = "default",
    *,
    seed: int = 0,
    max_shard_size: int | str = "200KB",
    **config_kwargs: Any,
) -> pathlib.Path:
    """``save_pretrained`` a :func:`tiny_model` into ``path`` (safetensors, sharded); returns ``path``.

    The small default ``max_shard_size`` makes even tiny checkpoints multi-shard, as real ones are.
    """
    path = pathlib.Path(path)
    model = tiny_model(family, variant, seed=seed, **config_kwargs)
    model.save_pretrained(path, max_shard_size=max_shard_size)
    return path


def tiny_vlm(family: str, *, seed: int = 0, **config_kwargs: Any) -> transformers.PreTrainedModel:
    """The family's real multimodal model (``*ForConditionalGeneration``) around a :func:`tiny_config`
    text tower and a one-layer vision tower, random weights (``torch.manual_seed(seed)``), bf16. The
    family module declares it (``TINY_MULTIMODAL``, :class:`poros.tiny.TinyMultimodal`).

    Real Gemma 3 (4B+), Gemma 4 and Qwen 3.5/3.6 checkpoints have this shape; ``save_pretrained`` writes
    the text weights under ``model.language_model.*`` (Gemma 3: the legacy ``language_model.model.*``).

    Raises:
        KeyError: ``family`` is not in :data:`MULTIMODAL_FAMILIES`.
    """
    from poros.errors import UnknownArchitectureError

    try:
        declared = tiny_multimodal(family)
    except UnknownArchitectureError:
        declared = None
    if declared is None:
        raise KeyError(f"no tiny multimodal model for {family!r}; choose one of {_multimodal_families()}")
    text = tiny_config(family, **config_kwargs).to_dict()
    config = getattr(transformers, declared.config_class)(text_config=text, **declared.fields(text))
    torch.manual_seed(seed)
    return getattr(transformers, declared.model_class)._from_config(config, dtype=torch.bfloat16)


def load_qlora(
    path: str | pathlib.Path,
    *,
    lora_rank: int = 8,
    lora_alpha: int = 16,
    target_modules: str | list[str] | tuple[str, ...] = "all-linear",
    use_rslora: bool = False,
    use_dora: bool = False,
    compute_dtype: torch.dtype = torch.bfloat16,
    double_quant: bool = False,
    quant_type: str = "nf4",
    attn_implementation: str | None = None,
    seed: int = 0,
    lora_init: str = "random",
):
    """Load a checkpoint the way the parity reference does: NF4 base (bitsandbytes) + PEFT LoRA.

    ``from_pretrained(path, quantization_config=BitsAndBytesConfig(load_in_4bit=True, ...),
    device_map={"": "cpu"}, dtype=compute_dtype)``, then ``torch.manual_seed(seed)`` and
    ``get_peft_model(LoraConfig(r, alpha, lora_dropout=0.0, target_modules, task_type="CAUSAL_LM"))``.
    The model is returned in ``train()`` mode.

    Args:
        target_modules: PEFT target modules. ``"all-linear"`` is resolved through the family
            descriptor (``poros.registry.for_config(config)``): its ``lora_targets_all_linear``
            leaf names plus the ``model_level_linears`` present on the model. That is PEFT's own
            all-linear set minus what the descriptor excludes (Gemma 4's router ``proj``).
        attn_implementation: ``"sdpa"``/``"eager"``; ``None`` keeps transformers' default.
        lora_init: ``"random"``: after PEFT's init, every ``lora_B`` gets ``N(0, 0.02^2)`` values
            from a generator seeded with ``seed``, so the adapters change the output and
            ``lora_A`` receives non-zero gradients at step 0 (what parity tests need).
            ``"default"``: PEFT's init (``lora_B`` zero).

    Raises:
        ValueError: ``lora_init`` is not ``"random"`` or ``"default"``.
    """
    import peft

    if lora_init not in ("random", "default"):
        raise ValueError(f"lora_init must be 'random' or 'default', got {lora_init!r}")
    quantization_config = transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type=quant_type, bnb_4bit_compute_dtype=compute_dtype,
        bnb_4bit_use_double_quant=double_quant,
    )
    extra = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=quantization_config, device_map={"": "cpu"}, dtype=compute_dtype, **extra,
    )
    if target_modules == "all-linear":
        target_modules = all_linear_targets(model)
    lora_config = peft.LoraConfig(
        r=lora_rank, lora_alpha=lora_alpha, lora_dropout=0.0, target_modules=target_modules,
        use_rslora=use_rslora, use_dora=use_dora, task_type="CAUSAL_LM",
    )
    torch.manual_seed(seed)
    peft_model = peft.get_peft_model(model, lora_config)
    if lora_init == "random":
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, parameter in sorted(peft_model.named_parameters()):
                if ".lora_B." in name:
                    noise = torch.randn(parameter.shape, generator=generator) * 0.02
                    parameter.copy_(noise.to(parameter.dtype))
    peft_model.train()
    return peft_model


def all_linear_targets(model: nn.Module) -> list[str]:
    """PEFT target names for "all-linear" per the family descriptor (see :func:`load_qlora`):
    :func:`poros.adapters.lora_target_modules`, the targets PorosTrainer uses."""
    return lora_target_modules(model, "all-linear")


def qlora_model(
    family: str,
    variant: str = "default",
    *,
    tmp_path: str | pathlib.Path,
    seed: int = 0,
    config_kwargs: dict[str, Any] | None = None,
    **lora_kwargs: Any,
):
    """:func:`save_tiny_checkpoint` into ``tmp_path`` (same ``seed``), then :func:`load_qlora` it."""
    path = save_tiny_checkpoint(pathlib.Path(tmp_path) / f"{family}-{variant}-{seed}", family, variant,
                                seed=seed, **(config_kwargs or {}))
    return load_qlora(path, seed=seed, **lora_kwargs)


class Rows(torch.utils.data.Dataset):
    """A list of ready-made rows (dicts of tensors) as the ``train_dataset`` HF ``Trainer`` and TRL take."""

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        return self.rows[index]


# -- parity: a resident reference against the streamed run ---------------------------------------

def train_adamw(model, parameters, batches, lr=1e-2):
    """One AdamW step per batch (``loss.backward()``, ``step``, ``zero_grad(set_to_none=True)``);
    returns ``(losses, optimizer)``: the detached losses and the optimizer with its state."""
    optimizer = torch.optim.AdamW(parameters, lr=lr)
    losses = []
    for batch in batches:
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return losses, optimizer


def trainable_parameters(model) -> dict[str, torch.nn.Parameter]:
    """The parameters that train (the adapters), by name."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def assert_bitwise_training(reference, streamed, ref_losses, poros_losses, ref_opt, poros_opt):
    """Zero tolerance: every step's loss, every trainable tensor and every AdamW state tensor of the
    streamed run ``torch.equal`` the resident reference's (as :func:`train_adamw` returns them)."""
    assert len(ref_losses) == len(poros_losses)
    for step, (a, b) in enumerate(zip(ref_losses, poros_losses)):
        assert torch.equal(a, b), f"step {step}: loss {a.item()!r} (resident) != {b.item()!r} (streamed)"
    ref_params, poros_params = trainable_parameters(reference), trainable_parameters(streamed)
    assert ref_params.keys() == poros_params.keys() and ref_params
    differing = [n for n in ref_params if not torch.equal(ref_params[n], poros_params[n])]
    assert not differing, f"{len(differing)}/{len(ref_params)} LoRA tensors differ, e.g. {differing[:3]}"
    for name in ref_params:
        ref_state, poros_state = ref_opt.state[ref_params[name]], poros_opt.state[poros_params[name]]
        assert ref_state.keys() == poros_state.keys()
        for key in ref_state:
            assert torch.equal(ref_state[key], poros_state[key]), f"AdamW {key} of {name} differs"


def mapping_memory(pid: int | str, path: str | pathlib.Path, mode: str | None = None) -> tuple[int, int]:
    """(Rss, Pss) in kB of process ``pid``'s mappings of ``path`` (``"self"``: this process), from
    ``/proc/<pid>/smaps`` (Linux): pages another process maps too count in part in Pss. ``mode``
    (``"r--s"``: shared, read-only) counts only the mappings with those permissions."""
    rss = pss = 0
    inside = False
    for line in pathlib.Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split(" ", 1)[0]
        if "-" in head and not head.endswith(":"):
            inside = line.rstrip().endswith(str(path)) and (mode is None or line.split()[1] == mode)
        elif inside and line.startswith("Rss:"):
            rss += int(line.split()[1])
        elif inside and line.startswith("Pss:"):
            pss += int(line.split()[1])
    return rss, pss
