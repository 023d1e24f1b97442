"""The host tier contract and the one host tier decision.

* every tier named in ``poros.config.HOST_TIERS`` is a ``poros.stream.tiers.HostTier`` and hands a block's
  bytes back bitwise: as packed, after a ``load_state_dict`` rewrote them (``keep``), and through a
  ``BlockStore`` (fetch, then restore);
* the names are one list: the config's choices, the planner and the engine's tier classes read it;
* ``prepare`` and ``poros plan`` take the host tier from one function (``plan_host_tier``), with the same
  arguments and the same answer for the same run options.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from poros.cli.main import main
from poros.config import HOST_TIERS, PorosConfig
from poros.errors import ConfigError, StreamingError
from poros.plan import host_tiers
from poros.stream import tiers
from poros.stream.packing import block_layouts, entry_view, frozen_tensors
from poros.stream.store import BlockStore
from poros.testing import save_tiny_checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiers") / "ckpt", "qwen3", seed=4, num_layers=4)


def decoder_layers(checkpoint, **load_options):
    """A QLoRA model of ``checkpoint`` (double quant: nested QuantStates) and its decoder layers."""
    from conformance_flows import load

    model = load(checkpoint, double_quant=True, **load_options)
    return model, list(model.get_base_model().model.layers)


def same_bytes(got: torch.Tensor, expected: torch.Tensor, entries) -> bool:
    """Every tensor region of two block buffers holds the same bytes (the padding between them is not data)."""
    def raw(buffer, entry):
        return entry_view(buffer, entry).reshape(-1).contiguous().view(torch.uint8)

    return all(torch.equal(raw(got, entry), raw(expected, entry)) for entry in entries)


def packed(layout) -> torch.Tensor:
    """A block's buffer as the store packs it, built here without any tier."""
    entries, tensors, nbytes = layout
    buffer = torch.zeros(nbytes, dtype=torch.uint8)
    for entry, tensor in zip(entries, tensors):
        entry_view(buffer, entry).copy_(tensor)
    return buffer


def test_the_tier_names_are_one_list():
    assert tuple(tiers.TIER_CLASSES) == HOST_TIERS and host_tiers.HOST_TIERS is HOST_TIERS
    choices = {f.name: f.metadata["choices"] for f in dataclasses.fields(PorosConfig)}["host_tier"]
    assert choices == (None, *HOST_TIERS)
    for name in HOST_TIERS:
        assert host_tiers.choose_host_tier([10, 10], requested=name).tier == name
        assert PorosConfig(host_tier=name).host_tier == name
    with pytest.raises(ConfigError, match="host_tier='swap'"):
        host_tiers.choose_host_tier([10, 10], requested="swap")
    with pytest.raises(StreamingError, match="expected one of pinned, mapped, disk"):
        tiers.make_host_tier("swap")


@pytest.mark.parametrize("name", HOST_TIERS)
def test_every_tier_keeps_the_contract_and_hands_back_a_blocks_bytes(name, checkpoint, tmp_path):
    _, layers = decoder_layers(checkpoint)
    layouts = dict(enumerate(block_layouts(layers)))
    streamed = {i: layout for i, layout in layouts.items() if i != 2}  # a gap: block 2 stays on the device
    expected = {i: packed(layout) for i, layout in streamed.items()}
    tier = tiers.make_host_tier(name, read_ahead=2, spill_dir=tmp_path / "spill")
    assert isinstance(tier, tiers.HostTier) and tier.name == name
    tier.attach(streamed, torch.device("cpu"))
    for _ in range(2):  # twice over: the disk tier's ring turns and reads ahead
        for index in [*streamed, *reversed(streamed)]:
            entries = streamed[index][0]
            host = tier.host_buffer(index)
            assert host is None or same_bytes(host, expected[index], entries)
            assert same_bytes(tier.acquire(index), expected[index], entries)
            tier.copied(index, None)
    for index, (entries, _, _) in streamed.items():
        assert same_bytes(tier.lend(index), expected[index], entries)
    # a load_state_dict writes a frozen tensor of an evicted block into the lent bytes; the tier serves them
    entries = streamed[1][0]
    lent = tier.lend(1)
    lent[entries[0].offset] += 1
    rewritten = expected[1].clone()
    rewritten[entries[0].offset] += 1
    tier.keep(1, lent)
    for index in (0, 1, 3):
        want = rewritten if index == 1 else expected[index]
        assert same_bytes(tier.acquire(index), want, streamed[index][0])
        tier.copied(index, None)
        assert same_bytes(tier.lend(index), want, streamed[index][0])
    if name != "pinned":  # a file tier never writes its file
        assert same_bytes(tiers.write_block_file(tmp_path / "again.bin", {1: streamed[1]}, 2).block_view(1), expected[1],
                          entries)
    tier.close()


