"""Test helpers: tiny real models per family, QLoRA loading as the reference does it, the descriptor contract.

Everything here builds the *real* transformers classes (``Qwen2ForCausalLM``, ``Gemma4ForCausalLM``...)
from shrunken configs with random weights; nothing is downloaded. Poros's own tests and third-party
family plugins use the same helpers::

    from poros.testing import assert_descriptor_matches, qlora_model, tiny_model

    def test_my_family(tmp_path):
        assert_descriptor_matches(MY_DESCRIPTOR, tiny_model("qwen3"))
        model = qlora_model("qwen3", tmp_path=tmp_path)   # NF4 base + LoRA, as the parity reference

Notable choices:

* Tiny configs switch every special feature of the family on and represent every layer kind
  the layer count allows (sliding windows shorter than test sequences, soft-capping, KV sharing,
  per-layer inputs, MoE...), so a streaming bug that ignores a quirk shows up as a difference.
* Models are built with the model's own ``dtype`` argument, never ``.to(bfloat16)`` afterwards:
  that would round the fp32 rotary ``inv_freq`` buffers and change cos/sin.
* Norm weights, biases, other 1-D parameters and Gemma 4's ``layer_scalar`` buffers are perturbed
  (deterministically from the seed) so that ``1 + w`` offsets, biases and scalars matter.
* :func:`load_qlora` keeps the model in ``train()`` mode: bitsandbytes on AVX512-BF16 CPUs repacks
  NF4 weights in place when run in eval mode without grad, which breaks later training.

Importing this module imports torch, transformers, PEFT and bitsandbytes; ``import poros`` never
imports it.
"""

from __future__ import annotations

import inspect
import pathlib
from typing import Any

import torch
import transformers
from torch import nn

from poros.adapters import causal_lm_of, lora_target_modules
from poros.descriptor import ArchitectureDescriptor, resolve_path
from poros.errors import DescriptorError
from poros.plugin_testing import registered_plugin

__all__ = [
    "MULTIMODAL_FAMILIES",
    "tiny_vlm",
    "TINY_VARIANTS",
    "all_linear_targets",
    "assert_descriptor_matches",
    "check_descriptor",
    "load_qlora",
    "qlora_model",
    "registered_plugin",
    "save_tiny_checkpoint",
    "tiny_config",
    "tiny_model",
]

#: family name -> tiny variants :func:`tiny_config` knows. ``qwen2``/``qwen3`` ``sliding``:
#: ``use_sliding_window`` with the upper half of the layers sliding. ``gemma4`` ``e2b``: per-layer
#: inputs, KV sharing (``num_layers // 2`` shared layers when ``num_layers >= 3``), double-wide MLP
#: on shared layers, ``global_head_dim``. ``gemma4`` ``moe``: MoE block (4 experts, top 2),
#: ``attention_k_eq_v`` with 1 global KV head, per-layer inputs off (modelled on 26B-A4B).
TINY_VARIANTS: dict[str, tuple[str, ...]] = {
    "qwen2": ("default", "sliding"),
    "qwen3": ("default", "sliding"),
    "qwen3_5": ("default",),
    "gemma3": ("default",),
    "gemma4": ("e2b", "moe"),
}

_CONFIG_CLASSES = {
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
    "qwen3_5": "Qwen3_5TextConfig",
    "gemma3": "Gemma3TextConfig",
    "gemma4": "Gemma4TextConfig",
}
#: default (num_layers, head_dim) per (family, variant); hidden size 64, 4 heads, 2 KV heads everywhere.
_DEFAULT_SHAPES = {
    ("qwen2", "default"): (2, 16),
    ("qwen2", "sliding"): (4, 16),
    ("qwen3", "default"): (2, 32),   # explicit head_dim != hidden / heads, as in Qwen3-0.6B
    ("qwen3", "sliding"): (4, 32),
    ("qwen3_5", "default"): (4, 32),  # partial rotary 0.25 -> 8 rotary channels, mrope [2, 1, 1]
    ("gemma3", "default"): (4, 16),
    ("gemma4", "e2b"): (6, 16),
    ("gemma4", "moe"): (4, 16),
}
#: sliding window of every tiny config: shorter than the sequences tests use, so sliding masks matter.
TINY_SLIDING_WINDOW = 8
SLIDING, FULL, LINEAR = "sliding_attention", "full_attention", "linear_attention"


