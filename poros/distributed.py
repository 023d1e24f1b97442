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

import atexit
import contextlib
import datetime
import os
import time
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
#: seconds :func:`leave_process_group` waits (GIL released) for gloo's workers to drop their last work
DRAIN_SECONDS = 0.1


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


def is_main_process() -> bool:
    """False in a rank other than 0 of a torchrun job (torch-free: from torchrun's ``RANK``)."""
    return os.environ.get("RANK", "0") == "0"


def job_id() -> str | None:
    """The torchrun job this process is a rank of (its run id at its rendezvous address), or None:
    the ranks of one job share its ``output_dir`` lock (:mod:`poros.training.run_lock`). Torch-free."""
    if not launched_by_torchrun():
        return None
    env = os.environ
    return f"{env.get('TORCHELASTIC_RUN_ID', 'none')}@{env['MASTER_ADDR']}:{env['MASTER_PORT']}"


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
        if backend == "gloo":
            # a process that exits with gloo's group alive may abort in its worker threads' teardown
            # ("terminate called without an active exception", SIGABRT: 8 of 20 two-rank jobs here), so
            # the group Poros made is left while the interpreter is still whole. (Not NCCL's: after a
            # failed collective its destroy may wait on the stuck communicator; torch only warns there.)
            atexit.register(_leave_at_exit, dist.group.WORLD)
    check_same_versions()
    return world()


def leave_process_group(*, barrier: bool = True) -> None:
    """Leave the job: destroy the default process group (a no-op without one, and on a second call).

    With ``barrier`` every rank first waits until all ranks got here (call it where every rank
    arrives: ``poros train`` does once training finished; at the end of your own script, before
    ``trainer.end()``). Then a pause of :data:`DRAIN_SECONDS` with the GIL released lets gloo's
    worker threads finish destroying their last work objects, which takes the GIL: a group dropped
    while one of them waits for it deadlocks (seen here: ``~ProcessGroupGloo`` joining a worker stuck
    in ``~AsyncAllgatherWork``, when a DDP wrapper dropped the last reference) or, at interpreter exit,
    aborts the process ("terminate called without an active exception"). The pause makes that race
    rare, not impossible (a reference held elsewhere, a DDP wrapper's, outlives the destroy). At exit
    Poros calls it without the barrier (a rank that failed must not wait for the others).
    """
    with contextlib.suppress(ImportError):
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            if barrier and dist.get_world_size() > 1:
                dist.barrier()
            time.sleep(DRAIN_SECONDS)  # releases the GIL
            dist.destroy_process_group()


def _leave_at_exit(made: Any) -> None:
    """At exit: leave the group Poros made, if it is still the default one (not one made after it)."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.group.WORLD is made:
        leave_process_group(barrier=False)


def join_launched_job(device: "torch.device") -> "torch.device":
    """In a process torchrun started: this rank's device (``cuda:LOCAL_RANK`` when ``device`` is CUDA)
    and the process group (:func:`init_process_group`). Elsewhere ``device`` as it is."""
    import torch

    if not launched_by_torchrun():
        return device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    init_process_group(device)
    return device


def versions() -> dict[str, str]:
    """The versions that decide the bits: every rank must run the same."""
    import poros
    from poros.packages import BITS_PACKAGES
    from poros.packages import versions as installed

    return {"poros": poros.__version__, **installed(BITS_PACKAGES)}


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
    and each slot is copied back into ``.grad``. As in DDP with ``find_unused_parameters``, a parameter
    without a gradient here contributes zeros; it receives the reduced gradient when another rank used it
    (its use is all-reduced first, like DDP's used map), and keeps none when no rank did — so every rank
    steps the same parameters (an MoE expert's adapter that one rank's batch never reached, say).
    """
    import torch
    import torch.distributed as dist

    parameters = [p for p in parameters if p.requires_grad]
    size = dist.get_world_size(group)
    if size == 1 or not parameters:
        return
    used = torch.tensor([p.grad is not None for p in parameters], dtype=torch.int32, device=parameters[0].device)
    dist.all_reduce(used, op=dist.ReduceOp.MAX, group=group)
    used_anywhere = used.tolist()
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
        for index, parameter, view in zip(bucket, members, views):
            if parameter.grad is not None:
                parameter.grad.copy_(view)
            elif used_anywhere[index]:
                parameter.grad = view.clone()


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


