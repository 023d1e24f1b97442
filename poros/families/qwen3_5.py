"""Qwen3.5 and Qwen3.6 dense (text tower ``Qwen3_5ForCausalLM``; model types ``qwen3_5_text``, ``qwen3_5``).

Layers alternate 3 ``linear_attention`` (Gated DeltaNet) : 1 ``full_attention`` (gated attention,
``q_proj`` twice as wide: query + output gate). Position ids are ``4 x B x S`` (row 0 text, rows 1-3
interleaved mRoPE); one partial rotary (factor 0.25) is used by the full layers only. The linear
layers' "mask" is the 2-D padding mask. Norms are zero-centred ``(1 + w)`` in fp32, except the
gated norm inside the DeltaNet. Real checkpoints are multimodal (``qwen3_5``); ``AutoModelForCausalLM``
loads their text tower as ``Qwen3_5ForCausalLM`` correctly. Qwen3.6 shares architecture and model type.
"""

from poros.descriptor import FULL_ATTENTION, LINEAR_ATTENTION, PER_TOKEN_DEFAULT, decoder_family
from poros.hookspecs import hookimpl
from poros.tiny import TinyMultimodal, TinyShape, TinyVariant, layer_pattern

DESCRIPTOR = decoder_family(
    name="qwen3_5",
    display_name="Qwen3.5 / Qwen3.6 (dense)",
    model_types=("qwen3_5_text", "qwen3_5"),
    aliases=("qwen3.5", "qwen3.6", "qwen3_6"),
    causal_lm_classes=("Qwen3_5ForCausalLM",),
    config_class="Qwen3_5TextConfig",
    layer_kinds=(LINEAR_ATTENTION, FULL_ATTENTION),
    rotary_kinds=((FULL_ATTENTION, "interleaved mRoPE, partial_rotary_factor 0.25, position ids 4xBxS"),),
    mask_kinds=((FULL_ATTENTION, "create_causal_mask"), (LINEAR_ATTENTION, "create_recurrent_attention_mask")),
    layer_call=(
        "layer(h, position_embeddings=(cos, sin), attention_mask=masks[layer_types[i]], "
        "position_ids=pos[0], cache=None, use_cache=False)"
    ),
    norm_style="zero_centered",
    # the text model passes position_ids[0] of its 4 x B x S expand (arange(S).view(1, 1, -1).expand(4, B, -1))
    contiguous_arguments=("position_ids",),
    lora_targets_all_linear=(
        "q_proj", "k_proj", "v_proj", "o_proj",
        "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj",
        "gate_proj", "up_proj", "down_proj",
    ),
    per_token=(*PER_TOKEN_DEFAULT, "linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_b",
               "linear_attn.in_proj_a", "linear_attn.out_proj"),
    never_quantized=(
        "input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm",
        "linear_attn.conv1d", "linear_attn.A_log", "linear_attn.dt_bias", "linear_attn.norm",
    ),
    packing_unsupported=("its Gated DeltaNet layers (transformers' torch path) run a packed row as one sequence: "
                         "they ignore the position_ids restarts that keep packed examples apart"),
    notes=(
        "linear-attention layers: in_proj_b/in_proj_a have num_v_heads outputs (tiny); LoRA on them is optional.",
        "packing via position_ids resets is not honoured by the torch GatedDeltaNet path: one sample per row.",
        "no carried state in training: conv/recurrent states exist only inside a Cache.",
    ),
)


def tiny_fields(shape: TinyShape, overrides: dict) -> dict:
    """Partial rotary 0.25 (8 rotary channels at head_dim 32), interleaved mrope, a full layer every 4th."""
    rotary_pairs = int(shape.head_dim * 0.25) // 2
    return dict(
        head_dim=shape.head_dim, tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.25,
            "mrope_section": [rotary_pairs - 2 * (rotary_pairs // 3), rotary_pairs // 3, rotary_pairs // 3],
            "mrope_interleaved": True,
        },
        layer_types=layer_pattern(shape.num_layers, 4, every=FULL_ATTENTION, other=LINEAR_ATTENTION),
        linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=shape.num_kv_heads, linear_num_value_heads=shape.num_heads,
    )


#: tiny test models (:mod:`poros.tiny`): partial rotary 0.25 -> 8 rotary channels, mrope [2, 1, 1].
TINY_VARIANTS = (
    TinyVariant("qwen3_5", "default", "Qwen3_5TextConfig", num_layers=4, head_dim=32, fields=tiny_fields,
                head_dim_multiple=8, min_layers=2, chunk_length=64),  # the delta rule's 64-token chunks
)

#: the tiny multimodal model (Qwen 3.5/3.6 with their vision tower): one vision block.
TINY_MULTIMODAL = TinyMultimodal("qwen3_5", "Qwen3_5Config", "Qwen3_5ForConditionalGeneration", lambda text: dict(
    vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text["hidden_size"],
                       patch_size=4, spatial_merge_size=2, temporal_patch_size=2)))


@hookimpl
def poros_register_architectures(register):
    register(DESCRIPTOR)
