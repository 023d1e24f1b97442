"""HostAdamW (optimizer state in host memory, stepped a chunk at a time) is bit for bit torch's AdamW.

For every family: the streamed model + HostAdamW against the resident HF + PEFT model + torch.optim.AdamW,
with gradient accumulation and ``clip_grad_norm_``, ``torch.equal`` on every loss, LoRA tensor and
optimizer state tensor (``step`` included); then a resume through ``state_dict`` in both directions.
"""

from __future__ import annotations

import io

import pytest
import torch

import poros
from poros.stream.host_optimizer import HostAdamW
from poros.testing import TINY_VARIANTS, load_qlora, save_tiny_checkpoint
from test_parity import make_batch, trainable

FAMILIES = [(family, variants[0]) for family, variants in TINY_VARIANTS.items()] + [("gemma4", "moe")]
#: torch.optim.AdamW's kernel choices that run on CPU: the default (for-loop on CPU), foreach, fused.
FLAGS = [{}, {"foreach": True}, {"fused": True}]


def run_steps(model, optimizer, parameters, micro_batches, *, max_grad_norm=0.5):
    """HF Trainer's step: accumulate the micro-batches, clip, step, zero."""
    losses = []
    for batches in micro_batches:
        total = 0
        for batch in batches:
            loss = model(**batch, use_cache=False).loss / len(batches)
            loss.backward()
            total = total + loss.detach()
        torch.nn.utils.clip_grad_norm_(parameters, max_grad_norm)
        optimizer.step()
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
        assert ref_state.keys() == state.keys() == {"step", "exp_avg", "exp_avg_sq"}
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
