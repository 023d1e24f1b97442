"""Kept activations (``recompute``): blocks that keep their forward's saved tensors until their backward train the
plain HF Trainer's bits under ``prepare_trainer`` (layer-major accumulation of 4), on every family, bf16 on and
off; kept blocks run each decoder layer once per micro-batch, recomputed ones twice; a kept block's backward
reads its own weights even when another block overwrote the slot it ran in."""

from __future__ import annotations

import pytest
import torch

import poros
from poros import registry
from poros.adapters import causal_lm_of
from poros.descriptor import resolve_path
from poros.dropin.detection import _quantization
from poros.stream.placement import host_embedding_tables
from conformance_flows import FAMILY_IDS, FAMILY_VARIANTS, assert_same_outcome, load, rows, run_trainer
from poros.errors import ConfigError
from poros.plan.footprint import plan_for_model
from poros.stream.kept import KeptBlock
from poros.stream.options import StreamOptions, Workload
from poros.testing import save_tiny_checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FLOW = dict(gradient_accumulation_steps=4, per_device_train_batch_size=2)
WORKLOAD = Workload(batch_size=2, seq_len=29, grad_accum=4, schedule="layer-major")


def _budget_keeping(model, kept: int) -> str:
    """A VRAM budget whose plan keeps ``kept`` blocks' activations (every block resident, the rest of the
    budget for kept activations), planned as ``prepare`` plans it."""
    causal_lm = causal_lm_of(model)
    descriptor = registry.for_config(causal_lm.config)
    layers = list(resolve_path(causal_lm, descriptor.decoder_layers))
    options = StreamOptions(vram_budget=1 << 40, workload=WORKLOAD, embeddings_on_host=False)
    plan = plan_for_model(causal_lm, layers, host_embedding_tables(causal_lm, descriptor), options,
                          device=torch.device("cpu"), compute_dtype=getattr(torch, _quantization(causal_lm)[2]))
    per_block = plan.kept_activation_bytes // plan.kept_activation_blocks
    return str(plan.needed_bytes + int((kept + 0.5) * per_block * (1 + plan.slack)))


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("family", "variant"), FAMILY_VARIANTS, ids=FAMILY_IDS)
def test_kept_activations_train_the_plain_bits(family, variant, bf16, tmp_path):
    """Every family, bf16 off and on: ``recompute="auto"`` under a budget that keeps one block (bf16 off) and
    ``recompute="none"`` (every block keeps; bf16 on) give the plain Trainer's losses, grad_norm, every LoRA
    tensor and every AdamW tensor (torch.equal), accumulation 4 run layer-major."""
    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt", family, variant, seed=7)
    flow = dict(train_rows=rows(8, 29), bf16=bf16, **FLOW)
    plain = run_trainer(load(checkpoint), tmp_path / "plain", **flow)
    if bf16:
        keywords = dict(recompute="none")
    else:
        keywords = dict(vram_budget=_budget_keeping(load(checkpoint), 1), workload=WORKLOAD)
    run = run_trainer(load(checkpoint), tmp_path / "poros",
                      line=lambda trainer: poros.prepare_trainer(trainer, **keywords), **flow)
    assert_same_outcome(plain, run)
    assert run["trainer"]._poros_window.windows_run == 2  # layer-major windows of 4
    model = run["trainer"].model
    count = len(model.executor.layers)
    if bf16:
        assert model.executor.recompute.last == frozenset(range(count))
    else:
        assert model.budget_plan.kept_activation_blocks == 1
        assert model.executor.recompute.last == frozenset({count - 1})


@pytest.mark.parametrize(("family", "variant"), FAMILY_VARIANTS, ids=FAMILY_IDS)
def test_kept_blocks_leave_no_activation_alive(family, variant, tmp_path):
    """Every block kept, three steps: after each step and after training, no tensor shaped like a micro-batch's
    activations (floating, ``2 x 29 x ...``) is alive. The kept forward's ``saved_tensors_hooks`` hand autograd
    detached tensors: a saved output packed with its own ``grad_fn`` is a cycle through autograd's C++ node that
    Python's collector cannot see, and a node the backward never runs (Qwen3.5's and the Gemma blocks have some)
    kept its saved tensors alive for good -- on Qwen3.5, more every step."""
    import gc

    import transformers

    def alive() -> int:
        gc.collect()
        return sum(isinstance(o, torch.Tensor) and o.is_floating_point() and o.dim() >= 3
                   and tuple(o.shape[:2]) == (2, 29) for o in gc.get_objects())

    class AfterEachStep(transformers.TrainerCallback):
        def __init__(self) -> None:
            self.counts: list[int] = []

        def on_step_end(self, *args, **kwargs):
            self.counts.append(alive())

    after = AfterEachStep()
    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt", family, variant, seed=7)
    run_trainer(load(checkpoint), tmp_path / "poros", train_rows=rows(32, 29), callbacks=[after], max_steps=3,
                **FLOW, line=lambda trainer: poros.prepare_trainer(trainer, recompute="none"))
    assert after.counts == [0, 0, 0] and alive() == 0


