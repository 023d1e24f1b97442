"""Batches for training: shuffled per epoch, right-padded, resumable from a checkpoint.

The order depends only on ``(seed, epoch, num_examples)``: epoch ``e`` visits the examples in
``torch.randperm(n, generator=torch.Generator().manual_seed(seed + e))`` order. No global RNG is
touched, so model initialisation, dropout and the data order never disturb one another, and a
resumed run sees exactly the batches the uninterrupted run would have seen.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from poros.data.tokenize import IGNORE_INDEX, TokenizedData
from poros.errors import DataError


class BatchIterator:
    """An endless stream of batches over tokenized examples.

    Each epoch is a permutation of the examples (or their order, with ``shuffle=False``), cut
    into ``num_examples // batch_size`` full batches: the partial last batch is dropped, so every
    batch has ``batch_size`` rows. Rows are right-padded to the longest row of their batch.

    Args:
        data: :class:`TokenizedData`, or a list of ``{"input_ids": [...], "labels": [...]}``.
        batch_size: rows per batch (>= 1).
        pad_token_id: the id written into padding positions of ``input_ids``.
        seed: epoch ``e`` is shuffled with ``torch.Generator().manual_seed(seed + e)``.
        shuffle: False keeps the dataset order in every epoch.
        pad_to_multiple_of: pad each batch to a multiple of this many tokens (None: to its longest
            row), as HF's ``DataCollatorWithPadding`` does; a few lengths instead of many.

    Raises:
        DataError: ``batch_size`` < 1; fewer examples than ``batch_size`` (not even one batch);
            an example whose ``labels`` differ in length from its ``input_ids``.
    """

    def __init__(self, data: TokenizedData | Sequence[Mapping[str, Sequence[int]]], *, batch_size: int,
                 pad_token_id: int, seed: int = 0, shuffle: bool = True, pad_to_multiple_of: int | None = None) -> None:
        examples = data.examples if isinstance(data, TokenizedData) else list(data)
        if not isinstance(batch_size, int) or batch_size < 1:
            raise DataError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        if len(examples) < batch_size:
            raise DataError(f"the dataset has {len(examples)} examples, fewer than one batch of {batch_size}; expected "
                            "at least batch_size examples (partial batches are dropped). Fix: lower batch_size (and "
                            "raise gradient accumulation), or add data")
        for index, example in enumerate(examples):
            if len(example["input_ids"]) != len(example["labels"]):
                raise DataError(f"example {index} has {len(example['input_ids'])} input_ids but "
                                f"{len(example['labels'])} labels; expected one label per token")
            if "position_ids" in example and len(example["position_ids"]) != len(example["input_ids"]):
                raise DataError(f"example {index} has {len(example['input_ids'])} input_ids but "
                                f"{len(example['position_ids'])} position_ids; expected one position per token")
        self.examples = examples
        self.batch_size = batch_size
        if pad_to_multiple_of is not None and (not isinstance(pad_to_multiple_of, int) or pad_to_multiple_of < 1):
            raise DataError(f"pad_to_multiple_of must be an integer >= 1 or None, got {pad_to_multiple_of!r}")
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0  # index into this epoch's order of the next example
        self._order: list[int] | None = None

    @property
    def num_examples(self) -> int:
        return len(self.examples)

    @property
    def batches_per_epoch(self) -> int:
        return self.num_examples // self.batch_size

    def epoch_order(self, epoch: int) -> list[int]:
        """The example indices of ``epoch``, in visiting order."""
        if not self.shuffle:
            return list(range(self.num_examples))
        import torch

        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_examples, generator=generator).tolist()

    def next_batch(self) -> dict[str, Any]:
        """The next batch: ``input_ids``, ``attention_mask`` and ``labels`` (packed rows: ``position_ids`` for
        the mask), int64 tensors ``[batch, longest]``.

        Padding is on the right (see :func:`collate`). After the last full batch of an epoch the
        next epoch starts.
        """
        if self.position + self.batch_size > self.num_examples:
            self.epoch, self.position, self._order = self.epoch + 1, 0, None
        if self._order is None:
            self._order = self.epoch_order(self.epoch)
        rows = [self.examples[i] for i in self._order[self.position: self.position + self.batch_size]]
        self.position += self.batch_size
        return collate(rows, self.pad_token_id, pad_to_multiple_of=self.pad_to_multiple_of)

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, Any]:
        return self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """Where the stream is: ``epoch``, ``position``, ``seed``, ``batch_size``, ``num_examples``, ``shuffle``.

        Plain ints and a bool: the dict survives JSON.
        """
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "batch_size": self.batch_size,
                "num_examples": self.num_examples, "shuffle": self.shuffle}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue exactly where ``state`` (from :meth:`state_dict`) left off.

        The seed and shuffle flag are taken from ``state``, so the resumed order is the saved
        run's order.

        Raises:
            DataError: ``state`` lacks a key, or was saved with another dataset size or batch
                size (the batches would not be the ones the saved run would have seen).
        """
        missing = {"epoch", "position", "seed", "batch_size", "num_examples"} - set(state)
        if missing:
            raise DataError(f"data position state lacks {sorted(missing)}; expected the dict "
                            "BatchIterator.state_dict() returns")
        mismatched = [f"{key} {state[key]} (saved) vs {getattr(self, key)} (now)"
                      for key in ("num_examples", "batch_size") if state[key] != getattr(self, key)]
        if mismatched:
            raise DataError(f"cannot resume the data position: {', '.join(mismatched)}; resuming needs the same "
                            "dataset, seq_len and batch size as the saved run. Fix: use the saved run's dataset "
                            "and settings, or start a new run instead of resuming")
        if not 0 <= state["position"] <= self.num_examples:
            raise DataError(f"data position {state['position']} is outside 0..{self.num_examples}")
        self.seed, self.shuffle = int(state["seed"]), bool(state.get("shuffle", self.shuffle))
        self.epoch, self.position, self._order = int(state["epoch"]), int(state["position"]), None


