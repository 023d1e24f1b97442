"""Host work per step, Poros against the resident reference, with the device work made negligible.

    python -m tools.bench.host_overhead --breakdown --json registry/results/cpu-2026-12-03/host-overhead.json

On the H200 the 512-token steps are host-bound (the GPU waits for the host at most block
boundaries, ``tools/bench/harness.py --timeline``), so a step costs what the host spends issuing it. This
replays that regime on the CPU: the Qwen2.5-32B layer count (64) at a tiny width, one thread,
so each op's execution is as cheap as a kernel launch and the step time is the host's work:
Python, autograd, HF, PEFT, bitsandbytes and -- for Poros -- the executor. Arms, interleaved
round by round so that a drifting machine drifts for all of them:

* ``resident``: HF checkpointing (non-reentrant), one micro-batch;
* ``resident-plain``: no checkpointing, one micro-batch: each block's forward once, with autograd --
  the resident counterpart of a block that keeps its activations;
* ``poros-resident``: every block resident (the executor without copies), recompute ``all``;
* ``poros``: every block streamed from the host store, recompute ``all``;
* ``poros-kept``: streamed, ``recompute="none"`` (every block keeps its activations), micro-major;
* ``poros-layer-major`` / ``poros-kept-layer-major``: streamed, ``forward_backward`` over ``--accumulation``
  micro-batches (the schedule ``prepare_trainer`` runs with accumulation), recompute ``all`` / ``none``;
* ``poros-kept-layer-major-collecting``: the kept layer-major arm with ``pause_gc=False`` (the collector runs
  inside the step, as it did before ``pause_gc``).

Median seconds per micro-batch (forward + backward; a layer-major step's time over its micro-batches) per
arm, its ratio to ``resident`` and ``resident-plain``, the host milliseconds per block call (one block's
forward and backward for one micro-batch), and the time Python's cyclic garbage collector took inside the
steps (a kept graph holds Python objects until its backward: the packed saved tensors, and the wrappers of the
graph nodes its context walk visited). ``--breakdown`` adds, for the kept layer-major arm and
``resident-plain``, one profiled step (cProfile; it slows Python down, so read shares, not times) with the
self time grouped by whose code it is, and -- unprofiled -- the milliseconds per kept block call spent in
each part of ``poros/stream/kept.py``'s bookkeeping (packing saved tensors, walking the graph for
contexts, binding them back, unpacking).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import json
import pstats
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

from tools.bench.models import SEVEN_PROJECTIONS, add_lora, build_model, make_batches
from tools.bench.provenance import environment
from tools.bench.shapes import model_config

ARMS = ("resident", "resident-plain", "poros-resident", "poros", "poros-kept", "poros-layer-major",
        "poros-kept-layer-major", "poros-kept-layer-major-collecting")
#: arm -> (resident blocks: "all" or 0, recompute, layer-major, pause_gc)
POROS_ARMS = {"poros-resident": ("all", "all", False, True), "poros": (0, "all", False, True),
              "poros-kept": (0, "none", False, True), "poros-layer-major": (0, "all", True, True),
              "poros-kept-layer-major": (0, "none", True, True),
              "poros-kept-layer-major-collecting": (0, "none", True, False)}
#: the kept bookkeeping's parts (``KeptBlock`` methods) the breakdown times
KEPT_PARTS = ("_pack", "_unpack", "detach_contexts", "bind_contexts")
#: whose code a profiled function is, by the first fragment of its file name found (else "torch and other")
OWNERS = (("poros/stream/kept.py", "poros kept.py"), ("poros/", "poros (executor, store, other)"),
          ("transformers/", "transformers"), ("peft/", "peft"), ("bitsandbytes/", "bitsandbytes"),
          ("run_backward", "autograd engine (backward)"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="steps per arm per round")
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--accumulation", type=int, default=4, help="micro-batches of a layer-major step")
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--breakdown", action="store_true", help="profile where the kept arm's host time goes")
    parser.add_argument("--commit")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    torch.set_num_threads(1)
    device = torch.device("cpu")
    config, info = model_config("qwen2.5-32b", layers=args.layers, hidden_size=64, intermediate_size=128,
                                      num_attention_heads=2, num_key_value_heads=1, vocab_size=256)
    model = build_model(config, device)
    peft_model = add_lora(model, gradient_checkpointing=False)  # only the ``resident`` arm checkpoints
    batches = make_batches(config, count=args.accumulation, batch=1, seq=args.seq)
    arms = [arm for arm in ARMS if arm in args.arms]
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    collector = _Collector()
    for _ in range(args.rounds):
        for arm in arms:
            with _arm(peft_model, arm, args.layers) as call:
                count = args.accumulation if POROS_ARMS.get(arm, (0, 0, False, True))[2] else 1
                for _ in range(args.steps):
                    with collector.counting(arm, count):
                        times[arm].append(_timed(call, batches[:count]) / count)
    medians = {arm: statistics.median(values[1:]) for arm, values in times.items()}  # the first step warms up
    report = {
        "tool": "tools/bench/host_overhead.py", "environment": environment(device, args.commit),
        "config": {"shape": f"qwen2.5-32b layer count ({args.layers}) at hidden 64, intermediate 128, vocab 256",
                   "layers": args.layers, "seq": args.seq, "accumulation": args.accumulation, "rounds": args.rounds,
                   "steps_per_round": args.steps, "threads": 1,
                   "lora": {"rank": 16, "targets": list(SEVEN_PROJECTIONS)}},
        "step_times_s": {arm: [round(t, 5) for t in values] for arm, values in times.items()},
        "median_step_s": {arm: round(m, 5) for arm, m in medians.items()},
        "ms_per_block_call": {arm: round(m / args.layers * 1e3, 3) for arm, m in medians.items()},
        # Python's cyclic garbage collector, inside the timed steps: ms per micro-batch, collections per micro-batch
        "gc_ms_per_micro_batch": {arm: round(collector.seconds[arm] / collector.micro_batches[arm] * 1e3, 3)
                                  for arm in arms},
        "gc_collections_per_micro_batch": {
            arm: [round(c / collector.micro_batches[arm], 2) for c in collector.collections[arm]] for arm in arms},
    }
    for reference in ("resident", "resident-plain"):
        if reference in medians:
            key = "ratio_to_resident" if reference == "resident" else "ratio_to_resident_plain"
            report[key] = {arm: round(m / medians[reference], 4) for arm, m in medians.items()}
    for arm, median in medians.items():
        ratio = f"  x{median / medians['resident']:.3f}" if "resident" in medians else ""
        print(f"{arm:<24}{median:.4f} s/micro-batch  {median / args.layers * 1e3:.3f} ms/block call{ratio}")
    if args.breakdown:
        report["breakdown"] = _breakdown(peft_model, batches, args.layers)
        print(json.dumps(report["breakdown"], indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


class _arm:
    """The model set up as ``arm`` runs it; ``call(batches)`` is one step over ``batches``."""

    def __init__(self, peft_model, arm: str, layers: int) -> None:
        self.peft_model, self.arm, self.layers, self.handle = peft_model, arm, layers, None

    def __enter__(self):
        import poros

        base = self.peft_model.get_base_model()
        if self.arm == "resident":
            base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        if self.arm in ("resident", "resident-plain"):
            return lambda batches: [self.peft_model(**b, use_cache=False).loss.backward() for b in batches]
        resident, recompute, layer_major, pause_gc = POROS_ARMS[self.arm]
        self.handle = poros.prepare(self.peft_model, resident_blocks=self.layers if resident == "all" else resident,
                                    recompute=recompute, pause_gc=pause_gc)
        if layer_major:
            return lambda batches: self.handle.forward_backward(batches)
        return lambda batches: [self.handle(**b, use_cache=False).loss.backward() for b in batches]

    def __exit__(self, *exc) -> None:
        self.peft_model.get_base_model().activation_checkpointing_disable()
        if self.handle is not None:
            self.handle.unpatch()


class _Collector:
    """Time the cyclic garbage collector spends (and its collections by generation) inside counted steps."""

    def __init__(self) -> None:
        self.arm, self.started = None, 0.0
        self.seconds: dict[str, float] = {}
        self.collections: dict[str, list[int]] = {}
        self.micro_batches: dict[str, int] = {}

    def _callback(self, phase: str, info: dict) -> None:
        if self.arm is None:
            return
        if phase == "start":
            self.started = time.perf_counter()
        else:
            self.seconds[self.arm] += time.perf_counter() - self.started
            self.collections[self.arm][info["generation"]] += 1

    @contextlib.contextmanager
    def counting(self, arm: str, micro_batches: int):
        self.seconds.setdefault(arm, 0.0)
        self.collections.setdefault(arm, [0, 0, 0])
        self.micro_batches[arm] = self.micro_batches.get(arm, 0) + micro_batches
        self.arm = arm
        gc.callbacks.append(self._callback)
        try:
            yield
        finally:
            gc.callbacks.remove(self._callback)
            self.arm = None


def _timed(call, batches) -> float:
    start = time.perf_counter()
    call(batches)
    return time.perf_counter() - start


def _breakdown(peft_model, batches, layers: int) -> dict:
    """Where the kept layer-major arm's host time goes (beside ``resident-plain``'s): cProfile self time by owner,
    and the kept bookkeeping's milliseconds per kept block call, timed without the profiler."""
    from poros.stream import kept

    out: dict = {"profile_self_time_share": {}, "profiled_ms_per_block_call": {}}
    for arm in ("resident-plain", "poros-kept-layer-major"):
        with _arm(peft_model, arm, layers) as call:
            count = len(batches) if arm.endswith("layer-major") else 1
            call(batches[:count])  # warm
            profiler = cProfile.Profile()
            profiler.enable()
            call(batches[:count])
            profiler.disable()
        shares: dict[str, float] = {}
        for (filename, _, function), row in pstats.Stats(profiler).stats.items():
            owner = next((name for key, name in OWNERS if key in filename or key in function), "torch and other")
            shares[owner] = shares.get(owner, 0.0) + row[2]  # tottime
        total = sum(shares.values())
        out["profile_self_time_share"][arm] = {k: round(v / total, 4) for k, v in sorted(shares.items())}
        calls = count * layers
        out["profiled_ms_per_block_call"][arm] = {k: round(v / calls * 1e3, 3) for k, v in sorted(shares.items())}
    spent = {part: 0.0 for part in KEPT_PARTS}
    originals = {part: getattr(kept.KeptBlock, part) for part in KEPT_PARTS}

    def timing(part, method):
        def timed(*a, **k):
            start = time.perf_counter()
            try:
                return method(*a, **k)
            finally:
                spent[part] += time.perf_counter() - start
        return timed

    try:
        for part, method in originals.items():
            setattr(kept.KeptBlock, part, timing(part, method))
        with _arm(peft_model, "poros-kept-layer-major", layers) as call:
            call(batches)  # warm
            for part in spent:
                spent[part] = 0.0
            rounds = 3
            for _ in range(rounds):
                call(batches)
    finally:
        for part, method in originals.items():
            setattr(kept.KeptBlock, part, method)
    block_calls = rounds * len(batches) * layers
    out["kept_ms_per_block_call"] = {part.strip("_"): round(s / block_calls * 1e3, 4) for part, s in spent.items()}
    out["kept_ms_per_block_call"]["total"] = round(sum(spent.values()) / block_calls * 1e3, 4)
    return out


if __name__ == "__main__":
    sys.exit(main())
