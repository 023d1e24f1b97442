"""What a block does with a carried mapping: the descriptor's word, resolved on the layer.

A carried mapping (``CarriedState(kind="mapping")``, e.g. K/V some layers store for later ones) is handed to
every block; some blocks write an entry, later ones read it. Eager mode needs to know nothing more (the
executor sees writes as they happen and hands readers every entry). A captured graph does: it must hold
the entries a block reads as static inputs and what it writes as static outputs, decided before the block
runs. :class:`CarriedAccess` is that, per block and mapping, from the descriptor's ``reader_flag`` /
``writer_flag`` / ``entry_key`` attribute paths on the layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from poros.descriptor import CarriedState, resolve_path
from poros.errors import DescriptorError


@dataclass(frozen=True)
class CarriedAccess:
    """What one block does with one carried mapping, as its descriptor declares it (``CarriedState``'s
    ``reader_flag`` / ``writer_flag`` / ``entry_key``, resolved on the layer): the keys of the entries it
    reads and writes. ``declared`` False: the descriptor does not say (or the layer lacks the attributes
    it names), so nothing is known of what the block touches."""

    kwarg: str
    reads: tuple = ()
    writes: tuple = ()
    declared: bool = True

    @classmethod
    def of(cls, layer: nn.Module, carried: CarriedState) -> "CarriedAccess":
        paths = (carried.reader_flag, carried.writer_flag, carried.entry_key)
        if not all(paths):
            return cls(carried.kwarg, declared=False)
        try:
            reads, writes, key = (resolve_path(layer, path) for path in paths)
        except DescriptorError:
            return cls(carried.kwarg, declared=False)
        return cls(carried.kwarg, (key,) if reads else (), (key,) if writes else ())

    def describe(self, index: int) -> str:
        """``"layer 3 reads shared_kv_states['full_attention']"`` (what a report says of the block)."""
        if not self.declared:
            return f"layer {index} hands {self.kwarg} on, reads and writes unknown"
        parts = [f"reads {self.kwarg}[{k!r}]" for k in self.reads]
        parts += [f"writes {self.kwarg}[{k!r}]" for k in self.writes]
        return f"layer {index} " + (" and ".join(parts) if parts else f"neither reads nor writes {self.kwarg}")



def add_reader_grads(pending: dict[tuple[str, Any, int], list], readers: dict[tuple[str, Any, int], list],
                     captured: dict[int, torch.Tensor | None]) -> None:
    """Add the gradients a block's recompute gave the entries it read to their writers' ``pending`` ones.

    Args:
        pending: (kwarg, key, writer index) -> one gradient or None per tensor of the entry, summed so far.
        readers: (kwarg, key, writer index) -> the tensors of that entry the recompute was handed.
        captured: id of each such tensor -> its gradient (None: it got none).

    Note:
        Blocks run backward in reverse layer order, so the sums come in the order autograd's would.
    """
    for entry, leaves in readers.items():
        grads = [captured.get(id(t)) if isinstance(t, torch.Tensor) else None for t in leaves]
        if any(g is not None for g in grads):
            earlier = pending.get(entry)
            pending[entry] = grads if earlier is None else [
                g if e is None else (e if g is None else e + g) for e, g in zip(earlier, grads)
            ]



def recompute_roots(output: torch.Tensor, grad_output: torch.Tensor,
                    written: list[tuple[Any, list]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The roots of a block's recompute with their gradients, in the order eager backward takes them:
    its output, then each tensor of an entry it wrote (``written``: the entry's value as the recompute
    wrote it, and one gradient or None per tensor, from later readers); those that require grad."""
    roots, grads = [output], [grad_output]
    for value, sent in written:
        for tensor, grad in zip(pytree.tree_leaves(value), sent):
            if grad is not None and isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                roots.append(tensor)
                grads.append(grad)
    return [(r, g) for r, g in zip(roots, grads) if r.requires_grad]


__all__ = ["CarriedAccess", "add_reader_grads", "recompute_roots"]
