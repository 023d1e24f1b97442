"""Which host tier holds the streamed blocks, for a host RAM budget; what host RAM a run needs, by part
(:func:`host_ram_parts`); and how fast the disk reads.

Torch-free: ``poros plan`` and ``poros doctor`` call it without loading anything. :func:`plan_host_tier`
is the one decision ``prepare`` and ``poros plan`` both take, from the blocks' bytes and the run's
options. The names are :data:`~poros.config.HOST_TIERS`; the tiers themselves are in
``poros/stream/tiers.py``; ``docs/cache-and-host-memory.md`` says when to use which.

* ``pinned`` -- every streamed block in one page-locked host arena: the whole NF4 base in page-locked RAM.
  The default when the budget holds it and the blocks are not an NF4 block cache entry's (``--no-cache``).
* ``mapped`` -- the NF4 block cache file mapped and registered for DMA: the OS page cache holds it,
  shared by every process of the node (data parallel ranks). Needs the same RAM as ``pinned`` once
  per node instead of once per process, and no copy at the start. The default when the budget holds the
  blocks and they were loaded through the block cache (one process, or a node's ranks mapping the one
  entry local rank 0 built): on the H200 its steps matched ``pinned`` and its start skipped the
  pinned copy (docs/results-h200.md).
* ``disk`` -- a ring of ``read_ahead`` pinned block buffers filled from the cache file ahead of use:
  host RAM of a few blocks, at the drive's read rate. What the budget holds beyond the ring keeps the
  first streamed blocks in pinned RAM for the run (``held_blocks``), so a step reads only the rest.
"""

from __future__ import annotations

import mmap
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

from poros.config import HOST_TIERS, parse_budget
from poros.errors import ConfigError
from poros.spellings import human_bytes

DEFAULT_READ_AHEAD = 3  # ring buffers of the disk tier: one copying, two read ahead
MAX_READ_AHEAD = 8
DISK_PROBE_BYTES = 512 << 20
# Large requests, as the disk tier's whole-block reads are: a virtual or NVMe drive with 16 MiB reads
# answered slower than the tier's block reads on the H200 host (docs/results-h200.md).
DISK_PROBE_CHUNK = 128 << 20


@dataclass(frozen=True)
class HostPlan:
    """The planner's host decision.

    Attributes:
        tier: ``pinned``, ``mapped`` or ``disk``.
        read_ahead: ring buffers of the disk tier (0 for the others).
        host_bytes: host RAM the tier holds for the blocks (pinned buffers, or the ring and the held
            blocks; for ``mapped`` the page cache's share, once per node).
        block_bytes: the streamed blocks' bytes together.
        reason: one line, why.
        ranks_per_node: the processes of the node that each stream the model (``LOCAL_WORLD_SIZE``).
        held_blocks: the disk tier's first streamed blocks kept in pinned RAM for the run (read once;
            a step reads only the others from the drive). 0 for the other tiers.
        notable: the run says ``reason`` (``prepare`` logs it, ``poros train`` prints it): a tier or a host
            budget was given, or the node has several ranks. Not in :meth:`to_dict`.
    """

    tier: str
    read_ahead: int
    host_bytes: int
    block_bytes: int
    reason: str
    ranks_per_node: int = 1
    held_blocks: int = 0
    notable: bool = field(default=False, compare=False)

    @property
    def host_bytes_per_node(self) -> int:
        """Host RAM of the node for the blocks: once for ``mapped`` (the page cache's one copy), once per rank else."""
        return self.host_bytes if self.tier == "mapped" else self.host_bytes * self.ranks_per_node

    def to_dict(self) -> dict:
        fields = {k: v for k, v in asdict(self).items() if k != "notable"}
        return {**fields, "host_bytes_per_node": self.host_bytes_per_node}


