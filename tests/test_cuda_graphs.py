"""``cuda_graphs`` (issue 18): off on CPU, validated as a setting, and — the part a CPU can check —
graph keys that tell block kinds apart and the per-call fallbacks. Capture and replay need CUDA:
their parity is the H200 gate's (``tools/gpu_run.sh gate:cuda-graphs``, docs/parity-modes.md)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import poros
from poros.errors import ConfigError
from poros.plan.entry import cuda_graphs_on
from poros.stream import graphs
from poros.stream.graphs import BlockGraphs
from poros.testing import load_qlora, save_tiny_checkpoint
from test_parity import BASE_SETUP, run_parity


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("graphs")
    return {name: save_tiny_checkpoint(root / f"{family}-{variant}", family, variant)
            for name, (family, variant) in {"qwen3": ("qwen3", "default"), "gemma3": ("gemma3", "default"),
                                            "qwen3_5": ("qwen3_5", "default"),
                                            "gemma4-moe": ("gemma4", "moe")}.items()}


def prepared(path, **options):
    model = load_qlora(path, lora_rank=4, lora_alpha=8)
    return poros.prepare(model, **options)


@pytest.mark.parametrize("setting", [True, "auto"])
def test_graphs_are_off_on_cpu_and_training_is_unchanged(tmp_path, setting):
    """On CPU, prepare(cuda_graphs=...) makes no graphs and the run is the resident one, bit for bit."""
    streamed = run_parity("qwen3", "default", BASE_SETUP, tmp_path, cuda_graphs=setting)
    assert streamed.executor.graphs is None
    assert not cuda_graphs_on(setting, torch.device("cpu"))
    assert cuda_graphs_on(setting, torch.device("cuda", 0)) and cuda_graphs_on(setting, "cuda:0")


@pytest.mark.parametrize("value", ["yes", "on", 1, None])
def test_a_setting_that_is_not_true_false_or_auto_is_refused(checkpoints, value):
    with pytest.raises(ConfigError, match="cuda_graphs"):
        graphs.check(value)
    with pytest.raises(ConfigError, match="cuda_graphs"):
        prepared(checkpoints["qwen3"], cuda_graphs=value)


def test_the_config_field_takes_true_false_and_auto():
    from poros.config import PorosConfig

    assert PorosConfig(cuda_graphs="auto").cuda_graphs == "auto"
    assert PorosConfig(cuda_graphs=True).cuda_graphs is True
    assert PorosConfig().cuda_graphs is False
    assert PorosConfig().apply_overrides(["--cuda-graphs", "true"]).cuda_graphs is True
    assert PorosConfig().apply_overrides(["--cuda-graphs"]).cuda_graphs is True
    assert PorosConfig().apply_overrides(["--cuda-graphs", "auto", "--steps", "3"]).cuda_graphs == "auto"
    assert PorosConfig(cuda_graphs=True).apply_overrides(["--no-cuda-graphs"]).cuda_graphs is False
    with pytest.raises(ConfigError, match="cuda_graphs"):
        PorosConfig(cuda_graphs="sometimes")


@pytest.mark.parametrize(("name", "same", "different"), [
    ("gemma3", [(0, 1), (1, 2)], [(2, 3)]),  # sliding, sliding, sliding, full
    ("qwen3_5", [(0, 1), (1, 2)], [(2, 3)]),  # Gated DeltaNet x 3, then gated attention
    ("qwen3", [(0, 1)], []),
])
def test_blocks_share_a_graph_only_when_they_run_the_same_code(checkpoints, name, same, different):
    """The key's structure part: equal for blocks of one kind, different across kinds — a replay
    of another kind's graph would compute the wrong block."""
    streamed = prepared(checkpoints[name])
    block_graphs = BlockGraphs(streamed.store, streamed.executor.layers)
    for a, b in same:
        assert block_graphs._structure_of(a) == block_graphs._structure_of(b), (a, b)
    for a, b in different:
        assert block_graphs._structure_of(a) != block_graphs._structure_of(b), (a, b)


