"""The VRAM-budget planner, resident blocks in the store, ``prepare(vram_budget=)`` and ``poros plan``.

* Resident blocks: streamed training with the last blocks kept on the device is bit-for-bit the
  resident HF training (micro-major and layer-major), and the fetch counts drop by exactly them.
* The planner's arithmetic on synthetic footprints: budgets parse, copy bytes and the pipeline
  model follow their formulas, and the decisions keep their promises (a bigger budget never keeps
  fewer blocks resident, a budget below the minimum fails naming it, at the minimum the plan fits,
  a returned plan never needs more than the budget).
* Calibration: the predicted peak against every bench record measured on the H200.
* ``poros plan`` on the CPU (memory plan, given times, the probe) and its exit statuses.
"""

from __future__ import annotations

import json
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import poros
from poros import registry
from poros.cli.main import main
from poros.descriptor import resolve_path
from poros.config import PorosConfig
from poros.errors import ConfigError
from poros.doctor import probe
from poros.plan import calibration, run_plan
from poros.plan import footprint as footprint_module
from poros.plan import budget as planner
from poros.stream.options import StreamOptions
from poros.plan.budget import ComputeTimes, Footprint, Workload
from poros.testing import load_qlora, save_tiny_checkpoint
from test_layer_major import layer_major_steps, resident_steps, with_item_counts
from test_parity import BASE_SETUP, assert_bitwise, make_batch, run_parity

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROOT = Path(__file__).resolve().parents[1]
GiB = 2**30


def budget_options(vram_budget, **options) -> StreamOptions:
    """The options these tests plan with: ``vram_budget``, AdamW's state on the device unless given."""
    return StreamOptions(vram_budget=vram_budget, **{"optimizer_states": "device", **options})




def decoder_layers(model) -> list[torch.nn.Module]:
    causal_lm = model.get_base_model()
    return list(resolve_path(causal_lm, registry.for_config(causal_lm.config).decoder_layers))


@pytest.fixture(scope="module")
def gemma4_checkpoint(tmp_path_factory):
    """Gemma 4 with KV sharing and per-layer inputs: a carried mapping crosses the resident boundary."""
    return save_tiny_checkpoint(tmp_path_factory.mktemp("g4") / "ckpt", "gemma4", "e2b", seed=5)


# -- resident blocks in the store --------------------------------------------------------------

def test_resident_blocks_are_bound_for_good_and_take_no_slot(gemma4_checkpoint):
    model = load_qlora(gemma4_checkpoint, seed=5)
    layers = decoder_layers(model)
    originals = {name: t.detach().clone() for name, t in layers[-1].named_parameters() if not t.requires_grad}
    streamed = poros.prepare(model, resident_blocks=2)
    store = streamed.store
    count = len(store.blocks)
    assert store.resident_blocks == (count - 2, count - 1)
    assert store.num_slots == 2 and store.slot_bytes == max(b.nbytes for b in store.blocks[:-2])
    assert store.host_bytes == sum(b.nbytes for b in store.blocks[:-2])
    assert store.resident_bytes == sum(b.nbytes for b in store.blocks[-2:])
    for record in store.blocks:
        params = [e for e in record.entries if e.kind == "param"]
        if record.resident:  # real tensors, views of the block's own buffer, on the compute device
            assert all(e.owner.numel() > 0 and e.owner.data_ptr() >= record.buffer.data_ptr() for e in params)
        else:
            assert all(e.owner.numel() == 0 for e in params)
    before = (list(store.stats.fetches), store.stats.bytes_copied)
    for index in store.resident_blocks:  # fetch / wait / release are no-ops: no copy, no count
        store.fetch(index)
        store.wait(index)
        store.release(index)
        assert store.is_resident(index)
    assert (store.stats.fetches, store.stats.bytes_copied) == before and None in store.slot_owner

    batch = make_batch(0, 2, 16, "left")
    store.stats.reset()
    streamed(**batch).loss.backward()
    streamed_bytes = sum(b.nbytes for b in store.blocks[:-2])
    assert store.stats.fetches == [2] * (count - 2) + [0, 0]  # the last streamed block is not kept across the turn
    assert store.stats.bytes_copied == 2 * streamed_bytes
    assert all(owner is None for owner in store.slot_owner)
    store.stats.reset()
    store.release_all()
    streamed.unpatch()
    restored = {name: t for name, t in layers[-1].named_parameters() if not t.requires_grad}
    assert all(torch.equal(restored[name], value) for name, value in originals.items())


def test_a_store_of_only_resident_blocks_has_no_ring(gemma4_checkpoint):
    streamed = poros.prepare(load_qlora(gemma4_checkpoint, seed=5), resident_blocks=6)
    assert streamed.store.num_slots == 0 and streamed.store.slot_bytes == 0 and streamed.store.host_bytes == 0
    streamed(**make_batch(1, 1, 12, "none")).loss.backward()
    assert sum(streamed.store.stats.fetches) == 0


