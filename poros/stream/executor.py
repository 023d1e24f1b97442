"""The Poros streaming executor (the block store is ``store.py``; what a recompute replays of its
forward, RNG and autocast state, ``replay.py``; the layer-major schedule, ``layer_major.py``).

::

    host (one buffer per block)       compute device
     block 0 ──fetch──▶ slot A ─┐
     block 1 ──fetch──▶ slot B  │  forward : prelude → [block i: fetch, run, release] → norm → head → loss
     ...                        │            keeps only each block's input h_i (+ carried state)
     block L-1                  │  backward: for i = L-1..0: fetch, recompute block i from h_i,
     LoRA A/B + optimizer ──────┘            back-propagate, release;   LoRA never moves

Notable features:

* **The HF model runs its own forward.** The executor replaces only the forward of the text
  model (the trunk, ``descriptor.text_model``) on that one instance; the causal LM's forward
  is untouched, so slicing, ``lm_head``, soft-capping and ``loss_function`` (with
  ``num_items_in_batch``) are the model's own code, and anything that calls the trunk — PEFT,
  HF Trainer, TRL's fused LM head — gets streamed hidden states.
* **HF builds its own context.** The streamed trunk first runs the trunk's class ``forward``
  with the decoder layers swapped for recorders. Each recorder captures the exact ``(args,
  kwargs)`` HF would pass to that layer — masks per layer kind, rotary per kind, position ids,
  per-layer inputs, the carried mapping — and the capture stops at the last layer. The executor
  then calls every real layer with exactly those arguments, only the hidden states replaced, and
  returns ``final_norm(h)``. No mask or rotary is re-implemented, so the forward is HF's, bit
  for bit.
* **One autograd node per block.** ``_StreamedBlock`` runs a block without grad in forward,
  saving only its input; in backward it fetches the block, recomputes it with grad from that
  input and back-propagates — reentrant recompute, but with every differentiable argument passed
  explicitly, so nothing reaches autograd through a side door. The block's LoRA parameters are
  inputs of the node too and their gradients its outputs: each parameter's accumulator runs once,
  from the graph the forward built, in the resident order (what DDP's reducer needs).
* **Carried state is generic.** A carried *mapping* (descriptor ``CarriedState(kind="mapping")``,
  e.g. K/V one layer stores for later layers) is tracked by identity: entries a block writes are
  versioned with the writer's index; a later block's recompute receives leaf copies; their gradients are summed in
  reverse layer order (the order autograd uses) and fed into the writer's recompute as extra
  output gradients. Any other argument that requires grad (e.g. per-layer inputs sliced from the
  prelude) is an input of the block's node, so its gradient flows back into the prelude.
* **Two schedules.** Micro-major (the default): every ``model(batch)`` call streams every block,
  forward and backward, and autograd drives it. Layer-major (:meth:`StreamingExecutor.forward_backward`,
  driven by ``layer_major.py``, for gradient accumulation over M micro-batches): every block is fetched
  once for the M forwards and once for the M backwards of an optimizer step, so it crosses the link
  twice instead of 2·M times. HF still builds each micro-batch's context (a first call of the model,
  the trunk in its ``PRELUDE`` phase, stops after the prelude) and computes its head and loss (a second
  call, ``HEAD``: the trunk returns the streamed hidden states); the blocks in between are driven by
  ``layer_major.py`` through this executor's block forward and backward, micro-batch 0 first in both
  directions, so every LoRA gradient is accumulated in the order of ordinary accumulation -- bitwise
  the same.
* **Without grad, HF's own loop.** A forward without grad (generation, evaluation) is never
  recomputed: the trunk's class ``forward`` runs with each layer a ``StreamingLayer`` proxy
  (fetch, run with HF's arguments, release), so HF's KV cache and whatever the trunk does
  between layers work as in the resident model.
* **CUDA graphs, optionally.** With ``graphs`` (``graphs.py``, ``cuda_graphs=True``), the block
  phases :meth:`StreamingExecutor.forward_backward` drives replay graphs captured once per slot and
  block kind instead of launching each kernel from Python; a block that cannot be replayed runs the
  eager code below, unchanged. Blocks handed a carried mapping replay too: :meth:`carried_access` says,
  from the descriptor, which entries each block reads (static graph inputs) and writes (static outputs).
* **Nothing is family-specific here.** Paths and carried-state kwargs come from the descriptor.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable

import torch
from torch import nn
from torch.utils import _pytree as pytree

from poros.descriptor import ArchitectureDescriptor, resolve_path
from poros.errors import StreamingError
from poros.stream.carried import CarriedAccess, add_reader_grads, recompute_roots
from poros.stream.dequantize_once import DequantizeOnce
from poros.stream.graphs import eager_reason
from poros.stream.dropout import dropout_modules, dropout_p  # noqa: F401 (re-exported)
from poros.stream.block_node import StreamedBlock as _StreamedBlock
from poros.stream.block_node import recording_use as _recording_use
from poros.stream import layer_major
from poros.stream.kept import run_kept
from poros.stream.layer_call import LayerCall
from poros.stream.options import StreamOptions
from poros.stream.placement import warn_states_stay
from poros.stream.recompute_choice import RecomputeChoice
from poros.stream.replay import autocast_state, outside_autocast, replayed_autocast, restored_rng, rng_state
from poros.stream.router_logits import RouterRecorder
from poros.stream.segments import kept as boundary_kept, recompute_inputs, resolve_every, segment_start
from poros.stream.store import BlockStore
from poros.stream.trunk import (STREAMING, CaptureDone, LayerRecorder, Phase, Step, StreamingLayer, TrunkOutput,
                                TrunkState, swapped)


class StreamingExecutor:
    """Runs a causal LM whose decoder blocks live in a :class:`BlockStore`; built whole (no part is set later).

    Args:
        causal_lm: the HF ``*ForCausalLM`` (PEFT's ``base_model.model`` when wrapped).
        descriptor: its family's descriptor.
        store: the block store holding the frozen tensors of ``descriptor.decoder_layers``.
        options: the run's :class:`~poros.stream.options.StreamOptions` as ``prepare`` decided them; the
            executor reads ``boundary_states`` (None: ``"device"``).
        graphs: the block phases' CUDA graphs (``graphs.BlockGraphs``); None: every block runs eagerly
            (CPU, ``cuda_graphs=False``).
        before_forward: called with the trunk's kwargs before each streamed forward (prepare's runtime gates).
        spill_dir: ``boundary_states="disk"``: the directory the state files go under (prepare: the
            cache's ``spill/``; None: ``$TMPDIR``).
        kept_blocks, kept_estimate: ``recompute="auto"``: how many blocks the plan keeps (None: no plan), and
            without one the activation estimate the first step decides with
            (:class:`~poros.stream.recompute_choice.RecomputeChoice`).
        dequantize_once: ``dequantize_once="auto"``: the plan's decision (None: no plan;
            :class:`~poros.stream.dequantize_once.DequantizeOnce`).
    """

    def __init__(self, causal_lm: nn.Module, descriptor: ArchitectureDescriptor, store: BlockStore,
                 options: StreamOptions = StreamOptions(), *, graphs: Any = None,
                 before_forward: Callable[[dict], None] | None = None, spill_dir: Any = None,
                 kept_blocks: int | None = None, kept_estimate: Callable[[torch.Tensor], Any] | None = None,
                 dequantize_once: bool | None = None) -> None:
        self.causal_lm, self.descriptor, self.store, self.options = causal_lm, descriptor, store, options
        self.graphs, self.before_forward = graphs, before_forward
        self.trunk = resolve_path(causal_lm, descriptor.text_model)
        # The trunk class's own forward, bound: HF's code, used to build each forward's context.
        self._trunk_class_forward = type(self.trunk).forward.__get__(self.trunk)
        self.layers = resolve_path(causal_lm, descriptor.decoder_layers)
        parent_path, self._layers_attr = descriptor.decoder_layers.rpartition(".")[::2]
        self._layers_parent = resolve_path(causal_lm, parent_path) if parent_path else causal_lm
        self.final_norm = resolve_path(causal_lm, descriptor.final_norm)
        self.mapping_kwargs = frozenset(c.kwarg for c in descriptor.carried_state if c.kind == "mapping")
        self.contiguous_kwargs = frozenset(descriptor.contiguous_arguments)
        self.routers = RouterRecorder(self.trunk)  # the modules whose logits output_router_logits collects
        self._grad_anchor = torch.zeros((), requires_grad=True)  # makes every block node differentiable
        self._state = STREAMING  # layer-major switches it for one call of the model (see forward_backward)
        self._stash_stream = None  # the host stash's side stream, made once
        self.spill_dir = spill_dir  # boundary_states="disk": where the state files go
        self._use_order: dict[int, list[nn.Parameter]] = {}  # block -> trainable parameters in use order
        self._access: dict[int, dict[str, CarriedAccess]] = {}  # block -> its carried mappings' access, found once
        #: which blocks keep their activations (``options.recompute``; ``poros.stream.recompute_choice``)
        self.recompute = RecomputeChoice(self, options.recompute, kept_blocks, kept_estimate)
        #: layer-major: each block's NF4 weights dequantized once per block phase (``options.dequantize_once``)
        self.dequantize = DequantizeOnce(self, options.dequantize_once, dequantize_once)
        self._said_states_stay = False  # a micro-major step with the states planned off the device: said once

    @property
    def boundary_states(self) -> str:
        """Layer-major: where the M x L boundary states wait for backward, ``"device"``, ``"host"`` (pinned) or
        ``"disk"`` (files under :attr:`spill_dir`)."""
        return self.options.boundary_states or "device"

    @property
    def states_off_device(self) -> bool:
        """Whether the boundary states are to wait on the host or disk: only :meth:`forward_backward` (layer-major)
        moves them there; a micro-major step keeps its kept block inputs on the device (autograd saves them)."""
        return self.boundary_states in ("host", "disk")

    @property
    def boundary_every(self) -> int:
        """k: the input of every k-th block is kept for backward (where :attr:`boundary_states` says); the
        k - 1 between are recomputed from it (``segments.py``). 1: every block's input is kept."""
        return resolve_every(self.options.boundary_every)

    def keeps_input(self, index: int) -> bool:
        """Whether block ``index``'s input is kept for its backward (else recomputed, :meth:`segment_input`)."""
        return boundary_kept(index, self.boundary_every)

    def segment_input(self, step: Step, index: int) -> torch.Tensor:
        """Micro-major: the input of block ``index``, not kept: recomputed with the rest of its segment below
        it the first time backward asks (it asks for the segment's top block first)."""
        if index not in step.recomputed:
            start = segment_start(index, self.boundary_every)
            step.recomputed.update(recompute_inputs(self, [step], start, index, [step.boundaries.pop(start)])[0])
            step.recomputed.pop(start)  # the start block's own node holds it
        return step.recomputed.pop(index)

    # -- installing ----------------------------------------------------------------------------
    @functools.cached_property
    def _layer_proxies(self) -> nn.ModuleList:
        """One :class:`StreamingLayer` per decoder layer, made once (generation runs a forward per token)."""
        return nn.ModuleList(StreamingLayer(self, i) for i in range(len(self.layers)))

    def install(self) -> None:
        """Stream this model in place: the trunk instance's ``forward`` becomes :meth:`trunk_forward`."""
        self.trunk.forward = self.trunk_forward

    def uninstall(self) -> None:
        self.trunk.__dict__.pop("forward", None)

    def forward(self, *args, **kwargs):
        """The causal LM's own forward (HF code), around the streamed trunk."""
        return self.causal_lm(*args, **kwargs)
    __call__ = forward

    # -- the streamed trunk ----------------------------------------------------------------------
    def trunk_forward(self, *args, **kwargs) -> "TrunkOutput":
        state = self._state
        if state.phase is Phase.HEAD:  # layer-major, second call: the blocks already ran
            return TrunkOutput(self.final_norm(state.hidden), state.router_logits)
        if self.before_forward is not None:
            self.before_forward(kwargs)
        if state.phase is Phase.STREAM and not torch.is_grad_enabled():
            return self._trunk_without_grad(*args, **kwargs)
        kwargs["use_cache"] = False  # a differentiable forward keeps no KV cache (training never needs one)
        if state.phase is Phase.PRELUDE:  # layer-major, first call: record, and let CaptureDone unwind the model
            state.asked["router"] = self.routers.wanted(kwargs)
            if state.autocast is not None:  # e.g. accelerate's autocast around the model's forward only
                state.autocast.append(autocast_state(self.store.device))
            self._record(state.calls, *args, **kwargs)
            self._step_of(state.calls)  # returned before the last layer: names what went wrong
        step = self._capture(*args, **kwargs)
        if self.states_off_device and not self._said_states_stay:
            self._said_states_stay = True
            warn_states_stay(self.boundary_states, sum(1 for i in range(len(self.layers)) if self.keeps_input(i)))
        step.router = self.routers.wanted(kwargs)
        hidden = step.calls[0].leaves[0]
        step.kept_blocks = self.recompute.blocks(hidden, 1)
        last = len(self.layers) - 1
        router_logits: list[torch.Tensor] = []
        for index in range(len(self.layers)):
            self._note_mapping_entry(step, index)
            # The last block stays resident: it is the first one backward needs.
            grad_inputs = step.calls[index].grad_tensors()
            parameters = self.block_parameters(index)
            known = self._use_order.get(index)
            with torch.no_grad(), _recording_use(self.layers[index], parameters, known) as used:
                # graphs replay layer-major's phases only (see graphs.py: micro-major's backward runs inside
                # the autograd engine, where a capture failed on the H200; MICRO_MAJOR_SWITCH probes it)
                output = self._run_block(step, index, hidden, grad_inputs, keep=index == last,
                                         graphable=self.graphs is not None and self.graphs.micro_major)
            self._use_order[index] = used
            if self.boundary_every > 1 and self.keeps_input(index):  # the segment's recompute starts from it
                step.boundaries[index] = hidden
            # The block's trainable parameters are inputs of its node, each through a view made in
            # the order the block used them: the engine runs the later-made view first, so their
            # accumulators (and DDP's hooks) fire in reverse use order, as in the resident backward.
            hidden, *logits = _StreamedBlock.apply(self, step, index, used, self._grad_anchor, hidden, output,
                                                   len(grad_inputs), *grad_inputs, *(p.view_as(p) for p in used))
            router_logits.extend(logits)
        return TrunkOutput(self.final_norm(hidden), tuple(router_logits) if step.router else None)

    def _trunk_without_grad(self, *args, **kwargs):
        """A forward without grad (generation, evaluation): HF's own trunk forward, each decoder layer a
        :class:`StreamingLayer` that fetches its block, runs it, releases it.

        Nothing is recomputed later, so there is nothing to capture: HF runs its whole loop, with
        whatever it does between layers (a trunk may slice later layers' inputs to
        ``logits_to_keep``), and the KV cache (``use_cache=True``, as ``generate`` asks) lives on the
        device, written by the layers themselves and returned in HF's own output.
        """
        if kwargs.get("use_cache") is None:
            kwargs["use_cache"] = False  # no cache unless asked for: an evaluation forward keeps none
        # HF's generate moves the inputs to ``model.device``, the first parameter's device: with
        # ``embeddings_on_host`` that is the host-kept table's (CPU), so position ids and masks would
        # reach the rotary and the layers on the host. The layers compute on the store's device.
        device = self.store.device
        args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
        kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        # HF's recorders look for the routers in the module tree, where the proxies stand: record them here
        with swapped(self._layers_parent, self._layers_attr, self._layer_proxies), \
                self.routers.recording(self.layers, self.routers.wanted(kwargs)) as logits:
            output = self._trunk_class_forward(*args, **kwargs)
        if logits:
            output["router_logits"] = tuple(logits)
        return output

    # -- prelude: HF's own code ----------------------------------------------------------------
    def _record(self, raw: list, *args, **kwargs) -> None:
        """HF's trunk forward with recorders for the layers: each layer call goes into ``raw``, and the
        last recorder raises :class:`CaptureDone`."""
        count = len(self.layers)
        recorders = nn.ModuleList(LayerRecorder(raw, last=i == count - 1) for i in range(count))
        with swapped(self._layers_parent, self._layers_attr, recorders):
            self._trunk_class_forward(*args, **kwargs)

    def _capture(self, *args, **kwargs) -> Step:
        raw: list[tuple[tuple, dict]] = []
        with contextlib.suppress(CaptureDone):
            self._record(raw, *args, **kwargs)
        return self._step_of(raw)

    def _step_of(self, raw: list[tuple[tuple, dict]]) -> Step:
        """The per-forward state of HF's recorded layer calls (StreamingError: not one per layer)."""
        count = len(self.layers)
        if len(raw) != count:
            raise StreamingError(
                f"the model's forward called {len(raw)} of its {count} decoder layers; the descriptor's "
                f"decoder_layers path {self.descriptor.decoder_layers!r} must name the list the forward loops over."
            )
        return Step(calls=[LayerCall.from_capture(a, k, self.mapping_kwargs, self.contiguous_kwargs) for a, k in raw])

    # -- one block ---------------------------------------------------------------------------
    def _run_block(self, step: Step, index: int, hidden: torch.Tensor, grad_tensors=(),
                   recompute_later: bool = True, keep: bool = False, graphable: bool = True) -> torch.Tensor:
        """Forward of block ``index`` (no grad inside the autograd node): fetch, run (a graph replay
        where ``self.graphs`` and ``graphable`` allow), release unless ``keep``."""
        self._make_resident(index)
        self._prefetch(index + 1)
        call = step.calls[index]
        if recompute_later:
            step.rng_states[index] = rng_state(hidden.device)
            step.autocast_states[index] = autocast_state(hidden.device)
        mappings = call.mappings()
        before = {(name, key): value for name, m in mappings.items() for key, value in m.items()}
        leaves = call.leaves_with(hidden, grad_tensors)
        output = None
        if self._keeps(step, index, mappings):
            output = self._kept_forward(step, index, hidden, grad_tensors)
        elif self.graphs is not None and (not graphable or step.router or self.dequantize.held is not None):
            self.graphs.note_eager(eager_reason(step.router, self.dequantize.held is not None))
        elif self.graphs is not None:
            output = self.graphs.forward(index, leaves, call.unflatten, self._carried_at(index, call))
        if output is None:
            args, kwargs = call.unflatten(leaves)
            with self.routers.recording(self.layers[index], step.router) as logits:
                output = self.layers[index](*args, **kwargs)
            if step.router:
                step.router_logits[index] = logits
        if not isinstance(output, torch.Tensor):
            raise StreamingError(
                f"decoder layer {index} returned {type(output).__name__}; Poros expects the new hidden states "
                "as a tensor (transformers >= 5 layers do). Adapt the family descriptor or pin transformers."
            )
        written = [(name, key) for name, m in mappings.items() for key, value in m.items()
                   if before.get((name, key)) is not value]
        if written:
            step.written_by[index] = written
        if not keep:
            self.store.release(index)
        return output

    def _keeps(self, step: Step, index: int, mappings: dict) -> bool:
        """Whether block ``index`` keeps its activations: chosen, with nothing carried (mappings, router logits)."""
        return index in step.kept_blocks and not mappings and not step.router

    def _kept_forward(self, step: Step, index: int, hidden: torch.Tensor, grad_tensors) -> torch.Tensor:
        """Block ``index``'s forward with autograd, kept on ``step`` until its backward (:func:`run_kept`)."""
        if self.graphs is not None:
            self.graphs.note_eager("kept activations")
        step.kept[index] = run_kept(self.layers[index], step.calls[index], index, hidden, grad_tensors,
                                    self.store.buffer_of)
        self.recompute.note(tuple(hidden.shape), step.kept[index].saved_bytes)
        return step.kept[index].output.detach()

    def block_parameters(self, index: int) -> list[nn.Parameter]:
        """The trainable parameters of block ``index`` (its adapters), in registration order."""
        return [p for p in self.layers[index].parameters() if p.requires_grad]

    def carried_access(self, index: int) -> dict[str, CarriedAccess]:
        """What block ``index`` reads and writes of each carried mapping (kwarg -> :class:`CarriedAccess`),
        from the descriptor's flags on the layer; found once per block."""
        if index not in self._access:
            self._access[index] = {c.kwarg: CarriedAccess.of(self.layers[index], c)
                                   for c in self.descriptor.carried_state if c.kind == "mapping"}
        return self._access[index]

    def _carried_at(self, index: int, call: LayerCall) -> dict[int, CarriedAccess]:
        """The carried mappings among a call's leaves: leaf position -> the block's access to that mapping."""
        access = self.carried_access(index)
        return {position: access[name] for position, name in call.mapping_at.items()}

    def _backward_block(self, step: Step, index: int, hidden: torch.Tensor, grad_inputs, grad_output,
                        hidden_needs_grad: bool, keep: bool = False, return_parameter_grads: bool = False,
                        router_grads: list | None = None, parameters: list[nn.Parameter] | None = None):
        """Backward of block ``index``: fetch, recompute from its input with grad, back-propagate, release.
        ``router_grads``: the gradients of the block's router logits (``output_router_logits``), one per logits
        tensor or None, more roots of the recompute.

        With ``return_parameter_grads`` the block's parameter gradients are returned (third value), in the order of
        ``parameters`` (None: :meth:`block_parameters`, found now), instead of accumulated into ``.grad`` here (else
        that list is empty): the caller's autograd node hands them to the parameters' own accumulators, so hooks on
        those (DDP's reducer) fire once, from the graph the forward built.
        """
        self._make_resident(index)
        self._prefetch(index - 1)
        call = step.calls[index]
        kept = step.kept.pop(index, None)
        if kept is not None:  # its forward kept the graph: its weights' references now point at its bytes now
            kept.bind_contexts()
            leaf_hidden, leaf_inputs = kept.leaf_hidden, kept.leaf_inputs
            hidden_needs_grad = hidden_needs_grad and leaf_hidden.requires_grad
        else:
            leaf_hidden = hidden.detach().requires_grad_(hidden_needs_grad)
            leaf_inputs = [t.detach().requires_grad_(True) for t in grad_inputs]
        mappings, readers = self._recompute_mappings(step, index, call)
        # what later readers sent back to the entries this block wrote: more output gradients of its recompute
        written_grads = [(name, key, pending) for name, key in step.written_by.get(index, [])
                         if (pending := step.pending.pop((name, key, index), None)) is not None]
        if kept is not None:
            pass  # no recompute, no graph replay: back-propagate the kept graph below
        elif self.graphs is not None and (step.router or self.dequantize.held is not None
                                          or (return_parameter_grads and not self.graphs.micro_major)):
            self.graphs.note_eager(eager_reason(step.router, self.dequantize.held is not None))
        elif self.graphs is not None:
            replayed = self.graphs.backward(
                index, call.leaves_with(hidden, grad_inputs, mappings), call.unflatten, grad_output, hidden_needs_grad,
                call.grad_at, step.autocast_states.get(index), not return_parameter_grads,
                self._carried_at(index, call), written_grads)
            if replayed is not None:
                hidden_grad, input_grads, parameter_grads, read_grads = replayed
                add_reader_grads(step.pending, readers, read_grads)
                if not keep:
                    self.store.release(index)
                return hidden_grad, input_grads, parameter_grads
        if kept is not None:
            output, logits = kept.output, []
        else:
            with torch.enable_grad(), restored_rng(step.rng_states.get(index), hidden.device), \
                    replayed_autocast(step.autocast_states.get(index), hidden.device):
                args, kwargs = call.build(leaf_hidden, leaf_inputs, mappings)
                with self.routers.recording(self.layers[index], step.router) as logits, \
                        self.dequantize.tail.recompute(index, not mappings and not step.router):
                    output = self.layers[index](*args, **kwargs)
        written = [(mappings[name][key], sent) for name, key, sent in written_grads]
        live = recompute_roots(output, grad_output, written + ([(logits, router_grads)] if router_grads else []))
        parameters = (parameters or self.block_parameters(index)) if return_parameter_grads else []
        # autograd.grad captures gradients at these leaves (without their accumulators' hooks);
        # sums inside the block are the engine's either way, so the values are backward's.
        targets = [leaf_hidden] if hidden_needs_grad else []
        targets += [t for t in leaf_inputs]
        targets += [t for leaves in readers.values() for t in leaves
                    if isinstance(t, torch.Tensor) and t.requires_grad]
        targets += parameters
        captured: dict[int, torch.Tensor | None] = {}
        if live and targets and return_parameter_grads:  # micro-major: inside the engine, in its state
            grads = torch.autograd.grad([r for r, _ in live], targets, [g for _, g in live], allow_unused=True)
            captured = {id(t): g for t, g in zip(targets, grads)}
        elif live:
            with outside_autocast(hidden.device):  # layer-major: as HF's loss.backward(), outside autocast
                torch.autograd.backward([r for r, _ in live], [g for _, g in live])
        if not return_parameter_grads:
            captured = {id(t): t.grad for t in targets}
        add_reader_grads(step.pending, readers, captured)
        if not keep:
            self.store.release(index)
        hidden_grad = captured.get(id(leaf_hidden)) if hidden_needs_grad else None
        input_grads = [captured.get(id(t)) for t in leaf_inputs]
        return hidden_grad, input_grads, [captured.get(id(p)) for p in parameters]

    # -- layer-major accumulation (layer_major.py) ---------------------------------------------
    def forward_backward(self, model_call: Callable[..., Any], micro_batches: list[dict], *,
                         own_backward: bool = False) -> list[torch.Tensor]:
        """Forward and backward of M micro-batches, block by block; returns their losses (detached).
        The layer-major schedule: :func:`poros.stream.layer_major.forward_backward` says how it runs."""
        return layer_major.forward_backward(self, model_call, micro_batches, own_backward=own_backward)

    @contextlib.contextmanager
    def _switched(self, state: TrunkState):
        """The trunk in ``state`` for the calls inside (layer-major's prelude and head), streaming again after them."""
        self._state = state
        try:
            yield
        finally:
            self._state = STREAMING

    # -- carried mappings --------------------------------------------------------------------
    def _note_mapping_entry(self, step: Step, index: int) -> None:
        """Record, for block ``index``, which version (writer index, value) of each entry it will see."""
        seen: dict[tuple[str, Any], tuple[int, Any]] = {}
        previous = step.seen_at_entry[-1] if step.seen_at_entry else {}
        for name, mapping in step.calls[index].mappings().items():
            for key, value in mapping.items():
                known = previous.get((name, key))
                if known is not None and known[1] is value:
                    seen[(name, key)] = known
                else:
                    writer = next((i for i in range(index - 1, -1, -1)
                                   if (name, key) in step.written_by.get(i, [])), -1)
                    seen[(name, key)] = (writer, value)
        step.seen_at_entry.append(seen)

    def _recompute_mappings(self, step: Step, index: int, call: LayerCall):
        """Fresh mappings for a recompute: entries written by earlier blocks become grad leaves."""
        mappings, readers = {}, {}
        for name, original in call.mappings().items():
            fresh = type(original)()
            for (entry_name, key), (writer, value) in step.seen_at_entry[index].items():
                if entry_name != name:
                    continue
                if writer < 0:
                    fresh[key] = value
                    continue
                leaves = pytree.tree_map(
                    lambda t: t.detach().requires_grad_(t.is_floating_point()) if isinstance(t, torch.Tensor) else t,
                    value,
                )
                fresh[key] = leaves
                readers[(name, key, writer)] = pytree.tree_leaves(leaves)
            mappings[name] = fresh
        return mappings, readers

    # -- helpers -----------------------------------------------------------------------------
    def _make_resident(self, index: int) -> None:
        """Fetch block ``index`` and order compute after its copy; prefetched blocks give way if no slot is free."""
        if not self.store.is_resident(index) and None not in self.store.slot_owner:
            self.store.release_all()
        self.store.fetch(index)
        self.store.wait(index)

    def _prefetch(self, index: int) -> None:
        """Start bringing block ``index`` in if a slot is free (it is needed next)."""
        if 0 <= index < len(self.layers) and None in self.store.slot_owner:
            self.store.fetch(index)
