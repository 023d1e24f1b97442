"""Writing a directory atomically, and saying why a write failed: what training checkpoints, the final
adapter (``PorosTrainer.save``) and the run lock's clean-up share.

:func:`atomic_directory` writes into a hidden temporary directory beside the target, flushes it to disk
and renames it into place in one ``rename`` (or merges it in, for the adapter beside its checkpoints),
so a kill at any moment leaves the complete directory or nothing under its name;
:func:`remove_partial_saves` sweeps what a killed save left (:data:`TEMPORARY_NAME`). A failed write
becomes one :class:`~poros.errors.OutputDirError` naming the path, what was found and the fix
(:func:`write_error`, :data:`WRITE_FIXES`). Torch-free.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import pathlib
import re
import shutil
import uuid
from collections.abc import Iterator
from typing import Any

from poros.errors import OutputDirError, PorosError, TrainingCheckpointError

logger = logging.getLogger("poros")
TEMPORARY_NAME = re.compile(r"^\..+\.(tmp|old)-\d+-[0-9a-f]+$")


# ---------------------------------------------------------------------------------------------
# Atomic directories
# ---------------------------------------------------------------------------------------------
def hidden_sibling(target: pathlib.Path, kind: str) -> pathlib.Path:
    return target.parent / f".{target.name}.{kind}-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def fsync_tree(directory: pathlib.Path) -> None:
    """Flush every file under ``directory`` and the directories themselves to disk, each file readable as a
    plain ``open()`` would have made it (0644 under the usual umask: safetensors writes 0600 files)."""
    mode = plain_file_mode()
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            with contextlib.suppress(OSError):  # a file system without modes keeps its own
                os.chmod(path, mode)
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
        fsync_directory(pathlib.Path(root))


def plain_file_mode() -> int:
    """The mode ``open(path, "w")`` gives a new file here: 0666 less the process's umask."""
    umask = os.umask(0o022)  # read it (os.umask only reads by setting) and put it back
    os.umask(umask)
    return 0o666 & ~umask


def fsync_directory(directory: pathlib.Path) -> None:
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:  # platforms that cannot open a directory (Windows): rename is still atomic
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def remove_directory(path: pathlib.Path) -> None:
    """Delete a directory so that it never exists under its name half-deleted: rename, then delete."""
    doomed = hidden_sibling(path, "old")
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


@contextlib.contextmanager
def atomic_directory(target: str | os.PathLike, *, merge: bool = False,
                     written_last: str | None = None) -> Iterator[pathlib.Path]:
    """Write a directory atomically: yield a temporary directory next to ``target``, then rename it.

    On normal exit the temporary directory is flushed to disk and renamed to ``target``. An
    existing ``target`` is touched only then: replaced whole (renamed away, the new one renamed
    in, the old one deleted), or with ``merge`` kept, each new entry renamed over its namesake in
    it (``written_last`` last) so that its other entries survive. On an exception the temporary
    directory is deleted and ``target`` is untouched.

    Args:
        target: the directory to create or replace; its parent is created if missing.
        merge: keep the entries of an existing ``target`` that the new directory does not have.
        written_last: with ``merge``, the entry moved in after all others (a completion marker).

    Raises:
        TrainingCheckpointError: ``target`` exists and is not a directory.
    """
    target = pathlib.Path(target)
    if target.exists() and not target.is_dir():
        raise TrainingCheckpointError(
            f"{target} exists and is a file; expected a directory (or nothing) to write into. Choose another "
            "path or remove the file."
        )
    temporary = hidden_sibling(target, "tmp")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        temporary.mkdir()
    except OSError as error:
        raise write_error(error, target) from error
    previous = None
    try:
        yield temporary
        fsync_tree(temporary)
        if target.exists() and merge:
            merge_into(temporary, target, written_last)
        elif target.exists():
            previous = hidden_sibling(target, "old")
            os.rename(target, previous)
            os.rename(temporary, target)
            shutil.rmtree(previous, ignore_errors=True)
        else:
            os.rename(temporary, target)
        fsync_directory(target.parent)
    except BaseException as error:
        full = disk_full(error, temporary)  # measured before the partial save frees its space
        shutil.rmtree(temporary, ignore_errors=True)
        if previous is not None and previous.exists() and not target.exists():
            os.rename(previous, target)  # interrupted between the two renames: the old one goes back
        if isinstance(error, OSError):
            raise write_error(error, target) from error
        if full:  # torch.save / safetensors report a full disk as their own errors
            raise write_error(OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} ({type(error).__name__}: "
                                                    f"{str(error).splitlines()[0] if str(error) else ''})"),
                              target) from error
        raise


