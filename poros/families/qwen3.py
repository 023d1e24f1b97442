"""Qwen3 dense (``Qwen3ForCausalLM``, model_type ``qwen3``).

The text-model forward is the same as Qwen2's; inside the layer, ``q_norm``/``k_norm`` (RMSNorm over
``head_dim``) run per head before RoPE, ``head_dim`` is explicit and attention biases come from
``attention_bias`` (default off).
"""

from poros.descriptor import derive
from poros.families.qwen2 import DESCRIPTOR as QWEN2
from poros.hookspecs import hookimpl
from poros.tiny import TINY_SLIDING_WINDOW, TinyShape, TinyVariant

DESCRIPTOR = derive(
    QWEN2,
    name="qwen3",
    display_name="Qwen3",
    model_types=("qwen3",),
    aliases=(),
    causal_lm_classes=("Qwen3ForCausalLM",),
    config_class="Qwen3Config",
    never_quantized=("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm"),
    notes=("q_norm/k_norm are per-head RMSNorms applied before RoPE.",
           "projection biases only when attention_bias=True (o_proj too)."),
)


def _tiny_fields(sliding: bool):
    def fields(shape: TinyShape, overrides: dict) -> dict:
        return dict(tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
                    use_sliding_window=sliding, sliding_window=TINY_SLIDING_WINDOW,
                    max_window_layers=shape.num_layers // 2 if sliding else shape.num_layers,
                    head_dim=shape.head_dim, attention_bias=False)
    return fields


#: tiny test models (:mod:`poros.tiny`): an explicit head_dim != hidden / heads, as in Qwen3-0.6B;
#: ``sliding``: ``use_sliding_window`` with the upper half of the layers sliding.
TINY_VARIANTS = (
    TinyVariant("qwen3", "default", "Qwen3Config", num_layers=2, head_dim=32, fields=_tiny_fields(False)),
    TinyVariant("qwen3", "sliding", "Qwen3Config", num_layers=4, head_dim=32, fields=_tiny_fields(True), min_layers=2,
                description="use_sliding_window, the upper half of the layers sliding"),
)


@hookimpl
def poros_register_architectures(register):
    register(DESCRIPTOR)
