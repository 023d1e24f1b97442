"""``lora_placement="host"``: the streamed blocks' LoRA tensors travel with their block, bit for bit resident.

For every family: the streamed model (layer-major ``forward_backward``, LoRA parameters and gradients on
the host between uses) + ``HostAdamW(placement=...)`` + the placement's clipping, against the resident
HF + PEFT model + ``torch.optim.AdamW`` + ``clip_grad_norm_``; ``torch.equal`` on every loss, LoRA tensor
and AdamW state tensor. Then hypothesis-drawn optimizer settings, where the tensors are between and
during steps (a placement that kept them on the device fails), resume through PorosTrainer, refusals.
"""

from __future__ import annotations

import pathlib
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import poros
from poros.errors import ConfigError
from poros.stream import lora_placement
from poros.stream.host_optimizer import HostAdamW, adamw
from poros.stream.options import StreamOptions
from poros.testing import load_qlora, save_tiny_checkpoint
from test_host_optimizer import FAMILIES, FLAGS, assert_same
from test_layer_major import CASES, resident_steps, setups, with_item_counts
from test_parity import make_batch, trainable


def steps_of(seed, steps=2, accumulation=2):
    return [with_item_counts([make_batch(seed + 10 * s + m, 2, 12, "left") for m in range(accumulation)])
            for s in range(steps)]


def placed_run(streamed, steps, *, max_grad_norm=0.5, chunk_bytes=4096, between=None, **options):
    parameters = streamed.trainable_parameters()
    optimizer = HostAdamW(parameters, **{"lr": 1e-2, **options}, chunk_bytes=chunk_bytes,
                          placement=streamed.lora_placement)
    losses = []
    for micro_batches in steps:
        losses.extend(streamed.forward_backward(micro_batches))
        if max_grad_norm is not None:
            lora_placement.clip_grad_norm_(parameters, max_grad_norm, streamed.device)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if between is not None:
            between(streamed)
    return losses, optimizer


def assert_at_home(streamed):
    """Between steps every streamed block's LoRA tensor is bound to its host tensor, none to a device copy."""
    placement = streamed.lora_placement
    assert not placement.on_device
    travelling = [p for p in streamed.trainable_parameters() if placement.travels(p)]
    assert travelling
    for parameter in travelling:
        assert parameter.data_ptr() == placement.home(parameter).data_ptr()
        assert parameter.grad is None


@pytest.mark.parametrize(("family", "variant"), FAMILIES, ids=[f"{f}-{v}" for f, v in FAMILIES])
def test_lora_on_the_host_is_bitwise_resident_with_clipping_and_accumulation(family, variant, tmp_path):
    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt", family, variant, seed=5)
    steps = steps_of(5)
    reference = load_qlora(checkpoint, seed=5)
    ref_losses, ref_opt = resident_steps(reference, steps, max_grad_norm=0.5)

    model = load_qlora(checkpoint, seed=5)
    streamed = poros.prepare(model, lora_placement="host")
    losses, opt = placed_run(streamed, steps, between=assert_at_home)
    assert_same(reference, ref_opt, model, opt, ref_losses, losses)
    # each block's adapters came in for its forward and its backward, and their gradients went back once a step
    placement = streamed.lora_placement
    assert placement.stats["grads_out"] == len(steps) * sum(len(ps) for ps in placement.parameters.values())


@pytest.mark.parametrize(("family", "variant"), CASES, ids=[f"{f}-{v}" for f, v in CASES])
def test_drawn_setups_of_every_variant_are_bitwise(family, variant):
    """Hypothesis draws the model config, M micro-batches, padding, rank, steps, the boundary states'
    placement and the clipping threshold, per family and variant."""
    @settings(max_examples=2, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(setup=setups(family, variant), boundary=st.sampled_from(["device", "host"]),
           max_grad_norm=st.sampled_from([None, 0.05]))
    def check(setup, boundary, max_grad_norm):
        with tempfile.TemporaryDirectory() as directory:
            try:
                path = save_tiny_checkpoint(pathlib.Path(directory) / "ckpt", family, variant, seed=setup["seed"],
                                            **setup["config"])
            except ValueError:
                assume(False)
            lora = {"lora_rank": setup["lora_rank"], "lora_alpha": 16, "seed": setup["seed"]}
            steps = [with_item_counts([make_batch(setup["seed"] + 10 * s + m, setup["batch"], setup["seq"],
                                                 setup["padding"]) for m in range(setup["micro_batches"])])
                     for s in range(setup["steps"])]
            reference = load_qlora(path, **lora)
            ref_losses, ref_opt = resident_steps(reference, steps, max_grad_norm=max_grad_norm)
            model = load_qlora(path, **lora)
            streamed = poros.prepare(model, lora_placement="host", boundary_states=boundary)
            losses, opt = placed_run(streamed, steps, max_grad_norm=max_grad_norm, between=assert_at_home)
            assert_same(reference, ref_opt, model, opt, ref_losses, losses)

    check()


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("lorahost") / "ckpt", "qwen3", seed=9, num_layers=3)


