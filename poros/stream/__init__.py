"""The streaming engine: the block store (:mod:`poros.stream.store`), the executor
(:mod:`poros.stream.executor`) and where the parts live (:mod:`poros.stream.placement`); what a
run will take and where its parts go is planned above it (:mod:`poros.plan`). The engine imports the core (descriptors, registry, config,
errors) and never the drop-in (:mod:`poros.dropin.model`), the trainer or the CLI (docs/architecture.md).
Torch is imported by the store and the executor; ``BlockStore`` and ``StreamingExecutor`` load
them on first use, so ``import poros.stream`` stays torch-free.

May import: the core only.
"""

from __future__ import annotations

from typing import Any

__all__ = ["BlockStore", "StreamingExecutor"]


def __getattr__(name: str) -> Any:
    if name == "BlockStore":
        from poros.stream.store import BlockStore

        return BlockStore
    if name == "StreamingExecutor":
        from poros.stream.executor import StreamingExecutor

        return StreamingExecutor
    raise AttributeError(f"module 'poros.stream' has no attribute {name!r}")
