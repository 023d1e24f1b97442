"""The NF4 block cache: quantize a checkpoint once, start every later run from the packed blocks.

An entry is a directory under the cache root (``cache_dir``, else ``$POROS_CACHE_DIR``, else
``~/.cache/poros``) named ``<model>-<key>``::

    manifest.json   what the entry is: model, checkpoint, quantization, versions, and per block its
                    offset, size, checksum (xxh3_64; crc32 where xxhash is missing) and tensor
                    layout (names, dtypes, shapes, bitsandbytes quantization state); the last line is
                    the crc32 of the lines above it
    blocks.bin      each decoder block's packed buffer -- exactly the bytes the block store streams --
                    at a 4 KiB-aligned offset (``poros.stream.block_file.BlockFile``)
    last-use        empty; its modification time is the entry's last use

The key hashes everything that changes those bytes: the checkpoint's identity (every weight file's
name, size and modification time, ``config.json``'s content, the revision), the quantization
(nf4/fp4, double quantization, compute dtype, block size, storage dtype), the compute device's kind
(blocks are quantized there), the family and its block path, and the versions of bitsandbytes,
transformers, torch and this format. Entries are written to a temporary directory and renamed into
place (atomic); a lock file lets one process of a node build an entry while the others wait and then
map it (:func:`build_lock`). Before any training, an entry is checked in full (manifest crc, file
size, every block's checksum): a damaged entry is reported in one line and rebuilt, never trained on.

Listing and clearing (``poros cache``) import no torch.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import logging
import os
import re
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from poros.errors import CacheEntryError

logger = logging.getLogger("poros")

FORMAT_VERSION = 2  # 2: a per-block "checksum" of the manifest's kind (xxh3_64 or crc32) replaced "crc32"
MANIFEST = "manifest.json"
BLOCKS = "blocks.bin"
LAST_USE = "last-use"
DEFAULT_ROOT = "~/.cache/poros"


def cache_root(configured: str | os.PathLike | None = None) -> Path:
    """The cache root: ``configured``, else ``$POROS_CACHE_DIR``, else ``~/.cache/poros``."""
    return Path(configured or os.environ.get("POROS_CACHE_DIR") or DEFAULT_ROOT).expanduser()


def prepare_root(root: Path) -> None:
    """Create the cache root and prove it writable (a file created and removed: ``os.access`` says yes to
    root on a read-only mount, and an existing directory passes ``mkdir``).

    Raises:
        OSError: the root cannot be created or written (read-only file system, under a file, no permission).
    """
    import tempfile

    root.mkdir(parents=True, exist_ok=True)
    descriptor, name = tempfile.mkstemp(prefix=".poros-write-test-", dir=root)
    os.close(descriptor)
    with contextlib.suppress(OSError):
        os.unlink(name)


def unusable_root_warning(root: Path, problem: OSError) -> str:
    """The one WARNING line for a cache root that cannot be written: where the root came from, that the run
    goes on without the cache, and both fixes. A cache is an optimisation: a run never stops for it."""
    environment = os.environ.get("POROS_CACHE_DIR")
    source = ("POROS_CACHE_DIR" if environment and Path(environment).expanduser() == Path(root)
              else f"the default {DEFAULT_ROOT}" if Path(root) == Path(DEFAULT_ROOT).expanduser() else "cache_dir")
    return (f"poros: cannot use the NF4 block cache at {root} ({problem.strerror or problem}; the directory comes "
            f"from {source}); training without the cache, so this start quantizes the checkpoint as every start "
            "will. Fix: set POROS_CACHE_DIR (or cache_dir) to a writable directory, or pass --no-cache to skip the "
            "cache and this warning.")


def package_versions() -> dict[str, str]:
    """The entry format and the versions that decide the packed bytes (part of an entry's key)."""
    from poros.packages import versions

    return {"format": str(FORMAT_VERSION), **versions(("bitsandbytes", "transformers", "torch"))}


def checkpoint_identity(path: Path, weight_files: list[Path], revision: str | None = None) -> dict[str, Any]:
    """What identifies a checkpoint's bytes without reading them: each weight file's size and mtime,
    the content of ``config.json``, the revision (and a hub snapshot's commit, its directory name)."""
    config = Path(path) / "config.json"
    return {
        "files": [[file.name, file.stat().st_size, file.stat().st_mtime_ns] for file in sorted(weight_files)],
        "config_sha256": hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else None,
        "revision": revision,
        "snapshot": Path(path).resolve().name,
    }


def entry_key(fields: dict[str, Any]) -> str:
    """The entry key: sha256 of the canonical JSON of ``fields`` (24 hex digits)."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:24]


def entry_name(model: str, key: str) -> str:
    slug = re.sub(r"[^A-Za-z0-9._-]+", "--", model.strip("/"))[-60:] or "model"
    return f"{slug}-{key}"


def _manifest_bytes(manifest: dict[str, Any]) -> bytes:
    body = json.dumps(manifest, indent=1, sort_keys=True).encode()
    return body + b"\ncrc32 %08x\n" % zlib.crc32(body)


def read_manifest(directory: Path) -> dict[str, Any]:
    """The manifest of an entry directory.

    Raises:
        CacheEntryError: missing, or its bytes do not match their crc32 (damaged).
    """
    try:
        raw = (directory / MANIFEST).read_bytes()
    except OSError as exc:
        raise CacheEntryError(f"{directory.name}: no readable {MANIFEST} ({exc.strerror})") from exc
    body, _, tail = raw.rstrip(b"\n").rpartition(b"\n")
    match = re.fullmatch(rb"crc32 ([0-9a-f]{8})", tail)
    if not match or int(match.group(1), 16) != zlib.crc32(body):
        raise CacheEntryError(f"{directory.name}: {MANIFEST} is damaged (its crc32 does not match)")
    try:
        return json.loads(body)
    except ValueError as exc:
        raise CacheEntryError(f"{directory.name}: {MANIFEST} is damaged ({exc})") from exc


@dataclass
class CacheEntry:
    """One entry: its directory and manifest."""

    directory: Path
    manifest: dict[str, Any]

    @property
    def blocks_path(self) -> Path:
        return self.directory / BLOCKS

    def block_file(self):
        """The entry's blocks as a ``poros.stream.block_file.BlockFile`` (imports torch)."""
        from poros.stream.block_file import BlockFile

        blocks = self.manifest["blocks"]
        return BlockFile(self.blocks_path, [b["offset"] for b in blocks], [b["nbytes"] for b in blocks],
                         [b["checksum"] for b in blocks], algorithm=self.manifest["checksum"])

    def check_size(self) -> None:
        """Check that ``blocks.bin`` has the size the manifest gives it (cheap: no byte is read).

        Raises:
            CacheEntryError: the entry is truncated or its file was replaced.
        """
        file = self.block_file()
        size = self.blocks_path.stat().st_size if self.blocks_path.is_file() else -1
        if size != file.size:
            raise CacheEntryError(f"{self.directory.name}: {BLOCKS} is {size} bytes, the manifest says {file.size} "
                                  "(truncated or replaced)")

    def verify(self, *, stop=None) -> None:
        """Check the file size and every block's checksum (reads the whole file, a thread per core up to 16).
        ``stop`` (a ``threading.Event``): once set, the check ends early and raises.

        Raises:
            CacheEntryError: the entry is truncated, a block's bytes changed, or ``stop`` was set.
        """
        from poros.stream.block_file import checksum_file

        self.check_size()
        file = self.block_file()
        try:
            found = checksum_file(file, workers=min(16, os.cpu_count() or 1), stop=stop)
        except (KeyError, ImportError) as problem:  # a kind this install cannot compute (no xxhash): rebuild
            raise CacheEntryError(f"{self.directory.name}: its checksums are {file.algorithm}, which this "
                                  f"installation cannot compute ({problem!r})") from problem
        if stop is not None and stop.is_set():
            raise CacheEntryError(f"{self.directory.name}: check stopped before it ended")
        bad = [i for i, (a, b) in enumerate(zip(found, file.checksums)) if a != b]
        if bad:
            raise CacheEntryError(f"{self.directory.name}: block {bad[0]} fails its checksum ({file.algorithm})"
                                  f"{f' (and {len(bad) - 1} more)' if len(bad) > 1 else ''}")

    def touch(self) -> None:
        (self.directory / LAST_USE).touch()


def open_entry(root: Path, name: str, *, verify: bool = True) -> CacheEntry | None:
    """The entry ``name`` under ``root``, or None when there is none. Its manifest and file size are
    always checked; every block's checksum too unless ``verify`` is False (the caller then runs
    :meth:`CacheEntry.verify` itself before training, e.g. while it reads the non-block weights).

    Raises:
        CacheEntryError: the entry exists but is damaged (the caller rebuilds it).
    """
    directory = Path(root) / name
    if not directory.is_dir():
        return None
    entry = CacheEntry(directory, read_manifest(directory))
    entry.verify() if verify else entry.check_size()
    return entry


def remove_entry(directory: Path) -> None:
    """Delete an entry (renamed aside first, so a reader never sees half of it)."""
    doomed = directory.with_name(f".removing-{directory.name}-{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        os.replace(directory, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def write_entry(root: Path, name: str, manifest: dict[str, Any], write_blocks) -> CacheEntry:
    """Write an entry atomically: ``write_blocks(path)`` writes ``blocks.bin`` into a temporary directory
    and returns the per-block ``(offset, nbytes, checksum)``, computed the way ``manifest["checksum"]``
    names (``poros.stream.block_file.CHECKSUMS``; crc32 when it names none); the manifest follows, then one
    rename. When another process renamed its copy first, that one is kept and returned."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    temporary = root / f".tmp-{name}-{os.getpid()}"
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir()
    try:
        placed = write_blocks(temporary / BLOCKS)
        manifest.setdefault("checksum", "crc32")
        for record, (offset, nbytes, checksum) in zip(manifest["blocks"], placed):
            record.update(offset=offset, nbytes=nbytes, checksum=checksum)
        (temporary / MANIFEST).write_bytes(_manifest_bytes(manifest))
        (temporary / LAST_USE).touch()
        with open(temporary / BLOCKS, "rb") as handle:
            os.fsync(handle.fileno())
        try:
            os.rename(temporary, root / name)
        except OSError:  # another process put its copy there first
            shutil.rmtree(temporary, ignore_errors=True)
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
    return CacheEntry(root / name, read_manifest(root / name))


@contextlib.contextmanager
def build_lock(root: Path, name: str) -> Iterator[None]:
    """Hold ``<root>/<name>.lock`` (an exclusive ``flock``) while looking an entry up and building it.

    This is the "one host copy per node" building block for data parallel: every local rank calls
    ``load_pretrained(..., cache_dir=...)``; the first to take the lock quantizes and writes the
    entry, the others wait on the lock, then find the entry and map it (``host_tier="mapped"``
    shares the pages of the OS page cache between them).
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{name}.lock", "a+") as handle:
        try:
            import fcntl

            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        except ImportError:  # not POSIX: no lock, last rename wins (entries are written atomically)
            pass
        yield


# -- listing (torch-free) ----------------------------------------------------------------------
@dataclass
class EntrySummary:
    name: str
    model: str
    config: str
    size: int
    last_use: datetime.datetime | None
    problem: str | None = None


def list_entries(root: Path) -> list[EntrySummary]:
    """Every entry under ``root``, newest use first; a damaged manifest is listed with its problem."""
    summaries = []
    root = Path(root)
    for directory in sorted(root.iterdir()) if root.is_dir() else []:
        if not directory.is_dir() or directory.name.startswith("."):
            continue
        size = sum(f.stat().st_size for f in directory.iterdir() if f.is_file())
        stamp = directory / LAST_USE
        last_use = datetime.datetime.fromtimestamp(stamp.stat().st_mtime) if stamp.exists() else None
        try:
            manifest = read_manifest(directory)
        except CacheEntryError as exc:
            summaries.append(EntrySummary(directory.name, "?", "?", size, last_use, str(exc)))
            continue
        quant = manifest.get("quantization", {})
        config = (f"{quant.get('quant_type', '?')}{'+dq' if quant.get('double_quant') else ''} "
                  f"{quant.get('compute_dtype', '?')} {manifest.get('device_type', '?')}")
        summaries.append(EntrySummary(directory.name, manifest.get("model", "?"), config, size, last_use))
    return sorted(summaries, key=lambda s: s.last_use or datetime.datetime.min, reverse=True)


def clear(root: Path, model: str | None = None) -> list[str]:
    """Remove every entry under ``root`` (or those of ``model``); returns the names removed."""
    removed = []
    named = re.compile(re.escape(entry_name(model, "")) + "[0-9a-f]{24}") if model is not None else None
    for summary in list_entries(root):
        if model is None or summary.model == model or named.fullmatch(summary.name):
            remove_entry(Path(root) / summary.name)
            removed.append(summary.name)
    if model is None and Path(root).is_dir():
        # Leftovers: entries renamed aside, and temporaries of builds whose process is gone. Lock files
        # stay (empty, and a build may hold one now: a new file in its place would let a second build
        # in), and so does the temporary of a build that is still running.
        for stray in Path(root).iterdir():
            if stray.name.startswith(".removing-") or (stray.name.startswith(".tmp-") and not _alive(stray)):
                (shutil.rmtree if stray.is_dir() else os.remove)(stray)
    return removed


def _alive(temporary: Path) -> bool:
    """Whether the process that names ``.tmp-<entry>-<pid>`` still runs on this host."""
    try:
        os.kill(int(temporary.name.rsplit("-", 1)[1]), 0)
    except (ValueError, IndexError, ProcessLookupError):
        return False
    except PermissionError:  # another user's process
        return True
    return True


__all__ = ["CacheEntry", "CacheEntryError", "EntrySummary", "FORMAT_VERSION", "build_lock", "cache_root",
           "checkpoint_identity", "clear", "entry_key", "entry_name", "list_entries", "open_entry", "package_versions",
           "prepare_root", "read_manifest", "remove_entry", "unusable_root_warning", "write_entry"]
