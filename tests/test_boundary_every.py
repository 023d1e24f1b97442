"""Boundary states kept every k-th block (``boundary_every``) train bit for bit as every block's kept.

Per family, in both schedules: the resident reference (HF + bitsandbytes + PEFT, ordinary
accumulation), then Poros with ``boundary_every`` 1, 2 and 4 over 5 blocks (segments of 2 and 4 with a
shorter last one); ``torch.equal`` on every loss, LoRA tensor and AdamW state against the resident run,
and so against each other. The tests also see the recompute happen: the k - 1 inputs between kept ones
are never saved, and come back from one forward through their segment.
"""

from __future__ import annotations

import pytest
import torch

import poros
from poros.stream import executor as executor_module
from poros.stream import layer_major
from poros.stream.stash import HostStash
from poros.testing import TINY_VARIANTS, load_qlora, save_tiny_checkpoint
from test_layer_major import layer_major_steps, resident_steps, with_item_counts
from poros.testing.strategies import min_layers
from test_parity import assert_bitwise, make_batch

CASES = [(family, variants[0]) for family, variants in TINY_VARIANTS.items()] + [("gemma4", "moe")]
LAYERS, MICRO, STEPS = 5, 2, 2


def _steps(seed: int) -> list[list[dict]]:
    return [with_item_counts([make_batch(seed + 10 * s + m, 2, 12, "left") for m in range(MICRO)])
            for s in range(STEPS)]


@pytest.fixture
def recomputes(monkeypatch):
    """Every segment recompute the executor runs (micro-major in ``executor.py``, layer-major in
    ``layer_major.py``), as ``(start, stop, micro-batches)``."""
    seen = []
    original = executor_module.recompute_inputs

    def counted(executor, steps, start, stop, bases):
        seen.append((start, stop, len(steps)))
        return original(executor, steps, start, stop, bases)

    for module in (executor_module, layer_major):
        monkeypatch.setattr(module, "recompute_inputs", counted)
    return seen


@pytest.mark.parametrize("schedule", ["layer-major", "micro-major"])
@pytest.mark.parametrize(("family", "variant"), CASES, ids=[f"{f}-{v}" for f, v in CASES])
def test_boundary_every_is_bitwise_every_block_and_resident(family, variant, schedule, tmp_path, recomputes):
    layers = max(LAYERS, min_layers(family, variant))
    path = save_tiny_checkpoint(tmp_path / "ckpt", family, variant, seed=11, num_layers=layers,
                                attn_implementation="sdpa")
    steps = _steps(11)
    reference = load_qlora(path, lora_rank=4, seed=11)
    ref_losses, ref_opt = resident_steps(reference, steps)
    for every in (2, 4):  # 1 is the resident run's bitwise too (test_parity.py, test_layer_major.py)
        recomputes.clear()
        model = load_qlora(path, lora_rank=4, seed=11)
        streamed = poros.prepare(model, boundary_every=every)
        assert streamed.executor.boundary_every == every
        if schedule == "layer-major":
            losses, optimizer = layer_major_steps(streamed, steps)
        else:
            losses, optimizer = resident_steps(streamed, steps)
        assert_bitwise(reference, model, ref_losses, losses, ref_opt, optimizer)
        tops = [(s, min(s + every - 1, layers - 1)) for s in range(0, layers, every)]
        segments = [(s, t, MICRO if schedule == "layer-major" else 1) for s, t in reversed(tops) if t > s]
        passes = STEPS * (1 if schedule == "layer-major" else MICRO)
        assert recomputes == segments * passes  # each segment recomputed once per backward, top segment first