@pytest.mark.parametrize("name", HOST_TIERS)
def test_every_tier_streams_a_store_bitwise(name, checkpoint, tmp_path):
    _, layers = decoder_layers(checkpoint)
    before = [{key: tensor.clone() for key, _, _, _, tensor in frozen_tensors(layer)} for layer in layers]

    def assert_as_loaded(index):
        now = {key: tensor for key, _, _, _, tensor in frozen_tensors(layers[index])}
        assert now.keys() == before[index].keys()
        for key, tensor in now.items():
            assert torch.equal(tensor.reshape(-1).view(torch.uint8), before[index][key].reshape(-1).view(torch.uint8)), key

    tier = tiers.make_host_tier(name, read_ahead=2, spill_dir=tmp_path / "spill")
    store = BlockStore(layers, "cpu", num_slots=2, resident=[3], host_tier=tier)
    assert store.host_tier is tier
    for index in [0, 1, 2, 3, 2, 1, 0]:
        store.fetch(index)
        store.wait(index)
        assert_as_loaded(index)
        store.release(index)
    store.restore()
    for index in range(len(layers)):
        assert_as_loaded(index)


def test_the_store_defaults_to_the_pinned_tier(checkpoint):
    _, layers = decoder_layers(checkpoint)
    store = BlockStore(layers, "cpu")
    assert isinstance(store.host_tier, tiers.PinnedTier)
    assert all(block.buffer is store.host_tier.host_buffer(block.index) for block in store.blocks)
    store.restore()


def test_the_pinned_tier_holds_every_block_in_one_arena_at_its_packed_size(checkpoint):
    """One host arena for all blocks, each at a 4 KiB-aligned offset (page-locked by registering it on CUDA), not one
    allocation of torch's pinned allocator per block, which rounds each up to a power of two: a 1.39 GB block of
    the 122B-A10B takes 2 GiB there. The host bytes are the packed bytes plus at most the alignment per block; closing
    the tier lets the arena go."""
    _, layers = decoder_layers(checkpoint)
    store = BlockStore(layers, "cpu")
    tier = store.host_tier
    arena = tier.arena
    storage = arena.raw.untyped_storage().data_ptr()
    assert all(tier.host_buffer(b.index).untyped_storage().data_ptr() == storage for b in store.blocks)
    sizes = [b.nbytes for b in store.blocks]
    assert sum(sizes) <= arena.raw.numel() <= sum(sizes) + (len(sizes) + 1) * tiers.FILE_ALIGN
    assert [tier.host_buffer(b.index).numel() for b in store.blocks] == sizes
    store.restore()
    assert tier.arena is None


# -- one decision: prepare and poros plan -----------------------------------------------------------

RUN_OPTIONS = {  # PorosConfig fields -> poros plan arguments
    "default": {},
    "disk asked for": {"host_tier": "disk", "read_ahead": 2},
    "pinned asked for": {"host_tier": "pinned"},
    "tight host budget": {"host_budget": "held", "read_ahead": 2},  # set below: the ring and one held block
    "no cache": {"no_cache": True},
}


@pytest.mark.parametrize("case", RUN_OPTIONS)
def test_prepare_and_poros_plan_take_the_host_tier_from_one_function(case, checkpoint, tmp_path, capsys,
                                                                     monkeypatch):
    import poros
    from conformance_flows import lora_model
    from poros.loading.load import load_pretrained
    from poros.stream.store import packed_block_bytes

    options = dict(RUN_OPTIONS[case], cache_dir=str(tmp_path / "cache"))
    # the model as PorosTrainer.from_config loads it: through the NF4 block cache unless no_cache
    loaded = load_pretrained(checkpoint, device="cpu", load_tokenizer=False,
                             cache_dir=None if options.get("no_cache") else tmp_path / "cache")
    model = lora_model(loaded.model, seed=4)
    sizes = packed_block_bytes(list(model.get_base_model().model.layers))
    if options.get("host_budget") == "held":
        options["host_budget"] = str(2 * max(sizes) + sizes[0] + 10)  # below the 4 blocks
    config = PorosConfig(model=str(checkpoint), device="cpu", seq_len=64, **options)
    calls = []
    real = host_tiers.plan_host_tier

    def recording(*args, **kwargs):
        plan = real(*args, **kwargs)
        calls.append(((list(args[0]), sorted(args[1]), kwargs), plan))
        return plan

    monkeypatch.setattr(host_tiers, "plan_host_tier", recording)
    # poros plan, for a budget where every block streams (as prepare without a VRAM budget streams them)
    argv = ["plan", "--model", str(checkpoint), "--device", "cpu", "--seq-len", "64", "--json"]
    for key, value in options.items():
        argv += [f"--{key.replace('_', '-')}"] + ([] if value is True else [str(value)])
    assert main([*argv, "--vram-budget", "1GiB"]) == 0
    minimum = json.loads(capsys.readouterr().out)["plan"]["pipelined_minimum_bytes"]
    calls.clear()
    assert main([*argv, "--vram-budget", str(minimum)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["plan"]["resident_blocks"] == []
    # prepare, with the options PorosTrainer.from_config passes it
    prepared = poros.prepare(model, host_tier=config.host_tier, host_budget=config.host_budget,
                             read_ahead=config.read_ahead, cache_dir=config.cache_dir)
    [(planned_with, planned), (prepared_with, chosen)] = calls
    assert planned_with == prepared_with  # the same inputs (block bytes, resident blocks, options) ...
    assert planned == chosen == prepared.host_plan  # ... the same decision
    assert report["host"] == chosen.to_dict() and prepared.store.host_tier.name == chosen.tier
    assert chosen.tier == {"default": "mapped", "disk asked for": "disk", "pinned asked for": "pinned",
                           "tight host budget": "disk", "no cache": "pinned"}[case]
    assert chosen.held_blocks == (case == "tight host budget")
    prepared.unpatch()
