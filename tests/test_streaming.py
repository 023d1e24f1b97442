"""Streaming is real: blocks live on the host, come in once per pass, and an evicted block cannot compute.

Also the negative controls that prove the parity checks can fail, a family the executor has never
seen (registered by a plugin inside the test), and the rule that the engine names no family.
"""

from __future__ import annotations

import pathlib
import re

import pytest
import torch
import transformers

import poros
from poros import registry
from poros.descriptor import decoder_family
from poros.errors import StreamingError
from poros.stream.executor import StreamingExecutor
from poros.testing import load_qlora, registered_plugin, save_tiny_checkpoint
from test_parity import BASE_SETUP, assert_bitwise, make_batch, run_parity, train, trainable

ENGINE = pathlib.Path(poros.__file__).parent / "stream"


@pytest.fixture(scope="module")
def gemma4_checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("g4") / "ckpt", "gemma4", "e2b", seed=5)


def test_blocks_stream_once_per_pass_and_residency_is_bounded(gemma4_checkpoint):
    model = poros.prepare(load_qlora(gemma4_checkpoint, seed=5), num_slots=2)
    blocks = len(model.store.blocks)
    # after prepare nothing is resident and every frozen tensor is a placeholder
    assert not model.store.stats.resident
    for record in model.store.blocks:
        for entry in record.entries:
            if entry.kind == "param":
                assert entry.owner.numel() == 0, entry.name
            elif entry.kind == "quant":
                assert getattr(entry.owner, entry.attr).numel() == 0, entry.name
    assert model.store.host_bytes > 0

    batch = make_batch(0, 2, 16, "left")
    for _ in range(2):
        model.store.stats.reset()
        model(**batch).loss.backward()
        stats = model.store.stats
        assert stats.max_resident <= 2
        # forward fetches every block once; backward once more, except the last block,
        # which stays resident across the turn from forward to backward
        assert stats.fetches == [2] * (blocks - 1) + [1]
        forward_order = [i for kind, i in stats.log if kind == "fetch"][:blocks]
        assert forward_order == list(range(blocks))
        backward_order = [i for kind, i in stats.log if kind == "release"][blocks - 1:]
        assert backward_order == list(range(blocks - 1, -1, -1))
        assert not stats.resident
        assert stats.bytes_copied == sum(b.nbytes for b in model.store.blocks) * 2 - model.store.blocks[-1].nbytes
    # the event log keeps the latest events only: a long run does not grow it without end
    assert model.store.stats.log.maxlen is not None


def test_the_store_allocates_nothing_in_the_block_loop(gemma4_checkpoint):
    """The block store's part of the loop -- fetch / wait / release -- copies into the preallocated
    slots and binds views of them: no allocation (the profiler counts every one). The blocks' own
    compute allocates its activations, as in the resident model."""
    from torch.profiler import ProfilerActivity, profile

    store = poros.prepare(load_qlora(gemma4_checkpoint, seed=5), num_slots=2).store
    slots = [slot.data_ptr() for slot in store.slots]

    def loop():
        for index in range(len(store.blocks)):
            store.fetch(index)
            store.wait(index)
            if index:
                store.release(index - 1)
        store.release_all()

    loop()  # first pass: placeholders are made once and cached
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as trace:
        loop()
    allocations = [(event.name, event.cpu_memory_usage) for event in trace.events() if event.cpu_memory_usage > 0]
    assert not allocations
    assert [slot.data_ptr() for slot in store.slots] == slots
    # the control: the same profiler does see an allocation made in such a loop
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as trace:
        store.blocks[0].buffer.clone()
    assert any(event.cpu_memory_usage > 0 for event in trace.events())


def test_one_slot_still_trains_bitwise(tmp_path):
    path = save_tiny_checkpoint(tmp_path / "ckpt", "qwen3", seed=4)
    batches = [make_batch(s, 2, 12, "right") for s in range(2)]
    reference = load_qlora(path, seed=4)
    ref_losses, ref_opt = train(reference, list(trainable(reference).values()), batches)
    model = load_qlora(path, seed=4)
    streamed = poros.prepare(model, num_slots=1)
    losses, opt = train(streamed, streamed.trainable_parameters(), batches)
    assert streamed.store.stats.max_resident == 1
    assert_bitwise(reference, model, ref_losses, losses, ref_opt, opt)


def test_computing_with_an_evicted_block_raises(gemma4_checkpoint):
    model = poros.prepare(load_qlora(gemma4_checkpoint, seed=5))
    layer = model.store.blocks[0].module
    hidden = torch.zeros(1, 4, model.config.hidden_size, dtype=torch.bfloat16)
    with pytest.raises(StreamingError, match="evicted"):
        layer(hidden)
    # a module inside the block, called directly, is guarded too
    with pytest.raises(StreamingError, match="evicted"):
        layer.mlp.up_proj.base_layer(hidden)
    # and the placeholders fail on their own, even without the guard hooks
    for hook in model.store._hooks:
        hook.remove()
    with pytest.raises(RuntimeError):
        layer.input_layernorm(hidden)
    with pytest.raises(RuntimeError):
        layer.mlp.up_proj.base_layer(hidden)
    # an evicted model can still be moved (HF Trainer calls model.to(device))
    model.to("cpu")


