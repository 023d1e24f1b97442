"""CUDA graphs under autocast (issue 30): the capture runs with the cast cache off instead of refusing
autocast. Capture needs CUDA; what a CPU can check is the decision (autocast with its cache on is no
longer a fallback, the graph key is the uncached state) and the claim the capture rests on: for every
family, a forward+backward under bf16 autocast gives the same bits with the cast cache off as on."""

from __future__ import annotations

import pytest
import torch

import poros
from conftest import BUILTIN_FAMILIES
from poros.stream.graphs import BlockGraphs
from poros.stream.replay import autocast_state, uncached
from poros.testing import load_qlora, save_tiny_checkpoint


def _forward_backward(model, batch, cache: bool):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache):
        loss = model(**batch).loss
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


@pytest.mark.parametrize("family", BUILTIN_FAMILIES)
def test_the_cast_cache_does_not_change_a_bit(tmp_path, family):
    """Every block's forward and backward under bf16 autocast: loss and every LoRA gradient are torch.equal
    with the cast cache off (what a graph capture runs) and on (eager's default)."""
    model = load_qlora(save_tiny_checkpoint(tmp_path / family, family), lora_rank=4, lora_alpha=8)
    assert any(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)  # the casts exist
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    loss_on, grads_on = _forward_backward(model, batch, cache=True)
    loss_off, grads_off = _forward_backward(model, batch, cache=False)
    assert torch.equal(loss_on, loss_off)
    assert grads_on.keys() == grads_off.keys() and grads_on
    for name, grad in grads_on.items():
        assert torch.equal(grad, grads_off[name]), name


def test_autocast_with_its_cache_on_is_not_a_fallback(tmp_path):
    model = load_qlora(save_tiny_checkpoint(tmp_path / "qwen3", "qwen3"), lora_rank=4, lora_alpha=8)
    streamed = poros.prepare(model)
    block_graphs = BlockGraphs(streamed.store, streamed.executor.layers)
    hidden = torch.zeros(1, 4, streamed.config.get_text_config().hidden_size)
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=True):
        assert torch.is_autocast_cache_enabled()
        assert block_graphs.eager_reason(0, [hidden]) is None


def test_the_capture_state_is_the_callers_with_the_cache_off():
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=True):
        state = autocast_state(torch.device("cpu"))
    captured = uncached(state)
    assert [kind for kind, _ in captured] == [kind for kind, _ in state]
    for (_, before), (_, after) in zip(state, captured):
        assert before["cache_enabled"] is True and after["cache_enabled"] is False
        assert {k: v for k, v in before.items() if k != "cache_enabled"} == \
            {k: v for k, v in after.items() if k != "cache_enabled"}
    assert uncached(None) is None
