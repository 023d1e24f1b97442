"""Evaluation: the loss of held-out data, computed by the very model that trains.

::

    train_data, eval_set = eval_set_for_run(config, data, tokenizer, pad_token_id=0)  # eval_split / eval_dataset
    result = evaluate(model, eval_set.batches, device=device)     # no grad, streamed like training
    print(result.loss, result.perplexity)

Notable choices:

* **One number per evaluation, the loss of every eval token.** The eval set is treated like one
  big accumulation step: ``n`` = the tokens with loss in all its batches, each batch's loss is
  ``model(**batch, num_items_in_batch=n).loss`` (its summed token losses / ``n``), and
  ``eval_loss`` is their sum, so padding and batch boundaries do not weight it;
  ``eval_perplexity = exp(eval_loss)``. A resident PEFT model given the same batches gets the
  same bits.
* **The training run does not notice.** The pass runs under ``torch.no_grad`` through the same
  :class:`~poros.dropin.model.PorosModel` (the streamed no-grad path of the executor), in eval mode,
  inside ``torch.random.fork_rng``; every module's train/eval flag is put back afterwards. Nothing
  that training reads (adapters, optimizer, data order, RNG) is touched: a run with evaluation is
  bit for bit the run without.
* **Eval mode, but not for bitsandbytes' 4-bit linears.** ``model.eval()`` turns dropout off, as HF
  ``Trainer`` does, but bitsandbytes' ``Linear4bit`` in eval mode repacks its weight in place on
  CPUs with AVX512-BF16 (another kernel, and a weight the block store did not write), so those
  modules run in training mode, whatever mode the model was in; on CUDA both modes compute alike.
* **Held out deterministically.** ``eval_split`` removes ``round(eval_split * n)`` examples (at
  least one) chosen by ``torch.randperm(n, generator=torch.Generator().manual_seed(seed))``:
  the same examples for the same data and seed, never trained on, without touching the global
  RNG. The batches are the eval examples in dataset order, ``batch_size`` at a time, the last one
  possibly smaller (:func:`poros.data.batches.collate`).
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

from poros.data import load_dataset
from poros.data.batches import collate, pad_token_id
from poros.data.tokenize import IGNORE_INDEX, TokenizedData
from poros.devices import compute_device
from poros.errors import ConfigError, DataError
from poros.training.progress import progress_bar, showing

__all__ = ["EVAL_METRIC_FIELDS", "EvalResult", "EvalSet", "eval_set_for_run", "eval_set_of", "evaluate",
           "evaluate_trainer", "evaluation_due", "evaluation_mode", "hold_out", "load_eval_data"]

#: Every eval row of ``metrics.jsonl`` (and of ``TrainResult.log_history``) has these keys.
EVAL_METRIC_FIELDS = ("step", "eval_loss", "eval_perplexity", "eval_num_tokens", "eval_batches", "eval_runtime")


@dataclass
class EvalSet:
    """The eval batches of a run (CPU tensors, in order) and where they came from.

    Attributes:
        batches: dicts of ``input_ids``, ``attention_mask``, ``labels`` (see :func:`~poros.data.batches.collate`).
        num_examples: examples in the eval set (all of them, before ``eval_batches`` limits a pass).
        source: for the user, e.g. ``"40 examples held out of poros-tiny-chat (eval_split 0.1)"``.
    """

    batches: list[dict[str, torch.Tensor]]
    num_examples: int
    source: str

    def summary(self) -> str:
        return f"eval: {self.source}, {len(self.batches):,} batches"


@dataclass
class EvalResult:
    """One evaluation: ``loss`` (float32 sum of the batch losses, see the module notes) and its context."""

    loss: float
    num_tokens: int
    num_batches: int
    runtime: float

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss) if self.loss < 700 else math.inf

    def row(self, step: int) -> dict[str, Any]:
        """The ``metrics.jsonl`` row (keys :data:`EVAL_METRIC_FIELDS`)."""
        return {"step": step, "eval_loss": self.loss, "eval_perplexity": self.perplexity,
                "eval_num_tokens": self.num_tokens, "eval_batches": self.num_batches, "eval_runtime": self.runtime}


def hold_out(data: TokenizedData, fraction: float, seed: int) -> tuple[TokenizedData, TokenizedData]:
    """``(train, held_out)``: ``round(fraction * n)`` examples (at least one) held out, both in dataset order.

    Raises:
        DataError: the dataset is too small to keep an example on each side.
    """
    count = len(data.examples)
    held = max(1, round(fraction * count))
    if held >= count:
        raise DataError(f"eval_split={fraction} of {count} examples leaves none to train on; expected at least one "
                        "example on each side. Fix: lower eval_split, add data, or pass an eval_dataset")
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed)).tolist()
    held_indices = set(order[:held])
    train = [example for index, example in enumerate(data.examples) if index not in held_indices]
    evaluation = [example for index, example in enumerate(data.examples) if index in held_indices]
    # dropped/truncated counts are the whole dataset's: which examples they were is not recorded
    return (TokenizedData(train, data.format, data.num_dropped, data.num_truncated),
            TokenizedData(evaluation, data.format))


def eval_set_for_run(config: Any, data: TokenizedData, tokenizer: Any, *, pad_token_id: int,
                     vocab_size: int | None = None) -> tuple[TokenizedData, EvalSet | None]:
    """The training data and the eval set of a run: ``eval_split`` of ``data``, or ``eval_dataset``, or none.

    Args:
        config: the run's :class:`~poros.config.PorosConfig` (``eval_split``, ``eval_dataset``,
            ``eval_dataset_split``, ``seq_len``, ``chat_template``, ``batch_size``, ``seed``).
        data: the tokenized training dataset.
        tokenizer: the model's tokenizer (None: only ``"synthetic"`` eval data).
        pad_token_id: see :func:`poros.data.batches.pad_token_id`.
        vocab_size: the vocabulary of ``"synthetic"`` data without a tokenizer.

    Raises:
        DataError: from :func:`hold_out` or :func:`poros.data.load_dataset`.
    """
    if config.eval_split > 0:
        data, held = hold_out(data, config.eval_split, config.seed)
        source = f"{held.num_examples:,} examples held out of {config.dataset} (eval_split {config.eval_split})"
    elif config.eval_dataset is not None:
        held = load_eval_data(config.eval_dataset, config, tokenizer, vocab_size)
        source = f"{held.num_examples:,} examples of {config.eval_dataset}"
    else:
        return data, None
    return data, eval_set_of(held, batch_size=config.batch_size, pad_token_id=pad_token_id, source=source)


def load_eval_data(source: Any, config: Any, tokenizer: Any, vocab_size: int | None) -> TokenizedData:
    """``source`` tokenized as the run's training data is (``seq_len``, ``chat_template``), split ``eval_dataset_split``."""
    return load_dataset(source, tokenizer, seq_len=config.seq_len, split=config.eval_dataset_split,
                        chat_template=config.chat_template, seed=config.seed, vocab_size=vocab_size)


