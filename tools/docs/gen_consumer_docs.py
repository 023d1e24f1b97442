"""Render the generated tables of docs/consumer-gpus.md: what fits on which card, from the planner.

    python -m tools.docs.gen_consumer_docs            # rewrite the generated blocks of docs/consumer-gpus.md
    python -m tools.docs.gen_consumer_docs --check    # exit 1 if the page is stale (a test runs this)

Only the text between ``<!-- BEGIN GENERATED: name -->`` and ``<!-- END GENERATED: name -->`` is
rewritten. The numbers come from two places, and every table says which:

* **measured**: the H200 bench records under ``registry/results/h200-*/`` (named in the table);
* **predicted**: ``poros.plan.budget`` on the real shapes of ``tools/bench/shapes.py``'s SHAPES (built
  from their configs on the meta device, no download): block bytes exact, the rest its estimates.
  Step times use per-block compute times *derived* from the H200 measurements (COMPUTE_RULE, printed
  on the page), not measured on any consumer card.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from tools.docs import docgen  # tools/docs/docgen.py: write or --check

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "consumer-gpus.md"
SHAPES = ("qwen2.5-7b", "qwen2.5-32b", "qwen2.5-72b", "qwen3-32b", "gemma3-27b", "gemma4-31b", "qwen3.6-27b")
CARDS_GIB = (8, 12, 16, 24, 32)
#: The small-card grid: the most common consumer cards x the Qwen2.5 sizes people fine-tune.
SMALL_CARDS_GIB = (6, 8, 12, 16, 24)
SMALL_CARD_SHAPES = ("qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b", "qwen2.5-72b")
LINKS_GB_PER_S = {"PCIe 4": 25.0, "PCIe 5": 55.0}
SEQ, BATCH, RANK = 512, 1, 16
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
COMPUTE_RULE = ("resident reference step on the H200 (median, deterministic algorithms off, seq 512) divided by "
                "the number of decoder blocks, split 1:2 between a block's forward and its recompute + backward; "
                "head and optimizer counted inside that share")


def _shapes():
    from tools.bench import shapes  # the shapes and their configs

    return shapes


def reference_records() -> dict[str, tuple[Path, dict]]:
    """Per shape, the first full-depth H200 bench record at seq 512, batch 1, one micro-batch, no cap,
    deterministic algorithms off, both arms finished."""
    found: dict[str, tuple[Path, dict]] = {}
    for path in sorted(ROOT.glob("registry/results/h200-*/bench-*.json")):
        record = json.loads(path.read_text())
        setup, arms = record["config"], record["arms"]
        info = setup["model_info"]
        if (setup["model"] in SHAPES and setup["model"] not in found and setup["seq"] == SEQ
                and setup["batch"] == BATCH and setup.get("grad_accum", 1) == 1 and not setup.get("vram_limit_gb")
                and not setup.get("vram_budget") and not setup["deterministic"]
                and info["num_hidden_layers"] == info["full_depth"]
                and all(arms.get(arm, {}).get("status") == "ok" for arm in ("resident", "poros"))):
            found[setup["model"]] = (path, record)
    return found


def capped_records() -> list[tuple[Path, dict]]:
    out = []
    for path in sorted(ROOT.glob("registry/results/h200-*/bench-*.json")):
        record = json.loads(path.read_text())
        if record["config"].get("vram_limit_gb") and record["arms"].get("poros", {}).get("status") == "ok":
            out.append((path, record))
    return out


_PLANS: dict[str, object] = {}


def shape_plan(name: str):
    """The planner's view of shape ``name`` at the page's run: NF4 + double quant, LoRA r16 on the seven
    projections, seq 512, batch 1, on CUDA with the embeddings on the host."""
    if name not in _PLANS:
        from poros.config import PorosConfig
        from poros.plan.run_plan import plan_run

        config, _ = _shapes().model_config(name)
        with tempfile.TemporaryDirectory() as directory:
            config.save_pretrained(directory)
            _PLANS[name] = plan_run(PorosConfig(
                model=directory, device="cuda", seq_len=SEQ, batch_size=BATCH, double_quant=True, lora_rank=RANK,
                lora_alpha=2 * RANK, target_modules=list(TARGETS), embeddings_on_host=True,
                attn_implementation="sdpa"))
    return _PLANS[name]


def derived_compute(name: str):
    """Per-block compute times of shape ``name`` derived from its H200 resident step (COMPUTE_RULE)."""
    from poros.plan import budget as planner

    _, record = reference_records()[name]
    blocks = record["config"]["model_info"]["num_hidden_layers"]
    per_block = record["arms"]["resident"]["median_step_s"] / blocks
    return planner.ComputeTimes.uniform(blocks, per_block / 3, 2 * per_block / 3,
                                        source="derived from the H200 resident step")


def _plan(name: str, budget, link_gb_per_s: float | None = None, optimizer_states: str = "device"):
    """The planner's decision for ``name`` at ``budget``; ``optimizer_states="auto"`` is what
    ``poros plan`` and ``prepare(vram_budget=...)`` ask (AdamW's state to the host only where nothing
    fits with it on the device)."""
    from poros.plan import budget as planner
    from poros.plan.entry import workload_of

    plan = shape_plan(name)
    from poros.stream.options import StreamOptions

    return planner.plan_budget(
        plan.footprint(), workload_of(batch_size=BATCH, seq_len=SEQ),
        StreamOptions(vram_budget=budget, embeddings_on_host=True, optimizer_states=optimizer_states),
        compute=derived_compute(name) if link_gb_per_s else None,
        link_bytes_per_s=link_gb_per_s * 1e9 if link_gb_per_s else None, context_bytes=planner.CUDA_CONTEXT_BYTES)


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f}"


def _link(path: Path) -> str:
    return f"[{path.name}](../{path.relative_to(ROOT).as_posix()})"


def render_measured() -> str:
    from poros.plan import budget as planner
    from poros.plan.entry import workload_of

    rows = ["| shape | blocks | resident peak GB | Poros peak GB | planner peak GB (error) | resident step s | "
            "Poros step s | planner step s (derived compute, link as measured) | JSON |",
            "|---|---|---|---|---|---|---|---|---|"]
    for name, (path, record) in reference_records().items():
        arms, plan = record["arms"], shape_plan(name)
        workload = workload_of(batch_size=BATCH, seq_len=SEQ)
        peak = planner.predict_peak(plan.footprint(), workload, num_slots=record["config"]["num_slots"]).total
        measured = arms["poros"]["peak_allocated_gb"] * 1e9
        link = record["build"]["link_h2d_gb_per_s"] * 1e9
        step = planner.predict_step(plan.block_bytes, workload, derived_compute(name), link,
                                    num_slots=record["config"]["num_slots"]).step_s
        rows.append(f"| {name} | {plan.num_blocks} | {arms['resident']['peak_allocated_gb']:.2f} | {measured / 1e9:.2f} | "
                    f"{_gb(peak)} ({peak / measured - 1:+.1%}) | {arms['resident']['median_step_s']:.3f} | "
                    f"{arms['poros']['median_step_s']:.3f} | {step:.3f} | {_link(path)} |")
    return "\n".join(rows)


def render_capped() -> str:
    rows = ["| shape | micro-batches per step | boundary states | cap GB | Poros peak allocated GB "
            "| Poros peak reserved GB | Poros step s | JSON |", "|---|---|---|---|---|---|---|---|"]
    for path, record in capped_records():
        config, poros = record["config"], record["arms"]["poros"]
        layer_major = config.get("grad_accum", 1) > 1 and config.get("schedule") == "layer-major"
        states = (poros.get("budget_plan") or {}).get("boundary_states", "device") if layer_major else "-"
        layers, full = config.get("model_info", {}).get("num_hidden_layers"), config.get("model_info", {}).get("full_depth")
        depth = f", {layers} of {full} layers" if layers and full and layers != full else ""
        seq = f", seq {config['seq']:,}" if config.get("seq", 512) != 512 else ""
        rows.append(f"| {config['model']}{depth}{seq} | {docgen.accum_label(config)} | {states} | {config['vram_limit_gb']:g} | "
                    f"{poros['peak_allocated_gb']:.2f} | {poros['peak_reserved_gb']:.2f} | "
                    f"{poros['median_step_s']:.3f} | {_link(path)} |")
    return "\n".join(rows)


def render_minimums() -> str:
    rows = ["| shape | blocks | block MB | minimum budget GB (1 slot) | with 2 slots GB | peak allocated GB (2 slots) "
            "| minimum with AdamW state on the host GB (1 slot / 2 slots) "
            "| budget to hide the copy GB, PCIe 4 (blocks resident) | PCIe 5 | everything resident GB |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for name in SHAPES:
        plan = shape_plan(name)
        base = _plan(name, 10**15)  # a budget that holds everything: all blocks resident
        hide = {label: _plan(name, 10**15, link) for label, link in LINKS_GB_PER_S.items()}
        pipelined = _plan(name, base.pipelined_minimum_bytes)
        cells = [f"{_gb(p.hide_copy_bytes)} ({p.hide_copy_resident})" for p in hide.values()]
        host = _plan(name, 10**15, optimizer_states="host")
        rows.append(f"| {name} | {plan.num_blocks} | {plan.largest_block_bytes / 1e6:.0f} | {_gb(base.minimum_bytes)} | "
                    f"{_gb(base.pipelined_minimum_bytes)} | {_gb(pipelined.peak.total)} | "
                    f"{_gb(host.minimum_bytes)} / {_gb(host.pipelined_minimum_bytes)} | {' | '.join(cells)} | "
                    f"{_gb(base.needed_bytes)} |")
    return "\n".join(rows)


def host_ram(name: str, resident_blocks) -> str:
    """Host RAM of the streamed blocks: pinned (or mapped, once per node), and the disk tier's ring
    (``poros.plan.host_tiers`` default read-ahead: 3 blocks) for hosts with less RAM than that."""
    from poros.plan.host_tiers import DEFAULT_READ_AHEAD

    streamed = [n for i, n in enumerate(shape_plan(name).block_bytes) if i not in set(resident_blocks)]
    if not streamed:
        return "0 (nothing streams)"
    return f"{_gb(sum(streamed))} ({_gb(DEFAULT_READ_AHEAD * max(streamed))})"


def render_cards() -> str:
    from poros.errors import ConfigError

    from poros.plan import budget as planner
    from poros.plan.entry import workload_of

    rows = ["| shape | card | fits | AdamW state | slots | resident blocks | peak allocated GB | needed GB | step s, "
            "PCIe 4 (copy hidden) | step s, PCIe 5 (copy hidden) | host RAM GB, pinned (disk tier ring) |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in SHAPES:
        for card in CARDS_GIB:
            budget = f"{card}GiB"
            try:
                plans = [_plan(name, budget, link, "auto") for link in LINKS_GB_PER_S.values()]
            except ConfigError:
                minimum = planner.minimum_budget(shape_plan(name).footprint(), workload_of(batch_size=BATCH, seq_len=SEQ),
                                                 context_bytes=planner.CUDA_CONTEXT_BYTES, optimizer_states="auto")
                rows.append(f"| {name} | {card} GiB | no (needs {_gb(minimum)} GB) | - | - | - | - | - | - | - | - |")
                continue
            plan = plans[0]
            steps = " | ".join(f"{p.step.step_s:.2f} ({'yes' if p.step.copy_hidden else 'no'})" for p in plans)
            rows.append(f"| {name} | {card} GiB | yes | {plan.optimizer_states} | {plan.num_slots} | "
                        f"{len(plan.resident_blocks)} of "
                        f"{plan.num_blocks} | {_gb(plan.peak.total)} | {_gb(plan.needed_bytes)} | {steps} | "
                        f"{host_ram(name, plan.resident_blocks)} |")
    return "\n".join(rows)


def render_small_cards() -> str:
    """The small-card grid as ``poros plan --vram-budget`` decides it (AdamW's state to the host where
    the slot ring does not fit with it on the device); a measured column where a capped H200 record
    has that shape, cap and AdamW placement."""
    from poros.errors import ConfigError
    from poros.plan import budget as planner
    from poros.plan.entry import workload_of

    measured = {}
    for path, record in capped_records():
        config = record["config"]
        if config.get("grad_accum", 1) == 1 and config["seq"] == SEQ and not config.get("vram_budget"):
            key = (config["model"], float(config["vram_limit_gb"]), config.get("optimizer_states", "device"))
            measured.setdefault(key, (path, record))
    timed = reference_records()
    rows = ["| shape | card | fits (predicted) | AdamW state | slots | resident blocks | predicted peak allocated GB "
            "| predicted step s, PCIe 4 / PCIe 5 | measured under that cap (H200) |", "|---|---|---|---|---|---|---|---|---|"]
    for name in SMALL_CARD_SHAPES:
        for card in SMALL_CARDS_GIB:
            try:
                plan = _plan(name, f"{card}GiB", optimizer_states="auto")
            except ConfigError:
                minimum = planner.minimum_budget(shape_plan(name).footprint(), workload_of(batch_size=BATCH, seq_len=SEQ),
                                                 context_bytes=planner.CUDA_CONTEXT_BYTES, optimizer_states="auto")
                rows.append(f"| {name} | {card} GiB | no (needs {_gb(minimum)} GB) | - | - | - | - | - | - |")
                continue
            steps = "- (no H200 reference to derive compute from)"
            if name in timed:
                steps = " / ".join(f"{_plan(name, f'{card}GiB', link, 'auto').step.step_s:.2f}"
                                   for link in LINKS_GB_PER_S.values())
            found = measured.get((name, float(card), plan.optimizer_states))  # a cap of N GB on the N GiB row
            cell = "not measured"
            if found:
                path, record = found
                poros = record["arms"]["poros"]
                chunks = record["config"].get("loss_chunks", 1)
                cell = (f"{poros['peak_allocated_gb']:.2f} GB, {poros['median_step_s']:.3f} s"
                        + (f", loss in {chunks} chunks" if chunks > 1 else "") + f" ({_link(path)})")
            rows.append(f"| {name} | {card} GiB | yes | {plan.optimizer_states} | {plan.num_slots} | "
                        f"{len(plan.resident_blocks)} of {plan.num_blocks} | {_gb(plan.peak.total)} | {steps} | {cell} |")
    return "\n".join(rows)


#: the long-context rows (issue 32): shape, tokens per example, card
LONG_CONTEXT = (("qwen2.5-72b", 8192, 24), ("qwen2.5-72b", 32768, 24), ("qwen2.5-72b", 65536, 48),
                ("qwen2.5-72b", 131072, 80), ("qwen2.5-32b", 32768, 12), ("qwen2.5-32b", 32768, 24),
                ("qwen2.5-7b", 32768, 8), ("qwen2.5-72b", 131072, 24))


def long_context_plan(name: str, seq: int, card_gib: int):
    """``(plan, budget plan or the ConfigError)`` of ``name`` at ``seq`` tokens, batch 1, layer-major (the
    PorosConfig default), on a ``card_gib`` card: what ``poros plan --seq-len SEQ --vram-budget CARDGiB`` decides."""
    from poros.config import PorosConfig
    from poros.errors import ConfigError
    from poros.plan import budget as planner
    from poros.stream.options import StreamOptions
    from poros.plan.run_plan import plan_run

    config, _ = _shapes().model_config(name)
    with tempfile.TemporaryDirectory() as directory:
        config.save_pretrained(directory)
        plan = plan_run(PorosConfig(model=directory, device="cuda", seq_len=seq, batch_size=BATCH, double_quant=True,
                                    lora_rank=RANK, lora_alpha=2 * RANK, target_modules=list(TARGETS),
                                    embeddings_on_host=True, attn_implementation="sdpa"))
    options = StreamOptions(vram_budget=f"{card_gib}GiB", embeddings_on_host=True, workload=plan.workload)
    try:
        return plan, planner.plan_budget(plan.footprint(), plan.workload, options,
                                         context_bytes=planner.CUDA_CONTEXT_BYTES, footprint_for=plan.footprint_for())
    except ConfigError as error:
        return plan, error


#: the host RAM the long-context rows are also planned for (GiB, by card): a desktop's beside a consumer card, a
#: server's beside an 80 GB one (issue 43's acceptance budgets)
HOST_BUDGET_GIB = {8: 32, 12: 32, 24: 48, 48: 64, 80: 100}


def long_context_host_fit(plan, card_gib: int) -> str:
    """The row's plan with ``boundary_every: auto`` and ``--host-budget`` of :data:`HOST_BUDGET_GIB`: ``k``, where
    the boundary states wait, and the host RAM it needs (blocks mapped, as from the cache or a bnb-4bit checkpoint)."""
    from poros.errors import ConfigError
    from poros.plan import budget as planner
    from poros.plan import host_tiers
    from poros.plan.host_tiers import host_ram_parts
    from poros.stream.options import StreamOptions

    host_gib = HOST_BUDGET_GIB[card_gib]
    options = StreamOptions(vram_budget=f"{card_gib}GiB", embeddings_on_host=True, workload=plan.workload,
                            boundary_every="auto", host_budget=f"{host_gib}GiB")
    try:
        bp = planner.plan_budget(plan.footprint(), plan.workload, options, context_bytes=planner.CUDA_CONTEXT_BYTES,
                                 footprint_for=plan.footprint_for())
    except ConfigError:
        return f"{host_gib} GiB: does not fit"
    host = host_tiers.plan_host_tier(bp.block_bytes, bp.resident_blocks, host_budget=f"{host_gib}GiB",
                                     shared_file=True)
    need = sum(n for _, n in host_ram_parts(bp, host, plan.footprint()))
    return f"{host_gib} GiB: boundary_every {bp.boundary_every}, {bp.boundary_states}, {_gb(need)} GB ({host.tier} tier)"


def long_context_records() -> dict[tuple[str, int, float], tuple[Path, dict]]:
    """``(shape, seq, cap GB) -> (path, record)``: the newest finished full-depth Poros run at a long
    sequence under a cap (a cap of N GB stands on the N GiB row, as in the small-card table)."""
    found = {}
    for path, record in capped_records():
        config, poros = record["config"], record["arms"].get("poros", {})
        info = config.get("model_info", {})
        if config["seq"] > SEQ and poros.get("status") == "ok" and info.get("num_hidden_layers") == info.get("full_depth"):
            found[(config["model"], config["seq"], float(config["vram_limit_gb"]))] = (path, record)
    return found


def _quantized_shape(directory: Path, checkpoint: str) -> str | None:
    """The full-depth shape a ``prequant`` report of ``directory`` wrote into ``checkpoint`` (the long-context runs
    start from it), or None."""
    for path in sorted(directory.glob("prequant-*.json")):
        record = json.loads(path.read_text())
        quantize, model = record.get("quantize") or {}, record.get("model") or {}
        if quantize.get("output") == checkpoint and model.get("num_hidden_layers") == model.get("full_depth"):
            return model.get("shape")
    return None


def _recorded_shape(model: dict) -> str | None:
    """The full-depth bench shape whose config the run recorded (``long_context_run``'s ``model``), or None: for a
    run whose checkpoint's ``prequant`` report did not come back with it."""
    from tools.bench.shapes import SHAPES, model_config

    keys = ("model_type", "num_hidden_layers", "hidden_size", "intermediate_size", "vocab_size")
    for name in SHAPES:
        try:
            config, _ = model_config(name)
        except KeyError:
            continue
        if all(getattr(config, key, None) == model.get(key) for key in keys):
            return name
    return None


def long_context_runs() -> dict[tuple[str, int, float], tuple[Path, dict]]:
    """``(shape, seq, cap GB) -> (path, report)``: the newest finished ``tools/checks/long_context_run`` report
    (trained or failed) per row, its shape the one quantized into its checkpoint in the same run."""
    found = {}
    for path in sorted(ROOT.glob("registry/results/h200-*/long-*.json")):
        record = json.loads(path.read_text())
        args = record.get("args") or {}
        if record.get("tool") != "long_context_run" or record.get("partial") or not args.get("cap_gib"):
            continue
        shape = _quantized_shape(path.parent, args["checkpoint"]) or _recorded_shape(record.get("model") or {})
        if shape is not None:
            found[(shape, args["seq"], float(round(args["cap_gib"] * 2**30 / 1e9)))] = (path, record)
    return found


def _long_context_run_cell(path: Path, record: dict) -> str:
    plan = record.get("budget_plan") or {}
    predicted = _gb((plan.get("peak") or {}).get("total", 0))
    allocated = record["peak_allocated_bytes"] / 1e9
    host = (f"host {record['host_peak_rss_bytes'] / 1e9:.1f} GB peak RSS "
            f"(planned {_gb(record['planned']['host_ram_bytes'])})" if record.get("planned") else "")
    if record.get("failed"):
        return (f"failed, {record['failed'].split(':')[0]} at {allocated:.2f} GB allocated (predicted {predicted}), "
                f"{host} ({_link(path)})")
    disk = (f", boundary states on the disk {record['spill_peak_bytes'] / 1e9:.1f} GB" if record["spill_peak_bytes"]
            else ", nothing on the disk")
    return (f"{allocated:.2f} allocated / {record['peak_reserved_bytes'] / 1e9:.2f} reserved GB (predicted {predicted}), "
            f"{record['step_s'][-1]:.1f} s{docgen.shared_mark(record)}, {record['tokens_per_second'][-1]:,.0f} tokens/s, {host}, "
            f"boundary_every {record['boundary_every']}{disk}, deterministic, from a bnb-4bit checkpoint "
            f"({_link(path)})")


def _long_context_cell(found: tuple[Path, dict] | None, run: tuple[Path, dict] | None = None) -> str:
    cells = [_long_context_bench_cell(found)] if found is not None else []
    if run is not None:
        cells.append(_long_context_run_cell(*run))
    return "; ".join(cells) or "not measured"


def _long_context_bench_cell(found: tuple[Path, dict]) -> str:
    path, record = found
    from poros.plan import calibration

    poros = record["arms"]["poros"]
    return (f"{poros['peak_allocated_gb']:.2f} allocated / {poros['peak_reserved_gb']:.2f} reserved GB "
            f"(predicted {_gb(calibration.predicted_peak(record))} for its own options), "
            f"{poros['median_step_s']:.1f} s, {poros['tokens_per_s']:,.0f} tokens/s, host {poros['host_peak_rss_gb']:.1f} GB "
            f"({_link(path)})")


def render_long_context() -> str:
    from poros.plan import host_tiers
    from poros.plan.host_tiers import host_ram_parts

    rows = ["| shape | seq | card | fits | loss_chunks | mlp_chunks | boundary states (all) | peak allocated GB "
            "(phase) | largest parts GB | host RAM GB | with a host budget (boundary_every auto): states, host RAM "
            "planned | measured under that cap (H200, full depth) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    measured, runs = long_context_records(), long_context_runs()
    for name, seq, card in LONG_CONTEXT:
        plan, bp = long_context_plan(name, seq, card)
        if isinstance(bp, Exception):
            reason = str(bp).split(". ")[0].split(": its biggest part is ")[-1]
            rows.append(f"| {name} | {seq:,} | {card} GiB | no: biggest part {reason} | | | | | | | | |")
            continue
        host = host_tiers.plan_host_tier(bp.block_bytes, bp.resident_blocks)
        host_gb = sum(n for _, n in host_ram_parts(bp, host, plan.footprint()))
        parts = sorted(((n, label) for label, n in (*bp.peak.persistent, *bp.peak.transient) if n), reverse=True)[:2]
        largest = "; ".join(f"{label.split(' (')[0]} {_gb(n)}" for n, label in parts)
        rows.append(f"| {name} | {seq:,} | {card} GiB | yes | {bp.loss_chunks} | {bp.mlp_chunks} | "
                    f"{bp.boundary_states} ({_gb(bp.boundary_bytes)} GB) | {_gb(bp.peak.total)} ({bp.peak.phase}) | "
                    f"{largest} | {_gb(host_gb)} | {long_context_host_fit(plan, card)} | "
                    f"{_long_context_cell(measured.get((name, seq, float(card))), runs.get((name, seq, float(card))))} |")
    return "\n".join(rows)


def estimate_records() -> list[tuple[Path, dict]]:
    """Per shape, depth and sequence, the first uncapped H200 bench record at batch 1, one micro-batch, no budget,
    eager blocks and HF's loss, its Poros arm finished."""
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


def render_dry_run() -> str:
    """Each record's peak beside today's ``poros train --dry-run`` estimate for the model and options it describes
    (:attr:`poros.plan.run_plan.Plan.peak_device_bytes_estimate`, :func:`poros.plan.calibration.record_plan`)."""
    from poros.plan import calibration

    rows = ["| shape | layers | seq | recorded peak GB | estimated peak GB (dry run) | JSON |", "|---|---|---|---|---|---|"]
    for path, record in estimate_records():
        setup = record["config"]
        estimate = calibration.record_plan(record).peak_device_bytes_estimate
        rows.append(f"| {setup['model']} | {setup['model_info']['num_hidden_layers']} | {setup['seq']} | "
                    f"{record['arms']['poros']['peak_allocated_gb']:.2f} | {estimate / 1e9:.2f} | {_link(path)} |")
    return "\n".join(rows)


BLOCKS = {
    "rule": lambda: f"the {COMPUTE_RULE}.",
    "dry-run-estimate": render_dry_run,
    "long-context": render_long_context,
    "measured": render_measured,
    "capped": render_capped,
    "minimums": render_minimums,
    "cards": render_cards,
    "small-cards": render_small_cards,
}


def main(argv=None) -> int:
    return docgen.main_for_blocks(__doc__, PAGE, BLOCKS, argv, quiet=True)


if __name__ == "__main__":
    sys.exit(main())
