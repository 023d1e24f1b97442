"""Training checkpoints: ``checkpoint-{step}/`` directories in the HF layout, written atomically.

::

    output_dir/
      metrics.jsonl
      checkpoint-50/                 complete: every file of REQUIRED_FILES is there
        adapter_model.safetensors    PEFT's own save (keys base_model.model.<module path>.lora_A.weight)
        adapter_config.json
        optimizer.pt                 optimizer.state_dict()
        scheduler.pt                 scheduler.state_dict()
        rng_state.pth                python, numpy, torch CPU (+ CUDA) generator states
        trainer_state.json           global_step, max_steps, losses, log_history, num_tokens, ...
        data_state.json              the BatchIterator's position
        poros_config.json            the run's PorosConfig, poros version, family, guarantee label
      .checkpoint-100.tmp-<pid>-<hex>/   a save in progress (or killed): never looks like a checkpoint

Notable choices:

* **Atomic.** A checkpoint is written into a hidden temporary directory next to its final name,
  flushed to disk, and renamed into place in one ``rename``: a kill at any moment leaves either
  the complete ``checkpoint-{step}`` or nothing under that name, and the previous checkpoints
  untouched. Rotation renames a checkpoint away before deleting it, for the same reason.
  :func:`~poros.training.atomic.atomic_directory` is the one helper; ``PorosTrainer.save`` uses it too.
* **Complete means every file.** :func:`list_checkpoints` ignores a ``checkpoint-*`` directory
  that lacks a required file (e.g. a partial copy), so ``resume_from="auto"`` never picks one.
* **Resuming refuses a different run.** :func:`check_resumable` compares the fields of the
  configuration that change the math and names every one that differs, with the fix.
* **Torch-free at import.** torch is imported inside the functions that save or load tensors.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from poros.errors import OutputDirError, PorosError, TrainingCheckpointError
from poros.training.atomic import (  # atomic_directory, write_error ...: re-exported, their home before the split
    WRITE_FIXES,
    atomic_directory,
    error_found,
    plain_file_mode,
    remove_directory,
    remove_partial_saves,
    write_error,
    write_json,
)

logger = logging.getLogger("poros")

CHECKPOINT_PREFIX = "checkpoint-"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
RNG_STATE_FILE = "rng_state.pth"
TRAINER_STATE_FILE = "trainer_state.json"
DATA_STATE_FILE = "data_state.json"
POROS_CONFIG_FILE = "poros_config.json"
REQUIRED_FILES = (ADAPTER_WEIGHTS_FILE, ADAPTER_CONFIG_FILE, OPTIMIZER_FILE, SCHEDULER_FILE, RNG_STATE_FILE,
                  TRAINER_STATE_FILE, DATA_STATE_FILE, POROS_CONFIG_FILE)

#: PorosConfig fields whose value changes what a training step computes. A checkpoint written
#: with one value cannot continue a run with another (``steps`` is checked apart: see
#: :data:`STEP_INDEPENDENT_SCHEDULES`).
MATH_FIELDS = (
    "model", "revision", "quantization", "double_quant", "compute_dtype", "attn_implementation",
    "lora_rank", "lora_alpha", "lora_dropout", "target_modules", "use_rslora", "use_dora",
    "dataset", "dataset_split", "eval_split", "chat_template", "seq_len", "batch_size", "grad_accum",
    "lr", "schedule", "warmup", "weight_decay", "max_grad_norm", "seed", "loss_chunks", "mlp_chunks",
)
#: Schedules whose learning rate at a step does not depend on the total number of steps: a run
#: resumed with more (or fewer) ``steps`` continues the same curve.
STEP_INDEPENDENT_SCHEDULES = ("constant", "constant_with_warmup")

_CHECKPOINT_NAME = re.compile(rf"^{CHECKPOINT_PREFIX}(\d+)$")


def failed_save(error: OutputDirError, output_dir: str | os.PathLike, step: int, *,
                keep_adapter: Callable[[pathlib.Path], Any], resume_command: Callable[[pathlib.Path], str]
                ) -> OutputDirError:
    """The error for a checkpoint save that failed at ``step`` (a full disk...), saying honestly what is left.

    With a complete checkpoint in ``output_dir`` the message names it, the steps after it that are
    lost, and ``resume_command(checkpoint)`` -- the command that continues from it. With none, the
    steps are lost and there is nothing to resume; the adapter of ``step`` is then kept if it still
    fits (``keep_adapter(output_dir)``: PorosTrainer.save, a few MB where the checkpoint also holds
    optimizer state), and the message says whether it was.
    """
    output_dir = pathlib.Path(output_dir)
    cause = error.__cause__ if isinstance(error.__cause__, OSError) else None
    found = error_found(cause) if cause is not None else str(error)
    space = WRITE_FIXES.get(cause.errno if cause is not None else None, "check the disk and the path")
    latest = latest_checkpoint(output_dir)
    head = f"could not write {output_dir / f'{CHECKPOINT_PREFIX}{step}'} at step {step}: {found}"
    if latest is not None:
        done = checkpoint_step(latest)
        lost = f"step {step} is" if done + 1 == step else f"steps {done + 1}-{step} are"
        return OutputDirError(
            f"{head}; nothing was replaced: earlier saves are intact, the newest is {latest.name} and {lost} "
            f"lost. Fix: {space}, then resume from it with: {resume_command(latest)}")
    try:
        keep_adapter(output_dir)
        kept = (f"the adapter of step {step} was saved to {output_dir} (PEFT loads it; it cannot resume: the "
                "optimizer state did not fit)")
        again = "train again with the same command and --overwrite"
    except (PorosError, OSError) as second:
        kept = f"the adapter could not be kept either ({type(second).__name__})"
        again = "run the same command again"
    return OutputDirError(
        f"{head}; no checkpoint was written before it, so there is nothing to resume and the {step} steps' "
        f"optimizer state is lost; {kept}. Fix: {space}, then {again} (it starts from step 0; a smaller "
        "save_steps keeps more of a run).")


# ---------------------------------------------------------------------------------------------
# Finding checkpoints
# ---------------------------------------------------------------------------------------------
def checkpoint_step(path: str | os.PathLike) -> int | None:
    """The step of a ``checkpoint-{step}`` directory name, or None for any other name."""
    match = _CHECKPOINT_NAME.match(pathlib.Path(path).name)
    return int(match.group(1)) if match else None


def missing_files(path: str | os.PathLike) -> list[str]:
    """The files of :data:`REQUIRED_FILES` that ``path`` lacks (all of them when it is no directory)."""
    path = pathlib.Path(path)
    return [name for name in REQUIRED_FILES if not (path / name).is_file()]


def list_checkpoints(output_dir: str | os.PathLike) -> list[pathlib.Path]:
    """Complete ``checkpoint-{step}`` directories in ``output_dir``, oldest step first."""
    output_dir = pathlib.Path(output_dir)
    if not output_dir.is_dir():
        return []
    found = []
    for path in output_dir.iterdir():
        step = checkpoint_step(path)
        if step is None or not path.is_dir():
            continue
        missing = missing_files(path)
        if missing:
            logger.warning("poros: ignoring incomplete checkpoint %s (missing %s)", path, ", ".join(missing))
            continue
        found.append((step, path))
    return [path for _, path in sorted(found)]


def latest_checkpoint(output_dir: str | os.PathLike) -> pathlib.Path | None:
    """The complete checkpoint with the highest step in ``output_dir``, or None."""
    checkpoints = list_checkpoints(output_dir)
    return checkpoints[-1] if checkpoints else None


def rotate_checkpoints(output_dir: str | os.PathLike, keep: int | None,
                       newest: str | os.PathLike | None = None) -> list[pathlib.Path]:
    """Delete all but the ``keep`` newest complete checkpoints; returns the deleted paths.

    Args:
        keep: how many to keep (>= 1); None keeps all.
        newest: the checkpoint just written. Checkpoints with a higher step (left in ``output_dir``
            by another run) are not this run's: they are neither counted nor deleted, so the one
            just written is never the one that goes.
    """
    if keep is None:
        return []
    checkpoints = list_checkpoints(output_dir)
    if newest is not None:
        limit = checkpoint_step(pathlib.Path(newest))
        checkpoints = [path for path in checkpoints if checkpoint_step(path) <= limit]
    doomed = checkpoints[:max(len(checkpoints) - max(keep, 1), 0)]
    for path in doomed:
        remove_directory(path)
        logger.info("poros: deleted %s (save_total_limit=%d)", path, keep)
    return doomed


# ---------------------------------------------------------------------------------------------
# Random number generators
# ---------------------------------------------------------------------------------------------
def capture_rng_state() -> dict[str, Any]:
    """Python, numpy, torch CPU and (when initialized) CUDA generator states, loadable with weights_only."""
    import random

    import numpy as np
    import torch

    kind, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "position": int(position),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
        "cpu": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.random.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Set every generator :func:`capture_rng_state` captured."""
    import random

    import numpy as np
    import torch

    random.setstate(state["python"])
    numpy = state["numpy"]
    np.random.set_state((numpy["kind"], numpy["keys"].numpy().astype(np.uint32), numpy["position"],
                         numpy["has_gauss"], numpy["cached_gaussian"]))
    torch.random.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.random.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------