def disk_full(error: BaseException, directory: pathlib.Path) -> bool:
    """Whether a failed write looks like a full disk: ENOSPC said, or (almost) no space left."""
    if isinstance(error, PorosError) or not isinstance(error, Exception):
        return False
    if isinstance(error, OSError):
        return error.errno in (errno.ENOSPC, errno.EDQUOT)
    if "No space left" in str(error) or "os error 28" in str(error):
        return True
    try:
        return shutil.disk_usage(directory).free < 1 << 20
    except OSError:
        return False


#: errno -> what makes the output_dir take writes again (the default: check the disk and the path)
WRITE_FIXES = {errno.ENOSPC: "free disk space (or pass an --output-dir on another disk)",
               errno.EDQUOT: "free space within your disk quota",
               errno.EROFS: "pass an --output-dir on a writable file system",
               errno.EACCES: "pass an --output-dir you can write to, or fix its permissions",
               errno.EPERM: "pass an --output-dir you can write to, or fix its permissions"}


def error_found(error: OSError) -> str:
    code = f", errno {error.errno}" if error.errno is not None else ""
    return f"{error.strerror or error} ({type(error).__name__}{code})"


def write_error(error: OSError, target: pathlib.Path) -> PorosError:
    """The :class:`~poros.errors.OutputDirError` for an ``OSError`` while writing ``target``, with the fix."""
    fix = WRITE_FIXES.get(error.errno, "check the disk and the path")
    if error.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):  # a transient failure: the run can go on
        fix += (" and resume with --resume_from auto" if error.errno == errno.ENOSPC
                else ", then resume with --resume_from auto")
    return OutputDirError(f"could not write {target}: {error_found(error)}; nothing was replaced: earlier saves are "
                          f"intact. Fix: {fix}.")


def merge_into(source: pathlib.Path, target: pathlib.Path, written_last: str | None) -> None:
    """Rename every entry of ``source`` over its namesake in ``target``; then delete ``source``."""
    names = sorted(entry.name for entry in source.iterdir())
    if written_last in names:
        names.remove(written_last)
        names.append(written_last)
    for name in names:
        destination = target / name
        if destination.is_dir() and not destination.is_symlink():
            remove_directory(destination)
        os.replace(source / name, destination)
    source.rmdir()


def remove_partial_saves(directory: str | os.PathLike) -> list[pathlib.Path]:
    """Delete the hidden temporary directories a killed save or rotation left in ``directory``."""
    directory = pathlib.Path(directory)
    removed = []
    if directory.is_dir():
        for path in sorted(directory.iterdir()):
            if path.is_dir() and TEMPORARY_NAME.match(path.name):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    if removed:
        logger.info("poros: removed %d partial save(s) left by an interrupted run in %s", len(removed), directory)
    return removed


def write_json(path: pathlib.Path, payload: Any) -> None:
    path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n", encoding="utf-8")


__all__ = ["TEMPORARY_NAME", "WRITE_FIXES", "atomic_directory", "disk_full", "error_found", "fsync_directory", "fsync_tree",
           "hidden_sibling", "merge_into", "plain_file_mode", "remove_directory", "remove_partial_saves", "write_error",
           "write_json"]