def test_the_tensors_travel_with_their_block(qwen3):
    """While block j computes, its adapters are device copies and every evicted block's are at home:
    a placement that left the adapters on the device (or never brought them in) fails here."""
    streamed = poros.prepare(load_qlora(qwen3, seed=9), lora_placement="host")
    placement, store = streamed.lora_placement, streamed.store
    seen = []

    def note(index):
        def hook(module, args):
            own = placement.parameters[index]
            assert all(p.data_ptr() != placement.home(p).data_ptr() for p in own)
            for other, parameters in placement.parameters.items():
                if not store.is_resident(other):
                    assert all(p.data_ptr() == placement.home(p).data_ptr() for p in parameters)
            seen.append(index)
        return hook

    handles = [layer.register_forward_pre_hook(note(i)) for i, layer in enumerate(streamed.executor.layers)]
    try:
        placed_run(streamed, steps_of(3, steps=1, accumulation=2), between=assert_at_home)
    finally:
        for handle in handles:
            handle.remove()
    assert sorted(set(seen)) == [0, 1, 2]
    # with gradients accumulated on the host (a second forward_backward before the step) they come back in
    parameters = streamed.trainable_parameters()
    batches = steps_of(4, steps=1, accumulation=2)[0]
    streamed.forward_backward(batches[:1])
    first = {id(p): p.grad.clone() for p in parameters}
    streamed.forward_backward(batches[1:])
    assert all(p.grad.device.type == "cpu" and not torch.equal(p.grad, first[id(p)]) for p in parameters)


def test_resident_blocks_keep_their_adapters_on_the_device_and_unpatch_restores(qwen3):
    model = load_qlora(qwen3, seed=9)
    reference = load_qlora(qwen3, seed=9)
    steps = steps_of(6)
    ref_losses, ref_opt = resident_steps(reference, steps, max_grad_norm=0.5)
    streamed = poros.prepare(model, lora_placement="host", resident_blocks=1)
    placement = streamed.lora_placement
    assert sorted(placement.parameters) == [0, 1]  # block 2 is resident: its adapters stay where they are
    losses, opt = placed_run(streamed, steps)
    assert_same(reference, ref_opt, model, opt, ref_losses, losses)
    streamed.unpatch()
    assert not placement.parameters and placement not in streamed.__dict__.values()


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(hyper=st.fixed_dictionaries({
    "lr": st.sampled_from([1e-3, 2e-2]), "weight_decay": st.sampled_from([0.0, 0.1]),
    "amsgrad": st.booleans(), "maximize": st.booleans()}),
    kernels=st.sampled_from(FLAGS), chunk_bytes=st.sampled_from([1, 3000, 1 << 30]),
    max_grad_norm=st.sampled_from([None, 0.05, 1.0]), accumulation=st.integers(1, 3))
def test_drawn_optimizer_settings_are_bitwise(qwen3, hyper, kernels, chunk_bytes, max_grad_norm, accumulation):
    steps = steps_of(7, steps=2, accumulation=accumulation)
    reference = load_qlora(qwen3, seed=9)
    ref_losses, ref_opt = resident_steps(reference, steps, max_grad_norm=max_grad_norm, **hyper, **kernels)
    model = load_qlora(qwen3, seed=9)
    streamed = poros.prepare(model, lora_placement="host")
    losses, opt = placed_run(streamed, steps, max_grad_norm=max_grad_norm, chunk_bytes=chunk_bytes,
                             between=assert_at_home, **hyper, **kernels)
    assert_same(reference, ref_opt, model, opt, ref_losses, losses)