def choose_host_tier(block_bytes: list[int], host_budget: int | None = None, *, requested: str | None = None,
                     read_ahead: int | None = None, ranks_per_node: int = 1, shared_file: bool = False,
                     prequantized: bool = False) -> HostPlan:
    """Pick the host tier and the disk tier's read-ahead depth for the streamed blocks' ``block_bytes``.

    ``requested`` (a tier name) is taken as given; otherwise ``disk`` when a budget is set and below the
    streamed blocks: a ring of ``read_ahead`` buffers (default :data:`DEFAULT_READ_AHEAD`; at least 2,
    fewer if the budget holds fewer), and as many of the first streamed blocks as the rest of the budget
    holds kept in pinned RAM (``held_blocks``: each saves a read per pass); when the rest holds no block,
    the ring takes up to :data:`MAX_READ_AHEAD` buffers instead (``read_ahead`` given: that many); else
    ``mapped`` when ``shared_file`` (the blocks are views of an NF4 block cache entry, which the page
    cache then holds once for every process of the node, and nothing is copied at the start); else
    ``pinned`` (with several ranks and no shared file, each rank holds its own copy, and the reason
    says so).

    Raises:
        ConfigError: an unknown tier; a budget below two of the largest blocks (the disk tier's minimum).
    """
    total, largest = sum(block_bytes), max(block_bytes, default=0)
    if requested is not None and requested not in HOST_TIERS:
        raise ConfigError(f"host_tier={requested!r}: expected one of {', '.join(HOST_TIERS)}.")
    if read_ahead is not None and read_ahead < 2:
        raise ConfigError(f"read_ahead={read_ahead}: the disk tier needs at least 2 ring buffers (one copying to "
                          "the device, one being read). Pass 2 or more.")
    depth = read_ahead or DEFAULT_READ_AHEAD
    notable = requested is not None or host_budget is not None or ranks_per_node > 1
    if requested == "disk" or (requested is None and host_budget is not None and total > host_budget):
        held = 0
        if host_budget is not None:
            fits = host_budget // largest if largest else MAX_READ_AHEAD
            if fits < 2:
                raise ConfigError(
                    f"host budget {human_bytes(host_budget)} is below the disk tier's minimum: two ring buffers "
                    f"of the largest block, {human_bytes(2 * largest)}. Raise --host-budget to at least that.")
            depth = min(depth, fits)
            spare = host_budget - depth * largest
            while held < len(block_bytes) - 1 and block_bytes[held] <= spare:  # at least one block streams
                spare -= block_bytes[held]
                held += 1
            if not held and not read_ahead:
                depth = min(MAX_READ_AHEAD, fits)
        why = ("asked for" if requested else
               f"the streamed blocks ({human_bytes(total)}) exceed the host budget ({human_bytes(host_budget)})")
        kept = sum(block_bytes[:held])
        holding = f", the first {held} blocks ({human_bytes(kept)}) held in pinned RAM" if held else ""
        return HostPlan("disk", depth, depth * largest + kept, total,
                        f"disk tier, {depth} ring buffers{holding}: {why}", ranks_per_node, held, notable)
    shared = requested is None and shared_file
    if requested == "mapped" or shared:
        source = "pre-quantized checkpoint's shards" if prequantized else "NF4 block cache entry"
        why = "asked for" if not shared else (
            f"{ranks_per_node} ranks on this node map the {source}" + ("" if prequantized else " local rank 0 built")
            if ranks_per_node > 1 else f"the blocks come from the {source} (no copy into pinned memory)")
        return HostPlan("mapped", 0, total, total, f"mapped tier, {why}: the page cache holds the blocks "
                        f"({human_bytes(total)}) once, shared by every process of the node", ranks_per_node,
                        notable=notable)
    why = "asked for" if requested else ("no host budget given" if host_budget is None else
                                         f"the host budget holds every streamed block ({human_bytes(total)})")
    if ranks_per_node > 1:
        why += (f"; each of the node's {ranks_per_node} ranks holds its own copy ({human_bytes(total)} each, "
                f"{human_bytes(total * ranks_per_node)} per node)" + (
                    "" if requested else ": no block cache entry to share (--no-cache)"))
    return HostPlan("pinned", 0, total, total, f"pinned tier: {why}", ranks_per_node, notable=notable)


