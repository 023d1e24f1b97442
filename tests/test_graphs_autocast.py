"""CUDA graphs under autocast (issue 30), the part a CPU can check.

A capture runs with the cast cache off (``replay.uncached``). What the H200 gate saw (loss equal, every
LoRA tensor off by ~1.7e-3 after the second step, in every family, even qwen3_5 whose blocks all ran
eagerly) was not a kernel: the gate entered ONE autocast region around both arms and every step, and
torch keeps the first cast of each fp32 LoRA weight for a whole region, through optimizer steps. Its
resident reference (and Poros's eager blocks, sharing the cache) computed steps 2+ with step 1's casts;
a capture, uncached, with the current weights. HF Trainer enters autocast per forward: there the casts
are fresh and cached == uncached, bit for bit.

So: (1) a forward+backward under bf16 autocast gives the same bits with the cache on and off; (2) the
graphed path (a recorder that reruns the captured body on its static buffers at each replay,
``test_gemma4_graphs.ReplayedOnCPU``) trains bitwise the resident model the way HF Trainer runs it
(autocast per forward, backward outside), every family; (3) in a region around several steps the
blocks run eagerly from the second ``forward_backward`` on (``autocast cache across steps``) and match
the resident run in that region — without that check they do not (the gate's failure, on CPU).
Capture and replay on a GPU are the H200 probe's (tools/autocast_graph_probe.py).
"""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

import poros
from conftest import BUILTIN_FAMILIES
from poros.stream import graphs as graphs_module
from poros.stream.graphs import AUTOCAST_SWITCH, MICRO_MAJOR_SWITCH, BlockGraphs
from poros.stream.replay import CastCacheWatch, autocast_state, uncached
from poros.testing import TINY_VARIANTS, load_qlora, save_tiny_checkpoint
from test_gemma4_graphs import ReplayedOnCPU
from test_layer_major import with_item_counts
from test_parity import MIN_LAYERS, assert_bitwise, make_batch, trainable

CASES = [(family, variant) for family, variants in TINY_VARIANTS.items() for variant in variants]
LORA = {"lora_rank": 4, "lora_alpha": 8, "seed": 3}


def bf16(cache: bool = True):
    return torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache)


def plan(steps: int = 2, micro: int = 2) -> list[list[dict]]:
    return [with_item_counts([make_batch(40 + 10 * s + m, 2, 12, "left") for m in range(micro)])
            for s in range(steps)]


def resident_trainer_steps(model, steps, region=contextlib.nullcontext):
    """HF Trainer under bf16=True: autocast around each micro-batch's forward, backward outside it.
    ``region``: a context around the whole run (the gate's old single autocast region)."""
    parameters = list(trainable(model).values())
    optimizer = torch.optim.AdamW(parameters, lr=1e-2)
    losses = []
    with region():
        for micro_batches in steps:
            for mb in micro_batches:
                with bf16():
                    loss = model(**mb, use_cache=False).loss
                loss.backward()
                losses.append(loss.detach())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return losses, optimizer


def graphed_steps(streamed, steps, region=contextlib.nullcontext):
    """Layer-major steps, each ``forward_backward`` under its own bf16 autocast (cache on, eager's default)."""
    optimizer = torch.optim.AdamW(streamed.trainable_parameters(), lr=1e-2)
    losses = []
    with region():
        for micro_batches in steps:
            with bf16():
                losses.extend(streamed.forward_backward(micro_batches))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return losses, optimizer


def checkpoint(tmp_path, family, variant="default"):
    layers = max(2, MIN_LAYERS.get((family, variant), 1))
    return save_tiny_checkpoint(tmp_path / f"{family}-{variant}", family, variant, seed=3, num_layers=layers)


def graphed(path, monkeypatch, switch: bool = True):
    if switch:  # on by default; "1" says so too
        monkeypatch.setenv(AUTOCAST_SWITCH, "1")
    else:
        monkeypatch.setenv(AUTOCAST_SWITCH, "0")
    model = load_qlora(path, **LORA)
    streamed = poros.prepare(model)
    streamed.executor.graphs = ReplayedOnCPU(streamed.store, streamed.executor.layers)
    return model, streamed


@pytest.mark.parametrize("family", BUILTIN_FAMILIES)
def test_the_cast_cache_does_not_change_a_bit(tmp_path, family):
    """One forward+backward under bf16 autocast: loss and every LoRA gradient are torch.equal with the
    cast cache off (what a capture runs) and on (eager's default)."""
    model = load_qlora(save_tiny_checkpoint(tmp_path / family, family), **LORA)
    assert any(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)  # the casts exist
    batch = make_batch(0, 2, 8, "left")
    results = []
    for cache in (True, False):
        model.zero_grad(set_to_none=True)
        with bf16(cache):
            loss = model(**batch, use_cache=False).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in trainable(model).items() if p.grad is not None}))
    (loss_on, grads_on), (loss_off, grads_off) = results
    assert torch.equal(loss_on, loss_off)
    assert grads_on.keys() == grads_off.keys() and grads_on
    for name, grad in grads_on.items():
        assert torch.equal(grad, grads_off[name]), name


