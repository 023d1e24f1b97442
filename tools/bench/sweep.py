"""``python -m tools.bench --sweep``: the bench at seq 512 / 2048 / 4096 / 8192 x accumulation 1 / 4 / 8, one process per
configuration (each writes its own JSON beside the sweep's), then one JSON with every configuration's arms: step,
tokens/s, model and hardware TFLOP/s, MFU and peak memory (docs/benchmarking.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SEQS = (512, 2048, 4096, 8192)
ACCUMULATIONS = (1, 4, 8)
SWEEP_ARMS = "trl-resident,trl-poros,unsloth"
#: what each arm's row keeps of its configuration's report
ROW_KEYS = ("status", "median_step_s", "tokens_per_s", "model_tflops", "hardware_tflops", "mfu", "peak_allocated_gb",
            "kept_activation_blocks", "kernels", "error")


def strip(argv: list[str], names: tuple[str, ...]) -> list[str]:
    """``argv`` without ``names`` and their values (``--seq 512`` and ``--seq=512``)."""
    out, skip = [], False
    for item in argv:
        if skip:
            skip = False
            continue
        if item in names:
            skip = True
            continue
        if item.split("=", 1)[0] in names:
            continue
        out.append(item)
    return out


def run(argv: list[str], json_path: Path | None, timeout_s: float | None = None) -> int:
    """Every configuration in its own ``python -m tools.bench`` process; the merged rows go to ``json_path``."""
    base = strip([a for a in argv if a != "--sweep"], ("--seq", "--grad-accum", "--json"))
    if "--arms" not in " ".join(base):
        base += ["--arms", SWEEP_ARMS]
    out_dir = (json_path or Path("sweep.json")).parent
    rows, failed = [], 0
    for seq in SEQS:
        for accumulation in ACCUMULATIONS:
            path = out_dir / f"sweep-{seq}-{accumulation}.json"
            command = [sys.executable, "-m", "tools.bench", *base, "--seq", str(seq), "--grad-accum",
                       str(accumulation), "--json", str(path)]
            print("sweep:", " ".join(command[1:]), flush=True)
            try:
                code = subprocess.run(command, timeout=timeout_s).returncode
            except subprocess.TimeoutExpired:
                code = "timeout"
            failed += code != 0
            report = json.loads(path.read_text()) if path.exists() else {}
            rows.append({"seq": seq, "grad_accum": accumulation, "exit": code,
                         "dense_bf16_tflops": report.get("dense_bf16_tflops"),
                         "arms": {name: {k: arm.get(k) for k in ROW_KEYS if k in arm}
                                  for name, arm in report.get("arms", {}).items()}})
            if json_path:
                json_path.write_text(json.dumps({"tool": "tools.bench --sweep", "command": argv,
                                                 "environment": report.get("environment"), "rows": rows},
                                                indent=2, default=str) + "\n")
    return 1 if failed else 0


__all__ = ["ACCUMULATIONS", "SEQS", "run", "strip"]
