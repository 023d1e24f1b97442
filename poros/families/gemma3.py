"""Gemma 3 text (``Gemma3ForCausalLM``, model types ``gemma3_text``, ``gemma3``).

5 sliding : 1 full layers, each kind with its own rotary (sliding theta 1e4, full theta 1e6 with
linear scaling on 4B+). Sandwich norms (4 per layer) plus q/k norms, zero-centred ``(1 + w)``
in fp32; the embedding is multiplied by ``sqrt(hidden)`` rounded to the weight dtype; attention
scaling is ``query_pre_attn_scalar ** -0.5``; ``final_logit_softcapping`` after the head
(``Gemma3ForCausalLM`` only). ``lm_head`` is tied to the embedding. 4B+ checkpoints are multimodal
(``gemma3``): ``Gemma3ForCausalLM.from_pretrained`` on them random-initialises every weight.
"""

from poros.descriptor import FULL_ATTENTION, PER_TOKEN_DEFAULT, SLIDING_ATTENTION, SLIDING_WINDOW_MASK, decoder_family
from poros.hookspecs import hookimpl
from poros.tiny import TINY_SLIDING_WINDOW, TinyMultimodal, TinyShape, TinyVariant, layer_pattern

DESCRIPTOR = decoder_family(
    name="gemma3",
    display_name="Gemma 3 (text)",
    model_types=("gemma3_text", "gemma3"),
    aliases=("gemma-3",),
    causal_lm_classes=("Gemma3ForCausalLM",),
    config_class="Gemma3TextConfig",
    layer_kinds=(SLIDING_ATTENTION, FULL_ATTENTION),
    rotary_kinds=(
        (SLIDING_ATTENTION, "rope theta 1e4 (rope_parameters['sliding_attention'])"),
        (FULL_ATTENTION, "rope theta 1e6, linear scaling x8 on 4B+ (rope_parameters['full_attention'])"),
    ),
    mask_kinds=((FULL_ATTENTION, "create_causal_mask"), (SLIDING_ATTENTION, "create_sliding_window_causal_mask")),
    layer_call=(
        "layer(h, attention_mask=masks[lt], position_embeddings=pe[lt], position_ids=pos, cache=None)"
    ),
    norm_style="zero_centered",
    seq_by_seq_masks=((SLIDING_ATTENTION, SLIDING_WINDOW_MASK),),
    embedding_scale="embed_tokens * sqrt(hidden_size) rounded to the weight dtype (55.43 -> 55.5 in bf16)",
    final_logit_softcapping="final_logit_softcapping",
    per_token=(*PER_TOKEN_DEFAULT, "pre_feedforward_layernorm", "post_feedforward_layernorm"),
    never_quantized=(
        "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
        "post_feedforward_layernorm", "self_attn.q_norm", "self_attn.k_norm",
    ),
    notes=(
        "Gemma3ForConditionalGeneration.forward does not apply final_logit_softcapping; Gemma3ForCausalLM does.",
        "use_bidirectional_attention (EmbeddingGemma) adds or_mask functions; not a causal-LM setting.",
    ),
)


def _tiny_fields(shape: TinyShape, overrides: dict) -> dict:
    """Sliding layers with a full one every 6th and last, per-kind RoPE, soft-capped logits."""
    return dict(
        head_dim=shape.head_dim, tie_word_embeddings=True,
        query_pre_attn_scalar=24,  # != head_dim: scaling must come from the config, not head_dim
        sliding_window=TINY_SLIDING_WINDOW, final_logit_softcapping=30.0,
        layer_types=layer_pattern(shape.num_layers, 6, every=FULL_ATTENTION, other=SLIDING_ATTENTION),
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        },
    )


#: tiny test models (:mod:`poros.tiny`).
TINY_VARIANTS = (
    TinyVariant("gemma3", "default", "Gemma3TextConfig", num_layers=4, head_dim=16, fields=_tiny_fields, min_layers=2),
)

#: the tiny multimodal model (Gemma 3 4B+): a one-layer SigLIP vision tower.
TINY_MULTIMODAL = TinyMultimodal("gemma3", "Gemma3Config", "Gemma3ForConditionalGeneration", lambda text: dict(
    mm_tokens_per_image=4, vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                              num_attention_heads=2, image_size=32, patch_size=8)))


@hookimpl
def poros_register_architectures(register):
    register(DESCRIPTOR)