def test_kept_blocks_run_their_forward_once_recomputed_twice(tmp_path):
    """Decoder-layer forward calls in one optimizer step (accumulation 4), auto keeping the last block of three:
    the kept block's layer runs once per micro-batch, the recomputed ones twice (forward, then recompute)."""
    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt", "qwen3", seed=7, num_hidden_layers=3)
    calls: dict[int, int] = {}

    def line(trainer):
        model = poros.prepare_trainer(trainer, vram_budget=_budget_keeping(trainer.model, 1), workload=WORKLOAD)
        for index, layer in enumerate(model.executor.layers):
            layer.register_forward_pre_hook(lambda *_, i=index: calls.__setitem__(i, calls.get(i, 0) + 1))

    run_trainer(load(checkpoint), tmp_path / "poros", train_rows=rows(8, 29), max_steps=1, line=line, **FLOW)
    assert calls == {0: 8, 1: 8, 2: 4}


def test_a_kept_block_reads_its_own_weights_after_its_slot_is_reused(tmp_path):
    """Block 1 keeps its MLP's graph (bitsandbytes' MatMul4Bit holds the packed weight in its context, the norm
    its weight as a saved tensor), leaves its slot, block 2 overwrites that slot, block 1 comes back in the other
    slot: the backward is bitwise a fresh recompute's. The negative control keeps a plain graph over the same
    moves and gets other gradients: without the rebinding this test fails."""
    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt", "qwen3", seed=7, num_hidden_layers=3)
    model = poros.prepare(load(checkpoint), num_slots=2, recompute="all")
    store, layers = model.store, model.executor.layers
    width = model.config.hidden_size
    x = torch.randn(2, 5, width, generator=torch.Generator().manual_seed(3))
    grad = torch.randn(2, 5, width, generator=torch.Generator().manual_seed(4))

    def mlp(layer, inputs):
        return layer.mlp(layer.post_attention_layernorm(inputs))

    def input_grad(kept: KeptBlock | None):
        store.release_all()
        store.fetch(1)  # slot 0
        assert store.blocks[1].slot == 0
        leaf = x.clone().requires_grad_(True)
        with torch.enable_grad(), (kept.saving() if kept else torch.autograd.graph.saved_tensors_hooks(
                lambda t: t, lambda t: t)):
            out = mlp(layers[1], leaf)
        if kept:
            kept.detach_contexts([out])
        store.release(1)
        store.fetch(2)  # overwrites slot 0
        store.fetch(1)  # block 1 back, in slot 1
        assert store.blocks[2].slot == 0 and store.blocks[1].slot == 1
        if kept:
            kept.bind_contexts()
        out.backward(grad)
        return leaf.grad

    store.release_all()
    store.fetch(1)
    leaf = x.clone().requires_grad_(True)
    with torch.enable_grad():
        mlp(layers[1], leaf).backward(grad)
    reference = leaf.grad
    assert torch.equal(input_grad(KeptBlock(1, store.buffer_of)), reference)
    assert not torch.equal(input_grad(None), reference)  # the trap is real: a plain kept graph reads block 2
    store.release_all()


def test_recompute_is_checked_and_carried_by_the_config():
    with pytest.raises(ConfigError, match="recompute='some'"):
        StreamOptions(recompute="some")
    config = poros.PorosConfig(recompute="none")
    assert StreamOptions.from_config(config).recompute == "none"
    with pytest.raises(ConfigError, match="recompute"):
        poros.PorosConfig(recompute="some")


