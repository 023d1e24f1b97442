"""Synthetic data: uniformly random token ids, all trained. For smoke tests and benchmarks."""

from __future__ import annotations

import random

from poros.data.tokenize import TokenizedData
from poros.errors import DataError


def synthetic_examples(*, vocab_size: int, seq_len: int, num_examples: int = 256, seed: int = 0) -> TokenizedData:
    """``num_examples`` sequences of ``seq_len`` random token ids, labels equal to the ids.

    The ids come from ``random.Random(seed)`` (no global RNG, no torch), so the same arguments
    give the same data on every machine.

    Args:
        vocab_size: ids are drawn from ``range(vocab_size)``; use ``len(tokenizer)``.
        seq_len: tokens per example (>= 2).
        num_examples: how many examples (>= 1).
        seed: the generator's seed.

    Returns:
        :class:`TokenizedData` with format ``"synthetic"``, every token trainable.

    Raises:
        DataError: a non-positive ``vocab_size`` or ``num_examples``, or ``seq_len`` < 2.
    """
    if vocab_size < 1 or num_examples < 1 or seq_len < 2:
        raise DataError(f"synthetic data needs vocab_size >= 1, num_examples >= 1 and seq_len >= 2; got "
                        f"vocab_size={vocab_size}, num_examples={num_examples}, seq_len={seq_len}")
    generator = random.Random(seed)
    examples = []
    for _ in range(num_examples):
        ids = [generator.randrange(vocab_size) for _ in range(seq_len)]
        examples.append({"input_ids": ids, "labels": list(ids)})
    return TokenizedData(examples, "synthetic")


__all__ = ["synthetic_examples"]