def test_the_norm_is_torchs(qwen3):
    """``grad_norm`` / ``clip_grad_norm_`` return torch's total norm and scale exactly as torch does."""
    model = load_qlora(qwen3, seed=9)
    for batch in steps_of(8, steps=1)[0]:
        model(**batch, use_cache=False).loss.backward()
    parameters = list(trainable(model).values())
    copies = [torch.nn.Parameter(p.detach().clone()) for p in parameters]
    for copy, parameter in zip(copies, parameters):
        copy.grad = parameter.grad.clone()
    assert torch.equal(lora_placement.grad_norm(parameters, "cpu", chunk_bytes=1),
                       torch.nn.utils.get_total_norm([p.grad for p in copies]))
    expected = torch.nn.utils.clip_grad_norm_(copies, 0.01)
    assert torch.equal(lora_placement.clip_grad_norm_(parameters, 0.01, "cpu", chunk_bytes=5000), expected)
    assert all(torch.equal(p.grad, c.grad) for p, c in zip(parameters, copies))


# -- what it refuses ---------------------------------------------------------------------------------
def test_a_forward_with_grad_outside_layer_major_is_refused(qwen3):
    streamed = poros.prepare(load_qlora(qwen3, seed=9), lora_placement="host")
    batch = make_batch(1, 1, 8, "none")
    with pytest.raises(ConfigError, match="layer-major"):
        streamed(**batch, use_cache=False)
    with torch.no_grad():  # evaluation and generation are fine: the adapters come in with their block
        logits = streamed(**batch, use_cache=False).logits
    reference = load_qlora(qwen3, seed=9)
    with torch.no_grad():
        assert torch.equal(logits, reference(**batch, use_cache=False).logits)
    assert_at_home(streamed)
    with pytest.raises(ConfigError, match="optimizer_states='host'"):
        adamw(streamed.trainable_parameters(), optimizer_states="device", placement=streamed.lora_placement)
    with pytest.raises(ConfigError, match="lora_placement='sideways'"):
        poros.prepare(load_qlora(qwen3, seed=9), lora_placement="sideways")


def test_data_parallel_is_refused(qwen3, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="data-parallel"):
        poros.prepare(load_qlora(qwen3, seed=9), lora_placement="host")


def test_the_config_refuses_what_the_placement_does_not_support():
    with pytest.raises(ConfigError, match="optimizer_states"):
        poros.PorosConfig(lora_placement="host", optimizer_states="device")
    with pytest.raises(ConfigError, match="layer-major"):
        poros.PorosConfig(lora_placement="host", stream_schedule="micro-major")
    with pytest.raises(ConfigError, match="layer-major"):
        poros.PorosConfig(lora_placement="host", lora_dropout=0.1)
    assert poros.PorosConfig(lora_placement="host").lora_placement == "host"


# -- PorosTrainer: the config field, clipping in the loop, checkpoint and resume ---------------------
TRAIN = dict(steps=4, seq_len=32, batch_size=1, grad_accum=2, lr=2e-2, max_grad_norm=0.5, logging_steps=2, seed=3,
             save_steps=2)


def test_trainer_with_lora_on_the_host_is_bitwise_and_resumes_bitwise(tmp_path):
    import json

    import transformers

    from poros.assets import asset_path
    from poros.training.trainer import PorosTrainer
    from test_trainer import adapters, assert_same_training_state, optimizer_states

    tokenizer = transformers.AutoTokenizer.from_pretrained(asset_path("poros-tiny-qwen3"))
    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt", "qwen3", seed=5, vocab_size=len(tokenizer))
    tokenizer.save_pretrained(checkpoint)
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"{i} plus {i + 3}?"},
                                                     {"role": "assistant", "content": f"It is {2 * i + 3}." * (1 + i % 3)}]})
                            + "\n" for i in range(16)))

    def trainer(placement, name):
        return PorosTrainer.from_pretrained(checkpoint, lora_rank=4, lora_alpha=8, seed=3,
                                            output_dir=str(tmp_path / name), lora_placement=placement)

    resident = trainer("device", "resident")
    expected = resident.train(data, **TRAIN)
    assert type(resident.optimizer).__name__ == "AdamW" and resident.model.lora_placement is None
    named = adapters(resident.model)
    expected_states = optimizer_states(resident.optimizer, named)

    placed = trainer("host", "placed")
    result = placed.train(data, **TRAIN)
    assert isinstance(placed.optimizer, HostAdamW) and placed.optimizer.placement is placed.model.lora_placement
    assert result.losses == expected.losses  # float(float32) is exact: torch.equal on the losses
    assert [row["grad_norm"] for row in result.log_history] == [row["grad_norm"] for row in expected.log_history]
    assert_same_training_state(named, expected_states, placed.model, placed.optimizer)
    assert_at_home(placed.model)

    resumed = trainer("host", "resumed")
    again = resumed.train(data, resume_from=tmp_path / "placed" / "checkpoint-2", **TRAIN)
    assert again.losses == expected.losses
    assert_same_training_state(named, expected_states, resumed.model, resumed.optimizer)
    assert_at_home(resumed.model)


