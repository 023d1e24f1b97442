"""BlockStore: every decoder block's frozen tensors in ONE contiguous buffer per block, kept by a host tier.

What a block holds and how it packs into its buffer is ``packing.py``: every tensor that does not
require grad (packed NF4 weights, norms, biases, buffers, the tensors of each bitsandbytes
``QuantState``), and the store keeps a snapshot of each QuantState's plain fields.

LoRA parameters (``requires_grad=True``) are not in the store: they stay on the compute device.

``fetch(i)`` copies block i's host buffer into a device slot (one copy, on a side stream on CUDA)
and points every module tensor at a view of the slot. ``release(i)`` puts size-0 placeholders
back (QuantState tensors too, so ``model.to(device)`` still works on an evicted model), and a
forward pre-hook on the block and on every module in it that owns a streamed tensor raises
:class:`~poros.errors.StreamingError` if it is called while evicted. A QuantState is
restored from its snapshot on every fetch, so bitsandbytes' in-place CPU repacking in eval mode
(AVX512-BF16 CPUs) cannot leak from one fetch into the next.

**state_dict / load_state_dict of an evicted block** see its real tensors: a state-dict hook on
every streamed block binds it to views of its host buffer (QuantStates restored from their
snapshots first, so a double-quant ``nested_offset`` or an eval repack never reaches the save),
and binds the placeholders back afterwards. ``save_pretrained``, PEFT's adapter save and every
Trainer checkpoint therefore write exactly what the unstreamed model writes, and a
``load_state_dict`` into an evicted block writes into its host buffer (the next fetch brings it).
The bytes lent are the host tier's (``lend``), and a load that writes frozen tensors hands them back
(``keep``): a file tier is never written, so it serves the loaded bytes from a buffer of their own.

**Resident blocks** (``resident=``, e.g. the last blocks of forward, which backward needs first)
are packed the same way into a buffer of their own on the device, bound once and never released:
``fetch``/``wait``/``release`` do nothing for them, they never take a slot, and the ring of slots
is sized for the streamed blocks only. The modules compute on the same bytes at the same
alignment either way, so a resident block changes where bytes live, not what is computed.

**Host tiers** (``host_tier=``, ``tiers.py``): the streamed blocks' host bytes are a
:class:`~poros.stream.tiers.HostTier`'s, and the store only calls its methods: ``fetch`` asks it for
block i's bytes (``acquire``) and tells it when the copy out of them is queued (``copied``). The
default, ``PinnedTier``, keeps one pinned buffer per block; ``MappedTier`` and ``DiskTier`` serve the
same bytes from a file of the packed blocks (the NF4 block cache entry), mapped or read ahead into a
small pinned ring.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch import nn

from poros.errors import StreamingError
from poros.stream.packing import Entry, bind_entry, entry_view, layout_of, shared_tensor_keys
# the layout's names the store's users import from here (``poros.stream.packing`` is their home)
from poros.stream.packing import ALIGN, block_layouts, frozen_tensors, packed_block_bytes  # noqa: F401
from poros.stream.shard_tier import copy_block, whole
from poros.stream.tiers import HostTier, PinnedTier

STATS_LOG_EVENTS = 1 << 16  # events kept in StoreStats.log


@dataclass
class BlockRecord:
    index: int
    module: nn.Module
    entries: list[Entry]
    nbytes: int
    # uint8 [nbytes]: the host tier's buffer of a streamed block (HostTier.host_buffer: None when the tier
    # reads it on demand), the block's own device buffer of a resident one
    buffer: torch.Tensor | None  # None once the store is restored
    quant_snapshots: list[tuple[Any, dict]] = field(default_factory=list)  # (QuantState, plain fields)
    slot: int | None = None  # device slot holding the block, None when evicted (always None when resident)
    resident: bool = False  # bound to its own device buffer for good

    @property
    def host(self) -> torch.Tensor:
        """The host buffer of a streamed block.

        Raises:
            StreamingError: the block is resident (its bytes live on the device, there is no host copy).
        """
        if self.resident:
            raise StreamingError(f"block {self.index} is resident: its bytes live in a device buffer, not on the "
                                 "host. Read BlockRecord.buffer.")
        return self.buffer


@dataclass
class StoreStats:
    """Counters for tests and benchmarks (no timing)."""

    fetches: list[int]
    releases: list[int]
    resident: set[int] = field(default_factory=set)
    max_resident: int = 0
    bytes_copied: int = 0
    # the latest fetch / release events (bounded: a long run must not grow it without end)
    log: deque[tuple[str, int]] = field(default_factory=lambda: deque(maxlen=STATS_LOG_EVENTS))

    def reset(self) -> None:
        self.fetches = [0] * len(self.fetches)
        self.releases = [0] * len(self.releases)
        self.max_resident = len(self.resident)
        self.bytes_copied = 0
        self.log.clear()


def _owners(block: nn.Module) -> list[nn.Module]:
    """The block and every module in it with a frozen parameter or a buffer of its own."""
    owners = [block]
    for module in block.modules():
        if module is not block and (any(not p.requires_grad for p in module.parameters(recurse=False))
                                    or any(b is not None for b in module.buffers(recurse=False))):
            owners.append(module)
    return owners


def _quant_states(block: nn.Module):
    for param in block.parameters():
        state = getattr(param, "quant_state", None)
        while state is not None:
            yield state
            state = getattr(state, "state2", None)


class BlockStore:
    """Host buffers for the frozen tensors of ``blocks`` and a ring of device slots.

    Args:
        blocks: the decoder layers, in order.
        device: the compute device; slots (and resident blocks) live there.
        num_slots: how many streamed blocks may hold weights on the device at once (>= 1). The
            ring never has more slots than there are streamed blocks.
        pin_memory: pin host buffers (default: when ``device`` is CUDA).
        resident: indices of blocks kept on the device for good (copied once, here).
        host_tier: where the streamed blocks' bytes live on the host, a
            :class:`~poros.stream.tiers.HostTier` (``make_host_tier``); default a ``PinnedTier`` (one
            buffer per block, pinned as ``pin_memory`` says). The store attaches and closes it.

    Raises:
        StreamingError: ``num_slots < 1``, or a resident index that is not a block index.
    """

    def __init__(self, blocks: list[nn.Module], device: torch.device | str, *, num_slots: int = 2,
                 pin_memory: bool | None = None, resident: Iterable[int] = (),
                 host_tier: HostTier | None = None) -> None:
        if num_slots < 1:
            raise StreamingError(f"num_slots={num_slots}; a store needs at least 1 device slot. Pass num_slots>=1.")
        resident = sorted(set(resident))
        outside = [i for i in resident if not 0 <= i < len(blocks)]
        if outside:
            raise StreamingError(f"resident blocks {outside} do not exist: the model has {len(blocks)} decoder blocks "
                                 f"(indices 0..{len(blocks) - 1}). Pass indices in that range.")
        self.device = torch.device(device)
        self.pin_memory = self.device.type == "cuda" if pin_memory is None else pin_memory
        # A tensor slot that several blocks share (e.g. one adapter buffer referenced by every layer)
        # cannot follow one block's residency: it stays where it is, resident.
        self.shared = shared_tensor_keys(blocks)
        layouts = [layout_of(block, self.shared) for block in blocks]
        self.host_tier: HostTier = PinnedTier(self.pin_memory) if host_tier is None else host_tier
        # the tier packs the streamed blocks' bytes (or finds, or writes, the file holding them)
        self.host_tier.attach({i: layout for i, layout in enumerate(layouts) if i not in resident}, self.device)
        self.blocks: list[BlockRecord] = [self._pack(i, block, i in resident, layouts[i])
                                          for i, block in enumerate(blocks)]
        streamed = [b for b in self.blocks if not b.resident]
        self.num_slots = min(num_slots, len(streamed))
        self.slot_bytes = max((b.nbytes for b in streamed), default=0)
        self.slots = [torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.device)
                      for _ in range(self.num_slots)]
        self.slot_owner: list[int | None] = [None] * self.num_slots
        # CUDA: copies run on their own stream. `slot_ready[s]` fires when slot s holds its block;
        # `slot_free[s]` when the compute that last read slot s is done. No host synchronisation.
        self.on_cuda = self.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(self.device) if self.on_cuda else None
        self.slot_ready = [torch.cuda.Event() for _ in range(self.num_slots)] if self.on_cuda else []
        self.slot_free = [torch.cuda.Event() for _ in range(self.num_slots)] if self.on_cuda else []
        self.stats = StoreStats(fetches=[0] * len(self.blocks), releases=[0] * len(self.blocks))
        #: objects told of each copy and wait (tracing, e.g. the bench's copy timeline):
        #: ``on_fetch(index)`` after a block's copy is issued, ``on_wait(index)`` before the compute
        #: stream is ordered after a streamed block's copy, ``on_release(index)`` (where defined) when a
        #: streamed block is evicted (``lora_placement.LoraPlacement`` moves the block's adapters with
        #: these). Empty: nothing is called.
        self.observers: list[Any] = []
        self._placeholders: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        # Guard the block and every module in it that owns a streamed tensor: calling any of
        # them while the block is evicted raises, even when called directly. Resident blocks
        # are never evicted: they need no guard.
        self._hooks = [module.register_forward_pre_hook(self._guard(b.index))
                       for b in streamed for module in _owners(b.module)]
        for b in streamed:
            self._hooks += [
                b.module.register_state_dict_pre_hook(lambda *_, i=b.index: self._lend_host(i)),
                b.module.register_state_dict_post_hook(lambda *_, i=b.index: self._end_lend(i)),
                b.module.register_load_state_dict_pre_hook(
                    lambda _, state_dict, prefix, *__, i=b.index: self._lend_for_load(i, state_dict, prefix)),
                b.module.register_load_state_dict_post_hook(lambda *_, i=b.index: self._end_lend(i)),
            ]
        # evicted blocks bound to their host bytes for a state_dict (see _lend_host) -> those bytes
        self._lent: dict[int, torch.Tensor] = {}
        self._loaded: set[int] = set()  # lent tier-served blocks a load_state_dict writes frozen tensors of
        for block in self.blocks:
            if block.resident:
                self._bind_all(block, block.buffer)
            else:
                self._bind_placeholders(block)

    # -- packing ---------------------------------------------------------------------------
    def _pack(self, index: int, block: nn.Module, resident: bool, layout) -> BlockRecord:
        entries, tensors, nbytes = layout
        if resident:
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            for entry, tensor in zip(entries, tensors):
                self._view(buffer, entry).copy_(tensor)
        else:
            buffer = self.host_tier.host_buffer(index)  # the tier's bytes of the block, None when it reads ahead
        # Plain fields only: the tensors are bound to buffer or slot views, and holding the
        # originals here would keep the unpacked copies alive.
        snapshots = [(state, {k: None if isinstance(v, torch.Tensor) else v for k, v in vars(state).items()})
                     for state in _quant_states(block) if (id(state), "absmax") not in self.shared]
        return BlockRecord(index, block, entries, nbytes, buffer, snapshots, resident=resident)

    _view = staticmethod(entry_view)

    # -- residency -------------------------------------------------------------------------
    def is_resident(self, index: int) -> bool:
        """Whether block ``index``'s weights are on the device now (fetched, or resident for good)."""
        block = self.blocks[index]
        return block.resident or block.slot is not None

    def buffer_of(self, index: int) -> torch.Tensor | None:
        """Block ``index``'s device bytes now (its slot's first ``nbytes``, or its resident buffer); None when
        it is not on the device."""
        block = self.blocks[index]
        if block.resident:
            return block.buffer
        return None if block.slot is None else self.slots[block.slot][: block.nbytes]

    @property
    def resident_blocks(self) -> tuple[int, ...]:
        """Indices of the blocks kept on the device for good."""
        return tuple(b.index for b in self.blocks if b.resident)

    def fetch(self, index: int) -> None:
        """Make block ``index`` resident: copy its buffer into a free slot and bind its tensors.
        Nothing happens for a block already fetched or resident for good.

        Raises:
            StreamingError: every slot holds another block (release one first).
        """
        block = self.blocks[index]
        if block.resident or block.slot is not None:
            return
        slot = next((s for s, owner in enumerate(self.slot_owner) if owner is None), None)
        if slot is None:
            raise StreamingError(
                f"cannot fetch block {index}: all {self.num_slots} device slots hold blocks "
                f"{self.slot_owner}. The executor must release a block first (or use more slots)."
            )
        target = self.slots[slot][: block.nbytes]
        source = self.host_tier.acquire(index)
        if self.on_cuda:
            with torch.cuda.stream(self.copy_stream):
                self.copy_stream.wait_event(self.slot_free[slot])
                copy_block(target, source, non_blocking=True)
                self.slot_ready[slot].record(self.copy_stream)
                self.host_tier.copied(index, self.copy_stream)
        else:
            copy_block(target, source)
            self.host_tier.copied(index, None)
        self.slot_owner[slot] = index
        block.slot = slot
        self._bind_all(block, target)
        self.stats.fetches[index] += 1
        self.stats.bytes_copied += block.nbytes
        self.stats.resident.add(index)
        self.stats.max_resident = max(self.stats.max_resident, len(self.stats.resident))
        self.stats.log.append(("fetch", index))
        for observer in self.observers:
            observer.on_fetch(index)

    def wait(self, index: int) -> None:
        """Order the current (compute) stream after block ``index``'s copy. No-op on CPU and for a
        resident block."""
        if self.blocks[index].resident:
            return
        slot = self.blocks[index].slot
        if slot is None:
            raise StreamingError(f"wait({index}): block {index} is not fetched; call fetch({index}) first.")
        for observer in self.observers:
            observer.on_wait(index)
        if self.on_cuda:
            torch.cuda.current_stream(self.device).wait_event(self.slot_ready[slot])

    def release(self, index: int) -> None:
        """Evict block ``index``: placeholders back in, its slot free once queued compute is done.
        Nothing happens for a block not fetched or resident for good."""
        block = self.blocks[index]
        if block.slot is None:
            return
        if self.on_cuda:
            self.slot_free[block.slot].record(torch.cuda.current_stream(self.device))
        self._bind_placeholders(block)
        self.slot_owner[block.slot] = None
        block.slot = None
        for observer in self.observers:
            if hasattr(observer, "on_release"):
                observer.on_release(index)
        self.stats.releases[index] += 1
        self.stats.resident.discard(index)
        self.stats.log.append(("release", index))

    def release_all(self) -> None:
        for block in self.blocks:
            self.release(block.index)

    # -- binding ---------------------------------------------------------------------------
    _bind = staticmethod(bind_entry)

    @staticmethod
    def _restore_quant_states(block: BlockRecord) -> None:
        """Give the block's QuantStates back their plain fields (their tensors are bound after)."""
        for state, fields in block.quant_snapshots:
            vars(state).clear()
            vars(state).update(fields)

    def _bind_all(self, block: BlockRecord, buffer: torch.Tensor) -> None:
        """Point every tensor of ``block`` at its view of ``buffer`` (a slot or its resident buffer)."""
        self._restore_quant_states(block)
        for entry in block.entries:
            self._bind(entry, self._view(buffer, entry))

    def _bind_placeholders(self, block: BlockRecord) -> None:
        # An evicted block's QuantStates are as packed, not as bitsandbytes' eval-mode CPU repacking left
        # them: a state_dict (PEFT's save) of an evicted block must not try to unpack placeholders.
        self._restore_quant_states(block)
        for entry in block.entries:
            key = (entry.dtype, self.device)
            if key not in self._placeholders:
                self._placeholders[key] = torch.empty(0, dtype=entry.dtype, device=self.device)
            self._bind(entry, self._placeholders[key])

    def _lend_host(self, index: int) -> None:
        """``state_dict``/``load_state_dict`` of an evicted block: bind its tensors to views of its host
        bytes (exact bytes, QuantStates restored), so it saves and loads what the unstreamed model would.
        The bytes are the tier's writable ones (``lend``: the mapped tier streams from a read-only
        mapping, the disk tier from a ring)."""
        block = self.blocks[index]
        if block.slot is None and index not in self._lent:
            source = self.host_tier.lend(index)
            self._lent[index] = source
            self._bind_all(block, source)

    def _lend_for_load(self, index: int, state_dict: dict, prefix: str) -> None:
        """``load_state_dict`` pre-hook: lend the host bytes, and note a block whose frozen tensors the load
        writes (see :meth:`_end_lend`)."""
        self._lend_host(index)
        block = self.blocks[index]
        if index in self._lent:
            trainable = {prefix + name for name, p in block.module.named_parameters() if p.requires_grad}
            if any(key.startswith(prefix) and key not in trainable for key in state_dict):
                self._loaded.add(index)

    def _end_lend(self, index: int) -> None:
        if index not in self._lent:
            return
        source = self._lent.pop(index)
        block = self.blocks[index]
        if index in self._loaded:  # the tier serves the loaded bytes from now on (a file tier: a buffer of their own)
            self._loaded.discard(index)
            self.host_tier.keep(index, source)
            block.buffer = self.host_tier.host_buffer(index)
        self._bind_placeholders(block)

    def _guard(self, index: int):
        def guard(module, args):
            if self.blocks[index].slot is None:
                raise StreamingError(
                    f"decoder block {index} was called while its weights are evicted to the host. "
                    "Call the model through the PorosModel returned by poros.prepare (it fetches blocks), "
                    "or PorosModel.unpatch() to put every weight back."
                )
        return guard

    # -- undo ------------------------------------------------------------------------------
    def restore(self) -> None:
        """Put every frozen tensor back as an ordinary tensor on ``device``, remove the guards, and let
        go of the host buffers, resident buffers and slots (a store kept after this holds no memory). The slots go
        first: a slot's bytes return as soon as the blocks bound to it are rebound, not after the whole model."""
        self.slots = []
        self.slot_owner = [None] * self.num_slots
        for block in self.blocks:
            self._restore_quant_states(block)
            source = block.buffer if block.resident else whole(self.host_tier.acquire(block.index))
            for entry in block.entries:
                self._bind(entry, self._view(source, entry).to(self.device, copy=True))
            if not block.resident:
                self.host_tier.copied(block.index, None)
            block.slot = None
            block.buffer = None
        self.host_tier.close()  # (unregistering a buffer waits for the device's copies: host_register.unregister)
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self.stats.resident.clear()

    @property
    def host_bytes(self) -> int:
        """Bytes of the streamed blocks' host buffers."""
        return sum(b.nbytes for b in self.blocks if not b.resident)

    @property
    def resident_bytes(self) -> int:
        """Bytes of the resident blocks' device buffers."""
        return sum(b.nbytes for b in self.blocks if b.resident)