@pytest.mark.parametrize(("family", "variant"), CASES, ids=[f"{f}-{v}" for f, v in CASES])
def test_replayed_blocks_under_autocast_train_bitwise_the_resident_trainer(tmp_path, monkeypatch, family, variant):
    """The graphed layer-major path under bf16 autocast (the capture's uncached casts, static LoRA buffers,
    gradients from autograd.grad accumulated by the executor) == HF Trainer's resident bf16 run: every
    loss, LoRA tensor and AdamW state tensor over 2 steps of 2 micro-batches."""
    path = checkpoint(tmp_path, family, variant)
    steps = plan()
    reference = load_qlora(path, **LORA)
    ref_losses, ref_opt = resident_trainer_steps(reference, steps)
    model, streamed = graphed(path, monkeypatch)
    losses, opt = graphed_steps(streamed, steps)
    assert_bitwise(reference, model, ref_losses, losses, ref_opt, opt)
    report = streamed.executor.graphs.report
    assert "autocast cache" not in report.eager and "autocast cache across steps" not in report.eager
    # MoE routing (graph_unsafe) and Qwen3.5's expanded position_ids ("argument layout") keep their blocks
    # eager on any device, for reasons of their own
    if not streamed.executor.graphs.unsafe and "argument layout" not in report.eager:
        assert report.replays > 0 and report.captured > 0, report.summary()


def test_a_region_around_several_steps_runs_eagerly_and_matches_a_resident_run_in_it(tmp_path, monkeypatch):
    """The gate's old setup: one autocast region around the whole run. The resident run computes step 2
    with step 1's cached casts; Poros's blocks run eagerly from the second forward_backward (their casts
    come from the same cache) and match it bitwise. Negative control: with the check off (the capture
    of commit 1b465ba) the replayed blocks use the current weights and the LoRA tensors differ — the
    H200 gate's failure."""
    path = checkpoint(tmp_path, "qwen3")
    steps = plan(steps=3)
    reference = load_qlora(path, **LORA)
    ref_losses, ref_opt = resident_trainer_steps(reference, steps, region=bf16)
    fresh = load_qlora(path, **LORA)
    resident_trainer_steps(fresh, steps)
    assert any(not torch.equal(a, b) for a, b in zip(trainable(reference).values(), trainable(fresh).values()))

    model, streamed = graphed(path, monkeypatch)
    losses, opt = graphed_steps(streamed, steps, region=bf16)
    assert_bitwise(reference, model, ref_losses, losses, ref_opt, opt)
    report = streamed.executor.graphs.report
    assert report.replays > 0  # the first step replayed
    assert report.eager["autocast cache across steps"] == 2 * 2 * 2 * len(streamed.executor.layers)

    monkeypatch.setattr(CastCacheWatch, "persisted", lambda self: False)
    model, streamed = graphed(path, monkeypatch)
    graphed_steps(streamed, steps, region=bf16)
    differing = [n for n, p in trainable(reference).items() if not torch.equal(p, trainable(model)[n])]
    assert differing


def test_with_the_switch_off_autocast_with_its_cache_on_runs_eagerly(tmp_path, monkeypatch):
    path = checkpoint(tmp_path, "qwen3")
    steps = plan(steps=1)
    reference = load_qlora(path, **LORA)
    ref_losses, ref_opt = resident_trainer_steps(reference, steps)
    model, streamed = graphed(path, monkeypatch, switch=False)
    assert not streamed.executor.graphs.autocast_capture
    losses, opt = graphed_steps(streamed, steps)
    assert_bitwise(reference, model, ref_losses, losses, ref_opt, opt)
    report = streamed.executor.graphs.report
    assert report.replays == 0 and report.eager["autocast cache"] == 2 * 2 * len(streamed.executor.layers)
    block_graphs = BlockGraphs(streamed.store, streamed.executor.layers)
    hidden = torch.zeros(1, 4, streamed.config.get_text_config().hidden_size)
    with bf16(cache=False):  # the cache off: nothing cached, nothing stale, captured as before
        assert block_graphs.eager_reason(0, [hidden]) is None
    assert graphs_module.AUTOCAST_SWITCH == "POROS_CUDA_GRAPHS_AUTOCAST"


