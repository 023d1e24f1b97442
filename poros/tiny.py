"""Tiny test variants of a family, declared by the family itself (built-in or plugin) as data next
to its descriptor, so :mod:`poros.testing` can build a tiny model of any registered family.

A family module sets ``TINY_VARIANTS``: a tuple of :class:`TinyVariant`, the first of a family its
default. Each names the transformers config class, a default shape and a function from a
:class:`TinyShape` (and the caller's leftover overrides) to the config fields beyond the common
ones (:meth:`TinyShape.common`). :func:`tiny_variants` finds them through the registry. Torch-free
and transformers-free: the configs are built by :func:`poros.testing.tiny_config`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

#: sliding window of every tiny config: shorter than the sequences tests use, so sliding masks matter.
TINY_SLIDING_WINDOW = 8


@dataclass(frozen=True)
class TinyShape:
    """The shape :func:`poros.testing.tiny_config` settled on (defaults and the caller's choices)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    def common(self) -> dict[str, Any]:
        """The fields every tiny config has: widths, layers, heads, intermediate ``2 * hidden``,
        512 positions and token ids 0/1/2 for pad/eos/bos."""
        return dict(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=2 * self.hidden_size,
            num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads, max_position_embeddings=512, pad_token_id=0, eos_token_id=1,
            bos_token_id=2,
        )


@dataclass(frozen=True)
class TinyVariant:
    """One tiny test model of a family.

    Attributes:
        family: the descriptor's ``name``.
        name: the variant (``"default"``, ``"sliding"``, ``"e2b"``...); the family's first is its default.
        config_class: the transformers config class, by name (``"Qwen2Config"``).
        num_layers, head_dim: the default shape (hidden 64, 4 heads, 2 KV heads everywhere).
        fields: ``(shape, overrides) -> config fields`` beyond :meth:`TinyShape.common`; it may
            pop a family-specific override it interprets and raise ``ValueError`` for an
            impossible combination.
        head_dim_multiple: ``head_dim`` must be a multiple of this (8 where a quarter of each head
            rotates).
        head_dim_from_hidden: the config has no separate ``head_dim`` (``hidden_size // num_heads``).
        min_layers: the fewest layers that hold every layer kind of the variant (tests build no fewer).
        chunk_length: the variant computes in chunks of this many tokens along the sequence (0: it does
            not), e.g. a Gated DeltaNet's delta rule; tests draw sequences that cross a chunk boundary.
        description: what the variant turns on, for the docs.
    """

    family: str
    name: str
    config_class: str
    num_layers: int
    head_dim: int
    fields: Callable[[TinyShape, dict[str, Any]], dict[str, Any]]
    head_dim_multiple: int = 2
    head_dim_from_hidden: bool = False
    min_layers: int = 1
    chunk_length: int = 0
    description: str = ""


@dataclass(frozen=True)
class TinyMultimodal:
    """A family's tiny multimodal model: its ``*ForConditionalGeneration`` around a tiny text tower
    and a one-layer vision tower.

    Attributes:
        family: the descriptor's ``name``.
        config_class, model_class: the transformers classes, by name (``"Gemma3Config"``,
            ``"Gemma3ForConditionalGeneration"``).
        fields: ``text config dict -> config fields`` beside ``text_config`` (the vision tower...).
    """

    family: str
    config_class: str
    model_class: str
    fields: Callable[[dict[str, Any]], dict[str, Any]]


def layer_pattern(num_layers: int, period: int, *, every: str, other: str) -> list[str]:
    """``other`` except every ``period``-th layer (1-based) and the last one, which are ``every``."""
    period = max(1, min(period, num_layers))
    return [every if (i + 1) % period == 0 or i == num_layers - 1 else other for i in range(num_layers)]


def tiny_variants(family: str) -> tuple[TinyVariant, ...]:
    """The tiny variants the module that registered ``family`` declares (``TINY_VARIANTS``), in order;
    empty when it declares none.

    Raises:
        UnknownArchitectureError: no registered family is called ``family``.
    """
    from poros import registry

    registration = registry.registration(family)
    plugin = registry.plugin_manager().get_plugin(registration.plugin)
    declared = getattr(plugin, "TINY_VARIANTS", ()) or ()
    return tuple(v for v in declared if isinstance(v, TinyVariant) and v.family == registration.descriptor.name)


def tiny_multimodal(family: str) -> TinyMultimodal | None:
    """The tiny multimodal model the module that registered ``family`` declares (``TINY_MULTIMODAL``),
    or None.

    Raises:
        UnknownArchitectureError: no registered family is called ``family``.
    """
    from poros import registry

    registration = registry.registration(family)
    declared = getattr(registry.plugin_manager().get_plugin(registration.plugin), "TINY_MULTIMODAL", None)
    return declared if isinstance(declared, TinyMultimodal) and declared.family == registration.descriptor.name else None


__all__ = ["TINY_SLIDING_WINDOW", "TinyMultimodal", "TinyShape", "TinyVariant", "layer_pattern", "tiny_multimodal",
           "tiny_variants"]
