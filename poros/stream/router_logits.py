"""Router logits across streamed blocks: what an MoE model's load-balancing (router aux) loss reads.

With ``output_router_logits=True`` transformers records every router's logits while the trunk runs
(the trunk class's ``_can_record_outputs["router_logits"]``: an ``OutputRecorder`` naming the router
class and the output index) and returns them as ``router_logits``; the causal LM adds
``router_aux_loss_coef * load_balancing_loss_func(router_logits, ...)`` to the loss, so gradients
flow from every block's router back through that block. A streamed block runs without grad inside
its autograd node, so the executor records the same outputs itself (:class:`RouterRecorder`) and
makes them outputs of the block's node: their gradients come back into the node's backward and are
extra roots of the block's recompute, next to its output. Torch only; nothing family-specific.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

#: the recordable output transformers names the routers' logits
ROUTER_LOGITS = "router_logits"


class RouterRecorder:
    """Which modules of a trunk produce router logits, and the index of the logits in their output."""

    def __init__(self, trunk: nn.Module) -> None:
        spec = (getattr(trunk, "_can_record_outputs", None) or {}).get(ROUTER_LOGITS)
        target = getattr(spec, "target_class", spec)
        self.target: type | None = target if isinstance(target, type) else None
        self.index: int = getattr(spec, "index", 0) or 0

    def wanted(self, kwargs: dict[str, Any]) -> bool:
        """True when the trunk was asked for router logits (``output_router_logits``) and has routers."""
        return self.target is not None and bool(kwargs.get("output_router_logits"))

    @contextlib.contextmanager
    def recording(self, layer: nn.Module, enabled: bool = True):
        """Yields a list that fills with the router logits ``layer`` produces inside, in call order."""
        found: list[torch.Tensor] = []
        if not enabled or self.target is None:
            yield found
            return

        def note(module, args, output):
            found.append(output[self.index] if isinstance(output, (tuple, list)) else output)

        handles = [m.register_forward_hook(note) for m in layer.modules() if isinstance(m, self.target)]
        try:
            yield found
        finally:
            for handle in handles:
                handle.remove()


__all__ = ["ROUTER_LOGITS", "RouterRecorder"]
