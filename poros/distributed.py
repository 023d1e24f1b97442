"""Data parallel on torch.distributed: every rank streams its own blocks; the adapters' gradients
are all-reduced the way ``DistributedDataParallel`` does it for the resident model.

Poros brings no launcher and no reducer of its own for the ordinary case. Launch with ``torchrun``,
``accelerate launch`` or ``poros train --nproc-per-node N`` (``torch.distributed.run``); wrap the
model in DDP (HF ``Trainer``/TRL/accelerate do). The streamed autograd node of each block takes the
block's adapter parameters as inputs and returns their gradients, so DDP's reducer finds every
adapter in the forward graph and sees it ready exactly once per backward — the same buckets and the
same all-reduce as the resident run, hence the same bits (``docs/multi-gpu.md``).

Layer-major accumulation (``PorosModel.forward_backward``) runs the M micro-batches outside DDP's
forward, so it reduces here, with DDP's arithmetic: :func:`all_reduce_gradients`.

Notable pieces:

* :func:`init_process_group`: gloo on CPU, NCCL on CUDA, a timeout, and a version handshake
  (:func:`check_same_versions`) so mismatched ranks fail at start with a clear error on every rank.
* :func:`all_reduce_gradients`: DDP's bucketed all-reduce (``grad * (1/N)`` into the bucket, SUM,
  copy back), buckets assigned as DDP assigns them.
* :func:`shared_host_copy`: the seam where the ranks of a node share one host copy of the base.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Iterator

from poros.errors import DistributedError

if TYPE_CHECKING:
    import torch

#: seconds a collective may wait for a lost rank before every rank fails (POROS_DIST_TIMEOUT overrides)
DEFAULT_TIMEOUT_S = 600.0
#: DDP's defaults (torch.nn.parallel.distributed): 25 MiB buckets, a 1 MiB first bucket
DDP_BUCKET_CAP_MB = 25
DDP_FIRST_BUCKET_BYTES = 1024 * 1024


@dataclass(frozen=True)
class World:
    """Where this process stands: ``rank`` of ``size`` ranks, ``local_rank`` of ``local_size`` on its node."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the one rank that writes checkpoints, adapters and metrics."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


def world() -> World:
    """This process's place, from the initialized process group or torchrun's environment."""
    env = os.environ
    size = int(env.get("WORLD_SIZE", "1"))
    rank = int(env.get("RANK", "0"))
    with contextlib.suppress(ImportError):
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            size, rank = dist.get_world_size(), dist.get_rank()
    return World(rank=rank, size=size, local_rank=int(env.get("LOCAL_RANK", "0")),
                 local_size=int(env.get("LOCAL_WORLD_SIZE", str(size))))


def reducing() -> bool:
    """True when a process group with more than one rank is initialized: gradients must be averaged."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def launched_by_torchrun() -> bool:
    """True in a process torchrun (``torch.distributed.run``) started: its rendezvous variables are set."""
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def timeout_seconds() -> float:
    return float(os.environ.get("POROS_DIST_TIMEOUT", DEFAULT_TIMEOUT_S))


def init_process_group(device: "torch.device | str | None" = None, backend: str | None = None) -> World:
    """Join the torchrun job (once): NCCL when ``device`` is CUDA, else gloo; collectives time out
    after :func:`timeout_seconds` (``POROS_DIST_TIMEOUT``). Then every rank checks that all ranks
    run the same Poros, torch, transformers, PEFT and bitsandbytes (:func:`check_same_versions`).

    Raises:
        DistributedError: the ranks' versions differ (on every rank, naming the ranks and versions).
    """
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        kind = torch.device(device).type if device is not None else "cpu"
        backend = backend or os.environ.get("POROS_DIST_BACKEND") or ("nccl" if kind == "cuda" else "gloo")
        options: dict[str, Any] = {"backend": backend,
                                   "timeout": datetime.timedelta(seconds=timeout_seconds())}
        if backend == "nccl" and device is not None:
            options["device_id"] = torch.device(device)
        dist.init_process_group(**options)
    check_same_versions()
    return world()


def versions() -> dict[str, str]:
    """The versions that decide the bits: every rank must run the same."""
    import importlib.metadata as metadata

    import poros

    found = {"poros": poros.__version__}
    for name in ("torch", "transformers", "peft", "bitsandbytes"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "absent"
    return found


def check_same_versions(mine: dict[str, str] | None = None) -> None:
    """All-gather every rank's :func:`versions`; raise the same error on every rank if they differ."""
    import torch.distributed as dist

    mine = versions() if mine is None else mine
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    differing = sorted({name for found in gathered for name in found if found.get(name) != gathered[0].get(name)})
    if differing:
        detail = "; ".join(f"rank {r}: " + ", ".join(f"{n} {found.get(n)}" for n in differing)
                           for r, found in enumerate(gathered))
        raise DistributedError(
            f"the ranks run different versions of {', '.join(differing)} ({detail}); data-parallel parity needs "
            "the same software on every rank. Install the same versions on every node (pip freeze on rank 0).")


