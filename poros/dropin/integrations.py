"""One line for trainers that build the PEFT model themselves: :func:`prepare_trainer` and :class:`PorosCallback`.

TRL's ``SFTTrainer(model, peft_config=...)`` (and scripts built on it: ``trl/scripts/sft.py``,
PEFT's ``examples/sft/train.py``) wraps the model with PEFT inside its constructor, so no
user-held PEFT model exists before the trainer does. Either line streams the trainer's own model
in place -- the object the trainer holds stays the one it built (:func:`poros.prepare` returns the
model it is given), so nothing inside the trainer has to be re-pointed::

    trainer = SFTTrainer(model=model, args=args, train_dataset=data, peft_config=lora)
    poros.prepare_trainer(trainer)                     # after construction, before train()

    trainer = SFTTrainer(..., peft_config=lora, callbacks=[poros.PorosCallback()])   # or: at init end

Either line also makes each gradient-accumulation window of the trainer one layer-major
``forward_backward`` (:mod:`poros.dropin.trainer_window`): each streamed block is fetched once per direction
per optimizer step instead of once per micro-batch, the Trainer's own code computing every loss, bitwise the
plain run. Where that cannot be shown safe (dropout active, a custom ``compute_loss``...), the windows stay
micro-major and one warning says why.

Either prints one line on stderr when the model streams (:mod:`poros.dropin.banner`: family, blocks
streamed, guarantee label), as the Trainer prints its own banner. Both refuse
``TrainingArguments(torch_compile=True)`` with :class:`~poros.errors.TorchCompileError`.
Importing this module imports transformers; ``import poros`` does not.
"""

from __future__ import annotations

import inspect
from typing import Any

from transformers import Trainer, TrainerCallback

from poros.errors import TorchCompileError
from poros.dropin import trainer_window
from poros.dropin.model import COMPILE_WORKAROUND, PorosModel, prepare

__all__ = ["PorosCallback", "prepare_trainer"]


def _check_args(args: Any) -> None:
    if getattr(args, "torch_compile", False):
        raise TorchCompileError(
            "TrainingArguments(torch_compile=True): the trainer would torch.compile the streamed model when training "
            f"starts, and compiled graphs capture each decoder block's tensors. {COMPILE_WORKAROUND}"
        )


def _apply_trainer_liger(args: Any, model: Any) -> None:
    """``args.use_liger_kernel``: apply Liger to ``model`` now, with the trainer's own ``liger_kernel_config``
    (TRL's turns the fused cross-entropy off), the call the Trainer makes when ``train()`` starts -- so Poros
    streams, plans and labels the model the Trainer will train (the Trainer's second call rebinds the same
    functions). Nothing for a model already streamed."""
    if getattr(args, "use_liger_kernel", False) and model is not None and not isinstance(model, PorosModel):
        from poros.dropin.kernels import apply_liger

        apply_liger(model, getattr(args, "liger_kernel_config", None))


def _trainer_options(args: Any, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with ``kernels="liger"`` when the trainer asks for Liger (so the banner names a family Liger
    leaves unpatched), unless the caller chose ``kernels`` itself."""
    if getattr(args, "use_liger_kernel", False):
        return {"kernels": "liger", **options}
    return options


def prepare_trainer(trainer: Any, **options: Any) -> PorosModel:
    """Stream ``trainer.model`` in place (an HF ``Trainer`` or TRL ``SFTTrainer``, after construction), and
    run each of its gradient-accumulation windows layer-major (:func:`poros.dropin.trainer_window.install`).

    Args:
        trainer: the trainer, before ``train()``/``evaluate()``.
        **options: passed to :func:`poros.prepare` (``num_slots``, ``require``, ``vram_budget``...).

    Returns:
        ``trainer.model`` itself, streamed (a :class:`~poros.dropin.model.PorosModel`); a model already
        prepared is returned as it is.

    With ``args.use_liger_kernel`` (HF ``TrainingArguments`` / TRL ``SFTConfig``) Liger's kernels are applied to
    the model first, with ``args.liger_kernel_config``, as the Trainer applies them when ``train()`` starts
    (:mod:`poros.dropin.kernels`): the streamed blocks run Liger's modules, and Liger's fused linear
    cross-entropy, where the config keeps it, replaces ``loss_chunks``.

    Raises:
        TorchCompileError: ``trainer.args.torch_compile`` is on.
        MissingDependencyError: ``use_liger_kernel`` without liger-kernel installed.
        PorosError: any gate of :func:`poros.prepare`.
    """
    _check_args(trainer.args)
    _apply_trainer_liger(trainer.args, trainer.model)
    model = trainer.model if isinstance(trainer.model, PorosModel) else prepare(
        trainer.model, **_trainer_options(trainer.args, options))
    trainer_window.install(trainer)
    return model


class PorosCallback(TrainerCallback):
    """A ``TrainerCallback`` that streams the trainer's model when the trainer is built (``on_init_end``,
    after TRL applied ``peft_config``), or at the latest when training starts, and runs the trainer's
    gradient-accumulation windows layer-major as :func:`prepare_trainer` does (it finds its trainer as the
    trainer calls it: the caller whose ``callback_handler`` holds this callback). With ``use_liger_kernel`` it
    streams when training starts, once the Trainer has applied Liger's kernels with its final
    ``liger_kernel_config`` (TRL sets its own after the constructor's ``on_init_end``).

    Args:
        **options: passed to :func:`poros.prepare`.

    Raises (from the trainer's constructor):
        TorchCompileError: ``args.torch_compile`` is on.
    """

    def __init__(self, **options: Any) -> None:
        self.options = options
        self.model: PorosModel | None = None

    def _prepare(self, args, model, *, starting: bool = False) -> bool:
        """Stream ``model`` (once) and drive the calling trainer's windows; False: no trainer found. With
        ``use_liger_kernel`` only when training starts (``starting``): the Trainer has applied Liger then, with
        the final ``liger_kernel_config`` (TRL sets its own after ``on_init_end``)."""
        _check_args(args)
        if getattr(args, "use_liger_kernel", False) and not starting:
            return True
        if model is not None and not isinstance(model, PorosModel):
            self.model = prepare(model, **_trainer_options(args, self.options))
        trainer = self._trainer()
        return trainer is not None and trainer_window.install(trainer) is not None

    def _trainer(self) -> Any:
        """The trainer calling this callback: a caller's ``self`` whose callback handler holds it."""
        frame = inspect.currentframe()
        try:
            while frame is not None:
                candidate = frame.f_locals.get("self")
                handler = getattr(candidate, "callback_handler", None)
                if isinstance(candidate, Trainer) and self in getattr(handler, "callbacks", ()):
                    return candidate
                frame = frame.f_back
            return None
        finally:
            del frame

    def on_init_end(self, args, state, control, model=None, **kwargs):
        self._prepare(args, model)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if not self._prepare(args, model, starting=True):
            trainer_window.logger.warning(
                "poros: gradient accumulation runs micro-major, not layer-major: PorosCallback found no "
                "transformers Trainer calling it (use poros.prepare_trainer(trainer) instead)")