def test_poros_plan_says_how_many_blocks_keep_their_activations(capsys):
    """``poros plan`` prints the kept blocks (a table row and a decision) and ``--json`` reports
    ``kept_activation_blocks``; ``--recompute all`` keeps none."""
    import json

    from poros.cli.main import main

    assert main(["plan", "--vram-budget", "2GiB", "--device", "cpu", "--grad-accum", "4"]) == 0
    out = capsys.readouterr().out
    assert "kept activations" in out and "blocks keep their activations (recompute=auto" in out
    assert main(["plan", "--vram-budget", "2GiB", "--device", "cpu", "--grad-accum", "4", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["plan"]["kept_activation_blocks"] > 0
    assert main(["plan", "--vram-budget", "2GiB", "--device", "cpu", "--grad-accum", "4", "--recompute", "all",
                 "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["plan"]["kept_activation_blocks"] == 0


def test_auto_without_a_plan_counts_a_block_by_its_measured_bytes_once_measured(tmp_path):
    """``recompute="auto"`` without a plan: before a block of the step's shape kept its tensors, one block is the
    estimate with ``UNMEASURED_FACTOR``; after, the bytes a kept block's graph really held, also when fewer than
    the estimate (fused kernels such as Liger's keep less than transformers' modules): the count then grows."""
    from poros.stream.recompute_choice import UNMEASURED_FACTOR

    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt", "qwen3", seed=7, num_hidden_layers=3)
    model = poros.prepare(load(checkpoint), recompute="auto")
    choice = model.executor.recompute
    hidden = torch.zeros(2, 29, model.config.hidden_size)
    estimate = choice._activation_parts(hidden).kept
    assert choice.block_bytes(hidden) == int(estimate * UNMEASURED_FACTOR)
    choice.note(tuple(hidden.shape), estimate // 2)
    assert choice.block_bytes(hidden) == estimate // 2
    choice.note(tuple(hidden.shape), 3 * estimate)
    assert choice.block_bytes(hidden) == 3 * estimate  # the largest measured block
    choice.allotted_bytes = 4 * 3 * estimate  # as if the first step had found room for four such blocks
    assert choice.blocks(hidden, 1) == frozenset(range(3))
    choice.allotted_bytes = 3 * estimate
    assert choice.blocks(hidden, 2) == frozenset()


def test_auto_without_a_plan_keeps_within_an_emulated_card(monkeypatch):
    """Without a plan, auto sizes the kept blocks from the device's free memory; under
    ``torch.cuda.set_per_process_memory_fraction`` (how the bench and users emulate a small card) the allocator stops
    at that fraction, whatever ``mem_get_info`` says is free (a 24 GB cap on a 141 GB card would otherwise keep
    blocks for the whole card)."""
    import types

    from poros.stream.recompute_choice import FREE_MARGIN, FREE_MARGIN_BYTES, RecomputeChoice

    gib = 1 << 30
    parts = types.SimpleNamespace(boundary=0, recompute=0, head=0)
    executor = types.SimpleNamespace(layers=[], causal_lm=torch.nn.Linear(1, 1, bias=False), dequantize=None)
    for p in executor.causal_lm.parameters():
        p.requires_grad_(False)
    choice = RecomputeChoice(executor, "auto", estimate=lambda hidden: parts)
    hidden = types.SimpleNamespace(device=torch.device("cuda", 0), shape=(1, 2048, 8), dtype=torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (130 * gib, 140 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 10 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 8 * gib)
    margin = lambda total: int(FREE_MARGIN * total) + FREE_MARGIN_BYTES  # noqa: E731
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 1.0)
    assert choice.free_beside_step(hidden, 4) == 130 * gib + 2 * gib - margin(140 * gib)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 0.25)  # 35 GiB of 140
    assert choice.free_beside_step(hidden, 4) == (35 - 10) * gib + 2 * gib - margin(35 * gib)


def test_auto_without_a_plan_refits_once_by_the_first_steps_measured_peak(monkeypatch):
    """Without a plan, the first step's allotment is an estimate; at the second step it grows by what the first
    step's peak left of the memory the process may use (less ``REFIT_MARGIN``, ``FREE_MARGIN_BYTES`` and three
    LoRA-sized tensors), once, and never shrinks: a larger peak from before the run (a model loaded on the device)
    keeps the first allotment. Memory outside the allocator (another process) is not room; a peak reset since (a
    memory tracker) leaves the allocator's reserved bytes, which count as the peak."""
    import types

    from poros.stream.recompute_choice import FREE_MARGIN_BYTES, REFIT_MARGIN, RecomputeChoice

    gib = 1 << 30
    parts = types.SimpleNamespace(boundary=0, recompute=0, head=0, kept=gib)
    lora = torch.nn.Linear(1024, 1024, bias=False)  # 4 MiB of trainable fp32 weights
    executor = types.SimpleNamespace(layers=list(range(64)), causal_lm=lora, dequantize=None, graphs=None,
                                     options=types.SimpleNamespace(lora_placement="device"))
    hidden = types.SimpleNamespace(device=torch.device("cuda", 0), shape=(1, 2048, 8), dtype=torch.bfloat16)
    total = 100 * gib
    card = {"reserved": 40 * gib, "peak": 40 * gib, "outside": 0}  # before the first step: 40 GiB allocated
    monkeypatch.setattr(torch.cuda, "mem_get_info",
                        lambda device: (total - card["outside"] - card["reserved"], total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: card["reserved"])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 40 * gib)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device: card["peak"])
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 1.0)

    def first_step():
        card.update(reserved=40 * gib, peak=40 * gib, outside=0)
        choice = RecomputeChoice(executor, "auto", estimate=lambda hidden: parts)
        kept = choice.blocks(hidden, 4)  # 4 micro-batches of 1.25 GiB (the estimate with its factor): 5 GiB a block
        assert choice.allotted_bytes == choice.free_beside_step(hidden, 4) and not choice.refitted
        assert len(kept) == choice.allotted_bytes // (5 * gib) and kept == frozenset(range(64 - len(kept), 64))
        choice.note(tuple(hidden.shape), gib)  # measured: 1 GiB a micro-batch
        card.update(reserved=70 * gib, peak=70 * gib)  # the first step's peak
        return choice, kept

    choice, first = first_step()
    second = choice.blocks(hidden, 4)
    room = total - 70 * gib - int(REFIT_MARGIN * total) - FREE_MARGIN_BYTES - 3 * 4 * (1 << 20)
    assert choice.refitted and choice.allotted_bytes == len(first) * 4 * gib + room
    assert len(second) == choice.allotted_bytes // (4 * gib) > len(first)
    card.update(reserved=50 * gib, peak=50 * gib)  # once only: a later step's room changes nothing
    assert choice.blocks(hidden, 4) == second

    reset, _ = first_step()
    card["peak"] = 0  # a tracker reset the peak; the allocator still holds its 70 GiB
    assert reset.blocks(hidden, 4) == second
    shared, _ = first_step()
    card["outside"] = 5 * gib  # another process took 5 GiB of the card since
    assert len(shared.blocks(hidden, 4)) == (shared.allotted_bytes // (4 * gib)) < len(second)
    assert shared.allotted_bytes == len(first) * 4 * gib + room - 5 * gib
    again, _ = first_step()
    allotted = again.allotted_bytes
    card["peak"] = 99 * gib  # a peak from before the run: the refit would shrink the room, and does not
    kept = again.blocks(hidden, 4)  # (the room's blocks counted by the measured bytes now)
    assert again.refitted and again.allotted_bytes == allotted and len(kept) == allotted // (4 * gib)

    cpu = RecomputeChoice(executor, "auto", estimate=lambda hidden: parts)  # no device: no refit
    on_cpu = types.SimpleNamespace(device=torch.device("cpu"), shape=(1, 2048, 8), dtype=torch.bfloat16)
    assert cpu.blocks(on_cpu, 4) == cpu.blocks(on_cpu, 4) == frozenset() and not cpu.refitted


def test_auto_without_a_plan_keeps_fewer_blocks_in_a_step_that_needs_more_beside_them(monkeypatch):
    """The room for kept blocks is for the shape of the step it was measured at; a later step with longer
    sequences (padding to the batch's longest, as TRL's collator does) needs more for its boundary states, a
    recompute's and the head's working sets, and its kept blocks get that much less; a shorter one keeps the room."""
    import types

    from poros.stream.recompute_choice import RecomputeChoice

    gib = 1 << 30
    parts = lambda hidden: types.SimpleNamespace(boundary=0, recompute=0, head=hidden.shape[1] * gib // 1024,  # noqa: E731
                                                 kept=hidden.shape[1] * gib // 2048)
    executor = types.SimpleNamespace(layers=list(range(64)), causal_lm=torch.nn.Linear(1, 1, bias=False),
                                     dequantize=None, graphs=None, options=types.SimpleNamespace(lora_placement="device"))
    choice = RecomputeChoice(executor, "auto", estimate=parts)
    shaped = lambda seq: types.SimpleNamespace(device=torch.device("cuda", 0), shape=(1, seq, 8),  # noqa: E731
                                               dtype=torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (40 * gib, 40 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 0)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 1.0)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device: 0)
    choice.refitted = True  # the room as the first step found it, without the refit
    first = choice.blocks(shaped(2048), 1)
    room = choice.allotted_bytes
    assert 0 < len(first) == room // int(gib * 1.25) < 64  # 1 GiB a block, with UNMEASURED_FACTOR
    longer = choice.blocks(shaped(8192), 1)  # the head needs 6 GiB more, a block 4 GiB
    assert 0 < len(longer) == (room - 6 * gib) // (5 * gib) < (room // (5 * gib))
    assert choice.blocks(shaped(65536), 1) == frozenset()  # more than the whole room beside the blocks
    shorter = choice.blocks(shaped(1024), 1)
    assert len(shorter) == min(64, room // int(gib * 0.625))