@pytest.mark.parametrize(("family", "variant", "resident"), [("qwen3", "default", 1), ("gemma4", "e2b", [0, 4, 5]),
                                                             ("qwen3_5", "default", 2)],
                         ids=["qwen3-last-1", "gemma4-e2b-scattered", "qwen3_5-last-2"])
def test_training_with_resident_blocks_is_bitwise_resident(tmp_path, family, variant, resident):
    streamed = run_parity(family, variant, BASE_SETUP, tmp_path, resident_blocks=resident)
    count = len(streamed.store.blocks)
    indices = set(range(count - resident, count)) if isinstance(resident, int) else set(resident)
    assert set(streamed.store.resident_blocks) == indices
    assert all((fetches == 0) == (i in indices) for i, fetches in enumerate(streamed.store.stats.fetches))


def test_layer_major_with_resident_blocks_is_bitwise_and_fetches_streamed_blocks_twice(gemma4_checkpoint):
    steps = [with_item_counts([make_batch(7 + 10 * s + m, 2, 14, "left") for m in range(3)]) for s in range(2)]
    reference = load_qlora(gemma4_checkpoint, seed=5)
    ref_losses, ref_opt = resident_steps(reference, steps)
    model = load_qlora(gemma4_checkpoint, seed=5)
    streamed = poros.prepare(model, resident_blocks=3)
    streamed.store.stats.reset()
    losses, opt = layer_major_steps(streamed, steps)
    assert_bitwise(reference, model, ref_losses, losses, ref_opt, opt)
    count = len(streamed.store.blocks)
    # per optimizer step: each streamed block once per direction for all 3 micro-batches; resident ones never
    assert streamed.store.stats.fetches == [2 * len(steps)] * (count - 3) + [0] * 3
    workload = Workload(2, 14, 3, "layer-major")
    block_bytes = tuple(b.nbytes for b in streamed.store.blocks)
    assert streamed.store.stats.bytes_copied == len(steps) * planner.copy_bytes_per_step(
        block_bytes, workload, streamed.store.resident_blocks)


def test_resident_blocks_and_budget_options_are_checked_before_anything_moves(gemma4_checkpoint):
    model = load_qlora(gemma4_checkpoint, seed=5)
    for bad in (7, -1, [0, 6], True):
        with pytest.raises(ConfigError, match="resident_blocks"):
            poros.prepare(model, resident_blocks=bad)
    with pytest.raises(ConfigError, match="Pass one of the two"):
        poros.prepare(model, resident_blocks=1, vram_budget="1GiB", workload={"seq_len": 16})
    with pytest.raises(ConfigError, match="workload="):
        poros.prepare(model, vram_budget="1GiB")
    with pytest.raises(ConfigError, match="needs at least"):
        poros.prepare(model, vram_budget=1000, workload={"seq_len": 16})
    # nothing moved: the model still runs as loaded and can be prepared
    assert all(p.numel() > 0 for p in model.parameters())
    poros.prepare(model).unpatch()


def test_prepare_with_a_budget_applies_the_plan_and_trains_bitwise(tmp_path):
    """A budget between the pipelined minimum and full residency: some blocks resident, the plan applied.
    (With uniform blocks, once no more than ``num_slots`` blocks stream, their slots' bytes hold them
    for good: the planner then makes every block resident.)"""
    path = save_tiny_checkpoint(tmp_path / "probe", "qwen3", seed=3, num_layers=4)
    model = load_qlora(path, lora_rank=4, lora_alpha=8, seed=3, double_quant=True)
    workload = Workload(batch_size=2, seq_len=20)
    causal_lm = model.get_base_model()
    layers = decoder_layers(model)
    footprint = footprint_module.footprint_of_model(causal_lm, layers, [], workload, device=torch.device("cpu"),
                                           compute_dtype=torch.bfloat16)
    # room for the ring and one resident block (two more would need a third block's bytes)
    peak = planner.predict_peak(footprint, workload, resident=[3], num_slots=2, embeddings_on_host=False)
    budget = planner.budget_for_peak(peak.total, context_bytes=0, slack=planner.ALLOCATOR_SLACK)

    streamed = run_parity("qwen3", "default", {**BASE_SETUP, "config": {"num_layers": 4}}, tmp_path,
                          vram_budget=budget, workload=workload)
    plan = streamed.budget_plan
    assert plan.resident_blocks == (3,) == streamed.store.resident_blocks
    assert plan.num_slots == streamed.store.num_slots == 2 and not plan.embeddings_on_host
    assert plan.needed_bytes <= budget
    assert 0 not in streamed.store.stats.fetches[:3] and streamed.store.stats.fetches[3] == 0


