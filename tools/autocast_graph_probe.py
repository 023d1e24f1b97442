"""Where CUDA graphs under autocast differ from eager autocast, step by step (issue 30); JSON out.

::

    python -m tools.autocast_graph_probe --device cuda --json out/autocast-probe.json   # on the H200
    tools/gpu_run.sh autocast-probe                                                     # the same, as a step
    python -m tools.autocast_graph_probe --device cpu --only qwen3                      # CPU: captures skipped

Every comparison is ``torch.equal`` (plus the max |difference| where they differ), against a reference
that runs the way HF Trainer's ``bf16=True`` does: autocast entered around each forward, backward
outside it, the cast cache on.

* ``layer`` — one real PEFT LoRA on a real bitsandbytes ``Linear4bit`` (``nn.Linear`` if bitsandbytes
  does not import): eager with the cast cache on (reference), eager with it off, and (CUDA) a CUDA graph
  captured with it off the way ``poros/stream/graphs.py`` captures a backward (static input, LoRA
  weights pointed at static buffers, ``torch.autograd.grad``), with and without a warm-up run on the
  capture stream: output, input grad, lora_A / lora_B grads.
* ``accumulate`` — the same over 2 and 4 micro-batches, gradients accumulated (``.grad`` as autograd's
  accumulator leaves it; the graph's via ``add_``, as the executor does), one region per micro-batch
  (HF) vs one region for all of them (Poros layer-major), cache on / off / captured.
* ``stale`` — one autocast region around an in-place weight update (an optimizer step): is the cached
  cast stale? (torch keeps a region's first cast; the 2026-12-01 gate ran every step in one region.)
* ``blocks`` — each parity-gate variant at width 64 (real transformers classes, NF4, LoRA on every
  linear): 2 AdamW steps of 2 micro-batches, resident (HF style) vs ``poros.prepare`` layer-major with
  each ``forward_backward`` under its own autocast: eager (``cuda_graphs=False``), and (CUDA) graphs
  with ``POROS_CUDA_GRAPHS_AUTOCAST=1``; per LoRA tensor: equal / max |diff|, the first that differs
  (after step 1's backward and after the last step), the losses, the graphs' report with every failure.

* ``micro-major`` — the same models, HF Trainer's loop (``loss.backward()`` per micro-batch) on the
  prepared model with ``POROS_CUDA_GRAPHS_MICRO_MAJOR=1`` (CUDA): the block phases that run inside the
  autograd engine replay too; without and with autocast. Whether a capture holds there, and the
  failures' messages if not.

``verdict`` in the JSON: for each case, whether everything compared equal (a skipped arm counts as
equal; a failed capture falls back to eager and shows in ``cuda_graphs.failures``, not in the verdict).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

from tools.bench.provenance import environment_line, start_tool
from tools.capture_trace import tracing


def _diff(a: torch.Tensor | None, b: torch.Tensor | None) -> dict[str, Any]:
    if a is None or b is None:
        return {"equal": a is None and b is None, "max_abs": None}
    equal = a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return {"equal": bool(equal), "max_abs": 0.0 if equal else float((a.double() - b.double()).abs().max())}


def _compare(reference: dict[str, torch.Tensor | None], other: dict[str, torch.Tensor | None]) -> dict[str, Any]:
    per = {name: _diff(reference[name], other.get(name)) for name in reference}
    differing = [name for name, d in per.items() if not d["equal"]]
    return {"equal": not differing, "first_differing": differing[0] if differing else None,
            "differing": len(differing), "of": len(per), "tensors": per}


def _autocast(device: torch.device, dtype: torch.dtype, cache: bool = True):
    return torch.autocast(device.type, dtype=dtype, cache_enabled=cache)


def _guarded(record: dict, name: str, run: Callable[[], Any]) -> Any:
    try:
        return run()
    except Exception as exc:  # noqa: BLE001 - a probe reports what failed and goes on
        record[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}
        return None


# -- one LoRA layer -------------------------------------------------------------------------------
def lora_layer(device: torch.device, width: int, rank: int, seed: int):
    """A PEFT LoRA (fp32 A/B) on a bitsandbytes Linear4bit with bf16 compute (nn.Linear without bnb)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base = None
    try:
        import bitsandbytes as bnb

        linear = bnb.nn.Linear4bit(width, width, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4")
        weight = torch.randn(width, width, dtype=torch.bfloat16) * 0.02
        linear.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4")
        base, kind = linear.to(device), "bnb.nn.Linear4bit"
    except Exception as exc:  # noqa: BLE001 - the fallback is named in the JSON
        base, kind = torch.nn.Linear(width, width, bias=False).to(device, torch.bfloat16), f"nn.Linear ({exc})"
    model = get_peft_model(torch.nn.Sequential(base), LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["0"],
                                                               lora_dropout=0.0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    return model, kind


def _lora_params(model) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def _eager(model, xs, gs, device, dtype, *, cache: bool, region: str) -> dict[str, torch.Tensor]:
    """Forward under autocast, backward outside; grads accumulated over the micro-batches ``xs``.
    ``region``: "micro" (one autocast region per micro-batch, HF) or "all" (one for all, layer-major)."""
    params = _lora_params(model)
    for p in params.values():
        p.grad = None
    out: dict[str, torch.Tensor] = {}
    outer = _autocast(device, dtype, cache) if region == "all" else contextlib.nullcontext()
    with outer:
        for m, (x, g) in enumerate(zip(xs, gs)):
            leaf = x.detach().requires_grad_(True)
            with _autocast(device, dtype, cache):
                y = model(leaf)
            y.backward(g)
            out[f"output[{m}]"], out[f"input_grad[{m}]"] = y.detach(), leaf.grad
    out.update({f"grad:{n}": p.grad.clone() for n, p in params.items()})
    return out


def _captured(model, xs, gs, device, dtype, *, side_warmup: bool) -> dict[str, torch.Tensor]:
    """What graphs.py does for a backward: a graph of the recompute + autograd.grad under autocast with
    the cache off, on static buffers; replayed per micro-batch; parameter grads accumulated with add_."""
    params = list(_lora_params(model).values())
    static_x = xs[0].detach().clone().requires_grad_(True)
    static_g = gs[0].detach().clone()
    statics = [p.detach().clone() for p in params]

    def body():
        originals = [p.data for p in params]
        try:
            for p, s in zip(params, statics):
                p.data = s
            with torch.enable_grad(), _autocast(device, dtype, cache=False):
                y = model(static_x)
            grads = torch.autograd.grad([y], [static_x, *params], [static_g], allow_unused=True)
        finally:
            for p, o in zip(params, originals):
                p.data = o
        return [y.detach(), *grads]

    body()  # eager warm-up on the compute stream (poros's WARMUP run)
    stream = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    if side_warmup:
        side.wait_stream(stream)
        with torch.cuda.stream(side):
            body()
        stream.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
        outputs = body()
    out: dict[str, torch.Tensor] = {}
    accumulated: list[torch.Tensor | None] = [None] * len(params)
    for m, (x, g) in enumerate(zip(xs, gs)):
        with torch.no_grad():
            torch._foreach_copy_([static_x, static_g, *statics], [x, g, *(p.detach() for p in params)])
        graph.replay()
        out[f"output[{m}]"], out[f"input_grad[{m}]"] = outputs[0].clone(), outputs[1].clone()
        for i, grad in enumerate(outputs[2:]):
            accumulated[i] = grad.clone() if accumulated[i] is None else accumulated[i].add_(grad)
    names = list(_lora_params(model))
    out.update({f"grad:{n}": a for n, a in zip(names, accumulated)})
    return out


def case_layer(device, dtype, args, micro: int) -> dict[str, Any]:
    model, kind = lora_layer(device, args.width, args.rank, args.seed)
    generator = torch.Generator().manual_seed(args.seed + micro)
    xs = [torch.randn(2, 16, args.width, generator=generator).to(device, torch.bfloat16) for _ in range(micro)]
    gs = [torch.randn(2, 16, args.width, generator=generator).to(device, torch.bfloat16) for _ in range(micro)]
    record: dict[str, Any] = {"base": kind, "micro_batches": micro}
    reference = _eager(model, xs, gs, device, dtype, cache=True, region="micro")
    arms = {"eager cache off, region per micro-batch": dict(cache=False, region="micro"),
            "eager cache on, one region": dict(cache=True, region="all"),
            "eager cache off, one region": dict(cache=False, region="all")}
    for name, options in arms.items():
        result = _guarded(record, name, lambda: _eager(model, xs, gs, device, dtype, **options))
        if result is not None:
            record[name] = _compare(reference, result)
    if device.type == "cuda":
        for side in (False, True):
            name = f"captured cache off{', side-stream warm-up' if side else ''}"
            result = _guarded(record, name, lambda: _captured(model, xs, gs, device, dtype, side_warmup=side))
            if result is not None:
                record[name] = _compare(reference, result)
    else:
        record["captured"] = "skipped (CPU)"
    return record


def case_stale(device, dtype, args) -> dict[str, Any]:
    model, kind = lora_layer(device, args.width, args.rank, args.seed)
    x = torch.randn(2, 16, args.width).to(device, torch.bfloat16)
    lora_b = next(p for n, p in model.named_parameters() if "lora_B" in n)
    with _autocast(device, dtype):
        before = model(x).detach()
        with torch.no_grad():
            lora_b.add_(0.5)  # an optimizer step inside the region
        inside = model(x).detach()
    with _autocast(device, dtype):
        fresh = model(x).detach()
    return {"base": kind, "changed inside one region (False: the cast is stale)": not torch.equal(before, inside),
            "changed in a new region": not torch.equal(before, fresh), "equal": not torch.equal(before, fresh)}


# -- decoder blocks through poros ---------------------------------------------------------------
#: the arms of the blocks cases: (name, cuda_graphs, switches set to 1, schedule, under autocast)
BLOCK_ARMS = {
    "blocks": [("poros eager", False, (), "layer-major", True),
               ("poros graphs", "auto", ("POROS_CUDA_GRAPHS_AUTOCAST",), "layer-major", True)],
    "micro-major": [("micro-major graphs, no autocast", "auto", ("POROS_CUDA_GRAPHS_MICRO_MAJOR",), "micro-major",
                     False),
                    ("micro-major graphs, autocast", "auto",
                     ("POROS_CUDA_GRAPHS_MICRO_MAJOR", "POROS_CUDA_GRAPHS_AUTOCAST"), "micro-major", True)],
}
SWITCHES = ("POROS_CUDA_GRAPHS_AUTOCAST", "POROS_CUDA_GRAPHS_MICRO_MAJOR")


@contextlib.contextmanager
def _switched(names: tuple[str, ...]):
    previous = {name: os.environ.get(name) for name in SWITCHES}
    for name in SWITCHES:
        os.environ[name] = "1" if name in names else "0"
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _blocks_variant(variant, device, dtype, args, arms) -> dict[str, Any]:
    import poros
    from tools.bench.arms import free_memory
    from tools.bench.models import add_lora, build_model, make_batches
    from tools.bench.shapes import model_config

    config, _ = model_config(variant.tiny)
    model = build_model(config, device, seed=args.seed, attn_implementation="sdpa",
                        experts_implementation="grouped_mm" if variant.moe else None)
    peft_model = add_lora(model, rank=8, alpha=16, targets="all-linear",
                          target_parameters=list(variant.target_parameters) or None, gradient_checkpointing=False)
    batches = make_batches(config, count=4, batch=2, seq=72, seed=args.seed + 1, left_pad=9)
    steps = [batches[:2], batches[2:]]
    named = {n: p for n, p in peft_model.named_parameters() if p.requires_grad}
    initial = {n: p.detach().clone() for n, p in named.items()}

    def train(step_call) -> dict[str, Any]:
        with torch.no_grad():
            for n, p in named.items():
                p.copy_(initial[n])
        optimizer = torch.optim.AdamW(list(named.values()), lr=1e-3)
        losses, first_grads = [], None
        for index, group in enumerate(steps):
            group = [{k: v.to(device) for k, v in b.items()} for b in group]
            items = torch.tensor(sum(int((b["labels"][..., 1:] != -100).sum()) for b in group), device=device)
            losses += step_call([{**b, "num_items_in_batch": items} for b in group])
            if index == 0:
                first_grads = {f"grad:{n}": None if p.grad is None else p.grad.clone() for n, p in named.items()}
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        lora = {f"lora:{n}": p.detach().clone() for n, p in named.items()}
        return {"losses": losses, "grads": first_grads, "lora": lora}

    def mixed(on: bool):
        return _autocast(device, dtype) if on else contextlib.nullcontext()

    def micro_major(call, on: bool):
        def step(group):  # HF Trainer: autocast around each forward, backward outside
            losses = []
            for b in group:
                with mixed(on):
                    loss = call(**b, use_cache=False).loss
                loss.backward()
                losses.append(loss.detach())
            return losses
        return step

    record: dict[str, Any] = {}
    references = {on: train(micro_major(peft_model, on)) for on in {arm[4] for arm in arms}}
    for name, graphs, switches, schedule, on in arms:
        if graphs and device.type != "cuda":
            record[name] = "skipped (CPU)"
            continue
        handle = None
        with _switched(switches):
            try:
                handle = poros.prepare(peft_model, cuda_graphs=graphs)

                def layer_major(group, handle=handle, on=on):
                    with mixed(on):
                        return handle.forward_backward(group)

                call = layer_major if schedule == "layer-major" else micro_major(handle, on)
                result = _guarded(record, name, lambda: train(call))
                if result is not None:
                    reference = references[on]
                    graphs_used = handle.executor.graphs
                    record[name] = {
                        "losses_equal": all(torch.equal(a, b) for a, b in zip(reference["losses"], result["losses"])),
                        "losses": [float(x) for x in result["losses"]],
                        "step 1 grads": _compare(reference["grads"], result["grads"]),
                        "lora after the last step": _compare(reference["lora"], result["lora"]),
                        "cuda_graphs": graphs_used.report.to_dict() if graphs_used is not None else None}
                    record[name]["equal"] = (record[name]["losses_equal"] and record[name]["step 1 grads"]["equal"]
                                             and record[name]["lora after the last step"]["equal"])
            finally:
                if handle is not None:
                    handle.unpatch()
    record["reference_losses"] = {f"autocast {on}": [float(x) for x in r["losses"]] for on, r in references.items()}
    del peft_model, model
    free_memory(device)
    return record


def case_blocks(device, dtype, args, arms) -> dict[str, Any]:
    from tools.checks.parity_gate import VARIANTS

    chosen = [v for v in VARIANTS if args.only is None or v.name in args.only.split(",")]
    out = {}
    for variant in chosen:
        start = time.perf_counter()
        out[variant.name] = _guarded(out, variant.name, lambda: _blocks_variant(variant, device, dtype, args, arms)) \
            or out.get(variant.name)
        out[variant.name]["seconds"] = round(time.perf_counter() - start, 1)
    return out


def _compute_stream(device: torch.device, wanted: bool):
    """``--compute-stream``: everything from here on Poros's pool stream (non-blocking), after the legacy
    stream's work so far (the engine's own ``poros.stream.compute_stream.step_stream``)."""
    from poros.stream.compute_stream import step_stream

    return step_stream(device, wanted)


def _all_equal(value: Any) -> bool:
    """Whether every ``equal`` below ``value`` is True (an ``error`` counts as not equal)."""
    if isinstance(value, dict):
        if "error" in value:
            return False
        if "equal" in value and not value["equal"]:
            return False
        return all(_all_equal(v) for k, v in value.items() if k != "tensors")
    return True


def summary_lines(report: dict[str, Any]) -> list[str]:
    lines = []
    stale = report["cases"].get("stale")
    if stale:
        lines.append(f"{'stale':<14} {'one region outlives an in-place update':<46} "
                     f"cast {'fresh' if stale['changed inside one region (False: the cast is stale)'] else 'STALE'} "
                     f"inside, {'fresh' if stale['changed in a new region'] else 'STALE'} in a new region")
    for case, body in report["cases"].items():
        for name, value in (body.items() if isinstance(body, dict) else []):
            if isinstance(value, dict) and ("equal" in value or "error" in value):
                state = "ERROR " + value["error"][:120] if "error" in value else \
                    ("equal" if value["equal"] else f"DIFFERS first {value.get('first_differing')}")
                lines.append(f"{case:<14} {name:<46} {state}")
            elif isinstance(value, dict):
                for arm, result in value.items():
                    if isinstance(result, dict) and ("equal" in result or "error" in result):
                        state = "ERROR " + result["error"][:120] if "error" in result else (
                            "equal" if result["equal"] else
                            f"DIFFERS step-1 grads first {result['step 1 grads']['first_differing']} "
                            f"max {max((d['max_abs'] or 0) for d in result['step 1 grads']['tensors'].values()):.3g}")
                        graphs = result.get("cuda_graphs") if isinstance(result, dict) else None
                        extra = f" | graphs {graphs['captured']} captured {graphs['replays']} replays, eager " \
                                f"{graphs['eager']}, failures {graphs['failures'][:1]}" if graphs else ""
                        lines.append(f"{case:<14} {name + ': ' + arm:<46} {state}{extra}")
    return lines


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--cases", default="layer,accumulate,stale,blocks,micro-major")
    parser.add_argument("--only", help="parity-gate variants for the blocks case (default: all)")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-deterministic", dest="deterministic", action="store_false")
    parser.add_argument("--threads", type=int)
    parser.add_argument("--commit")
    parser.add_argument("--compute-stream", action="store_true",
                        help="run the blocks cases on a side stream of torch's pool instead of the legacy default "
                             "stream (a capture failed with 'operation would make the legacy stream depend on a "
                             "capturing blocking stream': does any of it still queue work there?)")
    parser.add_argument("--trace", action="store_true",
                        help="tools.capture_trace: stream/event calls during captures, sync debug 'error' in them, "
                             "each failed capture's traceback (in the JSON's capture_trace)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads is None and args.device == "cpu":
        args.threads = 1
    device, env = start_tool(args)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    print(f"autocast graph probe on {environment_line(env)}")
    cases = args.cases.split(",")
    report: dict[str, Any] = {"tool": "tools/autocast_graph_probe.py", "environment": env,
                              "config": {k: str(v) for k, v in vars(args).items()}, "cases": {}}
    if "layer" in cases:
        report["cases"]["layer"] = case_layer(device, dtype, args, micro=1)
    if "accumulate" in cases:
        report["cases"]["accumulate"] = {f"{m} micro-batches": case_layer(device, dtype, args, micro=m) for m in (2, 4)}
    if "stale" in cases:
        report["cases"]["stale"] = case_stale(device, dtype, args)
    with (tracing() if args.trace else contextlib.nullcontext()) as log, _compute_stream(device, args.compute_stream):
        for case in ("blocks", "micro-major"):
            if case in cases:
                report["cases"][case] = case_blocks(device, dtype, args, BLOCK_ARMS[case])
    if log is not None:
        report["capture_trace"] = log.to_dict()
        for failure in log.failures[:3]:
            print(f"capture failure (block {failure['block']}):", " <- ".join(failure["chain"]))
            print(failure["traceback"][-1500:])
        print(f"calls during captures: {len(log.calls)}", sorted({c['call'] for c in log.calls}))
    report["verdict"] = {case: _all_equal(body) for case, body in report["cases"].items()}
    # per graphed arm: did the graphs hold (replays, no failed capture)? A failed capture runs eagerly,
    # so it is equal, and only shows here
    report["graphs_held"] = {
        f"{case}/{variant}/{arm}": {"replays": r["cuda_graphs"]["replays"],
                                    "failures": len(r["cuda_graphs"]["failures"]), "eager": r["cuda_graphs"]["eager"]}
        for case in ("blocks", "micro-major") for variant, arms in report["cases"].get(case, {}).items()
        if isinstance(arms, dict) for arm, r in arms.items() if isinstance(r, dict) and r.get("cuda_graphs")}
    for line in summary_lines(report):
        print(line)
    for arm, held in report["graphs_held"].items():
        print(f"graphs {arm}: {held['replays']} replays, {held['failures']} failed captures, eager {held['eager']}")
    print("verdict:", json.dumps(report["verdict"]))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1, default=str) + "\n")
        print(f"wrote {args.json}")
    return 0 if all(report["verdict"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
