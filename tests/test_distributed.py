"""Data parallel: two gloo ranks started through ``torch.distributed.run``, Poros under DDP bitwise equal
to the resident model under DDP (every loss on each rank, every LoRA tensor, every AdamW state tensor).

Each test starts one torchrun job (``poros.testing.distributed`` or ``python -m poros train``) in a
subprocess with a timeout, so a hang fails the test instead of the CI run; ``--standalone`` picks a
free port. Ranks write JSON; the test reads it.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import torch

import poros
from poros.testing import TINY_VARIANTS, qlora_model

CASES = [f"{family}:{variant}" for family, variants in TINY_VARIANTS.items() for variant in variants]
TIMEOUT_S = 420


def torchrun(child_env, *arguments: str, ranks: int = 2, timeout: int = TIMEOUT_S, **env: str):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
               *arguments]
    return subprocess.run(command, env=child_env(OMP_NUM_THREADS="1", POROS_DIST_TIMEOUT="60", **env),
                          capture_output=True, text=True, timeout=timeout)


def rank_reports(out, ranks: int = 2) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]


def parity_job(child_env, out, cases: list[str], modes: str, *extra: str):
    done = torchrun(child_env, "-m", "poros.testing.distributed", "--out", str(out), "--cases", ",".join(cases),
                    "--modes", modes, *extra)
    reports = rank_reports(out)
    return done, reports


def test_every_family_under_ddp_is_bitwise_resident_ddp(child_env, tmp_path):
    """Micro-major (DDP with and without find_unused_parameters), no_sync accumulation and layer-major
    accumulation (reduced by poros.distributed.all_reduce_gradients), every family, two ranks."""
    done, reports = parity_job(child_env, tmp_path, CASES, "micro,accum", "--steps", "1")
    for report in reports:
        assert report["world_size"] == 2 and report["backend"] == "gloo"
        failed = {k: v for k, v in report["results"].items() if not v["equal"]}
        assert not failed, (failed, done.stderr[-3000:])
        assert len(report["results"]) == 2 * len(CASES)
    # the ranks trained on different shards: their losses differ, their adapters (compared above) agree
    first = "qwen3:default/micro"
    assert reports[0]["results"][first]["find_unused=True"]["losses"] != \
        reports[1]["results"][first]["find_unused=True"]["losses"]
    assert done.returncode == 0


def test_hf_trainer_drop_in_under_ddp_and_a_negative_control(child_env, tmp_path):
    """HF Trainer makes the DDP wrapper around the model given ``prepare`` / ``patch_hf_model``: bitwise.
    And the parity check can fail: layer-major without the all-reduce (each rank keeps its own
    gradients) differs."""
    done, reports = parity_job(child_env, tmp_path, ["qwen3:default"], "hf_prepare,hf_patch,accum", "--control",
                               "--steps", "1")
    for report in reports:
        for mode in ("hf_prepare", "hf_patch"):
            assert report["results"][f"qwen3:default/{mode}"]["equal"], (report, done.stderr[-3000:])
        control = report["results"]["qwen3:default/accum"]
        assert control["micro_major"]["equal"] and not control["layer_major"]["equal"]


def test_ranks_with_different_versions_fail_on_every_rank(child_env, tmp_path):
    done = torchrun(child_env, "-m", "poros.testing.distributed", "--out", str(tmp_path), "--handshake-only",
                    timeout=120, POROS_TEST_FAKE_VERSION_RANK="1")
    assert done.returncode != 0
    for report in rank_reports(tmp_path):
        assert report["error_type"] == "DistributedError"
        assert "torch" in report["error"] and "0.0.0-fake" in report["error"] and "rank 1" in report["error"]


def test_a_rank_that_dies_stops_the_job_without_a_hang(child_env, tmp_path):
    """torchrun stops the other ranks; the collective they wait in fails (gloo: the peer's connection
    closes; NCCL: the process group's timeout, POROS_DIST_TIMEOUT) -- the subprocess timeout is the hang check."""
    done = torchrun(child_env, "-m", "poros.testing.distributed", "--out", str(tmp_path), "--die-rank", "1",
                    timeout=120)
    assert done.returncode != 0
    assert "exitcode  : 7" in done.stderr or "exit code 7" in done.stderr or "exitcode: 7" in done.stderr, \
        done.stderr[-2000:]


def poros_train(child_env, *arguments: str, timeout: int = TIMEOUT_S):
    return subprocess.run([sys.executable, "-m", "poros", "train", *arguments],
                          env=child_env(OMP_NUM_THREADS="1", POROS_DIST_TIMEOUT="60"), capture_output=True,
                          text=True, timeout=timeout)


def test_poros_train_nproc_per_node_2_trains_saves_once_and_resumes_only_with_two(child_env, tmp_path):
    out = tmp_path / "run"
    common = ["--steps", "3", "--save-steps", "2", "--batch-size", "1", "--grad-accum", "2", "--seq-len", "48",
              "--logging-steps", "1", "--output-dir", str(out)]
    done = poros_train(child_env, "--nproc-per-node", "2", *common)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "data parallel over 2 ranks (gloo): global batch 2 = 1 per rank x 2 ranks, x 2 accumulation" in done.stdout
    assert done.stdout.count("poros: saved the adapter to") == 1  # rank 0 writes, once
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3] and all(row["world_size"] == 2 for row in rows)
    assert json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())["world_size"] == 2
    uninterrupted = (out / "checkpoint-3" / "adapter_model.safetensors").read_bytes()

    # as if stopped after step 2: one rank may not resume it (nothing written), two ranks finish it
    # with the adapter the uninterrupted run had, byte for byte
    shutil.rmtree(out / "checkpoint-3")
    before = sorted(p.name for p in out.iterdir())
    refused = poros_train(child_env, "--resume-from", "auto", *common)
    assert refused.returncode == 1
    assert "written by a run over 2 rank(s); this run has 1" in refused.stderr
    assert "--nproc-per-node 2" in refused.stderr and "--nnodes" in refused.stderr  # one node, or several
    assert sorted(p.name for p in out.iterdir()) == before
    resumed = poros_train(child_env, "--nproc-per-node", "2", "--resume-from", "auto", *common)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    assert (out / "checkpoint-3" / "adapter_model.safetensors").read_bytes() == uninterrupted

    # layer-major (above: each rank accumulates block by block, then all_reduce_gradients) and
    # micro-major (DDP with no_sync) train the same adapter, byte for byte
    micro = tmp_path / "micro"
    other = poros_train(child_env, "--nproc-per-node", "2", "--stream-schedule", "micro-major",
                        *common[:-1], str(micro))
    assert other.returncode == 0, other.stderr[-3000:]
    assert (micro / "checkpoint-3" / "adapter_model.safetensors").read_bytes() == uninterrupted


