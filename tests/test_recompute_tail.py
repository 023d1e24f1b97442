"""A recompute without its unread last product (``poros.stream.recompute_tail``): with ``dequantize_once`` holding a
block's weights, a recomputed pre-norm block skips its ``down_proj`` product (found by a probe of its first
recompute, not declared) and the Trainer under ``prepare_trainer`` still gives the plain Trainer's bits, on every
family, bf16 on and off; a block whose last product's output a saved tensor reads (Gemma 3's post-feedforward norm)
recomputes whole, a block holding a router (Qwen3.5 MoE) is never probed, and a probe leaves no activation alive."""

from __future__ import annotations

from collections import Counter

import bitsandbytes as bnb
import pytest
import torch

import poros
from poros.stream import recompute_tail
from poros.testing import save_tiny_checkpoint
from conformance_flows import FAMILY_IDS, FAMILY_VARIANTS, assert_same_outcome, load, rows, run_trainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FLOW = dict(gradient_accumulation_steps=4, per_device_train_batch_size=2, train_rows=rows(8, 29))
HELD_RECOMPUTED = dict(dequantize_once=True, recompute="all")  # every block recomputed, its weights held


def _recomputes(executor) -> Counter:
    """Counts each block's eager recomputes (``_backward_block`` calls) on ``executor``."""
    counts, original = Counter(), executor._backward_block

    def counted(step, index, *args, **kwargs):
        counts[index] += 1
        return original(step, index, *args, **kwargs)
    executor._backward_block = counted
    return counts


#: how the recomputes run: layer-major with the weights held; layer-major through bitsandbytes' ``MatMul4Bit``;
#: micro-major (LoRA dropout on: the drop-in leaves every micro-batch to the Trainer), through ``MatMul4Bit``
MODES = {"held": (dict(dequantize_once=True), 0.0), "bitsandbytes": (dict(dequantize_once=False), 0.0),
         "micro-major": (dict(dequantize_once=False), 0.1)}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("family", "variant"), FAMILY_VARIANTS, ids=FAMILY_IDS)
def test_recompute_tail_keeps_the_plain_bits(family, variant, bf16, mode, tmp_path):
    """Accumulation 4, two steps, every block recomputed: the plain Trainer's losses, grad_norm, LoRA and AdamW
    tensors; each probed block skipped its product in every recompute after the first."""
    options, dropout = MODES[mode]
    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt", family, variant, seed=7)
    plain = run_trainer(load(checkpoint, dropout=dropout), tmp_path / "plain", bf16=bf16, **FLOW)
    recomputes: list[Counter] = []
    run = run_trainer(load(checkpoint, dropout=dropout), tmp_path / "poros", bf16=bf16, **FLOW,
                      line=lambda trainer: recomputes.append(_recomputes(poros.prepare_trainer(
                          trainer, recompute="all", **options).executor)))
    assert_same_outcome(plain, run)
    tail = run["trainer"].model.executor.dequantize.tail
    skipping = [index for index, state in tail.targets.items() if state is not None]
    assert tail.skipped == sum(recomputes[0][index] - 1 for index in skipping)
    assert run["trainer"].model.executor.dequantize.skipping is None
    assert bnb.matmul_4bit is bnb.autograd._functions.matmul_4bit  # bitsandbytes' own function given back


