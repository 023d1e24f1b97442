"""The attention working set at a sequence length: which SDPA kernel a block's attention can take, and
the ``seq x seq`` bytes transformers' masks put beside it. Torch-free (``poros plan`` calls it).

Transformers builds one mask per layer kind before the layer loop (``transformers.masking_utils``)
and hands it to every layer of that kind; with ``attn_implementation="sdpa"`` each layer calls
``torch.nn.functional.scaled_dot_product_attention`` (``integrations/sdpa_attention.py``):

=========================  ===================================================  ==================
layer kind / mask          what the layer gets                                  SDPA kernel
=========================  ===================================================  ==================
full, no padding/packing   ``None``: ``is_causal=True`` (and ``enable_gqa``)    flash (or efficient)
full, padded or packed     ``[batch, 1, seq, seq]`` bool, K/V repeated per head efficient, never flash
sliding, seq >= window     ``[batch, 1, seq, seq]`` bool (no window arg)        efficient, never flash
linear attention           ``[batch, seq]`` padding mask (chunked delta rule)   none: no ``seq x seq``
eager, any kind            ``[batch, 1, seq, seq]`` float and the scores        none (math)
=========================  ===================================================  ==================

SDPA turns a bool mask into a float one of the mask's full shape in the compute dtype before its
memory-efficient kernel runs, so a masked layer holds the bool mask (alive for the whole step: the
streamed executor keeps HF's layer calls until backward) plus, while it runs, the float copy.
Flash takes head dims up to 256 only: a kind whose heads are wider (a descriptor's ``head_dims``,
e.g. a config's ``global_head_dim``) runs the efficient kernel with K/V repeated per head. What a
family's masks force is the descriptor's ``seq_by_seq_masks`` (layer kind, reason), which
:func:`attention_working_set` reports; the kernel choices on CUDA are transformers' and torch's
dispatch rules as read, to be confirmed by the H200 run (``docs/consumer-gpus.md``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from poros.descriptor import LINEAR_ATTENTION, ArchitectureDescriptor

#: the widest head SDPA's flash kernel takes (torch's FlashAttention-2 build)
FLASH_MAX_HEAD_DIM = 256
#: kernels from the one that needs least to the one that needs most (the worst names a whole model)
KERNELS = ("none (linear attention)", "flash", "efficient", "math")


class AttentionWorkingSet(NamedTuple):
    """What one decoder block's attention needs at a sequence length, beyond the per-token activations.

    bytes: the ``seq x seq`` tensors: every layer kind's mask (they live for the whole step) plus the
        largest transient one a layer makes while it runs (SDPA's float copy of a bool mask; eager's
        scores, probabilities and their gradient); 0 when no kind needs one.
    kernel: the most demanding SDPA kernel any layer kind takes, one of :data:`KERNELS`.
    reason: per layer kind, why (``"sliding_attention: efficient: sliding window: ..."``), ``"; "``-joined.
    """

    bytes: int
    kernel: str
    reason: str


class KindAttention(NamedTuple):
    """One layer kind's attention: its kernel, its mask bytes (alive all step), its transient bytes, why."""

    kind: str
    kernel: str
    mask_bytes: int
    transient_bytes: int
    reason: str


def seq_by_seq_mask_bytes(rows: int, seq: int, value_bytes: int) -> tuple[int, int]:
    """``(alive, transient)`` bytes of a materialised ``[rows, 1, seq, seq]`` mask: transformers' bool mask,
    alive all step, and SDPA's copy of it in the compute dtype while a layer runs."""
    return rows * seq * seq, rows * seq * seq * value_bytes