# -- the planner ---------------------------------------------------------------------------------------
def test_the_planner_moves_the_lora_tensors_to_the_host_only_when_the_ring_does_not_fit_with_them():
    from poros.plan import budget as planner
    from poros.plan.budget import Footprint, Workload

    mib = 2**20  # the LoRA tensors larger than a block's share, as r16 all-linear at 72B against small cards
    fp = Footprint(block_bytes=(100 * mib,) * 8, device_non_block_bytes=500 * mib, host_embedding_bytes=0,
                   lora_parameter_bytes=800 * mib, boundary_bytes=10 * mib, recompute_bytes=50 * mib,
                   head_bytes=200 * mib)
    workload = Workload(grad_accum=2, schedule="layer-major")
    states_host = planner.minimum_budget(fp, workload, optimizer_states="host")
    lora_host = planner.minimum_budget(fp, workload, optimizer_states="host", lora_placement="auto")
    assert lora_host < states_host
    on_host = planner.predict_peak(fp, workload, optimizer_on_host=True, lora_on_host=True)
    on_device = planner.predict_peak(fp, workload, optimizer_on_host=True)
    persistent = dict(on_host.persistent)
    assert persistent["LoRA parameters of the blocks in the 2 slots (the rest on the host)"] == 2 * 100 * mib
    if on_host.phase == "block recompute and backward":  # the block in backward holds its gradients, no other
        assert dict(on_host.transient)["LoRA gradients"] == 100 * mib
    assert persistent["LoRA parameters (AdamW state on the host)"] == 0  # every adapter is in a streamed block
    assert on_host.total < on_device.total
    # 'auto': on the device while the two-slot ring fits with them there; below that, on the host
    # (the boundary states go to the host first: the ring is priced with them there)
    ring = planner.plan_budget(fp, workload, StreamOptions(vram_budget=10**12, optimizer_states="host",
                                                            boundary_states="host")).pipelined_minimum_bytes
    roomy = planner.plan_budget(fp, workload, StreamOptions(vram_budget=ring, optimizer_states="host",
                                                             lora_placement="auto"))
    assert roomy.lora_placement == "device"
    tight = planner.plan_budget(fp, workload, StreamOptions(vram_budget=ring - 1, optimizer_states="host",
                                                             lora_placement="auto"))
    assert tight.lora_placement == "host" and tight.num_slots == 2 and tight.resident_blocks == ()
    assert "LoRA parameters and gradients on the host" in " ".join(tight.notes)
    assert "LoRA tensors on the host" in tight.summary() and tight.to_dict()["lora_placement"] == "host"
    # never with AdamW's state on the device or micro-major; 'host' there is refused
    micro_major = Workload(grad_accum=2)  # at its minimum the ring does not fit, yet the LoRA tensors stay
    least = planner.minimum_budget(fp, micro_major, optimizer_states="host", lora_placement="auto")
    assert least == planner.minimum_budget(fp, micro_major, optimizer_states="host")
    assert planner.plan_budget(fp, micro_major, StreamOptions(vram_budget=least, optimizer_states="host",
                                                               lora_placement="auto")).lora_placement == "device"
    assert planner.plan_budget(fp, workload, StreamOptions(vram_budget=ring - 1, optimizer_states="auto",
                                                            lora_placement="auto")).lora_placement == "host"
    with pytest.raises(ConfigError, match="lora_placement='host' needs"):
        planner.plan_budget(fp, Workload(), StreamOptions(vram_budget=10**12, optimizer_states="host",
                                                          lora_placement="host"))
    with pytest.raises(ConfigError, match="lora_placement='elsewhere'"):
        planner.plan_budget(fp, workload, StreamOptions(vram_budget=10**12, optimizer_states="host",
                                                        lora_placement="elsewhere"))