def test_store_survives_in_place_repacking(gemma4_checkpoint):
    """bitsandbytes repacks a Linear4bit's weight and QuantState in place on some CPUs (eval, no grad).

    Simulate that on any CPU: mutate the fetched block's weights and quant state, release, fetch again:
    the block comes back from its host buffer exactly as packed.
    """
    model = poros.prepare(load_qlora(gemma4_checkpoint, seed=5))
    store = model.store
    store.fetch(0)
    record = store.blocks[0]
    before = {e.name: store._view(record.host, e).clone() for e in record.entries}
    for entry in record.entries:
        if entry.kind == "param":
            entry.owner.data = torch.zeros(3, dtype=torch.uint8)
        elif entry.kind == "quant":
            setattr(entry.owner, entry.attr, torch.zeros(1))
            entry.owner.packing_format_for_cpu = True
    store.release(0)
    store.fetch(0)
    for entry in record.entries:
        current = entry.owner if entry.kind == "param" else (
            entry.owner._buffers[entry.attr] if entry.kind == "buffer" else getattr(entry.owner, entry.attr))
        assert torch.equal(current, before[entry.name]), entry.name
        if entry.kind == "quant":
            assert not getattr(entry.owner, "packing_format_for_cpu", False)
    store.release(0)


def test_negative_control_dropping_shared_kv_gradients_is_caught(gemma4_checkpoint, monkeypatch):
    """Without the reader-to-writer K/V gradients, Gemma 4's LoRA tensors differ: the check can fail."""
    original = StreamingExecutor._recompute_mappings

    def without_readers(self, step, index, call):
        mappings, _ = original(self, step, index, call)
        return mappings, {}

    monkeypatch.setattr(StreamingExecutor, "_recompute_mappings", without_readers)
    with pytest.raises(AssertionError, match=r"differ|!="):
        run_parity("gemma4", "e2b", BASE_SETUP, gemma4_checkpoint.parent / "neg")


def test_negative_control_dropping_per_layer_input_gradients_is_caught(gemma4_checkpoint, monkeypatch):
    original = StreamingExecutor._backward_block

    def without_input_grads(self, *args, **kwargs):
        hidden_grad, input_grads, parameter_grads = original(self, *args, **kwargs)
        return hidden_grad, [None for _ in input_grads], parameter_grads

    monkeypatch.setattr(StreamingExecutor, "_backward_block", without_input_grads)
    with pytest.raises(AssertionError, match=r"differ|!="):
        run_parity("gemma4", "e2b", BASE_SETUP, gemma4_checkpoint.parent / "neg2")


class LlamaFamilyPlugin:
    """A family the executor has never seen, described only by its descriptor."""

    __name__ = "test-llama-family"

    @poros.hookimpl
    def poros_register_architectures(self, register):
        register(decoder_family(name="llama", display_name="Llama", model_types=("llama",),
                                causal_lm_classes=("LlamaForCausalLM",), config_class="LlamaConfig"))


def test_plugin_family_streams_through_its_descriptor_alone(tmp_path):
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(tmp_path / "llama")
    batches = [make_batch(s, 2, 16, "left") for s in range(2)]
    with registered_plugin(LlamaFamilyPlugin()):
        assert registry.get("llama").name == "llama"
        reference = load_qlora(tmp_path / "llama", seed=0)
        ref_losses, ref_opt = train(reference, list(trainable(reference).values()), batches)
        model = load_qlora(tmp_path / "llama", seed=0)
        streamed = poros.prepare(model)
        assert streamed.descriptor.name == "llama"
        losses, opt = train(streamed, streamed.trainable_parameters(), batches)
    assert_bitwise(reference, model, ref_losses, losses, ref_opt, opt)


def test_unknown_family_lists_registered_ones(tmp_path):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(poros.errors.UnknownArchitectureError, match="qwen2.*gemma4"):
        poros.prepare(model)


def test_engine_names_no_family():
    names = {n.lower() for r in registry.architectures() for n in r.descriptor.all_names}
    names |= {"qwen", "gemma", "llama", "mistral"}
    for path in sorted(ENGINE.glob("*.py")):
        text = path.read_text().lower()
        found = sorted(n for n in names if re.search(rf"\b{re.escape(n)}", text))
        assert not found, f"{path.name} mentions family names {found}; family facts belong in descriptors"


def test_executor_opens_with_its_dataflow_picture():
    text = (ENGINE / "executor.py").read_text()
    docstring = text.split('"""')[1]
    assert "host" in docstring and "forward" in docstring and "backward" in docstring and "──" in docstring
