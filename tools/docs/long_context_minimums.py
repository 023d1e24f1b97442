"""The smallest VRAM budget ``poros plan`` accepts at long sequences, with deterministic algorithms on and off.

Each shape (``tools/bench/shapes.py``, full depth, random weights never built: the planner reads the config) is
planned for CUDA (the context counted, layer-major, one micro-batch, LoRA r16 on the seven projections,
NF4 with double quantization, AdamW state and LoRA placement ``auto``), and the budget is bisected to
0.25 GiB. Deterministic algorithms on, the flash backward's dQ accumulator is split by an H200's 132 SMs
(``poros.plan.footprint.ASSUMED_SMS``, the count a CUDA run planned without its GPU assumes).
``docs/consumer-gpus.md`` quotes the table this writes.

    python -m tools.docs.long_context_minimums --json registry/results/cpu-2026-12-02/long-context-minimums.json

Imports: poros, tools.bench.shapes, tools.bench.provenance.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

#: (shape, tokens per example)
CASES = (("qwen2.5-72b", 32768), ("qwen2.5-72b", 65536), ("qwen2.5-72b", 131072), ("qwen2.5-32b", 32768),
         ("qwen2.5-7b", 32768))
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def minimum_gib(plan, lo: float = 1.0, hi: float = 256.0, step: float = 0.25) -> float:
    """The smallest budget (GiB, to ``step``) the planner fits ``plan``'s run in."""
    from poros.errors import ConfigError
    from poros.plan import budget as planner
    from poros.stream.options import StreamOptions

    def fits(gib: float) -> bool:
        options = StreamOptions(vram_budget=f"{gib}GiB", embeddings_on_host=True, workload=plan.workload,
                                optimizer_states="auto", lora_placement="auto")
        try:
            planner.plan_budget(plan.footprint(), plan.workload, options, context_bytes=planner.CUDA_CONTEXT_BYTES,
                                footprint_for=plan.footprint_for())
            return True
        except ConfigError:
            return False

    while hi - lo > step:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


def main(argv: list[str] | None = None) -> int:
    import torch

    from poros.config import PorosConfig
    from poros.plan.run_plan import plan_run
    from tools.bench import provenance
    from tools.bench.shapes import model_config

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the rows and the environment here")
    args = parser.parse_args(argv)
    rows = []
    for shape, seq in CASES:
        config, _ = model_config(shape)
        with tempfile.TemporaryDirectory() as directory:
            config.save_pretrained(directory)
            row = {"shape": shape, "seq": seq}
            for deterministic in (True, False):
                plan = plan_run(PorosConfig(model=directory, device="cuda", seq_len=seq, double_quant=True,
                                            lora_rank=16, target_modules=TARGETS, embeddings_on_host=True,
                                            attn_implementation="sdpa", stream_schedule="layer-major",
                                            deterministic=deterministic))
                row["deterministic_gib" if deterministic else "not_deterministic_gib"] = minimum_gib(plan)
                row["sms" if deterministic else "sms_off"] = plan.attention_sms
        rows.append(row)
        print(f"{shape} seq {seq:,}: {row['deterministic_gib']:.2f} GiB deterministic, "
              f"{row['not_deterministic_gib']:.2f} GiB not", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rows": rows, "environment": provenance.environment(torch.device("cpu"))},
                                        indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