def write_checkpoint(
    output_dir: str | os.PathLike,
    step: int,
    *,
    write_adapter: Callable[[pathlib.Path], None],
    optimizer,
    scheduler,
    trainer_state: dict[str, Any],
    data_state: dict[str, Any],
    poros_config: dict[str, Any],
    save_total_limit: int | None = None,
) -> pathlib.Path:
    """Write ``output_dir/checkpoint-{step}`` atomically, then keep the ``save_total_limit`` newest.

    Args:
        write_adapter: writes the adapter files (``adapter_model.safetensors``,
            ``adapter_config.json``) into the directory it is given.
        optimizer, scheduler: saved with their ``state_dict()``.
        trainer_state: counters and history, written as ``trainer_state.json``.
        data_state: the batch iterator's ``state_dict()``, written as ``data_state.json``.
        poros_config: written as ``poros_config.json``.
        save_total_limit: complete checkpoints to keep, newest first; None keeps all.

    Returns:
        The checkpoint directory.
    """
    import torch

    path = pathlib.Path(output_dir) / f"{CHECKPOINT_PREFIX}{step}"
    with atomic_directory(path) as directory:
        write_adapter(directory)
        torch.save(optimizer.state_dict(), directory / OPTIMIZER_FILE)
        torch.save(scheduler.state_dict(), directory / SCHEDULER_FILE)
        torch.save(capture_rng_state(), directory / RNG_STATE_FILE)
        write_json(directory / TRAINER_STATE_FILE, trainer_state)
        write_json(directory / DATA_STATE_FILE, data_state)
        write_json(directory / POROS_CONFIG_FILE, poros_config)
        missing = missing_files(directory)
        if missing:
            raise TrainingCheckpointError(
                f"checkpoint {path} would lack {', '.join(missing)} (the adapter writer did not write them); "
                "expected every file of poros.training.checkpoint.REQUIRED_FILES. This is a bug in the caller of "
                "write_checkpoint."
            )
    rotate_checkpoints(output_dir, save_total_limit, newest=path)
    return path


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------
@dataclass
class TrainingCheckpoint:
    """A complete checkpoint directory, its JSON files read; tensors are loaded on demand.

    Attributes:
        path: the ``checkpoint-{step}`` directory.
        step: ``trainer_state["global_step"]``.
        trainer_state, data_state, poros_config: the parsed JSON files.
    """

    path: pathlib.Path
    step: int
    trainer_state: dict[str, Any]
    data_state: dict[str, Any]
    poros_config: dict[str, Any]

    def adapter_state_dict(self, device=None) -> dict[str, Any]:
        """The adapter tensors, keyed as PEFT saves them."""
        from safetensors.torch import load_file

        path = self.path / ADAPTER_WEIGHTS_FILE
        try:
            return load_file(path, device=str(device or "cpu"))
        except Exception as error:  # SafetensorError on a truncated file, OSError...: say which file
            raise unreadable(path, error) from error

    def optimizer_state_dict(self, device=None) -> dict[str, Any]:
        return _load_tensors(self.path / OPTIMIZER_FILE, device)

    def scheduler_state_dict(self) -> dict[str, Any]:
        return _load_tensors(self.path / SCHEDULER_FILE, "cpu")

    def rng_state(self) -> dict[str, Any]:
        return _load_tensors(self.path / RNG_STATE_FILE, "cpu")


