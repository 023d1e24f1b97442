"""Host work per step, Poros against the resident reference, with the device work made negligible.

    python -m tools.bench.host_overhead --json registry/results/cpu-2026-11-30/host-overhead.json

On the H200 the 512-token steps are host-bound (the GPU waits for the host at most block
boundaries, ``tools/bench/harness.py --timeline``), so a step costs what the host spends issuing it. This
replays that regime on the CPU: the Qwen2.5-32B layer count (64) at a tiny width, one thread,
so each op's execution is as cheap as a kernel launch and the step time is the host's work:
Python, autograd, HF, PEFT, bitsandbytes and -- for Poros -- the executor. Arms, interleaved
round by round so that a drifting machine drifts for all of them: ``resident`` (HF checkpointing,
non-reentrant), ``poros-resident`` (every block resident: the executor without copies) and
``poros`` (every block streamed from the host store). Median seconds per step (forward + backward
of one micro-batch) per arm; ratios to ``resident``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

from tools.bench.models import SEVEN_PROJECTIONS, add_lora, build_model, make_batches
from tools.bench.provenance import environment
from tools.bench.shapes import model_config


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="steps per arm per round")
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--commit")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    import poros

    torch.set_num_threads(1)
    device = torch.device("cpu")
    config, info = model_config("qwen2.5-32b", layers=args.layers, hidden_size=64, intermediate_size=128,
                                      num_attention_heads=2, num_key_value_heads=1, vocab_size=256)
    model = build_model(config, device)
    peft_model = add_lora(model)
    base = peft_model.get_base_model()
    batch = make_batches(config, count=1, batch=1, seq=args.seq)[0]

    def step(call) -> float:
        start = time.perf_counter()
        call(**batch, use_cache=False).loss.backward()
        return time.perf_counter() - start

    times: dict[str, list[float]] = {"resident": [], "poros-resident": [], "poros": []}
    for _ in range(args.rounds):
        base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        times["resident"] += [step(peft_model) for _ in range(args.steps)]
        base.activation_checkpointing_disable()
        for arm, resident in (("poros-resident", args.layers), ("poros", 0)):
            handle = poros.prepare(peft_model, resident_blocks=resident)
            times[arm] += [step(handle) for _ in range(args.steps)]
            handle.unpatch()
    medians = {arm: statistics.median(values[1:]) for arm, values in times.items()}  # the first step warms up
    report = {
        "tool": "tools/bench/host_overhead.py", "environment": environment(device, args.commit),
        "config": {"shape": f"qwen2.5-32b layer count ({args.layers}) at hidden 64, intermediate 128, vocab 256",
                   "seq": args.seq, "rounds": args.rounds, "steps_per_round": args.steps, "threads": 1,
                   "lora": {"rank": 16, "targets": list(SEVEN_PROJECTIONS)}},
        "step_times_s": {arm: [round(t, 5) for t in values] for arm, values in times.items()},
        "median_step_s": {arm: round(m, 5) for arm, m in medians.items()},
        "ratio_to_resident": {arm: round(m / medians["resident"], 4) for arm, m in medians.items()},
    }
    for arm, median in medians.items():
        print(f"{arm:<16}{median:.4f} s/step  x{median / medians['resident']:.3f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