def test_poros_train_nproc_per_node_2_with_the_default_batch(child_env, tmp_path):
    """batch_size is per device (HF's per_device_train_batch_size): the default batch of 1 trains on two ranks,
    a global batch of 2, and poros_config.json records both."""
    out = tmp_path / "run"
    done = poros_train(child_env, "--nproc-per-node", "2", "--steps", "2", "--seq-len", "48", "--output-dir", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "global batch 2 = 1 per rank x 2 ranks, x 1 accumulation = 2 sequences per optimizer step" in done.stdout
    record = json.loads((out / "poros_config.json").read_text())
    assert (record["per_device_batch_size"], record["global_batch_size"], record["world_size"]) == (1, 2, 2)
    assert record["config"]["batch_size"] == 1


SHARED_HOST_COPY_RANK = """
import json, os, pathlib, sys
import torch.distributed as dist
from poros import PorosConfig, PorosTrainer
from poros.distributed import leave_process_group
from poros.testing import mapping_memory
out, tier, cache_dir = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]
# "auto": the chooser's tier, the embedding table on the host (shared by the node's ranks); "pinned": a pinned
# copy of the blocks per rank and the table on the (CPU) device, each rank's own
config = PorosConfig(steps=2, save_steps=2, batch_size=2, seq_len=32, logging_steps=1, output_dir=str(out / "run"),
                     cache_dir=cache_dir, host_tier=None if tier == "auto" else tier,
                     embeddings_on_host=tier == "auto")
trainer = PorosTrainer.from_config(config)
trainer.train()
store = trainer.model.store
entry = str(store.host_tier.file.path) if store.host_tier.name != "pinned" else None
tables = sorted(str(p) for p in pathlib.Path(entry).parent.glob("host-table-*.bin")) if entry else []
dist.barrier()  # both ranks alive and mapped: each one's Pss counts the other's share
rss, pss = mapping_memory("self", entry, mode="r--s") if entry else (0, 0)  # the tier's shared mapping
table_rss, table_pss = mapping_memory("self", tables[0], mode="rw-p") if tables else (0, 0)  # copy-on-write
weight = trainer.model.host_tables[0].module.weight if trainer.model.host_tables else None
dist.barrier()
rank = dist.get_rank()
(out / f"rank{rank}.json").write_text(json.dumps({"tier": trainer.model.host_plan.tier, "entry": entry,
    "ranks_per_node": trainer.model.host_plan.ranks_per_node, "rss_kb": rss, "pss_kb": pss, "tables": tables,
    "table_rss_kb": table_rss, "table_pss_kb": table_pss,
    "table_bytes": weight.numel() * weight.element_size() if weight is not None else 0}))
del trainer, store
leave_process_group()  # every rank, at the end of the script (docs/multi-gpu.md, "Exit")
"""


def test_ranks_of_a_node_share_the_cache_entry_local_rank_0_built(child_env, tmp_path):
    """Two ranks of one node with the block cache on take the mapped tier of the one entry: the entry's pages
    are resident in both and counted once between them (Pss); so are the pages of the embedding table kept
    on the host (one file beside the entry, mapped copy-on-write); and the adapter is byte-equal to the same
    two-rank run with a pinned copy of the blocks per rank and the table in each rank's own memory."""
    script, cache_dir = tmp_path / "rank.py", tmp_path / "cache"
    script.write_text(SHARED_HOST_COPY_RANK)
    reports, adapters = {}, {}
    for tier in ("auto", "pinned"):
        out = tmp_path / tier
        out.mkdir()
        done = torchrun(child_env, str(script), str(out), tier, str(cache_dir), timeout=240)
        assert done.returncode == 0, done.stderr[-3000:]
        reports[tier] = rank_reports(out)
        adapters[tier] = (out / "run" / "checkpoint-2" / "adapter_model.safetensors").read_bytes()
    shared, pinned = reports["auto"], reports["pinned"]
    assert [r["tier"] for r in shared] == ["mapped", "mapped"] and [r["ranks_per_node"] for r in shared] == [2, 2]
    assert [r["tier"] for r in pinned] == ["pinned", "pinned"]  # host_tier given: taken as given
    assert shared[0]["entry"] == shared[1]["entry"] and shared[0]["entry"].startswith(str(cache_dir))
    rss, pss = [r["rss_kb"] for r in shared], [r["pss_kb"] for r in shared]
    size_kb = pathlib.Path(shared[0]["entry"]).stat().st_size // 1024
    assert rss[0] == rss[1] >= size_kb, (rss, size_kb)  # every page of the entry is resident in both ranks
    assert sum(pss) <= max(rss) + 8, f"Rss {rss} kB, Pss {pss} kB: each rank holds its own copy of the pages"
    # the host embedding table: one file beside the entry, mapped by both ranks, its pages counted once
    assert shared[0]["tables"] == shared[1]["tables"] and len(shared[0]["tables"]) == 1
    assert pinned[0]["tables"] == [] or pinned[0]["tables"] == shared[0]["tables"]  # pinned arm: none of its own
    table_kb = shared[0]["table_bytes"] // 1024
    table_rss, table_pss = [r["table_rss_kb"] for r in shared], [r["table_pss_kb"] for r in shared]
    assert min(table_rss) >= table_kb > 0, (table_rss, table_kb)  # resident in both, as the mapping
    assert sum(table_pss) <= max(table_rss) + 8, f"table Rss {table_rss} kB, Pss {table_pss} kB: not shared"
    assert adapters["auto"] == adapters["pinned"]  # the shared copies change no bit


def test_plan_per_gpu_and_host_ram_per_node(capsys):
    from poros.cli.main import main

    assert main(["plan", "--vram-budget", "76MB", "--no-probe", "--json", "--batch-size", "4",
                 "--nproc-per-node", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    node = report["data_parallel"]
    assert report["plan"]["resident_blocks"] == []  # 76 MB: every block streams through the host tier
    assert report["plan"]["workload"]["batch_size"] == 4  # batch_size is per GPU (HF's per_device_train_batch_size)
    assert node["ranks_per_node"] == 2
    assert node["host_bytes_per_node_one_copy_per_rank"] == 2 * node["host_bytes_per_node_shared"] > 0
    # the block cache is on: the ranks map its one entry, and the node holds the blocks once
    assert (report["host"]["tier"], node["host_tier"]) == ("mapped", "mapped")
    assert node["host_bytes_per_node"] == node["host_bytes_per_node_shared"]
    assert main(["plan", "--vram-budget", "76MB", "--no-probe", "--batch-size", "4", "--nproc-per-node", "2"]) == 0
    assert "one copy shared by the ranks (mapped tier)" in capsys.readouterr().out
    # --no-cache: nothing to share, one pinned copy per rank
    assert main(["plan", "--vram-budget", "76MB", "--no-probe", "--json", "--batch-size", "4", "--nproc-per-node", "2",
                 "--no-cache"]) == 0
    report = json.loads(capsys.readouterr().out)
    node = report["data_parallel"]
    assert (report["host"]["tier"], node["host_tier"]) == ("pinned", "pinned")
    assert node["host_bytes_per_node"] == node["host_bytes_per_node_one_copy_per_rank"]
    assert "each of the node's 2 ranks holds its own copy" in report["host"]["reason"]
    assert main(["plan", "--vram-budget", "8GiB", "--no-probe", "--batch-size", "3", "--nproc-per-node", "3"]) == 0
    assert "3 ranks per node, batch 3 per GPU = 9 on the node" in capsys.readouterr().out  # any batch, any ranks


def test_node_host_ram_counts_shared_host_tables_once():
    """poros plan's node host RAM: with the block cache on, the node's ranks map one copy of the host
    embedding tables as of the blocks (mapped tier); with --no-cache each rank holds both its own."""
    from types import SimpleNamespace

    from poros.plan.host_tiers import node_host_ram
    from poros.plan.host_tiers import choose_host_tier

    footprint = SimpleNamespace(block_bytes=[100] * 10, host_embedding_bytes=50)
    shared = node_host_ram(footprint, choose_host_tier(footprint.block_bytes, ranks_per_node=4, shared_file=True),
                           True, shared_tables=True)
    assert shared["host_bytes_per_node"] == shared["host_bytes_per_node_shared"] == 1050
    private = node_host_ram(footprint, choose_host_tier(footprint.block_bytes, ranks_per_node=4, shared_file=False),
                            True, shared_tables=False)
    assert private["host_bytes_per_node"] == private["host_bytes_per_node_one_copy_per_rank"] == 4 * 1050
    alone = node_host_ram(footprint, choose_host_tier(footprint.block_bytes, shared_file=True), True, shared_tables=True)
    assert alone["host_bytes_per_node"] == 1050


def test_host_tables_are_out_of_ddps_sight_and_unpatch_restores(tmp_path):
    """DDP refuses a module whose parameters sit on two device types (seen on the H200: with the embedding
    tables on the host, DDP(model) raised "input module parameters locate in {'cuda', 'cpu'}"). A prepared
    model names exactly its host-kept frozen tables in DDP's opt-out list, so DDP sees only device
    parameters and reduces exactly the trainable ones; unpatch puts the list back as it was."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from poros.distributed import DDP_IGNORE_ATTRIBUTE

    model = qlora_model("qwen3", tmp_path=tmp_path, config_kwargs={"tie_word_embeddings": False})
    before = {name for name, p in model.named_parameters() if p.requires_grad}
    prepared = poros.prepare(model, embeddings_on_host=True)
    ignored = getattr(prepared, DDP_IGNORE_ATTRIBUTE)
    tables = {id(p) for table in prepared.host_tables for p in table.module.parameters()}
    assert ignored and {name for name, p in prepared.named_parameters() if id(p) in tables} == set(ignored)
    assert all(name.endswith("embed_tokens.weight") for name in ignored)
    store = dist.FileStore(str(tmp_path / "ddp-store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        ddp = DistributedDataParallel(prepared)
        assert set(ignored) <= ddp.parameters_to_ignore
        seen = {id(p) for p in ddp._module_parameters}
        assert not seen & tables and {n for n, p in prepared.named_parameters() if p.requires_grad} == before
    finally:
        dist.destroy_process_group()
    prepared.unpatch()
    assert not hasattr(model, DDP_IGNORE_ATTRIBUTE)


def _reduce_with_one_unused(rank: int, store_path: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from poros.distributed import all_reduce_gradients

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        a, b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
        x = torch.full((1, 3), float(rank + 1))
        loss = a(x).sum() + (b(x).sum() if rank == 1 else 0)  # rank 0 never reaches b
        loss.backward()
        params = [*a.parameters(), *b.parameters()]
        all_reduce_gradients(params)
        torch.save([p.grad for p in params], f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_layer_major_reduce_gives_every_rank_the_gradient_another_rank_made(tmp_path):
    """DDP with find_unused_parameters writes the reduced gradient into every rank's .grad of a parameter
    that any rank used; a rank whose batch never reached it must not keep grad=None (it would skip the
    step the other ranks take, and the adapters drift apart)."""
    import torch
    import torch.multiprocessing as mp

    mp.start_processes(_reduce_with_one_unused, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2,
                       start_method="spawn", join=True)
    grads = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    assert all(g is not None for g in grads[0]) and all(g is not None for g in grads[1])
    for g0, g1 in zip(*grads):
        assert torch.equal(g0, g1)
    assert torch.equal(grads[0][2], torch.full((2, 3), 1.0))  # b.weight: rank 1's (2.0) halved, rank 0's zeros


LEAVES_AT_EXIT = """
import atexit, torch.distributed as dist
from poros import distributed
atexit.register(lambda: print("initialized at exit:", dist.is_initialized(), flush=True))  # runs last (LIFO)
distributed.init_process_group()
print("joined:", dist.is_initialized(), flush=True)
distributed.leave_process_group() if {leave} else None
distributed.leave_process_group() if {leave} else None  # twice: a no-op
"""


def test_a_group_poros_made_is_destroyed_before_the_interpreter_exits(child_env):
    """gloo's worker threads abort the process ("terminate called without an active exception", SIGABRT)
    when the interpreter tears down a live group: ~40 % of 2-rank exits, the CI failure of stop 24. The
    group Poros made is destroyed at exit, after an explicit leave (poros train) as well."""
    for leave in (False, True):
        done = subprocess.run([sys.executable, "-c", LEAVES_AT_EXIT.format(leave=leave)], capture_output=True,
                              text=True, timeout=120, env=child_env(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                                                                    MASTER_ADDR="127.0.0.1",
                                                                    MASTER_PORT=str(free_port())))
        assert done.returncode == 0, done.stderr[-2000:]
        assert "joined: True" in done.stdout and "initialized at exit: False" in done.stdout, done.stdout


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_trl_sft_script_under_accelerate_launch_is_bitwise_with_the_one_line(child_env, tmp_path):
    """A user's TRL SFT script (tests/ddp_sft_script.py: NF4 base + peft_config, packing, eval, saves, TRL's
    bf16 and gradient checkpointing) launched by ``accelerate launch`` on 2 gloo ranks: plain, with
    ``prepare_trainer`` and with ``PorosCallback``. Accelerate wraps the streamed model in DDP itself; the
    logged losses, eval loss, every LoRA tensor and AdamW state tensor of each rank and the saved adapter and
    optimizer.pt are the plain run's, bit for bit."""
    from conformance_flows import assert_same_files, assert_same_outcome
    from poros.testing import save_tiny_checkpoint

    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt", "qwen3", seed=7)
    script = pathlib.Path(__file__).with_name("ddp_sft_script.py")
    tests = str(script.parent)
    runs = {}
    for line in ("none", "prepare_trainer", "callback"):
        out = tmp_path / line
        command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                   "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                   "--main_process_port", str(free_port()), str(script), str(checkpoint), str(out), line]
        env = child_env(OMP_NUM_THREADS="1", POROS_DIST_TIMEOUT="60")
        env["PYTHONPATH"] = os.pathsep.join([tests, env["PYTHONPATH"]])
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[line] = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    for rank, plain in enumerate(runs["none"]):
        assert (plain["world_size"], plain["backend"], plain["fetches"]) == (2, "gloo", 0)
        assert len(plain["loss"]) == 2 and len(plain["eval_loss"]) == 1
        for line in ("prepare_trainer", "callback"):
            streamed = runs[line][rank]
            assert streamed["fetches"] > 0, line  # it really streamed, on every rank
            assert_same_outcome(plain, streamed)
    for line in ("prepare_trainer", "callback"):
        assert_same_files(tmp_path / "none" / "checkpoint-2", tmp_path / line / "checkpoint-2",
                          ("adapter_model.safetensors", "optimizer.pt"))
