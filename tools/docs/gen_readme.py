"""Render the README's measured claims from the H200 records in ``registry/results/``.

    python -m tools.docs.gen_readme            # rewrite the generated blocks of README.md
    python -m tools.docs.gen_readme --check    # exit 1 if one is stale (tests/test_results_docs.py runs this)

The blocks: ``measured`` (the 32B and 72B peaks beside the resident ones: the records
``docs/consumer-gpus.md``'s measured table uses), ``moe`` (the MoE shapes' streamed peaks: the records
``docs/architecture-support.md``'s MoE table uses) and ``planner`` (how far today's predicted peak is from
every H200 record the planner is calibrated against, ``poros.plan.calibration``) and ``speed-plot`` (the speed plot
``python -m tools.docs.gen_results_docs`` draws, ``tools/docs/speed_plot.py``, and the JSON it came from).
"""

from __future__ import annotations

from pathlib import Path

from tools.docs import docgen

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "README.md"


#: the rest of the measured bullet: no figure (step times and their ranges are in the results tables)
REST_OF_MEASURED = """bitwise equal to resident training with deterministic algorithms on; both train
  under 8 GB / 12 GB memory caps. Every step time, beside the resident run's and the peers' in the same
  process, is in the results tables, each row with its JSON."""


def render_measured() -> str:
    from tools.docs.gen_consumer_docs import reference_records

    found = reference_records()
    peaks = {name: (found[name][1]["arms"]["poros"]["peak_allocated_gb"],
                    found[name][1]["arms"]["resident"]["peak_allocated_gb"]) for name in ("qwen2.5-32b", "qwen2.5-72b")}
    (p32, r32), (p72, r72) = peaks["qwen2.5-32b"], peaks["qwen2.5-72b"]
    return (f"- Measured on one H200 ([results](docs/results-h200.md)): Qwen2.5-32B-shaped QLoRA training\n"
            f"  peaks at {p32:.1f} GB allocated ({r32:.1f} GB resident) and Qwen2.5-72B-shaped at {p72:.1f} GB "
            f"({r72:.1f} GB\n  resident), {REST_OF_MEASURED}")


def render_moe() -> str:
    from tools.docs.gen_architecture_docs import moe_records

    claims = []
    for _, report in moe_records():
        config, depth = report["config"], report["config"]["model_info"]
        if not ((report.get("comparison") or {}).get("bitwise") and config.get("vram_limit_gb")
                and depth["num_hidden_layers"] == depth["full_depth"]):
            continue  # the README claims full-depth runs under a cap only
        experts = " with LoRA on the experts" if config["lora"].get("on_experts") else ""
        claims.append(f"{depth['hf_id'].split('/')[-1]} in {report['arms']['poros']['peak_allocated_gb']:.1f} GB "
                      f"under a {config['vram_limit_gb']:g} GB cap{experts}")
    return ("- Mixture-of-experts: Qwen3.5/3.6 MoE (`qwen3_5_moe`) and Gemma 4 26B-A4B, the fused experts packed to NF4\n"
            "  (`poros.quantize_experts`, the trainer's default for MoE) and streamed: " + " and\n  ".join(claims)
            + " trained on the H200,\n"
            "  bitwise the resident NF4-expert model ([architecture support](docs/architecture-support.md)).")


def render_planner() -> str:
    from poros.plan import calibration

    errors = calibration.peak_errors(calibration.calibration_records(ROOT / "registry" / "results"))
    low, high = min(errors.values()), max(errors.values())
    return ("- A VRAM-budget planner (`poros plan --vram-budget 8GiB`, `prepare(vram_budget=...)`,\n"
            "  `PorosConfig.vram_budget`): resident blocks and slots that fit the budget, with a predicted peak\n"
            f"  ({low * 100:+.1f} % to {high * 100:+.1f} % of the {len(errors)} H200 measurements, "
            "`poros.plan.calibration`) — see [consumer GPUs](docs/consumer-gpus.md).")


def render_speed_plot() -> str:
    from tools.docs import gen_results_docs, results_speed, speed_plot

    return speed_plot.render_block(results_speed.sweep_points(gen_results_docs.bench_reports()), PAGE)


BLOCKS = {"measured": render_measured, "moe": render_moe, "planner": render_planner, "speed-plot": render_speed_plot}


def main(argv=None) -> int:
    return docgen.main_for_blocks(__doc__, PAGE, BLOCKS, argv, quiet=True)


if __name__ == "__main__":
    raise SystemExit(main())
