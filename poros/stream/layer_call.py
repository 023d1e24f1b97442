"""One decoder-layer call as HF made it, flattened into leaves (hidden states first), with the places
where the executor substitutes hidden states, gradient-carrying tensors and carried mappings."""

from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from poros.errors import StreamingError


@dataclass
class LayerCall:
    """A captured call, flattened: leaves (hidden states are leaf 0), where mappings / grad tensors sit."""

    leaves: list[Any]
    spec: Any
    mapping_at: dict[int, str]  # leaf position -> carried mapping kwarg
    grad_at: list[int]  # leaf positions of tensors that require grad (besides hidden states)

    @classmethod
    def from_capture(cls, args: tuple, kwargs: dict, mapping_kwargs: frozenset[str],
                     contiguous_kwargs: frozenset[str] = frozenset()) -> "LayerCall":
        # the descriptor's contiguous_arguments: an expanded view becomes a contiguous copy (the same values)
        kwargs = {k: v.contiguous() if k in contiguous_kwargs and isinstance(v, torch.Tensor) else v
                  for k, v in kwargs.items()}
        # Carried mappings are pytree leaves: hide them from flattening by name.
        mapping_values = {k: kwargs[k] for k in mapping_kwargs if k in kwargs}
        plain_kwargs = {k: v for k, v in kwargs.items() if k not in mapping_values}
        leaves, spec = pytree.tree_flatten((args, plain_kwargs, mapping_values), is_leaf=is_mapping)
        if not args or not isinstance(args[0], torch.Tensor):
            raise StreamingError(
                "a decoder layer was called without hidden states as its first positional argument; "
                "Poros streams layers that HF calls as layer(hidden_states, ...)."
            )
        mapping_at, grad_at = {}, []
        for position, leaf in enumerate(leaves[1:], start=1):
            if is_mapping(leaf):
                name = next((k for k, v in mapping_values.items() if v is leaf), None)
                if name is None:
                    raise StreamingError(
                        f"a decoder layer receives a mutable mapping ({type(leaf).__name__}) that the descriptor "
                        "does not declare. Declare it as CarriedState(kind='mapping') so its gradients cross blocks."
                    )
                mapping_at[position] = name
            elif isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                grad_at.append(position)
        return cls(leaves, spec, mapping_at, grad_at)

    def build(self, hidden: torch.Tensor, grad_tensors=(), mappings: dict[str, Any] | None = None):
        return self.unflatten(self.leaves_with(hidden, grad_tensors, mappings))

    def leaves_with(self, hidden: torch.Tensor, grad_tensors=(), mappings: dict[str, Any] | None = None) -> list:
        leaves = list(self.leaves)
        leaves[0] = hidden
        for position, tensor in zip(self.grad_at, grad_tensors):
            leaves[position] = tensor
        for position, name in self.mapping_at.items():
            if mappings is not None:
                leaves[position] = mappings[name]
        return leaves

    def unflatten(self, leaves: list):
        args, kwargs, mapping_values = pytree.tree_unflatten(leaves, self.spec)
        return args, {**kwargs, **mapping_values}

    def grad_tensors(self) -> list[torch.Tensor]:
        return [self.leaves[p] for p in self.grad_at]

    def mappings(self) -> dict[str, Any]:
        return {name: self.leaves[p] for p, name in self.mapping_at.items()}


def is_mapping(value: Any) -> bool:
    return isinstance(value, MutableMapping) and not isinstance(value, dict)
