"""``StreamOptions``: one frozen object carries every streaming option from the config, the command line
or ``prepare(**keywords)`` to the planner, the store and the executor; it refuses what it cannot take.

The executor is built whole (its parts given at construction), and layer-major's phase switch is one
state that a failed call leaves as it found it.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

import poros
from poros.config import PorosConfig
from poros.errors import ConfigError
from poros.plan import budget as planner
from poros.stream.options import StreamOptions, Workload, option_names
from poros.stream.tiers import DiskTier
from poros.testing import load_qlora, save_tiny_checkpoint
from test_parity import make_batch

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("options") / "ckpt", "qwen3", seed=3, num_layers=3)


# -- the object ------------------------------------------------------------------------------------
def test_the_options_are_frozen_and_replace_makes_a_checked_copy():
    options = StreamOptions(num_slots=3, resident_blocks=[2, 0, 2], workload={"seq_len": 16})
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.num_slots = 1
    assert options.resident_blocks == (0, 2) and options.workload == Workload(seq_len=16)
    changed = options.replace(num_slots=1)
    assert (changed.num_slots, options.num_slots) == (1, 3) and changed.resident_blocks == (0, 2)
    assert changed == StreamOptions(num_slots=1, resident_blocks=(0, 2), workload=Workload(seq_len=16))
    with pytest.raises(ConfigError, match="num_slots=0"):
        options.replace(num_slots=0)
    assert StreamOptions(num_slots=None, lora_placement=None) == StreamOptions()  # None: the defaults


@pytest.mark.parametrize("option, value, message", [
    ("num_slots", 0, "num_slots=0: expected an integer >= 1"),
    ("num_slots", True, "num_slots=True"),
    ("resident_blocks", -1, "resident_blocks=-1"),
    ("resident_blocks", True, "resident_blocks=True"),
    ("resident_blocks", [0, "1"], "resident_blocks="),
    ("embeddings_on_host", "yes", "embeddings_on_host='yes'"),
    ("require", "exact", "require='exact'"),
    ("vram_budget", "7 GB?", "vram_budget='7 GB\\?'"),
    ("workload", {"seq": 16}, "workload has unknown keys \\['seq'\\]"),
    ("workload", 512, "workload=512"),
    ("boundary_states", "swap", "boundary_states='swap'"),
    ("optimizer_states", "disk", "optimizer_states='disk'"),
    ("host_tier", "swap", "host_tier='swap'"),
    ("host_budget", "lots", "host_budget"),
    ("read_ahead", 1, "read_ahead=1"),
    ("cuda_graphs", "yes", "cuda_graphs='yes'"),
    ("cuda_graphs", None, "cuda_graphs=None"),
    ("lora_placement", "sideways", "lora_placement='sideways'"),
    ("loss_chunks", 0, "loss_chunks=0"),
])
def test_an_invalid_value_is_refused_by_name(option, value, message):
    with pytest.raises(ConfigError, match=message):
        StreamOptions(**{option: value})


def test_an_unknown_option_is_refused_with_the_closest_name(checkpoint):
    with pytest.raises(ConfigError, match="unknown option 'num_slot'; did you mean 'num_slots'"):
        StreamOptions.from_keywords(num_slot=2)
    with pytest.raises(ConfigError, match="StreamOptions.replace\\(\\) got an unknown option 'cuda_graph'"):
        StreamOptions().replace(cuda_graph=True)
    model = load_qlora(checkpoint, seed=3)
    with pytest.raises(ConfigError, match="prepare\\(\\) got an unknown option 'num_slot'"):
        poros.prepare(model, num_slot=2)
    with pytest.raises(ConfigError, match="Pass one of the two"):
        poros.prepare(model, resident_blocks=1, vram_budget="1GiB", workload={"seq_len": 16})
    with pytest.raises(ConfigError, match="expected a poros.StreamOptions"):
        poros.prepare(model, options={"num_slots": 2})
    assert all(p.numel() > 0 for p in model.parameters())  # refused before anything moved
    poros.prepare(model).unpatch()


def test_prepare_shows_every_option_in_its_signature():
    parameters = inspect.signature(poros.prepare).parameters
    assert list(parameters) == ["model", "options", *option_names()]
    assert {name: parameters[name].default for name in option_names()} == StreamOptions().to_dict()


def test_a_config_gives_every_option_it_has():
    config = PorosConfig(num_slots=3, embeddings_on_host=True, require="numerical", vram_budget="6GiB",
                         optimizer_states="host", lora_placement="host", host_tier="disk", host_budget="2GiB",
                         read_ahead=4, cache_dir="/tmp/poros-cache", cuda_graphs="auto", loss_chunks=2,
                         batch_size=2, seq_len=64, grad_accum=4)
    options = StreamOptions.from_config(config)
    shared = set(option_names()) & {f.name for f in dataclasses.fields(PorosConfig)}
    assert shared == set(option_names()) - {"resident_blocks", "workload", "boundary_states"}
    assert all(getattr(options, name) == getattr(config, name) for name in shared)
    assert options.workload == Workload(2, 64, 4, "layer-major", 2)
    assert StreamOptions.from_config(config, schedule="micro-major").workload.schedule == "micro-major"
    assert StreamOptions.from_config(config, num_slots=1, boundary_states="host").num_slots == 1


# -- carried whole -----------------------------------------------------------------------------------
def test_options_on_the_command_line_reach_the_executor_and_the_store(tmp_path):
    """``poros train --cuda-graphs auto --host-tier disk ...``: the trainer hands prepare one object, and
    the executor is built with it (the choices prepare made filled in), the store with its host tier."""
    from poros.cli.arguments import load_config
    from poros.training.trainer import PorosTrainer

    config = load_config(["--device", "cpu", "--no-cache", "--cache-dir", str(tmp_path / "cache"),
                          "--cuda-graphs", "auto", "--host-tier", "disk", "--read-ahead", "2", "--loss-chunks", "2",
                          "--num-slots", "1", "--lora-rank", "4", "--lora-alpha", "8",
                          "--output-dir", str(tmp_path / "out")])
    model = PorosTrainer.from_config(config).model
    options = model.executor.options
    assert options is model.stream_options
    assert (options.cuda_graphs, options.host_tier, options.read_ahead, options.loss_chunks) == ("auto", "disk", 2, 2)
    assert options.embeddings_on_host is False and options.boundary_states == "device"  # filled in: CPU, no budget
    assert options.optimizer_states == "device" and options.lora_placement == "device"  # "auto" without a budget
    assert isinstance(model.store.host_tier, DiskTier) and model.host_plan.read_ahead == 2
    assert model.store.num_slots == 1 and model.executor.graphs is None  # off on CPU whatever the setting
    causal_lm = model.causal_lm
    assert causal_lm.loss_function.keywords == {"chunks": 2}  # prepare installed the chunked loss
    model.unpatch()
    assert "_loss_function" not in causal_lm.__dict__  # and unpatch removed it


def test_prepare_takes_an_options_object_and_keywords_over_it(checkpoint):
    options = StreamOptions(num_slots=1, boundary_states="host", resident_blocks=1)
    streamed = poros.prepare(load_qlora(checkpoint, seed=3), options=options, resident_blocks=2)
    assert streamed.store.num_slots == 1 and streamed.store.resident_blocks == (1, 2)
    assert streamed.executor.options == options.replace(resident_blocks=2, embeddings_on_host=False,
                                                        lora_placement="device", optimizer_states="device",
                                                        host_tier="pinned")
    assert streamed.executor.boundary_states == "host"
    with pytest.raises(AttributeError):  # read from the options the executor was built with, never assigned
        streamed.executor.boundary_states = "device"
    with pytest.raises(ConfigError, match="resident_blocks names \\[5\\]"):
        poros.prepare(load_qlora(checkpoint, seed=3), resident_blocks=[5])


def test_the_planner_takes_the_options_object():
    footprint = planner.Footprint(block_bytes=(100,) * 4, device_non_block_bytes=50, host_embedding_bytes=30,
                                  lora_parameter_bytes=40, boundary_bytes=10, recompute_bytes=20, head_bytes=60)
    with pytest.raises(ConfigError, match="without a vram_budget"):
        planner.plan_budget(footprint, Workload(), StreamOptions())
    plan = planner.plan_budget(footprint, Workload(), StreamOptions(vram_budget=10**6, num_slots=1,
                                                                    embeddings_on_host=False))
    assert plan.requested_slots == 1 and not plan.embeddings_on_host and plan.optimizer_states == "device"


def test_loss_chunks_has_one_value_beside_a_workload(checkpoint):
    """``prepare(loss_chunks=8, workload=...)``: the step the budget is planned for carries the user's 8 (it
    used to plan for the workload's 1 and write that back), and a workload's own chunks become the option."""
    options = StreamOptions(loss_chunks=8, workload={"seq_len": 16})
    assert options.loss_chunks == options.workload.loss_chunks == options.budget_workload().loss_chunks == 8
    assert options.replace(loss_chunks=2).workload.loss_chunks == 2
    assert StreamOptions(workload=Workload(seq_len=16, loss_chunks=4)).loss_chunks == 4
    with pytest.raises(ConfigError, match="loss_chunks=8 with a workload of loss_chunks=4"):
        StreamOptions(loss_chunks=8, workload=Workload(seq_len=16, loss_chunks=4))
    streamed = poros.prepare(load_qlora(checkpoint, seed=3), loss_chunks=8, vram_budget="64GiB",
                             workload={"seq_len": 16})
    assert streamed.budget_plan.loss_chunks == streamed.stream_options.loss_chunks == 8
    assert streamed.causal_lm.loss_function.keywords == {"chunks": 8}
    streamed.unpatch()


# -- the phase switch ---------------------------------------------------------------------------------
def test_a_failed_layer_major_call_leaves_the_model_streaming(checkpoint):
    """A micro-batch that fails inside the model's prelude call: forward_backward raises that error, and
    the next calls (ordinary and layer-major) stream as before, with the same loss bits."""
    streamed = poros.prepare(load_qlora(checkpoint, seed=3))
    batch = make_batch(3, 2, 12, "none")
    broken = {**batch, "input_ids": batch["input_ids"].float()}  # an embedding lookup refuses float ids
    with pytest.raises(RuntimeError):
        streamed.forward_backward([batch, broken])
    streamed.zero_grad(set_to_none=True)
    (layer_major,) = streamed.forward_backward([batch])
    streamed.zero_grad(set_to_none=True)
    plain = streamed(**batch)
    assert torch.equal(layer_major, plain.loss.detach()) and plain.logits is not None
