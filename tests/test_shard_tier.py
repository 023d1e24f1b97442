"""A pre-quantized (bnb-4bit) checkpoint as the ``mapped`` host tier (issue 43): its blocks stream from its
own safetensors shards, mapped shared and read-only, copied into the slot tensor by tensor; training is
bitwise the pinned tier's, and the ranks of a node share the shards' pages."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

import poros
from conformance_flows import lora_model
from poros.loading.load import load_pretrained
from poros.stream.shard_tier import ShardMappedTier, checkpoint_key
from poros.testing import assert_bitwise_training, train_adamw
from test_distributed import rank_reports, torchrun
from test_prequantized import BATCHES, bnb_checkpoint, keep_cpu_layout

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_layout_names_meet_the_checkpoints():
    assert checkpoint_key("self_attn.q_proj.base_layer.weight") == "self_attn.q_proj.weight"
    assert checkpoint_key("mlp.up_proj.base_layer.weight.quant_state.absmax") == "mlp.up_proj.weight.absmax"
    assert checkpoint_key("mlp.up_proj.weight.quant_state.state2.code") == "mlp.up_proj.weight.nested_quant_map"
    assert checkpoint_key("input_layernorm.weight") == "input_layernorm.weight"


def streamed(checkpoint: pathlib.Path, tier: str):
    loaded = load_pretrained(checkpoint, device="cpu", load_tokenizer=False, _blocks_to_host_on_cpu=True)
    return poros.prepare(lora_model(keep_cpu_layout(loaded.model), seed=5), host_tier=tier)


@pytest.mark.parametrize("family", ["qwen3", "gemma4"])
def test_the_mapped_shards_train_bitwise_the_pinned_tier(family, tmp_path):
    _, checkpoint = bnb_checkpoint(tmp_path, family, seed=2)
    runs = {}
    for tier in ("pinned", "mapped"):
        model = streamed(checkpoint, tier)
        runs[tier] = (model, *train_adamw(model, model.trainable_parameters(), BATCHES))
    mapped = runs["mapped"][0].store.host_tier
    assert isinstance(mapped, ShardMappedTier) and runs["mapped"][0].host_plan.tier == "mapped"
    stats = mapped.stats
    # the packed weights, scales and norms come from the shards; pinned beside them only what the file has no
    # tensor of (the nested quant state's offset, a number in its JSON), a few bytes each
    assert stats["mapped_bytes"] > 0.9 * (stats["mapped_bytes"] + stats["pinned_bytes"])
    assert stats["pinned_bytes"] <= 4 * stats["pinned_tensors"]
    # the loaded copies were handed over to their twins in the shards as they were checked (one copy at the start)
    assert stats["handed_over_bytes"] >= 0.9 * stats["mapped_bytes"], stats
    shards = {str(p) for p in checkpoint.glob("*.safetensors")}
    assert {str(p) for p in mapped.mappings} <= shards and mapped.mappings
    pinned, losses, optimizer = runs["pinned"]
    model, mapped_losses, mapped_optimizer = runs["mapped"]
    assert_bitwise_training(pinned, model, losses, mapped_losses, optimizer, mapped_optimizer)


SHARED_SHARDS_RANK = """
import json, pathlib, sys
import torch.distributed as dist
from poros import PorosConfig, PorosTrainer
from poros.distributed import leave_process_group
from poros.testing import mapping_memory
out, checkpoint = pathlib.Path(sys.argv[1]), sys.argv[2]
config = PorosConfig(model=checkpoint, dataset="synthetic", steps=1, save_steps=1, batch_size=2, seq_len=32, logging_steps=1,
                     output_dir=str(out / "run"))
trainer = PorosTrainer.from_config(config)
trainer.train()
tier = trainer.model.store.host_tier
shards = sorted(str(p) for p in tier.mappings)
dist.barrier()  # both ranks alive and mapped: each one's Pss counts the other's share
memory = {shard: mapping_memory("self", shard, mode="r--s") for shard in shards}
dist.barrier()
(out / f"rank{dist.get_rank()}.json").write_text(json.dumps({"tier": type(tier).__name__, "plan": trainer.model.host_plan.tier,
    "rss_kb": sum(r for r, _ in memory.values()), "pss_kb": sum(p for _, p in memory.values()), "shards": shards}))
del trainer, tier
leave_process_group()
"""


def test_two_ranks_share_the_shards_pages(child_env, tmp_path):
    _, checkpoint = bnb_checkpoint(tmp_path, "qwen3", seed=3)
    script = tmp_path / "rank.py"
    script.write_text(SHARED_SHARDS_RANK)
    out = tmp_path / "out"
    out.mkdir()
    done = torchrun(child_env, str(script), str(out), str(checkpoint), timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    reports = rank_reports(out)
    assert [(r["tier"], r["plan"]) for r in reports] == [("ShardMappedTier", "mapped")] * 2
    assert reports[0]["shards"] == reports[1]["shards"] and reports[0]["shards"]
    rss, pss = [r["rss_kb"] for r in reports], [r["pss_kb"] for r in reports]
    assert min(rss) > 0, rss  # the blocks' pages are resident in both ranks, as the shards' mapping
    assert sum(pss) <= max(rss) + 8, f"Rss {rss} kB, Pss {pss} kB: each rank holds its own copy of the pages"


def private_resident_bytes(files) -> int:
    """Bytes resident in this process's private mappings of ``files`` (``/proc/self/smaps``)."""
    import os
    wanted, total, inside = {os.path.realpath(f) for f in files}, 0, False
    for line in pathlib.Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5 and all(c in "0123456789abcdef-" for c in fields[0]):
            inside = len(fields) == 6 and fields[1][3] == "p" and os.path.realpath(fields[5]) in wanted
        elif inside and fields[0] == "Rss:":
            total += int(fields[1]) * 1024
    return total


@pytest.mark.skipif(not pathlib.Path("/proc/self/smaps").exists(), reason="reads Linux's /proc/self/smaps")
def test_the_loaders_view_of_the_shards_is_given_back(tmp_path):
    # transformers reads the blocks through its own private mapping of each shard; checked against the tier's
    # shared mapping, the pages were resident in both and the RSS counted the blocks twice (74 GB at 72B)
    _, checkpoint = bnb_checkpoint(tmp_path, "qwen3", seed=3, hidden_size=512, intermediate_size=4096)
    model = streamed(checkpoint, "mapped")
    stats = model.store.host_tier.stats
    assert stats["handed_over_bytes"] >= 0.9 * stats["mapped_bytes"] > 2**20, stats
    assert private_resident_bytes(checkpoint.glob("*.safetensors")) < 0.1 * stats["mapped_bytes"]
    losses = train_adamw(model, model.trainable_parameters(), BATCHES)[0]
    assert all(torch.isfinite(torch.tensor(losses)))
