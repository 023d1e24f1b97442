"""What llama.cpp's converter does per architecture, for ``poros merge --format gguf`` (:mod:`poros.export.gguf`):
which checkpoint tensors become which GGUF tensors, with which transform, and the architecture's metadata.

The converter is llama.cpp's ``convert_hf_to_gguf.py`` (its classes in ``conversion/``), at the llama.cpp
node-llama-cpp 3.22.1 bundles (tests/test_gguf_llama_cpp.py loads the files in that llama.cpp). One class here per
converter class, named after it, doing what its ``filter_tensors`` / ``modify_tensors`` /
``generate_extra_tensors`` / ``set_gguf_parameters`` do:

* :class:`TextConverter` (``TextModel``; Qwen2 and Qwen3): names from gguf-py's ``TensorNameMap``, no transform;
* :class:`Qwen35Converter` (``Qwen3_5TextModel`` / ``Qwen3_5MoeTextModel`` over ``_LinearAttentionVReorderBase``,
  ``Qwen3NextModel``, ``Qwen2MoeModel``): Gated DeltaNet tensors (``A_log`` -> ``-exp``, ``dt_bias`` ->
  ``ssm_dt.bias``, ``conv1d`` squeezed, V heads reordered from grouped to tiled where K heads are fewer), the
  zero-centred norms ``+ 1``, experts one matrix each stacked into ``ffn_{gate,up,down}_exps`` (or fused
  ``gate_up_proj`` split in two), the shared expert and its gate; written as with ``--no-mtp`` (the multi-token
  prediction layers, which no LoRA touches, stay out);
* :class:`Gemma4Converter` (``Gemma4Model`` over ``Gemma3Model``): fused ``ffn_gate_up_exps``, the router's
  ``scale`` and ``per_expert_scale`` as ``ffn_gate_inp.scale`` / ``ffn_down_exps.scale``, ``layer_scalar``, the
  proportional-RoPE ``rope_freqs`` of the full-attention layers, per-layer-kind head dims, KV heads and RoPE.

A transform is a function of the source tensors (one, or every expert's matrix); the file's layout is that
function run on ``meta`` tensors (shapes only), its data the same function on the merged tensors, so the two
cannot disagree. The sources reach it as the converter holds them: bf16 as float32, f16 and f32 as they are.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

import torch

from poros.errors import UnsupportedModelError

#: where a tensor llama.cpp's architecture has no name for sends the user
FIX = ("Fix: merge to safetensors (poros merge without --format) and convert that with llama.cpp's "
       "convert_hf_to_gguf.py.")


@dataclass(frozen=True)
class Source:
    """One checkpoint tensor: its shard (index into the checkpoint's weight files), its checkpoint key, its name in
    the causal LM (``model_key``), its shape."""

    shard: int
    key: str
    name: str
    shape: tuple[int, ...]


Build = Callable[[list[torch.Tensor]], torch.Tensor]


@dataclass(frozen=True)
class Planned:
    """One GGUF tensor: llama.cpp's name, the checkpoint tensors it is made of and how (``build``)."""

    name: str
    sources: tuple[Source, ...]
    build: Build

    def shape(self) -> tuple[int, ...]:
        """Its shape (torch order), from ``build`` run on meta tensors."""
        metas = [torch.empty(source.shape, dtype=torch.float32, device="meta") for source in self.sources]
        return tuple(self.build(metas).shape)


def _one(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0]


def _then(build: Build, step: Callable[[torch.Tensor], torch.Tensor]) -> Build:
    return lambda tensors: step(build(tensors))


def _block(name: str) -> int | None:
    """The converter's block id: the first number-like part of the name."""
    return next((int(part) for part in name.split(".") if part.isdecimal()), None)


class TextConverter:
    """``TextModel``: every text tensor named by gguf-py's ``TensorNameMap``; the vision tower (if any) left out;
    the hyperparameters every architecture has."""

    #: checkpoint names (causal LM names) left out of the file, as the converter's ``filter_tensors`` leaves them
    skipped: tuple[str, ...] = ()

    def __init__(self, arch: str, config: Any) -> None:
        import gguf

        self.arch = arch
        self.config = config
        self.names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)

    def plan(self, sources: list[Source]) -> list[Planned]:
        """Every GGUF tensor of the checkpoint's ``sources``, in checkpoint order (generated tensors first).

        Raises:
            UnsupportedModelError: a tensor llama.cpp's architecture has no name for.
        """
        planned = list(self.extra())
        kept = [source for source in sources if not any(re.match(prefix, source.name) for prefix in self.skipped)]
        for name, group, build in self.group(kept):
            name, build = self.rename(name, build)
            planned.extend(Planned(new_name, group, new_build) for new_name, new_build in self.modify(name, build))
        return planned

    def group(self, sources: list[Source]) -> list[tuple[str, tuple[Source, ...], Build]]:
        """``(name, sources, build)`` per tensor the converter's ``modify_tensors`` sees (one source each here)."""
        return [(source.name, (source,), _one) for source in sources]

    def rename(self, name: str, build: Build) -> tuple[str, Build]:
        """The converter's ``filter_tensors``: a name as its ``modify_tensors`` receives it."""
        return name, build

    def modify(self, name: str, build: Build) -> list[tuple[str, Build]]:
        """The converter's ``modify_tensors`` of one tensor: llama.cpp's name(s) and the transform(s)."""
        return [(self.map(name), build)]

    def extra(self) -> list[Planned]:
        """The converter's ``generate_extra_tensors`` (none here)."""
        return []

    def write_vocabulary(self, writer: Any, plan: Any, arch: Any) -> str:
        """The tokenizer, as the converter's ``set_vocab`` writes it (here: the GPT-2 BPE vocabulary,
        :func:`poros.export.gguf_tokenizer.write_tokenizer`); returns the file's pre-tokenizer."""
        from poros.export.gguf_tokenizer import load_tokenizer, tokenizer_pre, tokenizer_source, write_tokenizer

        write_tokenizer(writer, plan, arch)
        return tokenizer_pre(load_tokenizer(tokenizer_source(plan)))

    def map(self, name: str) -> str:
        found = self.names.get_name(name, try_suffixes=(".weight", ".bias"))
        if found is None:
            raise UnsupportedModelError(f"{name} has no name in llama.cpp's {self.arch} architecture; expected only "
                                        f"the text model's tensors. {FIX}")
        return found

    def metadata(self, writer: Any) -> None:
        """The hyperparameters llama.cpp reads (``TextModel.set_gguf_parameters`` and the class's own).

        Raises:
            UnsupportedModelError: sliding-window attention llama.cpp's architecture lacks, or a RoPE scaling it lacks.
        """
        config = self.config
        if getattr(config, "use_sliding_window", False):
            raise UnsupportedModelError(
                f"the base uses sliding-window attention (use_sliding_window: true, window {config.sliding_window}); "
                f"llama.cpp's {self.arch} attends to every token, so it would compute another model. Fix: merge to "
                "safetensors (poros merge without --format) and serve it with transformers or vLLM.")
        writer.add_block_count(config.num_hidden_layers)
        writer.add_context_length(config.max_position_embeddings)
        writer.add_embedding_length(config.hidden_size)
        if getattr(config, "intermediate_size", None) is not None:
            writer.add_feed_forward_length(config.intermediate_size)
        writer.add_head_count(config.num_attention_heads)
        writer.add_head_count_kv(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        self.rope(writer, dict(getattr(config, "rope_parameters", None) or {}))
        writer.add_layer_norm_rms_eps(config.rms_norm_eps)
        if getattr(config, "num_experts", None) is not None:
            writer.add_expert_count(config.num_experts)
        if getattr(config, "num_experts_per_tok", None) is not None:
            writer.add_expert_used_count(config.num_experts_per_tok)
        head_dim = getattr(config, "head_dim", None)
        if head_dim is not None:
            writer.add_key_length(head_dim)
            writer.add_value_length(head_dim)

    def rope(self, writer: Any, rope: dict) -> None:
        """RoPE base and scaling (linear, yarn); the converter's other kinds write nothing llama.cpp would use,
        so Poros refuses them."""
        import gguf

        theta = rope.get("rope_theta", getattr(self.config, "rope_theta", None))
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", "linear", "yarn"):
            raise UnsupportedModelError(
                f"the base scales RoPE with {kind!r}; GGUF for {self.arch} is written with linear or yarn scaling "
                "only. Fix: merge to safetensors (poros merge without --format).")
        if kind != "default":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR if kind == "linear" else gguf.RopeScalingType.YARN)
            writer.add_rope_scaling_factor(float(rope["factor"]))
            if kind == "yarn" and rope.get("original_max_position_embeddings"):
                writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
        if "mrope_section" in rope:
            writer.add_rope_dimension_sections((list(rope["mrope_section"]) + [0, 0, 0, 0])[:4])
        if theta is not None:
            writer.add_rope_freq_base(float(theta))


