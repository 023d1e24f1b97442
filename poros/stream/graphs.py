"""CUDA graphs per block phase: the streamed step without the host in it (``cuda_graphs=True``).

Every streamed block computes in the same device slot, with the same shapes, in the same order,
so one captured graph per (phase, slot, block structure, argument shapes) replays the very
kernels eager mode would launch, with the same arguments — the bits stay the same and the host
cost of queueing ~500 kernels per block disappears.

::

    eager, first time a key is seen ─▶ capture on a side stream (one shared memory pool)
    every later time:  copy the block's arguments and LoRA tensors into the static buffers
                       (the LoRA's one set for all graphs) ─▶ replay on the compute stream
                       ─▶ clone the outputs (the LoRA gradients: one set for all backward graphs)

* **Keys.** ``forward`` / ``backward`` × where the block's frozen bytes are bound (its device slot,
  or its own buffer when resident) × the block's structure (module types and plain attributes —
  numbers, strings, and dicts / lists of them such as PEFT's per-adapter ``scaling`` —
  the store layout of its frozen tensors, addresses of tensors the store does not stream) × each
  argument's shape, strides and dtype (plain arguments by value) × training mode, adapter state
  (enabled, active, merged) and the autocast state. Blocks of one kind in one slot share a graph.
* **Autocast** (HF Trainer's ``bf16=True``): unless :data:`AUTOCAST_SWITCH` is ``0``, a block under
  autocast is captured with the cast cache off (``replay.uncached``: each cast of an fp32 LoRA weight is
  an op the replay reruns; cached or not it gives the same bits, and autograd the same gradient, as
  long as the weight has not changed since it was cached). The one case where the cache changes the
  bits is an autocast region that outlives an optimizer step (torch keeps the first cast of each weight
  for the whole region, so the eager path computes with stale casts; HF Trainer enters autocast per
  forward): :meth:`BlockGraphs.begin_step` finds a region that lived through the previous
  ``forward_backward`` (``replay.CastCacheWatch``) and its blocks run eagerly (``autocast cache across
  steps``), matching a resident run in the same region. With the switch at ``0``, blocks under autocast
  with the cache on run eagerly (``autocast cache``). Captures hold on the H200 when the step runs off
  the legacy default stream (poros.stream.compute_stream; docs/results-h200-log.md, the eighth session).
* **LoRA tensors** are the one per-block state the graph reads that does not live in the slot: the capture
  points the block's trainable parameters at static buffers (``.data``), each replay copies the running
  block's values in. Those buffers are **one set shared by every graph**
  (:class:`~poros.stream.graph_capture.ParameterStatics`, :attr:`BlockGraphs.statics`): the k-th parameter of
  a given (shape, strides, dtype, device) in a block reads that signature's k-th buffer, in every graph of
  every block structure, so they hold the largest block's LoRA (per signature) once, not a copy per graph (an
  MoE block's expert LoRA is large; two layer kinds key twice the graphs). Why that is sound: every use of the
  buffers is queued on the one compute stream, per replay in this order — the copy of the running block's
  values in (:meth:`Graph.load`), the replay that reads them, the reads of its outputs (cloned, or added into
  ``.grad``) — and the next replay's copy in is queued after all of it, so no copy overwrites values a replay
  has yet to read. No graph writes them (the shared buffers are made outside the pool, before any capture),
  and none reads them outside its replay: a capture fills them with its block's values first, and its eager
  warm-up on the side stream waits for that copy while the compute stream waits for the warm-up. Two
  parameters of one block never share a buffer (a block's values must all be there at once). Micro-major's
  replays (:data:`MICRO_MAJOR_SWITCH`) run in the autograd engine on the compute stream, one at a time.
* **LoRA gradients** are shared the same way (:attr:`BlockGraphs.gradients`, a second set by the same rule):
  inside the capture a backward graph copies autograd's gradient of each LoRA tensor into its shared buffer (a
  copy kernel per tensor: same bits; an unused tensor's stays None) and returns the buffer, so autograd's own
  are the capture's temporaries, their pool bytes reused by later captures. Sound because
  :meth:`BlockGraphs.backward` reads the buffers on the compute stream right after the replay, before it
  returns, into tensors of the run's own — a new ``.grad`` (``empty_like(p).copy_``) or an ``add_`` into it in
  layer-major, clones for the autograd engine in micro-major — so no ``.grad`` or returned gradient is a
  buffer, and the next replay is queued after every read; no graph reads them, and the autocast warm-up that
  writes them waits for the compute stream and is waited for. Hidden, argument and carried-entry gradients
  stay each graph's own (boundary-sized). Checked on the CPU only.
* **The copy stream stays outside**: the store's events order the replay after the block's copy,
  exactly as they order eager compute.
* **Layer-major only**: graphs replay the phases :meth:`StreamingExecutor.forward_backward` drives
  (layer-major accumulation, ``PorosTrainer``'s default). Micro-major's backward runs inside the
  autograd engine, where a capture can be invalidated by the engine's other work (seen on the
  H200: the gate's first micro-major capture failed); its blocks run eagerly, counted as
  ``micro-major`` (:data:`MICRO_MAJOR_SWITCH` lets them replay, for the probe that measures it).
* **Carried mappings** (K/V one layer stores for later ones) are never captured by reference: the capture
  hands the block a mapping of its own, holding static copies of the entries the block reads (what
  :meth:`StreamingExecutor.carried_access` says, from the descriptor), copied in before each replay like
  the hidden states; what the block writes there is a static output, cloned into the live mapping after
  each replay. In backward the read entries' gradients are outputs and the gradients later readers sent
  to a written entry are inputs; the executor sums them as in eager mode. A block that neither reads nor
  writes gets an empty mapping. A capture whose block touches an entry it was not declared to fails.
* **Fallback, per call, named**: a carried mapping the descriptor does not describe, or an entry a block
  reads that no earlier block wrote (``carried state: ...``, naming the layer and the entry), an active
  dropout (its RNG draws; ``nn.Dropout`` or an attention's ``attention_dropout``), hooks on the
  trainable parameters, autocast with its cast cache on (:data:`AUTOCAST_SWITCH` ``0``, or in a region
  that outlived a step: see above), Python hooks on the block's modules (a replay runs no Python),
  arguments that are not tensors or plain values, or whose elements overlap (an expanded view: a static
  copy cannot hold it), and a family's ``graph_unsafe`` features (e.g. MoE routing through transformers'
  eager experts loop, which syncs with the host; its ``grouped_mm`` is captured) run eagerly; a capture
  that fails (a host sync inside third-party code) marks its key eager for the run. Past
  :data:`MAX_GRAPHS` keys (batches padded to many lengths: each length is new keys), new keys run
  eagerly — pad to a few lengths (``pad_to_multiple_of``) to replay them. :attr:`BlockGraphs.report`
  counts replays, captures and every eager run by reason (``poros doctor`` / the run summary).

CUDA only: ``poros.plan.entry.cuda_graphs_on`` says whether ``cuda_graphs`` applies to a device (the
one rule of ``"auto"``); on CPU the executor has no ``BlockGraphs`` and runs as before.

This module replays (:class:`BlockGraphs`: when to capture, when to run eagerly and why); the keys and what
keeps a block from capture are :mod:`poros.stream.graph_keys`'s, what a capture holds and how it is built
:mod:`poros.stream.graph_capture`'s, the report :mod:`poros.stream.graph_report`'s.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections import Counter
from typing import Any, Callable

import torch
from torch import nn

from poros.stream import capture_scratch
from poros.stream.carried import CarriedAccess, recompute_roots
from poros.stream.dropout import dropout_p
from poros.stream.graph_capture import (Graph, ParameterStatics, as_grad_of, clone, copied_into, numbered, own_mappings,
                                        pointed_at, read_tensors, static_copy, written_entries)
from poros.stream.graph_keys import (PLAIN, autocast_on, carried_reason, carried_signature, global_hooks,
                                     hashable_autocast, module_structure, non_overlapping, signature)
from poros.stream.graph_report import GraphReport, eager_reason  # re-exported: graphs.eager_reason
from poros.stream.options import check_cuda_graphs as check  # the setting's one check, as graphs.check
from poros.stream.replay import CastCacheWatch, autocast_state, outside_autocast, replayed_autocast, uncached

#: eager runs of a key before it is captured (lazy initialisation — cuBLAS handles, workspaces,
#: autotuning caches — happens in eager mode first, never inside a capture)
WARMUP = 1
#: graphs one run may capture: every new argument shape (a batch padded to another length) is new
#: keys, each with static buffers of its own; past this, new keys run eagerly ("graph limit")
MAX_GRAPHS = 24
#: the environment variable that turns off the capture under autocast with its cast cache on (``0``); on by
#: default since the H200 showed it bitwise in every family once the step runs off the legacy stream
#: (poros.stream.compute_stream; read when a :class:`BlockGraphs` is made)
AUTOCAST_SWITCH = "POROS_CUDA_GRAPHS_AUTOCAST"
#: the environment variable that lets micro-major's block phases (inside the autograd engine) replay
#: too (``1``): a probe for the H200 (its micro-major captures: docs/results-h200-log.md), off by default
MICRO_MAJOR_SWITCH = "POROS_CUDA_GRAPHS_MICRO_MAJOR"


class BlockGraphs:
    """Captured graphs of the executor's block phases (see the module docstring).

    Args:
        store: the executor's block store (where each block's frozen bytes are bound).
        layers: the decoder layers.
        unsafe: a reason when the family's config enables a feature that cannot be captured
            (``ArchitectureDescriptor.graph_unsafe``), else None.
        warmup: eager runs of a key before its capture.
        max_graphs: keys captured at most (failed captures included); later keys run eagerly.
    """

    def __init__(self, store: Any, layers: nn.ModuleList, *, unsafe: str | None = None, warmup: int = WARMUP,
                 max_graphs: int = MAX_GRAPHS) -> None:
        self.store, self.layers, self.unsafe, self.warmup, self.max_graphs = store, layers, unsafe, warmup, max_graphs
        self.pool = None  # the graphs' one memory pool, made at the first capture
        self.statics = ParameterStatics()  # the static LoRA buffers, one set every graph reads (module docstring)
        self.gradients = ParameterStatics()  # the LoRA gradients, one set every backward graph returns
        self.scratch = capture_scratch.CaptureScratch()  # what captures write their large transients to
        self.graphs: dict[tuple, Graph | None] = {}
        self.seen: Counter = Counter()
        self.report = GraphReport()
        self._structure: dict[int, tuple] = {}
        # per block, found once and again only when its module tree changed (``_refresh``): its modules in
        # named_modules order, those that may drop out (nn.Dropout, an attention's attention_dropout), its
        # PEFT adapter layers, and the tree's fingerprint (the ids of every module's children)
        self._tree: dict[int, tuple[int, ...]] = {}
        self._modules: dict[int, list[tuple[str, nn.Module]]] = {}
        self._dropouts: dict[int, list[nn.Module]] = {}
        self._adapters: dict[int, list[nn.Module]] = {}
        self._own_hooks = {handle.id for handle in getattr(store, "_hooks", ())}
        # autocast with its cast cache on: captured (cache off) only with the switch; a region that
        # outlived the previous forward_backward holds stale casts, which only eager mode reproduces
        self.autocast_capture = os.environ.get(AUTOCAST_SWITCH, "1") != "0"
        self.micro_major = os.environ.get(MICRO_MAJOR_SWITCH, "") == "1"
        self._cache_watch = CastCacheWatch(store.device)
        self._stale_casts = False
        self._capture_stream = None  # one side stream, warmed up and captured on (made at the first capture)

    def begin_step(self) -> None:
        """Called at the start of each ``forward_backward``: whether the ambient autocast region has lived
        since the previous one (its cast cache then holds casts of weights an optimizer step may have
        changed since: the eager path reuses them, a capture would not; such blocks run eagerly)."""
        self._stale_casts = self.autocast_capture and self._cache_watch.persisted()

    def release(self) -> None:
        """Drop every graph, the shared LoRA buffers, the capture scratch and the pool (``PorosModel.unpatch``):
        what the graphs held on the device goes back to the caching allocator, which frees a released pool's
        segments when it needs the room (or at ``torch.cuda.empty_cache``). Later calls capture afresh."""
        self.graphs.clear()
        self.seen.clear()
        self.statics, self.gradients, self.pool = ParameterStatics(), ParameterStatics(), None
        self.scratch = capture_scratch.CaptureScratch()

    # -- the two phases -------------------------------------------------------------------------
    def forward(self, index: int, leaves: list[Any], unflatten: Callable,
                carried: dict[int, CarriedAccess] | None = None) -> torch.Tensor | None:
        """Block ``index``'s forward without grad, replayed; None when it must run eagerly. ``carried``:
        the leaf positions of carried mappings, with what the block reads and writes of each; the
        entries it writes are put into those live mappings, as the block itself would."""
        carried = carried or {}
        reason = self.eager_reason(index, leaves, carried)
        if reason is not None:
            self.note_eager(reason)
            return None
        layer = self.layers[index]
        autocast = uncached(autocast_state(self.store.device))
        extra = (hashable_autocast(autocast), carried_signature(leaves, carried))
        key = self._key("forward", index, layer, leaves, extra, carried)
        graph = self._graph(key, index, lambda: self._capture_forward(index, leaves, unflatten, carried, autocast))
        if graph is None:
            return None
        graph.load(leaves, self._parameters(index), read_tensors(leaves, carried))
        graph.replay()
        self.report.replays += 1
        graph.write_back(leaves)
        return graph.outputs[0].clone()

    def backward(self, index: int, leaves: list[Any], unflatten: Callable, grad_output: torch.Tensor,
                 hidden_needs_grad: bool, grad_at: list[int], autocast: Any, accumulate: bool,
                 carried: dict[int, CarriedAccess] | None = None, written_grads: list = ()):
        """Block ``index``'s recompute and backward, replayed: ``(hidden grad, input grads, parameter
        grads, read grads)`` as the executor's eager path makes them (with ``accumulate`` the parameter
        grads go into ``.grad`` here and the list is empty; read grads: id of each tensor of an entry the
        block read, in ``leaves``' mappings, -> its gradient), or None when it must run eagerly.
        ``written_grads``: ``(kwarg, key, gradients)`` that later readers sent to entries this block
        writes (one gradient or None per tensor of the entry), more output gradients of the recompute."""
        carried = carried or {}
        reason = self.eager_reason(index, leaves, carried)
        if reason is not None:
            self.note_eager(reason)
            return None
        layer = self.layers[index]
        autocast = uncached(autocast)  # what the capture runs under: the forward's state, cast cache off
        pending = tuple((name, key, tuple(None if g is None else signature(g) for g in grads))
                        for name, key, grads in written_grads)
        extra = (hidden_needs_grad, tuple(grad_at), hashable_autocast(autocast), signature(grad_output),
                 carried_signature(leaves, carried), pending)
        key = self._key("backward", index, layer, leaves, extra, carried)
        graph = self._graph(key, index, lambda: self._capture_backward(
            index, leaves, unflatten, grad_output, hidden_needs_grad, grad_at, autocast, carried, written_grads))
        if graph is None:
            return None
        parameters = self._parameters(index)
        reads = read_tensors(leaves, carried)
        sent = [g for _, _, grads in written_grads for g in grads if g is not None]
        graph.load(leaves, parameters, [grad_output, *reads, *sent])
        graph.replay()
        self.report.replays += 1
        outputs = graph.outputs
        # each gradient in the layout autograd's accumulator gives a leaf's .grad (the eager path reads .grad)
        hidden_grad = as_grad_of(outputs[0], leaves[0]) if hidden_needs_grad else None
        inputs = [as_grad_of(g, leaves[p]) for g, p in zip(outputs[1:1 + len(grad_at)], grad_at)]
        read_outputs = iter(outputs[1 + len(grad_at):])
        read_grads = {id(t): as_grad_of(next(read_outputs), t) for t in reads if t.requires_grad}
        grads = outputs[1 + len(grad_at) + len(read_grads):]  # the shared gradient buffers: read before returning
        if not accumulate:
            return hidden_grad, inputs, [clone(g) for g in grads], read_grads
        with torch.no_grad():
            for parameter, grad in zip(parameters, grads):
                if grad is None:
                    continue
                if parameter.grad is None:  # autograd's accumulator: take the first (a copy: never the
                    parameter.grad = torch.empty_like(parameter).copy_(grad)  # shared buffer), add after
                else:
                    parameter.grad.add_(grad)
        return hidden_grad, inputs, [], read_grads

    # -- keys and fallbacks ---------------------------------------------------------------------
    def eager_reason(self, index: int, leaves: list[Any],
                     carried: dict[int, CarriedAccess] | None = None) -> str | None:
        """Why block ``index`` must run eagerly now (None: it may be graphed). ``carried``: the leaf
        positions of carried mappings, with what the block reads and writes of each."""
        self._refresh(index)
        carried = carried or {}
        layer = self.layers[index]
        if self.unsafe:
            return self.unsafe
        for position, access in carried.items():
            reason = carried_reason(index, leaves[position], access, self.store.device)
            if reason is not None:
                return reason
        if layer.training and any(dropout_p(m) > 0 for m in self._dropouts_of(index)):
            return "dropout"
        if torch.is_autocast_enabled(self.store.device.type) and torch.is_autocast_cache_enabled():
            if not self.autocast_capture:
                return "autocast cache"
            if self._stale_casts:
                return "autocast cache across steps"
        if global_hooks() or any(m._forward_hooks or m._forward_pre_hooks.keys() - self._own_hooks
                                  or m._backward_hooks or m._backward_pre_hooks for _, m in self._modules_of(index)):
            return "module hooks"
        if any(p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None)
               for p in self._parameters(index)):  # a replay's .grad bookkeeping runs no tensor hook
            return "parameter hooks"
        arguments = [leaf for position, leaf in enumerate(leaves) if position not in carried]
        if any(not isinstance(leaf, (torch.Tensor, *PLAIN)) for leaf in arguments):
            return "argument"
        tensors = [leaf for leaf in arguments if isinstance(leaf, torch.Tensor)]
        if any(t.device != self.store.device for t in tensors):
            return "argument off the device"
        if not all(non_overlapping(t) for t in tensors):
            return "argument layout"  # an expanded view: a static copy of its shape and strides cannot hold it
        return None

    def note_eager(self, reason: str) -> None:
        self.report.eager[reason] += 1

    def _key(self, phase: str, index: int, layer: nn.Module, leaves: list[Any], extra: tuple = (),
             carried: dict[int, CarriedAccess] | None = None) -> tuple:
        block = self.store.blocks[index]
        where = ("resident", index) if block.resident else ("slot", block.slot)
        adapters = tuple((m._disable_adapters, str(m.active_adapters), len(m.merged_adapters))
                         for m in self._adapter_layers(index))
        parameters = tuple((tuple(p.shape), p.dtype) for p in self._parameters(index))  # the static LoRA buffers
        arguments = tuple(("carried", type(leaf).__qualname__) if position in (carried or {}) else signature(leaf)
                          for position, leaf in enumerate(leaves))
        return (phase, where, self._structure_of(index), arguments, layer.training, adapters, parameters, extra)

    def _structure_of(self, index: int) -> tuple:
        """What makes two blocks run the same code on the same bytes: module types and plain attributes
        (but the layer index), the store layout, and the addresses of tensors the store does not
        stream (a per-block tensor outside the store makes the block's key its own)."""
        if index not in self._structure:
            layer, record = self.layers[index], self.store.blocks[index]
            modules = module_structure(self._modules_of(index))
            layout = tuple((e.name, e.kind, e.offset, e.dtype, e.shape, e.stride) for e in record.entries)
            streamed = {id(e.owner) for e in record.entries}
            outside = tuple(t.data_ptr() for _, m in self._modules_of(index)
                            for t in [*m._parameters.values(), *m._buffers.values(),
                                      *(v for v in vars(m).values() if isinstance(v, torch.Tensor))]
                            if t is not None and not t.requires_grad and id(t) not in streamed and id(m) not in streamed)
            self._structure[index] = (modules, layout, outside)
        return self._structure[index]

    def _refresh(self, index: int) -> None:
        """Forget what was found of block ``index`` if a module was added, removed or replaced in it since
        (a dropout swapped in, an adapter added): a cheap walk over the cached modules' children."""
        if index not in self._modules:
            return
        tree = tuple(id(child) for _, m in self._modules[index] for child in m._modules.values())
        if self._tree.setdefault(index, tree) != tree:
            for cache in (self._tree, self._modules, self._dropouts, self._adapters, self._structure):
                cache.pop(index, None)

    def _modules_of(self, index: int) -> list[tuple[str, nn.Module]]:
        if index not in self._modules:
            self._modules[index] = list(self.layers[index].named_modules())
        return self._modules[index]

    def _dropouts_of(self, index: int) -> list[nn.Module]:
        if index not in self._dropouts:
            self._dropouts[index] = [m for _, m in self._modules_of(index)
                                     if isinstance(m, nn.Dropout) or hasattr(m, "attention_dropout")]
        return self._dropouts[index]

    def _adapter_layers(self, index: int) -> list[nn.Module]:
        if index not in self._adapters:
            self._adapters[index] = [m for _, m in self._modules_of(index)
                                     if hasattr(m, "_disable_adapters") and hasattr(m, "merged_adapters")]
        return self._adapters[index]

    def _parameters(self, index: int) -> list[nn.Parameter]:
        """Block ``index``'s trainable parameters in ``parameters()`` order (``requires_grad`` read now)."""
        return list(dict.fromkeys(p for _, m in self._modules_of(index) for p in m._parameters.values()
                                  if p is not None and p.requires_grad))

    def _graph(self, key: tuple, index: int, capture: Callable[[], Graph]) -> Graph | None:
        if key in self.graphs:
            graph = self.graphs[key]
            if graph is None:
                self.note_eager("capture failed")
            return graph
        if self.seen[key] < self.warmup:
            self.seen[key] += 1
            self.note_eager("warm-up")
            return None
        if len(self.graphs) >= self.max_graphs:  # bounded memory: new shapes run eagerly from here on
            self.note_eager("graph limit")
            return None
        try:
            graph = capture()
            self.report.captured += 1
        except Exception as exc:  # noqa: BLE001 - a block that cannot be captured runs eagerly, and says why
            graph = None
            failure = f"{key[0]} of block {index}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            self.report.failures.append(failure)
            self.note_eager("capture failed")
            warnings.warn(f"poros: cuda graph capture failed, the block runs eagerly ({failure})", stacklevel=4)
        self.graphs[key] = graph
        return graph

    # -- capture --------------------------------------------------------------------------------
    def _record(self, index: int, body: Callable[[int], list], autocast: Any = None) -> tuple[Callable[[], None], list]:
        """Capture ``body(index)`` — block ``index``'s kernels — into a CUDA graph: ``(replay, body's
        outputs)``; each replay reruns those kernels on the same buffers, for whichever block of the key
        has its bytes there now (``body(i)`` is block ``i``'s). The one CUDA-only step of a capture."""
        self.pool = self.pool or torch.cuda.graph_pool_handle()
        device = self.store.device
        generator = torch.cuda.default_generators[device.index if device.index is not None
                                                  else torch.cuda.current_device()]
        backup, stream = generator.clone_state(), torch.cuda.current_stream(device)
        graph = torch.cuda.CUDAGraph()
        side = None
        if self.autocast_capture and (torch.is_autocast_enabled(device.type) or autocast_on(autocast)):
            # torch's recipe: one eager run on the capture's own stream first, so that what kernels set
            # up lazily per stream (cuBLAS workspaces of the bf16 GEMMs autocast adds) exists before it
            side = self._capture_stream = self._capture_stream or torch.cuda.Stream(device)
            side.wait_stream(stream)
            with torch.cuda.stream(side):
                body(index)
            stream.wait_stream(side)
        try:
            with torch.cuda.graph(graph, pool=self.pool, stream=side, capture_error_mode="thread_local"), \
                    capture_scratch.active(self.scratch):  # large transients to one held buffer, allocated once
                outputs = body(index)
        except Exception:
            # A capture CUDA invalidated ends without its epilogue: the generator would stay "capturing"
            # and refuse every later random draw, and torch.cuda.graph's exit raises before it gives the
            # compute stream back. Restore both (nothing was drawn; nothing ran on the capture stream).
            generator.graphsafe_set_state(backup)
            torch.cuda.set_stream(stream)
            torch.cuda.synchronize(device)
            self._abandon_pool(device)
            raise
        return graph.replay, outputs

    def _abandon_pool(self, device: torch.device) -> None:
        """After a failed capture: the allocator may still route the capture stream's allocations to the
        pool (the capture's end never ran), and every later capture into it would fail ("already
        recording to mempool_id", seen on the H200). End that and start later captures on a new pool."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        for name in ("_cuda_endAllocateToPool", "_cuda_endAllocateCurrentStreamToPool"):
            end = getattr(torch._C, name, None)
            if end is not None:
                with contextlib.suppress(Exception):
                    end(index, self.pool)
                break
        self.pool = None

    def _capture_forward(self, index: int, leaves: list[Any], unflatten: Callable,
                         carried: dict[int, CarriedAccess], autocast: Any = None) -> Graph:
        statics = [static_copy(leaf) for leaf in leaves]
        reads = own_mappings(statics, leaves, carried)
        params = self.statics.for_block(self._parameters(index))  # the shared buffers, this block's values in
        writes: list[tuple[int, Any, Any, int, int]] = []

        def body(block: int) -> list:
            with pointed_at(self._parameters(block), params), torch.no_grad(), \
                    replayed_autocast(autocast, self.store.device):
                args, kwargs = unflatten(statics)
                output = self.layers[block](*args, **kwargs)
            written = written_entries(index, statics, carried)
            writes[:] = [(position, key, spec, 1 + first, len(tensors)) for position, key, spec, tensors, first
                         in numbered(written)]
            return [output, *(t for _, _, _, tensors in written for t in tensors)]

        replay, outputs = self._record(index, body, autocast)
        return Graph(replay, statics, params, outputs, inputs=reads, writes=writes)

    def _capture_backward(self, index: int, leaves: list[Any], unflatten: Callable, grad_output: torch.Tensor,
                          hidden_needs_grad: bool, grad_at: list[int], autocast: Any,
                          carried: dict[int, CarriedAccess], written_grads: list) -> Graph:
        statics = [static_copy(leaf) for leaf in leaves]
        statics[0].requires_grad_(hidden_needs_grad)
        for position in grad_at:
            statics[position].requires_grad_(True)
        reads = own_mappings(statics, leaves, carried)  # requiring grad where the recompute's entries do
        params = self.statics.for_block(self._parameters(index))  # the shared buffers, this block's values in
        shared_grads = self.gradients.buffers_of(self._parameters(index))  # made outside the pool, before it records
        static_grad = static_copy(grad_output)
        position_of = {access.kwarg: position for position, access in carried.items()}
        sent = [(position_of[name], key, [None if g is None else static_copy(g) for g in grads])
                for name, key, grads in written_grads]

        def body(block: int) -> list:
            parameters = self._parameters(block)
            with pointed_at(parameters, params):
                with torch.enable_grad(), replayed_autocast(autocast, self.store.device):
                    args, kwargs = unflatten(statics)
                    output = self.layers[block](*args, **kwargs)
                live = recompute_roots(output, static_grad, [(statics[position][key], grads)
                                                             for position, key, grads in sent])
                targets = ([statics[0]] if hidden_needs_grad else []) + [statics[p] for p in grad_at]
                targets += [t for t in reads if t.requires_grad] + parameters
                with outside_autocast(self.store.device):  # as the eager layer-major backward
                    grads = list(torch.autograd.grad([r for r, _ in live], targets, [g for _, g in live],
                                                     allow_unused=True))
            first = len(grads) - len(parameters)  # the LoRA gradients, returned in the shared buffers
            grads[first:] = copied_into(grads[first:], shared_grads)
            if not hidden_needs_grad:
                grads.insert(0, None)
            return grads

        replay, outputs = self._record(index, body, autocast)  # the recompute's state: warm-up too
        inputs = [static_grad, *reads, *(g for _, _, grads in sent for g in grads if g is not None)]
        return Graph(replay, statics, params, outputs, inputs=inputs)


__all__ = ["eager_reason", "AUTOCAST_SWITCH", "MAX_GRAPHS", "MICRO_MAJOR_SWITCH", "WARMUP", "BlockGraphs", "GraphReport", "check"]
