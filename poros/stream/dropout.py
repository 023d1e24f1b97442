"""Dropouts: the modules of a model that draw random numbers in training (``nn.Dropout``, an
attention's ``attention_dropout``), and the refusal of layer-major accumulation while one is active
(its draws would come in another order than in ordinary accumulation). The executor refuses with it,
CUDA graphs run such a block eagerly, and a run falls back to micro-major (``poros.training.run``).
"""

from __future__ import annotations

from torch import nn

from poros.errors import StreamingError


def dropout_modules(model: nn.Module) -> list[str]:
    """Names of the dropouts with p > 0 in ``model`` (active in training mode): ``nn.Dropout`` modules,
    and attention modules whose float ``attention_dropout`` HF passes to the attention kernel."""
    return [name for name, module in model.named_modules() if dropout_p(module) > 0]


def dropout_p(module: nn.Module) -> float:
    """The drop probability ``module`` applies itself: ``nn.Dropout.p``, an attention's ``attention_dropout``."""
    if isinstance(module, nn.Dropout):
        return module.p
    p = getattr(module, "attention_dropout", 0.0)
    return float(p) if isinstance(p, (int, float)) and not isinstance(p, bool) else 0.0


def check_no_dropout(model: nn.Module) -> None:
    """Refuse layer-major accumulation while ``model`` trains with a dropout of p > 0.

    Raises:
        StreamingError: naming the first such module and its p.
    """
    active = dropout_modules(model) if model.training else []
    if active:
        raise StreamingError(
            f"layer-major accumulation with dropout active ({active[0]} p={dropout_p(model.get_submodule(active[0]))}"
            f"{f' and {len(active) - 1} more' if len(active) > 1 else ''}): the random draws would come in another "
            "order than in ordinary accumulation. Set lora_dropout=0 (and attention dropout 0), or use the "
            "micro-major schedule."
        )


__all__ = ["check_no_dropout", "dropout_modules", "dropout_p"]
