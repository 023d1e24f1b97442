"""One run of :meth:`PorosTrainer.train <poros.training.trainer.PorosTrainer.train>`: :class:`TrainingRun` holds
its data, optimizer, schedule, counters and logging, runs the optimizer steps (micro-major, or
layer-major through ``forward_backward``), writes ``metrics.jsonl`` (:data:`METRIC_FIELDS`) and the
checkpoints, stops on SIGINT/SIGTERM with a checkpoint (:class:`~poros.training.stop.StopRequest`) and
returns a :class:`TrainResult`. Evaluation (:mod:`poros.training.evaluation`) runs between steps when the
run has eval data, every row goes to the ``report_to`` trackers (:mod:`poros.training.tracking`), and the
progress bar and user lines are :mod:`poros.training.progress`'s. Data parallel
(:class:`poros.distributed.DataParallel`, inactive on one process): each rank trains its shard of
the global batch, through DDP micro-major, and rank 0 writes the metrics, trackers and
checkpoints. The trainer (poros/training/trainer.py) builds the model and saves the adapter; this module
never imports it."""

from __future__ import annotations

import json
import logging
import os
import pathlib
import time
from typing import TYPE_CHECKING, Any

import torch

from poros.training import checkpoint as checkpoints
from poros import distributed
from poros.data.batches import real_tokens
from poros.training import evaluation
from poros.training import model_card
from poros.training import tracking
from poros.devices import compute_device
from poros.errors import DataError, OutputDirError, TrainingCheckpointError
from poros.training.progress import echo, progress_bar, showing
from poros.training.stop import StopRequest
from poros.training.validation import check_seq_len
from poros.training.results import METRICS_FILE, METRIC_FIELDS, ThroughputWindow, TrainResult, peak_memory

if TYPE_CHECKING:
    from poros.config import PorosConfig

logger = logging.getLogger("poros")


