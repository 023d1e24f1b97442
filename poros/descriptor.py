"""ArchitectureDescriptor: everything family-specific the executor needs, as frozen torch-free data.

A descriptor is strings and tuples. Module paths are dotted attribute paths relative to the HF
``*ForCausalLM`` object (what ``AutoModelForCausalLM`` returns, or what PEFT wraps as
``base_model.model``). They are resolved to modules in one place, :func:`resolve_path`.

The executor is generic over these fields: it never asks which family it runs. A new family is
a new descriptor (usually built with :func:`decoder_family`), not new executor code.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

from poros.errors import DescriptorError

#: Layer kinds as HF writes them in ``config.layer_types``.
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LINEAR_ATTENTION = "linear_attention"
KNOWN_LAYER_KINDS = (FULL_ATTENTION, SLIDING_ATTENTION, LINEAR_ATTENTION)
#: a llama-style decoder layer's per-token modules beside its MLP: the two norms and the attention projections
PER_TOKEN_DEFAULT = ("input_layernorm", "post_attention_layernorm",
                     "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")

#: Why a sliding-window layer's SDPA attention needs a ``seq x seq`` tensor (``seq_by_seq_masks``).
SLIDING_WINDOW_MASK = (
    "sliding window: transformers materialises a [batch, 1, seq, seq] bool mask once seq >= sliding_window "
    "(SDPA has no window argument and its flash kernel takes no mask), so these layers run SDPA's "
    "memory-efficient kernel with the mask, which SDPA also converts to a float mask of the same shape"
)

#: Norm flavours (how a norm weight is applied), documented for users and the docs table.
NORM_STYLES = {
    "llama": "weight * x_normed.to(input_dtype) (Llama-style RMSNorm)",
    "zero_centered": "x_normed * (1 + weight) in fp32, then cast (Gemma-style RMSNorm, weights init 0)",
    "plain_fp32": "x * pow(mean(x^2) + eps, -0.5) * weight in fp32 (weights init 1)",
}


@dataclass(frozen=True)
class CarriedState:
    """Per-forward state, besides hidden states, that crosses block boundaries.

    Args:
        kwarg: keyword under which the HF text model passes the state to every decoder layer
            (the same object to each layer).
        kind: ``"mapping"``: a mutable mapping that some blocks write (``store``) and later blocks
            read (``reuse``); gradients of every reader must flow back into the writer.
            ``"per_layer_slice"``: a tensor built before the loop and sliced per layer; its
            gradients flow back into the prelude.
        description: one sentence for docs and ``list-architectures --json``.
        enabled_by: config attribute that switches the state on (``None``: always present).
        reader_flag, writer_flag, entry_key: (``"mapping"`` only) attribute paths on a decoder layer:
            truthy when that layer reads / writes the mapping, and the entry it reads or writes
            (Gemma 4: ``self_attn.is_kv_shared_layer``, ``self_attn.store_full_length_kv``,
            ``self_attn.layer_type``). With them ``cuda_graphs`` captures every block: a reader's
            entry is a static input, a writer's a static output; without them, blocks handed the
            mapping run eagerly.

    Note:
        The executor handles both kinds generically: mapping entries written during block i's
        forward are stashed detached, handed to later readers as leaves that require grad, and
        the readers' gradients are fed into block i's recompute in reverse layer order.
    """

    kwarg: str
    kind: str
    description: str
    enabled_by: str | None = None
    reader_flag: str | None = None
    writer_flag: str | None = None
    entry_key: str | None = None


@dataclass(frozen=True)
class ArchitectureDescriptor:
    """The facts about one model family that streaming needs. Frozen, hashable, torch-free.

    Module paths (all relative to the ``*ForCausalLM`` module):
        text_model: the decoder trunk whose output is ``last_hidden_state`` (``model``).
        decoder_layers: the ``nn.ModuleList`` of decoder blocks (``model.layers``).
        embeddings: the input token embedding (``model.embed_tokens``).
        final_norm: the norm applied after the last block (``model.norm``).
        head: the output projection (``lm_head``).
        rotary: the rotary embedding module(s) computed once per forward.
        prelude_modules: other model-level modules run before the loop (e.g. per-layer inputs).

    Layer facts:
        layer_kinds: every kind a layer of this family can have (``config.layer_types`` values).
        rotary_kinds: ``(layer kind, rotary description)`` pairs; one entry with kind ``"*"``
            when all layers share one ``(cos, sin)``.
        mask_kinds: ``(layer kind, transformers.masking_utils function)`` pairs.
        layer_call: how the HF text model calls a layer, as documentation
            (the executor reproduces it by capturing the HF call itself).
        carried_state: cross-block state besides hidden states, see :class:`CarriedState`.

    Numerics quirks:
        norm_style: key of :data:`NORM_STYLES`.
        embedding_scale: ``None`` or how the input embedding is scaled.
        final_logit_softcapping: config attribute holding the soft-cap (``None``: no soft-cap).
        tied_embeddings: config attribute that ties ``lm_head`` to the embedding.

    Adapters and quantization:
        lora_targets_default: leaf module names targeted by default (attention projections).
        lora_targets_all_linear: every ``nn.Linear`` leaf name inside a decoder layer that
            ``"all-linear"`` targets.
        lora_excluded: ``nn.Linear`` leaf names inside a layer deliberately NOT targeted, with
            the reason in ``notes``.
        never_quantized: parameter or module names inside a layer that stay in the compute
            dtype under NF4 (norms, conv, raw expert tensors, buffers); they stream too.
        model_level_linears: ``nn.Linear`` modules outside the decoder layers that bitsandbytes
            quantizes (and ``all-linear`` may target).
        optional_features: ``(config attribute, names)`` pairs: names of the fields above
            (model-level paths in ``prelude_modules``/``model_level_linears``, or layer-relative
            names in the LoRA and ``never_quantized`` lists) that exist only when that config
            attribute is truthy, e.g. Gemma 4's per-layer inputs (``hidden_size_per_layer_input``)
            and MoE block (``enable_moe_block``). Code that resolves these names skips the disabled ones
            (:meth:`disabled_names`); everything not listed here must exist on every model.

    Long sequences (``mlp_chunks``, the attention working set; ``poros.stream.tiling``, ``poros.plan.attention``):
        mlp: the per-token feed-forward module of a decoder layer (layer-relative path), called as
            ``mlp(hidden_states)`` and returning a tensor of the same leading shape; ``mlp_chunks``
            tiles it over the sequence. ``""``: the family has none to tile.
        per_token: the other per-token modules of a decoder layer (layer-relative paths: its norms and its
            attention or linear-attention projections), each called as ``module(x)`` on ``[..., seq, hidden]``
            and acting on the last dimension alone; ``mlp_chunks`` tiles them over the sequence like the
            MLP (a path missing on a layer, e.g. another layer kind's projections, is skipped there).
        mlp_untiled: ``(config attribute, reason)`` pairs: sequence-proportional parts of a block
            beside ``mlp`` that ``mlp_chunks`` leaves whole when that attribute is truthy (e.g. MoE
            experts that route all tokens of the block together).
        seq_by_seq_masks: ``(layer kind, reason)`` pairs: layer kinds whose SDPA attention gets a
            materialised ``batch x 1 x seq x seq`` mask from transformers (so never the flash kernel),
            and why; the planner prints the reason.
        head_dims: ``(layer kind, config attribute)`` pairs: a layer kind whose heads are not
            ``config.head_dim`` wide (e.g. Gemma 4's full layers, ``global_head_dim``).
        packing_unsupported: why ``packing: true`` cannot train this family (its layers do not keep
            packed examples apart by their ``position_ids`` restarts), or ``""`` where it can
            (``poros.data.packing``).

    Identity:
        name: registry name (``qwen2``); aliases: other accepted names; model_types: HF
        ``config.model_type`` values; causal_lm_classes: transformers class names.
    """

    name: str
    display_name: str
    model_types: tuple[str, ...]
    causal_lm_classes: tuple[str, ...]
    aliases: tuple[str, ...] = ()
    # module paths
    text_model: str = "model"
    decoder_layers: str = "model.layers"
    embeddings: str = "model.embed_tokens"
    final_norm: str = "model.norm"
    head: str = "lm_head"
    rotary: str = "model.rotary_emb"
    prelude_modules: tuple[str, ...] = ()
    # layers
    layer_kinds_attr: str = "layer_types"
    layer_kinds: tuple[str, ...] = (FULL_ATTENTION,)
    rotary_kinds: tuple[tuple[str, str], ...] = (("*", "rope"),)
    mask_kinds: tuple[tuple[str, str], ...] = ((FULL_ATTENTION, "create_causal_mask"),)
    layer_call: str = ""
    carried_state: tuple[CarriedState, ...] = ()
    # numerics
    norm_style: str = "llama"
    embedding_scale: str | None = None
    final_logit_softcapping: str | None = None
    tied_embeddings: str = "tie_word_embeddings"
    # adapters, quantization
    lora_targets_default: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    lora_targets_all_linear: tuple[str, ...] = (
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
    )
    lora_excluded: tuple[str, ...] = ()
    never_quantized: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
    model_level_linears: tuple[str, ...] = ()
    optional_features: tuple[tuple[str, tuple[str, ...]], ...] = ()
    #: (config attribute, reason[, (another attribute, its values that can be captured)]): with
    #: ``cuda_graphs`` on, a truthy attribute keeps the blocks eager unless the other attribute holds
    #: one of those values (e.g. MoE routing: host syncs in transformers' eager experts loop, none in
    #: its grouped_mm); ``poros.stream.graphs`` reports the reason with what was found
    graph_unsafe: tuple[tuple, ...] = ()
    # long sequences
    mlp: str = "mlp"
    per_token: tuple[str, ...] = PER_TOKEN_DEFAULT
    mlp_untiled: tuple[tuple[str, str], ...] = ()
    seq_by_seq_masks: tuple[tuple[str, str], ...] = ()
    head_dims: tuple[tuple[str, str], ...] = ()
    packing_unsupported: str = ""
    # documentation
    notes: tuple[str, ...] = ()
    config_class: str = ""
    extra: tuple[tuple[str, Any], ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        problems = validate(self)
        if problems:
            raise DescriptorError(
                f"descriptor {self.name!r} is malformed: " + "; ".join(problems)
                + ". Fix the descriptor's fields (see poros.descriptor.ArchitectureDescriptor)."
            )

    @property
    def all_names(self) -> tuple[str, ...]:
        """Every string lookup accepts for this family: name, aliases and HF model types."""
        return tuple(dict.fromkeys((self.name, *self.aliases, *self.model_types)))

    def disabled_names(self, config: Any) -> frozenset[str]:
        """Names from :attr:`optional_features` whose config attribute is missing or falsy on ``config``."""
        return frozenset(
            name for attribute, names in self.optional_features
            if not getattr(config, attribute, None) for name in names
        )

    def graph_unsafe_reason(self, config: Any) -> str | None:
        """Why this model's blocks cannot be captured in CUDA graphs (:attr:`graph_unsafe`), naming the
        attributes found (``"MoE routing (enable_moe_block, experts_implementation='eager')"``), or None."""
        for attribute, reason, *unless in self.graph_unsafe:
            if not getattr(config, attribute, None):
                continue
            if not unless:
                return f"{reason} ({attribute})"
            other, capturable = unless[0]
            if getattr(config, other, None) not in capturable:
                return f"{reason} ({attribute}, {other.lstrip('_')}={getattr(config, other, None)!r})"
        return None

    def mlp_untiled_reason(self, config: Any) -> str | None:
        """What in this model's blocks is sequence-proportional and not tiled by ``mlp_chunks``
        (:attr:`mlp_untiled`), naming the attributes found (``"MoE experts ... (enable_moe_block)"``), or None."""
        found = [f"{reason} ({attribute})" for attribute, reason in self.mlp_untiled if getattr(config, attribute, None)]
        return "; ".join(found) or None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (for ``--json`` listings and docs)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "carried_state":
                value = [vars(c) | {} for c in value]
            elif f.name == "optional_features":
                value = {attribute: list(names) for attribute, names in value}
            elif isinstance(value, tuple):
                value = [list(v) if isinstance(v, tuple) else v for v in value]
            out[f.name] = value
        return out


def validate(descriptor: ArchitectureDescriptor) -> list[str]:
    """Structural checks that need no model. Returns a list of problems (empty when valid)."""
    problems = []
    if not descriptor.name or not descriptor.name.replace("_", "").replace("-", "").isalnum():
        problems.append(f"name {descriptor.name!r} must be a non-empty identifier like 'qwen2'")
    if not descriptor.model_types:
        problems.append("model_types is empty; give at least the HF config.model_type")
    if not descriptor.causal_lm_classes:
        problems.append("causal_lm_classes is empty; give the transformers *ForCausalLM class name")
    for attr in ("model_types", "aliases", "causal_lm_classes", "layer_kinds", "prelude_modules",
                 "lora_targets_default", "lora_targets_all_linear", "lora_excluded",
                 "never_quantized", "model_level_linears", "notes", "per_token"):
        value = getattr(descriptor, attr)
        if not isinstance(value, tuple) or not all(isinstance(v, str) for v in value):
            problems.append(f"{attr} must be a tuple of strings, got {value!r}")
    for attr in ("text_model", "decoder_layers", "embeddings", "final_norm", "head"):
        value = getattr(descriptor, attr)
        if not isinstance(value, str) or not value or " " in value:
            problems.append(f"{attr} must be a dotted module path, got {value!r}")
    if not isinstance(descriptor.mlp, str) or " " in descriptor.mlp:
        problems.append(f"mlp must be a layer-relative dotted module path or '', got {descriptor.mlp!r}")
    for attr in ("mlp_untiled", "seq_by_seq_masks", "head_dims"):
        value = getattr(descriptor, attr)
        if not isinstance(value, tuple) or not all(
                isinstance(v, tuple) and len(v) == 2 and all(isinstance(x, str) and x for x in v) for v in value):
            problems.append(f"{attr} must be a tuple of (string, string) pairs, got {value!r}")
    for attr in ("seq_by_seq_masks", "head_dims"):
        for entry in getattr(descriptor, attr) if isinstance(getattr(descriptor, attr), tuple) else ():
            if isinstance(entry, tuple) and entry and entry[0] not in kinds_of(descriptor):
                problems.append(f"{attr} names layer kind {entry[0]!r} that layer_kinds lacks")
    if descriptor.norm_style not in NORM_STYLES:
        problems.append(f"norm_style {descriptor.norm_style!r} is not one of {sorted(NORM_STYLES)}")
    kinds = set(descriptor.layer_kinds) if isinstance(descriptor.layer_kinds, tuple) else set()
    for kind, _ in descriptor.mask_kinds:
        if kind not in kinds:
            problems.append(f"mask_kinds names layer kind {kind!r} that layer_kinds lacks")
    for kind, _ in descriptor.rotary_kinds:
        if kind != "*" and kind not in kinds:
            problems.append(f"rotary_kinds names layer kind {kind!r} that layer_kinds lacks")
    missing_default = set(descriptor.lora_targets_default) - set(descriptor.lora_targets_all_linear)
    if missing_default:
        problems.append(f"lora_targets_default {sorted(missing_default)} not in lora_targets_all_linear")
    both = set(descriptor.lora_targets_all_linear) & set(descriptor.lora_excluded)
    if both:
        problems.append(f"{sorted(both)} are both targets and excluded")
    for c in descriptor.carried_state:
        if not isinstance(c, CarriedState) or c.kind not in ("mapping", "per_layer_slice"):
            problems.append(f"carried_state entry {c!r} must be a CarriedState of kind mapping|per_layer_slice")
    named = {*descriptor.prelude_modules, *descriptor.model_level_linears, *descriptor.lora_targets_all_linear,
             *descriptor.lora_excluded, *descriptor.never_quantized}
    for entry in descriptor.optional_features:
        if (not isinstance(entry, tuple) or len(entry) != 2 or not isinstance(entry[0], str)
                or not isinstance(entry[1], tuple) or not all(isinstance(n, str) for n in entry[1])):
            problems.append(f"optional_features entry {entry!r} must be (config attribute, tuple of names)")
            continue
        unknown = sorted(set(entry[1]) - named)
        if unknown:
            problems.append(
                f"optional_features[{entry[0]!r}] names {unknown}, which no prelude_modules/model_level_linears/"
                "lora_targets_all_linear/lora_excluded/never_quantized entry lists"
            )
    listed = (*descriptor.aliases, *descriptor.model_types)
    repeated = sorted({n for n in listed if listed.count(n) > 1} | ({descriptor.name} & set(descriptor.aliases)))
    if repeated:
        problems.append(f"aliases/model_types repeat {repeated}; list each name once")
    return problems


def kinds_of(descriptor: ArchitectureDescriptor) -> set[str]:
    """The layer kinds a descriptor declares (empty when ``layer_kinds`` is malformed)."""
    return set(descriptor.layer_kinds) if isinstance(descriptor.layer_kinds, tuple) else set()


def decoder_family(**kwargs: Any) -> ArchitectureDescriptor:
    """Build a descriptor for a Llama-shaped decoder-only family, overriding what differs.

    Every keyword is a field of :class:`ArchitectureDescriptor`; unspecified fields keep the
    Llama-shaped defaults (``model.layers``, ``model.norm``, ``lm_head``, SwiGLU projections).

    Raises:
        DescriptorError: a field is malformed (see :func:`validate`).
        TypeError: a keyword is not a descriptor field.
    """
    return ArchitectureDescriptor(**kwargs)


def derive(descriptor: ArchitectureDescriptor, **changes: Any) -> ArchitectureDescriptor:
    """A copy of ``descriptor`` with ``changes`` applied (e.g. a sibling family)."""
    return replace(descriptor, **changes)


def resolve_path(root: Any, path: str) -> Any:
    """Resolve a dotted descriptor path (``model.layers``) on a module; the one place paths turn into objects.

    Raises:
        DescriptorError: a component is missing; the message names the component and what exists.
    """
    obj = root
    for part in path.split("."):
        if part.isdigit() and hasattr(obj, "__getitem__"):
            obj = obj[int(part)]
            continue
        if not hasattr(obj, part):
            children = sorted(getattr(obj, "_modules", {}) or vars(obj).keys())
            raise DescriptorError(
                f"path {path!r}: {type(obj).__name__} has no attribute {part!r} (it has {children}). "
                "The descriptor does not match this model; check the family or the module path."
            )
        obj = getattr(obj, part)
    return obj