def test_a_tight_layer_major_budget_puts_the_boundary_states_on_the_host(tmp_path):
    """prepare(vram_budget=...) below what the ring needs with the states on the device: the plan's
    host placement reaches the executor, and layer-major training is still bitwise; an explicit
    boundary_states stands whatever the plan says."""
    path = save_tiny_checkpoint(tmp_path / "ckpt", "qwen3", seed=3, num_layers=4)
    workload = Workload(batch_size=2, seq_len=14, grad_accum=3, schedule="layer-major")
    model = load_qlora(path, lora_rank=4, lora_alpha=8, seed=3)
    footprint = footprint_module.footprint_of_model(model.get_base_model(), decoder_layers(model), [], workload,
                                           device=torch.device("cpu"), compute_dtype=torch.bfloat16)
    on_device = planner.plan_budget(footprint, workload, budget_options(10**12)).pipelined_minimum_bytes
    steps = [with_item_counts([make_batch(3 + m, 2, 14, "left") for m in range(3)]) for _ in range(2)]
    reference = load_qlora(path, lora_rank=4, lora_alpha=8, seed=3)
    ref_losses, ref_opt = resident_steps(reference, steps)
    streamed = poros.prepare(model, vram_budget=on_device - 1, workload=workload)
    assert streamed.budget_plan.boundary_states == "host" == streamed.executor.boundary_states
    losses, opt = layer_major_steps(streamed, steps)
    assert_bitwise(reference, model, ref_losses, losses, ref_opt, opt)
    # an explicit choice is kept, even where the plan (micro-major) would say "device"
    other = poros.prepare(load_qlora(path, lora_rank=4, lora_alpha=8, seed=3), vram_budget=10**12,
                          workload=Workload(batch_size=2, seq_len=14), boundary_states="host")
    assert other.budget_plan.boundary_states == "device" and other.executor.boundary_states == "host"


# -- the planner's arithmetic ------------------------------------------------------------------

def test_budgets_parse_in_binary_and_decimal_units():
    assert planner.parse_budget("7GiB") == 7 * GiB
    assert planner.parse_budget("7GB") == 7 * 10**9
    assert planner.parse_budget("7000MiB") == 7000 * 2**20
    assert planner.parse_budget("7.5G") == int(7.5 * GiB)
    assert planner.parse_budget(" 24 gib ") == 24 * GiB
    assert planner.parse_budget(123456) == 123456
    for bad in ("7 GB?", "seven", "7XB", "", "0GB", 0, -5, True, 7.5):
        with pytest.raises(ConfigError, match="vram_budget"):
            planner.parse_budget(bad)
    with pytest.raises(ConfigError, match="vram_budget='7 GB\\?'"):
        PorosConfig(vram_budget="7 GB?")


def footprint(blocks: int = 8, block: int = 100, **changes) -> Footprint:
    values = dict(block_bytes=(block,) * blocks, device_non_block_bytes=500, host_embedding_bytes=300,
                  lora_parameter_bytes=40, boundary_bytes=10, recompute_bytes=60, head_bytes=200)
    return Footprint(**{**values, **changes})


def test_copy_bytes_per_step_follow_the_schedule():
    sizes = (100, 110, 120, 130)
    for micro in (1, 2, 5):
        assert planner.copy_bytes_per_step(sizes, Workload(grad_accum=micro)) == micro * (2 * 460 - 130)
        # layer-major: every block crosses the link twice per step, whatever M is (the last once)
        assert planner.copy_bytes_per_step(sizes, Workload(grad_accum=micro, schedule="layer-major")) == 2 * 460 - 130
    # resident tail: every streamed block twice (the last streamed one is not kept across the turn)
    assert planner.copy_bytes_per_step(sizes, Workload(grad_accum=3), [2, 3]) == 3 * 2 * 210
    assert planner.copy_bytes_per_step(sizes, Workload(), range(4)) == 0


def test_the_pipeline_model_is_max_of_copy_and_compute_per_stage():
    blocks, copy, fwd, bwd, head, optimizer = 6, 8.0, 5.0, 12.0, 3.0, 1.0  # copy in seconds at 1 byte/s
    sizes = (copy,) * blocks
    compute = ComputeTimes.uniform(blocks, fwd, bwd, head, optimizer)
    step = planner.predict_step(sizes, Workload(), compute, 1.0)
    # forward copy-bound (block 0's copy opens the pass), head, backward compute-bound (last block kept)
    assert step.forward_s == pytest.approx(blocks * copy + fwd)
    assert step.backward_s == pytest.approx(blocks * bwd)
    assert step.step_s == pytest.approx(blocks * copy + fwd + head + blocks * bwd + optimizer)
    assert step.copy_bound_stages == blocks - 1 and not step.copy_hidden
    assert step.compute_s == pytest.approx(blocks * (fwd + bwd) + head + optimizer)
    # one slot: nothing overlaps, every copy waits
    one = planner.predict_step(sizes, Workload(), compute, 1.0, num_slots=1)
    assert one.step_s == pytest.approx(step.compute_s + (2 * blocks - 1) * copy)
    # everything resident: pure compute
    assert planner.predict_step(sizes, Workload(), compute, 1.0, resident=range(blocks)).step_s \
        == pytest.approx(step.compute_s)
    # layer-major with M=2 makes forward compute-bound too: only the pass start waits
    layer_major = planner.predict_step(sizes, Workload(grad_accum=2, schedule="layer-major"), compute, 1.0)
    assert layer_major.copy_hidden and layer_major.exposed_copy_s == pytest.approx(copy)
    with pytest.raises(ConfigError, match="model has 6"):
        planner.predict_step(sizes, Workload(), ComputeTimes.uniform(5, 1, 1), 1.0)