def test_a_lora_scaling_of_its_own_gives_a_block_its_own_graph(checkpoints):
    """PEFT's per-adapter scaling is a dict attribute (alpha_pattern / rank_pattern make it differ by
    layer): a graph captured with one scaling must not replay for a block with another."""
    streamed = prepared(checkpoints["gemma3"])
    layers = streamed.executor.layers
    assert BlockGraphs(streamed.store, layers)._structure_of(0) == BlockGraphs(streamed.store, layers)._structure_of(1)
    lora = next(m for m in layers[1].modules() if hasattr(m, "scaling") and isinstance(m.scaling, dict))
    lora.scaling = {name: value * 3 for name, value in lora.scaling.items()}
    assert BlockGraphs(streamed.store, layers)._structure_of(0) != BlockGraphs(streamed.store, layers)._structure_of(1)


def test_fallbacks_are_named(checkpoints):
    """What cannot be replayed runs eagerly, for a stated reason."""
    streamed = prepared(checkpoints["qwen3"])
    block_graphs = BlockGraphs(streamed.store, streamed.executor.layers)
    hidden = torch.zeros(1, 4, streamed.config.get_text_config().hidden_size)
    assert block_graphs.eager_reason(0, [hidden, 3, None]) is None
    assert block_graphs.eager_reason(0, [hidden, object()]) == "argument"
    assert block_graphs.eager_reason(0, [hidden[:, :1].expand(1, 4, -1)]) == "argument layout"
    layer = streamed.executor.layers[0]
    handle = layer.mlp.register_forward_hook(lambda *_: None)
    try:
        assert block_graphs.eager_reason(0, [hidden]) == "module hooks"
    finally:
        handle.remove()
    assert block_graphs.eager_reason(0, [hidden]) is None  # the store's own guard hooks are not
    parameter = next(p for p in layer.parameters() if p.requires_grad)
    handle = parameter.register_post_accumulate_grad_hook(lambda p: None)
    try:  # a replay sets .grad itself: no accumulator, so no hook of the parameter would run
        assert block_graphs.eager_reason(0, [hidden]) == "parameter hooks"
    finally:
        handle.remove()
    streamed.train()
    attention = layer.self_attn
    attention.attention_dropout = 0.1  # HF passes it to the attention kernel: no nn.Dropout module
    assert block_graphs.eager_reason(0, [hidden]) == "dropout"
    attention.attention_dropout = 0.0
    assert block_graphs.eager_reason(0, [hidden]) is None
    layer.mlp.added_dropout = torch.nn.Dropout(0.1)  # as a LoRA dropout > 0 would be
    assert block_graphs.eager_reason(0, [hidden]) == "dropout"


def test_attention_dropout_keeps_layer_major_off(checkpoints):
    """An attention's attention_dropout draws random numbers like a dropout module: layer-major, whose
    draws would come in another order, refuses it, and the trainer's schedule falls back to micro-major."""
    from poros.config import PorosConfig
    from poros.errors import StreamingError
    from poros.training.run import stream_schedule

    streamed = prepared(checkpoints["qwen3"])
    streamed.train()
    config = PorosConfig(stream_schedule="layer-major")
    assert stream_schedule(config, streamed) == "layer-major"
    streamed.executor.layers[0].self_attn.attention_dropout = 0.2
    assert stream_schedule(config, streamed) == "micro-major"
    ids = torch.randint(3, 200, (1, 8))
    with pytest.raises(StreamingError, match="attention_dropout=0|dropout active"):
        streamed.forward_backward([{"input_ids": ids, "labels": ids}])


def test_a_family_feature_that_cannot_be_captured_keeps_its_blocks_eager(checkpoints):
    """Gemma 4's MoE through transformers' eager experts loop (host syncs); its grouped_mm is captured."""
    streamed = prepared(checkpoints["gemma4-moe"])
    assert streamed.descriptor.graph_unsafe_reason(streamed.config.get_text_config()) is None  # grouped_mm
    streamed.get_base_model().set_experts_implementation("eager")
    reason = streamed.descriptor.graph_unsafe_reason(streamed.config.get_text_config())
    assert reason == "MoE routing (enable_moe_block, experts_implementation='eager')"
    block_graphs = BlockGraphs(streamed.store, streamed.executor.layers, unsafe=reason)
    hidden = torch.zeros(1, 4, streamed.config.get_text_config().hidden_size)
    assert block_graphs.eager_reason(0, [hidden]) == reason
    dense = prepared(checkpoints["gemma3"])
    assert dense.descriptor.graph_unsafe_reason(dense.config.get_text_config()) is None


