"""``PinnedSlab``: the host AdamW state and the host LoRA tensors at their own size, each a storage of its own.

torch's pinned allocator rounds every allocation up to a power of two; the slab carves the tensors from a
few chunks instead. On CPU the chunks are not registered (no CUDA), but the carving is the same code:
the sizes, the separate storages (savers must not see one shared storage), the chunk freed with its last
tensor, and that HostAdamW and ``lora_placement="host"`` take their host tensors from it.
"""

from __future__ import annotations

import gc
import io
import weakref

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import poros
from poros.stream.host_optimizer import HostAdamW
from poros.stream.pinned_slab import ALIGN, FIRST_CHUNK, PinnedSlab, expected_bytes
from poros.testing import load_qlora
from test_lora_placement import placed_run, qwen3, steps_of  # noqa: F401 (qwen3: the fixture)

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8)


def spans(tensors):
    """(start, end) of each tensor's own storage."""
    return sorted((t.untyped_storage().data_ptr(), t.untyped_storage().data_ptr() + t.untyped_storage().nbytes())
                  for t in tensors)


@settings(max_examples=40, deadline=None)
@given(shapes=st.lists(st.tuples(st.lists(st.integers(0, 700), min_size=0, max_size=3), st.sampled_from(DTYPES)),
                       min_size=1, max_size=30),
       chunk_kib=st.integers(1, 64))
