"""Why a CUDA-graph capture of a block's backward fails on the H200 (issue 30), ingredient by ingredient.

::

    python -m tools.capture_probe --device cuda --json out/capture-probe.json     # on the H200
    tools/gpu_run.sh capture-probe capture-probe:cublas-config                      # the same, as steps
    python -m tools.capture_probe --device cpu                                      # dry run: no captures

Seen there: ``CUDA error: operation failed due to a previous error during capture``
(``cudaErrorStreamCaptureInvalidated``) whenever the recompute runs under bf16 autocast, or the capture
happens inside an outer ``loss.backward()`` (micro-major: the autograd engine's device thread), while
a layer-major backward without autocast captures. ``poros/stream/graphs.py`` (``BlockGraphs._record`` /
``_capture_backward``) captures a recompute + ``torch.autograd.grad`` with
``torch.cuda.graph(..., capture_error_mode="thread_local")`` on a side stream, after an eager warm-up
on that stream when autocast is on. Each case here does the same, from the smallest pieces upward:

* pieces (``--pieces``): ``linear`` (a bf16 ``nn.Linear`` + fp32 LoRA-like A/B parameters), ``nf4``
  (the same on a bitsandbytes ``Linear4bit``), ``peft-nf4`` (a PEFT LoRA on a ``Linear4bit``),
  ``qwen2`` (a real transformers Qwen2 decoder layer, width 256, NF4, PEFT LoRA on every linear);
* autocast: ``off`` / ``recompute`` (the forward under ``torch.autocast(bf16, cache_enabled=False)``,
  ``autograd.grad`` outside it, as graphs.py) / ``both`` (``autograd.grad`` inside it too);
* where: ``direct`` (the main thread), ``function`` (inside a custom ``autograd.Function``'s backward,
  called from an outer ``loss.backward()``: the micro-major situation), ``thread`` (a plain Python thread);
* then, for every case that failed, variants: ``capture_error_mode`` global / thread_local / relaxed;
  the warm-up on a new capture stream, or none (torch.cuda.graph's own stream, as graphs.py captures
  without autocast); deterministic algorithms flipped;
  ``torch.cuda.set_sync_debug_mode`` "warn" (the synchronising calls, as warnings) and "error" (the
  first one raises: its traceback, in the JSON, names the line) around the capture.

``CUBLAS_WORKSPACE_CONFIG`` is read once per process: ``--cublas-config`` sets it (``:4096:8``) before
CUDA starts (run the probe once without, once with). ``torch.backends.cuda.matmul`` stays as it is (its
settings are recorded). A capture that holds is replayed once and compared with the eager run by
``torch.equal`` (``equal``). Each case prints one line: name, ok / failed, the phase it failed in
(``reference``: the eager run before any capture, e.g. deterministic algorithms without
``CUBLAS_WORKSPACE_CONFIG``; ``warm-up``, ``capture``, ``replay``), the error's first line, and the first
line of the error it was raised during, if any.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

AUTOCAST = ("off", "recompute", "both")
WHERE = ("direct", "function", "thread")
PIECES = ("linear", "nf4", "peft-nf4", "qwen2")
MODES = ("global", "thread_local", "relaxed")


# -- the pieces ---------------------------------------------------------------------------------------
class Piece:
    """A module's forward ``call(x)`` with the parameters autograd.grad asks for (the LoRA ones)."""

    def __init__(self, name: str, call: Callable[[torch.Tensor], torch.Tensor], params: list[torch.Tensor],
                 shape: tuple[int, ...], kind: str):
        self.name, self.call, self.params, self.shape, self.kind = name, call, params, shape, kind


