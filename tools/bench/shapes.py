"""The model shapes the tools build with random weights: data, not code.

``SHAPES`` names each shape; the facts of its checkpoint (layers, widths, vocab...) come from
``registry/<family>.toml`` (a shape whose checkpoint the registry does not list is an error); what
the registry does not hold (rotary, norm eps, ...) is written here, under the ``config.json`` it came
from. The ``tiny*`` shapes are synthetic: every feature of each family at width 64, for CPU smoke runs.
:func:`model_config` turns a shape into the HF text config, optionally truncated to fewer layers.
Torch-free (transformers is imported when a config is built).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from poros import records

#: Where a synthetic shape's facts come from, as the records write it (the bench's ``--model`` shapes).
SYNTHETIC_SOURCE = "tools/bench/harness.py"


@dataclass(frozen=True)
class Shape:
    """A model shape to build with random weights.

    Args:
        family: the Poros family (``registry/<family>.toml``).
        model_type: the text config's ``model_type`` (``AutoConfig.for_model``).
        hf_id: the registry entry (``registry/<family>.toml``) whose facts (layers, widths,
            vocab...) are used; ``None`` for synthetic shapes.
        extra: config keyword arguments the registry does not hold (rotary, eps, layer pattern).
    """

    family: str
    model_type: str
    hf_id: str | None
    extra: dict[str, Any] = field(default_factory=dict)


#: Registry keys -> config keyword (the registry writes ``layers`` for ``num_hidden_layers``).
REGISTRY_TO_CONFIG = records.CONFIG_KEYS

_TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=256, max_position_embeddings=512)

SHAPES: dict[str, Shape] = {
    # https://huggingface.co/Qwen/Qwen2.5-7B/blob/main/config.json
    "qwen2.5-7b": Shape("qwen2", "qwen2", "Qwen/Qwen2.5-7B",
        extra=dict(rope_theta=1_000_000.0, rms_norm_eps=1e-6, use_sliding_window=False)),
    # https://huggingface.co/Qwen/Qwen2.5-14B/blob/main/config.json
    "qwen2.5-14b": Shape("qwen2", "qwen2", "Qwen/Qwen2.5-14B",
        extra=dict(rope_theta=1_000_000.0, rms_norm_eps=1e-5, use_sliding_window=False)),
    # https://huggingface.co/Qwen/Qwen2.5-32B/blob/main/config.json
    "qwen2.5-32b": Shape("qwen2", "qwen2", "Qwen/Qwen2.5-32B",
        extra=dict(rope_theta=1_000_000.0, rms_norm_eps=1e-5, use_sliding_window=False)),
    # https://huggingface.co/Qwen/Qwen2.5-72B/blob/main/config.json
    "qwen2.5-72b": Shape("qwen2", "qwen2", "Qwen/Qwen2.5-72B",
        extra=dict(rope_theta=1_000_000.0, rms_norm_eps=1e-5, use_sliding_window=False)),
    # https://huggingface.co/Qwen/Qwen3-8B/blob/main/config.json
    "qwen3-8b": Shape("qwen3", "qwen3", "Qwen/Qwen3-8B",
        extra=dict(rope_theta=1_000_000.0, rms_norm_eps=1e-6)),
    # https://huggingface.co/Qwen/Qwen3-32B/blob/main/config.json
    "qwen3-32b": Shape("qwen3", "qwen3", "Qwen/Qwen3-32B",
        extra=dict(rope_theta=1_000_000.0, rms_norm_eps=1e-6)),
    # https://huggingface.co/Qwen/Qwen3.5-9B/blob/main/config.json (text_config)
    "qwen3.5-9b": Shape("qwen3_5", "qwen3_5_text", "Qwen/Qwen3.5-9B",
        extra=dict(rms_norm_eps=1e-6, linear_key_head_dim=128, linear_value_head_dim=128,
                   rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25,
                                        mrope_section=[11, 11, 10], mrope_interleaved=True))),
    # https://huggingface.co/Qwen/Qwen3.6-27B/blob/main/config.json (text_config)
    # tie_word_embeddings is unconfirmed in the registry; the model card lists a separate LM output
    "qwen3.6-27b": Shape("qwen3_5", "qwen3_5_text", "Qwen/Qwen3.6-27B",
        extra=dict(tie_word_embeddings=False, rms_norm_eps=1e-6, linear_key_head_dim=128, linear_value_head_dim=128,
                   rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25,
                                        mrope_section=[11, 11, 10], mrope_interleaved=True))),
    # https://huggingface.co/Qwen/Qwen3.5-35B-A3B/blob/main/config.json (text_config)
    # rope theta 1e7: THUDM/slime scripts/models/qwen3.5-35B-A3B.sh (--rotary-base 10000000)
    "qwen3.5-35b-a3b": Shape("qwen3_5_moe", "qwen3_5_moe_text", "Qwen/Qwen3.5-35B-A3B",
        extra=dict(rms_norm_eps=1e-6,
                   rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25,
                                        mrope_section=[11, 11, 10], mrope_interleaved=True))),
    # https://huggingface.co/Qwen/Qwen3.5-122B-A10B/blob/main/config.json (text_config)
    # rope theta 1e7: apxml.com/models/qwen35-122b-a10b; shared expert 1024 (its "dense FFN") and the DeltaNet heads
    # (transformers' Qwen3_5MoeTextConfig defaults, 16 key / 32 value heads of 128) are unconfirmed in the registry
    "qwen3.5-122b-a10b": Shape("qwen3_5_moe", "qwen3_5_moe_text", "Qwen/Qwen3.5-122B-A10B",
        extra=dict(rms_norm_eps=1e-6, shared_expert_intermediate_size=1024, tie_word_embeddings=False,
                   rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25,
                                        mrope_section=[11, 11, 10], mrope_interleaved=True))),
    # https://huggingface.co/google/gemma-3-12b-pt/blob/main/config.json (text_config)
    "gemma3-12b": Shape("gemma3", "gemma3_text", "google/gemma-3-12b-pt",
        extra=dict(rms_norm_eps=1e-6, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                   rope_scaling=dict(rope_type="linear", factor=8.0))),
    # https://huggingface.co/google/gemma-3-27b-pt/blob/main/config.json (text_config)
    # vocab_size is unconfirmed in the registry; the 4B and 12B text configs say 262208
    "gemma3-27b": Shape("gemma3", "gemma3_text", "google/gemma-3-27b-pt",
        extra=dict(vocab_size=262208, rms_norm_eps=1e-6, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                   rope_scaling=dict(rope_type="linear", factor=8.0))),
    # https://huggingface.co/google/gemma-4-E4B-it/blob/main/config.json (text_config)
    "gemma4-e4b": Shape("gemma4", "gemma4_text", "google/gemma-4-E4B-it",
        extra=dict(rms_norm_eps=1e-6, final_logit_softcapping=30.0, use_double_wide_mlp=True,
                   vocab_size_per_layer_input=262144)),
    # https://huggingface.co/google/gemma-4-26B-A4B-it/blob/main/config.json (text_config)
    # attention_k_eq_v / 2 global KV heads: transformers 5.24's Gemma4TextConfig EP-plan comment for this
    # checkpoint ("num_global_key_value_heads=2"); unconfirmed in the registry
    "gemma4-26b-a4b": Shape("gemma4", "gemma4_text", "google/gemma-4-26B-A4B-it",
        extra=dict(rms_norm_eps=1e-6, final_logit_softcapping=30.0, hidden_size_per_layer_input=0,
                   enable_moe_block=True, attention_k_eq_v=True, num_global_key_value_heads=2)),
    # https://huggingface.co/google/gemma-4-31B-it/blob/main/config.json (text_config)
    # attention_k_eq_v / num_global_key_value_heads unconfirmed: the transformers defaults are used
    "gemma4-31b": Shape("gemma4", "gemma4_text", "google/gemma-4-31B-it",
        extra=dict(rms_norm_eps=1e-6, final_logit_softcapping=30.0, hidden_size_per_layer_input=0)),
    # Synthetic shapes for CPU smoke tests: every feature of each family, at width 64.
    "tiny": Shape("qwen2", "qwen2", None, extra=dict(_TINY, num_hidden_layers=2, head_dim=None)),
    "tiny-qwen2": Shape("qwen2", "qwen2", None, extra=dict(_TINY, num_hidden_layers=4, head_dim=None)),
    "tiny-qwen3": Shape("qwen3", "qwen3", None, extra=dict(_TINY, num_hidden_layers=4)),
    "tiny-qwen3_5": Shape("qwen3_5", "qwen3_5_text", None, extra=dict(
        _TINY, num_hidden_layers=4, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16)),
    "tiny-qwen3_5_moe": Shape("qwen3_5_moe", "qwen3_5_moe_text", None, extra=dict(
        _TINY, num_hidden_layers=4, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=64)),
    "tiny-gemma3": Shape("gemma3", "gemma3_text", None, extra=dict(
        _TINY, num_hidden_layers=4, query_pre_attn_scalar=16, sliding_window=8, final_logit_softcapping=30.0,
        rope_scaling=dict(rope_type="linear", factor=8.0),
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"])),
    "tiny-gemma4": Shape("gemma4", "gemma4_text", None, extra=dict(
        _TINY, num_hidden_layers=4, global_head_dim=32, num_kv_shared_layers=2, hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=256, use_double_wide_mlp=True, sliding_window=8, final_logit_softcapping=30.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])),
    "tiny-gemma4-moe": Shape("gemma4", "gemma4_text", None, extra=dict(
        _TINY, num_hidden_layers=4, global_head_dim=32, hidden_size_per_layer_input=0, enable_moe_block=True,
        num_experts=4, top_k_experts=2, moe_intermediate_size=32, attention_k_eq_v=True,
        num_global_key_value_heads=1, sliding_window=8, final_logit_softcapping=30.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])),
}


def _registry_facts(hf_id: str) -> dict[str, Any] | None:
    from poros import records

    found = records.find_checkpoint(hf_id)
    return None if found is None else found[1]


def model_config(name: str, *, layers: int | None = None, **overrides: Any):
    """The HF text config of shape ``name``, optionally truncated to ``layers`` decoder layers.

    Returns:
        ``(config, info)``: ``info`` says where the facts came from and what was passed.

    Raises:
        KeyError: unknown shape; the message lists the known ones.
    """
    from transformers import AutoConfig

    if name not in SHAPES:
        raise KeyError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    shape = SHAPES[name]
    facts, source = {}, SYNTHETIC_SOURCE
    if shape.hf_id is not None:
        facts = _registry_facts(shape.hf_id)
        if facts is None:
            raise KeyError(f"shape {name!r} names {shape.hf_id!r}, which registry/{shape.family}.toml does not list; "
                           "add the checkpoint's facts there (the registry is where shapes come from).")
        source = f"registry/{shape.family}.toml"
    kwargs = {REGISTRY_TO_CONFIG[k]: v for k, v in facts.items() if k in REGISTRY_TO_CONFIG}
    kwargs.update(shape.extra)
    kwargs.update(overrides)
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    full_layers = kwargs.get("num_hidden_layers")
    if layers is not None:
        kwargs["num_hidden_layers"] = layers
        if "layer_types" in kwargs and len(kwargs["layer_types"]) != layers:
            kwargs["layer_types"] = list(kwargs["layer_types"])[:layers]
        shared = kwargs.get("num_kv_shared_layers")
        if shared and full_layers and "num_kv_shared_layers" not in overrides:
            kwargs["num_kv_shared_layers"] = round(shared * layers / full_layers)
    config = AutoConfig.for_model(shape.model_type, **kwargs)
    # A truncated KV-sharing model may lose the producer of a shared layer kind: share fewer layers.
    while getattr(config, "num_kv_shared_layers", 0):
        try:
            config.kv_sharing_modes
            break
        except ValueError:
            kwargs["num_kv_shared_layers"] = config.num_kv_shared_layers - 1
            config = AutoConfig.for_model(shape.model_type, **kwargs)
    info = {"shape": name, "family": shape.family, "hf_id": shape.hf_id, "facts_from": source,
            "num_hidden_layers": config.num_hidden_layers, "full_depth": full_layers, "config_kwargs": kwargs}
    return config, info
