"""Today's planner prediction for a bench record's own run: what the calibration test
(``tests/test_planner.py``) and the long-context table of ``docs/consumer-gpus.md`` put beside the peak the
H200 measured.

A record keeps the prediction the planner made when it ran (``arms.poros.prediction``); the planner has
been refined since, so this re-plans the record's shape (``tools/bench/shapes.py``, cut to its depth) with the
options the run ran with: the chunk counts the planner chose (``--vram-budget`` may raise them), the slots,
resident blocks, boundary-state and LoRA placement it chose, where AdamW's state lived, and deterministic
algorithms as the record says (the flash backward's dQ accumulator split, ``poros.plan.footprint.attention_sms``,
for an H200's SMs: every record is an H200's).

Imports: poros, tools.bench.shapes.
"""

from __future__ import annotations

import json
import tempfile
from functools import cache
from pathlib import Path

#: the H200's streaming multiprocessors (``torch.cuda.get_device_properties(0).multi_processor_count``)
H200_SMS = 132


@cache
def _configs() -> tempfile.TemporaryDirectory:
    """Where the shapes' configs are saved for planning: one directory for the process, removed at its exit."""
    return tempfile.TemporaryDirectory(prefix="poros-record-peak-")


@cache
def _plan(model: str, layers: int, seq: int, batch: int, double_quant: bool, targets: tuple[str, ...], rank: int,
          attn: str | None, loss_chunks: int, quantize_experts: bool, mlp_chunks: int):
    from poros.config import PorosConfig
    from poros.plan.run_plan import plan_run
    from tools.bench.shapes import model_config

    config, _ = model_config(model, layers=layers)
    directory = Path(_configs().name) / f"{model}-{layers}"
    config.save_pretrained(directory)
    return plan_run(PorosConfig(model=str(directory), device="cuda", seq_len=seq, batch_size=batch,
                                double_quant=double_quant, target_modules=list(targets), lora_rank=rank,
                                embeddings_on_host=True, attn_implementation=attn, loss_chunks=loss_chunks,
                                quantize_experts=quantize_experts, mlp_chunks=mlp_chunks))


def record_plan(record: dict):
    """The :class:`~poros.plan.run_plan.Plan` of a record's shape and options (cached per shape and options)."""
    setup, measured = record["config"], record["arms"]["poros"]
    ran = measured.get("prediction") or {}  # the chunk counts it ran with: the planner's where it raised them
    return _plan(setup["model"], setup["model_info"]["num_hidden_layers"], setup["seq"], setup["batch"],
                 setup["quantization"]["double_quant"], tuple(setup["lora"]["targets"]), setup["lora"]["rank"],
                 setup.get("attn_implementation"), ran.get("loss_chunks") or setup.get("loss_chunks", 1),
                 bool(setup.get("quantize_experts")),  # records before --quantize-experts: bf16 experts
                 ran.get("mlp_chunks") or setup.get("mlp_chunks") or 1)


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
    return planner.predict_peak(footprint, workload, resident=measured.get("resident_blocks", ()),
                                num_slots=measured.get("num_slots", setup["num_slots"]),
                                boundary_on_host=boundary in ("host", "disk"),
                                optimizer_on_host=setup.get("optimizer_states") == "host",
                                lora_on_host=lora_placement == "host").total


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
