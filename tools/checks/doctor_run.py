"""``poros doctor`` on the GPU host, written to files: the paste-ready block and the JSON, with date and commit.

    python -m tools.checks.doctor_run --json out/doctor.json                      # the full doctor
    python -m tools.checks.doctor_run --model qwen2.5-32b --json out/doctor-32b.json   # + what the planner says
    python -m tools.checks.doctor_run --model poros-tiny-qwen3 --quick --json out/d.json   # CPU dry run

``--model`` takes what ``poros doctor --model`` takes, or a shape of ``tools/bench/shapes.py`` (``SHAPES``,
facts from ``registry/<family>.toml``): its ``config.json`` is written to a temporary directory
named after the shape, since the GPU host has no HF cache and no network. The text block goes to
the ``.txt`` beside the JSON and to stdout (the run's log); the JSON holds the doctor's report
(``report``), the block (``text``), the date, the commit and, for a shape, where its facts came from.
Exit status: the doctor's (1 when a problem that blocks training was found).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
from pathlib import Path



#: the scratch directory a bench shape's config.json is written to; the report names the model, never it
SCRATCH_PREFIX = "poros-doctor-shape-"


def relabel(data: dict, directory: str, shape_info: dict) -> None:
    """Name a shape's model by its HF id, not by the temporary directory its config was written to,
    in the model's record, the suggested flags and the problems (rendered again)."""
    from poros.doctor import diagnostics

    name = shape_info["hf_id"] or shape_info["shape"]
    record = data["model"]
    record["model"] = name
    record["found_in"] = f"config.json from {shape_info['facts_from']} (tools/bench/harness.py shape {shape_info['shape']})"
    record["checkpoint"] = None  # the scratch directory held only that config.json
    record["suggested_flags"] = [name if flag == directory else flag for flag in record["suggested_flags"]]
    data["problems"] = diagnostics.problems(data)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a bench shape (qwen2.5-32b), a checkpoint directory or a bundled model")
    parser.add_argument("--vram-budget", help="as poros doctor --vram-budget")
    parser.add_argument("--quick", action="store_true", help="skip the bandwidth measurement")
    parser.add_argument("--json", type=Path, required=True, help="where the JSON goes; the text goes beside it (.txt)")
    parser.add_argument("--commit", help="commit to record (default: $POROS_COMMIT or git)")
    args = parser.parse_args(argv)

    from tools.bench.provenance import git_commit
    from tools.bench.shapes import SHAPES, model_config
    from poros.cli import doctor

    shape_info = None
    with tempfile.TemporaryDirectory(prefix=SCRATCH_PREFIX) as scratch:
        model = args.model
        if model in SHAPES:
            config, shape_info = model_config(model)
            model = str(Path(scratch) / model)
            config.save_pretrained(model)
        data = doctor.report()
        data.update(doctor.gpu_report(data, quick=args.quick, model=model, vram_budget=args.vram_budget))
    if shape_info is not None and not data["model"].get("error"):
        relabel(data, model, shape_info)
    text = doctor.format_report(data)
    print(text)
    record = {"tool": "doctor", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": git_commit(args.commit), "argv": sys.argv[1:] if argv is None else argv,
              "model_shape": shape_info, "text": text, "report": data}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(record, indent=1, default=str) + "\n")
    args.json.with_suffix(".txt").write_text(text + "\n")
    return doctor.exit_status(data)


if __name__ == "__main__":
    sys.exit(main())
