"""loss_chunks: the chunked causal-LM head and loss are bitwise a resident run with the same chunks (every
family, accumulation, clipping, micro- and layer-major), only numerically HF's default loss, and never make the
whole logits (the head sees one token chunk at a time, forward and backward)."""

from __future__ import annotations

import pytest
import torch

import poros
from poros.errors import ConfigError
from poros.adapters import causal_lm_of
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
    """True when the chunked loss's autograd node is in ``loss``'s graph (the model's own forward's loss
    went through it: the fallback path of the chunked head)."""
    return in_graph(loss, "_ChunkedCrossEntropySumBackward")


class HeadRows:
    """The row counts of every ``lm_head`` output (forward and backward's recomputations) while installed."""

    def __init__(self, model) -> None:
        self.rows: list[int] = []
        head = causal_lm_of(model).get_output_embeddings()
        self.handle = head.register_forward_hook(lambda module, args, output: self.rows.append(
            output.reshape(-1, output.shape[-1]).shape[0]))

    def __enter__(self) -> "HeadRows":
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()


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
    with torch.no_grad():
        output = streamed(**micro_batches[0][0], use_cache=False)
    assert output.logits is None and not computed_chunked(output.loss)  # the head ran in chunks
    parameters = streamed.trainable_parameters()
    opt = torch.optim.AdamW(parameters, lr=1e-2)
    losses = run_steps(streamed, opt, parameters, micro_batches)
    assert_same(reference, ref_opt, streamed, opt, ref_losses, losses)


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])  # gemma3: the head soft-caps its logits
def test_chunked_loss_is_numerically_hfs_default_loss_and_removable(family, tmp_path):
    """The documented numerical claim: same per-token kernels, another summation order."""
    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt", family, seed=2)
    model = load_qlora(checkpoint, seed=2)
    batch = steps_of(2, steps=1, accumulation=1)[0][0]

    def loss_and_grads(chunked: bool):
        loss = model(**batch, use_cache=False).loss
        assert computed_chunked(loss) == chunked
        grads = torch.autograd.grad(loss, list(trainable(model).values()))
        return loss.detach(), grads

    default_loss, default_grads = loss_and_grads(False)
    handle = use_chunked_loss(model, 5)
    chunked_loss, chunked_grads = loss_and_grads(False)  # the head in chunks: the loss function is not called
    torch.testing.assert_close(chunked_loss, default_loss, rtol=1e-6, atol=0)
    for chunked, default in zip(chunked_grads, default_grads):
        torch.testing.assert_close(chunked, default, rtol=1e-4, atol=1e-6)
    handle.remove()
    assert torch.equal(loss_and_grads(False)[0], default_loss)  # HF's own loss again
    assert "_loss_function" not in model.get_base_model().__dict__
    assert "forward" not in model.get_base_model().__dict__  # the class's forward again


def test_one_chunk_installs_nothing_and_bad_values_are_refused(tmp_path):
    model = load_qlora(save_tiny_checkpoint(tmp_path / "ckpt", "qwen3", seed=2), seed=2)
    use_chunked_loss(model, 1)
    assert not {"_loss_function", "forward"} & set(model.get_base_model().__dict__)
    with pytest.raises(ConfigError, match="loss_chunks=0"):
        use_chunked_loss(model, 0)
    assert chunk_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)] and chunk_bounds(2, 5) == [(0, 1), (1, 2)]


def test_the_planner_counts_one_chunk_of_the_head_and_loss(tmp_path):
    from poros.config import PorosConfig
    from poros.plan.run_plan import plan_run
    from poros.plan import budget as planner
    from poros.plan.footprint import LOSS_BYTES_PER_LOGIT

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


@pytest.mark.parametrize(("family", "variant"), [("qwen3", "default"), ("gemma3", "default")])
def test_layer_major_steps_with_the_chunked_head_are_bitwise_the_resident_run(family, variant, tmp_path):
    """``forward_backward`` (the trunk's two calls: capture, then the head from the streamed hidden states)
    through the chunked head, against the resident model's per-micro-batch backward; Gemma soft-caps."""
    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt", family, variant, seed=6)
    micro_batches = steps_of(6, steps=1, accumulation=3)[0]
    reference = load_qlora(checkpoint, seed=6)
    use_chunked_loss(reference, 4)
    ref_losses = []
    for batch in micro_batches:
        loss = reference(**batch, use_cache=False).loss
        loss.backward()
        ref_losses.append(loss.detach())
    streamed = poros.prepare(load_qlora(checkpoint, seed=6), loss_chunks=4)
    losses = streamed.forward_backward(micro_batches)
    assert all(torch.equal(a, b) for a, b in zip(ref_losses, losses))
    for name, parameter in trainable(reference).items():
        assert torch.equal(parameter.grad, dict(streamed.named_parameters())[name].grad), name
    causal_lm = streamed.get_base_model()
    assert "forward" in causal_lm.__dict__
    streamed.unpatch()  # prepare installed the chunked head: unpatch takes it away with the rest
    assert not {"forward", "_loss_function"} & set(causal_lm.__dict__)