def test_poros_plan_chooses_the_host_when_the_budget_needs_it_and_prepare_applies_it(tmp_path, capsys):
    """``poros plan`` plans from config.json alone: a Qwen3 shape whose r128 adapters (~0.5 GB) outweigh
    HostAdamW's chunks in flight, as at 72B on a small card."""
    import json

    from poros.cli.main import main
    from poros.plan import budget as planner

    directory = tmp_path / "shape"
    directory.mkdir()
    config = json.loads((save_tiny_checkpoint(tmp_path / "ckpt", "qwen3", seed=1) / "config.json").read_text())
    config.update(hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_attention_heads=16,
                  num_key_value_heads=4, head_dim=128, layer_types=["full_attention"] * 24)
    (directory / "config.json").write_text(json.dumps(config))
    base = ["plan", "--model", str(directory), "--device", "cpu", "--seq-len", "64", "--grad-accum", "2",
            "--lora-rank", "128", "--optimizer-states", "host"]

    def plan(*argv):
        assert main([*base, "--json", *argv]) == 0
        out = json.loads(capsys.readouterr().out)
        return out["plan"], out["footprint"]

    roomy, footprint = plan("--vram-budget", "64GiB")
    assert roomy["lora_placement"] == "device"
    footprint = planner.Footprint(**{**footprint, "block_bytes": tuple(footprint["block_bytes"])})
    ring = planner.plan_budget(footprint, planner.Workload(1, 64, 2, "layer-major"), StreamOptions(
        vram_budget=10**12, optimizer_states="host", boundary_states="host")).pipelined_minimum_bytes  # boundary first
    tight, _ = plan("--vram-budget", str(ring - 1))
    assert tight["lora_placement"] == "host" and tight["num_slots"] == 2
    assert plan("--vram-budget", str(ring - 1), "--lora-placement", "device")[0]["num_slots"] == 1
    assert main([*base, "--vram-budget", str(ring - 1)]) == 0
    table = capsys.readouterr().out
    assert "LoRA tensors" in table and "host; pinned, each block's with its block" in table

    # prepare(vram_budget=...) applies the plan's placement (asked for here: at a tiny shape the chunks
    # in flight outweigh the adapters, so 'auto' keeps them on the device), and training stays bitwise
    checkpoint = save_tiny_checkpoint(tmp_path / "tiny", "qwen3", seed=1, num_layers=3)
    workload = {"batch_size": 2, "seq_len": 12, "grad_accum": 2, "schedule": "layer-major"}
    roomy = poros.prepare(load_qlora(checkpoint, seed=1), vram_budget="1GiB", workload=workload,
                          optimizer_states="host", lora_placement="host").budget_plan
    assert roomy.lora_placement == "device" and len(roomy.resident_blocks) == 3  # all resident: nothing travels
    streamed = poros.prepare(load_qlora(checkpoint, seed=1), vram_budget=roomy.pipelined_minimum_bytes,
                             workload=workload, optimizer_states="host", lora_placement="host")
    assert streamed.budget_plan.lora_placement == "host" and streamed.budget_plan.resident_blocks == ()
    assert sorted(streamed.lora_placement.parameters) == [0, 1, 2]
    kept = poros.prepare(load_qlora(checkpoint, seed=1), vram_budget="1GiB", workload=workload,
                         optimizer_states="host", lora_placement="auto")
    assert kept.budget_plan.lora_placement == "device" and kept.lora_placement is None
    steps = steps_of(2)
    reference = load_qlora(checkpoint, seed=1)
    ref_losses, ref_opt = resident_steps(reference, steps, max_grad_norm=0.5)
    losses, opt = placed_run(streamed, steps, between=assert_at_home)
    assert_same(reference, ref_opt, streamed, opt, ref_losses, losses)