def test_the_report_counts_what_ran_eagerly():
    report = graphs.GraphReport()
    report.eager["warm-up"] += 2
    report.captured, report.replays = 2, 6
    assert report.summary() == "cuda graphs: 2 captured, 6 replays; eager runs: 2 warm-up"
    assert report.to_dict()["eager"] == {"warm-up": 2}


def test_the_planner_counts_the_graphs_memory(checkpoints):
    """prepare(vram_budget=..., cuda_graphs=True) plans with the graphs' memory: the pool's capture transients held
    beside the peak, like the CUDA context (an estimate: placement.graph_reserve_bytes: one block's working set and
    autograd's LoRA gradients of one block), and what the graphs keep allocated counted in the peak
    (placement.graph_statics_bytes): per slot and block structure a forward and a backward graph's static boundary
    states, the static LoRA buffers and LoRA gradient buffers once each (all graphs share them), and the capture
    scratch of the fused NF4 experts (none here)."""
    from poros.plan.footprint import footprint_of_model, plan_for_model
    from poros.plan.peak import predict_peak
    from poros.stream.placement import graph_reserve_bytes, graph_statics_bytes
    from poros.plan.budget import Workload

    model = load_qlora(checkpoints["qwen3"], lora_rank=4, lora_alpha=8)
    causal = model.get_base_model()
    layers = list(causal.model.layers)
    from poros.stream.options import StreamOptions

    options = StreamOptions(vram_budget="1GiB", workload=Workload(1, 16))
    where = dict(device=torch.device("cpu"), compute_dtype=torch.bfloat16)
    plain = plan_for_model(causal, layers, [], options, **where)
    graphed = plan_for_model(causal, layers, [], options.replace(cuda_graphs=True), cuda_graphs=True, **where)
    footprint = footprint_of_model(causal, layers, [], options.workload, **where)
    reserve, statics = graph_reserve_bytes(footprint), graph_statics_bytes(footprint, 2)
    assert reserve > footprint.recompute_bytes > 0 and footprint.expert_scratch_bytes == 0
    assert footprint.captured_recompute_bytes == footprint.recompute_bytes  # no fused experts
    assert graphed.context_bytes == plain.context_bytes + reserve
    assert graphed.needed_bytes > plain.needed_bytes
    # the footprint the budget priced knows the graphs are on, and its peak holds what they keep allocated
    assert graphed.footprint.cuda_graphs and not plain.footprint.cuda_graphs
    assert [n for n, _ in graphed.peak.persistent if n.startswith("CUDA graphs")]
    assert not [n for n, _ in plain.peak.persistent if n.startswith("CUDA graphs")]
    on = dataclasses.replace(footprint, cuda_graphs=True)
    assert predict_peak(on, options.workload).total == predict_peak(footprint, options.workload).total + statics
    # the shared LoRA buffers: one block's (every block's LoRA has the same tensors here), not the model's
    assert footprint.block_structures == 1
    assert footprint.lora_statics_bytes == max(sum(p.numel() * p.element_size() for p in layer.parameters()
                                                   if p.requires_grad) for layer in layers)
    assert footprint.lora_statics_bytes < footprint.lora_parameter_bytes
    boundary, lora = footprint.boundary_bytes, footprint.lora_statics_bytes
    # one more block structure: per slot a forward graph (hidden in, out) and a backward graph (hidden and
    # output gradient in, hidden gradient out) more, and no more LoRA or LoRA gradient buffers (shared)
    two = dataclasses.replace(footprint, block_structures=2)
    assert graph_statics_bytes(two, 2) - statics == 2 * (2 * boundary + 3 * boundary)
    assert graph_reserve_bytes(two) == reserve
    # the LoRA buffers and the LoRA gradient buffers allocated, autograd's gradients in the pool: each once
    more = dataclasses.replace(footprint, lora_statics_bytes=lora + 1024)
    assert graph_statics_bytes(more, 2) - statics == 2 * 1024 and graph_reserve_bytes(more) - reserve == 1024
    wide = dataclasses.replace(footprint, block_structures=3)  # 4 slots x 3 structures: 13 backward graphs
    assert graph_statics_bytes(dataclasses.replace(wide, lora_statics_bytes=lora + 1024), 4) \
        - graph_statics_bytes(wide, 4) == 2 * 1024
    assert reserve == footprint.recompute_bytes + lora
    assert statics == 2 * lora + 2 * 2 * boundary + 3 * 3 * boundary
    # fused NF4 experts: the graphs hold the largest dequantized whole, and a capture's transient is the rest
    experts = dataclasses.replace(footprint, expert_scratch_bytes=10 ** 6, captured_recompute_bytes=1000)
    assert graph_statics_bytes(experts, 2) == statics + 10 ** 6 and graph_reserve_bytes(experts) == 1000 + lora


