"""Gemma 4 text (``Gemma4ForCausalLM``, model types ``gemma4_text``, ``gemma4``).

The most involved family. Sliding/full layers (last forced full) with per-kind rotary and head
dims (full layers: ``global_head_dim``, proportional partial RoPE, optionally K = V and fewer KV
heads). Two kinds of state cross block boundaries:

* ``shared_kv_states`` (a ``KVSharingDict``): for each layer kind the last non-shared layer
  stores its post-norm, post-RoPE K/V; the last ``num_kv_shared_layers`` layers (no k/v
  projections) read them. Gradients of every reader flow back into the writer. Every layer is
  handed the mapping, also where no layer shares K/V (31B, 26B-A4B: the last layer of each kind
  still stores, for assistant models); the descriptor names transformers' own per-layer flags, so
  ``cuda_graphs`` captures every block (``poros.stream.graphs``).
* per-layer inputs (PLE, E2B/E4B): ``[B, S, L, D]`` built before the loop from
  ``embed_tokens_per_layer`` and the NF4 model-level ``per_layer_model_projection``; layer i
  gets slice i as its second positional argument, and gradients flow back into the prelude.

Each layer ends with ``h *= layer_scalar`` (a persistent buffer that streams). Optional MoE
block: router ``proj`` (NF4, excluded from LoRA by default) and experts as raw 3-D parameters
that bitsandbytes does not quantize (they stream in the compute dtype).
"""

from poros.descriptor import (FULL_ATTENTION, PER_TOKEN_DEFAULT, SLIDING_ATTENTION, SLIDING_WINDOW_MASK, CarriedState,
                              decoder_family)
from poros.hookspecs import hookimpl
from poros.tiny import TINY_SLIDING_WINDOW, TinyMultimodal, TinyShape, TinyVariant

DESCRIPTOR = decoder_family(
    name="gemma4",
    display_name="Gemma 4 (text)",
    model_types=("gemma4_text", "gemma4"),
    aliases=("gemma-4",),
    causal_lm_classes=("Gemma4ForCausalLM",),
    config_class="Gemma4TextConfig",
    prelude_modules=("model.embed_tokens_per_layer", "model.per_layer_model_projection",
                     "model.per_layer_projection_norm"),
    layer_kinds=(SLIDING_ATTENTION, FULL_ATTENTION),
    rotary_kinds=(
        (SLIDING_ATTENTION, "default rope theta 1e4 over head_dim"),
        (FULL_ATTENTION, "proportional rope theta 1e6, partial 0.25 over global_head_dim"),
    ),
    mask_kinds=((FULL_ATTENTION, "create_causal_mask"), (SLIDING_ATTENTION, "create_sliding_window_causal_mask")),
    layer_call=(
        "layer(h, per_layer_inputs[:, :, i] or None, shared_kv_states=kv, position_embeddings=pe[lt], "
        "attention_mask=masks[lt], position_ids=pos, cache=None)"
    ),
    carried_state=(
        CarriedState(
            kwarg="shared_kv_states",
            kind="mapping",
            description="K/V stored by the last non-shared layer of each kind, read by the KV-shared tail layers",
            # transformers' own per-layer flags (config.kv_sharing_modes): "reuse" reads, "store" writes; the
            # entry is the layer's kind. The last layer of each kind stores even without readers (31B, 26B-A4B).
            reader_flag="self_attn.is_kv_shared_layer",
            writer_flag="self_attn.store_full_length_kv",
            entry_key="self_attn.layer_type",
        ),
        CarriedState(
            kwarg="per_layer_input",
            kind="per_layer_slice",
            description="per-layer inputs [B,S,L,D] from the prelude; layer i reads slice i (2nd positional arg)",
            enabled_by="hidden_size_per_layer_input",
        ),
    ),
    norm_style="plain_fp32",
    seq_by_seq_masks=((SLIDING_ATTENTION, SLIDING_WINDOW_MASK),),
    head_dims=((FULL_ATTENTION, "global_head_dim"),),
    # the dense MLP (``mlp``) is tiled; the experts beside it route all tokens of the block together
    mlp_untiled=(("enable_moe_block", "MoE experts: the router picks each token's experts over all tokens of "
                  "the block and grouped_mm groups them by expert, so mlp_chunks leaves them whole (their working "
                  "set is tokens x top_k_experts x moe_intermediate_size)"),),
    embedding_scale="embed_tokens * sqrt(hidden_size) rounded to the weight dtype",
    final_logit_softcapping="final_logit_softcapping",
    lora_targets_all_linear=(
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
        "per_layer_input_gate", "per_layer_projection",
    ),
    lora_excluded=("proj",),
    per_token=(*PER_TOKEN_DEFAULT, "pre_feedforward_layernorm", "post_feedforward_layernorm"),
    never_quantized=(
        "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
        "post_feedforward_layernorm", "self_attn.q_norm", "self_attn.k_norm", "layer_scalar",
        "post_per_layer_input_norm", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2",
        "pre_feedforward_layernorm_2", "router.scale", "router.per_expert_scale",
        "experts.gate_up_proj", "experts.down_proj",
    ),
    model_level_linears=("model.per_layer_model_projection",),
    # transformers' eager experts loop and Poros' NF4 loop (poros_nf4) sync with the host (nonzero, a loop
    # over the hit experts); grouped_mm and batched_mm (grouped_mm is transformers' default) and Poros'
    # grouped NF4 experts (poros_nf4_grouped) run on the device alone
    graph_unsafe=(("enable_moe_block", "MoE routing",
                   ("_experts_implementation", ("grouped_mm", "batched_mm", "poros_nf4_grouped"))),),
    optional_features=(
        # per-layer inputs (the E-models); absent when hidden_size_per_layer_input is 0/None
        ("hidden_size_per_layer_input", (
            "model.embed_tokens_per_layer", "model.per_layer_model_projection", "model.per_layer_projection_norm",
            "per_layer_input_gate", "per_layer_projection", "post_per_layer_input_norm",
        )),
        # MoE block beside the dense MLP (26B-A4B); absent unless enable_moe_block
        ("enable_moe_block", (
            "proj", "router.scale", "router.per_expert_scale", "experts.gate_up_proj", "experts.down_proj",
            "post_feedforward_layernorm_1", "post_feedforward_layernorm_2", "pre_feedforward_layernorm_2",
        )),
    ),
    notes=(
        "reentrant gradient checkpointing silently drops the KV-sharing gradients (42/98 LoRA grads differ).",
        "router.proj (leaf name 'proj') is quantized by bitsandbytes; excluded from LoRA targets by default.",
        "MoE experts stay bf16 under NF4 unless poros.quantize_experts; LoRA on them, bf16 or NF4: PEFT "
        "target_parameters=['experts.gate_up_proj', 'experts.down_proj'] (the trainer's default, lora_on_experts).",
        "KV-shared layers have no k_proj/v_proj/k_norm/v_norm; full layers with attention_k_eq_v have no v_proj.",
    ),
)


