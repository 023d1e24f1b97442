"""Qwen3 dense (``Qwen3ForCausalLM``, model_type ``qwen3``).

The text-model forward is the same as Qwen2's; inside the layer, ``q_norm``/``k_norm`` (RMSNorm over
``head_dim``) run per head before RoPE, ``head_dim`` is explicit and attention biases come from
``attention_bias`` (default off).
"""

from poros.descriptor import derive
from poros.families.qwen2 import DESCRIPTOR as QWEN2
from poros.hookspecs import hookimpl

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


@hookimpl
def poros_register_architectures(register):
    register(DESCRIPTOR)
