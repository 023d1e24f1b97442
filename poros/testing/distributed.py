"""Data-parallel parity, run by every rank of a torchrun job: Poros under DDP vs resident under DDP.

::

    python -m torch.distributed.run --nproc-per-node 2 -m poros.testing.distributed \\
        --out OUT --cases qwen3:default,gemma4:e2b --modes micro,accum,layer_major,hf_prepare,hf_patch

Each rank trains the same tiny checkpoint twice on its own shard of the data (rank-seeded
batches): once resident (``DistributedDataParallel`` over the PEFT model, as loaded) and once
streamed (``poros.prepare`` / ``patch_hf_model``, then DDP, or layer-major accumulation), and writes
``OUT/rank{r}.json``: per case and mode, whether every loss, LoRA tensor and AdamW state tensor is
``torch.equal`` to the resident run's, and the first difference if not. CI starts it with gloo on
CPU (``tests/test_distributed.py``); ``python -m tools.checks.ddp_check`` on GPUs (gloo on one device, NCCL on two).

Modes: ``micro`` (one batch per step, DDP with and without ``find_unused_parameters``), ``accum``
(DDP's ``no_sync`` accumulation against Poros's micro-major ``no_sync`` accumulation and against
layer-major ``PorosModel.forward_backward``), ``hf_prepare`` / ``hf_patch`` (HF ``Trainer`` makes the DDP wrapper).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import traceback
from typing import Any

import torch
import transformers
from torch.nn.parallel import DistributedDataParallel

import poros
from poros import distributed
from poros.testing import TINY_VARIANTS, Rows, load_qlora, save_tiny_checkpoint

MODES = ("micro", "accum", "hf_prepare", "hf_patch")


def make_batch(seed: int, batch: int, seq: int, vocab: int = 256) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab, (batch, seq), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    if batch > 1:  # left padding on the last row: masks matter
        attention_mask[-1, : seq // 3] = 0
        input_ids[attention_mask == 0] = 0
    return {"input_ids": input_ids, "attention_mask": attention_mask,
            "labels": input_ids.masked_fill(attention_mask == 0, -100)}


def _to(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _trainable(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {n.replace("model.base_model", "base_model"): p for n, p in model.named_parameters() if p.requires_grad}


def _state(model, optimizer, losses) -> dict[str, Any]:
    lora = {n: p.detach().clone() for n, p in _trainable(model).items()}
    names = {id(p): n for n, p in _trainable(model).items()}
    adam = {f"{names[id(p)]}.{k}": v.clone() for p, s in optimizer.state.items() for k, v in s.items()
            if isinstance(v, torch.Tensor)}
    return {"losses": [x.detach().float().cpu() for x in losses], "lora": lora, "adam": adam}


def compare(reference: dict[str, Any], streamed: dict[str, Any]) -> dict[str, Any]:
    """``equal`` and the first difference between two :func:`_state` results (zero tolerance)."""
    if len(reference["losses"]) != len(streamed["losses"]):
        return {"equal": False, "first_difference": "number of losses"}
    for i, (a, b) in enumerate(zip(reference["losses"], streamed["losses"])):
        if not torch.equal(a, b):
            return {"equal": False, "first_difference": f"loss {i}: {a.item()!r} != {b.item()!r}"}
    for kind in ("lora", "adam"):
        if set(reference[kind]) != set(streamed[kind]):
            return {"equal": False, "first_difference": f"{kind} names differ"}
        for name, tensor in reference[kind].items():
            other = streamed[kind][name]
            if not torch.equal(tensor, other):
                diff = (tensor.float() - other.float()).abs().max().item()
                return {"equal": False, "first_difference": f"{kind} {name} max |diff| {diff:.3e}"}
    return {"equal": True, "losses": [x.item() for x in reference["losses"]],
            "tensors_compared": len(reference["lora"]) + len(reference["adam"])}


# ---------------------------------------------------------------------------------------------
# One arm: load, wrap, train on this rank's shard
# ---------------------------------------------------------------------------------------------
def _load(checkpoint, device, streamed: str | None, seed: int):
    model = load_qlora(checkpoint, seed=seed, lora_rank=4, lora_alpha=8)
    if device.type != "cpu":
        model = model.to(device)
    if streamed == "prepare":
        return model, poros.prepare(model)
    if streamed == "patch":
        poros.patch_hf_model(model)
    return model, model


def _ddp(module, device, find_unused: bool):
    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(module, device_ids=ids, find_unused_parameters=find_unused)


def _batches(rank: int, steps: int, accum: int, batch: int, seq: int) -> list[list[dict]]:
    return [[make_batch(1000 * step + 10 * m + rank, batch, seq) for m in range(accum)] for step in range(steps)]


def run_arm(checkpoint, device, *, mode: str, streamed: bool, seed: int, steps: int, accum: int, batch: int,
            seq: int, find_unused: bool, control: bool = False) -> dict[str, Any]:
    rank = distributed.world().rank
    peft_model, target = _load(checkpoint, device, "prepare" if streamed else None, seed)
    optimizer = torch.optim.AdamW(list(_trainable(peft_model).values()), lr=1e-2)
    losses = []
    if mode == "layer_major" and streamed:
        for micro in _batches(rank, steps, accum, batch, seq):
            total = sum(int((b["labels"][:, 1:] != -100).sum()) for b in micro)
            micro = [_to({**b, "num_items_in_batch": torch.tensor(total)}, device) for b in micro]
            losses += target.forward_backward(micro, sync_gradients=not control)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return _state(peft_model, optimizer, losses)
    model = _ddp(target, device, find_unused)
    for micro in _batches(rank, steps, accum, batch, seq):
        total = sum(int((b["labels"][:, 1:] != -100).sum()) for b in micro)
        for m, mb in enumerate(micro):
            extra = {"num_items_in_batch": torch.tensor(total)} if accum > 1 else {}
            context = model.no_sync() if m < len(micro) - 1 else contextlib.nullcontext()
            with context:
                loss = model(**_to({**mb, **extra}, device), use_cache=False).loss
                loss.backward()
            losses.append(loss.detach())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return _state(peft_model, optimizer, losses)



def run_hf_trainer(checkpoint, device, *, streamed: str | None, seed: int, out: pathlib.Path) -> dict[str, Any]:
    """HF Trainer under torchrun (it makes the DDP wrapper and shards the data): ``streamed`` is
    ``None`` (resident), ``"prepare"`` (the Trainer gets the PorosModel) or ``"patch"``."""
    peft_model, target = _load(checkpoint, device, streamed, seed)
    rows = []
    for index in range(16):
        one = make_batch(index, 1, 12)
        rows.append({key: value[0] for key, value in one.items()})
    args = transformers.TrainingArguments(
        output_dir=str(out / f"hf-{streamed}"), max_steps=2, per_device_train_batch_size=2,
        gradient_accumulation_steps=2, learning_rate=1e-2, lr_scheduler_type="constant", optim="adamw_torch",
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=device.type == "cpu", seed=11, data_seed=11,
        dataloader_num_workers=0, disable_tqdm=True, ddp_backend=_backend(),
    )
    trainer = transformers.Trainer(model=target, args=args, train_dataset=Rows(rows))
    trainer.train()
    losses = [torch.tensor(e["loss"]) for e in trainer.state.log_history if "loss" in e]
    return _state(peft_model, trainer.optimizer, losses)


def _backend() -> str:
    import torch.distributed as dist

    return dist.get_backend()


# ---------------------------------------------------------------------------------------------
# The job
# ---------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for the checkpoints and rank{r}.json")
    parser.add_argument("--cases", default="all", help="family:variant,... (default: every tiny variant)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--device", default="cpu", help="cpu, cuda (one GPU per rank) or cuda:0 (all ranks share it)")
    parser.add_argument("--backend", default=None, help="gloo or nccl (default: gloo on CPU, NCCL on CUDA)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--accum", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=12)
    parser.add_argument("--layers", type=int, default=None, help="decoder layers of the tiny models")
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--deterministic", action="store_true",
                        help="torch.use_deterministic_algorithms(True) (warn only), CUBLAS_WORKSPACE_CONFIG=:4096:8")
    parser.add_argument("--control", action="store_true",
                        help="negative control: layer-major without the all-reduce (must differ)")
    parser.add_argument("--die-rank", type=int, default=None,
                        help="this rank exits (status 7) right after joining; the others wait in a collective")
    parser.add_argument("--handshake-only", action="store_true",
                        help="only the version handshake; POROS_TEST_FAKE_VERSION_RANK=r makes rank r report "
                             "another torch version")
    return parser.parse_args(argv)


def _device(spec: str) -> torch.device:
    if spec == "cuda":
        return torch.device("cuda", distributed.world().local_rank)
    return torch.device(spec)


def cases(spec: str) -> list[tuple[str, str]]:
    if spec == "all":
        return [(family, variant) for family, variants in TINY_VARIANTS.items() for variant in variants]
    return [tuple(item.split(":", 1)) if ":" in item else (item, TINY_VARIANTS[item][0]) for item in spec.split(",")]


def main(argv=None) -> int:
    import torch.distributed as dist

    args = parse_args(argv)
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    device = _device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if args.handshake_only:
        return handshake(device, args)
    here = distributed.init_process_group(device, backend=args.backend)
    if args.die_rank is not None:
        if here.rank == args.die_rank:
            os._exit(7)
        dist.barrier()
        dist.all_reduce(torch.ones(1))
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"rank": here.rank, "world_size": here.size, "backend": dist.get_backend(),
                              "device": str(device), "results": {}}
    modes = args.modes.split(",")
    for family, variant in cases(args.cases):
        case = f"{family}:{variant}"
        config = {} if args.layers is None else {"num_layers": args.layers}
        checkpoint = out / "checkpoints" / f"{family}-{variant}"
        if here.rank == 0:
            save_tiny_checkpoint(checkpoint, family, variant, seed=args.seed, **config)
        dist.barrier()
        for mode in modes:
            try:
                report["results"][f"{case}/{mode}"] = run_mode(mode, checkpoint, device, args, out)
            except Exception as error:  # noqa: BLE001 -- recorded per mode; the job continues
                report["results"][f"{case}/{mode}"] = {"equal": False, "error": traceback.format_exc(limit=6),
                                                       "error_type": type(error).__name__}
            dist.barrier()
    (out / f"rank{here.rank}.json").write_text(json.dumps(report, indent=1) + "\n")
    distributed.leave_process_group()  # drains gloo's workers first (see there)
    return 0 if all(r.get("equal") for r in report["results"].values()) else 1


def handshake(device, args) -> int:
    """Join with versions (one rank may fake another torch); write what each rank saw."""
    import torch.distributed as dist

    from poros.errors import DistributedError

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ["RANK"])
    mine = distributed.versions()
    if str(rank) == os.environ.get("POROS_TEST_FAKE_VERSION_RANK"):
        mine["torch"] = "0.0.0-fake"
    dist.init_process_group(backend=args.backend or "gloo")
    try:
        distributed.check_same_versions(mine)
        seen = {"error": None}
    except DistributedError as error:
        seen = {"error": str(error), "error_type": type(error).__name__}
    (out / f"rank{rank}.json").write_text(json.dumps(seen) + "\n")
    distributed.leave_process_group()  # drains gloo's workers first (see there)
    return 1 if seen["error"] else 0


def run_mode(mode: str, checkpoint, device, args, out) -> dict[str, Any]:
    shape = {"seed": args.seed, "steps": args.steps, "batch": args.batch, "seq": args.seq}
    if mode == "micro":
        results = {}
        for find_unused in (False, True):
            ref = run_arm(checkpoint, device, mode=mode, streamed=False, accum=1, find_unused=find_unused, **shape)
            got = run_arm(checkpoint, device, mode=mode, streamed=True, accum=1, find_unused=find_unused, **shape)
            results[f"find_unused={find_unused}"] = compare(ref, got)
        return {"equal": all(r["equal"] for r in results.values()), **results}
    if mode == "accum":
        # the reference is DDP's no_sync accumulation; find_unused_parameters=True keeps DDP's
        # construction-time buckets, the ones all_reduce_gradients uses (see poros.distributed)
        ref = run_arm(checkpoint, device, mode="accum", streamed=False, accum=args.accum, find_unused=True, **shape)
        results = {}
        for schedule in ("micro_major", "layer_major"):
            got = run_arm(checkpoint, device, mode=schedule, streamed=True, accum=args.accum, find_unused=True,
                          control=args.control, **shape)
            results[schedule] = compare(ref, got)
        return {"equal": all(r["equal"] for r in results.values()), **results}
    if mode in ("hf_prepare", "hf_patch"):
        ref = run_hf_trainer(checkpoint, device, streamed=None, seed=args.seed, out=out)
        got = run_hf_trainer(checkpoint, device, streamed=mode.removeprefix("hf_"), seed=args.seed, out=out)
        return compare(ref, got)
    raise SystemExit(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
