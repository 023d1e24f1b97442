"""One run per output directory: an exclusive lock for the run's lifetime, and no silent mixing of runs.

::

    output_dir/
      .poros.lock          {"pid": 4242, "host": "gpu-7", "started": "2026-...Z", "command": "poros train ..."}

Notable choices:

* **Created whole and exclusively.** The record is written to a private file and hard-linked to
  ``.poros.lock``: two runs racing into one directory cannot both create it, and a reader never sees
  it half written. Where the file system has no hard links it is created with O_EXCL and then
  written, and a reader gives an unreadable lock a second to become readable. The second run fails at
  once with :class:`~poros.errors.RunLockedError` naming the pid, host, start time and command of
  the first.
* **Stale locks are taken over.** A lock whose pid is not alive on this host (a ``kill -9``, a
  power cut) is stale: it is replaced, and a WARNING says so. A lock from another host is never
  judged stale (its pid means nothing here); the message says to delete it if that run is over.
* **Re-entrant within the process.** ``poros train`` holds the lock around ``train()`` and the final
  ``save()``; ``train()`` takes it too (for Python callers). Nested holds by the same process count
  up and down; the file goes when the outermost hold ends.
* **One lock per torchrun job.** Under data parallel rank 0 takes the lock and records the job
  (:func:`poros.distributed.job_id`); the job's other ranks take none and accept that one.
* **Results are not mixed.** :func:`check_fresh_start` refuses a fresh run into a directory that
  holds another run's adapter, checkpoints or metrics unless ``overwrite`` is set (which removes the
  old checkpoints and metrics first); resuming (``resume_from``) is the other way in.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import json
import logging
import os
import pathlib
import socket
import sys
import time
from collections.abc import Iterator
from typing import Any

from poros.distributed import is_main_process, job_id
from poros.errors import OutputDirError, RunLockedError

logger = logging.getLogger("poros")

LOCK_FILE = ".poros.lock"
#: tenths of a second a reader waits for an unreadable lock to become readable before refusing
UNREADABLE_RETRIES = 10
#: files whose presence means a previous run left results in output_dir.
RESULT_FILES = ("adapter_model.safetensors", "metrics.jsonl")

_HELD: dict[pathlib.Path, int] = {}  # resolved output_dir -> nesting depth of holds in this process


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    except OSError:
        return False
    return True


def read_lock(output_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The owner recorded in ``output_dir/.poros.lock`` (``{}`` when unreadable), or None when unlocked."""
    path = pathlib.Path(output_dir) / LOCK_FILE
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError:
        return {}
    try:
        owner = json.loads(text)
    except ValueError:
        return {}
    return owner if isinstance(owner, dict) else {}


def is_stale(owner: dict[str, Any]) -> bool:
    """True when the lock's owner is a process of this host that is no longer alive."""
    pid, host = owner.get("pid"), owner.get("host")
    if not isinstance(pid, int) or host != socket.gethostname():
        return False
    return not _pid_alive(pid)


def _describe(owner: dict[str, Any]) -> str:
    if not owner:
        return "an unreadable lock"
    return (f"pid {owner.get('pid')} on host {owner.get('host')}, started {owner.get('started')}"
            + (f": {owner['command']}" if owner.get("command") else ""))


def _create(path: pathlib.Path, command: str | None) -> None:
    record = {"pid": os.getpid(), "host": socket.gethostname(),
              "started": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
              "command": command or " ".join(sys.argv), "job": job_id()}
    text = json.dumps(record) + "\n"
    # The lock appears with its whole record: written to a private file, then hard-linked to its name
    # (link, like O_EXCL, fails when the name exists). Created empty and written after, a reader racing
    # the writer (a data-parallel job's other ranks, check_unlocked) saw "an unreadable lock" and refused.
    temporary = path.with_name(f"{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")  # hosts may share the dir
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            handle.write(text)
        try:
            os.link(temporary, path)
            return
        except FileExistsError:
            raise
        except OSError:  # a file system without hard links: O_EXCL, then the record
            pass
    finally:
        with contextlib.suppress(OSError):
            temporary.unlink()
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
        handle.write(text)