def test_the_watch_sees_a_region_that_outlived_the_previous_call():
    watch = CastCacheWatch(torch.device("cpu"))
    assert watch.persisted() is False  # no autocast
    with bf16():
        assert watch.persisted() is False  # the first call of a region
        assert watch.persisted() is True and watch.persisted() is True
        with bf16():  # a nested region shares the outer one's cache
            assert watch.persisted() is True
    with bf16():
        assert watch.persisted() is False  # a new region: the cache was cleared when the last one exited
    with bf16(cache=False):
        assert watch.persisted() is False and watch.persisted() is False
    with torch.autocast("cpu", dtype=torch.float16):
        assert watch.persisted() is False and watch.persisted() is True


def test_the_capture_state_is_the_callers_with_the_cache_off():
    with bf16():
        state = autocast_state(torch.device("cpu"))
    captured = uncached(state)
    assert [kind for kind, _ in captured] == [kind for kind, _ in state]
    for (_, before), (_, after) in zip(state, captured):
        assert before["cache_enabled"] is True and after["cache_enabled"] is False
        assert {k: v for k, v in before.items() if k != "cache_enabled"} == \
            {k: v for k, v in after.items() if k != "cache_enabled"}
    assert uncached(None) is None


def test_the_gate_enters_autocast_per_forward_and_is_bitwise_for_qwen3_5(tmp_path):
    """The H200 gate's configuration on CPU (bf16 autocast, layer-major, 2 micro-batches, 4 batches):
    Qwen3.5, whose Gated DeltaNet backward changes bits under autocast, is bitwise now that the gate
    enters autocast per forward (HF Trainer's way) and layer-major runs every backward outside it."""
    from tools.checks import parity_gate

    out = tmp_path / "gate.json"
    assert parity_gate.main(["--device", "cpu", "--tiny", "--only", "qwen3_5", "--autocast", "bf16", "--no-diagnose",
                             "--grad-accum", "2", "--schedule", "layer-major", "--steps", "4",
                             "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["config"]["autocast_region"] == "forward"
    (variant,) = report["variants"]
    assert variant["comparison"]["bitwise"] and variant["autocast_region"] == "forward"


def test_the_probe_runs_on_cpu_with_its_captures_skipped(tmp_path):
    """tools/autocast_graph_probe.py (the H200's ``autocast-probe`` step): the eager cases compare equal on
    CPU, the captured ones say they were skipped, the stale-cache case shows a region's cast outliving an
    in-place update (the gate's old reference) and a new region seeing it."""
    from tools import autocast_graph_probe

    out = tmp_path / "probe.json"
    assert autocast_graph_probe.main(["--device", "cpu", "--cases", "layer,accumulate,stale", "--width", "64",
                                      "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["verdict"] == {"layer": True, "accumulate": True, "stale": True}
    layer = report["cases"]["layer"]
    assert layer["captured"] == "skipped (CPU)" and layer["base"] == "bnb.nn.Linear4bit"
    assert layer["eager cache off, region per micro-batch"]["equal"]
    assert layer["eager cache off, region per micro-batch"]["of"] == 4  # output, input grad, lora_A, lora_B
    assert set(report["cases"]["accumulate"]) == {"2 micro-batches", "4 micro-batches"}
    stale = report["cases"]["stale"]
    assert stale["changed inside one region (False: the cast is stale)"] is False and stale["changed in a new region"]


@pytest.mark.parametrize("autocast", [False, True])
def test_micro_major_phases_replay_bitwise_with_their_switch(tmp_path, monkeypatch, autocast):
    """Micro-major (HF Trainer's ``loss.backward()`` per micro-batch): with ``POROS_CUDA_GRAPHS_MICRO_MAJOR=1``
    its forward and its recompute+backward (inside the autograd engine, gradients handed back to the
    engine in use order) replay, and train bitwise the resident model; whether a capture holds inside
    the engine on a GPU is the probe's question (tools/autocast_graph_probe.py ``micro-major``)."""
    path = checkpoint(tmp_path, "qwen3")
    steps = plan()
    mixed = bf16 if autocast else contextlib.nullcontext
    runs = []
    for streamed_run in (False, True):
        model = load_qlora(path, **LORA)
        streamed = None
        if streamed_run:
            monkeypatch.setenv(MICRO_MAJOR_SWITCH, "1")
            monkeypatch.setenv(AUTOCAST_SWITCH, "1")
            streamed = poros.prepare(model)
            streamed.executor.graphs = ReplayedOnCPU(streamed.store, streamed.executor.layers)
        optimizer = torch.optim.AdamW(list(trainable(model).values()), lr=1e-2)
        losses = []
        for micro_batches in steps:
            for mb in micro_batches:
                with mixed():
                    loss = model(**mb, use_cache=False).loss
                loss.backward()
                losses.append(loss.detach())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        runs.append((model, losses, optimizer, streamed))
    (reference, ref_losses, ref_opt, _), (model, losses, opt, streamed) = runs
    assert_bitwise(reference, model, ref_losses, losses, ref_opt, opt)
    report = streamed.executor.graphs.report
    assert "micro-major" not in report.eager and report.replays > 0, report.summary()