# ---------------------------------------------------------------------------------------------
# PorosTrainer's side: one object the training loop asks (a no-op on one process)
# ---------------------------------------------------------------------------------------------
class DataParallel:
    """What ``PorosTrainer`` needs to train data-parallel, and nothing when there is one rank.

    The global batch (``batch_size``) is drawn the same way on every rank (same seed, same order)
    and rank ``r`` trains rows ``[r*b, (r+1)*b)`` of it, ``b = batch_size / world_size``: a
    deterministic shard, and a data position that is the same on every rank (checkpoints hold one).
    Micro-major steps go through ``DistributedDataParallel`` (``no_sync`` on all but the last
    micro-batch); layer-major steps reduce in ``PorosModel.forward_backward``. Only rank 0 writes.

    Args:
        model: the :class:`~poros.dropin.model.PorosModel` (its frozen tensors are left out of DDP: each
            rank loaded the same base, and broadcasting it would move the whole model).
        device: the compute device.
        global_batch: ``batch_size`` of the run, split over the ranks.

    Raises:
        DistributedError: the world size does not divide ``global_batch``.
    """

    def __init__(self, model, device, global_batch: int) -> None:
        self.world = world()
        self.active = reducing()
        self.model = model
        self.per_rank_batch = check_batch_divides(global_batch, self.world.size) if self.active else global_batch
        self.ddp = None
        if self.active:
            from torch.nn.parallel import DistributedDataParallel

            frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
            frozen += [name for name, _ in model.named_buffers()]
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, frozen)
            self.ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)

    @property
    def is_main(self) -> bool:
        return self.world.is_main

    def describe(self, global_batch: int, grad_accum: int) -> str:
        return (f"poros: data parallel over {self.world.size} ranks ({dist_backend()}): global batch {global_batch} "
                f"= {self.per_rank_batch} per rank x {self.world.size} ranks, x {grad_accum} accumulation = "
                f"{global_batch * grad_accum} sequences per optimizer step")

    def shard(self, batch: dict[str, Any]) -> dict[str, Any]:
        """This rank's rows of a global batch."""
        if not self.active:
            return batch
        start = self.world.rank * self.per_rank_batch
        return {key: value[start:start + self.per_rank_batch] for key, value in batch.items()}

    def forward_model(self, micro_batch: int, micro_batches: int):
        """``(callable, context)`` for one micro-major micro-batch: DDP, without sync but at the last."""
        if not self.active:
            return self.model, contextlib.nullcontext()
        return self.ddp, (self.ddp.no_sync() if micro_batch < micro_batches - 1 else contextlib.nullcontext())

    def mean(self, values: "torch.Tensor") -> "torch.Tensor":
        """The mean over ranks of a tensor (losses for the log)."""
        import torch.distributed as dist

        if not self.active:
            return values
        total = values.detach().clone()
        dist.all_reduce(total)
        return total / self.world.size

    def total(self, value: "torch.Tensor | int", device) -> int:
        """The sum over ranks of a count (tokens for the log)."""
        import torch
        import torch.distributed as dist

        if not self.active:
            return int(value)
        tensor = torch.as_tensor(value, device=device, dtype=torch.float64).clone()
        dist.all_reduce(tensor)
        return int(tensor.item())

    def any_rank(self, flag: bool, device) -> bool:
        """True on every rank when ``flag`` is true on any rank (a stop request)."""
        import torch
        import torch.distributed as dist

        if not self.active:
            return flag
        tensor = torch.tensor([1.0 if flag else 0.0], device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return bool(tensor.item())

    def barrier(self) -> None:
        import torch.distributed as dist

        if self.active:
            dist.barrier()

    def check_resume(self, trainer_state: dict[str, Any], path) -> None:
        """Refuse to resume a checkpoint written by another number of ranks."""
        saved = int(trainer_state.get("world_size", 1))
        if saved != self.world.size:
            raise DistributedError(
                f"{path} was written by a run over {saved} rank(s); this run has {self.world.size}. The data shards "
                f"and the global batch depend on it. Resume with {saved} rank(s) in all (on one node `poros train "
                f"--nproc-per-node {saved}`; over several, the saved run's torchrun --nnodes and --nproc-per-node), "
                "or start a fresh run in another output_dir.")


#: DDP's own opt-out list, read by ``DistributedDataParallel.__init__`` from the module it wraps (what
#: ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model`` writes)
DDP_IGNORE_ATTRIBUTE = "_ddp_params_and_buffers_to_ignore"


def host_parameter_names(model: Any, host_modules: Iterable[Any]) -> list[str]:
    """Names (as ``model.named_parameters()`` gives them) of the parameters of ``host_modules``: the frozen
    embedding tables Poros keeps in host memory. DDP refuses a module whose parameters sit on two device
    types ("input module parameters locate in {'cuda', 'cpu'}"); these tables are frozen (nothing to
    all-reduce) and equal on every rank, so a prepared model names them in DDP's opt-out list, and the
    trainable parameters DDP reduces stay exactly the resident run's."""
    held = {id(p) for module in host_modules for p in module.parameters()}
    return [name for name, p in model.named_parameters() if id(p) in held]


def dist_backend() -> str:
    import torch.distributed as dist

    return dist.get_backend() if dist.is_available() and dist.is_initialized() else "none"


# ---------------------------------------------------------------------------------------------
# `poros train --nproc-per-node N`: torchrun, in process
# ---------------------------------------------------------------------------------------------
def launch(nproc_per_node: int, module_arguments: list[str]) -> int:
    """Start ``python -m poros <module_arguments>`` on ``nproc_per_node`` local ranks through
    ``torch.distributed.run`` (what ``torchrun --standalone`` runs) and wait for them.

    Returns the exit status: 0, 130 when every rank stopped on a signal after saving, else 1 (the
    launcher has printed which rank failed and why).
    """
    import sys

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    if nproc_per_node < 1:
        raise DistributedError(f"--nproc-per-node {nproc_per_node}: expected 1 or more processes per node.")
    argv = ["--standalone", "--nproc-per-node", str(nproc_per_node), "-m", "poros", *module_arguments]
    print(f"poros: starting {nproc_per_node} ranks: torchrun {' '.join(argv)}", flush=True)
    try:
        run(get_args_parser().parse_args(argv))
    except SignalException as stopped:  # the ranks got the signal too; the launcher waited for them to exit
        print(f"poros: {signal_name(stopped.sigval)} received; the ranks stopped (rank 0 printed the checkpoint it "
              "saved, if a step was done).", file=sys.stderr)
        return 130
    except ChildFailedError as failed:
        codes = {failure.exitcode for failure in failed.failures.values()}
        if codes == {130}:
            return 130
        first = min(failed.failures.items())
        print(f"poros: rank {first[0]} failed with exit status {first[1].exitcode}; every rank was stopped.",
              file=sys.stderr)
        return 1
    return 0


def signal_name(number: int) -> str:
    import signal

    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