def plan_host_tier(block_bytes: Iterable[int], resident: Iterable[int] = (), *, host_tier: str | None = None,
                   host_budget: str | int | None = None, read_ahead: int | None = None, ranks_per_node: int = 1,
                   shared_file: bool = False, prequantized: bool = False) -> HostPlan:
    """The host tier a run gets: the one decision ``prepare`` (``poros.dropin.model``) and ``poros plan``
    (``poros.plan.run_plan``) both take. ``block_bytes`` are every block's packed bytes and ``resident``
    the indices of those kept on the device (the others stream); ``host_tier``, ``host_budget`` (bytes or
    ``"24GiB"``) and ``read_ahead`` are the run's options; ``ranks_per_node`` the node's processes that
    each stream the model; ``shared_file``: the blocks are views of an NF4 block cache entry (loaded, or
    to be loaded, through the cache), or with ``prequantized`` the checkpoint's own shards. See
    :func:`choose_host_tier`.

    Raises:
        ConfigError: an unparsable host budget, and as :func:`choose_host_tier`.
    """
    budget = parse_budget(host_budget, "host_budget") if host_budget is not None else None
    kept = set(resident)
    streamed = [n for i, n in enumerate(block_bytes) if i not in kept]
    return choose_host_tier(streamed, budget, requested=host_tier, read_ahead=read_ahead,
                            ranks_per_node=ranks_per_node, shared_file=shared_file, prequantized=prequantized)


def node_host_ram(footprint: Any, host: HostPlan, embeddings_on_host: bool, *, shared_tables: bool = False) -> dict:
    """Host bytes of a node's frozen base: the host tier's blocks (once for ``mapped``, once per rank else)
    and the host embedding tables (once when ``shared_tables``: the node's ranks map one copy of each when
    the model comes through the block cache; once per rank else); beside them the two bounds, one copy per
    rank and one shared copy. ``host_bytes_per_node`` is what the run will use. ``footprint`` is a
    ``poros.plan.budget.Footprint``."""
    ranks = host.ranks_per_node
    one = sum(footprint.block_bytes) + (footprint.host_embedding_bytes if embeddings_on_host else 0)
    tables = footprint.host_embedding_bytes if embeddings_on_host else 0
    return {"ranks_per_node": ranks, "host_tier": host.tier, "host_bytes_one_rank": one,
            "host_bytes_per_node": host.host_bytes_per_node + (tables if shared_tables and ranks > 1 else tables * ranks),
            "host_bytes_per_node_one_copy_per_rank": one * ranks, "host_bytes_per_node_shared": one}


#: the environment variable that sets the host RAM a run may use on this machine (bytes or ``"64GiB"``), in place of
#: what :func:`machine_host_ram` reads from the kernel: for planning another machine, and for tests
HOST_RAM_ENV = "POROS_HOST_RAM"
#: host RAM the process needs beside what the plan counts: Python, torch and CUDA's own host allocations,
#: the data pipeline (an estimate; ``poros plan`` compares the plan plus this with the machine)
PROCESS_HOST_BYTES = 4 << 30
_CGROUP_FILES = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),  # cgroup v2
                 ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"))  # v1


@dataclass(frozen=True)
class MachineRam:
    """The host RAM a run may use on this machine, and where the number comes from (for the messages)."""

    available: int
    source: str


