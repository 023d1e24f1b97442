"""Llama (``LlamaForCausalLM``, model_type ``llama``) as a third-party Poros family.

Source: transformers 5.24 ``models/llama/modeling_llama.py``. The Llama trunk is what
:func:`poros.descriptor.decoder_family` assumes by default -- ``model.embed_tokens``,
``model.layers``, ``model.norm``, ``lm_head``, one ``model.rotary_emb`` shared by every layer, a
causal mask, Llama-style RMSNorm and SwiGLU projections -- so the descriptor only states
identity, the layer call and what differs from the defaults.
"""

import poros
from poros.descriptor import decoder_family
from poros.tiny import TinyShape, TinyVariant

DESCRIPTOR = decoder_family(
    name="llama",
    display_name="Llama (example plugin)",
    model_types=("llama",),
    aliases=("llama3", "llama-3"),
    causal_lm_classes=("LlamaForCausalLM",),
    config_class="LlamaConfig",
    layer_kinds_attr="",  # LlamaConfig has no layer_types: every layer is full attention (the default kind)
    layer_call=(
        "layer(h, attention_mask=causal_mask, position_embeddings=(cos, sin), position_ids=pos, "
        "cache=None, use_cache=False)"
    ),
    never_quantized=("input_layernorm", "post_attention_layernorm"),
    notes=(
        "q/k/v/o carry a bias only with attention_bias=True, gate/up/down only with mlp_bias=True.",
    ),
)



def _tiny_fields(shape: TinyShape, overrides: dict) -> dict:
    """Every Llama option on: biases on q/k/v/o and the MLP, an explicit head_dim, an untied head."""
    return dict(head_dim=shape.head_dim, tie_word_embeddings=False, attention_bias=True, mlp_bias=True,
                rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})


#: The family's tiny test model, as data next to its descriptor: ``poros.testing.tiny_config("llama")``
#: builds it (and ``tiny_model``, ``save_tiny_checkpoint``, ``qlora_model``) while the plugin is registered.
TINY_VARIANTS = (
    TinyVariant("llama", "default", "LlamaConfig", num_layers=3, head_dim=16, fields=_tiny_fields),
)


@poros.hookimpl
def poros_register_architectures(register):
    register(DESCRIPTOR)
