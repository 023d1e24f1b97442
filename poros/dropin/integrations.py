"""One line for trainers that build the PEFT model themselves: :func:`prepare_trainer` and :class:`PorosCallback`.

TRL's ``SFTTrainer(model, peft_config=...)`` (and scripts built on it: ``trl/scripts/sft.py``,
PEFT's ``examples/sft/train.py``) wraps the model with PEFT inside its constructor, so no
user-held PEFT model exists before the trainer does. Either line streams the trainer's own model
in place -- the object the trainer holds stays the one it built (:func:`poros.prepare` returns the
model it is given), so nothing inside the trainer has to be re-pointed::

    trainer = SFTTrainer(model=model, args=args, train_dataset=data, peft_config=lora)
    poros.prepare_trainer(trainer)                     # after construction, before train()

    trainer = SFTTrainer(..., peft_config=lora, callbacks=[poros.PorosCallback()])   # or: at init end

Either prints one line on stderr when the model streams (:mod:`poros.dropin.banner`: family, blocks
streamed, guarantee label), as the Trainer prints its own banner. Both refuse
``TrainingArguments(torch_compile=True)`` with :class:`~poros.errors.TorchCompileError`.
Importing this module imports transformers; ``import poros`` does not.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from poros.errors import TorchCompileError
from poros.dropin.model import COMPILE_WORKAROUND, PorosModel, prepare

__all__ = ["PorosCallback", "prepare_trainer"]


def _check_args(args: Any) -> None:
    if getattr(args, "torch_compile", False):
        raise TorchCompileError(
            "TrainingArguments(torch_compile=True): the trainer would torch.compile the streamed model when training "
            f"starts, and compiled graphs capture each decoder block's tensors. {COMPILE_WORKAROUND}"
        )


def prepare_trainer(trainer: Any, **options: Any) -> PorosModel:
    """Stream ``trainer.model`` in place (an HF ``Trainer`` or TRL ``SFTTrainer``, after construction).

    Args:
        trainer: the trainer, before ``train()``/``evaluate()``.
        **options: passed to :func:`poros.prepare` (``num_slots``, ``require``, ``vram_budget``...).

    Returns:
        ``trainer.model`` itself, streamed (a :class:`~poros.dropin.model.PorosModel`); a model already
        prepared is returned as it is.

    Raises:
        TorchCompileError: ``trainer.args.torch_compile`` is on.
        PorosError: any gate of :func:`poros.prepare`.
    """
    _check_args(trainer.args)
    if isinstance(trainer.model, PorosModel):
        return trainer.model
    return prepare(trainer.model, **options)


class PorosCallback(TrainerCallback):
    """A ``TrainerCallback`` that streams the trainer's model when the trainer is built (``on_init_end``,
    after TRL applied ``peft_config``), or at the latest when training starts.

    Args:
        **options: passed to :func:`poros.prepare`.

    Raises (from the trainer's constructor):
        TorchCompileError: ``args.torch_compile`` is on.
    """

    def __init__(self, **options: Any) -> None:
        self.options = options
        self.model: PorosModel | None = None

    def _prepare(self, args, model) -> None:
        _check_args(args)
        if model is None or isinstance(model, PorosModel):
            return
        self.model = prepare(model, **self.options)

    def on_init_end(self, args, state, control, model=None, **kwargs):
        self._prepare(args, model)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._prepare(args, model)