def _pattern(num_layers: int, period: int, *, every: str, other: str) -> list[str]:
    """``other`` except every ``period``-th layer (1-based) and the last one, which are ``every``."""
    period = max(1, min(period, num_layers))
    return [every if (i + 1) % period == 0 or i == num_layers - 1 else other for i in range(num_layers)]


def _gemma4_layer_types(num_layers: int, num_kv_shared_layers: int) -> list[str]:
    """Sliding layers ending in a full one, in the unshared prefix and in the shared tail alike.

    Both kinds must be produced before the first KV-shared layer (HF checks it), and the last
    layer must be full.
    """
    unshared = num_layers - num_kv_shared_layers
    head = [SLIDING] * (unshared - 1) + [FULL] if unshared else []
    tail = [SLIDING] * (num_kv_shared_layers - 1) + [FULL] if num_kv_shared_layers else []
    return head + tail


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
    window :data:`TINY_SLIDING_WINDOW` (8), and per variant the layer count and head dim of
    ``_DEFAULT_SHAPES``. Every layer kind of the family is present whenever ``num_layers`` allows
    (``qwen3_5`` with 2 layers: linear, full; ``gemma3`` with 2 layers: sliding, full); Gemma
    configs soft-cap the logits at 30.

    Args:
        family: a key of :data:`TINY_VARIANTS`.
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
    if family not in TINY_VARIANTS:
        raise ValueError(f"no tiny config for family {family!r}; known: {sorted(TINY_VARIANTS)}")
    variants = TINY_VARIANTS[family]
    if variant == "default":
        variant = variants[0]
    if variant not in variants:
        raise ValueError(f"family {family!r} has no tiny variant {variant!r}; known: {list(variants)}")
    default_layers, default_head_dim = _DEFAULT_SHAPES[(family, variant)]
    num_layers = default_layers if num_layers is None else num_layers
    hidden_size = 64 if hidden_size is None else hidden_size
    num_heads = 4 if num_heads is None else num_heads
    num_kv_heads = min(2, num_heads) if num_kv_heads is None else num_kv_heads
    if family == "qwen2":
        if head_dim is not None and head_dim * num_heads != hidden_size:
            raise ValueError(
                f"qwen2 has no separate head_dim: it is hidden_size // num_heads = {hidden_size} // {num_heads}, "
                f"got head_dim={head_dim}; pass hidden_size={head_dim * num_heads} instead"
            )
        head_dim = hidden_size // max(num_heads, 1)
    head_dim = default_head_dim if head_dim is None else head_dim
    _validate_shape(family, num_layers=num_layers, hidden_size=hidden_size, num_heads=num_heads,
                    num_kv_heads=num_kv_heads, head_dim=head_dim, vocab_size=vocab_size)
    if attn_implementation not in ("sdpa", "eager"):
        raise ValueError(f"attn_implementation must be 'sdpa' or 'eager', got {attn_implementation!r}")

    common = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=512, pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )
    kwargs: dict[str, Any]
    if family in ("qwen2", "qwen3"):
        sliding = variant == "sliding"
        kwargs = dict(
            common, tie_word_embeddings=family == "qwen2",
            rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
            use_sliding_window=sliding, sliding_window=TINY_SLIDING_WINDOW,
            max_window_layers=num_layers // 2 if sliding else num_layers,
        )
        if family == "qwen3":
            kwargs.update(head_dim=head_dim, attention_bias=False)
    elif family == "qwen3_5":
        rotary_pairs = int(head_dim * 0.25) // 2
        kwargs = dict(
            common, head_dim=head_dim, tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.25,
                "mrope_section": [rotary_pairs - 2 * (rotary_pairs // 3), rotary_pairs // 3, rotary_pairs // 3],
                "mrope_interleaved": True,
            },
            layer_types=_pattern(num_layers, 4, every=FULL, other=LINEAR),
            linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_num_key_heads=num_kv_heads, linear_num_value_heads=num_heads,
        )
    elif family == "gemma3":
        kwargs = dict(
            common, head_dim=head_dim, tie_word_embeddings=True,
            query_pre_attn_scalar=24,  # != head_dim: scaling must come from the config, not head_dim
            sliding_window=TINY_SLIDING_WINDOW, final_logit_softcapping=30.0,
            layer_types=_pattern(num_layers, 6, every=FULL, other=SLIDING),
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
            },
        )
    else:  # gemma4
        e2b = variant == "e2b"
        shared = overrides.pop("num_kv_shared_layers", num_layers // 2 if e2b and num_layers >= 3 else 0)
        if shared and not 2 <= num_layers - shared < num_layers:
            raise ValueError(
                f"impossible tiny gemma4 config: num_kv_shared_layers={shared} of num_layers={num_layers}; KV "
                "sharing needs at least 2 unshared layers (one producer per layer kind) before the shared ones"
            )
        kwargs = dict(
            common, head_dim=head_dim, global_head_dim=2 * head_dim, tie_word_embeddings=True,
            sliding_window=TINY_SLIDING_WINDOW, final_logit_softcapping=30.0,
            layer_types=_gemma4_layer_types(num_layers, shared), num_kv_shared_layers=shared,
        )
        if e2b:
            kwargs.update(use_double_wide_mlp=True, hidden_size_per_layer_input=8,
                          vocab_size_per_layer_input=vocab_size)
        else:
            kwargs.update(
                hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=4, top_k_experts=2,
                moe_intermediate_size=hidden_size // 2, attention_k_eq_v=True, num_global_key_value_heads=1,
            )
    kwargs.update(overrides)
    config_class = getattr(transformers, _CONFIG_CLASSES[family])
    config = config_class(**kwargs)
    config._attn_implementation = attn_implementation
    return config


def _validate_shape(family: str, *, num_layers: int, hidden_size: int, num_heads: int, num_kv_heads: int,
                    head_dim: int, vocab_size: int) -> None:
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
    elif family in ("qwen3_5", "gemma4") and head_dim % 8:
        problems.append(f"{family} rotates a quarter of each head: head_dim={head_dim} must be a multiple of 8")
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


MULTIMODAL_FAMILIES = ("gemma3", "gemma4", "qwen3_5")


def tiny_vlm(family: str, *, seed: int = 0, **config_kwargs: Any) -> transformers.PreTrainedModel:
    """The family's real multimodal model (``*ForConditionalGeneration``) around a :func:`tiny_config`
    text tower and a one-layer vision tower, random weights (``torch.manual_seed(seed)``), bf16.

    Real Gemma 3 (4B+), Gemma 4 and Qwen 3.5/3.6 checkpoints have this shape; ``save_pretrained`` writes
    the text weights under ``model.language_model.*`` (Gemma 3: the legacy ``language_model.model.*``).

    Raises:
        KeyError: ``family`` is not in :data:`MULTIMODAL_FAMILIES`.
    """
    text = tiny_config(family, **config_kwargs).to_dict()
    if family == "gemma3":
        config = transformers.Gemma3Config(
            text_config=text, mm_tokens_per_image=4,
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                               image_size=32, patch_size=8))
        model_class = transformers.Gemma3ForConditionalGeneration
    elif family == "gemma4":
        config = transformers.Gemma4Config(
            text_config=text, audio_config=None,
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                               num_key_value_heads=2, head_dim=16))
        model_class = transformers.Gemma4ForConditionalGeneration
    elif family == "qwen3_5":
        config = transformers.Qwen3_5Config(
            text_config=text,
            vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                               out_hidden_size=text["hidden_size"], patch_size=4, spatial_merge_size=2,
                               temporal_patch_size=2))
        model_class = transformers.Qwen3_5ForConditionalGeneration
    else:
        raise KeyError(f"no tiny multimodal model for {family!r}; choose one of {MULTIMODAL_FAMILIES}")
    torch.manual_seed(seed)
    return model_class._from_config(config, dtype=torch.bfloat16)


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