def machine_host_ram(environ: dict | None = None, root: str = "/") -> MachineRam | None:
    """The host RAM this machine can give a run: :data:`HOST_RAM_ENV` when set, else the smaller of
    ``MemAvailable`` (``/proc/meminfo``) and the cgroup's limit less its usage (cgroup v2 ``memory.max``, or
    v1 ``memory.limit_in_bytes``); None where neither can be read (not Linux). ``root`` prefixes the kernel's
    files (tests).

    Raises:
        ConfigError: :data:`HOST_RAM_ENV` is not a size.
    """
    environ = os.environ if environ is None else environ
    given = environ.get(HOST_RAM_ENV)
    if given:
        return MachineRam(parse_budget(given, HOST_RAM_ENV), f"{HOST_RAM_ENV}={given}")
    found = []
    try:
        for line in Path(root, "proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append((int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"))
    except (OSError, ValueError, IndexError):
        pass
    for limit_file, usage_file in _CGROUP_FILES:
        try:
            limit = Path(root, limit_file.lstrip("/")).read_text().strip()
            usage = int(Path(root, usage_file.lstrip("/")).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 1 << 60:  # "max", or v1's "no limit" of 2^63 rounded to pages
            found.append((max(int(limit) - usage, 0), f"the cgroup's memory limit less its usage ({limit_file})"))
        break
    if not found:
        return None
    available, source = min(found)
    return MachineRam(available, source)


def measure_disk_read(directory: str | os.PathLike, size: int = DISK_PROBE_BYTES) -> dict:
    """Sequential read rate of the drive under ``directory``: write a fresh file of ``size`` random
    bytes, flush it, drop it from the page cache, and read it back in 128 MiB reads (``O_DIRECT``
    where the file system allows it, so the page cache cannot answer). Returns ``gb_per_s``
    (10^9 bytes), ``direct`` and ``bytes``; the file is removed."""
    directory = Path(directory).expanduser()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f".poros-read-probe-{os.getpid()}"
    chunk = mmap.mmap(-1, DISK_PROBE_CHUNK)  # page-aligned: O_DIRECT needs aligned buffers
    chunk.write(os.urandom(DISK_PROBE_CHUNK))
    size = max(DISK_PROBE_CHUNK, size // DISK_PROBE_CHUNK * DISK_PROBE_CHUNK)
    try:
        with open(path, "wb") as handle:
            for _ in range(size // DISK_PROBE_CHUNK):
                handle.write(chunk)
            handle.flush()
            os.fsync(handle.fileno())
        direct = hasattr(os, "O_DIRECT")
        try:
            fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        except OSError:
            direct, fd = False, os.open(path, os.O_RDONLY)
        try:
            if not direct and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            start, done = time.perf_counter(), 0
            while done < size:
                try:
                    count = os.preadv(fd, [chunk], done)
                except OSError:
                    if not direct:
                        raise
                    os.close(fd)
                    direct, fd = False, os.open(path, os.O_RDONLY)
                    continue
                if count == 0:
                    break
                done += count
            seconds = time.perf_counter() - start
        finally:
            os.close(fd)
    finally:
        chunk.close()
        path.unlink(missing_ok=True)
    return {"gb_per_s": done / seconds / 1e9 if seconds else None, "direct": direct, "bytes": done,
            "path": str(directory)}


def host_ram_parts(budget_plan: Any, host: HostPlan, footprint: Any) -> tuple[tuple[str, int], ...]:
    """The host RAM one rank's run needs, by part: the host tier's blocks, the host embedding tables, layer-major's
    boundary states (pinned on the host; on disk only the one in flight, twice: written and read), AdamW's state
    and the LoRA tensors when the plan keeps them there. ``poros plan`` prints them and their sum. ``budget_plan`` a
    ``poros.plan.budget_plan.BudgetPlan``, ``footprint`` its ``Footprint``."""
    from poros.plan.peak import kept_states

    micro = budget_plan.workload.grad_accum if budget_plan.workload.schedule == "layer-major" else 1
    one_state = footprint.boundary_bytes
    streamed = footprint.num_blocks - len(budget_plan.resident_blocks)
    lora_streamed = footprint.lora_parameter_bytes // max(footprint.num_blocks, 1) * streamed
    off_device = kept_states(footprint.num_blocks, budget_plan.boundary_every) - 1  # block 0's: the prelude's
    boundary = {"host": (f"boundary states, pinned ({micro} x {off_device} off the device)",
                         micro * off_device * one_state),
                "disk": ("boundary states: one in flight each way (the rest on disk)", 2 * one_state)}
    return tuple(part for part in (
        (f"blocks ({host.tier} tier)", host.host_bytes),
        ("embedding tables", footprint.host_embedding_bytes if budget_plan.embeddings_on_host else 0),
        boundary.get(budget_plan.boundary_states, ("boundary states", 0)),
        ("AdamW state (exp_avg, exp_avg_sq)", 2 * footprint.lora_parameter_bytes
         if budget_plan.optimizer_states == "host" else 0),
        ("LoRA parameters and gradients of the streamed blocks", 2 * lora_streamed
         if budget_plan.lora_placement == "host" else 0),
    ) if part[1])


__all__ = ["DEFAULT_READ_AHEAD", "HOST_RAM_ENV", "HOST_TIERS", "PROCESS_HOST_BYTES", "HostPlan", "MachineRam",
           "choose_host_tier", "host_ram_parts", "machine_host_ram", "measure_disk_read", "node_host_ram",
           "plan_host_tier"]