def collate(rows: Sequence[Mapping[str, Sequence[int]]], pad_token_id: int, *,
            pad_to_multiple_of: int | None = None) -> dict[str, Any]:
    """One batch of ``rows``: ``input_ids``, ``attention_mask`` and ``labels``, int64 ``[len(rows), longest]``
    (``longest`` rounded up to a multiple of ``pad_to_multiple_of`` when given).

    Padding is on the right: ``pad_token_id`` in ``input_ids``, 0 in ``attention_mask``, -100 in
    ``labels``. Packed rows (``position_ids``, :mod:`poros.data.packing`) give ``position_ids`` instead of
    ``attention_mask`` (transformers builds the packed mask from their restarts only without one); their
    padding continues the row's last positions, which no real token attends to under the causal mask.
    """
    import torch

    longest = max(len(row["input_ids"]) for row in rows)
    if pad_to_multiple_of:
        longest = -(-longest // pad_to_multiple_of) * pad_to_multiple_of
    packed = "position_ids" in rows[0]
    if any(("position_ids" in row) != packed for row in rows):
        raise DataError("a batch mixes packed rows (with position_ids) and unpacked ones; expected one kind")
    input_ids = torch.full((len(rows), longest), pad_token_id, dtype=torch.int64)
    labels = torch.full((len(rows), longest), IGNORE_INDEX, dtype=torch.int64)
    # packed rows: positions, their padding continuing the last example's; else the 1/0 attention mask
    third = torch.zeros((len(rows), longest), dtype=torch.int64)
    for row_index, row in enumerate(rows):
        length = len(row["input_ids"])
        input_ids[row_index, :length] = torch.tensor(row["input_ids"], dtype=torch.int64)
        labels[row_index, :length] = torch.tensor(row["labels"], dtype=torch.int64)
        if packed:
            tail = row["position_ids"][-1] + 1 if length else 0
            third[row_index] = torch.tensor([*row["position_ids"], *range(tail, tail + longest - length)],
                                            dtype=torch.int64)
        else:
            third[row_index, :length] = 1
    if packed:
        return {"input_ids": input_ids, "labels": labels, "position_ids": third}
    return {"input_ids": input_ids, "attention_mask": third, "labels": labels}


def real_tokens(batch: Mapping[str, Any], pad_token_id: int) -> Any:
    """The tokens of a batch that are not padding (what tokens/s counts): its ``attention_mask``'s ones, or
    for packed rows (no mask) all tokens less each row's padded tail (``pad_token_id`` with label -100)."""
    if "attention_mask" in batch:
        return batch["attention_mask"].sum()
    import torch

    padding = (batch["input_ids"] == pad_token_id) & (batch["labels"] == IGNORE_INDEX)
    tail = torch.cumprod(padding.flip(-1).to(torch.int64), dim=-1).sum()  # the trailing run of padding per row
    return batch["input_ids"].numel() - tail


def pad_token_id(tokenizer: Any, model_config: Any) -> int:
    """The id padding is written with: the tokenizer's pad (else its eos) token, else the model config's pad, else 0."""
    if tokenizer is not None:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad is not None:
            return pad
    return getattr(model_config, "pad_token_id", None) or 0


__all__ = ["BatchIterator", "collate", "pad_token_id", "real_tokens"]
