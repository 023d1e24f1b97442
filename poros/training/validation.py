"""Everything about a run that can be checked before the model loads, checked first.

``poros train`` (and ``--dry-run``, and ``poros plan`` for its part) call :func:`validate_run`
before any weight is read, so a typo in a path fails in a second, not after minutes of loading::

    packages     the train extra is installed              MissingDependencyError
    device       --device cuda has a CUDA torch and GPU    DeviceError
    output_dir   not a file, writable, not in use by a     OutputDirError, RunLockedError
                 live run, no other run's results (unless
                 overwrite or resume_from)
    resume_from  complete, intact, same math               TrainingCheckpointError
    model        config.json found, a registered family    CheckpointLoadError, UnknownArchitectureError
    dataset      readable; format detected and the first   DataError
                 records normalized; a hub id cached or
                 reachable (no retries)

Each check raises the first problem it finds as a :class:`~poros.errors.PorosError` whose
message names what was found and the fix. Nothing is written (the writability probe removes its
file) and nothing is loaded but the checkpoint's ``config.json`` and the dataset file.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import sys
from typing import Any

from poros.packages import INSTALL_HINT, RUN_PACKAGES, missing_packages  # noqa: F401 (re-exported)
from poros.errors import CheckpointLoadError, DataError, MissingDependencyError, OutputDirError

#: records normalized by :func:`check_dataset` (the whole file is read; only these are normalized).
SAMPLE_RECORDS = 32


def require_run_packages(command: str) -> None:
    """Raise :class:`~poros.errors.MissingDependencyError` when a package ``command`` needs is missing."""
    missing = missing_packages()
    if missing:
        raise missing_dependency(command, missing)


def missing_dependency(command: str, missing: list[str]) -> MissingDependencyError:
    """The error for ``command`` run without the packages ``missing``, with the install hint."""
    return MissingDependencyError(
        f"{command} needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} not installed (the core "
        f"install of poros-train runs list-architectures, plugins, doctor and init). Fix: {INSTALL_HINT}; "
        "`poros doctor` shows what is installed."
    )


def check_device(device: str) -> None:
    """Raise :class:`~poros.errors.DeviceError` when ``device`` is not available here."""
    from poros.devices import resolve_device

    resolve_device(device, check=True)


def _probe_writable(directory: pathlib.Path) -> None:
    """Create and remove a file in ``directory``: the honest test of writability (``os.access`` is not, as root)."""
    import tempfile

    try:
        descriptor, name = tempfile.mkstemp(prefix=".poros-write-test-", dir=directory)
    except OSError as error:
        from poros.training.checkpoint import write_error

        raise write_error(error, directory) from None
    os.close(descriptor)
    with contextlib.suppress(OSError):
        os.unlink(name)


def check_output_dir(output_dir: str, *, overwrite: bool = False, resuming: bool = False) -> None:
    """``output_dir`` can take this run: not a file, writable, not held by a live run, and no other run's
    results in it unless ``overwrite`` or ``resuming``.

    Raises:
        OutputDirError: a file, a path under a file, not writable, or another run's results.
        RunLockedError: another live run holds it.
    """
    from poros.training import run_lock

    directory = pathlib.Path(output_dir).expanduser()
    if directory.exists() and not directory.is_dir():
        raise OutputDirError(f"output_dir {directory} is a file; expected a directory for the adapter, checkpoints "
                             "and metrics. Fix: pass --output-dir a new or existing directory.")
    existing = directory
    while not existing.exists():  # the nearest ancestor that exists: the run will create the rest
        existing = existing.parent
    if not existing.is_dir():
        raise OutputDirError(f"output_dir {directory} lies under {existing}, which is a file. Fix: pass --output-dir "
                             "a path under a directory.")
    _probe_writable(existing)
    if directory.is_dir():
        run_lock.check_unlocked(directory)
        if not (overwrite or resuming):
            run_lock.check_fresh_start(directory, overwrite=False)


def check_model(model: str, *, revision: str | None = None, download_allowed: bool = True) -> None:
    """The model's ``config.json`` is found and a registered family claims it.

    A hub id that is not in the HF cache passes when ``download_allowed`` (``poros train`` downloads
    it) unless ``HF_HUB_OFFLINE`` is set; ``--dry-run`` reads only the cache.

    Raises:
        CheckpointLoadError: no such local directory, no ``config.json``, or a hub id that is not
            cached where it cannot be downloaded.
        UnknownArchitectureError: no registered family claims the checkpoint's ``model_type``.
    """
    from poros import registry
    from poros.training.plan import load_text_config, locate_checkpoint_config

    try:
        directory, _ = locate_checkpoint_config(model, revision=revision)
    except CheckpointLoadError:
        hub_like = model.count("/") == 1 and not model.startswith((".", "/", "~"))
        offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
        if hub_like and download_allowed and not offline and not pathlib.Path(model).expanduser().exists():
            return  # loaded (downloaded) later; its config is checked then
        raise
    _, text_config = load_text_config(directory)
    registry.for_config(text_config)


def check_dataset(dataset: str, *, split: str = "train") -> str:
    """The dataset is readable and its format is detected on its first records; returns the format.

    Local files are read whole and their first :data:`SAMPLE_RECORDS` records normalized; a hub id
    is only checked to be cached or reachable (it is loaded once, by the run).

    Raises:
        DataError: as :func:`poros.data.load_records`, :func:`~poros.data.detect_format` and
            :func:`~poros.data.to_examples` raise it; or the first records' roles are all unknown.
    """
    from poros.data.formats import detect_format, to_examples, unknown_roles, unknown_roles_hint
    from poros.data.sources import SYNTHETIC, check_hub_dataset, is_hub_id, load_records

    if dataset == SYNTHETIC:
        return "synthetic"
    if is_hub_id(dataset):
        check_hub_dataset(dataset)
        return "hub"
    records = load_records(dataset, split=split)
    sample = records[:SAMPLE_RECORDS]
    fmt = detect_format(sample)
    if fmt != "oasst1":  # oasst1 examples are trees across records: a sample would cut them
        examples = to_examples(sample, fmt)
        roles = unknown_roles(examples)
        if roles and not any(m["role"] == "assistant" for example in examples for m in example.messages):
            raise DataError(f"{dataset}: no assistant turn in the first {len(sample)} records: "
                            f"{unknown_roles_hint(roles)}")
    return fmt


def check_resume(config: Any) -> None:
    """The checkpoint ``resume_from`` names is complete, intact and from a run with the same math.

    Raises:
        TrainingCheckpointError: see :func:`poros.training.checkpoint.read_checkpoint` and
            :func:`~poros.training.checkpoint.check_resumable`.
    """
    from poros.training import checkpoint

    if config.resume_from is None:
        return
    if config.resume_from == "auto":
        path = checkpoint.latest_checkpoint(config.output_dir) if pathlib.Path(config.output_dir).is_dir() else None
        if path is None:
            return  # starts fresh (the run says so)
    else:
        path = pathlib.Path(config.resume_from)
    checkpoint.check_resumable(checkpoint.read_checkpoint(path), config.to_dict())


def validate_run(config: Any, *, dry_run: bool = False) -> None:
    """Every check above for a :class:`~poros.config.PorosConfig`, in the order a user fixes them."""
    from poros.training.checkpoint import latest_checkpoint

    check_device(config.device)
    output_dir = pathlib.Path(config.output_dir)
    resuming = config.resume_from not in (None, "auto") or (  # 'auto' without a checkpoint starts fresh
        config.resume_from == "auto" and output_dir.is_dir() and latest_checkpoint(output_dir) is not None)
    check_output_dir(config.output_dir, overwrite=config.overwrite, resuming=resuming)
    check_resume(config)
    check_model(config.model, revision=config.revision, download_allowed=not dry_run)
    check_dataset(config.dataset, split=config.dataset_split)
    if config.eval_dataset:
        check_dataset(config.eval_dataset, split=config.eval_dataset_split)


__all__ = ["RUN_PACKAGES", "check_dataset", "check_device", "check_model", "check_output_dir", "check_resume",
           "missing_dependency", "missing_packages", "require_run_packages", "validate_run"]
