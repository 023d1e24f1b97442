"""Render the measured tables of docs/cache-and-host-memory.md from ``tools/checks/cache_bench.py``'s JSON.

    python -m tools.docs.gen_cache_docs            # rewrite the generated blocks of docs/cache-and-host-memory.md
    python -m tools.docs.gen_cache_docs --check    # exit 1 if the page is stale (tests/test_results_docs.py runs this)

The blocks: ``cache-starts`` (each start of a truncated shape in a fresh process, from the
``cache-*-starts-only*.json`` records without a tier comparison), ``cache-projection`` (the
``cache-projection-*.json`` fits read at full depth: a projection, not a measurement) and ``cache-tiers``
(the step per host tier against ``pinned`` in the same process). Every row names its JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tools.docs import docgen

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "cache-and-host-memory.md"
RECORDS = "registry/results/h200-*/cache-*.json"
#: the starts a row compares, in the table's order: quantizing (no cache), the first cached run (writes the
#: entry), cached with the pages dropped, cached with the entry in the page cache
STARTS = ("nocache", "cold", "cached", "cached_warm")


def _records(kind: str) -> list[tuple[Path, dict]]:
    out = []
    for path in sorted(ROOT.glob(RECORDS)):
        record = json.loads(path.read_text())
        projection = bool(record.get("projection"))
        starts = not projection and "starts-only" in path.name and "start-tiers" not in path.name
        tiers = (not projection and bool(record.get("tiers")) and "start-tiers" not in path.name
                 and not record.get("partial"))
        if {"projection": projection, "starts": starts, "tiers": tiers}[kind]:
            out.append((path, record))
    return out


def _gb(nbytes) -> str:
    return "-" if nbytes is None else f"{nbytes / 1e9:.1f}"


def render_starts() -> str:
    rows = ["| shape (layers) | checkpoint / entry GB | quantizing, no cache s | first cached run (writes the entry) s "
            "| cached, dropped s | cached, warm s | speedup dropped / warm | commit | JSON |",
            "|---|---|---|---|---|---|---|---|---|"]
    records = sorted(_records("starts"), key=lambda r: (r[1]["model"]["shape"], r[1]["model"]["num_hidden_layers"]))
    for path, record in records:
        start = {name: record["start"][name]["start_s"] for name in STARTS}
        rows.append(f"| {record['model']['shape']} ({record['model']['num_hidden_layers']}) | "
                    f"{_gb(record['checkpoint_bytes'])} / {_gb(record.get('entry_bytes'))} | "
                    + " | ".join(f"{start[name]:.1f}" for name in STARTS)
                    + f" | {start['nocache'] / start['cached']:.1f}x / {start['nocache'] / start['cached_warm']:.1f}x | "
                    f"{record['environment']['commit']} | {docgen.json_link(path, 'JSON')} |")
    return "\n".join(rows)


def render_projection() -> str:
    rows = ["| full depth | quantizing, start s | cached dropped s | cached warm s | speedup dropped / warm: start "
            "| through the first step | from the launch to the start | JSON |", "|---|---|---|---|---|---|---|---|"]
    for path, record in _records("projection"):
        start = record["start"]

        def at(name: str, phase: str) -> float:
            return start[name][phase]["at_full_depth_s"]

        cells = [f"{record['shape']} ({record['full_depth']})"]
        cells += [f"{at(name, 'start_s'):.1f}" for name in ("nocache", "cached", "cached_warm")]
        cells += [f"{at('nocache', phase) / at('cached', phase):.1f}x / {at('nocache', phase) / at('cached_warm', phase):.1f}x"
                  for phase in ("start_s", "through_first_step_s", "process_start_s")]
        rows.append("| " + " | ".join([*cells, docgen.json_link(path, "JSON")]) + " |")
    return "\n".join(rows)


def render_tiers() -> str:
    rows = ["| shape (layers) | timed steps per tier | `pinned` s/step | `mapped` s/step (x pinned) | `disk` s/step "
            "(x pinned), ring | disk tier read GB/s while reading / the drive probe's | entry GB | JSON |",
            "|---|---|---|---|---|---|---|---|"]
    for path, record in _records("tiers"):
        tiers = record["tiers"]

        def cell(name: str) -> str:
            tier = tiers.get(name)
            if not tier:
                return "-"
            ring = f", ring of {tier['host_plan']['read_ahead']}" if name == "disk" else ""
            return f"{tier['step_s']:.3f} ({tier['vs_pinned']:.2f}x){ring}"

        disk = (tiers.get("disk") or {}).get("disk")
        read = "-" if not disk else f"{disk['gb_per_s_while_reading']:.2f} / {record['drive']['gb_per_s']:.2f}"
        timed = len(tiers["pinned"].get("timed_s") or tiers["pinned"].get("steps_s") or [])
        rows.append(f"| {record['model']['shape']} ({record['model']['num_hidden_layers']}) | {timed or record['steps']} | "
                    f"{tiers['pinned']['step_s']:.3f} | {cell('mapped')} | {cell('disk')} | {read} | "
                    f"{_gb(record.get('entry_bytes'))} | {docgen.json_link(path, 'JSON')} |")
    return "\n".join(rows)


BLOCKS = {"cache-starts": render_starts, "cache-projection": render_projection, "cache-tiers": render_tiers}


def main(argv=None) -> int:
    return docgen.main_for_blocks(__doc__, PAGE, BLOCKS, argv)


if __name__ == "__main__":
    sys.exit(main())
