"""What the graphed path did and why a block ran eagerly (``graphs.py``'s report).

:class:`GraphReport` counts captures, replays, eager runs by reason and failed captures (``poros doctor`` and
the run summary print it); :func:`eager_reason` names why a block phase the executor drives itself ran eagerly.
Imports nothing of Poros.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass
class GraphReport:
    """What the graphed path did: captures, replays, eager runs by reason, failed captures."""

    captured: int = 0
    replays: int = 0
    eager: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"captured": self.captured, "replays": self.replays, "eager": dict(self.eager),
                "failures": list(self.failures)}

    def summary(self) -> str:
        eager = ", ".join(f"{n} {reason}" for reason, n in self.eager.most_common()) or "none"
        text = f"cuda graphs: {self.captured} captured, {self.replays} replays; eager runs: {eager}"
        return text + (f"; {len(self.failures)} capture(s) failed: {self.failures[0]}" if self.failures else "")


def eager_reason(router: bool, held: bool) -> str:
    """Why a block phase runs eagerly under CUDA graphs (``BlockGraphs.report.eager``): its router logits, its
    held weights (``dequantize_once``), else micro-major (its backward inside the autograd engine)."""
    return "router logits" if router else "dequantize once" if held else "micro-major"


__all__ = ["GraphReport", "eager_reason"]