def test_auto_turns_the_graphs_off_where_their_memory_does_not_fit_the_budget(capsys, monkeypatch):
    """``cuda_graphs: auto`` under a budget: on where the plan with the graphs' pool and buffers fits, off (and the
    plan says so) where only the plan without them does; ``true`` then refuses and names ``auto`` and ``false``.
    Before, auto refused a budget the run fits without graphs (a 35B-A3B at 5 GB)."""
    import json

    from poros.cli.main import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cuda = ["--device", "cuda", "--block-ms", "10,20", "--link-gb-per-s", "25", "--grad-accum", "4",
            "--stream-schedule", "layer-major", "--seq-len", "512", "--json"]

    def planned(budget: str, graphs: str) -> tuple[int, dict | None, str]:
        status = main(["plan", "--model", "Qwen/Qwen2.5-7B", "--vram-budget", budget, "--cuda-graphs", graphs, *cuda])
        out, err = capsys.readouterr()
        return status, (json.loads(out) if status == 0 else None), err

    def minimum(graphs: str) -> int:
        status, _, err = planned("1GB", graphs)  # below any minimum: the refusal names the run's
        assert status != 0
        return int(float(err.split("needs at least ")[1].split(" GB")[0]) * 1e9)

    without, with_graphs = minimum("false"), minimum("true")
    assert with_graphs > without
    between = f"{(without + with_graphs) // 2}"
    status, report, err = planned(between, "auto")
    assert status == 0, err
    assert any(note.startswith("cuda_graphs: auto -> off") for note in report["plan"]["notes"])
    status, _, err = planned(between, "true")
    assert status != 0 and "cuda_graphs: auto" in err and "cuda_graphs: false" in err
    status, report, err = planned(f"{with_graphs + 10**9}", "auto")  # room for them: on, no such note
    assert status == 0 and not any("cuda_graphs" in note for note in report["plan"]["notes"])


@pytest.mark.parametrize(("name", "structures"), [("qwen3", 1), ("gemma3", 2), ("qwen3_5", 2), ("gemma4-moe", 3)])
def test_the_planner_counts_the_block_structures_the_graphs_key(checkpoints, name, structures):
    """The planner's count of block structures (graph_keys.block_structures, a loaded model's and a meta
    skeleton's alike) is the number of structures the graph keys tell apart: Gemma 4's layer that stores its
    kind's K/V for later layers is a third (two layer kinds, three structures)."""
    from poros.config import PorosConfig
    from poros.plan.budget import Workload
    from poros.plan.footprint import footprint_of_model
    from poros.plan.run_plan import plan_run

    streamed = prepared(checkpoints[name])
    layers = streamed.executor.layers
    keyed = {BlockGraphs(streamed.store, layers)._structure_of(i) for i in range(len(layers))}
    footprint = footprint_of_model(streamed.get_base_model(), list(layers), [], Workload(1, 16),
                                   device=torch.device("cpu"), compute_dtype=torch.bfloat16)
    skeleton = plan_run(PorosConfig(model=str(checkpoints[name]), lora_rank=4, device="cpu"))
    assert len(keyed) == footprint.block_structures == skeleton.block_structures == structures