def _nf4_linear(width: int, device: torch.device):
    import bitsandbytes as bnb

    linear = bnb.nn.Linear4bit(width, width, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4")
    weight = torch.randn(width, width, dtype=torch.bfloat16) * 0.02
    linear.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4")
    return linear.to(device)


def _lora_like(base: torch.nn.Module, width: int, rank: int, device: torch.device, name: str, kind: str) -> Piece:
    """``base(x) + B(A(x)) * 2`` with fp32 A/B, x cast to fp32 for the LoRA path as PEFT does."""
    a = (torch.randn(rank, width) * 0.02).to(device).requires_grad_(True)
    b = (torch.randn(width, rank) * 0.02).to(device).requires_grad_(True)

    def call(x):
        lora = torch.nn.functional.linear(torch.nn.functional.linear(x.to(a.dtype), a), b) * 2.0
        y = base(x)
        return y + lora.to(y.dtype)
    return Piece(name, call, [a, b], (2, 16, width), kind)


def _peft_nf4(width: int, rank: int, device: torch.device) -> Piece:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(torch.nn.Sequential(_nf4_linear(width, device)),
                           LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["0"], lora_dropout=0.0))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    params = [p for p in model.parameters() if p.requires_grad]
    return Piece("peft-nf4", model, params, (2, 16, width), "PEFT LoRA on bnb.nn.Linear4bit")


def _qwen2(width: int, rank: int, device: torch.device, seed: int) -> Piece:
    from tools.bench.models import add_lora, build_model
    from tools.bench.shapes import model_config

    config, _ = model_config("tiny", layers=1, hidden_size=width, intermediate_size=2 * width)
    peft_model = add_lora(build_model(config, device, seed=seed, attn_implementation="sdpa"), rank=rank,
                          alpha=2 * rank, targets="all-linear", gradient_checkpointing=False)
    inner = peft_model.get_base_model().model
    layer, rotary = inner.layers[0], inner.rotary_emb
    seq = 16
    positions = torch.arange(seq, device=device)[None]
    with torch.no_grad():
        cos_sin = rotary(torch.zeros(1, seq, width, device=device, dtype=torch.bfloat16), positions)

    def call(x):
        out = layer(x, attention_mask=None, position_ids=positions, position_embeddings=cos_sin)
        return out[0] if isinstance(out, tuple) else out
    params = [p for p in layer.parameters() if p.requires_grad]
    return Piece("qwen2", call, params, (1, seq, width), f"{type(layer).__name__} NF4 + PEFT LoRA (all linear)")


def build_piece(name: str, device: torch.device, width: int, rank: int, seed: int) -> Piece:
    torch.manual_seed(seed)
    if name == "linear":
        base = torch.nn.Linear(width, width, bias=False).to(device, torch.bfloat16).requires_grad_(False)
        return _lora_like(base, width, rank, device, name, "nn.Linear bf16 + fp32 A/B")
    if name == "nf4":
        return _lora_like(_nf4_linear(width, device), width, rank, device, name, "bnb.nn.Linear4bit + fp32 A/B")
    if name == "peft-nf4":
        return _peft_nf4(width, rank, device)
    if name == "qwen2":
        return _qwen2(width, rank, device, seed)
    raise KeyError(f"unknown piece {name!r}; known: {', '.join(PIECES)}")


# -- one capture ----------------------------------------------------------------------------------------
def _region(on: bool, device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=False) if on else \
        contextlib.nullcontext()


def make_body(piece: Piece, device: torch.device, autocast: str):
    """graphs.py's backward body on static buffers: ``(body, statics)``; ``body()`` returns
    ``[output, input grad, *parameter grads]``."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(*piece.shape, generator=generator).to(device, torch.bfloat16).requires_grad_(True)
    g = torch.randn(*piece.shape, generator=generator).to(device, torch.bfloat16)

    def body() -> list[torch.Tensor]:
        with torch.enable_grad():
            with _region(autocast != "off", device):
                y = piece.call(x)
            with _region(True, device) if autocast == "both" else _outside(device):
                grads = torch.autograd.grad([y], [x, *piece.params], [g.to(y.dtype)], allow_unused=True)
        return [y.detach(), *grads]
    return body


@contextlib.contextmanager
def _outside(device: torch.device):
    """Autocast off for the backward, as graphs.py's ``outside_autocast``."""
    with torch.autocast(device.type, enabled=False):
        yield


