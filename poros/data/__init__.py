"""From what users bring to tokenized, loss-masked examples and batches.

::

    from poros.data import BatchIterator, load_dataset

    data = load_dataset("data.jsonl", tokenizer, seq_len=512)   # or an HF id, a list, "synthetic"
    print(data.summary())   # data: 312 examples (messages), 41.2% of 95,410 tokens trainable, ...
    batches = BatchIterator(data, batch_size=4, pad_token_id=tokenizer.pad_token_id, seed=0)
    batch = batches.next_batch()   # input_ids, attention_mask, labels

The steps, each usable on its own: :func:`load_records` (file, hub id, list, ``datasets``
object, ``"poros-tiny-chat"``) -> :func:`detect_format` (messages, sharegpt, oasst1,
prompt_completion, alpaca, text) -> :func:`to_examples` -> :func:`tokenize_examples` (chat
template, loss on assistant turns only) -> :func:`pack_examples` (``packing: true``: whole examples
in rows of up to ``seq_len`` tokens, kept apart by ``position_ids`` restarts) -> :class:`BatchIterator`.

``import poros.data`` imports neither torch, transformers nor datasets; ``BatchIterator`` imports
torch when it builds a batch, and hub ids import ``datasets`` when loaded.

May import: the core only.
"""

from __future__ import annotations

from poros.assets import TINY_CHAT
from poros.data.batches import BatchIterator
from poros.data.formats import FORMATS, Example, detect_format, to_examples
from poros.data.packing import pack_examples
from poros.data.sources import SYNTHETIC, load_dataset, load_records
from poros.data.synthetic import synthetic_examples
from poros.data.tokenize import CHATML_TEMPLATE, IGNORE_INDEX, TokenizedData, tokenize_examples

__all__ = [
    "CHATML_TEMPLATE",
    "FORMATS",
    "IGNORE_INDEX",
    "SYNTHETIC",
    "TINY_CHAT",
    "BatchIterator",
    "Example",
    "TokenizedData",
    "detect_format",
    "load_dataset",
    "load_records",
    "pack_examples",
    "synthetic_examples",
    "to_examples",
    "tokenize_examples",
]