def check_batch_divides(global_batch: int, world_size: int) -> int:
    """The per-rank batch of a global batch; refuse a world size that does not divide it."""
    if global_batch % world_size:
        raise DistributedError(
            f"a global batch of {global_batch} sequences cannot be split over {world_size} ranks "
            f"({global_batch} % {world_size} = {global_batch % world_size}); every rank must take the same number. "
            f"Use a global batch that is a multiple of {world_size}, or {world_size} ranks that divide it.")
    return global_batch // world_size


# ---------------------------------------------------------------------------------------------
# DDP's all-reduce, for gradients accumulated outside DDP's forward (layer-major accumulation)
# ---------------------------------------------------------------------------------------------
def ddp_buckets(parameters: list["torch.Tensor"], bucket_cap_mb: int = DDP_BUCKET_CAP_MB,
                first_bucket_bytes: int = DDP_FIRST_BUCKET_BYTES) -> list[list[int]]:
    """Parameter indices per bucket, in reduction order, as ``DistributedDataParallel(
    find_unused_parameters=True)`` assigns them (HF Trainer's choice for PEFT models): sized over the
    parameters in registration order, the list of buckets reversed (the last parameters' gradients
    are ready first)."""
    import torch.distributed as dist

    limits = [first_bucket_bytes, bucket_cap_mb * 1024 * 1024] if first_bucket_bytes < bucket_cap_mb * 1024 * 1024 \
        else [bucket_cap_mb * 1024 * 1024]
    indices, _ = dist._compute_bucket_assignment_by_size(parameters, limits, [False] * len(parameters))
    return list(reversed(indices))


def all_reduce_gradients(parameters: Iterable["torch.Tensor"], group=None, *, bucket_cap_mb: int = DDP_BUCKET_CAP_MB,
                         first_bucket_bytes: int = DDP_FIRST_BUCKET_BYTES) -> None:
    """Average ``.grad`` over the ranks the way DDP's reducer does at a synchronizing backward.

    Per bucket (:func:`ddp_buckets`): each gradient is multiplied by ``1/world_size`` into its slot of
    a flat bucket (DDP's ``mul_out`` with a wrapped double scalar), the bucket is all-reduced with SUM,
    and each slot is copied back into ``.grad``. A parameter without a gradient contributes zeros and
    keeps no gradient, as in DDP with ``find_unused_parameters``.
    """
    import torch
    import torch.distributed as dist

    parameters = [p for p in parameters if p.requires_grad]
    size = dist.get_world_size(group)
    if size == 1 or not parameters:
        return
    for bucket in ddp_buckets(parameters, bucket_cap_mb, first_bucket_bytes):
        members = [parameters[i] for i in bucket]
        flat = torch.zeros(sum(p.numel() for p in members), dtype=members[0].dtype, device=members[0].device)
        offset = 0
        views = []
        for parameter in members:
            view = flat[offset:offset + parameter.numel()].view_as(parameter)
            if parameter.grad is not None:
                torch.mul(parameter.grad, 1.0 / size, out=view)
            views.append(view)
            offset += parameter.numel()
        dist.all_reduce(flat, group=group)
        for parameter, view in zip(members, views):
            if parameter.grad is not None:
                parameter.grad.copy_(view)


# ---------------------------------------------------------------------------------------------
# One host copy per node
# ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def shared_host_copy() -> Iterator[World]:
    """Build the node's host copy of the base once: local rank 0 runs the body first, the node's other
    ranks wait on a barrier and then run it (finding what local rank 0 built, e.g. the NF4 block cache).

    This is the seam for the ``mapped`` host tier (the NF4 block cache mapped read-only and shared
    through the page cache): with it, the body of the other ranks maps the file local rank 0 wrote
    instead of quantizing again, and the node holds one copy. Without a process group it just runs.
    """
    import torch.distributed as dist

    here = world()
    grouped = dist.is_available() and dist.is_initialized() and here.local_size > 1
    if grouped and here.local_rank != 0:
        dist.barrier()  # local rank 0 builds first
    try:
        yield here
    finally:
        if grouped and here.local_rank == 0:
            dist.barrier()  # release the others