def test_peak_phases():
    fp = footprint(blocks=4, block=100)
    peak = planner.predict_peak(fp, Workload(), num_slots=2)
    persistent = 2 * 100 + 500 + 3 * 40
    assert peak.phase.startswith("head and loss") and peak.total == persistent + 4 * 10 + 200
    big_recompute = planner.predict_peak(footprint(blocks=4, recompute_bytes=400), Workload())
    assert big_recompute.phase == "block recompute and backward"
    assert big_recompute.total == persistent + max(4 * 10 + 40 // 4, 2 * 10 + 40) + 400
    # layer-major keeps M x L boundary states until backward is over
    layer_major = planner.predict_peak(footprint(blocks=4, head_bytes=0), Workload(grad_accum=3, schedule="layer-major"))
    assert layer_major.total == persistent + 3 * 5 * 10 + 40 + 60
    # resident blocks replace streaming, the ring shrinks to the streamed blocks
    assert planner.predict_peak(fp, Workload(), resident=[1, 2, 3]).persistent[0][1] == 100
    assert planner.predict_peak(fp, Workload(), resident=range(4)).persistent[0][1] == 0
    assert planner.predict_peak(fp, Workload(), embeddings_on_host=False).total == peak.total + 300


def test_a_budget_below_the_minimum_names_the_minimum():
    fp, workload = footprint(), Workload()
    minimum = planner.minimum_budget(fp, workload)
    with pytest.raises(ConfigError, match=f"needs at least {planner.format_gb(minimum)}".replace(".", r"\.")):
        planner.plan_budget(fp, workload, budget_options(minimum - 1))
    plan = planner.plan_budget(fp, workload, budget_options(minimum))
    assert plan.needed_bytes <= minimum and plan.num_slots == 1 and plan.resident_blocks == ()
    assert "1 device slot instead of 2" in plan.notes[0]
    pipelined = planner.plan_budget(fp, workload, budget_options(plan.pipelined_minimum_bytes))
    assert pipelined.num_slots == 2 and pipelined.resident_blocks == ()


def test_layer_major_boundary_states_go_to_the_host_only_when_the_device_cannot_hold_them():
    fp = footprint(boundary_bytes=1000)
    workload = Workload(grad_accum=4, schedule="layer-major")
    roomy = planner.plan_budget(fp, workload, budget_options(10**6))
    assert roomy.boundary_states == "device" and roomy.boundary_bytes == 4 * 8 * 1000
    assert "boundary states on the device" in " ".join(roomy.notes)
    on_device = planner.predict_peak(fp, workload, num_slots=2)
    on_host = planner.predict_peak(fp, workload, num_slots=2, boundary_on_host=True)
    # M(L+2)B at the turn on the device; on the host the M prelude outputs and those in flight:
    # 3MB at the turn, 4MB in backward (this block's inputs, the next block's, the gradients)
    assert dict(on_device.transient)["boundary states (M x L) + outputs and their gradients"] == 4 * 10 * 1000
    assert on_host.phase == "block recompute and backward" and on_host.total < on_device.total
    assert [n for name, n in on_host.transient if name.startswith("boundary")] == [4 * 4 * 1000]
    # below what the ring needs with the states on the device: host, and no resident block
    device_minimum = planner.minimum_budget(fp, workload, boundary_states="device")
    tight = planner.plan_budget(fp, workload, budget_options(roomy.pipelined_minimum_bytes - 1))
    assert tight.boundary_states == "host" and tight.num_slots == 2 and tight.resident_blocks == ()
    assert tight.needed_bytes < roomy.pipelined_minimum_bytes and "on the host" in " ".join(tight.notes)
    # the smallest budget: one slot, states on the host; below it the error names that minimum
    minimum = planner.minimum_budget(fp, workload)
    assert minimum == roomy.boundary_offload_minimum_bytes == roomy.minimum_bytes < device_minimum
    assert planner.plan_budget(fp, workload, budget_options(minimum)).boundary_states == "host"
    with pytest.raises(ConfigError, match="needs at least.*boundary states on the host"):
        planner.plan_budget(fp, workload, budget_options(minimum - 1))
    # forced to the device: its own minimum, and the error says what the host would need
    with pytest.raises(ConfigError, match="needs at least.*With the boundary states on the host"):
        planner.plan_budget(fp, workload, budget_options(device_minimum - 1, boundary_states="device"))
    assert planner.plan_budget(fp, workload, budget_options(10**6, boundary_states="host")).boundary_states == "host"
    assert planner.plan_budget(fp, workload, budget_options(10**6, boundary_states="disk")).boundary_states == "disk"
    with pytest.raises(ConfigError, match="boundary_states='swap'"):
        planner.plan_budget(fp, workload, budget_options(10**6, boundary_states="swap"))
    # micro-major: autograd keeps the states; never offloaded
    micro = Workload(grad_accum=4)
    assert planner.plan_budget(fp, micro, budget_options(10**6)).boundary_states == "device"
    assert planner.minimum_budget(fp, micro) == planner.plan_budget(fp, micro, budget_options(10**6)).minimum_bytes


def test_the_budget_that_hides_the_copy_is_priced_with_the_states_on_the_device():
    """Found by hypothesis: a budget that only fits with the states on the host keeps no resident
    block, so the hiding budget (which needs resident blocks) must not be priced in the host placement."""
    fp = Footprint(block_bytes=(1, 1, 1), device_non_block_bytes=0, host_embedding_bytes=0, lora_parameter_bytes=0,
                   boundary_bytes=1, recompute_bytes=0, head_bytes=0, workspace_bytes=0)
    workload = Workload(grad_accum=3, schedule="layer-major")
    times = ComputeTimes.uniform(3, 1.0, 1.0, 0.01)
    for budget in range(planner.minimum_budget(fp, workload), 40):
        plan = planner.plan_budget(fp, workload, budget_options(budget, num_slots=1), compute=times,
                                   link_bytes_per_s=10**6)
        if budget >= plan.hide_copy_bytes:
            assert plan.boundary_states == "device" and plan.step.copy_hidden, budget


def test_the_host_placement_is_only_chosen_where_it_fits():
    """One block: the states on the host (4 x M in flight) take more than on the device (M x 2):
    the planner keeps them on the device, and its minimum is the device's."""
    fp = footprint(blocks=1, boundary_bytes=1000)
    workload = Workload(grad_accum=4, schedule="layer-major")
    device = planner.minimum_budget(fp, workload, boundary_states="device")
    host = planner.minimum_budget(fp, workload, boundary_states="host")
    assert device < host and planner.minimum_budget(fp, workload) == device
    assert planner.plan_budget(fp, workload, budget_options(device)).boundary_states == "device"


def test_hiding_the_copy():
    fp = footprint(blocks=6, block=8)
    slow_link = ComputeTimes.uniform(6, 5.0, 12.0, 1.0)  # copy 8 s > forward 5 s: forward copy-bound
    plan = planner.plan_budget(fp, Workload(), budget_options(10**6), compute=slow_link, link_bytes_per_s=1.0)
    # all but block 0: its forward copy opens the pass (nothing to hide it behind), its backward copy
    # hides behind block 1's backward; block 0 resident would not be faster but for that first copy
    assert plan.hide_copy_resident == 5 and plan.hide_copy_step.copy_hidden
    assert plan.hide_copy_step.step_s == pytest.approx(plan.hide_copy_step.compute_s + 8.0)
    assert plan.resident_blocks == tuple(range(6)) and plan.step.step_s == pytest.approx(plan.step.compute_s)
    assert "5 already take the copy off the critical path" in plan.notes[0]
    tight = planner.plan_budget(fp, Workload(), budget_options(plan.hide_copy_bytes - 1), compute=slow_link,
                                link_bytes_per_s=1.0)
    assert len(tight.resident_blocks) < 5 and not tight.step.copy_hidden
    assert any("layer-major accumulation over 2 or more" in note for note in plan.notes)
    fast_link = ComputeTimes.uniform(6, 9.0, 12.0, 1.0)  # compute-bound everywhere: no block needs to stay
    plan = planner.plan_budget(fp, Workload(), budget_options(10**6), compute=fast_link, link_bytes_per_s=1.0)
    assert plan.hide_copy_resident == 0 and plan.hide_copy_bytes == plan.pipelined_minimum_bytes
    assert planner.plan_budget(fp, Workload(), budget_options(10**6)).hide_copy_resident is None  # unknown untimed


footprints = st.builds(
    Footprint,
    block_bytes=st.lists(st.integers(1, 10**6), min_size=1, max_size=12).map(tuple),
    device_non_block_bytes=st.integers(0, 10**7), host_embedding_bytes=st.integers(0, 10**7),
    lora_parameter_bytes=st.integers(0, 10**6), boundary_bytes=st.integers(0, 10**5),
    recompute_bytes=st.integers(0, 10**6), head_bytes=st.integers(0, 10**7), workspace_bytes=st.integers(0, 10**5))
workloads = st.builds(Workload, batch_size=st.just(1), seq_len=st.just(1), grad_accum=st.integers(1, 4),
                      schedule=st.sampled_from(planner.SCHEDULES))


@settings(max_examples=40, deadline=None, derandomize=True)
@given(fp=footprints, workload=workloads, slots=st.integers(1, 3), context=st.integers(0, 10**6),
       timed=st.booleans(), data=st.data())
def test_decisions_keep_their_promises(fp, workload, slots, context, timed, data):
    compute = ComputeTimes.uniform(fp.num_blocks, data.draw(st.floats(0.001, 1.0)), data.draw(st.floats(0.001, 1.0)),
                                   0.01) if timed else None
    options = dict(compute=compute, link_bytes_per_s=10**6 if timed else None, context_bytes=context)
    minimum = planner.minimum_budget(fp, workload, context_bytes=context)
    at_minimum = planner.plan_budget(fp, workload, budget_options(minimum, num_slots=slots), **options)
    assert at_minimum.needed_bytes <= minimum  # at the minimum it fits
    with pytest.raises(ConfigError, match="needs at least"):
        planner.plan_budget(fp, workload, budget_options(minimum - 1, num_slots=slots), **options)
    previous = -1
    full = planner.budget_for_peak(planner.predict_peak(fp, workload, resident=range(fp.num_blocks)).total,
                                   context_bytes=context, slack=planner.ALLOCATOR_SLACK)
    for budget in sorted({minimum, *(minimum + (full - minimum) * k // 7 for k in range(1, 9)), full + 1}):
        plan = planner.plan_budget(fp, workload, budget_options(budget, num_slots=slots), **options)
        assert plan.needed_bytes <= budget and plan.peak.total < plan.needed_bytes or plan.peak.total == 0
        assert len(plan.resident_blocks) >= previous  # a bigger budget never keeps fewer blocks resident
        assert plan.resident_blocks == tuple(range(fp.num_blocks - len(plan.resident_blocks), fp.num_blocks))
        previous = len(plan.resident_blocks)
        if timed and plan.hide_copy_bytes is not None and budget >= plan.hide_copy_bytes:
            assert plan.step.copy_hidden
    assert previous == fp.num_blocks  # with room for everything, everything stays


# -- calibration against the H200 --------------------------------------------------------------

BENCH_RECORDS = calibration.calibration_records(ROOT / "registry" / "results")


@cache
def _results_docs():
    from tools.docs import gen_results_docs

    return gen_results_docs


def predicted_and_measured(record_path: Path) -> tuple[int, float]:
    """Today's prediction for a record's own run (``poros.plan.calibration``) and the peak it measured."""

    record = json.loads(record_path.read_text())
    plan = calibration.record_plan(record)
    resident = record["arms"]["poros"].get("resident_blocks", ())
    assert plan.host_store_bytes - sum(plan.block_bytes[i] for i in resident) == record["arms"]["poros"]["host_bytes"]
    return calibration.predicted_peak(record), record["arms"]["poros"]["peak_allocated_gb"] * 1e9


def test_predicted_peak_is_within_15_percent_of_every_h200_record():
    """Every bench record with a finished Poros arm (micro-major and layer-major, seq 512 and 2048, 7B to 72B)."""
    assert len(BENCH_RECORDS) >= 15
    errors = {}
    for path in BENCH_RECORDS:
        predicted, measured = predicted_and_measured(path)
        errors[f"{path.parent.name}/{path.stem}"] = predicted / measured - 1
    far = {name: f"{error:+.1%}" for name, error in errors.items() if abs(error) > 0.15}
    assert not far, f"predicted peak off by more than 15 %: {far}"
    assert any("layer-major" in name for name in errors)
    assert any("vram-budget" in name for name in errors)  # a planner-chosen run (boundary states on the host)


MOE_RECORDS = [p for p in BENCH_RECORDS if json.loads(p.read_text())["config"].get("quantize_experts")]


def test_predicted_peak_is_within_10_percent_of_every_moe_record():
    """The MoE records (Qwen3.5-35B-A3B and -122B-A10B, NF4 experts, grouped forward): the recompute holds one
    whole fused expert tensor dequantized (gate_up_proj, 3.2 GB at 122B-A10B). The prediction the 122B run
    recorded (6.54 GB against 8.50 measured) left it out: ``predict_prepared`` read the expert count from the
    codes' shape, which the store had emptied (tests/test_moe.py checks the prepared model's count)."""
    assert len(MOE_RECORDS) >= 2
    errors = {}
    for path in MOE_RECORDS:
        predicted, measured = predicted_and_measured(path)
        errors[path.stem] = predicted / measured - 1
    far = {name: f"{error:+.1%}" for name, error in errors.items() if abs(error) > 0.10}
    assert not far, f"MoE predicted peak off by more than 10 %: {far}"


# -- poros plan --------------------------------------------------------------------------------

CURVE_RECORDS = sorted((ROOT / "registry" / "results").glob("h200-*/curve-*.json"))


def test_predicted_peak_is_within_15_percent_across_the_published_curves():
    """Every budget of every published VRAM curve (tools/bench/vram_curve.py: 32B and 72B, accumulation 1
    and 8 layer-major, from no resident block to all of them), recomputed from the shape's config.

    The peak is predicted for what ran (the row's slots, resident blocks and boundary-state placement).
    The planner's decision for the row's budget, made again, may be more careful than the one that ran,
    never bolder: the curves (2026-11-30) were measured with the decisions of a planner that priced a
    block's recompute about 0.1 GB lower at seq 512 (before it counted PEFT's fp32 LoRA input copies and
    the norm backward's fp32 temporaries, issue 32), so at budgets that sat on a threshold it now keeps up
    to 3 resident blocks fewer, or the boundary states on the host. A re-run of the curves pins them again."""
    assert {json.loads(p.read_text())["config"]["model"] for p in CURVE_RECORDS} >= {"qwen2.5-32b", "qwen2.5-72b"}
    errors = {}
    for path in CURVE_RECORDS:
        record = json.loads(path.read_text())
        setup = record["config"]
        layers = setup["model_info"]["num_hidden_layers"]
        plan = calibration.plan_model(record, seq=setup["seq"], batch=setup["batch"], double_quant=True,
                                      targets=tuple(setup["lora"]["targets"]), rank=setup["lora"]["rank"], attn="sdpa",
                                      loss_chunks=1, quantize_experts=False, mlp_chunks=1)
        workload = Workload(setup["batch"], setup["seq"], setup["grad_accum"], setup["schedule"])
        for row in record["rows"]:
            name = f"{path.stem} @ {row['budget']}"
            resident = range(layers - row["resident_blocks"], layers)
            # the curves predate dequantize_once (issue 41): those runs held no dequantized block
            chosen = planner.plan_budget(plan.footprint(), workload,
                                         budget_options(row["budget"], embeddings_on_host=True, dequantize_once=False),
                                         context_bytes=planner.CUDA_CONTEXT_BYTES)
            ran_states = row.get("boundary_states") or (
                _results_docs()._states(row, record) if workload.schedule == "layer-major" and workload.grad_accum > 1
                else chosen.boundary_states)
            assert row["resident_blocks"] - 3 <= len(chosen.resident_blocks) <= row["resident_blocks"], name
            assert chosen.boundary_states in {ran_states, "host"}, name
            peak = planner.predict_peak(plan.footprint(), workload, resident=resident, num_slots=max(row["num_slots"], 1),
                                        boundary_on_host=ran_states == "host")
            errors[name] = peak.total / (row["peak_allocated_gb"] * 1e9) - 1
    assert len(errors) >= 16
    far = {name: f"{error:+.1%}" for name, error in errors.items() if abs(error) > 0.15}
    assert not far, f"predicted peak off by more than 15 %: {far}"


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("plan") / "ckpt", "qwen3", num_layers=4)


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_plan_on_cpu_prints_the_memory_plan(capsys, tiny_checkpoint):
    status, out, err = run_cli(capsys, "plan", "--model", str(tiny_checkpoint), "--vram-budget", "1GiB",
                               "--device", "cpu", "--seq-len", "64")
    assert status == 0, err
    for line in ("budget      1.07 GB (1.0 GiB)", "resident blocks   4 of 4 (0..3)", "predicted peak allocated",
                 "budget (fits)", "step time   unknown", "Minimum budget for this run"):
        assert line in out, line
    assert "hide copy   unknown" in out


def test_plan_with_given_times_and_json(capsys, tiny_checkpoint):
    base = ["plan", "--model", str(tiny_checkpoint), "--device", "cpu", "--seq-len", "64", "--grad-accum", "2",
            "--stream-schedule", "layer-major", "--block-ms", "0.3,0.6", "--link-gb-per-s", "0.001",
            "--optimizer-states", "device"]  # the AdamW state's host fallback: tests/test_host_optimizer.py
    status, out, err = run_cli(capsys, *base, "--vram-budget", "1GiB", "--json")
    assert status == 0, err
    report = json.loads(out)
    plan = report["plan"]
    assert plan["workload"] == {"batch_size": 1, "seq_len": 64, "grad_accum": 2, "schedule": "layer-major",
                                "loss_chunks": 1, "packed": False, "boundary_every": 1,
                                "fused_loss": False}
    assert plan["step"]["step_s"] > 0 and report["compute"]["source"] == "given: --block-ms 0.3,0.6"
    assert plan["needed_bytes"] <= plan["budget_bytes"] and plan["hide_copy_resident"] is not None
    minimum = plan["boundary_offload_minimum_bytes"]  # layer-major: the states may wait on the host
    assert plan["boundary_states"] == "device" and minimum == plan["minimum_bytes"]
    status, out, err = run_cli(capsys, *base, "--vram-budget", str(plan["pipelined_minimum_bytes"]))
    assert status == 0, err
    assert "resident blocks   0 of 4" in out and "predicted step" in out.lower() and "hide copy   needs" in out
    status, out, err = run_cli(capsys, *base, "--vram-budget", str(minimum))
    assert status == 0, err
    # at the minimum the states wait on the host, unless a raised mlp_chunks / loss_chunks keeps them on the
    # device with the ring asked for (the chunk choice tries the ring first: the MLP's LoRA input copies make
    # a tiled MLP worth it even at 64 tokens)
    assert "boundary states   host" in out or ("boundary states   device" in out and "(asked 1 and 1)" in out)
    # a byte less: the planner chunks the head and loss (or the MLP) rather than refuse
    status, out, err = run_cli(capsys, *base, "--vram-budget", str(minimum - 1))
    assert status == 0 and "the budget cannot hold the step with fewer chunks" in out, err
    status, out, err = run_cli(capsys, *base, "--vram-budget", "1000")
    assert status == 1 and out == ""
    assert "does not fit this run" in err and "its biggest part is" in err and "below the minimum" in err


def test_plan_probes_on_request(capsys, tiny_checkpoint):
    status, out, err = run_cli(capsys, "plan", "--model", str(tiny_checkpoint), "--vram-budget", "1GiB",
                               "--device", "cpu", "--seq-len", "32", "--probe")
    assert status == 0, err
    assert "compute     probe on cpu (1 block at batch 1 x seq 32" in out
    assert "link        " in out and "(measured: a 256 MiB host memcpy (cpu))" in out


def test_probe_segments_per_micro_batch():
    """The probe's marks, layer-major over 2 micro-batches: each block's time runs from its first entry to
    the next block's, divided by M."""
    labels = ["start", "block 0", "block 0", "block 1", "block 1", "head", "head", "block 1", "block 1", "block 0",
              "block 0", "end", "optimizer"]
    times = [0, 1, 3, 5, 7, 9, 10, 11, 17, 23, 27, 31, 32]
    segments = probe._segments(labels, [float(t) for t in times], layers=2, micro=2)
    assert segments == {"forward 0": 2.0, "forward 1": 2.0, "backward 1": 6.0, "backward 0": 4.0, "head": 1.0,
                        "optimizer": 1.0}
    with pytest.raises(poros.errors.StreamingError, match="do not follow the executor's order"):
        probe._segments(labels[:3] + labels[5:], [float(t) for t in times[:3] + times[5:]], layers=2, micro=2)


def test_plan_of_a_known_model_is_made_offline_from_its_registry_record(tmp_path, child_env):
    """Qwen/Qwen2.5-72B with HF_HUB_OFFLINE=1 and an empty HF cache: the shape registry/qwen2.toml records is
    planned, the output says so, and nothing is written to the cache; an unknown hub id still fails by name."""
    cache = tmp_path / "hf"
    cache.mkdir()
    env = child_env(HF_HUB_OFFLINE="1", HF_HOME=str(cache), HF_HUB_CACHE=str(cache / "hub"), OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "poros", "plan", "--vram-budget", "24GiB", "--device", "cpu"]
    done = subprocess.run([*command, "--model", "Qwen/Qwen2.5-72B"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "model       Qwen/Qwen2.5-72B (not in the HF cache; planned offline from its record in registry/qwen2.toml" \
        in done.stdout
    assert "family      qwen2 (model_type qwen2): 80 decoder blocks, hidden 8192, vocab 152064" in done.stdout
    assert "predicted peak allocated" in done.stdout
    assert list(cache.rglob("*")) == []
    unknown = subprocess.run([*command, "--model", "poros-test/not-a-known-model"], env=env, capture_output=True,
                             text=True, timeout=300)
    assert unknown.returncode == 1 and "is not in the HF cache" in unknown.stderr


def test_plan_errors_exit_1(capsys, tiny_checkpoint):
    status, _, err = run_cli(capsys, "plan", "--model", str(tiny_checkpoint), "--device", "cpu")
    assert status == 1 and "needs a budget on the CPU" in err
    status, _, err = run_cli(capsys, "plan", "--model", str(tiny_checkpoint), "--device", "cpu",
                             "--vram-budget", "7 GB?")
    assert status == 1 and "vram_budget='7 GB?'" in err
    status, _, err = run_cli(capsys, "plan", "--vram-budget", "1GiB", "--device", "cpu", "--block-ms", "fast")
    assert status == 1 and "--block-ms 'fast'" in err


def test_plan_says_the_host_tier_a_run_gets(capsys, tiny_checkpoint):
    """`poros plan --host-budget`: with the cache, blocks that fit take the entry's mapping; a budget below
    them, the disk tier with the first blocks the budget holds beyond the ring kept in RAM."""
    base = ["plan", "--model", str(tiny_checkpoint), "--device", "cpu", "--seq-len", "64"]
    status, out, err = run_cli(capsys, *base, "--vram-budget", "1GiB", "--json")
    assert status == 0, err
    base += ["--vram-budget", str(json.loads(out)["plan"]["pipelined_minimum_bytes"])]  # every block streams
    status, out, err = run_cli(capsys, *base, "--json")
    assert status == 0, err
    host = json.loads(out)["host"]
    assert host["tier"] == "mapped" and host["held_blocks"] == 0 and host["block_bytes"] > 0
    status, out, err = run_cli(capsys, *base, "--json", "--no-cache")
    assert status == 0, err
    assert json.loads(out)["host"]["tier"] == "pinned"
    largest = host["block_bytes"] // 4  # the tiny qwen3's 4 blocks are of one size
    status, out, err = run_cli(capsys, *base, "--host-budget", str(3 * largest + 10), "--read-ahead", "2")  # 1 held
    assert status == 0, err
    assert "disk tier, 2 ring buffers, the first 1 blocks" in out and "held in pinned RAM" in out