def test_every_graph_reads_one_shared_set_of_static_lora_buffers(tmp_path):
    """Qwen3.5 MoE (Gated DeltaNet and gated-attention blocks: two structures) with LoRA on its NF4 experts,
    its blocks captured and replayed with the CPU recorder of tests/test_gemma4_graphs.py (bitwise the resident
    run: tests/test_moe.py): every graph's static LoRA tensors are buffers of the one BlockGraphs.statics, shared
    across phases, slots and structures, and that set holds what the planner prices (lora_statics_bytes, from
    the loaded model and from the config alone)."""
    from poros.config import PorosConfig
    from poros.plan.budget import Workload
    from poros.plan.footprint import footprint_of_model
    from poros.plan.run_plan import plan_run
    from test_gemma4_graphs import ReplayedOnCPU
    from test_layer_major import layer_major_steps, with_item_counts
    from test_moe import FIXED, load
    from test_parity import make_batch

    path = save_tiny_checkpoint(tmp_path / "ckpt", "qwen3_5_moe", "default", seed=5, num_layers=4)
    streamed = poros.prepare(load(path, {**FIXED, "seed": 5}, "nf4+lora"))
    block_graphs = streamed.executor.graphs = ReplayedOnCPU(streamed.store, streamed.executor.layers)
    layer_major_steps(streamed, [with_item_counts([make_batch(5 + m, 2, 14, "left") for m in range(2)])])
    captured = {key: graph for key, graph in block_graphs.graphs.items() if graph is not None}
    assert block_graphs.report.failures == [] and len(captured) == block_graphs.report.captured >= 4
    assert len({key[2] for key in captured}) == 2  # both block structures captured
    shared = {id(b): b for held in block_graphs.statics.buffers.values() for b in held}
    for graph in captured.values():  # a graph's tensors: shared buffers, none twice
        ids = [id(t) for t in graph.params]
        assert set(ids) <= shared.keys() and len(set(ids)) == len(ids)
    read = {id(t) for graph in captured.values() for t in graph.params}
    assert read == shared.keys() and len(read) < sum(len(graph.params) for graph in captured.values())
    expert_lora = [p for p in streamed.executor.layers[0].parameters() if p.requires_grad]
    assert expert_lora and all(".experts." in n for n, p in streamed.executor.layers[0].named_parameters()
                               if p.requires_grad)  # the Gated DeltaNet blocks: LoRA on the experts only
    footprint = footprint_of_model(streamed.get_base_model(), list(streamed.executor.layers), [], Workload(1, 16),
                                   device=torch.device("cpu"), compute_dtype=torch.bfloat16)
    config = PorosConfig(model=str(path), lora_rank=FIXED["lora_rank"], target_modules=["q_proj", "v_proj"],
                         device="cpu")
    assert block_graphs.statics.nbytes == footprint.lora_statics_bytes == plan_run(config).lora_statics_bytes
    assert footprint.block_structures == 2
    # the LoRA gradients every backward graph returns (its last outputs, one per LoRA tensor): buffers of the one
    # BlockGraphs.gradients, none twice in a graph, shared across slots and structures, none a LoRA value buffer
    gradients = {id(b) for held in block_graphs.gradients.buffers.values() for b in held}
    backward = [graph for key, graph in captured.items() if key[0] == "backward"]
    returned = [[id(t) for t in graph.outputs[len(graph.outputs) - len(graph.params):]] for graph in backward]
    assert len(backward) >= 2 and all(set(ids) <= gradients and len(set(ids)) == len(ids) for ids in returned)
    assert {i for ids in returned for i in ids} == gradients and not gradients & shared.keys()
    assert len(gradients) < sum(len(ids) for ids in returned)
    assert block_graphs.gradients.nbytes == block_graphs.statics.nbytes  # the planner counts them as large


