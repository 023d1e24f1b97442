"""Each gradient-accumulation window of an HF ``Trainer`` (or TRL ``SFTTrainer``) as one layer-major
:meth:`~poros.dropin.model.PorosModel.forward_backward`: every streamed block fetched once per direction per
optimizer step instead of once per micro-batch, the Trainer's own code computing every loss.

How the Trainer is driven (transformers 5.x ``_inner_training_loop``): it takes a window's micro-batches
with ``get_batch_samples`` (one list, with ``num_items_in_batch`` counted over all of them), then calls
``training_step(model, inputs, num_items_in_batch)`` once per micro-batch, and after each adds
``floating_point_ops(inputs)`` to its flops count. :func:`install` wraps the three on the trainer instance:

* ``get_batch_samples``: the Trainer's own, its window noted.
* ``training_step``: its first call of a window runs the whole window through ``forward_backward``, each
  micro-batch's step being the trainer's own ``training_step`` (``_prepare_inputs``, ``compute_loss`` with
  TRL's metrics, the loss scaling for accumulation, ``accelerator.backward``); it returns micro-batch 0's
  loss, and the window's later calls return their micro-batches' losses, already computed. Gradients, losses,
  metrics and every saved file are the plain run's bits (``docs/prepare.md``). The step's ``model.train()``
  walks the module tree once a window (:mod:`poros.dropin.train_mode`), not twice a micro-batch.
* ``floating_point_ops``: the Trainer's own, with the model's ``num_parameters`` walked once per window
  (:mod:`poros.dropin.parameter_counts`; the walk is done while the device finishes the window): the same
  ``total_flos``, without a ~20 ms walk of idle device time after every micro-batch.

``forward_backward`` calls the step twice per micro-batch (the first call stops at the trunk, where HF built
the layers' context), so the step must do nothing before its model call that a second call would repeat.
That holds for the Trainer's and ``SFTTrainer``'s own methods; where it cannot be shown -- or layer-major is
not the same computation -- the driver leaves every window to the Trainer (micro-major, bitwise as before)
and says why once (:func:`fallback_reason`). A window of one micro-batch runs micro-major as well: there is
nothing to share -- unless the boundary states are to wait off the device (``boundary_states`` host or disk),
which only ``forward_backward`` does: a micro-major step keeps them on the device.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from dataclasses import dataclass, field
from typing import Any

import transformers

from poros.dropin import parameter_counts
from poros.dropin.train_mode import once_per_window
from poros.stream.compute_stream import step_stream
from poros.stream.dropout import dropout_modules, dropout_p

logger = logging.getLogger("poros")

#: the Trainer methods a window's step runs twice per micro-batch; only these classes' own are known to allow it
CHECKED_METHODS = ("training_step", "compute_loss", "_prepare_inputs", "_prepare_input", "compute_loss_context_manager",
                   "autocast_smart_context_manager", "_prepare_context_parallel_inputs")


def _known_classes() -> tuple[type, ...]:
    known: list[type] = [transformers.Trainer]
    try:
        import trl

        known += [trl.SFTTrainer, *[c for c in trl.SFTTrainer.__mro__ if c.__module__.startswith("trl.")]]
    except ImportError:  # TRL is optional
        pass
    return tuple(known)


def _owner(cls: type, name: str) -> type | None:
    return next((c for c in cls.__mro__ if name in c.__dict__), None)


def _set_on_instance(trainer: Any, name: str) -> bool:
    """Whether ``trainer.name`` is a function set on the instance (the driver's own wrappers see through to
    what they wrap)."""
    value = vars(trainer).get(name)
    if isinstance(getattr(value, "__self__", None), WindowDriver):
        value = getattr(value.__self__, name).on_instance
    if value is None:
        return False
    return getattr(value, "__func__", None) is not getattr(type(trainer), name, None)


def fallback_reason(trainer: Any) -> str | None:
    """Why ``trainer``'s accumulation windows cannot run layer-major (None: they can)."""
    from poros.dropin.model import PorosModel

    model, args, accelerator = trainer.model, trainer.args, trainer.accelerator
    if not isinstance(model, PorosModel):
        return "the trainer's model is not streamed"
    known = _known_classes()
    for name in CHECKED_METHODS:
        if _set_on_instance(trainer, name):
            return (f"trainer.{name} is set on the instance (a custom step or loss: Poros cannot prove it safe to "
                    "run twice per micro-batch, as layer-major accumulation does)")
        owner = _owner(type(trainer), name)
        if owner is not None and owner not in known:
            return (f"{owner.__qualname__}.{name} overrides the Trainer's (a custom step or loss: Poros cannot prove "
                    "it safe to run twice per micro-batch, as layer-major accumulation does)")
        module = (getattr(owner.__dict__[name], "__module__", None) or "") if owner is not None else "transformers."
        if not module.startswith(("transformers.", "trl.")):  # e.g. a library's monkeypatch of Trainer.compute_loss
            return (f"{owner.__qualname__}.{name} is patched (by {module or 'unknown code'}): Poros cannot prove it "
                    "safe to run twice per micro-batch")
    active = dropout_modules(model)
    if active:
        return (f"dropout is active ({active[0]} p={dropout_p(model.get_submodule(active[0]))}"
                f"{f' and {len(active) - 1} more' if len(active) > 1 else ''}): its random draws would come in "
                "another order than in the Trainer's accumulation; set lora_dropout=0 for layer-major")
    if accelerator.num_processes > 1 or getattr(args, "n_gpu", 1) > 1:
        return f"data parallel ({max(accelerator.num_processes, args.n_gpu)} processes or GPUs)"
    if str(accelerator.distributed_type).rsplit(".", 1)[-1] not in ("NO",):
        return f"distributed type {accelerator.distributed_type}"
    parallelism = getattr(accelerator, "parallelism_config", None)
    if parallelism is not None and (getattr(parallelism, "cp_enabled", False) or getattr(parallelism, "sp_enabled", False)):
        return "context or sequence parallelism"
    if str(getattr(args, "optim", "")).rsplit(".", 1)[-1].lower() in ("lomo", "adalomo"):
        return "a LOMO optimizer (it updates the weights inside each backward)"
    if getattr(args, "activation_offloading", False):
        return "activation_offloading (TRL's offload hooks around each micro-batch's step)"
    for callback in trainer.callback_handler.callbacks:
        if _owner(type(callback), "on_substep_end") is not transformers.TrainerCallback:
            return (f"callback {type(callback).__name__}.on_substep_end runs between micro-batches (it would see "
                    "the whole window's gradients)")
    return None