def _tiny_layer_types(num_layers: int, num_kv_shared_layers: int) -> list[str]:
    """Sliding layers ending in a full one, in the unshared prefix and in the shared tail alike.

    Both kinds must be produced before the first KV-shared layer (HF checks it), and the last
    layer must be full.
    """
    unshared = num_layers - num_kv_shared_layers
    head = [SLIDING_ATTENTION] * (unshared - 1) + [FULL_ATTENTION] if unshared else []
    tail = [SLIDING_ATTENTION] * (num_kv_shared_layers - 1) + [FULL_ATTENTION] if num_kv_shared_layers else []
    return head + tail


def _tiny_fields(e2b: bool):
    def fields(shape: TinyShape, overrides: dict) -> dict:
        num_layers = shape.num_layers
        shared = overrides.pop("num_kv_shared_layers", num_layers // 2 if e2b and num_layers >= 3 else 0)
        if shared and not 2 <= num_layers - shared < num_layers:
            raise ValueError(
                f"impossible tiny gemma4 config: num_kv_shared_layers={shared} of num_layers={num_layers}; KV "
                "sharing needs at least 2 unshared layers (one producer per layer kind) before the shared ones"
            )
        out = dict(
            head_dim=shape.head_dim, global_head_dim=2 * shape.head_dim, tie_word_embeddings=True,
            sliding_window=TINY_SLIDING_WINDOW, final_logit_softcapping=30.0,
            layer_types=_tiny_layer_types(num_layers, shared), num_kv_shared_layers=shared,
        )
        if e2b:
            out.update(use_double_wide_mlp=True, hidden_size_per_layer_input=8,
                       vocab_size_per_layer_input=shape.vocab_size)
        else:
            out.update(
                hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=4, top_k_experts=2,
                moe_intermediate_size=shape.hidden_size // 2, attention_k_eq_v=True, num_global_key_value_heads=1,
            )
        return out
    return fields


#: tiny test models (:mod:`poros.tiny`). ``e2b``: per-layer inputs, KV sharing (``num_layers // 2``
#: shared layers when ``num_layers >= 3``; override with ``num_kv_shared_layers``), double-wide MLP
#: on shared layers, ``global_head_dim``. ``moe``: MoE block (4 experts, top 2), ``attention_k_eq_v``
#: with 1 global KV head, per-layer inputs off (modelled on 26B-A4B).
TINY_VARIANTS = (
    TinyVariant("gemma4", "e2b", "Gemma4TextConfig", num_layers=6, head_dim=16, fields=_tiny_fields(True),
                head_dim_multiple=8, min_layers=3,
                description="per-layer inputs, KV sharing, double-wide MLP, global_head_dim"),
    TinyVariant("gemma4", "moe", "Gemma4TextConfig", num_layers=4, head_dim=16, fields=_tiny_fields(False),
                head_dim_multiple=8, min_layers=2, description="MoE block, attention_k_eq_v, per-layer inputs off"),
)

#: the tiny multimodal model: a one-layer vision tower, no audio tower.
TINY_MULTIMODAL = TinyMultimodal("gemma4", "Gemma4Config", "Gemma4ForConditionalGeneration", lambda text: dict(
    audio_config=None, vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=2, head_dim=16)))


@hookimpl
def poros_register_architectures(register):
    register(DESCRIPTOR)
