"""Everything about a run that can be checked before the model loads, checked first.

``poros train`` (and ``--dry-run``, and ``poros plan`` for its part) call :func:`validate_run`
before any weight is read, so a typo in a path fails in a second, not after minutes of loading::

    packages     the train extra is installed              MissingDependencyError
    device       --device cuda has a CUDA torch and GPU    DeviceError
    output_dir   not a file, writable, not in use by a     OutputDirError, RunLockedError
                 live run, no other run's results (unless
                 overwrite or resume_from)
    resume_from  complete, intact, same math               TrainingCheckpointError
    model        config.json found, a registered family;   CheckpointLoadError, UnknownArchitectureError
                 a local checkpoint's shards all there
    dataset      readable; format detected and the first   DataError
                 records normalized; a hub id cached or
                 reachable (no retries); a local file
                 leaves some example a trainable token
                 (the checkpoint's tokenizer, seq_len)

Each check raises the first problem it finds as a :class:`~poros.errors.PorosError` whose
message names what was found and the fix. Nothing is written (the writability probe removes its
file) and nothing is loaded but the checkpoint's ``config.json``, its tokenizer and the dataset file.
The trainable-token check tokenizes the first :data:`SAMPLE_RECORDS` records, and the whole file only
when none of those has a trainable token (what the run would do before it fails the same way).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import sys
from typing import Any

from poros.packages import INSTALL_HINT, RUN_PACKAGES, missing_packages  # noqa: F401 (re-exported)
from poros.errors import CheckpointLoadError, ConfigError, DataError, MissingDependencyError, OutputDirError

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


def check_model(model: str, *, revision: str | None = None, download_allowed: bool = True) -> pathlib.Path | None:
    """The model's ``config.json`` is found and a registered family claims it; a local checkpoint (a
    directory, the bundled model) with a shard index has every shard it lists. Returns the checkpoint
    directory (None for a hub id that is downloaded later).

    A hub id that is not in the HF cache passes when ``download_allowed`` (``poros train`` downloads
    it) unless ``HF_HUB_OFFLINE`` is set; ``--dry-run`` reads only the cache. A cached hub snapshot's
    weights are not checked: the run fetches the ones missing.

    Raises:
        CheckpointLoadError: no such local directory, no ``config.json``, a hub id that is not
            cached where it cannot be downloaded, or a local index naming a shard that is not there.
        UnknownArchitectureError: no registered family claims the checkpoint's ``model_type``.
    """
    from poros import registry
    from poros.plan.run_plan import load_text_config, locate_checkpoint_config

    try:
        directory, where = locate_checkpoint_config(model, revision=revision)
    except CheckpointLoadError:
        hub_like = model.count("/") == 1 and not model.startswith((".", "/", "~"))
        offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
        if hub_like and download_allowed and not offline and not pathlib.Path(model).expanduser().exists():
            return None  # loaded (downloaded) later; its config is checked then
        raise
    from poros.loading.load import PICKLE_INDEX, SAFE_INDEX, inspect_checkpoint

    if where != "HF cache" and any((directory / name).is_file() for name in (SAFE_INDEX, PICKLE_INDEX)):
        inspect_checkpoint(directory)  # the family, and every shard of the index (a copy cut short fails here)
    else:  # a config.json alone plans (`--dry-run` reads no weights); a hub snapshot fetches what it lacks
        _, text_config = load_text_config(directory)
        registry.for_config(text_config)
    return directory


def check_dataset(dataset: str, *, split: str = "train", tokenizer: Any = None, seq_len: int | None = None,
                  chat_template: str | None = None) -> str:
    """The dataset is readable and its format is detected on its first records; returns the format.

    Local files are read whole and their first :data:`SAMPLE_RECORDS` records normalized; with a
    ``tokenizer`` and ``seq_len``, some example must keep a trainable token (:func:`check_trainable`).
    A hub id is only checked to be cached or reachable (it is loaded once, by the run).

    Raises:
        DataError: as :func:`poros.data.load_records`, :func:`~poros.data.detect_format` and
            :func:`~poros.data.to_examples` raise it; the first records' roles are all unknown; or no
            example has a trainable token (the run's own message: no assistant turn, or beyond seq_len).
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
    if tokenizer is not None and seq_len is not None:
        check_trainable(records, fmt, tokenizer, seq_len=seq_len, chat_template=chat_template)
    return fmt


def check_trainable(records: list[Any], fmt: str, tokenizer: Any, *, seq_len: int,
                    chat_template: str | None = None) -> None:
    """Some example of ``records`` keeps a trainable token at ``seq_len``, as the run tokenizes them: the
    first :data:`SAMPLE_RECORDS` records are tried, and all of them only when none of those has one.
    The run's WARNINGs (dropped examples) are left to the run, which counts the whole dataset.

    Raises:
        DataError: as :func:`poros.data.tokenize_examples` raises it (no trainable token in any example,
            a chat template that fails).
    """
    from poros.data.formats import to_examples
    from poros.data.tokenize import tokenize_examples

    data_logger = logging.getLogger("poros")
    level = data_logger.level
    data_logger.setLevel(logging.ERROR)  # a sample's "dropped N of M" would count the sample, not the data
    try:
        for sample in ((records[:SAMPLE_RECORDS], records) if len(records) > SAMPLE_RECORDS else (records,)):
            try:
                tokenize_examples(to_examples(sample, fmt), tokenizer, seq_len=seq_len, chat_template=chat_template,
                                  fmt=fmt)
                return
            except DataError:
                if sample is records:
                    raise
    finally:
        data_logger.setLevel(level)


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
    directory = check_model(config.model, revision=config.revision, download_allowed=not dry_run)
    if directory is not None:
        from poros.plan.run_plan import load_text_config

        check_seq_len(config.seq_len, load_text_config(directory)[1], config.model)
    tokenizer = checkpoint_tokenizer(directory)
    check_dataset(config.dataset, split=config.dataset_split, tokenizer=tokenizer, seq_len=config.seq_len,
                  chat_template=config.chat_template)
    if config.eval_dataset:
        check_dataset(config.eval_dataset, split=config.eval_dataset_split, tokenizer=tokenizer,
                      seq_len=config.seq_len, chat_template=config.chat_template)


def longest_sequence(text_config: Any) -> int | None:
    """The most tokens a row may have for this model: ``max_position_embeddings``, or a RoPE scaling's
    ``factor x original_max_position_embeddings`` where that is more (YaRN as the Qwen cards add it);
    None when the config says neither."""
    limit = getattr(text_config, "max_position_embeddings", None)
    rope = getattr(text_config, "rope_parameters", None) or getattr(text_config, "rope_scaling", None) or {}
    kinds = rope.values() if rope and all(isinstance(v, dict) for v in rope.values()) else [rope]
    for parameters in kinds:  # one dict, or one per layer kind (Gemma)
        if isinstance(parameters, dict) and parameters.get("factor") and parameters.get("original_max_position_embeddings"):
            scaled = int(parameters["factor"] * parameters["original_max_position_embeddings"])
            limit = scaled if limit is None else max(limit, scaled)
    return limit


def check_seq_len(seq_len: int, text_config: Any, model: str = "the model") -> None:
    """``seq_len`` is at most the model's :func:`longest_sequence`.

    Raises:
        ConfigError: above it, naming both numbers and the fix.
    """
    limit = longest_sequence(text_config)
    if limit is not None and seq_len > limit:
        raise ConfigError(f"seq_len={seq_len} is above {model}'s max_position_embeddings={limit}: positions past it "
                          "were never trained (and RoPE scaling is not set to reach them). Fix: seq_len "
                          f"{limit} or less, or a checkpoint (or rope_parameters) made for longer sequences.")


def checkpoint_tokenizer(directory: pathlib.Path | None) -> Any:
    """The tokenizer of the checkpoint in ``directory`` (``AutoTokenizer``, as the run loads it), or None when
    it has none (the run then trains 'synthetic' only and says so)."""
    from poros.loading.load import TOKENIZER_FILES

    if directory is None or not any((directory / name).is_file() for name in TOKENIZER_FILES):
        return None
    import transformers

    return transformers.AutoTokenizer.from_pretrained(directory)


__all__ = ["RUN_PACKAGES", "check_dataset", "check_device", "check_model", "check_output_dir", "check_resume",
           "check_seq_len", "check_trainable", "checkpoint_tokenizer", "longest_sequence", "missing_dependency", "missing_packages", "require_run_packages",
           "validate_run"]