@pytest.mark.parametrize("held", [True, False], ids=["held", "bitsandbytes"])
def test_a_pre_norm_block_recomputes_without_its_down_projection(held, tmp_path):
    """Qwen3, three blocks, layer-major: the probe finds each block's ``mlp.down_proj``; its base product runs 4
    times a step in the forward phase and, in the backward phase, only in the first (probed) recompute of each
    block -- 15 then 12 products where a whole recompute runs 24 a step -- with its weights held or not, and the
    bits are the plain Trainer's."""
    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt", "qwen3", seed=7, num_hidden_layers=3, intermediate_size=96)
    plain = run_trainer(load(checkpoint), tmp_path / "plain", bf16=True, **FLOW)
    products: list[int] = []

    def line(trainer):
        executor = poros.prepare_trainer(trainer, recompute="all", dequantize_once=held).executor
        window = executor.forward_backward

        def counted(*args, **kwargs):
            products.append(0)
            linear = torch.nn.functional.linear

            def counting(input, weight, bias=None):
                products[-1] += tuple(weight.shape) == (64, 96)  # down_proj's base weight, dequantized
                return linear(input, weight, bias)
            torch.nn.functional.linear = counting
            try:
                return window(*args, **kwargs)
            finally:
                torch.nn.functional.linear = linear
        executor.forward_backward = counted

    run = run_trainer(load(checkpoint), tmp_path / "poros", bf16=True, line=line, **FLOW)
    assert_same_outcome(plain, run)
    executor = run["trainer"].model.executor
    assert products == [4 * 3 + 3, 4 * 3]
    assert executor.dequantize.tail.skipped == 3 * 7
    assert executor.dequantize.tail.skipped_flops == 3 * 7 * 2 * (2 * 29) * 96 * 64  # rows x K x N, 2 FLOPs each
    for index, layer in enumerate(executor.layers):
        assert executor.dequantize.tail.targets[index] is layer.mlp.down_proj.base_layer.weight.quant_state


def test_a_block_whose_last_output_is_saved_recomputes_whole(tmp_path):
    """Gemma 3 normalizes the MLP's output (``post_feedforward_layernorm``), which saves it: the probe finds a
    saved tensor derived from ``down_proj``'s output in every block, nothing is skipped, and the bits are the
    plain Trainer's."""
    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt", "gemma3", seed=7)
    plain = run_trainer(load(checkpoint), tmp_path / "plain", bf16=True, **FLOW)
    run = run_trainer(load(checkpoint), tmp_path / "poros", bf16=True, **FLOW,
                      line=lambda trainer: poros.prepare_trainer(trainer, **HELD_RECOMPUTED))
    assert_same_outcome(plain, run)
    dequantize = run["trainer"].model.executor.dequantize
    assert dequantize.tail.targets and set(dequantize.tail.targets.values()) == {None}
    assert dequantize.tail.skipped == 0


def test_a_routed_block_is_not_probed(monkeypatch, tmp_path):
    """Qwen3.5 MoE: which experts run depends on the tokens, so one recompute's order of products says nothing
    of the next one's; its blocks hold a router, are never probed and recompute whole, with the plain bits."""
    probes = []

    class Counted(recompute_tail._Probe):
        def __init__(self):
            super().__init__()
            probes.append(self)
    monkeypatch.setattr(recompute_tail, "_Probe", Counted)
    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt", "qwen3_5_moe", seed=7, num_layers=2)
    plain = run_trainer(load(checkpoint), tmp_path / "plain", bf16=True, **FLOW)
    run = run_trainer(load(checkpoint), tmp_path / "poros", bf16=True, **FLOW,
                      line=lambda trainer: poros.prepare_trainer(trainer, **HELD_RECOMPUTED))
    assert_same_outcome(plain, run)
    dequantize = run["trainer"].model.executor.dequantize
    assert dequantize.tail.targets == {0: None, 1: None} and dequantize.tail.skipped == 0 and not probes


@pytest.mark.parametrize("held", [True, False], ids=["held", "bitsandbytes"])
@pytest.mark.parametrize(("family", "variant"), FAMILY_VARIANTS, ids=FAMILY_IDS)
def test_the_probe_leaves_no_activation_alive(family, variant, held, tmp_path):
    """The probe's ``saved_tensors_hooks`` hand autograd detached tensors: a saved output packed with its own
    ``grad_fn`` makes a cycle through autograd's C++ nodes, which the cyclic collector cannot see, so the
    activations of every probed recompute would stay alive for good (on a GPU, device memory; Qwen3.5's, Gemma 3's
    and Gemma 4's blocks save such outputs). After training and a collection, on every family, no tensor shaped
    like a micro-batch's activations (floating, ``2 x 29 x ...``) is left."""
    import gc

    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt", family, variant, seed=7)
    run_trainer(load(checkpoint), tmp_path / "poros", **FLOW,
                line=lambda trainer: poros.prepare_trainer(trainer, recompute="all", dequantize_once=held))
    gc.collect()
    alive = [tuple(o.shape) for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.is_floating_point()
             and o.dim() >= 3 and tuple(o.shape[:2]) == (2, 29)]
    assert not alive, alive