@dataclass
class _Window:
    batches: list
    num_items: Any
    losses: list | None = None
    next: int = 0
    counts: dict = field(default_factory=dict)  # the model's num_parameters answers, one walk for the window


class WindowDriver:
    """Installed on one trainer by :func:`install`; ``reason`` says why it leaves the windows to the Trainer
    (None until the first window of several micro-batches, then decided once)."""

    def __init__(self, trainer: Any) -> None:
        # The trainer holds this driver's bound methods; the driver holds the trainer weakly and calls its own
        # methods through it, so that, as without the line, ``del trainer`` frees the trainer and its optimizer
        # state at once (a cycle would wait for Python's collector, the device memory with it).
        self._trainer = weakref.ref(trainer)
        self.get_batch_samples = _Own(trainer, "get_batch_samples")
        self.training_step = _Own(trainer, "training_step")
        self.floating_point_ops = _Own(trainer, "floating_point_ops")
        self.window: _Window | None = None
        self.counted: _Window | None = None  # the window whose micro-batches the Trainer's flops count is for
        self.reason: str | None = None
        self.decided = False
        self.windows_run = 0  # windows run layer-major

    @property
    def trainer(self) -> Any:
        return self._trainer()

    def batch_samples(self, epoch_iterator, num_batches, device):
        batches, num_items = self.get_batch_samples(epoch_iterator, num_batches, device)
        self.window = self.counted = _Window(list(batches), num_items)
        return batches, num_items

    def flops(self, inputs):
        """The trainer's ``floating_point_ops``: for a micro-batch of the current window, with the model's
        ``num_parameters`` answered from one walk per window (``poros.dropin.parameter_counts``: the same count,
        without the idle device time of a walk after every micro-batch)."""
        window, model = self.counted, self.trainer.model
        if window is None or not any(inputs is batch for batch in window.batches) or "_count_memo" not in vars(model):
            return self.floating_point_ops(inputs)
        with parameter_counts.memoized(model, window.counts):
            return self.floating_point_ops(inputs)

    def step(self, model, inputs, num_items_in_batch=None, *args, **kwargs):
        """The trainer's ``training_step``: the window's first call runs the window; a call that is not the
        window's next micro-batch (or a window of one, or a trainer that falls back) is the Trainer's own."""
        window = self.window
        ours = not args and not kwargs and window is not None and window.next < len(window.batches) \
            and inputs is window.batches[window.next] and num_items_in_batch is window.num_items
        if not ours or (len(window.batches) < 2 and not self._states_off_device()) or not self._layer_major():
            with self._step_stream():  # micro-major: the Trainer's own step, off the legacy stream with graphs
                return self.training_step(model, inputs, num_items_in_batch, *args, **kwargs)
        if window.next == 0:
            window.losses = self._run(window)
        loss = window.losses[window.next]
        window.next += 1
        if window.next == len(window.batches):
            self.window = None
        return loss

    def _step_stream(self):
        executor = getattr(self.trainer.model, "executor", None)
        if executor is None:
            return contextlib.nullcontext()
        return step_stream(executor.store.device, executor.graphs is not None)

    def _states_off_device(self) -> bool:
        """A window of one micro-batch still runs layer-major when the boundary states are to wait off the
        device: only ``forward_backward`` puts them there (the Trainer's own step keeps them on the device)."""
        executor = getattr(self.trainer.model, "executor", None)
        return executor is not None and executor.states_off_device

    def _layer_major(self) -> bool:
        if not self.decided:
            self.decided, self.reason = True, fallback_reason(self.trainer)
            if self.reason is not None:
                logger.warning("poros: gradient accumulation runs micro-major (each streamed block fetched once per "
                               "micro-batch and direction), not layer-major: %s", self.reason)
        return self.reason is None

    def _run(self, window: _Window) -> list:
        model = self.trainer.model  # what each micro-batch's step is given, and what runs the window

        def micro_step(inputs):
            return self.training_step(model, inputs, window.num_items)

        self.windows_run += 1
        with once_per_window(model):  # the step's ``model.train()``: one walk a window, not two a micro-batch
            losses = model.forward_backward([{"inputs": batch} for batch in window.batches], sync_gradients=False,
                                            train_step=micro_step)
        if "_count_memo" in vars(model):  # the Trainer's flops count asks this next; walk while the device works
            with parameter_counts.memoized(model, window.counts):
                model.num_parameters(exclude_embeddings=True)
        return losses