def test_unpatch_lets_go_of_every_graph_and_its_buffers_before_the_weights_come_back(checkpoints):
    """``PorosModel.unpatch`` drops the graphs, their shared LoRA buffers and their pool before the frozen weights
    return to the device (an H100 run of the 122B-A10B shape ran out of memory restoring its resident arm beside
    6 GiB the graphs' pool still held): nothing of them stays referenced, and the model trains as before."""
    import gc
    import weakref

    from test_gemma4_graphs import ReplayedOnCPU
    from test_layer_major import layer_major_steps, with_item_counts
    from test_parity import make_batch

    streamed = prepared(checkpoints["qwen3"])
    block_graphs = streamed.executor.graphs = ReplayedOnCPU(streamed.store, streamed.executor.layers)
    layer_major_steps(streamed, [with_item_counts([make_batch(5 + m, 2, 14, "left") for m in range(2)])])
    held = [weakref.ref(b) for buffers in (block_graphs.statics.buffers, block_graphs.gradients.buffers)
            for group in buffers.values() for b in group]
    held += [weakref.ref(t) for graph in block_graphs.graphs.values() if graph is not None for t in graph.outputs
             if isinstance(t, torch.Tensor)]
    assert held and block_graphs.report.captured > 0
    model = streamed.unpatch()
    gc.collect()
    assert block_graphs.graphs == {} and block_graphs.pool is None
    assert [r for r in held if r() is not None] == []
    batch = make_batch(1, 2, 14, "left")
    loss = model(**batch).loss
    assert torch.isfinite(loss)


class _GradsAfterBackward:
    """Mixed into the CPU recorder: each block's ``.grad`` (a copy) right after its backward phase."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, warmup=0, **kwargs)  # every phase captured at its first call, replayed after
        self.after: dict[int, list] = {}

    def backward(self, index, *args, **kwargs):
        result = super().backward(index, *args, **kwargs)
        self.after[index] = [None if p.grad is None else p.grad.clone() for p in self._parameters(index)]
        return result


def test_no_grad_is_a_shared_gradient_buffer_that_later_replays_overwrite(checkpoints):
    """Every backward graph returns its LoRA gradients in the one shared set of buffers (BlockGraphs.gradients):
    the next block's replay overwrites them, so a ``.grad`` must be a copy. With the CPU recorder (it reruns the
    captured body at each replay, writing the shared buffers as a replay would), layer-major, 2 micro-batches:
    each block's ``.grad`` right after its own backward replays is what it is at the end of the step, after every
    lower block's replays wrote the same buffers, and no ``.grad`` shares memory with a buffer."""
    from test_gemma4_graphs import ReplayedOnCPU
    from test_layer_major import with_item_counts
    from test_parity import make_batch

    class Recorded(_GradsAfterBackward, ReplayedOnCPU):
        pass

    streamed = prepared(checkpoints["qwen3"])
    block_graphs = streamed.executor.graphs = Recorded(streamed.store, streamed.executor.layers)
    streamed.forward_backward(with_item_counts([make_batch(m, 2, 12, "none") for m in range(2)]))
    report = block_graphs.report
    assert report.failures == [] and not report.eager and report.replays == 2 * 2 * len(streamed.executor.layers)
    after = block_graphs.after
    assert len(after) == len(streamed.executor.layers) >= 2
    assert not all(torch.equal(a, b) for a, b in zip(after[0], after[1]))  # the blocks' gradients differ
    buffers = {b.untyped_storage().data_ptr() for held in block_graphs.gradients.buffers.values() for b in held}
    for index, grads in after.items():
        parameters = block_graphs._parameters(index)
        assert all(torch.equal(p.grad, g) for p, g in zip(parameters, grads, strict=True)), index
        assert not {p.grad.untyped_storage().data_ptr() for p in parameters} & buffers


