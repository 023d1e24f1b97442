"""Where records come from: local files, in-memory lists, ``datasets`` objects, the hub, the bundled set.

Local ``.jsonl`` / ``.json`` / ``.csv`` files are read with the standard library, never through
the ``datasets`` cache, so a local file always means exactly what is on disk. Hub ids go through
``datasets.load_dataset`` (imported only then); offline, they must already be in its cache.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import pathlib
from collections.abc import Mapping
from typing import Any

from poros.assets import TINY_CHAT, asset_path
from poros.errors import DataError

logger = logging.getLogger("poros.data")

#: the source name that :func:`load_dataset` turns into random token ids.
SYNTHETIC = "synthetic"
#: file suffixes read directly.
LOCAL_SUFFIXES = (".jsonl", ".json", ".csv")
#: suffixes that mark a string as a file path even when the file does not exist.
_FILE_LIKE_SUFFIXES = LOCAL_SUFFIXES + (".txt", ".tsv", ".parquet", ".arrow", ".gz", ".zst", ".ndjson")


def _is_datasets_object(source: Any) -> bool:
    return type(source).__module__.partition(".")[0] == "datasets"


def _looks_like_path(name: str) -> bool:
    """A string that cannot be a hub id (``name`` or ``owner/name``) is meant as a path."""
    return (pathlib.PurePath(name).suffix.lower() in _FILE_LIKE_SUFFIXES or name.startswith((".", "/", "~"))
            or name.count("/") > 1 or "\\" in name)


def is_hub_id(source: Any) -> bool:
    """A string :func:`load_records` would load from the Hugging Face hub (not bundled, not a path)."""
    return (isinstance(source, str) and source not in (TINY_CHAT, SYNTHETIC)
            and not pathlib.Path(source).expanduser().exists() and not _looks_like_path(source))


def _check_records(records: list[Any], origin: str) -> list[dict[str, Any]]:
    if not records:
        raise DataError(f"{origin} has no records; expected at least one. Fix: point at a non-empty file or split")
    for index, record in enumerate(records):
        if not isinstance(record, Mapping):
            raise DataError(f"{origin}: record {index} is a {type(record).__name__}, expected a JSON object of "
                            "columns, e.g. {\"text\": ...} or {\"messages\": [...]}")
    return [dict(record) for record in records]


def _read_json_lines(text: str, path: pathlib.Path) -> list[Any]:
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as error:
            raise DataError(f"{path}: line {number} is not valid JSON ({error.msg} at column {error.colno}); "
                            "expected one JSON object per line. Fix that line") from None
    return records


def _read_json(text: str, path: pathlib.Path, split: str) -> list[Any]:
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        if error.msg == "Extra data":  # several top-level values: JSON lines in a .json file
            return _read_json_lines(text, path)
        raise DataError(f"{path} is not valid JSON ({error.msg} at line {error.lineno}, column {error.colno}). "
                        "Fix the file, or save it as JSON lines (.jsonl): one object per line") from None
    if isinstance(document, list):
        return document
    if isinstance(document, Mapping):
        for key in (split, "data"):
            if isinstance(document.get(key), list):
                return document[key]
        raise DataError(f"{path} holds a JSON object with keys {sorted(document)}; expected a list of records, or "
                        f"an object with a list under {split!r} or 'data'. Fix: wrap the records in a list")
    raise DataError(f"{path} holds a JSON {type(document).__name__}; expected a list of records")


def _read_csv(path: pathlib.Path) -> list[Any]:
    csv.field_size_limit(2**31 - 1)  # a long conversation in one cell is data, not an error
    with path.open(newline="", encoding="utf-8-sig") as handle:  # -sig: Excel's "CSV UTF-8" starts with a BOM
        records = list(csv.DictReader(handle))
    for number, record in enumerate(records, start=2):
        if None in record:  # DictReader keeps a row's extra cells under the key None
            raise DataError(f"{path}: row {number} has more cells than the header has columns "
                            f"({sorted(k for k in record if k is not None)}); expected one cell per column. Fix: quote "
                            "cells that contain commas, or fix that row")
    return records


def read_local_file(path: str | os.PathLike, *, split: str = "train") -> list[dict[str, Any]]:
    """Records of a local ``.jsonl``, ``.json`` or ``.csv`` file, read with the standard library.

    Args:
        path: the file. ``.json`` may hold a list of objects, an object with the list under
            ``split`` (``"train"`` by default) or ``"data"``, or JSON lines. ``.csv`` needs a header row;
            every value is a string (a ``messages`` cell may hold the conversation as JSON).
        split: the key to look under in a ``.json`` object.

    Raises:
        DataError: the file is missing, is a directory, has another suffix, does not parse, or
            holds no records.
    """
    path = pathlib.Path(path).expanduser()
    if path.is_dir():
        raise DataError(f"{path} is a directory; expected a .jsonl, .json or .csv file. Fix: point at the file "
                        "inside it (a `save_to_disk` directory: load it with datasets.load_from_disk and pass the "
                        "Dataset)")
    if not path.exists():
        raise DataError(f"dataset file {path} does not exist (looked from {pathlib.Path.cwd()}). Fix: check the path, "
                        "or pass a Hugging Face dataset id such as 'OpenAssistant/oasst1'")
    suffix = path.suffix.lower()
    if suffix not in LOCAL_SUFFIXES:
        raise DataError(f"cannot read {path}: the suffix {suffix or '(none)'!r} is not one Poros reads; expected "
                        f"{', '.join(LOCAL_SUFFIXES)}. Fix: convert it (pandas: df.to_json('data.jsonl', "
                        "orient='records', lines=True)), or load it with datasets and pass the Dataset")
    try:
        if suffix == ".csv":
            records = _read_csv(path)
        else:
            text = path.read_text(encoding="utf-8-sig")  # a leading byte-order mark (Notepad) is not data
            records = _read_json_lines(text, path) if suffix == ".jsonl" else _read_json(text, path, split)
    except UnicodeDecodeError as error:
        raise DataError(f"{path} is not UTF-8 text: byte {error.object[error.start:error.start + 1]!r} at offset "
                        f"{error.start} ({error.reason}); expected a UTF-8 file. Fix: re-save it as UTF-8 (e.g. "
                        f"iconv -f latin1 -t utf-8 {path.name} > fixed{suffix})") from None
    except csv.Error as error:
        raise DataError(f"{path} is not valid CSV ({error}); expected a header row and one record per row. Fix the "
                        "file, or save it as JSON lines (.jsonl)") from None
    except OSError as error:
        raise DataError(f"cannot read {path}: {error.strerror or error}. Fix: check the file's permissions") from None
    return _check_records(records, str(path))


def _from_datasets_object(source: Any, split: str) -> list[dict[str, Any]]:
    if isinstance(source, Mapping):  # DatasetDict / IterableDatasetDict
        if split not in source:
            raise DataError(f"the DatasetDict has no split {split!r}; it has {sorted(source)}. Fix: pass split=... "
                            "with one of those")
        source = source[split]
    if hasattr(source, "to_list"):
        records = source.to_list()
    else:  # IterableDataset
        records = list(source)
    return _check_records(records, f"the {type(source).__name__}")


def hub_dataset_cached(dataset_id: str) -> bool:
    """Whether ``dataset_id`` has an entry in the HF hub cache or the ``datasets`` cache (nothing is read)."""
    from huggingface_hub import constants

    hub = pathlib.Path(constants.HF_HUB_CACHE) / f"datasets--{dataset_id.replace('/', '--')}"
    datasets_cache = pathlib.Path(os.environ.get("HF_DATASETS_CACHE")
                                  or pathlib.Path(constants.HF_HOME) / "datasets")
    return hub.is_dir() or (datasets_cache / dataset_id.replace("/", "___")).is_dir()


def hub_reachable(timeout: float = 3.0) -> bool:
    """False when offline is asked for (``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE``) or the hub's host does
    not answer one TCP connect within ``timeout`` seconds (no retries)."""
    import socket
    from urllib.parse import urlparse

    if any(os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")
           for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")):
        return False
    endpoint = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    try:
        with socket.create_connection((endpoint.hostname or "huggingface.co",
                                       endpoint.port or (80 if endpoint.scheme == "http" else 443)), timeout=timeout):
            return True
    except OSError:
        return False


def check_hub_dataset(dataset_id: str) -> None:
    """Fail at once for a hub dataset that is neither cached nor reachable (instead of ~35 s of retries).

    Raises:
        DataError: not in the cache and the hub is unreachable or offline was asked for; the
            message also covers a local file named without its suffix.
    """
    if hub_dataset_cached(dataset_id) or hub_reachable():
        return
    local = [str(p) for p in (pathlib.Path(dataset_id + s) for s in LOCAL_SUFFIXES) if p.is_file()]
    raise DataError(
        f"dataset {dataset_id!r} is not a local file and not in the Hugging Face cache, and the hub cannot be reached "
        "(offline, or HF_HUB_OFFLINE/HF_DATASETS_OFFLINE set). Fix: "
        + (f"did you mean {local[0]!r}? Give the file with its suffix" if local else
           f"a local file needs its suffix (e.g. {dataset_id}.jsonl); a hub dataset must be loaded once online "
           f"(python -c \"import datasets; datasets.load_dataset({dataset_id!r})\"), or give the data as a local "
           ".jsonl/.json/.csv file")
    )


def _from_hub(dataset_id: str, split: str) -> list[dict[str, Any]]:
    try:
        import datasets
    except ImportError as error:
        raise DataError(f"{dataset_id!r} is not a local file, so it would be loaded from the Hugging Face hub, but "
                        f"the datasets package is not installed ({error}). Fix: pip install 'poros-train[train]', or "
                        "pass a local .jsonl/.json/.csv file") from None
    check_hub_dataset(dataset_id)
    try:
        loaded = datasets.load_dataset(dataset_id, split=split)
    except Exception as error:
        raise DataError(
            f"could not load the Hugging Face dataset {dataset_id!r} (split {split!r}): {type(error).__name__}: "
            f"{error}. A hub dataset is loaded with datasets.load_dataset; offline (HF_HUB_OFFLINE=1 or "
            "HF_DATASETS_OFFLINE=1, or no network) it must already be in the datasets cache. Fix: load it once "
            f"online (python -c \"import datasets; datasets.load_dataset({dataset_id!r})\"), or give it as a local "
            ".jsonl/.json/.csv file"
        ) from error
    return _from_datasets_object(loaded, split)


def load_records(source: Any, *, split: str = "train") -> list[dict[str, Any]]:
    """The records (dicts of columns) of a dataset, wherever it is.

    Args:
        source: one of

            * ``"poros-tiny-chat"``: the bundled chat dataset (:data:`poros.assets.TINY_CHAT`);
            * a local ``.jsonl`` / ``.json`` / ``.csv`` path (``str`` or ``PathLike``), read with the
              standard library (see :func:`read_local_file`);
            * a Hugging Face dataset id (``"OpenAssistant/oasst1"``), loaded with
              ``datasets.load_dataset(id, split=split)``; cached datasets work offline;
            * a list of dicts;
            * a ``datasets.Dataset`` / ``IterableDataset``, or a ``DatasetDict`` (its ``split``).
        split: the split of a hub dataset or a ``DatasetDict`` (and the key looked up in a
            ``.json`` object).

    Returns:
        A list of dicts, one per record.

    Raises:
        DataError: a missing file; an unknown suffix; a file or split with no records; a hub id
            that cannot be loaded (not cached offline, unknown, no such split) -- the message
            names the id and says to cache it or use a local file; a source of another type.
    """
    if isinstance(source, str) and source == TINY_CHAT:
        return read_local_file(asset_path(TINY_CHAT))
    if isinstance(source, str) and source == SYNTHETIC:
        raise DataError("'synthetic' has no records: it is random token ids made for a tokenizer. Fix: call "
                        "poros.data.load_dataset('synthetic', tokenizer, seq_len=...) or synthetic_examples(...)")
    if isinstance(source, os.PathLike):
        return read_local_file(source, split=split)
    if isinstance(source, str):
        return _from_hub(source, split) if is_hub_id(source) else read_local_file(source, split=split)
    if _is_datasets_object(source):
        return _from_datasets_object(source, split)
    if isinstance(source, (list, tuple)):
        return _check_records(list(source), "the list of records")
    raise DataError(f"cannot load a dataset from a {type(source).__name__}; expected a file path, a Hugging Face "
                    "dataset id, a list of dicts, a datasets.Dataset or 'poros-tiny-chat'")


def load_dataset(
    source: Any,
    tokenizer: Any,
    *,
    seq_len: int,
    split: str = "train",
    chat_template: str | None = None,
    seed: int = 0,
    vocab_size: int | None = None,
):
    """From what the user brings to tokenized, loss-masked examples: the one call the trainer makes.

    Args:
        source: anything :func:`load_records` takes; ``"synthetic"`` for random tokens
            (:func:`poros.data.synthetic_examples` with ``vocab_size=len(tokenizer)``); or an
            already :class:`~poros.data.TokenizedData` (returned as is).
        tokenizer: the model's HF tokenizer.
        seq_len: the most tokens per example (longer examples keep their start).
        split: the split of a hub dataset or ``DatasetDict``.
        chat_template: a Jinja chat template instead of the tokenizer's own.
        seed: the seed of ``"synthetic"`` data (real data is not shuffled here; the batch
            iterator shuffles).
        vocab_size: the vocabulary of ``"synthetic"`` data when there is no tokenizer (the model's
            ``config.vocab_size``).

    Returns:
        :class:`~poros.data.TokenizedData`; its :meth:`~poros.data.TokenizedData.summary` is
        logged at INFO on ``poros.data``.

    Raises:
        DataError: from :func:`load_records`, :func:`~poros.data.detect_format`,
            :func:`~poros.data.to_examples` or :func:`~poros.data.tokenize_examples`.
    """
    from poros.data.formats import detect_format, to_examples
    from poros.data.synthetic import synthetic_examples
    from poros.data.tokenize import TokenizedData, tokenize_examples

    if isinstance(source, TokenizedData):
        data = source
    elif isinstance(source, str) and source == SYNTHETIC:
        if tokenizer is None and vocab_size is None:
            raise DataError('dataset "synthetic" needs a vocabulary size: pass a tokenizer or vocab_size=')
        data = synthetic_examples(vocab_size=len(tokenizer) if tokenizer is not None else vocab_size,
                                  seq_len=seq_len, seed=seed)
    else:
        records = load_records(source, split=split)
        fmt = detect_format(records)
        data = tokenize_examples(to_examples(records, fmt), tokenizer, seq_len=seq_len, chat_template=chat_template,
                                 fmt=fmt)
    logger.info(data.summary())
    return data


__all__ = ["LOCAL_SUFFIXES", "SYNTHETIC", "check_hub_dataset", "hub_dataset_cached", "hub_reachable", "is_hub_id",
           "load_dataset", "load_records", "read_local_file"]