# -- the descriptor contract ----------------------------------------------------------------------

_PEFT_INTERNALS = frozenset({
    "lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_dropout", "lora_magnitude_vector",
})


def _resolves(root: Any, path: str) -> bool:
    try:
        resolve_path(root, path)
    except DescriptorError:
        return False
    return True


def _layer_entries(layer: nn.Module) -> tuple[dict[str, nn.Module], set[str]]:
    """``(linears, paths)`` of one decoder layer, with PEFT wrapping taken out.

    ``linears``: layer-relative path -> ``nn.Linear`` (bitsandbytes ``Linear4bit`` is one);
    ``paths``: every module, parameter and buffer path. ``.base_layer`` is dropped from paths and
    LoRA's own modules (``lora_A``...) are skipped, so a PEFT-wrapped layer reads like the plain one.
    """
    linears: dict[str, nn.Module] = {}
    paths: set[str] = set()
    for name, module in layer.named_modules():
        parts = name.split(".") if name else []
        if _PEFT_INTERNALS.intersection(parts):
            continue
        clean = ".".join(p for p in parts if p != "base_layer")
        if clean:
            paths.add(clean)
        if isinstance(module, nn.Linear):
            linears[clean] = module
        for attribute, _ in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            paths.add(f"{clean}.{attribute}" if clean else attribute)
    return linears, paths


