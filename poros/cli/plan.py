"""``poros plan``: what a VRAM budget buys -- device slots, resident blocks, peak and step time.

Reads the same configuration as ``poros train`` (a ``poros.yaml`` and ``--key value``
overrides; ``--vram-budget`` is the ``vram_budget`` field) and the checkpoint's ``config.json``
only: nothing is loaded or trained. On CUDA it times one block of the model at the run's shapes
(the compute probe) and the host-to-device link, and predicts the step; on the CPU, give the
times (``--block-ms``, ``--link-gb-per-s``) or the step time is reported as unknown.
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
      poros plan: error: ConfigError: VRAM budget 4.29 GB is below the minimum for this run: it needs at least
      ... Raise the budget to at least ...
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


def parse_block_ms(text: str) -> tuple[float, float]:
    """``"6,12"`` -> ``(0.006, 0.012)`` seconds; ``"18"`` -> ``(0.006, 0.012)`` (split 1:2).

    Raises:
        ConfigError: not one or two positive numbers.
    """
    from poros.errors import ConfigError

    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        values = []
    if len(values) not in (1, 2) or any(v <= 0 for v in values):
        raise ConfigError(f"--block-ms {text!r}: expected FWD,BWD milliseconds per block and micro-batch (e.g. 6,12) "
                          "or one total (split 1:2 between forward and recompute+backward).")
    if len(values) == 1:
        return values[0] / 3000, 2 * values[0] / 3000
    return values[0] / 1000, values[1] / 1000


def host_tier_plan(config, block_bytes, resident_blocks, ranks_per_node: int = 1):
    """The host tier for ``--host-tier`` / ``--host-budget`` and the node's ranks (``poros.loading.host_tiers``; torch-free):
    the tier the run will take, ``mapped`` when the model loads through the block cache."""
    from poros.config import parse_budget
    from poros.loading.host_tiers import choose_host_tier

    budget = parse_budget(config.host_budget, "host_budget") if config.host_budget is not None else None
    streamed = [n for i, n in enumerate(block_bytes) if i not in set(resident_blocks)]
    return choose_host_tier(streamed, budget, requested=config.host_tier, read_ahead=config.read_ahead,
                            ranks_per_node=ranks_per_node, shared_file=not config.no_cache)


def run(args: argparse.Namespace) -> int:
    import sys
    from dataclasses import asdict
    from pathlib import Path

    from poros.noise import quiet_known_noise
    from poros.training.validation import require_run_packages

    quiet_known_noise(verbose=args.verbose)
    require_run_packages("poros plan")
    import torch

    from poros.doctor import probe
    from poros.cli.arguments import load_config
    from poros.cli.output import print_json
    from poros.cli.report import format_budget_plan
    from poros.devices import resolve_device
    from poros.errors import ConfigError
    from poros.training.plan import load_text_config, plan_run
    from poros.stream import planner
    from poros.stream.placement import embeddings_on_host

    config = load_config(list(getattr(args, "arguments", [])))
    # the budget, the probe and the link measurement need the GPU itself; all three given, a CUDA run is
    # planned on any machine
    given_all = config.vram_budget is not None and args.block_ms is not None and args.link_gb_per_s is not None
    device = resolve_device(config.device, check=not given_all)
    on_cuda = device.type == "cuda"
    budget = config.vram_budget
    if budget is None:
        if not on_cuda:
            raise ConfigError("poros plan needs a budget on the CPU: pass --vram-budget (e.g. --vram-budget 8GiB for "
                              "an 8 GiB card); on CUDA it defaults to the device's memory.")
        budget = torch.cuda.get_device_properties(device).total_memory
    plan = plan_run(config)
    ranks = args.nproc_per_node
    workload = planner.Workload(config.batch_size, config.seq_len, config.grad_accum, config.stream_schedule,
                                config.loss_chunks)

    compute = link = None
    link_source = None
    if args.block_ms is not None:
        forward, backward = parse_block_ms(args.block_ms)
        compute = planner.ComputeTimes.uniform(plan.num_blocks, forward, backward, args.head_ms / 1000,
                                               source=f"given: --block-ms {args.block_ms}"
                                                      + (f" --head-ms {args.head_ms:g}" if args.head_ms else ""))
    elif args.probe or (args.probe is None and on_cuda):
        _, text_config = load_text_config(Path(plan.checkpoint))
        try:
            compute = probe.probe_compute(
                text_config, workload, device, compute_dtype=getattr(torch, config.compute_dtype),
                quant_type=config.quantization, double_quant=config.double_quant,
                attn_implementation=config.attn_implementation, lora_rank=config.lora_rank,
                lora_alpha=config.lora_alpha, target_modules=config.target_modules,
                lora_parameters=plan.lora_parameters)
        except torch.OutOfMemoryError as error:
            print(f"poros plan: the compute probe did not fit on {device} ({str(error).splitlines()[0]}); the step "
                  "time stays unknown. Give --block-ms (and --link-gb-per-s) from another run, or free the device.",
                  file=sys.stderr)
    if args.link_gb_per_s is not None:
        if args.link_gb_per_s <= 0:
            raise ConfigError(f"--link-gb-per-s {args.link_gb_per_s:g}: expected a positive GB/s, e.g. 25 (PCIe 4 x16).")
        link, link_source = args.link_gb_per_s * 1e9, "given: --link-gb-per-s"
    elif compute is not None and (on_cuda or args.probe):
        link = probe.measure_link(device)
        link_source = "measured: one pinned 256 MiB copy" if on_cuda else "measured: a 256 MiB host memcpy (cpu)"
    on_host = embeddings_on_host(config.embeddings_on_host, device)
    from poros.stream.placement import graph_reserve_bytes

    context = planner.CUDA_CONTEXT_BYTES if on_cuda else 0
    if on_cuda and config.cuda_graphs is not False:  # the graphs' pool and static buffers (an estimate)
        context += graph_reserve_bytes(plan.footprint(), config.num_slots)
    budget_plan = planner.plan_budget(
        plan.footprint(), workload, budget, num_slots=config.num_slots, embeddings_on_host=on_host, compute=compute,
        link_bytes_per_s=link, context_bytes=context,
        optimizer_states=config.optimizer_states, lora_placement=config.lora_placement)
    host = host_tier_plan(config, plan.footprint().block_bytes, budget_plan.resident_blocks, ranks)
    node = node_host_ram(plan.footprint(), host, on_host, shared_tables=not config.no_cache)
    if args.json:
        print_json({"model": plan.model, "checkpoint": plan.checkpoint, "family": plan.family,
                    "device": plan.device, "link_source": link_source,
                    "footprint": asdict(plan.footprint()),
                    "compute": asdict(compute) if compute else None, "plan": budget_plan.to_dict(),
                    "host": host.to_dict(), "data_parallel": node})
    else:
        print(format_budget_plan(plan, budget_plan, link_source=link_source))
        from poros.loading.host_tiers import size

        print(f"host: {host.reason}; {size(host.host_bytes)} of host RAM for the blocks")
        if ranks > 1:
            how = ("one copy shared by the ranks (mapped tier)" if host.tier == "mapped" else
                   f"one {host.tier} copy per rank" + ("" if host.tier != "pinned" or config.host_tier else
                                                       "; with the block cache on they would share one"))
            print(f"data parallel: {ranks} ranks per node, batch {config.batch_size} per GPU = {config.batch_size * ranks} "
                  "on the node; the "
                  f"peak above is per GPU. Host RAM of the node for the frozen base: "
                  f"{planner.format_gb(node['host_bytes_per_node'])}, {how} (docs/multi-gpu.md)")
    return 0


def node_host_ram(footprint, host, embeddings_on_host: bool, *, shared_tables: bool = False) -> dict:
    """Host bytes of a node's frozen base: the host tier's blocks (once for ``mapped``, once per rank else)
    and the host embedding tables (once when ``shared_tables``: the node's ranks map one copy of each when
    the model comes through the block cache; once per rank else); beside them the two bounds, one copy per
    rank and one shared copy. ``host_bytes_per_node`` is what the run will use."""
    ranks = host.ranks_per_node
    one = sum(footprint.block_bytes) + (footprint.host_embedding_bytes if embeddings_on_host else 0)
    tables = footprint.host_embedding_bytes if embeddings_on_host else 0
    return {"ranks_per_node": ranks, "host_tier": host.tier, "host_bytes_one_rank": one,
            "host_bytes_per_node": host.host_bytes_per_node + (tables if shared_tables and ranks > 1 else tables * ranks),
            "host_bytes_per_node_one_copy_per_rank": one * ranks, "host_bytes_per_node_shared": one}
