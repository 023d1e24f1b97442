"""Render the host-work tables of docs/benchmarking.md from ``tools/bench/host_overhead.py``'s JSON and the H200
bench records that carry a kernel profile.

    python -m tools.docs.gen_host_overhead_docs            # rewrite the generated blocks of docs/benchmarking.md
    python -m tools.docs.gen_host_overhead_docs --check    # exit 1 if the page is stale (tests/test_results_docs.py runs this)

``host-overhead``: per arm, the host milliseconds per block call (one block's forward and backward for one
micro-batch) of the newest CPU record, beside the record ``host-overhead-before.json`` of the same day when there
is one (the same tool before a change), each with its ratio to ``resident-plain`` (the resident model without
checkpointing: each block's forward once, with autograd) and the cyclic garbage collector's time.
``kept-host-parts``: the kept-activations bookkeeping per kept block call, part by part, before and after; and
one profiled step's self time by whose code it is. ``h200-idle``: per H200 arm with a kernel profile, the
profiled step's kernel span, busy and idle time beside the unprofiled median step: the median less the busy
time is the most idle an unprofiled step can hold, and the busy time over the same record's Unsloth step what the
arm's step would be against Unsloth's with no idle at all.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tools.docs import docgen

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "benchmarking.md"

#: what each arm of tools/bench/host_overhead.py runs, in words
ARM_WORDS = {
    "resident": "HF checkpointing (non-reentrant), one micro-batch",
    "resident-plain": "no checkpointing: each block's forward once, with autograd",
    "poros-resident": "Poros, every block resident, recompute all",
    "poros": "Poros streaming, recompute all (micro-major)",
    "poros-kept": "Poros streaming, recompute none (micro-major)",
    "poros-layer-major": "Poros streaming, recompute all, layer-major accumulation",
    "poros-kept-layer-major": "Poros streaming, recompute none, layer-major accumulation (`prepare_trainer`'s path)",
}


def _records() -> tuple[Path | None, Path | None]:
    """The newest host-overhead record with per-block-call times, and the same day's ``-before`` record (or None)."""
    paths = [p for p in sorted(ROOT.glob("registry/results/cpu-*/host-overhead.json"))
             if "ms_per_block_call" in json.loads(p.read_text())]
    if not paths:
        return None, None
    before = paths[-1].with_name("host-overhead-before.json")
    return paths[-1], before if before.exists() else None


def _load(path: Path | None) -> dict:
    return json.loads(path.read_text()) if path is not None else {}


def _cell(record: dict, arm: str) -> str:
    ms = record.get("ms_per_block_call", {}).get(arm)
    if ms is None:
        return "-"
    ratio = record.get("ratio_to_resident_plain", {}).get(arm)
    return f"{ms:.2f}" + (f" ({ratio:.2f}x)" if ratio is not None else "")


def _header(path: Path, record: dict, label: str) -> str:
    config = record["config"]
    return (f"{label}: commit {record['environment']['commit']}, {config['layers']} layers, seq {config['seq']}, "
            f"accumulation {config['accumulation']}, {config['rounds']} rounds x {config['steps_per_round']} steps "
            f"({docgen.json_link(path, 'JSON')})")


def render_arms() -> str:
    after_path, before_path = _records()
    if after_path is None:
        return "pending `python -m tools.bench.host_overhead --breakdown --json ...`"
    after, before = _load(after_path), _load(before_path)
    lines = [f"- {_header(before_path, before, 'before')}"] if before else []
    lines += [f"- {_header(after_path, after, 'after' if before else 'measured')}", ""]
    rows = ["| arm | what runs | ms per block call (x resident-plain), before | after | GC ms per micro-batch, before "
            "| after | GC collections per micro-batch (generation 0 / 1 / 2), after |", "|---|---|---|---|---|---|---|"]
    for arm in after["ms_per_block_call"]:
        gc_before = before.get("gc_ms_per_micro_batch", {}).get(arm)
        gc_after = after.get("gc_ms_per_micro_batch", {}).get(arm)
        collections = after.get("gc_collections_per_micro_batch", {}).get(arm)
        rows.append(f"| `{arm}` | {ARM_WORDS.get(arm, '-')} | {_cell(before, arm)} | {_cell(after, arm)} | "
                    f"{'-' if gc_before is None else f'{gc_before:.1f}'} | {'-' if gc_after is None else f'{gc_after:.1f}'} | "
                    f"{'-' if collections is None else ' / '.join(f'{c:g}' for c in collections)} |")
    return "\n".join(lines + rows)


def render_parts() -> str:
    after_path, before_path = _records()
    after, before = _load(after_path), _load(before_path)
    parts_after = after.get("breakdown", {}).get("kept_ms_per_block_call")
    if not parts_after:
        return "pending `python -m tools.bench.host_overhead --breakdown --json ...`"
    parts_before = before.get("breakdown", {}).get("kept_ms_per_block_call", {})
    rows = ["| `KeptBlock` part, ms per kept block call | before | after |", "|---|---|---|"]
    for part, ms in parts_after.items():
        was = parts_before.get(part)
        rows.append(f"| {'**total**' if part == 'total' else f'`{part}`'} | {'-' if was is None else f'{was:.3f}'} | "
                    f"{ms:.3f} |")
    profiled = after["breakdown"].get("profiled_ms_per_block_call", {})
    arms = list(profiled)
    owners = sorted({owner for arm in arms for owner in profiled[arm]})
    rows += ["", "| whose code (one step under cProfile, after), ms per block call | " + " | ".join(f"`{a}`" for a in arms)
             + " |", "|---|" + "---|" * len(arms)]
    for owner in owners:
        rows.append(f"| {owner} | " + " | ".join(f"{profiled[a][owner]:.2f}" if owner in profiled[a] else "-"
                                                  for a in arms) + " |")
    rows.append("| **sum** | " + " | ".join(f"{sum(profiled[a].values()):.2f}" for a in arms) + " |")
    return "\n".join(rows)


def render_idle() -> str:
    rows = ["| record | arm | median step s | profiled step: kernel span s | busy s | idle s | median less busy s "
            "| busy over Unsloth's median step |", "|---|---|---|---|---|---|---|---|"]
    for path in sorted(ROOT.glob("registry/results/h200-*/bench-*.json")):
        try:
            record = json.loads(path.read_text())
        except json.JSONDecodeError:
            continue
        for arm, result in (record.get("arms") or {}).items():
            profile = result.get("kernel_profile") if isinstance(result, dict) else None
            if not profile or "busy_ms" not in profile or result.get("median_step_s") is None:
                continue
            median, busy = result["median_step_s"], profile["busy_ms"] / 1e3
            unsloth = (record["arms"].get("unsloth") or {}).get("median_step_s")
            rows.append(f"| {docgen.json_link(path, path.parent.name)} | `{docgen.arm_label(arm, result)}` | {median:.2f} | "
                        f"{profile['span_ms'] / 1e3:.2f} | {busy:.2f} | {profile['idle_ms'] / 1e3:.2f} | "
                        f"{median - busy:.2f} | {'-' if not unsloth else f'{busy / unsloth:.2f}x'} |")
    return docgen.rows_or_pending(rows)


BLOCKS = {"host-overhead": render_arms, "kept-host-parts": render_parts, "h200-idle": render_idle}


def main(argv=None) -> int:
    return docgen.main_for_blocks(__doc__, PAGE, BLOCKS, argv)


if __name__ == "__main__":
    sys.exit(main())