def _sweep_private_files(directory: pathlib.Path) -> None:
    """Remove the lock's private files (``.poros.lock.<host>.<pid>.tmp``) that dead processes of this host
    left (a kill between writing one and linking it)."""
    host = socket.gethostname()
    for stray in directory.glob(f"{LOCK_FILE}.{host}.*.tmp"):
        pid = stray.name[len(f"{LOCK_FILE}.{host}."):-len(".tmp")]
        if pid.isdigit() and not _pid_alive(int(pid)):
            with contextlib.suppress(OSError):
                stray.unlink()


def _acquire(directory: pathlib.Path, command: str | None) -> None:
    path = directory / LOCK_FILE
    _sweep_private_files(directory)
    for _ in range(2):  # a second try after removing a stale lock
        try:
            _create(path, command)
            return
        except FileExistsError:
            owner = read_lock(directory) or {}
            if owner.get("pid") == os.getpid() and owner.get("host") == socket.gethostname():
                logger.warning("poros: %s was left by an earlier run of this process; taking it over", path)
            elif is_stale(owner):
                logger.warning("poros: removing the stale lock %s (%s is no longer running)", path, _describe(owner))
            else:
                raise _locked(directory, owner) from None
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        except OSError as error:
            raise OutputDirError(
                f"cannot create {path}: {error.strerror or error}; expected a writable output directory. "
                f"{_fix_for(error)}"
            ) from None
    raise RunLockedError(f"{directory}: another run took the lock while a stale one was being replaced. Fix: "
                         "pass another --output-dir, or retry once that run is done.")


def _locked(directory: pathlib.Path, owner: dict[str, Any]) -> RunLockedError:
    return RunLockedError(
        f"{directory} is in use by another Poros run ({_describe(owner)}); expected one run per output directory. "
        f"Fix: wait for it to finish, or pass another --output-dir; if that run is over (another host, or a "
        f"reused pid), delete {directory / LOCK_FILE}."
    )


def check_unlocked(output_dir: str | os.PathLike) -> None:
    """Raise :class:`~poros.errors.RunLockedError` when another live run holds ``output_dir`` (no lock is taken)."""
    directory = pathlib.Path(output_dir)
    owner = read_lock(directory)
    for _ in range(UNREADABLE_RETRIES):  # a lock being written (file systems without hard links: see _create)
        if owner != {}:
            break
        time.sleep(0.1)
        owner = read_lock(directory)
    if owner is None or directory.resolve() in _HELD or is_stale(owner):
        return
    if owner.get("pid") == os.getpid() and owner.get("host") == socket.gethostname():
        return
    if owner.get("job") is not None and owner.get("job") == job_id():  # rank 0 of this torchrun job holds it
        return
    raise _locked(directory, owner)


def _fix_for(error: OSError) -> str:
    if error.errno == errno.ENOSPC:
        return "Fix: free disk space, or pass an --output-dir on another disk."
    if error.errno == errno.EROFS:
        return "Fix: pass an --output-dir on a writable file system."
    return "Fix: pass an --output-dir you can write to, or fix its permissions."