def eval_set_of(data: TokenizedData, *, batch_size: int, pad_token_id: int, source: str) -> EvalSet:
    """``data``'s examples in order, ``batch_size`` at a time (the last batch may be smaller)."""
    batches = [collate(data.examples[start:start + batch_size], pad_token_id)
               for start in range(0, len(data.examples), batch_size)]
    return EvalSet(batches, data.num_examples, source)


def evaluate_trainer(trainer: Any, dataset: Any = None, *, max_batches: int | None = None) -> dict[str, Any]:
    """:meth:`PorosTrainer.evaluate <poros.training.trainer.PorosTrainer.evaluate>`: one evaluation, outside ``train()``.

    Args:
        trainer: a :class:`~poros.training.trainer.PorosTrainer`; its ``run_config`` gives ``seq_len``,
            ``chat_template``, ``batch_size``, ``eval_dataset`` and ``eval_batches``.
        dataset: what to evaluate (anything :func:`poros.data.load_dataset` takes); None: the eval set
            of the trainer's last ``train()``, else ``eval_dataset``.
        max_batches: at most this many batches; None: ``eval_batches`` of the config.

    Returns:
        The eval row, ``step`` being the trainer's ``global_step``.

    Raises:
        ConfigError: no dataset, no previous eval set and no ``eval_dataset``.
    """
    config, model = trainer.run_config, trainer.model
    eval_set = trainer.eval_set
    if dataset is not None or eval_set is None:
        if dataset is None and config.eval_dataset is None:
            raise ConfigError("evaluate() found no eval data: no dataset was passed, the last train() had none and "
                              "eval_dataset is null. Pass one: trainer.evaluate('data/val.jsonl'), or train with "
                              "eval_split or eval_dataset first")
        data = load_eval_data(dataset if dataset is not None else config.eval_dataset, config, trainer.tokenizer,
                              model.config.vocab_size)
        eval_set = eval_set_of(data, batch_size=config.batch_size, source=f"{data.num_examples:,} examples",
                               pad_token_id=pad_token_id(trainer.tokenizer, model.config))
    result = evaluate(model, eval_set.batches, device=compute_device(model),
                      max_batches=max_batches if max_batches is not None else config.eval_batches)
    return result.row(trainer.global_step)