def _abandon(pool, device: torch.device) -> None:
    """What graphs.py's ``_abandon_pool`` does after a failed capture: end the pool's allocation routing."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    for name in ("_cuda_endAllocateToPool", "_cuda_endAllocateCurrentStreamToPool"):
        end = getattr(torch._C, name, None)
        if end is not None:
            with contextlib.suppress(Exception):
                end(index, pool)
            break


def _warning_lines(caught) -> list[str]:
    return [f"{w.category.__name__}: {str(w.message).splitlines()[0][:200]}" for w in caught][:8]


def capture(body: Callable[[], list], device: torch.device, *, mode: str, warmup: bool, sync_debug: str | None,
            dry: bool) -> dict[str, Any]:
    """:func:`_capture` with the phase it failed in (reference, warm-up, capture, replay) on the error."""
    phase = ["reference"]
    try:
        return _capture(body, device, mode=mode, warmup=warmup, sync_debug=sync_debug, dry=dry, phase=phase)
    except Exception as exc:
        exc.probe_phase = phase[0]  # type: ignore[attr-defined]
        raise


def _capture(body: Callable[[], list], device: torch.device, *, mode: str, warmup: bool, sync_debug: str | None,
             dry: bool, phase: list[str]) -> dict[str, Any]:
    """Eager run (the reference), optional warm-up on the side stream, capture, one replay, compare.
    ``sync_debug``: ``torch.cuda.set_sync_debug_mode`` during the capture ("warn": the synchronising calls
    come back as warnings; "error": the first one raises, its traceback names the Python line), or None."""
    reference = [None if t is None else t.clone() for t in body()]
    if dry:
        return {"status": "ok", "captured": False, "note": "dry run: capture skipped"}
    stream = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device) if warmup else None  # None: torch.cuda.graph's own capture stream
    phase[0] = "warm-up"
    if warmup:
        side.wait_stream(stream)
        with torch.cuda.stream(side):
            body()
        stream.wait_stream(side)
    torch.cuda.synchronize(device)
    graph, pool = torch.cuda.CUDAGraph(), torch.cuda.graph_pool_handle()
    generator = torch.cuda.default_generators[device.index or 0]
    backup = generator.clone_state()
    previous = torch.cuda.get_sync_debug_mode()
    phase[0] = "capture"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            try:
                if sync_debug:
                    torch.cuda.set_sync_debug_mode(sync_debug)
                with torch.cuda.graph(graph, pool=pool, stream=side, capture_error_mode=mode):
                    outputs = body()
            finally:
                torch.cuda.set_sync_debug_mode(previous)
        except Exception as exc:  # as graphs.py: the generator, the compute stream, the pool back
            exc.probe_warnings = _warning_lines(caught)  # type: ignore[attr-defined]
            generator.graphsafe_set_state(backup)
            torch.cuda.set_stream(stream)
            torch.cuda.synchronize(device)
            _abandon(pool, device)
            raise
    seen = _warning_lines(caught)
    phase[0] = "replay"
    graph.replay()
    torch.cuda.synchronize(device)
    equal = all((a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
                for a, b in zip(reference, outputs))
    return {"status": "ok", "captured": True, "equal": bool(equal), "warnings": seen}


# -- where the capture runs -----------------------------------------------------------------------------
def run_where(where: str, work: Callable[[], dict], device: torch.device) -> dict[str, Any]:
    """``work()`` on the main thread, inside an autograd.Function's backward (outer loss.backward()),
    or on a fresh Python thread; what the thread was is recorded."""
    box: dict[str, Any] = {}

    def task():
        box["thread"] = threading.current_thread().name
        box["grad_enabled"] = torch.is_grad_enabled()
        box["stream"] = str(torch.cuda.current_stream(device)) if device.type == "cuda" else None
        try:
            box["result"] = work()
        except Exception as exc:  # noqa: BLE001 - carried back to the caller's thread
            box["error"] = exc
    if where == "direct":
        task()
    elif where == "thread":
        worker = threading.Thread(target=task, name="probe-thread")
        worker.start()
        worker.join()
    elif where == "function":
        class Inside(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x * 2

            @staticmethod
            def backward(ctx, grad):
                task()
                return grad * 2
        leaf = torch.ones(4, device=device, requires_grad=True)
        Inside.apply(leaf).sum().backward()
    else:
        raise KeyError(f"unknown place {where!r}; known: {', '.join(WHERE)}")
    if "error" in box:
        raise box["error"]
    return {**box["result"], "thread": box["thread"], "grad_enabled_there": box["grad_enabled"],
            "stream_there": box["stream"]}


@contextlib.contextmanager
def deterministic(on: bool):
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(on)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)


def first_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


def error_chain(exc: BaseException) -> list[str]:
    """The first line of ``exc`` and of each exception it was raised during (``__context__``/``__cause__``),
    outermost first: a call CUDA refuses inside the capture raises, then ``torch.cuda.graph``'s exit ends the
    invalidated capture and raises "operation failed due to a previous error during capture" on top of it."""
    chain, seen = [], set()
    while exc is not None and id(exc) not in seen and len(chain) < 6:
        seen.add(id(exc))
        chain.append(first_line(exc))
        exc = exc.__cause__ or exc.__context__
    return chain


def run_case(name: str, piece: Piece, device: torch.device, settings: dict[str, Any], dry: bool) -> dict[str, Any]:
    """One case in its own try/except; prints one line and returns its record."""
    record: dict[str, Any] = {"case": name, "piece": piece.name, **settings}
    try:
        body = make_body(piece, device, settings["autocast"])
        with deterministic(settings["deterministic"]):
            record.update(run_where(settings["where"], lambda: capture(
                body, device, mode=settings["mode"], warmup=settings["warmup"], sync_debug=settings["sync_debug"],
                dry=dry), device))
    except Exception as exc:  # noqa: BLE001 - a probe reports what failed and goes on
        chain = error_chain(exc)
        record.update(status="failed", phase=getattr(exc, "probe_phase", "setup"), error=chain[0],
                      root_error=chain[-1], error_chain=chain,
                      traceback=traceback.format_exc()[-4000:], warnings=getattr(exc, "probe_warnings", []))
    state = record["status"] if record["status"] == "failed" else (
        "ok" + ("" if not record.get("captured") else f" equal={record.get('equal')}"))
    root = record.get("root_error")
    shown = f"[{record['phase']}] {record['error']}" if "phase" in record else "" + (f" <- raised during: {root}" if root and root != record["error"] else "")
    print(f"{name:<72} {state:<16} {shown}", flush=True)
    return record


def case_name(piece: str, settings: dict[str, Any]) -> str:
    return (f"{piece}/autocast={settings['autocast']}/where={settings['where']}/mode={settings['mode']}"
            f"/warmup={'side' if settings['warmup'] else 'none'}/det={int(settings['deterministic'])}"
            f"{'/sync-debug=' + settings['sync_debug'] if settings['sync_debug'] else ''}")


def variants(settings: dict[str, Any]) -> list[dict[str, Any]]:
    """The variants of a failing case: every other capture_error_mode, the warm-up flipped, deterministic
    algorithms flipped, and the sync debug mode "warn" and "error"."""
    out = [{**settings, "mode": mode} for mode in MODES if mode != settings["mode"]]
    out.append({**settings, "warmup": not settings["warmup"]})
    out.append({**settings, "deterministic": not settings["deterministic"]})
    out += [{**settings, "sync_debug": level} for level in ("warn", "error")]
    return out


def run_piece(name: str, device: torch.device, args, dry: bool) -> list[dict[str, Any]]:
    """Every base case of one piece, then the variants of each that failed."""
    try:
        piece = build_piece(name, device, args.width, args.rank, args.seed)
    except Exception as exc:  # noqa: BLE001 - the other pieces still run
        print(f"{name:<72} {'failed':<16} building: {first_line(exc)}", flush=True)
        return [{"case": name, "piece": name, "status": "failed", "error": "building: " + first_line(exc),
                 "traceback": traceback.format_exc()[-3000:]}]
    records = []
    base = {"mode": "thread_local", "deterministic": args.deterministic, "sync_debug": None}
    for autocast in AUTOCAST:
        for where in WHERE:
            # graphs.py: a warm-up on a new side stream only under autocast
            settings = {**base, "autocast": autocast, "where": where, "warmup": autocast != "off"}
            record = run_case(case_name(name, settings), piece, device, settings, dry)
            record["kind"] = piece.kind
            records.append(record)
            if record["status"] == "failed" or (dry and args.dry_variants):
                for variant in variants(settings):
                    extra = run_case(case_name(name, variant) + " (variant)", piece, device, variant, dry)
                    extra["variant_of"] = record["case"]
                    records.append(extra)
    del piece
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return records


# -- the report ----------------------------------------------------------------------------------------
def matmul_settings() -> dict[str, Any]:
    matmul = torch.backends.cuda.matmul
    out = {}
    for key in ("allow_tf32", "allow_bf16_reduced_precision_reduction", "allow_fp16_reduced_precision_reduction",
                "fp32_precision"):
        with contextlib.suppress(Exception):
            out[key] = str(getattr(matmul, key))
    return out


def summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts, and per ingredient (piece / autocast / where) how many of its base cases failed."""
    base = [r for r in records if "variant_of" not in r]
    out: dict[str, Any] = {"cases": len(records), "failed": sum(r["status"] == "failed" for r in records),
                           "not_equal": sum(r.get("equal") is False for r in records)}
    for key in ("piece", "autocast", "where"):
        groups: dict[str, list[int]] = {}
        for r in base:
            if key in r:
                groups.setdefault(str(r[key]), [0, 0])
                groups[str(r[key])][0] += r["status"] == "failed"
                groups[str(r[key])][1] += 1
        out[f"failed_by_{key}"] = {k: f"{f}/{n}" for k, (f, n) in groups.items()}
    roots: dict[str, int] = {}
    for r in records:
        if r.get("root_error"):
            roots[r["root_error"]] = roots.get(r["root_error"], 0) + 1
    out["root_errors"] = roots  # the innermost error of each failure, and how many cases ended in it
    rescued = [r["case"] for r in records if "variant_of" in r and r["status"] == "ok"]
    out["variants_that_captured"] = rescued
    return out


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--pieces", default=",".join(PIECES), help="comma list of: " + ", ".join(PIECES))
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--deterministic", action="store_true",
                        help="deterministic algorithms on in the base cases (the variants flip it)")
    parser.add_argument("--cublas-config", action="store_true",
                        help="CUBLAS_WORKSPACE_CONFIG=:4096:8 before CUDA starts (cuBLAS reads it once)")
    parser.add_argument("--dry-variants", action="store_true", help="CPU dry run: the variants of every case too")
    parser.add_argument("--threads", type=int)
    parser.add_argument("--commit")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.cublas_config:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    from tools.bench.provenance import configure_threads, environment, environment_line, resolve_device

    configure_threads(args.threads if args.threads is not None else (1 if args.device == "cpu" else None))
    device = resolve_device(args.device, with_index=True)
    env = environment(device, args.commit)
    dry = device.type != "cuda"
    print(f"capture probe on {environment_line(env)}{' (dry run: no captures)' if dry else ''}")
    records: list[dict[str, Any]] = []
    for name in args.pieces.split(","):
        records += run_piece(name, device, args, dry)
    report = {"tool": "tools/capture_probe.py", "environment": env,
              "config": {**{k: str(v) for k, v in vars(args).items()}, "dry_run": dry,
                         "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
                         "matmul": matmul_settings()},
              "summary": summary(records), "cases": records}
    print("summary:", json.dumps({k: v for k, v in report["summary"].items() if k != "variants_that_captured"}))
    for case in report["summary"]["variants_that_captured"]:
        print("variant captured:", case)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1, default=str) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