def _load_tensors(path: pathlib.Path, device) -> Any:
    import torch

    try:
        return torch.load(path, map_location=device or "cpu", weights_only=True)
    except Exception as error:  # a truncated or foreign file: say which one
        raise unreadable(path, error) from error


def unreadable(path: pathlib.Path, error: BaseException) -> TrainingCheckpointError:
    """The error for a checkpoint file that exists but cannot be read (truncated, foreign)."""
    detail = str(error).splitlines()[0] if str(error) else ""
    return TrainingCheckpointError(
        f"cannot read {path}: {type(error).__name__}: {detail}; expected a file written by Poros's "
        "write_checkpoint (this one is truncated or foreign). Fix: resume from another checkpoint "
        "(--resume_from <path>), or start fresh with --overwrite."
    )


def check_intact(path: pathlib.Path) -> None:
    """Cheap structural check of a tensor file, without reading its tensors: a ``.safetensors`` header whose
    offsets end where the file ends, a ``torch.save`` zip whose central directory (at its end) opens.

    Raises:
        TrainingCheckpointError: the file is truncated or is not that format (named, with the fix).
    """
    import struct
    import zipfile

    try:
        if path.suffix == ".safetensors":
            with path.open("rb") as handle:
                (header_size,) = struct.unpack("<Q", handle.read(8))
                header = json.loads(handle.read(header_size))
            ends = [entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"]
            expected = 8 + header_size + max(ends, default=0)
            if path.stat().st_size != expected:
                raise ValueError(f"the file has {path.stat().st_size} bytes, its header describes {expected}")
        else:
            with zipfile.ZipFile(path):
                pass
    except Exception as error:  # struct.error, ValueError, BadZipFile, KeyError...: all mean damaged
        raise unreadable(path, error) from None


def read_checkpoint(path: str | os.PathLike) -> TrainingCheckpoint:
    """Open a checkpoint directory and read its JSON files.

    Raises:
        TrainingCheckpointError: ``path`` is not a directory, lacks a required file, holds a
            truncated tensor file (:func:`check_intact`) or a JSON file that cannot be parsed; the
            message names what is missing and the checkpoints that do exist beside it.
    """
    path = pathlib.Path(path)
    if not path.is_dir():
        siblings = [p.name for p in list_checkpoints(path.parent)] if path.parent.is_dir() else []
        raise TrainingCheckpointError(
            f"no checkpoint directory at {path}; expected a checkpoint-{{step}} directory written during training "
            f"(complete ones beside it: {', '.join(siblings) or 'none'}). Pass one of those, or "
            "resume_from='auto' to take the newest in output_dir."
        )
    missing = missing_files(path)
    if missing:
        raise TrainingCheckpointError(
            f"checkpoint {path} is incomplete: it lacks {', '.join(missing)} (a checkpoint has "
            f"{', '.join(REQUIRED_FILES)}). It was not written by a finished save; resume from an earlier "
            "checkpoint, or resume_from='auto', which skips incomplete ones."
        )
    for name in (ADAPTER_WEIGHTS_FILE, OPTIMIZER_FILE, SCHEDULER_FILE, RNG_STATE_FILE):
        check_intact(path / name)
    parsed = {}
    for name in (TRAINER_STATE_FILE, DATA_STATE_FILE, POROS_CONFIG_FILE, ADAPTER_CONFIG_FILE):
        try:
            parsed[name] = json.loads((path / name).read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise TrainingCheckpointError(
                f"cannot parse {path / name}: {error}; expected the JSON Poros wrote. Fix: resume from another "
                "checkpoint (--resume_from <path>), or start fresh with --overwrite."
            ) from error
    state = parsed[TRAINER_STATE_FILE]
    return TrainingCheckpoint(path, int(state.get("global_step", checkpoint_step(path) or 0)), state,
                              parsed[DATA_STATE_FILE], parsed[POROS_CONFIG_FILE])


def _normalized(value: Any) -> Any:
    return json.loads(json.dumps(value))  # tuples become lists, as in the JSON file


def check_resumable(checkpoint: TrainingCheckpoint, config: dict[str, Any]) -> None:
    """Refuse to continue ``config``'s run from a checkpoint written with different math.

    Args:
        checkpoint: the checkpoint to resume from.
        config: the run's ``PorosConfig.to_dict()``.

    Raises:
        TrainingCheckpointError: a field of :data:`MATH_FIELDS` differs, ``steps`` differs under
            a schedule that depends on it, or the checkpoint is at (the run is finished) or past ``steps``.
    """
    saved = checkpoint.poros_config.get("config", {})
    differences = []
    for name in MATH_FIELDS:
        if name in saved and _normalized(saved[name]) != _normalized(config.get(name)):
            differences.append((name, saved[name], config.get(name)))
    saved_steps = saved.get("steps", config.get("steps"))
    if config.get("steps") == 0 and saved.get("epochs") == config.get("epochs"):  # steps: as many as the same epochs
        config = {**config, "steps": saved_steps}
    if saved_steps != config.get("steps") and config.get("schedule") not in STEP_INDEPENDENT_SCHEDULES:
        differences.append(("steps", saved_steps, config.get("steps")))
    if differences:
        listed = "; ".join(f"{name}: checkpoint {old!r}, this run {new!r}" for name, old, new in differences)
        fix = ", ".join(f"{name}={old!r}" for name, old, _ in differences)
        steps_note = (" (steps sets the length of the learning-rate schedule; only the "
                      f"{'/'.join(STEP_INDEPENDENT_SCHEDULES)} schedules may be resumed with other steps)"
                      if any(name == "steps" for name, _, _ in differences) else "")
        raise TrainingCheckpointError(
            f"checkpoint {checkpoint.path} was written by a run that computes differently — {listed}{steps_note}. "
            f"Resuming continues the same run, so these must match. Fix: resume with {fix}, or start a new run "
            "without resume_from (in another output_dir to keep these checkpoints)."
        )
    if checkpoint.step > int(config.get("steps", checkpoint.step)):
        raise TrainingCheckpointError(
            f"checkpoint {checkpoint.path} is at step {checkpoint.step}, past this run's steps={config.get('steps')}; "
            f"expected steps >= {checkpoint.step}. Resume with steps={saved_steps}, or from an earlier checkpoint."
        )
    if checkpoint.step == int(config.get("steps") or -1):  # the run's last step: resuming would train nothing
        raise TrainingCheckpointError(
            f"{checkpoint.path} is step {checkpoint.step} of the {checkpoint.step} this run trains: the run is "
            f"finished, there is nothing to resume (its adapter is in {checkpoint.path.parent}). Fix: raise --steps "
            f"above {checkpoint.step} (steps= in Python) to train on from it, or --overwrite (overwrite=True) to "
            "start again.")


__all__ = ["ADAPTER_CONFIG_FILE", "ADAPTER_WEIGHTS_FILE", "CHECKPOINT_PREFIX", "DATA_STATE_FILE", "MATH_FIELDS",
           "OPTIMIZER_FILE", "POROS_CONFIG_FILE", "REQUIRED_FILES", "RNG_STATE_FILE", "SCHEDULER_FILE",
           "STEP_INDEPENDENT_SCHEDULES", "TRAINER_STATE_FILE", "TrainingCheckpoint", "WRITE_FIXES",
           "atomic_directory", "capture_rng_state", "check_intact", "check_resumable", "checkpoint_step",
           "failed_save", "latest_checkpoint", "list_checkpoints", "missing_files", "plain_file_mode",
           "read_checkpoint", "remove_directory", "remove_partial_saves", "restore_rng_state", "rotate_checkpoints",
           "unreadable", "write_checkpoint", "write_error", "write_json"]
