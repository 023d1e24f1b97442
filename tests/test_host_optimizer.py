"""HostAdamW (optimizer state in host memory, stepped a chunk at a time) is bit for bit torch's AdamW.

For every family: the streamed model + HostAdamW against the resident HF + PEFT model + torch.optim.AdamW,
with gradient accumulation and ``clip_grad_norm_``, ``torch.equal`` on every loss, LoRA tensor and
optimizer state tensor (``step`` included); then a resume through ``state_dict`` in both directions.
"""

from __future__ import annotations

import io

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import poros
from poros.stream.host_optimizer import HostAdamW
from poros.testing import TINY_VARIANTS, load_qlora, save_tiny_checkpoint
from test_parity import make_batch, trainable

FAMILIES = [(family, variants[0]) for family, variants in TINY_VARIANTS.items()] + [("gemma4", "moe")]
#: torch.optim.AdamW's kernel choices that run on CPU: the default (for-loop on CPU), foreach, fused.
FLAGS = [{}, {"foreach": True}, {"fused": True}]


def run_steps(model, optimizer, parameters, micro_batches, *, max_grad_norm=0.5, scheduler=None):
    """HF Trainer's step: accumulate the micro-batches, clip, step, zero."""
    losses = []
    for batches in micro_batches:
        total = 0
        for batch in batches:
            loss = model(**batch, use_cache=False).loss / len(batches)
            loss.backward()
            total = total + loss.detach()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(parameters, max_grad_norm)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    return losses


def assert_same(reference, ref_opt, model, opt, ref_losses, losses):
    assert len(ref_losses) == len(losses)
    for a, b in zip(ref_losses, losses):
        assert torch.equal(a, b)
    ref_params, params = trainable(reference), trainable(model)
    assert ref_params.keys() == params.keys() and ref_params
    for name in ref_params:
        assert torch.equal(ref_params[name], params[name]), name
        ref_state, state = ref_opt.state[ref_params[name]], opt.state[params[name]]
        assert ref_state.keys() == state.keys() and {"step", "exp_avg", "exp_avg_sq"} <= state.keys()
        for key in ref_state:
            assert ref_state[key].dtype == state[key].dtype, (name, key)
            assert torch.equal(ref_state[key].cpu(), state[key].cpu()), (name, key)


def steps_of(seed, steps=2, accumulation=2):
    return [[make_batch(seed + 10 * s + m, 2, 12, "left") for m in range(accumulation)] for s in range(steps)]


@pytest.mark.parametrize(("family", "variant"), FAMILIES, ids=[f"{f}-{v}" for f, v in FAMILIES])
def test_streamed_model_with_host_optimizer_states_is_bitwise_resident(family, variant, tmp_path):
    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt", family, variant, seed=5)
    micro_batches = steps_of(5)
    reference = load_qlora(checkpoint, seed=5)
    ref_params = list(trainable(reference).values())
    ref_opt = torch.optim.AdamW(ref_params, lr=1e-2)
    ref_losses = run_steps(reference, ref_opt, ref_params, micro_batches)

    model = load_qlora(checkpoint, seed=5)
    streamed = poros.prepare(model)
    parameters = streamed.trainable_parameters()
    opt = HostAdamW(parameters, lr=1e-2, chunk_bytes=4096)  # many chunks on these tiny adapters
    losses = run_steps(streamed, opt, parameters, micro_batches)
    assert_same(reference, ref_opt, model, opt, ref_losses, losses)
    stepped = [opt.state[p]["exp_avg"] for p in parameters]
    assert all(value.data_ptr() not in {p.data_ptr() for p in parameters} for value in stepped)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("hostopt") / "ckpt", "qwen3", seed=9)


@pytest.mark.parametrize("flags", FLAGS, ids=["default", "foreach", "fused"])
@pytest.mark.parametrize("chunk_bytes", [1, 1 << 30], ids=["one-tensor-chunks", "one-chunk"])
def test_every_kernel_choice_and_chunking_is_bitwise(qwen3, flags, chunk_bytes):
    micro_batches = steps_of(1, steps=3)
    reference = load_qlora(qwen3, seed=9)
    ref_params = list(trainable(reference).values())
    ref_opt = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.1, **flags)
    ref_losses = run_steps(reference, ref_opt, ref_params, micro_batches)

    model = load_qlora(qwen3, seed=9)
    parameters = list(trainable(model).values())
    opt = HostAdamW(parameters, lr=1e-2, weight_decay=0.1, chunk_bytes=chunk_bytes, **flags)
    losses = run_steps(model, opt, parameters, micro_batches)
    assert_same(reference, ref_opt, model, opt, ref_losses, losses)


