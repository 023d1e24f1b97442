"""The streaming engine (imports torch): block store and executor."""

from poros.stream.executor import StreamingExecutor
from poros.stream.store import BlockStore

__all__ = ["BlockStore", "StreamingExecutor"]