# -- tools/bench/harness.py --------------------------------------------------------------------------------------
def test_bench_runs_the_poros_arm_with_the_lora_tensors_on_the_host(tmp_path, child_env):
    """The bench's CPU dry run of the small-card setup: layer-major, HostAdamW, LoRA on the host; bitwise. The arms'
    snapshots go to files (``--snapshot-dir``, what the 122B expert-LoRA run needs on a 125 GB host): the parity
    check reads them back memory-mapped and still finds every tensor."""
    import json
    import pathlib
    import subprocess
    import sys

    report_path = tmp_path / "bench.json"
    command = [sys.executable, "-m", "tools.bench", "--model", "tiny", "--steps", "2", "--warmup", "1", "--arms",
               "resident,poros", "--optimizer-states", "host", "--lora-placement", "host", "--grad-accum", "2",
               "--schedule", "layer-major", "--deterministic", "--device", "cpu", "--json", str(report_path),
               "--snapshot-dir", str(tmp_path / "snapshots")]
    done = subprocess.run(command, cwd=pathlib.Path(__file__).resolve().parents[1],
                          env=child_env(POROS_COMMIT="test", OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    written = sorted(p.name.split("-")[0] for p in (tmp_path / "snapshots").glob("*.pt"))
    assert written.count("lora") == 3 and written.count("adamw") == 2  # the start, then each arm's
    report = json.loads(report_path.read_text())
    assert report["config"]["lora_placement"] == "host" and report["arms"]["poros"]["status"] == "ok"
    assert report["arms"]["poros"]["lora_placement"] == "host"  # prepare applied it
    comparison = report["comparison"]
    assert comparison["bitwise"] is True and comparison["adapter_tensors"] == 2 * 7 * 2
    assert "(bitwise, 28 LoRA tensors, 84 AdamW state tensors)" in done.stdout


def test_bench_arms_after_the_poros_arm_compute_the_loss_in_its_chunks(tmp_path, child_env):
    """A chunked loss sums in another order than HF's, so it is bitwise only against a run with the same chunks: the
    bench's resident arm computes its loss in the chunks the Poros arm ran with (given, or raised by a budget plan;
    with a budget the Poros arm runs first). On the H100 a 6 GB plan raised them to 2 and the unchunked resident arm
    differed from the first micro-batch's loss on (docs/results-h200-log.md, 2026-12-07). And the resident arm runs
    HF's gradient checkpointing, as the model was built, though the Poros arm before it turned it off."""
    import json
    import pathlib
    import subprocess
    import sys

    report_path = tmp_path / "bench.json"
    command = [sys.executable, "-m", "tools.bench", "--model", "tiny", "--steps", "2", "--warmup", "1", "--arms",
               "resident,poros", "--grad-accum", "2", "--schedule", "layer-major", "--deterministic", "--device",
               "cpu", "--loss-chunks", "3", "--vram-budget", "1GiB", "--json", str(report_path)]
    done = subprocess.run(command, cwd=pathlib.Path(__file__).resolve().parents[1],
                          env=child_env(POROS_COMMIT="test", OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(report_path.read_text())
    arms = report["arms"]
    assert arms["poros"]["loss_chunks"] == arms["resident"]["loss_chunks"] == 3
    assert list(arms) == ["poros", "resident"]  # with a budget the Poros arm ran first
    assert arms["resident"]["gradient_checkpointing"] is True  # HF's, back on after the Poros arm turned it off
    assert report["comparison"]["bitwise"] is True


def test_the_trainer_feeds_the_store_device_not_the_adapters_home(qwen3):
    """With the adapters at home on the host, the first trainable parameter is a host tensor: the trainer's
    inputs must still go to the device the blocks compute on (on the H200 they went to the host, and the
    device embedding table's lookup failed: ``index is on cpu``)."""
    from poros.devices import compute_device

    streamed = poros.prepare(load_qlora(qwen3, seed=9), lora_placement="host")
    assert streamed.poros_compute_device == streamed.store.device
    marked = torch.nn.Linear(2, 2)
    marked.poros_compute_device = torch.device("meta")  # what poros.from_pretrained and a streamed model carry
    assert compute_device(marked) == torch.device("meta")
    assert compute_device(streamed) == streamed.store.device
