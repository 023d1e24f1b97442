"""Dequantize once per block phase (``dequantize_once``): bitsandbytes' products with a held dequantized weight are
its own (forward, input gradient, bias gradient; fp16, bf16 and fp32 compute; bf16 and fp32 weights; plain and
nested absmax; in and out of autocast); ``dequantize_once=true`` trains the plain HF Trainer's bits under
``prepare_trainer`` (layer-major accumulation of 4) on every family, bf16 on and off, with recomputed and kept
blocks, each 4-bit weight dequantized once per block phase -- against once a call with ``false``; under CUDA
graphs a held block runs eagerly; ``auto`` follows the plan and ``poros plan`` reports it."""

from __future__ import annotations

import json
import types
from collections import Counter

import bitsandbytes as bnb
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import poros
from poros import registry
from poros.adapters import causal_lm_of
from poros.descriptor import resolve_path
from poros.dropin.detection import _quantization
from poros.errors import ConfigError
from poros.plan.footprint import plan_for_model
from poros.stream.dequantize_once import DequantizeOnce
from poros.stream.options import StreamOptions, Workload
from poros.stream.placement import host_embedding_tables
from poros.testing import save_tiny_checkpoint
from conformance_flows import FAMILY_IDS, FAMILY_VARIANTS, assert_same_outcome, load, rows, run_trainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FLOW = dict(gradient_accumulation_steps=4, per_device_train_batch_size=2)
WORKLOAD = Workload(batch_size=2, seq_len=29, grad_accum=4, schedule="layer-major")
class Dequantizations:
    """Counts the calls of ``torch.ops.bitsandbytes.dequantize_4bit.default`` -- bitsandbytes' ``dequantize_4bit``,
    ``gemm_4bit``'s default kernel (the CPU's) and Poros all call it by that name -- by ``(tag(), the codes'
    address)``. (A ``TorchDispatchMode`` would see ``gemm_4bit`` but run its kernel below autocast, changing it.)"""

    def __init__(self, tag=lambda: None) -> None:
        self.tag, self.counts = tag, Counter()
        self._packet = None

    def __enter__(self) -> "Dequantizations":
        self._packet = packet = torch.ops.bitsandbytes.dequantize_4bit

        def default(codes, *args, **kwargs):
            self.counts[(self.tag(), codes.data_ptr())] += 1
            return packet.default(codes, *args, **kwargs)
        setattr(torch.ops.bitsandbytes, "dequantize_4bit", types.SimpleNamespace(default=default, out=packet.out))
        return self

    def __exit__(self, *exc) -> None:
        setattr(torch.ops.bitsandbytes, "dequantize_4bit", self._packet)


def _linear4bit(rows: int, cols: int, *, bias: bool, compute: torch.dtype, weights: torch.dtype, nested: bool,
                seed: int) -> bnb.nn.Linear4bit:
    torch.manual_seed(seed)
    dense = torch.nn.Linear(cols, rows, bias=bias, dtype=weights)
    linear = bnb.nn.Linear4bit(cols, rows, bias=bias, compute_dtype=compute, quant_type="nf4",
                               compress_statistics=nested, device="meta")
    linear.weight = bnb.nn.Params4bit(dense.weight.data.clone(), requires_grad=False, quant_type="nf4",
                                      compress_statistics=nested)._quantize("cpu")
    if bias:
        linear.bias = torch.nn.Parameter(dense.bias.data.clone(), requires_grad=True)
    return linear


DTYPES = st.sampled_from([torch.float16, torch.bfloat16, torch.float32])


@settings(max_examples=30, deadline=None, derandomize=True)
@given(compute=DTYPES, weights=st.sampled_from([torch.bfloat16, torch.float32]), nested=st.booleans(),
       bias=st.booleans(), autocast=st.booleans(), tokens=st.integers(1, 9), seed=st.integers(0, 99))
