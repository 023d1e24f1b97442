"""Hypothesis strategies for the parity tests: one generator of tiny-model training setups.

What a family's tiny variant needs from a test is read from the variant's own declaration
(:class:`poros.tiny.TinyVariant`, next to the family's descriptor), never from its name: the fewest
layers that hold every layer kind (``min_layers``), whether ``head_dim`` follows from the width
(``head_dim_from_hidden``), and the chunk length a sequence must cross (``chunk_length``)::

    from hypothesis import given
    from poros.testing.strategies import tiny_setups

    @given(setup=tiny_setups("qwen3_5", "default", seq=(9, 24)))
    def test_it(setup): ...

A setup is a dict: ``config`` (keywords of :func:`poros.testing.save_tiny_checkpoint`: layers, heads,
KV heads, widths, attention implementation), ``seed``, ``batch``, ``seq``, ``padding`` and whatever
else the caller asked to draw (micro-batches, LoRA rank and alpha, double quantization, MLP chunks,
steps, HF gradient checkpointing on the reference). Each option that is ``None`` is not drawn.

Imports hypothesis (a test dependency); nothing else heavy.
"""

from __future__ import annotations

from typing import Any, Sequence

from hypothesis import strategies as st

from poros.tiny import TinyVariant, tiny_variants

#: tokens past a chunk boundary a sequence reaches when the variant computes in chunks
PAST_CHUNK = 6


def tiny_variant(family: str, variant: str = "default") -> TinyVariant:
    """The :class:`~poros.tiny.TinyVariant` ``variant`` of ``family`` (``"default"``: its first)."""
    declared = tiny_variants(family)
    if variant == "default":
        return declared[0]
    return next(v for v in declared if v.name == variant)


def min_layers(family: str, variant: str = "default") -> int:
    """The fewest layers a tiny model of the variant gets: enough for every layer kind."""
    return tiny_variant(family, variant).min_layers


def longest_seq(family: str, variant: str, default: int, *, past_chunk: int = PAST_CHUNK) -> int:
    """``default`` tokens, or for a variant that computes in chunks ``past_chunk`` tokens past its first
    chunk boundary (so a drawn sequence can cross it)."""
    chunk = tiny_variant(family, variant).chunk_length
    return chunk + past_chunk if chunk else default


def head_dim_config(family: str, variant: str, head_dim: int) -> dict[str, int]:
    """``{"head_dim": head_dim}``, or nothing where the config derives it (``hidden_size // num_heads``)."""
    return {} if tiny_variant(family, variant).head_dim_from_hidden else {"head_dim": head_dim}


def _maybe(draw, name: str, strategy, out: dict[str, Any]) -> None:
    """Draw ``name`` from ``strategy`` into ``out``, unless the strategy is None (not drawn)."""
    if strategy is not None:
        out[name] = draw(strategy)


def _range(bounds: tuple[int, int] | None):
    return None if bounds is None else st.integers(*bounds)


def _choice(values: Sequence[int] | None):
    return None if values is None else st.sampled_from(list(values))


@st.composite
def tiny_setups(draw, family: str, variant: str, *, max_layers: int = 4, kv_heads: Sequence[int] = (1, 2),
                widths: Sequence[int] | None = None, head_dims: Sequence[int] | None = None,
                micro_batches: tuple[int, int] | None = None, batch: tuple[int, int] = (1, 2),
                seq: tuple[int, int] = (9, 20), past_chunk: int = PAST_CHUNK,
                lora_ranks: Sequence[int] | None = None, lora_alphas: Sequence[int] | None = None,
                double_quant: bool = False, mlp_chunks: tuple[int, int] | None = None,
                steps: tuple[int, int] = (1, 2), reference_checkpointing: bool = False) -> dict[str, Any]:
    """A training setup for the tiny ``variant`` of ``family`` (see the module docstring).

    Args:
        max_layers: layers are drawn from the variant's ``min_layers`` to this.
        kv_heads: KV head counts to draw from (those dividing the drawn head count, at most it).
        widths: hidden size per head to draw from (``None``: the variant's default width).
        head_dims: ``head_dim`` to draw from, where the variant's config takes one.
        seq: ``(shortest, longest)`` tokens; a chunked variant's longest is ``past_chunk`` past its chunk.
        micro_batches, batch, mlp_chunks, steps: ``(low, high)`` ranges; lora_ranks, lora_alphas: lists.
        double_quant, reference_checkpointing: draw a boolean for them.
    """
    declared = tiny_variant(family, variant)
    num_heads = draw(st.sampled_from([2, 4]))
    config: dict[str, Any] = {
        "num_layers": draw(st.integers(declared.min_layers, max_layers)),
        "num_heads": num_heads,
        "num_kv_heads": draw(st.sampled_from([k for k in kv_heads if k <= num_heads and num_heads % k == 0])),
    }
    if widths is not None:
        config["hidden_size"] = num_heads * draw(st.sampled_from(list(widths)))
    if head_dims is not None and not declared.head_dim_from_hidden:
        config["head_dim"] = draw(st.sampled_from(list(head_dims)))
    config["attn_implementation"] = draw(st.sampled_from(["sdpa", "eager"]))
    setup: dict[str, Any] = {"config": config, "seed": draw(st.integers(0, 2**16))}
    _maybe(draw, "micro_batches", _range(micro_batches), setup)
    setup["batch"] = draw(st.integers(*batch))
    setup["seq"] = draw(st.integers(seq[0], longest_seq(family, variant, seq[1], past_chunk=past_chunk)))
    setup["padding"] = draw(st.sampled_from(["none", "left", "right"]))
    _maybe(draw, "lora_rank", _choice(lora_ranks), setup)
    _maybe(draw, "lora_alpha", _choice(lora_alphas), setup)
    if double_quant:
        setup["double_quant"] = draw(st.booleans())
    _maybe(draw, "mlp_chunks", _range(mlp_chunks), setup)
    setup["steps"] = draw(st.integers(*steps))
    if reference_checkpointing:
        setup["reference_checkpointing"] = draw(st.booleans())
    return setup


__all__ = ["PAST_CHUNK", "head_dim_config", "longest_seq", "min_layers", "tiny_setups", "tiny_variant"]
