"""CUDA graphs for Gemma 4 (issue 34), the part a CPU can check.

Every Gemma 4 block is handed the ``shared_kv_states`` mapping, even at 31B where no layer shares
K/V (the last layer of each kind still stores its K/V there). What a block does with it comes from the
descriptor (``CarriedState`` reader / writer flags): a block that neither reads nor writes is captured
like any other, a reader's entry is a static input, a writer's a static output. These tests check the
decisions (which blocks are graphable, the reasons of those that are not) and — with a recorder that
stands in for ``torch.cuda.graph`` (it runs the captured body again on the same static buffers at each
replay, and poisons the outputs of the capture itself, as a real capture leaves them unwritten) — that
replayed blocks train bitwise the resident model. Capture and replay on a GPU are the H200 gate's.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers.cache_utils import KVSharingDict

import poros
import poros.registry
from poros.descriptor import derive
from poros.stream.carried import CarriedAccess
from poros.stream.graph_keys import non_overlapping
from poros.stream import layer_major
from poros.stream.graphs import BlockGraphs
from poros.testing import load_qlora, save_tiny_checkpoint
from test_layer_major import layer_major_steps, resident_steps, with_item_counts
from test_parity import assert_bitwise, make_batch

KV = "shared_kv_states"
SLIDING, FULL = "sliding_attention", "full_attention"


class ReplayedOnCPU(BlockGraphs):
    """BlockGraphs whose "graph" reruns the captured body on its static buffers at every replay.

    A capture's body reads only what a CUDA graph would read (the static buffers, the capture's own
    mappings); the outputs of the capture run are overwritten with NaN (a real capture computes
    nothing), so a replay whose inputs were not copied in, or an output read before a replay, shows.
    A replay runs the block that calls it (blocks of one kind in one slot share a graph: a real replay
    reads the slot's bytes, which are that block's).
    """

    running = None

    def forward(self, index, *args, **kwargs):
        self.running = index
        return super().forward(index, *args, **kwargs)

    def backward(self, index, *args, **kwargs):
        self.running = index
        return super().backward(index, *args, **kwargs)

    def _record(self, index, body, autocast=None):
        outputs = body(index)
        _poison(outputs)

        def replay():
            again = body(self.running)
            with torch.no_grad():
                for kept, new in zip(outputs, again):
                    if kept is not None:
                        kept.copy_(new)

        return replay, outputs


def _poison(outputs):
    with torch.no_grad():
        for tensor in outputs:
            if tensor is not None and tensor.is_floating_point():
                tensor.fill_(float("nan"))


#: depths at which blocks of one kind meet in one slot (two slots): they share graphs, as at full depth
VARIANTS = {
    # 31B-like: no shared-KV layers; the last sliding (4) and the last full layer (5) still store their K/V
    "no-sharing": ("e2b", dict(num_layers=6, num_kv_shared_layers=0)),
    # E2B/E4B-like: layers 2 (sliding) and 3 (full) store, 4-6 (sliding) and 7 (full) read
    "shared-kv": ("e2b", dict(num_layers=8)),
    # 26B-A4B-like: MoE block, attention_k_eq_v, no sharing; 4 and 5 store
    "moe": ("moe", dict(num_layers=6)),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma4-graphs")
    return {name: save_tiny_checkpoint(root / name, "gemma4", variant, seed=5, **config)
            for name, (variant, config) in VARIANTS.items()}


def prepared(path, **options):
    return poros.prepare(load_qlora(path, lora_rank=4, lora_alpha=8, seed=5), **options)


def batches(micro: int, step: int = 0):
    return with_item_counts([make_batch(5 + 10 * step + m, 2, 14, "left") for m in range(micro)])


def first_step(streamed):
    """The captured prelude of one micro-batch (HF's own calls of every layer), as forward_backward sees it."""
    return layer_major.prelude(streamed.executor, streamed, batches(1)[0])


def reasons_per_block(streamed, graphs=None):
    """Each block's eager reason (None: graphable) at the point of its forward, the earlier blocks run."""
    executor, step = streamed.executor, first_step(streamed)
    graphs = graphs or BlockGraphs(streamed.store, executor.layers)
    reasons, hidden = [], step.calls[0].leaves[0]
    with torch.no_grad():
        for index, call in enumerate(step.calls):
            leaves = call.leaves_with(hidden, call.grad_tensors())
            reasons.append(graphs.eager_reason(index, leaves, executor._carried_at(index, call)))
            executor._note_mapping_entry(step, index)
            hidden = executor._run_block(step, index, hidden, call.grad_tensors())
    return reasons


# -- which blocks may be graphed --------------------------------------------------------------------
@pytest.mark.parametrize(("name", "reads", "writes"), [
    ("no-sharing", {}, {4: SLIDING, 5: FULL}),
    ("shared-kv", {4: SLIDING, 5: SLIDING, 6: SLIDING, 7: FULL}, {2: SLIDING, 3: FULL}),
    ("moe", {}, {4: SLIDING, 5: FULL}),
])
def test_the_descriptor_says_what_each_block_reads_and_writes(checkpoints, name, reads, writes):
    streamed = prepared(checkpoints[name])
    for index in range(len(streamed.executor.layers)):
        access = streamed.executor.carried_access(index)[KV]
        assert access.declared
        assert access.reads == ((reads[index],) if index in reads else ()), index
        assert access.writes == ((writes[index],) if index in writes else ()), index
    assert streamed.executor.carried_access(0)[KV].describe(0) == f"layer 0 neither reads nor writes {KV}"
    last = len(streamed.executor.layers) - 1
    assert streamed.executor.carried_access(last)[KV].describe(last).startswith(f"layer {last} ")


@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_gemma4_block_is_graphable(checkpoints, name):
    """With and without shared KV, MoE with transformers' default grouped_mm experts: no block must run
    eagerly — the reason 31B ran all 2,880 block calls eagerly ("carried state") is gone."""
    streamed = prepared(checkpoints[name])
    config = streamed.config.get_text_config()
    unsafe = streamed.descriptor.graph_unsafe_reason(config)
    assert unsafe is None, unsafe
    assert reasons_per_block(streamed) == [None] * len(streamed.executor.layers)


def test_moe_blocks_with_the_eager_experts_loop_stay_eager_and_say_so(checkpoints):
    streamed = prepared(checkpoints["moe"])
    streamed.get_base_model().set_experts_implementation("eager")
    config = streamed.config.get_text_config()
    reason = streamed.descriptor.graph_unsafe_reason(config)
    assert reason == "MoE routing (enable_moe_block, experts_implementation='eager')"
    graphs = BlockGraphs(streamed.store, streamed.executor.layers, unsafe=reason)
    assert reasons_per_block(streamed, graphs) == [reason] * len(streamed.executor.layers)


def test_a_mapping_the_descriptor_does_not_describe_keeps_its_blocks_eager(checkpoints):
    """Without reader/writer flags nothing says what a block touches: every block handed the mapping
    runs eagerly, and the reason names the mapping, the layer and the missing fields."""
    streamed = prepared(checkpoints["no-sharing"])
    descriptor = streamed.executor.descriptor
    bare = tuple(dataclasses.replace(c, reader_flag=None, writer_flag=None, entry_key=None)
                 for c in descriptor.carried_state)
    streamed.executor.descriptor = derive(descriptor, carried_state=bare)
    streamed.executor._access.clear()
    reasons = reasons_per_block(streamed)
    assert reasons == [f"carried state: {KV} (layer {i}; the descriptor does not say which entries a layer "
                       "reads or writes: CarriedState reader_flag / writer_flag / entry_key)"
                       for i in range(len(reasons))]


def test_a_reader_whose_entry_is_missing_is_named(checkpoints):
    streamed = prepared(checkpoints["shared-kv"])
    executor, step = streamed.executor, first_step(streamed)
    graphs = BlockGraphs(streamed.store, executor.layers)
    call = step.calls[4]  # reads the sliding entry; nothing has run, so nothing was written
    reason = graphs.eager_reason(4, call.leaves_with(call.leaves[0]), executor._carried_at(4, call))
    assert reason == f"carried state: {KV}['{SLIDING}'] (layer 4 reads it; no earlier layer wrote it)"


def test_a_strided_slice_is_an_argument_a_static_copy_holds():
    """Gemma 4's per-layer input is ``per_layer_inputs[:, :, i]``: strided, gaps between rows, no element
    twice; an expanded view (Qwen3.5's position_ids) repeats elements and stays eager."""
    per_layer = torch.zeros(2, 5, 6, 8)
    assert non_overlapping(per_layer[:, :, 3])
    assert non_overlapping(per_layer.transpose(1, 2))
    assert not non_overlapping(torch.zeros(1, 5).expand(3, 5))
    assert not non_overlapping(torch.zeros(4, 5).as_strided((4, 5), (2, 1)))


# -- replayed, bitwise ------------------------------------------------------------------------------
def graphed_run(path, micro: int = 3, steps: int = 2):
    reference = load_qlora(path, lora_rank=4, lora_alpha=8, seed=5)
    plan = [batches(micro, s) for s in range(steps)]
    ref_losses, ref_opt = resident_steps(reference, plan)
    model = load_qlora(path, lora_rank=4, lora_alpha=8, seed=5)
    streamed = poros.prepare(model)
    streamed.executor.graphs = ReplayedOnCPU(streamed.store, streamed.executor.layers)
    poros_losses, poros_opt = layer_major_steps(streamed, plan)
    assert_bitwise(reference, model, ref_losses, poros_losses, ref_opt, poros_opt)
    return streamed, streamed.executor.graphs.report


@pytest.mark.parametrize("name", list(VARIANTS))
def test_replayed_gemma4_blocks_train_bitwise_resident(checkpoints, name):
    """Layer-major, 2 steps x 3 micro-batches, every block forward and backward replayed from its graph
    (but each key's warm-up run): losses, LoRA tensors and AdamW states torch.equal the resident run's."""
    streamed, report = graphed_run(checkpoints[name])
    layers = len(streamed.executor.layers)
    assert report.failures == []
    assert set(report.eager) == {"warm-up"}, report.eager
    assert report.captured == report.eager["warm-up"] > 0
    assert report.replays + report.eager["warm-up"] == 2 * 2 * 3 * layers  # phases x steps x micro-batches
    assert report.captured < 2 * layers  # blocks of one kind in one slot share a graph


def test_a_replayed_writer_puts_a_copy_into_the_live_mapping(checkpoints):
    """The live mapping gets clones of the writer graph's static outputs (the next replay overwrites those
    buffers), and a reader's graph holds a mapping of its own, never a live one."""
    streamed = prepared(checkpoints["shared-kv"])
    executor = streamed.executor
    graphs = executor.graphs = ReplayedOnCPU(streamed.store, executor.layers)
    streamed.forward_backward(batches(2))
    writer = next(g for key, g in graphs.graphs.items() if key[0] == "forward" and g is not None and g.writes)
    live = {}
    position, key, spec, first, count = writer.writes[0]
    leaves = [None] * (position + 1)
    leaves[position] = live
    writer.write_back(leaves)
    written = torch.utils._pytree.tree_leaves(live[key])
    assert len(written) == count
    for copy, static in zip(written, writer.outputs[first:first + count]):
        assert torch.equal(copy, static) and copy.data_ptr() != static.data_ptr()
    own = [s for g in graphs.graphs.values() if g is not None for s in g.statics if isinstance(s, KVSharingDict)]
    assert own and all(set(m.keys()) <= {SLIDING, FULL} for m in own)


def test_a_block_that_writes_what_it_was_not_declared_to_fails_its_capture_and_runs_eagerly(checkpoints):
    """A descriptor whose flags the layer contradicts cannot bake a wrong graph: the capture raises, the
    key runs eagerly for the run (named in the report), and training stays bitwise."""
    path = checkpoints["no-sharing"]
    reference = load_qlora(path, lora_rank=4, lora_alpha=8, seed=5)
    plan = [batches(3)]
    ref_losses, ref_opt = resident_steps(reference, plan)
    model = load_qlora(path, lora_rank=4, lora_alpha=8, seed=5)
    streamed = poros.prepare(model)
    executor = streamed.executor
    executor.graphs = ReplayedOnCPU(streamed.store, executor.layers)
    last = len(executor.layers) - 1
    executor._access[last] = {KV: CarriedAccess(KV)}  # says: neither reads nor writes (it writes)
    with pytest.warns(UserWarning, match="capture failed"):
        poros_losses, poros_opt = layer_major_steps(streamed, plan)
    assert_bitwise(reference, model, ref_losses, poros_losses, ref_opt, poros_opt)
    report = executor.graphs.report
    assert any(f"of block {last}: StreamingError: layer {last} wrote {KV}['{FULL}']" in f for f in report.failures)
    assert report.eager["capture failed"] > 0


def test_the_descriptor_check_finds_flags_the_layers_lack(checkpoints):
    """The reader / writer flags are attribute paths on transformers' layers: a rename there is a
    descriptor problem the contract check names (else every block would fall back to eager)."""
    from poros.descriptor_check import check_descriptor

    model = load_qlora(checkpoints["shared-kv"], lora_rank=4, lora_alpha=8)
    descriptor = poros.registry.get("gemma4")
    assert not [p for p in check_descriptor(descriptor, model) if "carried_state" in p]
    renamed = tuple(dataclasses.replace(c, reader_flag="self_attn.reads_shared_kv") if c.kind == "mapping" else c
                    for c in descriptor.carried_state)
    problems = check_descriptor(derive(descriptor, carried_state=renamed), model)
    assert f"carried_state['{KV}'].reader_flag 'self_attn.reads_shared_kv' is missing on layers " \
           f"{list(range(8))}" in problems
