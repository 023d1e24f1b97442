"""Qwen3.5 and Qwen3.6 dense (text tower ``Qwen3_5ForCausalLM``; model types ``qwen3_5_text``, ``qwen3_5``).

Layers alternate 3 ``linear_attention`` (Gated DeltaNet) : 1 ``full_attention`` (gated attention,
``q_proj`` twice as wide: query + output gate). Position ids are ``4 x B x S`` (row 0 text, rows 1-3
interleaved mRoPE); one partial rotary (factor 0.25) is used by the full layers only. The linear
layers' "mask" is the 2-D padding mask. Norms are zero-centred ``(1 + w)`` in fp32, except the
gated norm inside the DeltaNet. Real checkpoints are multimodal (``qwen3_5``); ``AutoModelForCausalLM``
loads their text tower as ``Qwen3_5ForCausalLM`` correctly. Qwen3.6 shares architecture and model type.
"""

from poros.descriptor import FULL_ATTENTION, LINEAR_ATTENTION, decoder_family
from poros.hookspecs import hookimpl

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
    lora_targets_all_linear=(
        "q_proj", "k_proj", "v_proj", "o_proj",
        "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj",
        "gate_proj", "up_proj", "down_proj",
    ),
    never_quantized=(
        "input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm",
        "linear_attn.conv1d", "linear_attn.A_log", "linear_attn.dt_bias", "linear_attn.norm",
    ),
    notes=(
        "linear-attention layers: in_proj_b/in_proj_a have num_v_heads outputs (tiny); LoRA on them is optional.",
        "packing via position_ids resets is not honoured by the torch GatedDeltaNet path: one sample per row.",
        "no carried state in training: conv/recurrent states exist only inside a Cache.",
    ),
)


@hookimpl
def poros_register_architectures(register):
    register(DESCRIPTOR)