def test_only_the_kept_states_go_to_the_host_stash(tmp_path, monkeypatch):
    """Layer-major with the host stash and boundary_every=2 over 5 blocks: only blocks 2 and 4's inputs
    go out (block 0's is the prelude's), each comes back once, and the run is bitwise the device one."""
    put = []
    original = HostStash.put
    monkeypatch.setattr(HostStash, "put", lambda self, key, tensor: put.append(key) or original(self, key, tensor))
    path = save_tiny_checkpoint(tmp_path / "ckpt", "qwen3", seed=4, num_layers=LAYERS)
    steps = _steps(4)
    results = []
    for options in ({"boundary_states": "device"}, {"boundary_states": "host", "boundary_every": 2}):
        streamed = poros.prepare(load_qlora(path, lora_rank=4, seed=4), **options)
        results.append(layer_major_steps(streamed, steps)[0] + [p.detach().clone()
                                                                for p in streamed.trainable_parameters()])
    assert sorted(set(put)) == [(m, i) for m in range(MICRO) for i in (2, 4)]
    assert len(put) == STEPS * MICRO * 2
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_micro_major_saves_only_the_kept_inputs(tmp_path):
    """Micro-major: a block node whose input is not kept saves none (the memory boundary_every frees)."""
    path = save_tiny_checkpoint(tmp_path / "ckpt", "qwen3", seed=2, num_layers=LAYERS)
    streamed = poros.prepare(load_qlora(path, lora_rank=4, seed=2), boundary_every=2)
    loss = streamed(**make_batch(2, 2, 12, "none")).loss
    node, saved = loss.grad_fn, {}
    pending, seen = [node], set()
    while pending:
        node = pending.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if hasattr(node, "index") and hasattr(node, "saved_tensors"):
            saved[node.index] = node.saved_tensors[0] is not None
        pending.extend(next_node for next_node, _ in node.next_functions)
    assert saved == {i: i % 2 == 0 for i in range(LAYERS)}
    loss.backward()


def test_boundary_every_is_checked():
    with pytest.raises(poros.errors.ConfigError, match="boundary_every=0"):
        poros.stream.options.StreamOptions(boundary_every=0)
    with pytest.raises(poros.errors.ConfigError, match="boundary_every"):
        poros.config.PorosConfig(boundary_every=-2)


@pytest.mark.parametrize("schedule", ["layer-major", "micro-major"])
def test_the_planner_prices_the_recompute(schedule):
    """boundary_every=k: the peak counts the kept states and a segment's recomputed ones; the step's copies and
    time count one more forward through every segment but its top block."""
    from poros.stream.options import Workload
    from poros.plan.budget import ComputeTimes, Footprint, copy_bytes_per_step, predict_peak, predict_step

    blocks, state = 8, 1000
    footprint = Footprint(block_bytes=(100,) * blocks, device_non_block_bytes=0, host_embedding_bytes=0,
                          lora_parameter_bytes=0, boundary_bytes=state, recompute_bytes=0, head_bytes=0)
    compute = ComputeTimes.uniform(blocks, 1.0, 2.0)
    one, four = (Workload(grad_accum=2, schedule=schedule, boundary_every=k) for k in (1, 4))
    passes = 1 if schedule == "layer-major" else 2
    assert copy_bytes_per_step(footprint.block_bytes, four) - copy_bytes_per_step(footprint.block_bytes, one) == \
        passes * (2 * 3 + 1) * 100  # 3 recomputed blocks per segment, and the last block evicted by them
    slow, fast = (predict_step(footprint.block_bytes, w, compute, 1e12).compute_s for w in (four, one))
    assert slow - fast == pytest.approx(2 * 3 * 1.0 * 2)  # 6 more block forwards, for 2 micro-batches
    peak = {k: predict_peak(footprint, w).total - 2 * 100 for k, w in ((1, one), (4, four))}  # less the 2 slots
    if schedule == "layer-major":  # at the turn M x (L + 2); in backward M x (L/4 + 1) and the segment's 3 x M
        assert (peak[1], peak[4]) == (2 * (8 + 2) * state, 2 * (2 + 1 + 3) * state)
    else:  # at the turn L states; at the first backward block L/4 and the segment's 3
        assert (peak[1], peak[4]) == (8 * state, (2 + 3) * state)