def test_tensors_are_carved_at_their_own_size_each_its_own_storage(shapes, chunk_kib):
    slab = PinnedSlab(False, chunk_bytes=chunk_kib << 10)
    tensors = [slab.empty(tuple(shape), dtype) for shape, dtype in shapes]
    for tensor, (shape, dtype) in zip(tensors, shapes):
        assert tensor.shape == tuple(shape) and tensor.dtype == dtype and tensor.is_contiguous()
        assert tensor.device.type == "cpu"
        if tensor.numel():
            assert tensor.data_ptr() % ALIGN == 0  # DMA-friendly, any element size
            assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()  # not the chunk
    ranges = [r for r, t in zip(spans(tensors), sorted(tensors, key=lambda t: t.untyped_storage().data_ptr()))
              if t.numel()]
    assert all(end <= start for (_, end), (start, _) in zip(ranges, ranges[1:]))  # disjoint
    for index, tensor in enumerate(tensors):  # writing one leaves the others alone
        tensor.fill_(index % 7 if tensor.dtype != torch.uint8 else index % 251)
    for index, tensor in enumerate(tensors):
        assert torch.equal(tensor, torch.full_like(tensor, index % 7 if tensor.dtype != torch.uint8 else index % 251))
    needed = sum(-(-t.numel() * t.element_size() // ALIGN) * ALIGN for t in tensors)
    assert slab.used == needed
    # no power-of-two rounding: the chunks hold what was asked, plus at most the first chunk and one
    # tensor's tail per chunk beyond it
    largest = max((t.numel() * t.element_size() for t in tensors), default=0)
    chunks = max(1, -(-needed // max(1, min(chunk_kib << 10, needed))))
    assert slab.reserved <= max(FIRST_CHUNK, needed + chunks * (largest + ALIGN)) + FIRST_CHUNK


def test_savers_see_separate_tensors_and_save_only_their_bytes(tmp_path):
    from safetensors.torch import load_file, save_file

    slab = PinnedSlab(False)
    named = {f"t{i}": slab.empty((33, 17 + i), torch.float32).normal_() for i in range(5)}
    save_file(named, str(tmp_path / "a.safetensors"))  # refuses tensors that share a storage
    assert all(torch.equal(named[k], v) for k, v in load_file(str(tmp_path / "a.safetensors")).items())
    buffer = io.BytesIO()
    torch.save(named, buffer)
    assert buffer.tell() < sum(t.numel() * 4 for t in named.values()) + 16_384  # not the 16 MiB chunk


def test_a_chunk_is_freed_with_its_last_tensor():
    slab = PinnedSlab(False, chunk_bytes=FIRST_CHUNK)
    first = slab.empty((1024,), torch.float32)
    chunk = weakref.ref(slab._chunk.base)  # the chunk's whole buffer, which every tensor carved from it holds
    second = slab.empty((FIRST_CHUNK // 4,), torch.float32)  # does not fit: a new chunk
    assert slab.reserved >= 2 * FIRST_CHUNK
    gc.collect()
    assert chunk() is not None  # the slab moved on, the first tensor still holds its chunk
    del first
    gc.collect()
    assert chunk() is None
    assert second.numel() == FIRST_CHUNK // 4


def test_host_adamw_and_the_host_lora_tensors_come_from_slabs(qwen3):
    """A placement or optimizer that went back to ``torch.empty(pin_memory=...)`` per tensor fails here:
    every host tensor lies in its slab, and the slab handed out exactly their bytes."""
    streamed = poros.prepare(load_qlora(qwen3, seed=9), lora_placement="host")
    placement = streamed.lora_placement
    _, optimizer = placed_run(streamed, steps_of(3, steps=1, accumulation=2))
    assert isinstance(optimizer, HostAdamW)

    def carved(tensors, slab):
        sizes = [-(-t.numel() * t.element_size() // ALIGN) * ALIGN for t in tensors]
        assert slab.used == sum(sizes)
        assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in tensors)

    homes = [placement.host[id(p)] for parameters in placement.parameters.values() for p in parameters]
    carved(homes + list(placement.host_grad.values()), placement.slab)
    states = [value for state in optimizer.state.values() for key, value in state.items()
              if isinstance(value, torch.Tensor) and optimizer._on_device(optimizer.param_groups[0], key)]
    assert states
    carved(states, optimizer._slabs[False])


def test_the_owner_s_total_caps_the_chunks_and_a_large_tensor_leaves_the_open_chunk_open():
    """A registered chunk is locked RAM whether used or not: with ``expected`` no chunk outgrows what is still
    to come; a tensor larger than a chunk gets its own, and the next small tensor goes on in the open chunk."""
    sizes = [3000, 5000, 700, 12_000]
    expected = sum(4 * n + ALIGN for n in sizes)
    slab = PinnedSlab(False, expected=expected)
    tensors = [slab.empty((n,), torch.float32) for n in sizes]
    assert slab.reserved <= -(-expected // ALIGN) * ALIGN  # not the 16 MiB a first chunk takes without it
    assert slab.used == sum(-(-4 * n // ALIGN) * ALIGN for n in sizes) == expected_bytes(tensors)  # the owners' sum
    small = PinnedSlab(False, chunk_bytes=64 << 10)
    first = small.empty((1000,), torch.float32)
    large = small.empty((64 << 10,), torch.float32)  # 256 KiB, over the 64 KiB chunk
    after = small.empty((10,), torch.float32)
    assert after.data_ptr() == first.data_ptr() + -(-4000 // ALIGN) * ALIGN  # carved on from the open chunk
    assert large.untyped_storage().nbytes() == 4 * (64 << 10) and len(tensors) == 4


def test_a_refused_registration_does_not_linger_as_cuda_s_last_error(monkeypatch):
    """torch checks CUDA's last error after every kernel launch, so a refused ``cudaHostRegister`` left there would
    fail the next, unrelated kernel instead of letting the caller fall back. The CUDA runtime is not on a CPU
    machine: a stand-in for ``torch.cuda.cudart()`` refuses, and the reset is recorded."""
    from poros.stream import host_register

    class Runtime:
        def __init__(self, error):
            self.error = error

        def cudaHostRegister(self, pointer, nbytes, flags):  # noqa: N802 (CUDA's name)
            return self.error

    resets = []
    monkeypatch.setattr(host_register, "_last_error", [lambda: resets.append(1)])
    monkeypatch.setattr(torch.cuda, "cudart", lambda: Runtime(1))  # cudaErrorInvalidValue
    assert host_register.register(4096, 4096) == 1 and resets == [1]
    monkeypatch.setattr(torch.cuda, "cudart", lambda: Runtime(0))
    assert host_register.register(4096, 4096) == 0 and resets == [1]  # nothing to reset
