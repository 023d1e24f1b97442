"""``poros plan``: what a VRAM budget buys -- device slots, resident blocks, peak and step time.

Reads the same configuration as ``poros train`` (a ``poros.yaml`` and ``--key value``
overrides; ``--vram-budget`` is the ``vram_budget`` field) and the checkpoint's ``config.json``
only: nothing is loaded or trained. On CUDA it times one block of the model at the run's shapes
(the compute probe) and the host-to-device link, and predicts the step; on the CPU, give the
times (``--block-ms``, ``--link-gb-per-s``) or the step time is reported as unknown. A thin shell: the
plan is :func:`poros.plan.run_plan.plan_run`'s, the text :mod:`poros.cli.report`'s.
Exit status: 0 planned, 1 a Poros error (the budget is below the minimum -- the message says how
much the run needs --, a bad value or override), 2 a usage error.
"""

from __future__ import annotations

import argparse
import textwrap
from typing import Any

DESCRIPTION = """\
Plan a run for a VRAM budget without loading or training anything.

  CONFIG          a poros.yaml (optional; `poros init` writes one)
  --KEY VALUE     any PorosConfig field: --model, --vram-budget 7GiB, --seq-len, --batch-size,
                  --grad-accum, --stream-schedule layer-major, --num-slots, --device ...

The planner keeps the embedding tables on the host, gives the ring its slots, and makes the last
blocks resident (the last of forward are the first of backward) as far as the budget allows: a
resident block is never copied again. It prints the decisions, the predicted peak and its parts
against the budget, the bytes copied per step, the predicted step time, and the budget that would
take the copy off the critical path (the fewest resident blocks for which no block waits for its
copy).
"""

EPILOG = textwrap.dedent("""\
    examples:
      $ poros plan --vram-budget 1GiB --device cpu          # the bundled tiny Qwen3, memory plan only
      $ poros plan --model Qwen/Qwen2.5-32B --vram-budget 8GiB     # on CUDA: probe + step prediction
      $ poros plan poros.yaml --vram-budget 24GB --seq-len 2048 --json
      $ poros plan --model ./ckpt --vram-budget 12GiB --device cpu --block-ms 6,12 --link-gb-per-s 25
      $ poros plan --model Qwen/Qwen2.5-72B --vram-budget 24GiB --host-budget 16GiB   # host tier + read-ahead

      $ poros plan --model Qwen/Qwen2.5-72B --vram-budget 4GiB
      poros plan: error: ConfigError: VRAM budget 4.29 GB does not fit this run: its biggest part is ...; it is
      below the minimum for this run: it needs at least ... Fix: --vram-budget ... or more (poros plan then ...
    """)

USAGE = ("poros plan [-h] [CONFIG] [--KEY VALUE ...] [--block-ms FWD,BWD] [--head-ms MS] [--verbose] "
         "[--link-gb-per-s GB] [--probe | --no-probe] [--nproc-per-node N] [--json]")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "plan",
        help="plan device slots and resident blocks for a VRAM budget; predict peak and step time",
        description=DESCRIPTION,
        epilog=EPILOG,
        usage=USAGE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # an abbreviation must be an unknown override, not one of these options
    )
    parser.add_argument("--block-ms", metavar="FWD,BWD",
                        help="compute per block and micro-batch in ms: forward, recompute+backward (one number: "
                             "their sum, split 1:2); skips the probe")
    parser.add_argument("--head-ms", type=float, default=0.0, metavar="MS",
                        help="head and loss, forward and backward, per micro-batch in ms (with --block-ms)")
    parser.add_argument("--link-gb-per-s", type=float, metavar="GB",
                        help="host-to-device GB/s (10^9 bytes); default: measured on CUDA")
    parser.add_argument("--probe", action=argparse.BooleanOptionalAction, default=None,
                        help="time one block at the run's shapes on the device (default: on CUDA, unless "
                             "--block-ms is given)")
    parser.add_argument("--nproc-per-node", type=int, default=1, metavar="N",
                        help="data parallel over N ranks per node: plan each GPU for its batch_size (per device, "
                             "as HF's per_device_train_batch_size), and report the host RAM of the node")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--verbose", action="store_true",
                        help="also show the known third-party notices Poros hides (see poros.noise)")
    parser.set_defaults(run=run)
    from poros.cli.arguments import keep_unknown_arguments

    keep_unknown_arguments(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    """Parse the configuration, plan it (``poros.plan.run_plan.plan_run``), print the report."""
    import sys

    from poros.noise import quiet_known_noise
    from poros.training.validation import require_run_packages

    quiet_known_noise(verbose=args.verbose)
    require_run_packages("poros plan")
    from poros.cli.arguments import load_config
    from poros.cli.output import print_json
    from poros.cli.report import budget_report_json, format_budget_report
    from poros.doctor import probe
    from poros.plan.run_plan import PlanOptions, plan_run

    config = load_config(list(getattr(args, "arguments", [])))
    plan = plan_run(config, PlanOptions(block_ms=args.block_ms, head_ms=args.head_ms, link_gb_per_s=args.link_gb_per_s,
                                        probe=args.probe, ranks_per_node=args.nproc_per_node, prober=probe))
    for notice in plan.budget.notices:
        print(f"poros plan: {notice}", file=sys.stderr)
    if args.json:
        print_json(budget_report_json(plan))
    else:
        print(format_budget_report(plan))
    return 0