def test_held_products_are_bitsandbytes_own(compute, weights, nested, bias, autocast, tokens, seed):
    """Two calls through one held weight (then a backward) give bitsandbytes' outputs, input gradients and bias
    gradients, torch.equal; the held phase dequantizes each (dequantized dtype, dtype) once, bitsandbytes once a
    call (forward and backward)."""
    linear = _linear4bit(64, 128, bias=bias, compute=compute, weights=weights, nested=nested, seed=seed)
    x = torch.randn(2, tokens, 128, dtype=weights, generator=torch.Generator().manual_seed(seed))

    def run(held: DequantizeOnce | None):
        a = x.clone().requires_grad_(True)
        if bias:
            linear.bias.grad = None
        with Dequantizations() as counted, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), \
                (held.holding(0) if held else torch.enable_grad()):
            first, second = linear(a), linear(a * 2)
            (first.float().sum() + (second.float() ** 2).sum()).backward()
        return (first, second, a.grad, *((linear.bias.grad,) if bias else ())), sum(counted.counts.values())

    expected, plain_count = run(None)
    held = DequantizeOnce(types.SimpleNamespace(layers=[torch.nn.ModuleList([linear])], graphs=None), True)
    held.on = True
    got, held_count = run(held)
    for want, have in zip(expected, got):
        assert torch.equal(want, have)
    assert plain_count == 4  # bitsandbytes: each call's forward and backward
    state = linear.weight.quant_state
    # the backward's copy is the weights' dtype cast to the product's gradient's (autocast's bf16 inside, before
    # Linear4bit casts the output back); one copy serves both when all agree
    shared = state.dtype == compute == (torch.bfloat16 if autocast else compute)
    assert held_count == (1 if shared else 2)


def _count_per_phase(executor, seen: list) -> None:
    """Each layer-major window's dequantizations go into ``seen`` (:func:`_per_phase`), tagged with the block and
    phase running them (``_run_block``: forward; ``_backward_block``: recompute and backward)."""
    now: list = [None]
    for name, phase in (("_run_block", "forward"), ("_backward_block", "backward")):
        original = getattr(executor, name)

        def tagged(step, index, *args, _original=original, _phase=phase, **kwargs):
            now[0] = (index, _phase)
            try:
                return _original(step, index, *args, **kwargs)
            finally:
                now[0] = None
        setattr(executor, name, tagged)
    counter, window = Dequantizations(lambda: now[0]), executor.forward_backward

    def counted(*args, **kwargs):
        with counter:
            out = window(*args, **kwargs)
        seen.append(_per_phase(counter.counts))
        counter.counts.clear()
        return out
    executor.forward_backward = counted


def _per_phase(counts: Counter) -> dict:
    """``(block, phase) -> sorted dequantization counts of its weights`` in one step (4-bit linears outside the
    blocks, as Gemma 4's per-layer projection, run in HF's prelude: not a block phase's)."""
    out: dict = {}
    for (where, _), n in counts.items():
        if where is not None:
            out.setdefault(where, []).append(n)
    return {k: sorted(v) for k, v in out.items()}


