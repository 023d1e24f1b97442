"""Render the measured table of docs/configuration.md: the dry run's peak estimate beside the H200 records.

    python -m tools.docs.gen_configuration_docs            # rewrite the generated block of docs/configuration.md
    python -m tools.docs.gen_configuration_docs --check    # exit 1 if the page is stale (tests/test_results_docs.py runs this)

One row per shape, depth and sequence: the first uncapped H200 bench record at batch 1, one micro-batch, no
budget, eager blocks (``registry/results/h200-*/bench-*.json``), its recorded peak, and today's
``poros train --dry-run`` estimate (:attr:`poros.plan.run_plan.Plan.peak_device_bytes_estimate`) for the model
and options the record describes (:func:`poros.plan.calibration.record_plan`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tools.docs import docgen

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "configuration.md"


def estimate_records() -> list[tuple[Path, dict]]:
    found: dict[tuple[str, int, int], tuple[Path, dict]] = {}
    for path in sorted(ROOT.glob("registry/results/h200-*/bench-*.json")):
        record = json.loads(path.read_text())
        setup, poros = record["config"], record["arms"].get("poros") or {}
        key = (setup["model"], setup["model_info"]["num_hidden_layers"], setup["seq"])
        if (poros.get("status") == "ok" and setup["batch"] == 1 and setup.get("grad_accum", 1) == 1
                and not setup.get("vram_limit_gb") and not setup.get("vram_budget") and not setup.get("cuda_graphs")
                and not setup.get("quantize_experts") and setup.get("loss_chunks", 1) == 1 and key not in found):
            found[key] = (path, record)
    return [found[key] for key in sorted(found)]


def render_estimates() -> str:
    from poros.plan import calibration

    rows = ["| shape | layers | seq | recorded peak GB | estimated peak GB | JSON |", "|---|---|---|---|---|---|"]
    for path, record in estimate_records():
        setup = record["config"]
        estimate = calibration.record_plan(record).peak_device_bytes_estimate
        rows.append(f"| {setup['model']} | {setup['model_info']['num_hidden_layers']} | {setup['seq']} | "
                    f"{record['arms']['poros']['peak_allocated_gb']:.2f} | {estimate / 1e9:.2f} | "
                    f"{docgen.json_link(path, 'JSON')} |")
    return "\n".join(rows)


BLOCKS = {"dry-run-estimate": render_estimates}


def main(argv=None) -> int:
    return docgen.main_for_blocks(__doc__, PAGE, BLOCKS, argv, quiet=True)


if __name__ == "__main__":
    sys.exit(main())