@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(hyper=st.fixed_dictionaries({
    "lr": st.sampled_from([1e-3, 2e-2]), "weight_decay": st.sampled_from([0.0, 0.1]),
    "betas": st.sampled_from([(0.9, 0.999), (0.8, 0.95)]), "eps": st.sampled_from([1e-8, 1e-6]),
    "amsgrad": st.booleans(), "maximize": st.booleans()}),
    kernels=st.sampled_from(FLAGS), chunk_bytes=st.sampled_from([1, 3000, 1 << 30]),
    max_grad_norm=st.sampled_from([None, 0.05, 1.0]), accumulation=st.integers(1, 3), decay_groups=st.booleans())
def test_drawn_hyperparameters_groups_and_chunkings_are_bitwise(qwen3, hyper, kernels, chunk_bytes, max_grad_norm,
                                                                accumulation, decay_groups):
    """Hypothesis draws AdamW's hyper-parameters and kernels, the chunking, clipping, accumulation, two
    param groups (HF Trainer's decay / no-decay split) and a schedule that changes lr between steps."""
    micro_batches = steps_of(7, steps=2, accumulation=accumulation)

    def run(optimizer_class, **options):
        model = load_qlora(qwen3, seed=9)
        parameters = list(trainable(model).values())
        groups = ([{"params": parameters[::2]}, {"params": parameters[1::2], "weight_decay": 0.0}]
                  if decay_groups else parameters)
        optimizer = optimizer_class(groups, **hyper, **kernels, **options)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        losses = run_steps(model, optimizer, parameters, micro_batches, max_grad_norm=max_grad_norm,
                           scheduler=scheduler)
        return model, optimizer, losses

    reference, ref_opt, ref_losses = run(torch.optim.AdamW)
    model, opt, losses = run(HostAdamW, chunk_bytes=chunk_bytes)
    assert_same(reference, ref_opt, model, opt, ref_losses, losses)


def saved(optimizer) -> dict:
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("flags", [{}, {"fused": True}], ids=["default", "fused"])
def test_resume_through_state_dict_either_way(qwen3, flags):
    """A HostAdamW checkpoint resumes a torch AdamW and the other way round, bit for bit."""
    micro_batches = steps_of(3, steps=4)
    reference = load_qlora(qwen3, seed=9)
    ref_params = list(trainable(reference).values())
    ref_opt = torch.optim.AdamW(ref_params, lr=1e-2, **flags)
    ref_losses = run_steps(reference, ref_opt, ref_params, micro_batches)

    model = load_qlora(qwen3, seed=9)
    parameters = list(trainable(model).values())
    first = HostAdamW(parameters, lr=1e-2, chunk_bytes=2048, **flags)
    losses = run_steps(model, first, parameters, micro_batches[:1])
    reference_format = saved(torch.optim.AdamW([torch.nn.Parameter(p.detach().clone()) for p in parameters],
                                               lr=1e-2, **flags))
    host_format = saved(first)
    assert host_format["param_groups"][0].keys() == reference_format["param_groups"][0].keys()

    resident = torch.optim.AdamW(parameters, lr=1e-2, **flags)  # a host checkpoint resumes torch's AdamW
    resident.load_state_dict(host_format)
    losses += run_steps(model, resident, parameters, micro_batches[1:2])
    second = HostAdamW(parameters, lr=1e-2, chunk_bytes=2048, **flags)  # and torch's resumes HostAdamW
    second.load_state_dict(saved(resident))
    losses += run_steps(model, second, parameters, micro_batches[2:3])
    third = HostAdamW.from_optimizer(second)
    losses += run_steps(model, third, parameters, micro_batches[3:])
    assert_same(reference, ref_opt, model, third, ref_losses, losses)
    assert saved(third)["state"].keys() == saved(ref_opt)["state"].keys()