class HostEmbedding:
    """Keep a frozen ``nn.Embedding`` table in host memory and look tokens up there.

    A lookup is a gather (exact), and a scaled embedding multiplies two values of the table's
    dtype (one rounding on any device), so the rows that reach the compute device are bit for
    bit the ones a device-resident table gives. Only ``B x S x hidden`` crosses the link instead
    of keeping ``vocab x hidden`` on the device. Not for a table tied to the output head (the
    head needs it on the device) nor for a trainable one.
    """

    def __init__(self, module: nn.Module, device: torch.device) -> None:
        self.module, self.device = module, torch.device(device)
        self.home = {name: t.device for name, t in [*module.named_parameters(), *module.named_buffers()]}
        module.to("cpu")
        self._hooks = [
            module.register_forward_pre_hook(self._tokens_to_host),
            module.register_forward_hook(self._rows_to_device),
        ]

    @staticmethod
    def _tokens_to_host(module, args):
        # to wherever the table is now (the host unless a plain ``nn.Module.to`` on an inner module moved it)
        return (args[0].to(module.weight.device), *args[1:])

    def _rows_to_device(self, module, args, output):
        # The table is frozen, so nothing upstream of its output learns: the rows arrive as a leaf.
        # (transformers' input-require-grads hook, on while checkpointing, makes the output require
        # grad; through a plain copy its gradient would go back to the host for nothing, with a sync.)
        rows = output.detach().to(self.device)
        return rows.requires_grad_() if output.requires_grad else rows

    def restore(self) -> None:
        for hook in self._hooks:
            hook.remove()
        for name, tensor in [*self.module.named_parameters(), *self.module.named_buffers()]:
            if name in self.home and tensor.device != self.home[name]:
                tensor.data = tensor.data.to(self.home[name])
        self._hooks = []
