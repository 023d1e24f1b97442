"""loss_chunks: the chunked causal-LM loss is bitwise a resident run with the same chunked loss (every
family, accumulation, clipping), and only numerically HF's default loss."""

from __future__ import annotations

import pytest
import torch

import poros
from poros.errors import ConfigError
from poros.stream.chunked_loss import chunk_bounds, use_chunked_loss
from poros.testing import load_qlora, save_tiny_checkpoint
from test_host_optimizer import FAMILIES, assert_same, run_steps, steps_of
from test_parity import trainable


def in_graph(loss: torch.Tensor, node_name: str) -> bool:
    """True when an autograd node of class ``node_name`` is in ``loss``'s graph."""
    seen, todo = set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == node_name:
            return True
        todo.extend(next_node for next_node, _ in node.next_functions)
    return False


def computed_chunked(loss: torch.Tensor) -> bool:
    """True when the chunked loss's autograd node is in ``loss``'s graph (the loss really went through it)."""
    return in_graph(loss, "_ChunkedCrossEntropySumBackward")


@pytest.mark.parametrize(("family", "variant"), FAMILIES, ids=[f"{f}-{v}" for f, v in FAMILIES])
def test_streamed_chunked_loss_is_bitwise_a_resident_run_with_the_same_chunked_loss(family, variant, tmp_path):
    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt", family, variant, seed=4)
    micro_batches = steps_of(4)
    reference = load_qlora(checkpoint, seed=4)
    use_chunked_loss(reference, 3)
    ref_params = list(trainable(reference).values())
    ref_opt = torch.optim.AdamW(ref_params, lr=1e-2)
    ref_losses = run_steps(reference, ref_opt, ref_params, micro_batches)

    streamed = poros.prepare(load_qlora(checkpoint, seed=4))
    use_chunked_loss(streamed, 3)
    assert computed_chunked(streamed(**micro_batches[0][0], use_cache=False).loss)
    parameters = streamed.trainable_parameters()
    opt = torch.optim.AdamW(parameters, lr=1e-2)
    losses = run_steps(streamed, opt, parameters, micro_batches)
    assert_same(reference, ref_opt, streamed, opt, ref_losses, losses)


def test_chunked_loss_is_numerically_hfs_default_loss_and_removable(tmp_path):
    """The documented numerical claim: same per-token kernels, another summation order."""
    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt", "qwen3", seed=2)
    model = load_qlora(checkpoint, seed=2)
    batch = steps_of(2, steps=1, accumulation=1)[0][0]

    def loss_and_grads(chunked: bool):
        loss = model(**batch, use_cache=False).loss
        assert computed_chunked(loss) == chunked
        grads = torch.autograd.grad(loss, list(trainable(model).values()))
        return loss.detach(), grads

    default_loss, default_grads = loss_and_grads(False)
    handle = use_chunked_loss(model, 5)
    chunked_loss, chunked_grads = loss_and_grads(True)
    torch.testing.assert_close(chunked_loss, default_loss, rtol=1e-6, atol=0)
    for chunked, default in zip(chunked_grads, default_grads):
        torch.testing.assert_close(chunked, default, rtol=1e-4, atol=1e-6)
    handle.remove()
    assert torch.equal(loss_and_grads(False)[0], default_loss)  # HF's own loss again
    assert "_loss_function" not in model.get_base_model().__dict__


def test_one_chunk_installs_nothing_and_bad_values_are_refused(tmp_path):
    model = load_qlora(save_tiny_checkpoint(tmp_path / "ckpt", "qwen3", seed=2), seed=2)
    use_chunked_loss(model, 1)
    assert "_loss_function" not in model.get_base_model().__dict__
    with pytest.raises(ConfigError, match="loss_chunks=0"):
        use_chunked_loss(model, 0)
    assert chunk_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)] and chunk_bounds(2, 5) == [(0, 1), (1, 2)]


def test_the_planner_counts_one_chunk_of_the_head_and_loss(tmp_path):
    from poros.config import PorosConfig
    from poros.training.plan import plan_run
    from poros.stream import planner
    from poros.stream.footprint import LOSS_BYTES_PER_LOGIT

    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt", "qwen3", seed=2)
    plans = {n: plan_run(PorosConfig(model=str(checkpoint), device="cpu", seq_len=64, loss_chunks=n))
             for n in (1, 4)}
    logits = 64 * plans[1].vocab_size
    value = plans[1].activation_bytes_per_value
    assert plans[1].logits_bytes == logits * (value + LOSS_BYTES_PER_LOGIT)
    # the chunked head (issue 32): one chunk's logits and their gradient, and its fp32 working set
    assert plans[4].logits_bytes == -(-logits // 4) * (2 * value + LOSS_BYTES_PER_LOGIT)
    assert planner.Workload(loss_chunks=4).loss_chunks == 4
    with pytest.raises(ConfigError, match="loss_chunks=0"):
        planner.Workload(loss_chunks=0)
