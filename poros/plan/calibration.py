"""The planner against the H200: today's prediction for a bench record's own run, what the calibration
tests (``tests/test_planner.py``) and the generated tables of ``docs/consumer-gpus.md`` and the README put
beside the peak the H200 measured.

    python -m poros.plan.calibration registry/results/h200-*/bench-*.json

A record keeps the prediction the planner made when it ran (``arms.poros.prediction``); the planner has
been refined since, so this re-plans the record's model -- the config it was built from, which the record
keeps (``config.model_info.config_kwargs``, cut to the depth it ran) -- with the options the run ran with:
the chunk counts the planner chose (``--vram-budget`` may raise them), the slots, resident blocks,
boundary-state and LoRA placement it chose, where AdamW's state lived, and deterministic algorithms as the
record says (the flash backward's dQ accumulator split, ``poros.plan.footprint.attention_sms``, for an
H200's SMs: every record is an H200's).

Torch-lazy: transformers and torch are imported when a record is planned.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from functools import cache
from pathlib import Path

#: runs with mlp_chunks > 1 made before mlp_chunks tiled the norms and attention projections too (issue 32,
#: 2026-12-02 ninth session): only their MLP was tiled, which today's footprint no longer prices; the
#: re-runs of those shapes (h200-2026-12-02-s9) are the calibration
MLP_ONLY_TILING = ("h200-2026-11-", "h200-2026-12-01", "h200-2026-12-02-s8")

#: the day the CUDA graphs' capture scratch (``poros.stream.capture_scratch``, b4e0353) began holding the fused NF4
#: experts, and the commits of that day's records made before it
CAPTURE_SCRATCH_SINCE = "2026-12-07"
BEFORE_CAPTURE_SCRATCH = ("325a997", "67a94df")


def holds_scratch(record: dict) -> bool:
    """Whether a record's run held the fused NF4 experts in the graphs' capture scratch (else a capture's transient)."""
    environment = record.get("environment") or {}
    date, commit = environment.get("date") or "", environment.get("commit") or ""
    return date >= CAPTURE_SCRATCH_SINCE and not commit.startswith(BEFORE_CAPTURE_SCRATCH)

#: the H200's streaming multiprocessors (``torch.cuda.get_device_properties(0).multi_processor_count``)
H200_SMS = 132


@cache
def _configs() -> tempfile.TemporaryDirectory:
    """Where the records' configs are saved for planning: one directory for the process, removed at its exit."""
    return tempfile.TemporaryDirectory(prefix="poros-calibration-")


def record_config(record: dict):
    """The HF text config a record's model was built from (its family's text ``model_type``)."""
    from transformers import AutoConfig

    from poros import registry

    info = record["config"]["model_info"]
    return AutoConfig.for_model(registry.get(info["family"]).model_types[0], **info["config_kwargs"])


def plan_model(record: dict, *, seq: int, batch: int, double_quant: bool, targets: tuple[str, ...], rank: int,
               attn: str | None, loss_chunks: int, quantize_experts: bool, mlp_chunks: int,
               lora_on_experts: bool = False):
    """The :class:`~poros.plan.run_plan.Plan` of a record's model with the given options (cached)."""
    info = record["config"]["model_info"]
    return _plan(info["family"], json.dumps(info["config_kwargs"], sort_keys=True), seq, batch, double_quant,
                 targets, rank, attn, loss_chunks, quantize_experts, mlp_chunks, lora_on_experts)


@cache
def _plan(family: str, config_kwargs: str, seq: int, batch: int, double_quant: bool, targets: tuple[str, ...],
          rank: int, attn: str | None, loss_chunks: int, quantize_experts: bool, mlp_chunks: int,
          lora_on_experts: bool):
    from poros.config import PorosConfig
    from poros.plan.run_plan import plan_run

    config = record_config({"config": {"model_info": {"family": family, "config_kwargs": json.loads(config_kwargs)}}})
    directory = Path(_configs().name) / hashlib.sha256(config_kwargs.encode()).hexdigest()[:16]
    config.save_pretrained(directory)
    return plan_run(PorosConfig(model=str(directory), device="cuda", seq_len=seq, batch_size=batch,
                                double_quant=double_quant, target_modules=list(targets), lora_rank=rank,
                                embeddings_on_host=True, attn_implementation=attn, loss_chunks=loss_chunks,
                                quantize_experts=quantize_experts, mlp_chunks=mlp_chunks,
                                lora_on_experts=lora_on_experts))


def record_plan(record: dict):
    """The :class:`~poros.plan.run_plan.Plan` of a record's model and the options it ran with (cached)."""
    setup, measured = record["config"], record["arms"]["poros"]
    ran = measured.get("prediction") or {}  # the chunk counts it ran with: the planner's where it raised them
    return plan_model(record, seq=setup["seq"], batch=setup["batch"], double_quant=setup["quantization"]["double_quant"],
                      targets=tuple(setup["lora"]["targets"]), rank=setup["lora"]["rank"],
                      attn=setup.get("attn_implementation"),
                      loss_chunks=ran.get("loss_chunks") or setup.get("loss_chunks", 1),
                      quantize_experts=bool(setup.get("quantize_experts")),  # before --quantize-experts: bf16
                      mlp_chunks=ran.get("mlp_chunks") or setup.get("mlp_chunks") or 1,
                      lora_on_experts=bool(setup["lora"].get("on_experts")))  # before lora_on_experts: none


def predicted_peak(record: dict) -> int:
    """Today's predicted peak allocated bytes for the run a record describes."""
    import dataclasses

    from poros.plan import budget as planner
    from poros.plan.entry import workload_of

    setup, measured = record["config"], record["arms"]["poros"]
    plan = record_plan(record)
    workload = workload_of(batch_size=setup["batch"], seq_len=setup["seq"], grad_accum=setup.get("grad_accum", 1),
                           schedule=setup.get("schedule") or "micro-major", loss_chunks=plan.loss_chunks)
    # everything the run ran with: the planner's choices where it chose (--vram-budget), else what it asked
    chosen = measured.get("budget_plan") or {}
    boundary = chosen.get("boundary_states") or setup.get("boundary_states") or "device"
    lora_placement = chosen.get("lora_placement") or setup.get("lora_placement") or "device"
    footprint = dataclasses.replace(plan, attention_sms=H200_SMS if setup.get("deterministic") else 0).footprint()
    # the graphs' live buffers where its blocks were captured; before the capture scratch the fused experts were a
    # capture's transient in the pool like any other
    footprint = dataclasses.replace(footprint, cuda_graphs=bool((measured.get("cuda_graphs") or {}).get("captured")),
                                    **({} if holds_scratch(record) else
                                       {"expert_scratch_bytes": 0, "captured_recompute_bytes": 0}))
    return planner.predict_peak(footprint, workload, resident=measured.get("resident_blocks", ()),
                                num_slots=measured.get("num_slots", setup["num_slots"]),
                                boundary_on_host=boundary in ("host", "disk"),
                                optimizer_on_host=setup.get("optimizer_states") == "host",
                                lora_on_host=lora_placement == "host").total


def counted(path: Path) -> bool:
    """Whether a bench record calibrates the planner: its Poros arm finished, and it is no MLP-only tiling run."""
    record = json.loads(path.read_text())
    if record["arms"].get("poros", {}).get("status") != "ok":
        return False
    return not ((record["config"].get("mlp_chunks") or 1) > 1 and path.parent.name.startswith(MLP_ONLY_TILING))


def calibration_records(results: Path | None = None) -> list[Path]:
    """The H200 bench records the planner is calibrated against (``registry/results/h200-*/bench-*.json``)."""
    from poros import records

    folder = results or records.data_dir() / "results"
    return sorted(path for path in folder.glob("h200-*/bench-*.json") if counted(path))


def peak_errors(paths: list[Path]) -> dict[Path, float]:
    """Today's predicted peak against the measured one, ``predicted / measured - 1``, per record."""
    errors = {}
    for path in paths:
        record = json.loads(path.read_text())
        errors[path] = predicted_peak(record) / (record["arms"]["poros"]["peak_allocated_gb"] * 1e9) - 1
    return errors


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("records", nargs="+", type=Path, help="bench JSON records (registry/results/h200-*/bench-*.json)")
    args = parser.parse_args(argv)
    for path in args.records:
        record = json.loads(path.read_text())
        predicted, measured = predicted_peak(record), record["arms"]["poros"]["peak_allocated_gb"] * 1e9
        print(f"{predicted / 1e9:8.2f} GB predicted  {measured / 1e9:8.2f} GB measured  {predicted / measured - 1:+6.1%}  {path.name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