# -- the planner ---------------------------------------------------------------------------------
def test_the_planner_moves_the_adamw_state_to_the_host_only_when_the_ring_does_not_fit_with_it_on_the_device():
    from poros.plan import budget as planner
    from poros.stream.options import StreamOptions
    from poros.plan.budget import Footprint, Workload

    def budget_options(vram_budget, **options) -> StreamOptions:  # AdamW's state on the device unless given
        return StreamOptions(vram_budget=vram_budget, **{"optimizer_states": "device", **options})

    mib = 2**20  # the LoRA state far larger than HostAdamW's chunks, as at real shapes
    fp = Footprint(block_bytes=(100 * mib,) * 4, device_non_block_bytes=500 * mib, host_embedding_bytes=0,
                   lora_parameter_bytes=400 * mib, boundary_bytes=10 * mib, recompute_bytes=50 * mib,
                   head_bytes=200 * mib)
    workload = Workload()
    device_minimum = planner.minimum_budget(fp, workload)
    host_minimum = planner.minimum_budget(fp, workload, optimizer_states="auto")
    assert host_minimum < device_minimum
    assert host_minimum == planner.minimum_budget(fp, workload, optimizer_states="host")
    on_host = planner.predict_peak(fp, workload, optimizer_on_host=True)
    on_device = planner.predict_peak(fp, workload)
    persistent = sum(n for _, n in on_device.persistent) - sum(n for _, n in on_host.persistent)
    assert persistent == 2 * 400 * mib  # exp_avg + exp_avg_sq off the device for the whole step
    in_flight = dict(on_host.transient)["AdamW state chunks in flight (3) + temporary"]
    assert in_flight == 3 * 32 * mib + 16 * mib < dict(on_device.transient)["AdamW temporary"]
    # 'auto': the state stays while the two-slot ring fits with it; below that, the host and the ring
    ring = planner.plan_budget(fp, workload, budget_options(10**12)).pipelined_minimum_bytes
    assert planner.plan_budget(fp, workload, budget_options(ring, optimizer_states="auto")).optimizer_states == "device"
    tight = planner.plan_budget(fp, workload, budget_options(ring - 1, optimizer_states="auto"))
    assert tight.optimizer_states == "host" and tight.num_slots == 2 and tight.resident_blocks == ()
    assert "AdamW state on the host" in " ".join(tight.notes) and "AdamW state on the host" in tight.summary()
    one_slot = planner.plan_budget(fp, workload, budget_options(ring - 1))  # asked for on the device: it stays
    assert one_slot.optimizer_states == "device" and one_slot.num_slots == 1
    with pytest.raises(poros.errors.ConfigError, match="below the minimum"):
        planner.plan_budget(fp, workload, budget_options(device_minimum - 1))
    auto = planner.plan_budget(fp, workload, budget_options(device_minimum - 1, optimizer_states="auto"))
    assert auto.needed_bytes < device_minimum
    with pytest.raises(poros.errors.ConfigError, match="below the minimum"):
        planner.plan_budget(fp, workload, budget_options(host_minimum - 1, optimizer_states="auto"))
    previous = -1  # with 'auto' too, a bigger budget never keeps fewer blocks resident, and every plan fits
    for budget in range(host_minimum, 2 * ring, (2 * ring - host_minimum) // 40):
        plan = planner.plan_budget(fp, workload, budget_options(budget, optimizer_states="auto"))
        assert plan.needed_bytes <= budget and len(plan.resident_blocks) >= previous, budget
        previous = len(plan.resident_blocks)
    assert planner.plan_budget(fp, workload, budget_options(10**12, optimizer_states="host")).optimizer_states == "host"
    with pytest.raises(poros.errors.ConfigError, match="optimizer_states='disk'"):
        planner.plan_budget(fp, workload, budget_options(10**12, optimizer_states="disk"))


def test_poros_plan_picks_host_optimizer_states_when_that_is_what_fits(tmp_path, capsys):
    import json

    from poros.cli.main import main

    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt", "qwen3", seed=1)
    base = ["plan", "--model", str(checkpoint), "--device", "cpu", "--seq-len", "64", "--json"]

    def plan(*argv):
        assert main([*base, *argv]) == 0
        return json.loads(capsys.readouterr().out)["plan"]

    roomy = plan("--vram-budget", "1GiB")
    assert roomy["optimizer_states"] == "device"
    tight = plan("--vram-budget", str(roomy["minimum_bytes"] - 1))
    assert tight["optimizer_states"] == "host" and tight["needed_bytes"] < roomy["minimum_bytes"]
    assert plan("--vram-budget", "1GiB", "--optimizer-states", "host")["optimizer_states"] == "host"


# -- PorosTrainer ----------------------------------------------------------------------------------
from test_trainer import (RESUME, assert_continues_uninterrupted, chat_file, new_trainer,  # noqa: E402,F401
                          qwen3_checkpoint, tokenizer, uninterrupted)


def test_poros_trainer_with_host_optimizer_states_trains_and_resumes_bitwise(uninterrupted, qwen3_checkpoint,
                                                                             chat_file, tmp_path):
    """optimizer_states='host': the same 4 steps (accumulation, clipping at max_grad_norm 1.0) as the
    device run; its checkpoint resumes the device optimizer and the device checkpoint resumes it."""
    from poros.training import checkpoint as checkpoints

    host = new_trainer(qwen3_checkpoint, tmp_path / "host")
    result = host.train(chat_file, save_steps=2, optimizer_states="host", **RESUME)
    assert isinstance(host.optimizer, HostAdamW) and host.run_config.max_grad_norm == 1.0
    assert_continues_uninterrupted(uninterrupted, host, result)

    resumed = new_trainer(qwen3_checkpoint, tmp_path / "device-from-host")
    result = resumed.train(chat_file, resume_from=tmp_path / "host" / "checkpoint-2", optimizer_states="device",
                           **RESUME)
    assert type(resumed.optimizer) is torch.optim.AdamW
    assert_continues_uninterrupted(uninterrupted, resumed, result)

    resumed = new_trainer(qwen3_checkpoint, tmp_path / "host-from-device")
    result = resumed.train(chat_file, resume_from=uninterrupted["output_dir"] / "checkpoint-2",
                           optimizer_states="host", **RESUME)
    assert isinstance(resumed.optimizer, HostAdamW)
    assert_continues_uninterrupted(uninterrupted, resumed, result)
    # the files: torch's AdamW state_dict either way, equal tensor for tensor
    written = checkpoints.read_checkpoint(tmp_path / "host" / "checkpoint-4").optimizer_state_dict()
    expected = checkpoints.read_checkpoint(uninterrupted["output_dir"] / "checkpoint-4").optimizer_state_dict()
    assert written["param_groups"] == expected["param_groups"] and written["state"].keys() == expected["state"].keys()
    for index, state in expected["state"].items():
        assert state.keys() == written["state"][index].keys()
        assert all(torch.equal(value, written["state"][index][key]) for key, value in state.items())


# -- HF Trainer ------------------------------------------------------------------------------------
@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused"])
def test_hf_trainer_with_host_adamw_is_bitwise_its_own_adamw(qwen3, optim, tmp_path):
    """HF Trainer (its decay groups, clipping at max_grad_norm 1.0, accumulation, a mid-run save and
    resume) with ``trainer.optimizer = HostAdamW.from_optimizer(trainer.create_optimizer())``."""
    import transformers

    from poros.testing import Rows

    rows = []
    for seed in range(12):
        batch = make_batch(seed, 1, 16, "none")
        rows.append({key: value[0] for key, value in batch.items()})

    def run(host: bool, output_dir, max_steps=3, resume=None):
        model = load_qlora(qwen3, seed=9)
        poros.patch_hf_model(model)
        args = transformers.TrainingArguments(
            output_dir=str(output_dir), max_steps=max_steps, per_device_train_batch_size=2,
            gradient_accumulation_steps=2, learning_rate=1e-2, weight_decay=0.1, lr_scheduler_type="linear",
            optim=optim, logging_steps=1, save_strategy="steps", save_steps=2, report_to=[], use_cpu=True, seed=11,
            data_seed=11, dataloader_num_workers=0, disable_tqdm=True)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=Rows(rows))
        if host:
            trainer.optimizer = HostAdamW.from_optimizer(trainer.create_optimizer(), chunk_bytes=4096)
        trainer.train(resume_from_checkpoint=resume)
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        return model, trainer.optimizer, losses

    reference, ref_opt, ref_losses = run(False, tmp_path / "resident")
    model, opt, losses = run(True, tmp_path / "host")
    assert isinstance(opt.optimizer, HostAdamW) and len(opt.optimizer.param_groups) == len(ref_opt.param_groups)
    assert losses == ref_losses and len(losses) == 3
    assert_same(reference, ref_opt, model, opt.optimizer, [], [])
    # resume the resident run's checkpoint-2 with HostAdamW: the same end state
    model, opt, _ = run(True, tmp_path / "host-resumed", resume=str(tmp_path / "resident" / "checkpoint-2"))
    assert_same(reference, ref_opt, model, opt.optimizer, [], [])