def attention_by_kind(descriptor: ArchitectureDescriptor, text_config: Any, seq: int, batch: int, *,
                      padded: bool = False, value_bytes: int = 2) -> list[KindAttention]:
    """:class:`KindAttention` for each layer kind the model has (``text_config``'s layer kinds).

    Args:
        descriptor: the family's descriptor (``mask_kinds``, ``seq_by_seq_masks``, ``head_dims``).
        text_config: the text config (an HF config or any object with its attributes).
        seq, batch: tokens per row and rows per micro-batch.
        padded: some row is padded (or packed): full-attention layers get a materialised mask too.
        value_bytes: bytes per value of the compute dtype (2: bf16).
    """
    implementation = getattr(text_config, "_attn_implementation", None) or "sdpa"
    fields = plain_fields(text_config)
    heads = fields.get("num_attention_heads") or 1
    kv_heads = fields.get("num_key_value_heads") or heads
    window = fields.get("sliding_window")
    forced = dict(descriptor.seq_by_seq_masks)
    head_attributes = dict(descriptor.head_dims)
    square = seq * seq
    out = []
    for kind in layer_kinds_of(descriptor, text_config):
        head_dim = (fields.get(head_attributes[kind]) if kind in head_attributes else None) \
            or fields.get("head_dim") or fields["hidden_size"] // heads
        if kind == LINEAR_ATTENTION:
            out.append(KindAttention(kind, KERNELS[0], 0, 0, "a [batch, seq] padding mask, "
                                     "no seq x seq tensor"))
            continue
        if implementation == "eager":
            out.append(KindAttention(kind, "math", batch * square * value_bytes,
                                     3 * batch * heads * square * value_bytes,
                                     "attn_implementation='eager' materialises a float mask and the attention "
                                     "scores (batch x heads x seq x seq); use sdpa"))
            continue
        mask_rows = 0
        reason = ""
        if kind in forced and window is not None and seq >= window:
            # one row per batch row once a 2-D attention_mask is passed (Poros's batches always pass one)
            mask_rows, reason = batch, forced[kind]
        elif padded:
            mask_rows, reason = batch, ("padded or packed rows: transformers materialises a [batch, 1, seq, seq] "
                                        "bool mask (flash takes no mask)")
        repeat = 2 * batch * (heads - kv_heads) * seq * head_dim * value_bytes  # K/V repeated per head
        if mask_rows:
            alive, copy = seq_by_seq_mask_bytes(mask_rows, seq, value_bytes)
            out.append(KindAttention(kind, "efficient", alive, copy + repeat, reason))
        elif head_dim > FLASH_MAX_HEAD_DIM:
            out.append(KindAttention(kind, "efficient", 0, repeat, f"head_dim {head_dim} > {FLASH_MAX_HEAD_DIM}: "
                                     "flash takes heads up to 256 wide (K/V repeated per head)"))
        else:
            out.append(KindAttention(kind, "flash", 0, 0, "no mask: is_causal, no seq x seq tensor"))
    return out


def attention_working_set(descriptor: ArchitectureDescriptor, text_config: Any, seq: int, batch: int, *,
                          padded: bool = False, value_bytes: int = 2) -> AttentionWorkingSet:
    """The :class:`AttentionWorkingSet` of one block at ``seq`` tokens x ``batch`` rows (see the module
    docstring; the arguments are :func:`attention_by_kind`'s)."""
    kinds = attention_by_kind(descriptor, text_config, seq, batch, padded=padded, value_bytes=value_bytes)
    total = sum(k.mask_bytes for k in kinds) + max((k.transient_bytes for k in kinds), default=0)
    kernel = max((k.kernel for k in kinds), key=KERNELS.index, default="flash")
    return AttentionWorkingSet(total, kernel, "; ".join(f"{k.kind}: {k.kernel}: {k.reason}" for k in kinds))


def plain_fields(text_config: Any) -> dict[str, Any]:
    """The config's values as a plain dict (``to_dict()``: per-layer configs refuse some attributes as
    attributes; an object without it, its ``vars``)."""
    to_dict = getattr(text_config, "to_dict", None)
    return to_dict() if callable(to_dict) else dict(vars(text_config))


def layer_kinds_of(descriptor: ArchitectureDescriptor, text_config: Any) -> list[str]:
    """The layer kinds ``text_config`` has, in order of first appearance (the descriptor's first kind when
    the config lists none)."""
    listed = plain_fields(text_config).get(descriptor.layer_kinds_attr) if descriptor.layer_kinds_attr else None
    return list(dict.fromkeys(listed)) if listed else [descriptor.layer_kinds[0]]


__all__ = ["FLASH_MAX_HEAD_DIM", "KERNELS", "AttentionWorkingSet", "KindAttention", "attention_by_kind",
           "attention_working_set", "layer_kinds_of", "plain_fields", "seq_by_seq_mask_bytes"]