def test_micro_major_replays_hand_the_engine_copies_of_the_shared_gradients(checkpoints, monkeypatch):
    """Micro-major's replays (POROS_CUDA_GRAPHS_MICRO_MAJOR=1) return the LoRA gradients to the autograd
    engine, which accumulates them after the block's node returns, past later blocks' replays: they are clones
    of the shared buffers. With the CPU recorder, ``loss.backward()``: every ``.grad`` is the eager streamed
    run's, bitwise, and none shares memory with a buffer."""
    from test_gemma4_graphs import ReplayedOnCPU
    from test_parity import make_batch

    monkeypatch.setenv(graphs.MICRO_MAJOR_SWITCH, "1")
    batch = make_batch(3, 2, 12, "none")
    eager = prepared(checkpoints["qwen3"])
    eager(**batch).loss.backward()
    streamed = prepared(checkpoints["qwen3"])
    block_graphs = streamed.executor.graphs = ReplayedOnCPU(streamed.store, streamed.executor.layers, warmup=0)
    streamed(**batch).loss.backward()
    layers, report = len(streamed.executor.layers), block_graphs.report
    # every backward phase replayed; the forwards, which record the parameters' use order with hooks, ran eagerly
    assert {key[0] for key, graph in block_graphs.graphs.items() if graph is not None} == {"backward"}
    assert report.failures == [] and report.replays == layers and dict(report.eager) == {"module hooks": layers}
    buffers = {b.untyped_storage().data_ptr() for held in block_graphs.gradients.buffers.values() for b in held}
    assert buffers
    for (name, p), q in zip(streamed.named_parameters(), eager.parameters(), strict=True):
        if p.requires_grad:
            assert torch.equal(p.grad, q.grad) and p.grad.untyped_storage().data_ptr() not in buffers, name


def test_the_static_lora_buffers_are_found_by_signature_and_occurrence():
    """ParameterStatics: the k-th tensor of a (shape, strides, dtype, device) in a block gets that signature's
    k-th buffer, in every block; another signature another buffer; the buffers hold the last block's values;
    the planner's rule (placement.shared_statics_bytes) prices what they hold."""
    from poros.stream.graph_capture import ParameterStatics
    from poros.stream.placement import shared_statics_bytes

    def parameters(*tensors):
        return [torch.nn.Parameter(t) for t in tensors]

    statics = ParameterStatics()
    first = parameters(torch.randn(4, 8), torch.randn(4, 8), torch.randn(8, 4))
    a = statics.for_block(first)
    assert len({id(b) for b in a}) == 3 and all(torch.equal(b, p) for b, p in zip(a, first))
    second = parameters(torch.randn(8, 4), torch.randn(4, 8), torch.randn(4, 8, dtype=torch.bfloat16),
                        torch.randn(8, 4).t())
    b = statics.for_block(second)
    assert b[0] is a[2] and b[1] is a[0]  # the first (8, 4) and the first (4, 8): one buffer each
    assert all(x is not y for x in b[2:] for y in a) and b[2] is not b[3]  # another dtype, other strides
    assert b[3].stride() == second[3].stride() and b[2].dtype == torch.bfloat16
    assert all(torch.equal(x, p) for x, p in zip(b, second))  # the running block's values
    assert statics.for_block(first) == a  # the same block again: the same buffers, its values back in
    assert torch.equal(a[0], first[0]) and len([t for held in statics.buffers.values() for t in held]) == 5
    sizes = [[(ParameterStatics.signature(p), p.numel() * p.element_size()) for p in block]
             for block in (first, second)]
    assert statics.nbytes == shared_statics_bytes(sizes) == 4 * (3 * 32 + 32) + 2 * 32
    assert shared_statics_bytes([]) == 0


def test_past_the_graph_limit_new_shapes_run_eagerly(checkpoints):
    """Batches padded to many lengths are keys of their own: past max_graphs nothing more is captured
    (each graph holds static buffers), and the run says so."""
    streamed = prepared(checkpoints["qwen3"])
    block_graphs = BlockGraphs(streamed.store, streamed.executor.layers, warmup=1, max_graphs=0)
    never = lambda: pytest.fail("captured past the limit")  # noqa: E731
    assert block_graphs._graph(("forward", 512), 0, never) is None  # the warm-up run, eager as always
    assert block_graphs._graph(("forward", 512), 0, never) is None
    assert dict(block_graphs.report.eager) == {"warm-up": 1, "graph limit": 1}
    assert graphs.MAX_GRAPHS >= 8  # room for a few lengths x (forward, backward) x 2 slots
