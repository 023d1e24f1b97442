"""Qwen3.5 / Qwen3.6 mixture-of-experts text tower (``Qwen3_5MoeForCausalLM``; model types
``qwen3_5_moe_text``, ``qwen3_5_moe``).

The trunk is Qwen3.5's (:mod:`poros.families.qwen3_5`): 3 Gated DeltaNet layers to 1 gated full
attention layer, 4 x B x S position ids, one partial interleaved mRoPE, zero-centred norms. Every
layer's MLP is a ``Qwen3_5MoeSparseMoeBlock``:

* router ``mlp.gate``: a raw ``[num_experts, hidden]`` weight (no ``nn.Linear``, so bitsandbytes
  leaves it in the compute dtype), fp32 softmax, top ``num_experts_per_tok``, renormalised;
* experts ``mlp.experts``: fused 3-D parameters ``gate_up_proj [E, 2 * moe_intermediate, hidden]``
  and ``down_proj [E, hidden, moe_intermediate]`` that bitsandbytes skips (they stay bf16 unless
  :func:`poros.quantize_experts` packs them to NF4); LoRA reaches them only through PEFT's
  ``target_parameters``;
* a shared expert ``mlp.shared_expert`` (SwiGLU ``nn.Linear``s, NF4) scaled by
  ``sigmoid(mlp.shared_expert_gate(x))`` (an ``nn.Linear(hidden, 1)``, NF4, not a LoRA target).

The router's logits feed transformers' load-balancing loss when ``output_router_logits`` is on
(``router_logits``: every layer's logits, collected across blocks). Real checkpoints are
multimodal (``qwen3_5_moe``); ``AutoModelForCausalLM`` loads their text tower as
``Qwen3_5MoeForCausalLM``, as for the dense family. Qwen3.6-35B-A3B shares architecture and model type.
"""

from poros.descriptor import derive
from poros.families.qwen3_5 import DESCRIPTOR as QWEN3_5
from poros.families.qwen3_5 import tiny_fields as dense_tiny_fields
from poros.hookspecs import hookimpl
from poros.tiny import TinyMultimodal, TinyShape, TinyVariant

DESCRIPTOR = derive(
    QWEN3_5,
    name="qwen3_5_moe",
    display_name="Qwen3.5 / Qwen3.6 (MoE)",
    model_types=("qwen3_5_moe_text", "qwen3_5_moe"),
    aliases=("qwen3.5-moe", "qwen3.6-moe", "qwen3_6_moe"),
    causal_lm_classes=("Qwen3_5MoeForCausalLM",),
    config_class="Qwen3_5MoeTextConfig",
    lora_targets_all_linear=(
        "q_proj", "k_proj", "v_proj", "o_proj",
        "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj",
        "gate_proj", "up_proj", "down_proj",
    ),
    lora_excluded=("shared_expert_gate",),
    never_quantized=(*QWEN3_5.never_quantized, "mlp.gate", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"),
    # transformers' eager experts loop (and Poros' NF4 loop, poros_nf4, which dequantizes the experts the
    # tokens hit) syncs with the host (nonzero, a loop over the hit experts); grouped_mm, batched_mm and
    # Poros' grouped NF4 experts (poros_nf4_grouped: all experts dequantized at once) do not
    graph_unsafe=(("num_experts", "MoE routing",
                   ("_experts_implementation", ("grouped_mm", "batched_mm", "poros_nf4_grouped"))),),
    notes=(
        *QWEN3_5.notes,
        "experts are fused 3-D parameters (bf16 under NF4 unless poros.quantize_experts); LoRA on them, bf16 or NF4, "
        "either order with quantize_experts: PEFT target_parameters=['experts.gate_up_proj', 'experts.down_proj'] "
        "(the trainer's default, lora_on_experts).",
        "router mlp.gate is a raw weight (never quantized); shared_expert_gate (one output) is excluded from LoRA.",
        "output_router_logits adds router_aux_loss_coef * load-balancing loss over every layer's router logits.",
    ),
)


def _tiny_fields(shape: TinyShape, overrides: dict) -> dict:
    """The dense tiny fields (partial rotary, mRoPE, a full layer every 4th) plus 4 experts, top 2."""
    return dict(
        dense_tiny_fields(shape, overrides), num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=shape.hidden_size // 2, shared_expert_intermediate_size=shape.hidden_size,
    )


#: tiny test models (:mod:`poros.tiny`): the dense tiny Qwen3.5 with an MoE block in every layer
#: (4 experts, top 2, a shared expert).
TINY_VARIANTS = (
    TinyVariant("qwen3_5_moe", "default", "Qwen3_5MoeTextConfig", num_layers=4, head_dim=32, fields=_tiny_fields,
                head_dim_multiple=8, min_layers=2, chunk_length=64,  # the delta rule's 64-token chunks
                description="4 experts (top 2) and a shared expert in every layer"),
)

#: the tiny multimodal model: one vision block.
TINY_MULTIMODAL = TinyMultimodal(
    "qwen3_5_moe", "Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration", lambda text: dict(
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                           out_hidden_size=text["hidden_size"], patch_size=4, spatial_merge_size=2,
                           temporal_patch_size=2)))


@hookimpl
def poros_register_architectures(register):
    register(DESCRIPTOR)
