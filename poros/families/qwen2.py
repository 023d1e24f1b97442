"""Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``, model_type ``qwen2``).

Source: transformers 5.24 ``models/qwen2/modeling_qwen2.py``. One RoPE ``(cos, sin)`` shared by all
layers; q/k/v projections carry a (frozen) bias; Llama-style RMSNorm. Layers at index
``>= max_window_layers`` slide only when ``use_sliding_window`` is set (never in Qwen2.5
checkpoints). ``lm_head`` is tied to the embedding for 0.5B/1.5B/3B.
"""

from poros.descriptor import FULL_ATTENTION, SLIDING_ATTENTION, SLIDING_WINDOW_MASK, decoder_family
from poros.hookspecs import hookimpl
from poros.tiny import TINY_SLIDING_WINDOW, TinyShape, TinyVariant

LAYER_CALL = (
    "layer(h, attention_mask=masks[layer_types[i]], position_embeddings=(cos, sin), "
    "position_ids=pos, cache=None, use_cache=False)"
)

DESCRIPTOR = decoder_family(
    name="qwen2",
    display_name="Qwen2 / Qwen2.5",
    model_types=("qwen2",),
    aliases=("qwen2.5", "qwen2_5"),
    causal_lm_classes=("Qwen2ForCausalLM",),
    config_class="Qwen2Config",
    layer_kinds=(FULL_ATTENTION, SLIDING_ATTENTION),
    rotary_kinds=(("*", "rope (rope_parameters: default/yarn/dynamic), one (cos, sin) for all layers"),),
    mask_kinds=((FULL_ATTENTION, "create_causal_mask"), (SLIDING_ATTENTION, "create_sliding_window_causal_mask")),
    layer_call=LAYER_CALL,
    norm_style="llama",
    seq_by_seq_masks=((SLIDING_ATTENTION, SLIDING_WINDOW_MASK),),
    never_quantized=("input_layernorm", "post_attention_layernorm",
                     "self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    notes=("q/k/v biases stay in the compute dtype inside Linear4bit and stream with the block.",
           "sliding layers only with use_sliding_window=True (layers >= max_window_layers)."),
)


def _tiny_fields(sliding: bool):
    def fields(shape: TinyShape, overrides: dict) -> dict:
        return dict(tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
                    use_sliding_window=sliding, sliding_window=TINY_SLIDING_WINDOW,
                    max_window_layers=shape.num_layers // 2 if sliding else shape.num_layers)
    return fields


#: tiny test models (:mod:`poros.tiny`); ``sliding``: ``use_sliding_window`` with the upper half of the layers sliding.
TINY_VARIANTS = (
    TinyVariant("qwen2", "default", "Qwen2Config", num_layers=2, head_dim=16, fields=_tiny_fields(False),
                head_dim_from_hidden=True),
    TinyVariant("qwen2", "sliding", "Qwen2Config", num_layers=4, head_dim=16, fields=_tiny_fields(True),
                head_dim_from_hidden=True, min_layers=2,
                description="use_sliding_window, the upper half of the layers sliding"),
)


@hookimpl
def poros_register_architectures(register):
    register(DESCRIPTOR)