#: ``(experts path, index, projection)`` of one expert's matrix in a checkpoint
EXPERT_MATRIX = re.compile(r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


class Qwen35Converter(TextConverter):
    """``Qwen3_5MoeTextModel`` / ``Qwen3_5TextModel``: ``_LinearAttentionVReorderBase``, ``Qwen3NextModel``
    (with ``--no-mtp``), ``Qwen2MoeModel``; the mRoPE sections always written (``_Qwen35MRopeMixin``)."""

    skipped = (r"mtp\.", r"model\.mtp\.", r"model\.visual\.", r"visual\.")
    DEFAULT_MROPE_SECTION = [11, 11, 10, 0]

    def group(self, sources: list[Source]) -> list[tuple[str, tuple[Source, ...], Build]]:
        """``Qwen2MoeModel``: one matrix per expert (``experts.<e>.<proj>.weight``) stacked ``[E, out, in]`` in
        expert order, at the place of the layer's last expert matrix.

        Raises:
            UnsupportedModelError: a layer's experts are not numbered 0..num_experts-1 for every projection.
        """
        experts = self.config.num_experts if getattr(self.config, "num_experts", None) else 0
        stacks: dict[tuple[str, str], dict[int, Source]] = {}
        for source in sources:
            found = EXPERT_MATRIX.fullmatch(source.name)
            if found:
                stacks.setdefault((found.group(1), found.group(3)), {})[int(found.group(2))] = source
        grouped: list[tuple[str, tuple[Source, ...], Build]] = []
        for source in sources:
            found = EXPERT_MATRIX.fullmatch(source.name)
            if not found:
                grouped.append((source.name, (source,), _one))
                continue
            stack = stacks[(found.group(1), found.group(3))]
            if sorted(stack) != list(range(experts)):
                raise UnsupportedModelError(
                    f"{found.group(1)} has {found.group(3)} matrices for experts {sorted(stack)[:8]}..., expected one "
                    f"for each of the {experts} experts (num_experts). Is the checkpoint complete?")
            if source is stack[max(stack)]:
                grouped.append((f"{found.group(1)}.{found.group(3)}.weight",
                                tuple(stack[e] for e in range(experts)), lambda tensors: torch.stack(tensors, dim=0)))
        return grouped

    def modify(self, name: str, build: Build) -> list[tuple[str, Build]]:
        build = self.reorder_v_heads(name, build)
        if name.endswith(".A_log"):
            build = _then(build, lambda t: -torch.exp(t))
        elif name.endswith(".dt_bias"):
            name = name.rpartition(".dt_bias")[0] + ".dt_proj.bias"
        elif "conv1d" in name:
            build = _then(build, torch.squeeze)
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            build = _then(build, lambda t: t + 1)  # the zero-centred RMSNorm's (1 + w)
        if name.endswith(("mlp.experts.down_proj", "mlp.experts.down_proj.weight")):
            return [(self.map(name if name.endswith(".weight") else f"{name}.weight"), build)]
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj.weight")):  # fused on disk: split
            base = name.removesuffix(".weight").removesuffix(".gate_up_proj")
            gate = _then(build, lambda t: t[..., :t.shape[-2] // 2, :].contiguous())
            up = _then(build, lambda t: t[..., t.shape[-2] // 2:, :].contiguous())
            return [(self.map(f"{base}.gate_proj.weight"), gate), (self.map(f"{base}.up_proj.weight"), up)]
        return [(self.map(name), build)]

    def reorder_v_heads(self, name: str, build: Build) -> Build:
        """``_LinearAttentionVReorderBase``: where DeltaNet has fewer K heads than V heads, the V heads of every
        tensor that holds them go from grouped by K head to tiled (``[G0_v0, G1_v0, ..., G0_v1, ...]``)."""
        config = self.config
        k_heads = getattr(config, "linear_num_key_heads", 0) or 0
        v_heads = getattr(config, "linear_num_value_heads", 0) or 0
        if not (k_heads > 0 and v_heads > 0 and k_heads != v_heads and "linear_attn." in name):
            return build
        k_dim, v_dim, per_k = config.linear_key_head_dim, config.linear_value_head_dim, v_heads // k_heads

        def tiled(tensor: torch.Tensor, dim: int, head_dim: int) -> torch.Tensor:
            shape = list(tensor.shape)
            dim = dim % len(shape)
            split = tensor.reshape(*shape[:dim], k_heads, per_k, head_dim, *shape[dim + 1:])
            return split.transpose(dim, dim + 1).contiguous().reshape(*shape)

        if ".in_proj_qkv." in name:
            qk = 2 * k_dim * k_heads
            return _then(build, lambda t: torch.cat([t[:qk], tiled(t[qk:], 0, v_dim)], dim=0))
        if ".in_proj_z." in name:
            return _then(build, lambda t: tiled(t, 0, v_dim))
        if ".in_proj_b." in name or ".in_proj_a." in name:
            return _then(build, lambda t: tiled(t, 0, 1))
        if ".A_log" in name or ".dt_bias" in name or ".dt_proj" in name:
            return _then(build, lambda t: tiled(t.unsqueeze(-1), 0, 1).squeeze(-1) if t.dim() == 1 else tiled(t, -1, 1))
        if ".conv1d" in name:
            qk = 2 * k_dim * k_heads
            return _then(build, lambda t: torch.cat([t.squeeze()[:qk], tiled(t.squeeze()[qk:], 0, v_dim)], dim=0))
        if ".out_proj." in name:
            return _then(build, lambda t: tiled(t, 1, v_dim))
        return build

    def metadata(self, writer: Any) -> None:
        config = self.config
        super().metadata(writer)
        if getattr(config, "moe_intermediate_size", None) is not None:
            writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        if getattr(config, "shared_expert_intermediate_size", None) is not None:
            writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
        writer.add_ssm_conv_kernel(config.linear_conv_kernel_dim)
        writer.add_ssm_state_size(config.linear_key_head_dim)
        writer.add_ssm_group_count(config.linear_num_key_heads)
        writer.add_ssm_time_step_rank(config.linear_num_value_heads)
        writer.add_ssm_inner_size(config.linear_value_head_dim * config.linear_num_value_heads)
        layer_types = list(getattr(config, "layer_types", None) or [])
        if layer_types:  # gguf-py's add_recurrent_layers, by its key (older gguf packages lack the method)
            writer.add_array(f"{self.arch}.attention.recurrent_layers", [t == "linear_attention" for t in layer_types])
        writer.add_full_attention_interval(getattr(config, "full_attention_interval", None) or 4)
        rope = dict(getattr(config, "rope_parameters", None) or {})
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 0.25)))
        if "mrope_section" not in rope:
            writer.add_rope_dimension_sections(self.DEFAULT_MROPE_SECTION)


class Gemma4Converter(TextConverter):
    """``Gemma4Model`` (over ``Gemma3Model``): sliding and full layers with their own head dims, KV heads and RoPE,
    the MoE block beside the dense MLP, ``layer_scalar``; norms as stored (Gemma 4's RMSNorm multiplies by ``w``)."""

    skipped = (r"model\.vision_tower\.", r"model\.audio_tower\.", r"model\.embed_vision\.", r"model\.embed_audio\.")

    def rename(self, name: str, build: Build) -> tuple[str, Build]:
        if name.endswith(("per_dim_scale", "layer_scalar")):
            name += ".weight"
        if ".experts." in name and not name.endswith(".weight"):
            name += ".weight"
        return name, build

    def modify(self, name: str, build: Build) -> list[tuple[str, Build]]:
        block = _block(name)
        if name.endswith("router.scale"):
            return [(f"blk.{block}.ffn_gate_inp.scale", build)]
        if ".per_expert_scale" in name:
            return [(f"blk.{block}.ffn_down_exps.scale", build)]
        return [(self.map(name), build)]

    #: the tokens the converter writes as user-defined so that they are rendered (llama.cpp's chat parser reads them)
    VISIBLE_TOKENS = frozenset({"<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "<|tool_response>",
                                "<tool_response|>", '<|"|>'})

    def write_vocabulary(self, writer: Any, plan: Any, arch: Any) -> str:
        """Gemma's own tokenizer (SentencePiece-style BPE with byte fallback) as llama.cpp's ``gemma4`` tokenizer
        model (:func:`poros.export.gguf_tokenizer.write_sentencepiece_bpe`); a byte-level BPE tokenizer as GPT-2
        BPE (what the converter's ``gemma4`` model cannot read, so llama.cpp's ``gpt2`` model)."""
        from poros.export.gguf_tokenizer import (load_tokenizer, sentencepiece_bpe, tokenizer_source,
                                                 write_sentencepiece_bpe)

        source = tokenizer_source(plan)
        if not sentencepiece_bpe(load_tokenizer(source)):
            return super().write_vocabulary(writer, plan, arch)
        write_sentencepiece_bpe(writer, source, "gemma4", self.VISIBLE_TOKENS, self.config.vocab_size)
        return "gemma4"

    def per_layer(self, key: str) -> Any:
        """The converter's reading of a full-attention layer's ``key`` (``head_dim``, ``num_key_value_heads``): the
        config's ``global_head_dim`` / ``num_global_key_value_heads``, else the first full layer's
        ``per_layer_config`` entry (config.json's spelling; transformers' config object exposes only a per-layer
        view of it)."""
        hparams = self.config.to_dict()
        found = hparams.get({"head_dim": "global_head_dim", "num_key_value_heads": "num_global_key_value_heads"}[key])
        if found is None:
            layer_types = hparams.get("layer_types", [])
            for index, layer in (hparams.get("per_layer_config") or {}).items():
                if int(index) < len(layer_types) and layer_types[int(index)] == "full_attention" and key in layer:
                    return layer[key]
        return found

    def head_dim_full(self) -> int:
        return self.per_layer("head_dim")

    def extra(self) -> list[Planned]:
        """``rope_freqs.weight``: the full layers' proportional RoPE as llama.cpp's neox RoPE over the whole head,
        frequency factor 1 on the rotated pairs and 1e30 (no rotation) on the rest."""
        full = self.config.rope_parameters["full_attention"]
        if full.get("rope_type") != "proportional":
            raise UnsupportedModelError(f"the base's full-attention layers use {full.get('rope_type')!r} RoPE; "
                                        f"llama.cpp's gemma4 expects 'proportional'. {FIX}")
        head_dim = self.head_dim_full()
        rotated = int(head_dim * full["partial_rotary_factor"] / 2)
        values = [1.0] * rotated + [1e30] * (head_dim // 2 - rotated)
        return [Planned("rope_freqs.weight", (), lambda _: torch.tensor(values, dtype=torch.float32))]

    def metadata(self, writer: Any) -> None:
        config = self.config
        hparams = config.to_dict()  # head_dim and num_key_value_heads: the sliding layers' (config.json's fields)
        full = config.rope_parameters["full_attention"]
        sliding = config.rope_parameters.get("sliding_attention", {})
        layer_types = list(config.layer_types)
        swa = [kind == "sliding_attention" for kind in layer_types]
        writer.add_block_count(config.num_hidden_layers)
        writer.add_context_length(config.max_position_embeddings)
        writer.add_embedding_length(config.hidden_size)
        if not getattr(config, "use_double_wide_mlp", False):  # else per layer, below
            writer.add_feed_forward_length(config.intermediate_size)
        writer.add_head_count(config.num_attention_heads)
        writer.add_rope_freq_base(float(full["rope_theta"]))
        if sliding.get("rope_theta") is not None:
            writer.add_rope_freq_base_swa(float(sliding["rope_theta"]))
        writer.add_layer_norm_rms_eps(config.rms_norm_eps)
        if getattr(config, "num_experts", None) is not None:
            writer.add_expert_count(config.num_experts)
        if getattr(config, "top_k_experts", None) is not None:
            writer.add_expert_used_count(config.top_k_experts)
        if getattr(config, "final_logit_softcapping", None):
            writer.add_final_logit_softcapping(config.final_logit_softcapping)
        writer.add_sliding_window(config.sliding_window)
        writer.add_shared_kv_layers(getattr(config, "num_kv_shared_layers", 0) or 0)
        writer.add_embedding_length_per_layer_input(getattr(config, "hidden_size_per_layer_input", 0) or 0)
        writer.add_sliding_window_pattern(swa)
        head_dim_full = self.head_dim_full()
        writer.add_key_length(head_dim_full)
        writer.add_value_length(head_dim_full)
        writer.add_key_length_swa(hparams["head_dim"])
        writer.add_value_length_swa(hparams["head_dim"])
        if getattr(config, "moe_intermediate_size", None) is not None:
            writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        if getattr(config, "use_double_wide_mlp", False):
            first_shared = config.num_hidden_layers - (getattr(config, "num_kv_shared_layers", 0) or 0)
            writer.add_feed_forward_length([config.intermediate_size * (1 if i < first_shared else 2)
                                            for i in range(config.num_hidden_layers)])
        kv_full = self.per_layer("num_key_value_heads")
        kv_heads = hparams["num_key_value_heads"]
        writer.add_head_count_kv([kv_heads if is_swa else kv_full for is_swa in swa] if kv_full is not None
                                 else kv_heads)
        writer.add_rope_dimension_count(int(head_dim_full))
        # the converter reads the factor at the top of rope_parameters, which Gemma 4 nests per layer kind: 1.0
        factor = config.rope_parameters.get("partial_rotary_factor", 1.0)
        writer.add_rope_dimension_count_swa(int(hparams["head_dim"] * factor))


@dataclass(frozen=True)
class GgufArchitecture:
    """How llama.cpp names a family.

    Attributes:
        arch: gguf-py's architecture name (``gguf.MODEL_ARCH_NAMES``), ``general.architecture``.
        tokenizer_pre: the pre-tokenizer the family's published tokenizers get from llama.cpp's converter
            (informational, for the docs' table); the file's own ``tokenizer.ggml.pre`` is chosen from the
            tokenizer exported (:func:`poros.export.gguf_tokenizer.tokenizer_pre`), as the converter chooses it.
        converter: the converter class's counterpart here (its tensors and metadata).
    """

    arch: str
    tokenizer_pre: str
    converter: type[TextConverter] = TextConverter


#: HF ``model_type`` -> its GGUF architecture (convert_hf_to_gguf.py: Qwen2Model, Qwen3Model, Qwen3_5MoeTextModel,
#: Gemma4Model); both the text model's type and the multimodal checkpoint's
GGUF_ARCHITECTURES = {
    "qwen2": GgufArchitecture("qwen2", "qwen2"),
    "qwen3": GgufArchitecture("qwen3", "qwen2"),
    "qwen3_5_moe_text": GgufArchitecture("qwen35moe", "qwen35", Qwen35Converter),
    "qwen3_5_moe": GgufArchitecture("qwen35moe", "qwen35", Qwen35Converter),
    "gemma4_text": GgufArchitecture("gemma4", "gemma4", Gemma4Converter),
    "gemma4": GgufArchitecture("gemma4", "gemma4", Gemma4Converter),
}


def converter_dtype(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor as the converter's ``prepare_tensors`` hands it to ``modify_tensors``: f16 and f32 as they are,
    any other dtype (bf16) as float32."""
    return tensor if tensor.dtype in (torch.float16, torch.float32) else tensor.to(torch.float32)


__all__ = ["EXPERT_MATRIX", "GGUF_ARCHITECTURES", "Gemma4Converter", "GgufArchitecture", "Planned", "Qwen35Converter",
           "Source", "TextConverter", "converter_dtype"]