def _budget(model, dequantize_once) -> str:
    """A budget whose plan keeps one block's activations with ``dequantize_once`` priced (every block resident)."""
    causal_lm = causal_lm_of(model)
    descriptor = registry.for_config(causal_lm.config)
    layers = list(resolve_path(causal_lm, descriptor.decoder_layers))
    options = StreamOptions(vram_budget=1 << 40, workload=WORKLOAD, embeddings_on_host=False,
                            dequantize_once=dequantize_once)
    plan = plan_for_model(causal_lm, layers, host_embedding_tables(causal_lm, descriptor), options,
                          device=torch.device("cpu"), compute_dtype=getattr(torch, _quantization(causal_lm)[2]))
    per_block = plan.kept_activation_bytes // plan.kept_activation_blocks
    return str(plan.needed_bytes + int(1.5 * per_block * (1 + plan.slack)))


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("family", "variant"), FAMILY_VARIANTS, ids=FAMILY_IDS)
def test_dequantize_once_trains_the_plain_bits(family, variant, bf16, tmp_path):
    """Every family, bf16 off and on, accumulation 4 layer-major: ``dequantize_once`` gives the plain Trainer's
    losses, grad_norm, every LoRA tensor and every AdamW tensor (torch.equal), and in each step every 4-bit weight
    is dequantized once in its block's forward phase and once in its backward phase. bf16 off: ``auto`` under a
    budget that holds the copy and keeps one block's activations (the plan turns it on); bf16 on: ``true`` with
    ``recompute="none"`` (every block kept: its forward's graph runs its backward with the held copy)."""
    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt", family, variant, seed=7)
    flow = dict(train_rows=rows(8, 29), bf16=bf16, **FLOW)
    plain = run_trainer(load(checkpoint), tmp_path / "plain", **flow)
    keywords = (dict(dequantize_once=True, recompute="none") if bf16 else
                dict(dequantize_once="auto", vram_budget=_budget(load(checkpoint), True), workload=WORKLOAD))
    seen: list[dict] = []

    run = run_trainer(load(checkpoint), tmp_path / "poros", **flow, line=lambda trainer: _count_per_phase(
        poros.prepare_trainer(trainer, **keywords).executor, seen))
    assert_same_outcome(plain, run)
    assert bnb.matmul_4bit is bnb.autograd._functions.matmul_4bit  # every phase gave bitsandbytes' function back
    model = run["trainer"].model
    count = len(model.executor.layers)
    assert model.executor.dequantize.last and len(seen) == 2  # two layer-major windows of 4, both held
    if not bf16:
        assert model.budget_plan.dequantize_once and model.budget_plan.kept_activation_blocks == 1
        assert model.executor.recompute.last == frozenset({count - 1})
    for step in seen:
        assert {where for where in step} == {(i, p) for i in range(count) for p in ("forward", "backward")}
        assert all(set(counts) == {1} for counts in step.values()), step


def test_once_per_block_phase_against_once_a_call(tmp_path):
    """One step of accumulation 4, three blocks, the last kept (auto under a budget): with ``false`` each 4-bit
    weight is dequantized once a call -- 4 times in its forward phase, 8 in a recomputed block's backward phase
    (recompute and input gradient; block 0's q, k and v, whose input needs none, 4; ``down_proj`` 5, its product
    left out of every recompute after the first), 4 in the kept block's; with ``true`` once per phase, and the
    same bits."""
    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt", "qwen3", seed=7, num_hidden_layers=3)
    results, phases = {}, {}
    for once in (False, True):
        seen: list[dict] = []

        def line(trainer, once=once, seen=seen):
            _count_per_phase(poros.prepare_trainer(trainer, dequantize_once=once, workload=WORKLOAD,
                                                   vram_budget=_budget(trainer.model, once)).executor, seen)

        results[once] = run_trainer(load(checkpoint), tmp_path / str(once), train_rows=rows(8, 29), max_steps=1,
                                    line=line, **FLOW)
        assert results[once]["trainer"].model.executor.recompute.last == frozenset({2})
        (phases[once],) = seen
    assert_same_outcome(results[False], results[True])
    linears = len(phases[True][(0, "forward")])
    assert linears == 7  # q, k, v, o, gate, up, down
    assert phases[False] == {(0, "forward"): [4] * linears, (1, "forward"): [4] * linears,
                             (2, "forward"): [4] * linears, (2, "backward"): [4] * linears,
                             # down_proj: 4 input gradients, and its product only in the first (probed)
                             # recompute (poros.stream.recompute_tail)
                             (1, "backward"): [5] + [8] * (linears - 1),
                             # block 0's input needs no gradient: q, k and v's neither (recompute only)
                             (0, "backward"): [4] * 3 + [5] + [8] * 3}
    assert phases[True] == {where: [1] * linears for where in phases[False]}


class _NoReplay:
    """Stands for ``graphs.BlockGraphs`` (CUDA only) in the executor's routing: a block phase it is asked to replay
    fails the test; eager phases are counted by reason, as its report does."""

    micro_major = False
    scratch = None  # no capture scratch to lend the step's eager runs

    def __init__(self) -> None:
        self.eager: Counter = Counter()

    def begin_step(self) -> None:
        pass

    def note_eager(self, reason: str) -> None:
        self.eager[reason] += 1

    def forward(self, *args, **kwargs):
        raise AssertionError("a held block was replayed from a graph")

    backward = forward