class _Own:
    """A trainer's own ``name`` method, as it was before :func:`install`, called on the trainer through a weak
    reference: a function set on the instance (kept as it is), else its class's."""

    def __init__(self, trainer: Any, name: str) -> None:
        self.trainer, self.name = weakref.ref(trainer), name
        self.on_instance = vars(trainer).get(name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.on_instance is not None:
            return self.on_instance(*args, **kwargs)
        trainer = self.trainer()
        if trainer is None:  # a wrapped method kept after its trainer was freed
            raise ReferenceError(f"the trainer whose {self.name} this is has been deleted")
        return getattr(type(trainer), self.name)(trainer, *args, **kwargs)


def install(trainer: Any) -> WindowDriver | None:
    """Wrap ``trainer.get_batch_samples``, ``trainer.training_step`` and ``trainer.floating_point_ops`` (on the
    instance) with a :class:`WindowDriver`; once per trainer (a second call returns the first driver). None, and
    nothing changed, for an object without those three methods (not a transformers 5 ``Trainer``)."""
    driver = getattr(trainer, "_poros_window", None)
    if isinstance(driver, WindowDriver):
        return driver
    if not all(callable(getattr(trainer, name, None))
               for name in ("get_batch_samples", "training_step", "floating_point_ops")):
        return None
    driver = WindowDriver(trainer)
    trainer._poros_window = driver
    trainer.get_batch_samples = driver.batch_samples
    trainer.training_step = driver.step
    trainer.floating_point_ops = driver.flops
    return driver


__all__ = ["WindowDriver", "fallback_reason", "install"]