def evaluation_due(config: Any, step: int) -> bool:
    """Whether a run evaluates after optimizer step ``step``: every ``eval_steps`` and at the last step."""
    return step == config.steps or (config.eval_steps > 0 and step % config.eval_steps == 0)


@contextlib.contextmanager
def evaluation_mode(model: nn.Module) -> Iterator[None]:
    """``model.eval()``, but bitsandbytes' ``Linear4bit`` in training mode (see the module notes); every flag
    restored after."""
    flags = [(module, module.training) for module in model.modules()]
    try:
        for module, _ in flags:
            module.training = _is_bnb_4bit(module)
        yield
    finally:
        for module, training in flags:
            module.training = training


def _is_bnb_4bit(module: nn.Module) -> bool:
    return type(module).__module__.startswith("bitsandbytes") and type(module).__name__ in ("Linear4bit",
                                                                                             "LinearNF4", "LinearFP4")


def evaluate(model: nn.Module, batches: list[dict[str, torch.Tensor]], *, device: torch.device | str,
             max_batches: int | None = None, show_progress: bool = True) -> EvalResult:
    """The eval loss of ``batches`` (the first ``max_batches`` of them) under ``model``.

    Args:
        model: a :class:`~poros.dropin.model.PorosModel` (or any HF causal LM taking ``num_items_in_batch``).
        batches: CPU or device tensors; moved to ``device`` one batch at a time.
        show_progress: a progress bar (a plain line now and then when stdout is not a terminal).

    Raises:
        DataError: no batch, or no token with a label.
    """
    device = torch.device(device)
    batches = batches[:max_batches] if max_batches is not None else batches
    num_items = sum(int((batch["labels"][..., 1:] != IGNORE_INDEX).sum()) for batch in batches)
    if not batches or num_items == 0:
        raise DataError(f"the eval set has {len(batches)} batches and {num_items} tokens with a label; expected at "
                        "least one of each. Fix: point eval_dataset at data with assistant turns, or raise eval_split")
    started = time.perf_counter()
    bar = progress_bar(len(batches), unit="batch", label="eval", nested=True) if show_progress else None
    devices = [device] if device.type == "cuda" else []
    total = torch.zeros((), dtype=torch.float32, device=device)
    with torch.no_grad(), evaluation_mode(model), torch.random.fork_rng(devices=devices), \
            (showing(bar) if bar is not None else contextlib.nullcontext()):
        n = torch.tensor(num_items, device=device)
        for batch in batches:
            inputs = {key: value.to(device, non_blocking=True) for key, value in batch.items()}
            total = total + model(**inputs, num_items_in_batch=n, use_cache=False).loss.float()
            if bar is not None:
                bar.update(1)
        loss = float(total)
    return EvalResult(loss, num_items, len(batches), time.perf_counter() - started)