class TrainingRun:
    """The state of one ``train()`` call: data, optimizer, schedule, counters, logging."""

    def __init__(self, trainer: Any, config: PorosConfig, data_source: Any = None):
        self.trainer = trainer
        self.config = config
        self.data_source = config.dataset if data_source is None else data_source
        self.model = trainer.model
        self.device = compute_device(trainer.model)
        self.output_dir = pathlib.Path(config.output_dir)
        self.losses: list[float] = []
        self.pending_losses: list[torch.Tensor] = []  # step losses not yet moved to Python
        self.pending_tokens: torch.Tensor | int = 0  # non-pad tokens seen since the last sync
        self.window_losses: list[float] = []  # losses of the steps since the last log line
        self.log_history: list[dict[str, Any]] = []
        self.num_tokens = 0
        self.global_step = 0
        self.last_checkpoint: pathlib.Path | None = None
        #: batch_size is per device: the ranks draw batch_size x ranks rows together and each trains its share
        self.global_batch = config.batch_size * (distributed.world().size if distributed.reducing() else 1)
        #: ranks, shards, DDP and rank-0 writing (inactive on one process)
        self.parallel = distributed.DataParallel(self.model, self.device, self.global_batch)
        self.eval_set: evaluation.EvalSet | None = None  # set with the data
        self.trackers = tracking.Trackers()  # opened when the loop starts
        self.started, self.tokens_before = time.perf_counter(), 0  # for the summary line: this call's time, tokens

    # -- setup ---------------------------------------------------------------------------------
    def _data(self):
        from poros.data import BatchIterator, load_dataset
        from poros.data.batches import pad_token_id as padding_id

        config, tokenizer = self.config, self.trainer.tokenizer
        check_seq_len(config.seq_len, self.model.config.get_text_config(), config.model)  # also for train(seq_len=)
        if tokenizer is None and not (isinstance(self.data_source, str) and self.data_source == "synthetic"):
            raise DataError(f"the checkpoint {config.model} has no tokenizer files, so only dataset 'synthetic' can "
                            "be trained without one. Fix: copy the base model's tokenizer files next to its "
                            "config.json, or pass a tokenizer: PorosTrainer(model, tokenizer, config)")
        data = load_dataset(self.data_source, tokenizer, seq_len=config.seq_len, split=config.dataset_split,
                            chat_template=config.chat_template, seed=config.seed,
                            vocab_size=self.model.config.vocab_size)
        pad_token_id = padding_id(tokenizer, self.model.config)
        data, self.eval_set = evaluation.eval_set_for_run(config, data, tokenizer, pad_token_id=pad_token_id,
                                                          vocab_size=self.model.config.vocab_size)
        if config.packing:
            data = self._packed(data)
        self.pad_token_id = pad_token_id
        self.trainer.eval_set = self.eval_set
        batches = BatchIterator(data, batch_size=self.global_batch, pad_token_id=pad_token_id, seed=config.seed,
                                shuffle=True, pad_to_multiple_of=config.pad_to_multiple_of)
        steps, note = config.steps_for_epochs(batches.batches_per_epoch)  # epochs: the steps of that many passes
        if note is not None:
            echo(f"poros: {note}")
        self.config = self.trainer.run_config = config.replace(steps=steps)
        return data, batches

    def _packed(self, data):
        """The training examples packed into rows of up to ``seq_len`` tokens (``packing: true``)."""
        from poros.data.packing import pack_examples

        reason = self.model.descriptor.packing_unsupported
        if reason:
            raise DataError(f"packing: true cannot train {self.model.descriptor.display_name}: {reason}. Fix: set "
                            "packing: false (one example per row)")
        packed = pack_examples(data, self.config.seq_len)
        echo(f"poros: packing: {data.num_examples:,} examples into {packed.num_examples:,} rows of up to "
             f"{self.config.seq_len:,} tokens ({100 * packed.total_tokens / (packed.num_examples * self.config.seq_len):.1f}% full)")
        return packed

    def _optimizer(self):
        import transformers

        from poros.stream import host_optimizer, optimizer_states

        config = self.config
        plan = self.model.budget_plan
        states = optimizer_states.resolve(config.optimizer_states, plan.optimizer_states if plan else None)
        if self.model.lora_placement is not None and config.optimizer_states == "auto":
            states = "host"  # the LoRA tensors on the host: HostAdamW brings them in to step
        optimizer = host_optimizer.adamw(self.model.trainable_parameters(), optimizer_states=states, lr=config.lr,
                                         weight_decay=config.weight_decay, placement=self.model.lora_placement)
        scheduler = transformers.get_scheduler(config.schedule, optimizer, num_warmup_steps=config.warmup,
                                               num_training_steps=config.steps)
        return optimizer, scheduler

    def _checkpoint_to_resume(self) -> checkpoints.TrainingCheckpoint | None:
        resume_from = self.config.resume_from
        if resume_from is None:
            return None
        if resume_from == "auto":
            path = checkpoints.latest_checkpoint(self.output_dir)
            if path is None:
                echo(f"poros: resume_from='auto': no complete checkpoint in {self.output_dir}, starting fresh")
                return None
        else:
            path = pathlib.Path(resume_from)
        checkpoint = checkpoints.read_checkpoint(path)
        checkpoints.check_resumable(checkpoint, self.config.to_dict())
        return checkpoint

    def _resume(self, checkpoint: checkpoints.TrainingCheckpoint, optimizer, scheduler, batches) -> None:
        from poros.stream.host_optimizer import HostAdamW

        self.trainer._restore_adapter(checkpoint.adapter_state_dict(device=self.device), checkpoint.path)
        try:
            on_host = isinstance(optimizer, HostAdamW)  # its state goes to host memory, not via the device
            optimizer.load_state_dict(checkpoint.optimizer_state_dict(device="cpu" if on_host else self.device))
            scheduler.load_state_dict(checkpoint.scheduler_state_dict())
        except (ValueError, KeyError) as error:
            raise TrainingCheckpointError(
                f"the optimizer or scheduler state in {checkpoint.path} does not fit this run: {error}; expected "
                "the same adapters and optimizer. Resume with the settings the checkpoint was trained with."
            ) from error
        batches.load_state_dict(checkpoint.data_state)
        state = checkpoint.trainer_state
        self.global_step = checkpoint.step
        self.losses = [float(loss) for loss in state.get("losses", [])]
        self.num_tokens = self.tokens_before = int(state.get("num_tokens", 0))
        self.log_history = list(state.get("log_history", []))
        # the logging window in progress at the checkpoint (a resume between two logging steps): its
        # first row must average the same steps as the uninterrupted run's
        last_logged = next((row["step"] for row in reversed(self.log_history) if "loss" in row), 0)
        self.window_losses = self.losses[last_logged:]
        checkpoints.restore_rng_state(checkpoint.rng_state())
        echo(f"poros: resumed from {checkpoint.path} at step {checkpoint.step}/{self.config.steps}")

    # -- the loop ------------------------------------------------------------------------------
    def execute(self) -> TrainResult:
        """Set the run up (resumed or fresh), train to ``config.steps`` or a stop signal, and say how it ended."""
        optimizer, scheduler, batches = self._prepare()
        interrupted = self._train(optimizer, scheduler, batches)
        return self._finish(interrupted)

    def _prepare(self):
        """Everything before the first step: the checkpoint to resume (refused before any work when it does not
        fit), the data, optimizer and schedule, then the resumed state or a fresh start, and the data summaries;
        ``(optimizer, scheduler, batches)``."""
        config = self.config
        parallel = self.parallel
        if parallel.is_main:
            checkpoints.remove_partial_saves(self.output_dir)
        parallel.barrier()
        checkpoint = self._checkpoint_to_resume()  # refuses a mismatched checkpoint before any work
        if checkpoint is not None:
            parallel.check_resume(checkpoint.trainer_state, checkpoint.path)
        data, batches = self._data()
        config = self.config  # with the steps epochs make
        optimizer, scheduler = self._optimizer()
        self.trainer.optimizer, self.trainer.scheduler = optimizer, scheduler
        if checkpoint is not None:
            self._resume(checkpoint, optimizer, scheduler, batches)
        else:
            self._start_fresh()
        self.trainer.global_step = self.global_step
        if parallel.is_main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            self._rewrite_metrics()
        echo(data.summary())
        if parallel.active:
            echo(parallel.describe(self.global_batch, config.grad_accum))
        if self.eval_set is not None:
            echo(self.eval_set.summary())
        return optimizer, scheduler, batches

    def _start_fresh(self) -> None:
        """No checkpoint to resume: refuse another run's results in ``output_dir`` (``overwrite``: remove them),
        then seed."""
        from poros.training.run_lock import check_fresh_start

        config = self.config
        # never a mix of two runs' results: every rank refuses alike, only rank 0 removes (overwrite)
        if self.parallel.is_main or not config.overwrite:
            check_fresh_start(self.output_dir, overwrite=config.overwrite)
        self.parallel.barrier()
        seed_everything(config.seed)

    def _runs_layer_major(self) -> bool:
        """Whether the steps run layer-major (through ``forward_backward``): on the layer-major schedule (see
        :func:`stream_schedule`) when it saves anything — gradient accumulation, LoRA tensors on the host
        (always through ``forward_backward``), CUDA graphs (replayed layer-major only), boundary states off
        the device (``boundary_states`` host or disk: only layer-major moves them there, so a micro-major step
        of one micro-batch would keep them all on the device, beyond what the plan priced). Says when a
        dropout turns gradient accumulation micro-major."""
        config = self.config
        executor = self.model.executor
        placement = self.model.lora_placement  # LoRA tensors on the host: always through forward_backward
        graphs = getattr(executor, "graphs", None) is not None  # CUDA graphs replay layer-major only
        layer_major = ((config.grad_accum > 1 or placement is not None or graphs or executor.states_off_device)
                       and stream_schedule(config, self.model) == "layer-major")
        if config.grad_accum > 1 and config.stream_schedule == "layer-major" and not layer_major:
            echo("poros: dropout is active, so gradient accumulation runs micro-major (layer-major would "
                  "draw the dropout masks in another order); set lora_dropout 0 for layer-major")
        return layer_major

    def _train(self, optimizer, scheduler, batches) -> bool:
        """The optimizer steps up to ``config.steps``, each followed by what is due after it (a log line, an
        evaluation, a checkpoint); True when a stop signal ended them early, after a checkpoint."""
        config = self.config
        parallel = self.parallel
        parameters = self.model.trainable_parameters()
        self.model.train()
        layer_major = self._runs_layer_major()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)  # peak_memory_gb: this run's training peak
        bar = progress_bar(config.steps, self.global_step, label="train")  # data parallel: silent off rank 0
        window = ThroughputWindow(time.perf_counter(), self.num_tokens, self._bytes_copied())
        # report_to (logs the config); data parallel: rank 0's
        trackers = tracking.open_trackers(config, self.output_dir) if parallel.is_main else tracking.Trackers()
        with StopRequest() as stop, showing(bar), trackers:
            self.trackers = trackers
            while self.global_step < config.steps:
                learning_rate, grad_norm = self._step(optimizer, scheduler, batches, parameters, layer_major)
                if bar is not None:
                    bar.update(1)

                if self.global_step % config.logging_steps == 0:
                    window = self._log_window(window, learning_rate, grad_norm, bar)
                last_step = self.global_step == config.steps
                if self.eval_set is not None and evaluation.evaluation_due(config, self.global_step):
                    window.leave_out(*self._evaluate())  # not counted in the training throughput
                # a signal on any rank stops every rank after the same step
                if parallel.any_rank(stop.signal_name is not None, self.device) and not last_step:
                    stop.signal_name = stop.signal_name or "SIGINT"  # (it arrived on another rank)
                    self._save_checkpoint(optimizer, scheduler, batches)
                    self._announce_interrupt(stop.signal_name)
                    return True
                if config.save_steps and (self.global_step % config.save_steps == 0 or last_step):
                    self._save_checkpoint(optimizer, scheduler, batches)
        return False

    def _step(self, optimizer, scheduler, batches, parameters, layer_major: bool) -> tuple[float, torch.Tensor]:
        """One optimizer step over ``grad_accum`` micro-batches of this rank's shard of the next batch;
        ``(the learning rate it used, the gradients' norm)``."""
        micro_batches = [{key: value.to(self.device, non_blocking=True)
                          for key, value in self.parallel.shard(batches.next_batch()).items()}
                         for _ in range(self.config.grad_accum)]
        step_loss = self._step_loss(micro_batches, layer_major)
        grad_norm = self._grad_norm(parameters)
        learning_rate = optimizer.param_groups[0]["lr"]  # the rate this step uses
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        self.global_step += 1
        self.trainer.global_step = self.global_step
        self.pending_losses.append(step_loss)
        self.pending_tokens = self.pending_tokens + sum(real_tokens(batch, self.pad_token_id) for batch in micro_batches)
        return learning_rate, grad_norm

    def _step_loss(self, micro_batches: list[dict[str, torch.Tensor]], layer_major: bool) -> torch.Tensor:
        """Forward and backward over the micro-batches, the gradients accumulating; the step's loss (their sum)."""
        num_items_in_batch = sum((batch["labels"][..., 1:] != -100).sum() for batch in micro_batches)
        step_loss = 0
        if layer_major:  # each block crosses the link twice per step, not twice per micro-batch
            for loss in self.model.forward_backward(
                    [{**batch, "num_items_in_batch": num_items_in_batch} for batch in micro_batches]):
                step_loss = step_loss + loss
        else:
            for index, batch in enumerate(micro_batches):
                model, sync = self.parallel.forward_model(index, len(micro_batches))  # DDP (no_sync) or not
                with sync:
                    loss = model(**batch, num_items_in_batch=num_items_in_batch, use_cache=False).loss
                    loss.backward()
                step_loss = step_loss + loss.detach()
        return step_loss

    def _grad_norm(self, parameters) -> torch.Tensor:
        """The gradients' total norm, after clipping them to ``max_grad_norm`` when it is set."""
        from poros.stream import lora_placement

        config = self.config
        if self.model.lora_placement is not None:  # gradients on the host: norms on the device, as resident
            return (lora_placement.grad_norm(parameters, self.device) if config.max_grad_norm is None
                    else lora_placement.clip_grad_norm_(parameters, config.max_grad_norm, self.device))
        if config.max_grad_norm is None:
            return torch.nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None])
        return torch.nn.utils.clip_grad_norm_(parameters, config.max_grad_norm)

    def _bytes_copied(self) -> int:
        """Host-to-device bytes the block store has copied so far (0 without one)."""
        return self.model.store.stats.bytes_copied if self.model.store is not None else 0

    def _log_window(self, window: ThroughputWindow, learning_rate: float, grad_norm: torch.Tensor,
                    bar) -> ThroughputWindow:
        """The log line of the steps since the last one, their throughput measured over ``window``; the window
        that starts now."""
        self._sync()
        bytes_copied = self._bytes_copied()
        elapsed = max(time.perf_counter() - window.started, 1e-9)
        self._log(learning_rate, grad_norm, self.num_tokens - window.first_tokens, elapsed,
                  bytes_copied - window.first_bytes, bar)
        return ThroughputWindow(time.perf_counter(), self.num_tokens, bytes_copied)

    def _finish(self, interrupted: bool) -> TrainResult:
        """The last losses synced, how the run ended said (and what CUDA graphs replayed); the result."""
        self._sync()
        final = self.losses[-1] if self.losses else None
        if not interrupted:  # the final loss as the log lines show it: the last window's mean
            echo(model_card.summary_line(
                steps=self.global_step, losses=self.losses, log_history=self.log_history,
                logging_steps=self.config.logging_steps, tokens=self.num_tokens - self.tokens_before,
                seconds=time.perf_counter() - self.started))
        graphs = getattr(getattr(self.model, "executor", None), "graphs", None)
        if graphs is not None:  # cuda_graphs: what was replayed, what ran eagerly and why
            echo(f"poros: {graphs.report.summary()}")
        eval_loss = next((row["eval_loss"] for row in reversed(self.log_history) if "eval_loss" in row), None)
        return TrainResult(self.global_step, list(self.losses), final, interrupted, self.output_dir,
                           self.last_checkpoint, list(self.log_history), eval_loss)

    # -- logging -------------------------------------------------------------------------------
    def _sync(self) -> None:
        """Move the step losses and token counts kept as tensors since the last sync to Python numbers."""
        pending = self.pending_losses
        if pending and self.parallel.active:  # the log shows the mean over ranks
            pending = list(self.parallel.mean(torch.stack([torch.as_tensor(x) for x in pending])))
        synced = [float(loss) for loss in pending]
        self.pending_losses.clear()
        self.losses.extend(synced)
        self.window_losses.extend(synced)
        self.num_tokens += self.parallel.total(self.pending_tokens, self.device)
        self.pending_tokens = 0

    def _log(self, learning_rate: float, grad_norm: torch.Tensor, window_tokens: int, elapsed: float,
             window_bytes: int, bar) -> None:
        window, self.window_losses = self.window_losses, []
        peak, peak_kind = peak_memory(self.device)
        row = {
            "step": self.global_step,
            "loss": sum(window) / len(window),
            "learning_rate": float(learning_rate),
            "grad_norm": float(grad_norm),
            "tokens_per_second": window_tokens / elapsed,
            "num_tokens": self.num_tokens,
            "peak_memory_gb": peak,
            "peak_memory_kind": peak_kind,
            "h2d_gb_per_s": window_bytes / elapsed / 1e9,
        }
        self._record(row)
        peak_text = f"{peak:.2f} GB ({peak_kind})" if peak is not None else "n/a"
        echo(f"step {row['step']}/{self.config.steps} | loss {row['loss']:.4f} | lr {row['learning_rate']:.3e} | "
              f"grad_norm {row['grad_norm']:.4f} | {row['tokens_per_second']:.0f} tok/s | peak {peak_text} | "
              f"h2d {row['h2d_gb_per_s']:.2f} GB/s")
        if bar is not None:
            bar.set_postfix(loss=f"{row['loss']:.4f}")

    def _record(self, row: dict[str, Any]) -> None:
        """A row of ``log_history``, ``metrics.jsonl`` and the trackers (data parallel: written by rank 0)."""
        if self.parallel.active:
            row["world_size"] = self.parallel.world.size
        self.log_history.append(row)
        if self.parallel.is_main:
            with open(self.output_dir / METRICS_FILE, "a", encoding="utf-8") as handle:
                handle.write(json.dumps(row) + "\n")
        self.trackers.log(row)

    def _evaluate(self) -> tuple[float, int]:
        """Evaluate, log the row; the seconds and host-to-device bytes it took."""
        store = self.model.store
        copied_before = store.stats.bytes_copied if store is not None else 0
        result = evaluation.evaluate(self.model, self.eval_set.batches, device=self.device,
                                     max_batches=self.config.eval_batches)
        row = result.row(self.global_step)
        self._record(row)
        echo(f"eval step {row['step']}/{self.config.steps} | eval_loss {row['eval_loss']:.4f} | perplexity "
             f"{row['eval_perplexity']:.2f} | {row['eval_batches']} batches, {row['eval_num_tokens']:,} tokens | "
             f"{row['eval_runtime']:.1f} s")
        return result.runtime, (store.stats.bytes_copied if store is not None else 0) - copied_before

    def _rewrite_metrics(self) -> None:
        """``metrics.jsonl`` = this run's log history so far (empty on a fresh run)."""
        lines = "".join(json.dumps(row) + "\n" for row in self.log_history)
        temporary = self.output_dir / f".{METRICS_FILE}.tmp-{os.getpid()}"
        temporary.write_text(lines, encoding="utf-8")
        os.replace(temporary, self.output_dir / METRICS_FILE)

    # -- checkpoints -----------------------------------------------------------------------------
    def _save_checkpoint(self, optimizer, scheduler, batches) -> None:
        self._sync()
        config = self.config
        trainer_state = {
            "global_step": self.global_step,
            "max_steps": config.steps,
            "logging_steps": config.logging_steps,
            "save_steps": config.save_steps,
            "train_batch_size": config.batch_size,
            "grad_accum": config.grad_accum,
            "num_tokens": self.num_tokens,
            "world_size": self.parallel.world.size,
            "losses": self.losses,
            "log_history": self.log_history,
        }
        if self.parallel.is_main:  # data parallel: rank 0 writes; the others wait for it
            try:
                self.last_checkpoint = checkpoints.write_checkpoint(
                    self.output_dir, self.global_step, write_adapter=self.trainer._write_adapter, optimizer=optimizer,
                    scheduler=scheduler, trainer_state=trainer_state, data_state=batches.state_dict(),
                    poros_config=self.trainer._poros_config_record(), save_total_limit=config.save_total_limit,
                )
            except OutputDirError as error:  # a full disk: say what is left and the command that truly resumes
                raise checkpoints.failed_save(error, self.output_dir, self.global_step, keep_adapter=self.trainer.save,
                                              resume_command=lambda path: self.trainer.resume_commands(path)[0]
                                              ) from error
            logger.info("poros: wrote %s", self.last_checkpoint)
        else:
            self.last_checkpoint = self.output_dir / f"{checkpoints.CHECKPOINT_PREFIX}{self.global_step}"
        self.parallel.barrier()

    def _announce_interrupt(self, signal_name: str) -> None:
        command, python = self.trainer.resume_commands(self.last_checkpoint)
        echo(f"poros: {signal_name} received: stopped after step {self.global_step}/{self.config.steps} and saved "
              f"{self.last_checkpoint}\n"
              f"poros: resume with\n    {command}\n"
              f"poros: or in Python\n    {python}")


def stream_schedule(config, model) -> str:
    """The schedule a run uses: the configured one, micro-major when the model has a dropout."""
    from poros.stream.executor import dropout_modules

    if config.stream_schedule == "layer-major" and dropout_modules(model):
        return "micro-major"
    return config.stream_schedule


def seed_everything(seed: int) -> None:
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # seeds CUDA too


__all__ = ["METRICS_FILE", "METRIC_FIELDS", "TrainResult", "TrainingRun", "peak_memory", "seed_everything",
           "stream_schedule"]