def _is_linear(module: Any) -> bool:
    """An ``nn.Linear`` (bitsandbytes ``Linear4bit`` included), or a PEFT layer wrapping one."""
    return isinstance(module, nn.Linear) or isinstance(getattr(module, "base_layer", None), nn.Linear)


def _matches(path: str, name: str) -> bool:
    """PEFT's rule: a target name matches a module path equal to it or ending in ``.name``."""
    return path == name or path.endswith("." + name)


def _is_quantized(obj: Any) -> bool:
    try:
        import bitsandbytes as bnb
    except ImportError:  # pragma: no cover - bitsandbytes is a [train] dependency
        return False
    return isinstance(obj, (bnb.nn.Linear4bit, bnb.nn.Params4bit))


def check_descriptor(descriptor: ArchitectureDescriptor, model: nn.Module) -> list[str]:
    """The descriptor contract: does ``descriptor`` describe ``model``? Returns the problems (empty: yes).

    ``model`` is the real ``*ForCausalLM``, plain or NF4-quantized, optionally PEFT-wrapped
    (unwrapped with ``get_base_model()``). Names that ``descriptor.optional_features`` switches
    off on this config must be absent; all other names must be present. Checks:

    * identity: ``type(model).__name__`` in ``causal_lm_classes``, ``config.model_type`` in
      ``model_types``, the config class is ``config_class`` (when set);
    * module paths (``text_model``, ``decoder_layers``, ``embeddings``, ``final_norm``, ``head``,
      ``rotary``, ``prelude_modules``, ``model_level_linears``) resolve; ``decoder_layers`` holds
      ``num_hidden_layers`` layers; ``embeddings`` is an ``nn.Embedding``, ``head`` and every
      model-level linear an ``nn.Linear``; every ``nn.Linear`` outside the layers other than the
      head is listed in ``model_level_linears``;
    * layer kinds: every value of ``config.<layer_kinds_attr>`` is in ``layer_kinds`` and has a
      ``mask_kinds`` entry naming a function of ``transformers.masking_utils``; a rotary module
      with per-kind buffers (``<kind>_inv_freq``) is described per kind, one with a single
      ``inv_freq`` by one ``rotary_kinds`` entry;
    * adapters: every name in ``lora_targets_all_linear``/``lora_targets_default``/``lora_excluded``
      is an ``nn.Linear``/``Linear4bit`` in at least one decoder layer; every such linear in a
      layer is a target or excluded (offenders reported by full name);
    * ``never_quantized`` entries exist in some layer (module, parameter or buffer path) and are
      not bitsandbytes 4-bit;
    * each ``CarriedState.kwarg`` is a parameter of the decoder layers' ``forward``;
    * config attributes named by ``final_logit_softcapping``, ``tied_embeddings`` and each
      ``CarriedState.enabled_by``/``optional_features`` entry exist on the config.

    Run it on a model that has every layer kind of the family and every optional feature on
    (:func:`tiny_config` builds such configs whenever ``num_layers`` allows): a name that only
    some layer kind has (Qwen3.5's ``in_proj_qkv`` lives in linear-attention layers) is reported
    missing on a model without that kind. A kind named in ``mask_kinds``/``rotary_kinds`` may be
    unused by one model (Qwen2 slides only with ``use_sliding_window``); that every kind is used by
    *some* configuration is a family-level check (see ``tests/test_descriptors.py``).
    """
    problems: list[str] = []
    base = causal_lm_of(model)
    config = base.config
    disabled = descriptor.disabled_names(config)

    # identity
    if type(base).__name__ not in descriptor.causal_lm_classes:
        problems.append(f"model class {type(base).__name__} is not in causal_lm_classes {list(descriptor.causal_lm_classes)}")
    if config.model_type not in descriptor.model_types:
        problems.append(f"config.model_type {config.model_type!r} is not in model_types {list(descriptor.model_types)}")
    if descriptor.config_class and type(config).__name__ != descriptor.config_class:
        problems.append(f"config class {type(config).__name__} is not config_class {descriptor.config_class!r}")

    # config attributes
    named_attributes = [("final_logit_softcapping", descriptor.final_logit_softcapping),
                        ("tied_embeddings", descriptor.tied_embeddings),
                        ("layer_kinds_attr", descriptor.layer_kinds_attr)]
    named_attributes += [(f"carried_state[{c.kwarg!r}].enabled_by", c.enabled_by) for c in descriptor.carried_state]
    named_attributes += [("optional_features", attribute) for attribute, _ in descriptor.optional_features]
    for field_name, attribute in named_attributes:
        if attribute and not hasattr(config, attribute):
            problems.append(f"{field_name} names config attribute {attribute!r}, which {type(config).__name__} lacks")

    # module paths
    resolved: dict[str, Any] = {}
    for field_name in ("text_model", "decoder_layers", "embeddings", "final_norm", "head", "rotary"):
        path = getattr(descriptor, field_name)
        try:
            resolved[field_name] = resolve_path(base, path)
        except DescriptorError as error:
            problems.append(f"{field_name}: {error}")
    for field_name in ("prelude_modules", "model_level_linears"):
        for path in getattr(descriptor, field_name):
            present = _resolves(base, path)
            if path in disabled:
                if present:
                    problems.append(f"{field_name} entry {path!r} exists although optional_features marks it "
                                    "absent for this config")
                continue
            try:
                target = resolve_path(base, path)
            except DescriptorError as error:
                problems.append(f"{field_name}: {error}")
                continue
            if field_name == "model_level_linears" and not _is_linear(target):
                problems.append(f"model_level_linears entry {path!r} is a {type(target).__name__}, not an nn.Linear")
    if "embeddings" in resolved and not isinstance(resolved["embeddings"], nn.Embedding):
        problems.append(f"embeddings {descriptor.embeddings!r} is a {type(resolved['embeddings']).__name__}, "
                        "not an nn.Embedding")
    head = resolved.get("head")
    if head is not None and not _is_linear(head):
        problems.append(f"head {descriptor.head!r} is a {type(head).__name__}, not an nn.Linear")
    layers = resolved.get("decoder_layers")
    if layers is not None and len(layers) != config.num_hidden_layers:
        problems.append(f"decoder_layers {descriptor.decoder_layers!r} holds {len(layers)} layers, "
                        f"config.num_hidden_layers is {config.num_hidden_layers}")
    layers = list(layers) if layers is not None else []

    # model-level linears outside the layers must be listed (bitsandbytes quantizes them)
    layers_prefix = descriptor.decoder_layers + "."
    for name, module in base.named_modules():
        parts = name.split(".")
        if (isinstance(module, nn.Linear) and not _PEFT_INTERNALS.intersection(parts)
                and not name.startswith(layers_prefix)):
            clean = ".".join(p for p in parts if p != "base_layer")
            if clean != descriptor.head and clean not in descriptor.model_level_linears:
                problems.append(f"nn.Linear {clean!r} outside the decoder layers is not in model_level_linears")

    # layer kinds, masks, rotary
    kinds = getattr(config, descriptor.layer_kinds_attr, None)
    if kinds is None:
        kinds = []
    elif len(kinds) != config.num_hidden_layers:
        problems.append(f"config.{descriptor.layer_kinds_attr} has {len(kinds)} entries for "
                        f"{config.num_hidden_layers} layers")
    used_kinds = list(dict.fromkeys(kinds))
    for kind in used_kinds:
        if kind not in descriptor.layer_kinds:
            problems.append(f"config.{descriptor.layer_kinds_attr} uses layer kind {kind!r}, not in layer_kinds "
                            f"{list(descriptor.layer_kinds)}")
    mask_functions = dict(descriptor.mask_kinds)
    from transformers import masking_utils

    for kind in used_kinds:
        if kind not in mask_functions:
            problems.append(f"layer kind {kind!r} is used but has no mask_kinds entry")
    for kind, function_name in descriptor.mask_kinds:
        if not callable(getattr(masking_utils, function_name, None)):
            problems.append(f"mask_kinds[{kind!r}] names {function_name!r}, not a function of transformers.masking_utils")
    rotary = resolved.get("rotary")
    if rotary is not None:
        buffers = {name for name, _ in rotary.named_buffers(recurse=False)}
        per_kind = sorted(k for k in descriptor.layer_kinds if f"{k}_inv_freq" in buffers)
        described = sorted(k for k, _ in descriptor.rotary_kinds)
        if per_kind and not set(per_kind) <= set(described):
            problems.append(f"rotary module has per-kind buffers for {per_kind}, rotary_kinds describes {described}")
        if not per_kind and len(descriptor.rotary_kinds) != 1:
            problems.append(f"rotary module has one inv_freq, rotary_kinds describes {described}")

    # carried state reaches the layers as a keyword of their forward
    for layer_class in dict.fromkeys(type(layer) for layer in layers):
        parameters = inspect.signature(layer_class.forward).parameters
        for carried in descriptor.carried_state:
            if carried.kwarg not in parameters:
                problems.append(f"carried_state kwarg {carried.kwarg!r} is not a parameter of "
                                f"{layer_class.__name__}.forward {list(parameters)[1:]}")

    # adapters and quantization, per layer
    missing_kinds = [kind for kind in descriptor.layer_kinds if kinds and kind not in used_kinds]
    absent_kinds = (f" (this model has no {'/'.join(missing_kinds)} layers: check a config with every layer kind)"
                    if missing_kinds else "")
    all_linears: dict[str, nn.Module] = {}
    all_paths: set[str] = set()
    for index, layer in enumerate(layers):
        linears, paths = _layer_entries(layer)
        all_paths |= paths
        for path, module in linears.items():
            all_linears.setdefault(path, module)
            if not any(_matches(path, n) for n in (*descriptor.lora_targets_all_linear, *descriptor.lora_excluded)):
                problems.append(
                    f"nn.Linear {descriptor.decoder_layers}.{index}.{path} is neither in lora_targets_all_linear "
                    "nor in lora_excluded"
                )
    for field_name in ("lora_targets_all_linear", "lora_targets_default", "lora_excluded"):
        for name in getattr(descriptor, field_name):
            found = any(_matches(path, name) for path in all_linears)
            if name in disabled:
                if found:
                    problems.append(f"{field_name} entry {name!r} exists although optional_features marks it "
                                    "absent for this config")
            elif not found:
                problems.append(f"{field_name} entry {name!r} is not an nn.Linear in any decoder layer{absent_kinds}")
    for name in descriptor.never_quantized:
        found = sorted(path for path in all_paths if _matches(path, name))
        if name in disabled:
            if found:
                problems.append(f"never_quantized entry {name!r} exists although optional_features marks it "
                                "absent for this config")
            continue
        if not found:
            problems.append(f"never_quantized entry {name!r} is not a module, parameter or buffer of any decoder "
                            f"layer{absent_kinds}")
            continue
        for index, layer in enumerate(layers):
            for path in found:
                try:
                    obj = resolve_path(layer, path)
                except DescriptorError:
                    continue
                if _is_quantized(obj) or _is_quantized(getattr(obj, "weight", None)):
                    problems.append(f"never_quantized entry {name!r} is 4-bit quantized at "
                                    f"{descriptor.decoder_layers}.{index}.{path}")
    return problems


def assert_descriptor_matches(descriptor: ArchitectureDescriptor, model: nn.Module) -> None:
    """Raise ``AssertionError`` listing every :func:`check_descriptor` problem."""
    problems = check_descriptor(descriptor, model)
    if problems:
        raise AssertionError(
            f"descriptor {descriptor.name!r} does not match {type(causal_lm_of(model)).__name__} "
            f"({len(problems)} problems):\n  - " + "\n  - ".join(problems)
        )