def test_under_cuda_graphs_a_held_block_runs_eagerly_and_auto_stays_off(tmp_path):
    """With graphs, ``true`` runs every held block phase eagerly (named ``dequantize once`` in the graphs' report)
    and trains the same bits; ``auto`` stays off at micro-batches under ``GRAPHS_MIN_TOKENS`` tokens, saying why."""
    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt", "qwen3", seed=7, num_hidden_layers=2)
    flow = dict(train_rows=rows(8, 29), max_steps=1, **FLOW)
    plain = run_trainer(load(checkpoint), tmp_path / "plain", **flow)
    graphs = _NoReplay()

    def line(trainer):
        model = poros.prepare_trainer(trainer, dequantize_once=True, recompute="all")
        model.executor.graphs = graphs

    run = run_trainer(load(checkpoint), tmp_path / "poros", line=line, **flow)
    assert_same_outcome(plain, run)
    assert graphs.eager == {"dequantize once": 4 * 2 * 2}  # M calls x 2 blocks x (forward, backward)
    executor = types.SimpleNamespace(graphs=graphs, layers=[])
    auto = DequantizeOnce(executor, "auto", planned=True)
    assert not auto.decide(torch.zeros(2, 29, 8), 4) and "CUDA graphs" in auto.reason
    assert auto.decide(torch.zeros(2, 1024, 8), 4)  # 2048 tokens: the plan's decision
    assert not DequantizeOnce(types.SimpleNamespace(graphs=None, layers=[]), "auto", None).decide(
        torch.zeros(2, 29, 8), 4)  # no plan on the CPU: off


def test_dequantize_once_is_checked_carried_and_planned(capsys):
    """The setting is checked and carried by the config; ``poros plan`` prints the decision and ``--json`` reports
    ``dequantize_once`` and its bytes: on with accumulation 4, off at one micro-batch and with ``false``."""
    from poros.cli.main import main
    from poros.plan import budget as planner

    with pytest.raises(ConfigError, match="dequantize_once='some'"):
        StreamOptions(dequantize_once="some")
    assert StreamOptions.from_config(poros.PorosConfig(dequantize_once=True)).dequantize_once is True
    with pytest.raises(ConfigError, match="dequantize_once"):
        poros.PorosConfig(dequantize_once="some")
    assert poros.PorosConfig().dequantize_once == "auto"  # gated bitwise on the H200 (docs/results-h200.md)
    base = ["plan", "--vram-budget", "2GiB", "--device", "cpu", "--stream-schedule", "layer-major",
            "--dequantize-once", "auto"]
    assert main([*base, "--grad-accum", "4"]) == 0
    out = capsys.readouterr().out
    assert "dequantize once   on" in out and "dequantized once for its 4 forwards" in out
    plans = {}
    for name, extra, on in (("auto", ["--grad-accum", "4"], True), ("one", ["--grad-accum", "1"], False),
                            ("false", ["--grad-accum", "4", "--dequantize-once", "false"], False)):  # the last --dequantize-once wins
        assert main([*base, *extra, "--json"]) == 0
        plans[name] = plan = json.loads(capsys.readouterr().out)["plan"]
        assert plan["dequantize_once"] is on and (plan["dequantize_once_bytes"] > 0) is on
    # auto never costs a resident block: a copy larger than what the plan leaves stays off (the plan is false's);
    # true counts it from the start, so a budget that cannot hold it is refused
    assert main([*base, "--grad-accum", "4", "--json"]) == 0
    footprint = json.loads(capsys.readouterr().out)["footprint"]
    footprint = planner.Footprint(**{**footprint, "block_bytes": tuple(footprint["block_bytes"]),
                                     "held_weight_bytes": 1 << 31})
    workload = Workload(1, 512, 4, "layer-major")
    tight = planner.plan_budget(footprint, workload, StreamOptions(vram_budget="2GiB", optimizer_states="device",
                                                                   dequantize_once="auto"))
    assert not tight.dequantize_once
    assert tight.resident_blocks == tuple(plans["false"]["resident_blocks"])
    assert any("cannot hold one block's dequantized weights" in note for note in tight.notes)
    with pytest.raises(ConfigError, match="does not fit this run"):
        planner.plan_budget(footprint, workload, StreamOptions(vram_budget="2GiB", dequantize_once=True,
                                                               optimizer_states="device"))