@contextlib.contextmanager
def hold(output_dir: str | os.PathLike, *, command: str | None = None) -> Iterator[pathlib.Path]:
    """Hold the exclusive lock on ``output_dir`` (created if missing) for the ``with`` block.

    Raises:
        RunLockedError: another live run holds it (named in the message).
        OutputDirError: ``output_dir`` is a file or cannot be written.
    """
    directory = pathlib.Path(output_dir)
    if directory.exists() and not directory.is_dir():
        raise OutputDirError(f"output_dir {directory} is a file; expected a directory for the adapter, checkpoints "
                             "and metrics. Fix: pass --output-dir a new or existing directory.")
    created = _first_missing(directory)  # a run that fails before writing anything leaves no empty directory
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise OutputDirError(f"cannot create output_dir {directory}: {error.strerror or error}. {_fix_for(error)}"
                             ) from None
    if not is_main_process():  # data parallel: rank 0 holds the lock for the job's ranks
        check_unlocked(directory)
        yield directory
        return
    key = directory.resolve()
    if _HELD.get(key):
        _HELD[key] += 1
        try:
            yield directory
        finally:
            _HELD[key] -= 1
        return
    _acquire(directory, command)
    _HELD[key] = 1
    try:
        yield directory
    finally:
        _HELD.pop(key, None)
        with contextlib.suppress(OSError):
            (directory / LOCK_FILE).unlink()
        _remove_if_empty(directory, created)


def _first_missing(directory: pathlib.Path) -> pathlib.Path | None:
    """The outermost of ``directory`` and its ancestors that does not exist yet (None: it exists)."""
    missing = None
    for path in (directory, *directory.parents):
        if path.exists():
            break
        missing = path
    return missing


def _remove_if_empty(directory: pathlib.Path, created: pathlib.Path | None) -> None:
    """Remove ``directory`` and its ancestors up to ``created`` (what :func:`hold` made) while they are empty."""
    if created is None:
        return
    for path in (directory, *directory.parents):
        try:
            path.rmdir()  # only an empty directory goes
        except OSError:
            return
        if path == created:
            return


def previous_results(output_dir: str | os.PathLike) -> list[str]:
    """The names of another run's results in ``output_dir``: the adapter, metrics, checkpoints."""
    from poros.training.checkpoint import CHECKPOINT_PREFIX

    directory = pathlib.Path(output_dir)
    if not directory.is_dir():
        return []
    found = [name for name in RESULT_FILES if (directory / name).is_file() and (directory / name).stat().st_size]
    found += sorted(p.name for p in directory.iterdir() if p.name.startswith(CHECKPOINT_PREFIX) and p.is_dir())
    return found


def check_fresh_start(output_dir: str | os.PathLike, *, overwrite: bool) -> None:
    """Refuse a fresh run into a directory holding another run's results, unless ``overwrite``.

    With ``overwrite`` the old checkpoints, ``metrics.jsonl`` and adapter are removed, so the
    directory never holds a mix of two runs.

    Raises:
        OutputDirError: results are there and ``overwrite`` is False; the message names them and
            both ways on (resume, or overwrite).
    """
    from poros.training.checkpoint import CHECKPOINT_PREFIX, remove_directory

    found = previous_results(output_dir)
    if not found:
        return
    directory = pathlib.Path(output_dir)
    if not overwrite:
        shown = ", ".join(found[:6]) + (f" and {len(found) - 6} more" if len(found) > 6 else "")
        resumable = any(name.startswith(CHECKPOINT_PREFIX) for name in found)
        raise OutputDirError(
            f"{directory} holds another run's results ({shown}); a fresh run would mix with or replace them"
            + ("" if resumable else " (it holds no checkpoint to resume)") + ". Fix: "
            + ("continue that run with --resume_from auto (resume_from='auto' in Python), " if resumable else "")
            + "pass another --output-dir (output_dir=), or --overwrite (overwrite=True) to replace them."
        )
    for name in found:
        path = directory / name
        if path.is_dir():
            remove_directory(path)
        else:
            path.unlink()
    if "adapter_model.safetensors" in found:  # the rest of that save: no half of the old adapter stays
        for name in ("adapter_config.json", "poros_config.json"):
            with contextlib.suppress(FileNotFoundError):
                (directory / name).unlink()
    logger.warning("poros: overwrite=True: removed the earlier run's %s from %s", ", ".join(found), directory)


__all__ = ["LOCK_FILE", "check_fresh_start", "check_unlocked", "hold", "is_stale", "previous_results", "read_lock"]
