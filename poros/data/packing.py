"""Packing: several tokenized examples in one row of up to ``seq_len`` tokens, each attending only to itself.

``packing: true`` (``--packing``) fills rows the way TRL's ``SFTConfig(packing=True)`` does by default
(``packing_strategy="bfd"``, best-fit decreasing): examples are taken longest first, each into the fullest
row it still fits, a new row when none has room. No example is split across rows (each was already cut
to ``seq_len`` by tokenization, with the one WARNING that says how many).

What keeps packed examples apart is ``position_ids``, as in HF's ``DataCollatorWithFlattening`` and TRL's
padding-free collator: each example's positions restart at 0, and a batch carries no ``attention_mask``,
so transformers' mask code (``masking_utils.find_packed_sequence_indices``) builds the block-diagonal
causal mask from the restarts. Each example's first label is ``-100`` (HF's ``separator_id``): the loss
never predicts it from the example before. A row's right padding (:func:`~poros.data.batches.collate`)
continues the last example's positions with ``-100`` labels: under the causal mask no real token sees it.

The mask is then a ``batch x 1 x seq x seq`` boolean, and SDPA takes its memory-efficient kernel instead
of flash (``poros plan`` prices that mask as it does padded rows). Families whose layers do not honour
``position_ids`` restarts (Qwen3.5's Gated DeltaNet runs the whole row as one sequence) name it in their
descriptor's ``packing_unsupported`` and refuse ``packing: true``.

Imports no torch.
"""

from __future__ import annotations

import bisect

from poros.data.tokenize import IGNORE_INDEX, TokenizedData
from poros.errors import DataError


def pack_examples(data: TokenizedData, seq_len: int) -> TokenizedData:
    """``data``'s examples packed into rows of at most ``seq_len`` tokens (best-fit decreasing).

    Each row is ``{"input_ids", "labels", "position_ids"}``; ``position_ids`` restart at 0 at every
    example, and every example's first label is ``-100``. The rows' order is deterministic (the batch
    iterator shuffles them). ``num_dropped`` and ``num_truncated`` are the unpacked data's.

    Raises:
        DataError: ``seq_len`` < 2, or an example longer than ``seq_len`` (tokenize with the same ``seq_len``).
    """
    if not isinstance(seq_len, int) or seq_len < 2:
        raise DataError(f"seq_len must be an integer >= 2, got {seq_len!r}")
    order = sorted(range(len(data.examples)), key=lambda i: -len(data.examples[i]["input_ids"]))
    rows: list[list[int]] = []  # example indices per row
    rooms: list[tuple[int, int]] = []  # (tokens left, row), sorted: the best fit is the first with room enough
    for index in order:
        length = len(data.examples[index]["input_ids"])
        if length > seq_len:
            raise DataError(f"example {index} has {length} tokens, more than seq_len={seq_len}; packing takes "
                            "examples tokenized with the same seq_len (longer ones are truncated first)")
        at = bisect.bisect_left(rooms, (length, -1))
        if at == len(rooms):
            rows.append([index])
            bisect.insort(rooms, (seq_len - length, len(rows) - 1))
        else:
            room, row = rooms.pop(at)
            rows[row].append(index)
            bisect.insort(rooms, (room - length, row))
    packed = []
    for members in rows:
        input_ids, labels, positions = [], [], []
        for index in members:
            example = data.examples[index]
            input_ids.extend(example["input_ids"])
            labels.extend([IGNORE_INDEX, *example["labels"][1:]])
            positions.extend(range(len(example["input_ids"])))
        packed.append({"input_ids": input_ids, "labels": labels, "position_ids": positions})
    return TokenizedData(packed, data.format, data.num_dropped, data.num_truncated)


__all__ = ["pack_examples"]
