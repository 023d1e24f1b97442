"""The kept-activations bookkeeping's safety on its own (``poros/stream/kept.py``): the quick byte-range test that
packs a saved tensor as a :class:`~poros.stream.kept.SlotRef` agrees with the whole test on every tensor, and a
kept block that is not on the device can neither pack, nor unpack, nor bind a reference (no kept block ever reads
a slot another block owns). The bitwise training tests are ``tests/test_recompute.py``."""

from __future__ import annotations

import pytest
import torch

from poros.errors import StreamingError
from poros.stream.kept import KeptBlock, SlotRef, _Bytes, _ref


def test_the_quick_range_test_agrees_with_the_whole_test():
    """Every tensor that lies in a block's bytes (its first and last byte, in between, any dtype) is a SlotRef
    by both tests; every other one (the same storage just outside the block's range, another storage, an empty
    view, not a tensor) is None by both."""
    storage = torch.zeros(4096, dtype=torch.uint8)
    buffer = storage[512:2560]  # a block inside a larger slot storage, at a storage offset
    other = torch.zeros(4096, dtype=torch.uint8)
    candidates = [
        buffer, buffer[:1], buffer[-1:], buffer[1024:1536].view(torch.bfloat16).view(16, 16),
        buffer[:512].view(torch.float32).view(8, 16).t(), buffer[2044:].view(torch.float32),
        storage[:512], storage[511:512], storage[2560:], storage[2560:2564].view(torch.float32),  # just outside
        other[512:2560], other[:16].view(torch.float32), buffer[:0], torch.empty(0), torch.ones(3), None, 3.0,
    ]
    quick = _Bytes(buffer)
    for tensor in candidates:
        assert quick.ref(tensor) == _ref(tensor, buffer)
    inside = [t for t in candidates if quick.ref(t) is not None]
    assert len(inside) == 6 and all(isinstance(quick.ref(t), SlotRef) for t in inside)


def test_a_kept_block_off_the_device_cannot_pack_unpack_or_bind():
    slot = torch.zeros(1024, dtype=torch.uint8)
    owner = {"index": 1}
    kept = KeptBlock(1, lambda index: slot if owner["index"] == index else None)
    weight = slot[256:512].view(torch.float32)  # the block's weight, in its slot
    hidden = torch.ones(64, requires_grad=True)
    with kept.saving():
        output = weight * hidden  # saves the weight: packed by place
    kept.contexts.append((type("Node", (), {})(), "tensors", (None, SlotRef(256, torch.float32, (64,), (1,)))))
    owner["index"] = 2  # the slot now belongs to block 2
    with pytest.raises(StreamingError, match="block 1 kept its activations but is not on the device"):
        output.sum().backward()
    with pytest.raises(StreamingError, match="block 1 kept its activations but is not on the device"):
        kept.bind_contexts()
    with pytest.raises(StreamingError, match="block 1 kept its activations but is not on the device"):
        with kept.saving():
            pass
    owner["index"] = 1  # back on the device: the saved weight reads its bytes now
    slot[256:512].view(torch.float32).fill_(2.0)
    kept.bind_contexts()
    output.sum().backward()
    assert torch.equal(hidden.grad, torch.full((64,), 2.0))
