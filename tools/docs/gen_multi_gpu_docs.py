"""Render the measured table of docs/multi-gpu.md from ``tools/checks/ddp_check.py``'s ``ddp-scale-*.json``.

    python -m tools.docs.gen_multi_gpu_docs            # rewrite the generated block of docs/multi-gpu.md
    python -m tools.docs.gen_multi_gpu_docs --check    # exit 1 if the page is stale (tests/test_results_docs.py runs this)

One row per scale run (one rank, then two, on the same GPU and link): the host tier, the node's host RAM
(PSS: a page shared by two processes counts half in each, so the node's sum is its real use; "above
baseline" less each rank's own PSS after its imports and CUDA context), tokens/s and each rank's peak.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tools.docs import docgen

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "multi-gpu.md"


def _cell(value, pattern: str = "{:.2f}") -> str:
    return "-" if value is None else pattern.format(value)


def render_scale() -> str:
    rows = ["| shape (layers) | block cache | host tier of the ranks | commit | 1 rank: node PSS GB | 2 ranks: node PSS GB "
            "| ratio | above baseline GB, 1 rank -> 2 ranks | ratio | 2 ranks' tokens/s over 1 rank's | peak allocated "
            "GB per rank | H2D GB/s per rank, alone / together | JSON |", "|" + "---|" * 13]
    for path in sorted(ROOT.glob("registry/results/h200-*/ddp-scale-*.json")):
        record = json.loads(path.read_text())
        scale, summary = record["scale"], record["scale"]["summary"]
        one, two = scale["runs"]["1"], scale["runs"]["2"]
        rank = two["per_rank"][0]
        above = "-" if one.get("host_pss_node_above_baseline_gb") is None else \
            f"{one['host_pss_node_above_baseline_gb']:.2f} -> {two['host_pss_node_above_baseline_gb']:.2f}"
        rows.append(f"| {scale['shape']} ({two['layers']}) | {'yes' if scale.get('cache') else 'no'} | "
                    f"{rank.get('host_tier', 'pinned')}{'' if scale.get('host_tier_requested') else ' (default)'} | "
                    f"{record['environment']['commit']} | {_cell(one.get('host_pss_node_gb'))} | "
                    f"{_cell(two.get('host_pss_node_gb'))} | {_cell(summary.get('host_pss_ratio'), '{:.2f}x')} | {above} | "
                    f"{_cell(summary.get('host_pss_above_baseline_ratio'), '{:.2f}x')} | {summary['speedup']:.2f}x | "
                    f"{rank['peak_allocated_gb']:.2f} | {rank['h2d_alone_gb_per_s']:.0f} / {rank['h2d_together_gb_per_s']:.0f} | "
                    f"{docgen.json_link(path, 'JSON')} |")
    return "\n".join(rows)


BLOCKS = {"ddp-scale": render_scale}


def main(argv=None) -> int:
    return docgen.main_for_blocks(__doc__, PAGE, BLOCKS, argv)


if __name__ == "__main__":
    sys.exit(main())