def test_the_whole_logits_never_exist(tmp_path):
    """Every ``lm_head`` call, in forward and in backward's recomputation, sees at most ceil(tokens / chunks)
    rows; the output carries no logits; without labels the model's own forward (whole logits) runs."""
    model = load_qlora(save_tiny_checkpoint(tmp_path / "ckpt", "gemma3", seed=3), seed=3)
    batch = steps_of(3, steps=1, accumulation=1)[0][0]
    tokens, chunks = batch["input_ids"].numel(), 5
    use_chunked_loss(model, chunks)
    with HeadRows(model) as head:
        output = model(**batch, use_cache=False)
        output.loss.backward()
    assert output.logits is None and len(head.rows) == 2 * chunks  # each chunk once forward, once backward
    assert max(head.rows) == -(-tokens // chunks) and sum(head.rows) == 2 * tokens
    with HeadRows(model) as head, torch.no_grad():
        plain = model(input_ids=batch["input_ids"], use_cache=False)
    assert plain.loss is None and plain.logits.shape[:2] == batch["input_ids"].shape and head.rows == [tokens]


def test_num_items_in_batch_shift_labels_and_tuples_keep_hfs_meaning(tmp_path):
    """HF's reductions through the chunked head: ``num_items_in_batch`` divides the sum, pre-shifted
    ``shift_labels`` are scored unshifted, ``return_dict=False`` gives the tuple (loss first)."""
    model = load_qlora(save_tiny_checkpoint(tmp_path / "ckpt", "qwen3", seed=2), seed=2)
    batch = steps_of(2, steps=1, accumulation=1)[0][0]
    labels = batch["labels"]
    with torch.no_grad():
        default = {n: model(**batch, use_cache=False, num_items_in_batch=n).loss for n in (None, 7)}
        use_chunked_loss(model, 3)
        chunked = {n: model(**batch, use_cache=False, num_items_in_batch=n).loss for n in (None, 7)}
        shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
        pre_shifted = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                            shift_labels=shifted, use_cache=False).loss
        as_tuple = model(**batch, use_cache=False, return_dict=False)
    for n in (None, 7):
        torch.testing.assert_close(chunked[n], default[n], rtol=1e-6, atol=0)
    assert torch.equal(pre_shifted, chunked[None]) and torch.equal(as_tuple[0], chunked[None])


def test_trls_fused_head_and_the_chunked_head_patch_in_either_order(tmp_path):
    """TRL's ``add_fused_lm_head`` (SFTTrainer adds it) and ours both patch the instance's forward: whichever
    came first, ``fused_lm_head=True`` is TRL's fused output and a plain call with labels is ours; removing
    ours leaves TRL's working."""
    trl_utils = pytest.importorskip("trl.trainer.utils")
    batch = steps_of(2, steps=1, accumulation=1)[0][0]
    for ours_first in (True, False):
        model = load_qlora(save_tiny_checkpoint(tmp_path / f"ckpt{ours_first}", "qwen3", seed=2), seed=2)
        with torch.no_grad():
            default = model(**batch, use_cache=False).loss
        if ours_first:
            handle = use_chunked_loss(model, 3)
        trl_utils.add_fused_lm_head(causal_lm_of(model))
        if not ours_first:
            handle = use_chunked_loss(model, 3)
        with torch.no_grad():
            fused = model(**batch, use_cache=False, fused_lm_head=True)
            ours = model(**batch, use_cache=False)
        assert fused.log_probs is not None and ours.logits is None
        torch.testing.assert_close(fused.loss, default, rtol=1e-5, atol=0)
        torch.testing.assert_close(ours.loss, default, rtol=1e-6, atol=0)
        handle.remove()
        with torch.no_grad():
            assert model(**batch, use_cache=False).logits is not None  # the model's own head again
            assert model(**batch, use_cache=False, fused_lm_head=True).log_probs is not None


@pytest.mark.parametrize("how", ["lora", "modules_to_save"])
def test_a_trainable_lm_head_gets_its_gradients_from_the_recomputed_chunks(how, tmp_path):
    """LoRA on ``lm_head`` or PEFT's ``modules_to_save`` copy of it: the chunked head's gradients are HF's
    default head's, numerically (the tolerance of the test above)."""
    from peft import LoraConfig, get_peft_model

    from poros.testing import tiny_model

    base = tiny_model("qwen3", seed=2, dtype=torch.float32)
    targets = ["q_proj", "lm_head"] if how == "lora" else ["q_proj"]
    extra = {} if how == "lora" else {"modules_to_save": ["lm_head"]}
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, **extra))
    batch = steps_of(2, steps=1, accumulation=1)[0][0]
    head = {name: p for name, p in model.named_parameters() if p.requires_grad and "lm_head" in name}
    assert head

    def grads():
        loss = model(**batch, use_cache=False).loss
        return loss.detach(), torch.autograd.grad(loss, list(head.values()))

    default_loss, default_grads = grads()
    use_chunked_loss(model, 4)
    chunked_loss, chunked_grads = grads()
    torch.testing.assert_close(chunked_loss, default_loss, rtol=1e-6, atol=0)
    assert any(grad.abs().sum() > 0 for grad in chunked_grads)  # (LoRA's A: zero while B is zero-initialised)
    for chunked, default in zip(chunked_grads, default_grads):
        torch.testing.assert_close(chunked, default, rtol=1e-4, atol=1e-6)


def test_a_moe_models_router_aux_loss_is_added_as_hfs_forward_adds_it(tmp_path):
    """``output_router_logits=True``: the chunked head adds ``router_aux_loss_coef x aux_loss`` (HF's
    ``load_balancing_loss_func``) and returns both, as the family's own forward does."""
    model = load_qlora(save_tiny_checkpoint(tmp_path / "ckpt", "qwen3_5_moe", seed=2), seed=2)
    batch = steps_of(2, steps=1, accumulation=1)[0][0]
    with torch.no_grad():
        default = model(**batch, use_cache=False, output_router_logits=True)
        use_chunked_loss(model, 3)
        chunked = model(**batch, use_cache=False, output_router_logits=True)
    assert chunked.logits is None and chunked.aux_loss is not None and default.aux_loss is not None
    assert torch.equal(chunked.aux_loss, default.aux_loss)  # the same router logits, the same function
    torch.testing.assert_close(chunked.loss, default.loss, rtol=1e-6, atol=0)
