"""The bench's Trainer arms and its Unsloth arm, on the CPU at the tiny shape (no timing asserted).

* ``python -m tools.bench --arms trl-resident,trl-poros,hf-resident,hf-poros,unsloth`` runs once as a
  subprocess: TRL's SFTTrainer and HF's Trainer, each plain and with ``poros.prepare_trainer``, must be
  bitwise (``torch.equal`` on the logged losses, every LoRA tensor, every AdamW state tensor). The
  Unsloth arm needs a GPU; here ``--unsloth-command`` names a stand-in child, so what the real child
  receives (the bnb-4bit checkpoint, the rows, the settings, its environment) and how its JSON is merged
  are checked.
* The checkpoint the Unsloth arm writes loads back with ``from_pretrained`` holding the same packed
  NF4 weights, at full depth and truncated.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")
pytest.importorskip("trl")
pytest.importorskip("datasets")

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

#: the stand-in for tools/bench/unsloth_child.py: records what it was given, answers with fixed step times
FAKE_CHILD = textwrap.dedent("""
    import json, os, pathlib, sys
    spec = json.loads(pathlib.Path(sys.argv[1]).read_text())
    checkpoint = pathlib.Path(spec["checkpoint"])
    config = json.loads((checkpoint / "config.json").read_text())
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())
    setup = spec["setup"]
    out = {"status": "ok", "losses": [5.0] * (setup["warmup"] + setup["steps"]),
           "step_times_s": [2.0] * setup["warmup"] + [0.5] * setup["steps"],
           "peak_allocated_gb": 1.5, "peak_reserved_gb": 2.0, "versions": {"unsloth": "stand-in"},
           "seen": {"layers": config["num_hidden_layers"], "quant": config["quantization_config"]["quant_method"],
                    "weights": len(index["weight_map"]),
                    "tokenizer": (checkpoint / "tokenizer_config.json").exists(), "rows": spec["rows"],
                    "setup": setup, "lora": spec["lora"], "checkpointing": spec["gradient_checkpointing"],
                    "pythonpath": os.environ["PYTHONPATH"], "offline": os.environ.get("HF_HUB_OFFLINE"),
                    "cwd": os.getcwd(), "checkpoint": str(checkpoint)}}
    pathlib.Path(sys.argv[2]).write_text(json.dumps(out))
""")


@pytest.fixture(scope="module")
def report(tmp_path_factory, child_env):
    folder = tmp_path_factory.mktemp("bench-trainer")
    child = folder / "fake_child.py"
    child.write_text(FAKE_CHILD)
    command = [sys.executable, "-m", "tools.bench", "--model", "tiny", "--device", "cpu", "--steps", "2",
               "--warmup", "1", "--grad-accum", "2", "--deterministic",
               "--arms", "trl-resident,trl-poros,hf-resident,hf-poros,unsloth",
               "--unsloth-command", f"{sys.executable} {child}", "--unsloth-site", str(folder / "site"),
               "--json", str(folder / "bench.json")]
    done = subprocess.run(command, cwd=REPO, env=child_env(POROS_COMMIT="test"), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return json.loads((folder / "bench.json").read_text())


@pytest.mark.parametrize("flow", ["trl", "hf"])
def test_the_one_line_trains_bitwise_what_the_plain_trainer_trains(report, flow):
    comparison = report["trainer"][flow]
    assert comparison["bitwise"] is True, comparison
    assert (comparison["max_diff_loss"], comparison["max_diff_adapter"], comparison["max_diff_optimizer"]) == (0, 0, 0)
    assert comparison["adapter_tensors"] == 2 * 7 * 2  # 2 layers x 7 projections x (A, B)
    assert comparison["optimizer_tensors"] == 3 * comparison["adapter_tensors"]  # step, exp_avg, exp_avg_sq
    resident, streamed = report["arms"][f"{flow}-resident"], report["arms"][f"{flow}-poros"]
    for arm in (resident, streamed):
        assert arm["status"] == "ok", arm["error"]
        assert len(arm["losses"]) == len(arm["step_times_s"]) == 3 and arm["timed_steps"] == 2
        assert arm["tokens_per_step"] == 2 * 64 and arm["tokens_per_s"] > 0
    assert resident["losses"] == streamed["losses"] and resident["grad_norms"] == streamed["grad_norms"]
    assert streamed["guarantee"] == "bitwise" and streamed["blocks"] == 2
    assert streamed["block_fetches_per_step"] > 0


def test_the_unsloth_arm_gets_the_bench_model_rows_and_settings(report):
    arm = report["arms"]["unsloth"]
    assert arm["status"] == "ok", arm["error"]
    seen = arm["seen"]
    assert seen["layers"] == arm["layers"] == arm["full_depth"] == 2 and arm["depth_reason"] is None
    assert seen["quant"] == "bitsandbytes" and seen["weights"] > 0 and seen["tokenizer"]
    assert len(seen["rows"]) == 3 * 2 and {len(row) for row in seen["rows"]} == {64}
    assert {k: seen["setup"][k] for k in ("warmup", "steps", "grad_accum", "batch", "seq")} == \
        {"warmup": 1, "steps": 2, "grad_accum": 2, "batch": 1, "seq": 64}
    assert seen["lora"] == {"rank": 16, "alpha": 32, "targets": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                  "up_proj", "down_proj"]}
    assert seen["checkpointing"] == "unsloth"
    site, repo = seen["pythonpath"].split(":")[:2]
    assert site.endswith("site") and Path(repo) == REPO and seen["offline"] == "1"
    assert not Path(seen["cwd"]).exists() and not Path(seen["checkpoint"]).exists()  # both temporary, removed
    # the JSON merge: the median over the timed steps, tokens/s, the ratios against the same-depth arms
    assert arm["median_step_s"] == 0.5 and arm["tokens_per_s"] == 128 / 0.5 and arm["peak_allocated_gb"] == 1.5
    assert arm["versions"] == {"unsloth": "stand-in"} and arm["child"]["returncode"] == 0
    assert report["unsloth"]["comparable"] is True
    ratio = report["unsloth"]["trl-resident"]["ratio_median_step_s"]
    assert ratio == round(0.5 / report["arms"]["trl-resident"]["median_step_s"], 4)


def bench_args(**overrides) -> argparse.Namespace:
    from tools.bench import harness as bench

    args = bench.parse_args(["--model", "tiny", "--device", "cpu", "--arms", "unsloth"])
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def test_the_unsloth_arm_is_skipped_on_a_cpu_with_the_reason():
    from tools.bench import unsloth_arm
    from tools.bench.trainer_common import TrainerSetup

    checkpoint = unsloth_arm.save_checkpoint(None, bench_args(), torch.device("cpu"))
    assert "CUDA GPU" in checkpoint["skipped"]
    setup = TrainerSetup("cpu", 1, 2, 1, 1, 64, 1e-4, 0, "unused")
    arm = unsloth_arm.run(bench_args(), checkpoint, [], setup)
    assert arm["status"] == "skipped" and arm["error"] == checkpoint["skipped"]
    assert unsloth_arm.compare({"unsloth": arm}, 2) is None


@pytest.mark.parametrize("layers", [None, 1])
def test_the_checkpoint_loads_back_with_the_same_packed_weights(tmp_path, layers):
    import transformers

    from tools.bench import unsloth_arm
    from tools.bench.models import build_model
    from tools.bench.shapes import model_config

    config, _ = model_config("tiny")
    model = build_model(config, "cpu", seed=3)
    args = bench_args(unsloth_command="stand-in", unsloth_dir=str(tmp_path / "ckpt"), unsloth_layers=layers)
    written = unsloth_arm.save_checkpoint(model, args, torch.device("cpu"))
    depth = layers or 2
    assert written["layers"] == depth and written["full_depth"] == 2 and not written["temporary"]
    assert (written["depth_reason"] is None) == (layers is None)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(written["dir"], device_map={"": "cpu"})
    assert loaded.config.num_hidden_layers == depth and loaded.config.quantization_config.load_in_4bit
    ours, theirs = model.state_dict(), loaded.state_dict()
    expected = {k for k in ours if not any(f".layers.{i}." in k for i in range(depth, 2))}
    assert set(theirs) == expected
    for key in expected:
        assert torch.equal(ours[key], theirs[key]), key


def test_the_depth_shrinks_to_what_the_disk_holds():
    from tools.bench.unsloth_arm import plan_depth

    per_layer = {i: 10 for i in range(8)}
    assert plan_depth(5, per_layer, 8, free=1000) == (8, None)
    layers, reason = plan_depth(5, per_layer, 8, free=50)  # 90 % of 50 = 45: 5 + 4 x 10
    assert layers == 4 and "first 4 layers" in reason


def test_the_depths_must_match_for_a_ratio():
    from tools.bench.unsloth_arm import compare

    arms = {"unsloth": {"status": "ok", "layers": 8, "median_step_s": 1.0, "depth_reason": "disk"},
            "trl-resident": {"status": "ok", "median_step_s": 2.0}}
    assert compare(arms, 64) == {"comparable": False, "reason": "disk"}
    assert compare(arms, 8)["trl-resident"] == {"ratio_median_step_s": 0.5}


def test_the_child_environment_puts_unsloths_packages_first_and_stays_offline(monkeypatch):
    from tools.bench.unsloth_arm import child_environment

    monkeypatch.setenv("PYTHONPATH", "/tmp/site:/elsewhere")
    env = child_environment("/tmp/site-unsloth")
    assert env["PYTHONPATH"].split(":") == ["/tmp/site-unsloth", str(REPO)]  # not the Poros arms' wheels
    assert env["HF_HUB_OFFLINE"] == "1" and env["UNSLOTH_DISABLE_STATISTICS"] == "1"


@pytest.mark.skipif(importlib.util.find_spec("unsloth") is not None, reason="Unsloth is installed here")
def test_the_child_writes_its_json_when_unsloth_is_missing(tmp_path):
    from tools.bench import unsloth_child

    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"checkpoint": str(tmp_path), "setup": {}, "rows": [], "lora": {},
                                "gradient_checkpointing": "unsloth", "deterministic": False}))
    assert unsloth_child.main([str(spec), str(tmp_path / "out.json")]) == 1
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["status"] == "error" and "unsloth" in out["error"] and out["versions"]["unsloth"] is None


def test_the_results_page_shows_the_arms_side_by_side(report, monkeypatch):
    """The generated table of docs/results-h200.md: one row per arm of the run, the one-line arms with their
    parity and ratio; a 'pending' row while no run exists."""
    from tools.docs import gen_results_docs

    monkeypatch.setattr(gen_results_docs, "bench_reports", lambda: [])
    assert "pending the H200 run" in gen_results_docs.render_trainer()
    path = gen_results_docs.ROOT / "registry" / "results" / "h200-x" / "bench-trainer.json"
    monkeypatch.setattr(gen_results_docs, "bench_reports", lambda: [(path, report)])
    rows = gen_results_docs.render_trainer().splitlines()[2:]
    assert [row.split(" | ")[5] for row in rows] == ["trl-resident", "trl-poros", "hf-resident", "hf-poros", "unsloth"]
    assert all("bitwise (0.0)" in row for row in rows if "-poros" in row)


def test_the_poros_trainer_arms_take_the_bench_budget_and_resident_blocks():
    from tools.bench import harness as bench
    from tools.bench.trainer_common import TrainerSetup

    args = bench.parse_args(["--model", "tiny", "--device", "cpu", "--arms", "hf-poros", "--vram-budget", "30GB",
                             "--grad-accum", "2"])
    setup = bench.trainer_setup(args, torch.device("cpu"))
    options = setup.prepare_options()
    assert options["vram_budget"] == "30GB" and "resident_blocks" not in options
    assert (options["workload"].grad_accum, options["workload"].schedule) == (2, "layer-major")
    assert setup.to_dict()["vram_budget"] == "30GB"
    plain = TrainerSetup("cpu", 1, 2, 1, 1, 64, 1e-4, 0, "unused", resident_blocks=1)
    assert plain.prepare_options() == {"cuda_graphs": False, "resident_blocks": 1}


def test_the_trainer_arms_take_the_bench_cap_on_the_arms_it_names():
    """``--vram-limit`` with ``--cap-arms`` caps those Trainer arms as it caps the step arms (the issue's 24 GB row:
    before, the Trainer arms ignored the cap)."""
    from tools.bench import harness as bench

    args = bench.parse_args(["--model", "tiny", "--device", "cpu", "--arms", "trl-resident,trl-poros",
                             "--vram-limit", "24", "--cap-arms", "trl-poros"])
    setup = bench.trainer_setup(args, torch.device("cpu"))
    assert (setup.cap_of("trl-poros"), setup.cap_of("trl-resident")) == (24, None)
    everyone = bench.trainer_setup(bench.parse_args(["--model", "tiny", "--device", "cpu", "--vram-limit", "24"]),
                                   torch.device("cpu"))
    assert everyone.cap_of("trl-resident") == everyone.cap_of("hf-poros") == 24


def test_a_poros_trainer_arm_keeps_the_blocks_it_is_asked_to_keep(tmp_path):
    from tools.bench.models import add_lora, build_model, make_batches
    from tools.bench.shapes import model_config
    from tools.bench.trainer_arms import run_trainer_arm, snapshot, token_rows, trainable
    from tools.bench.trainer_common import TrainerSetup

    config, _ = model_config("tiny")
    peft_model = add_lora(build_model(config, torch.device("cpu"), seed=0), rank=4, alpha=8, targets="all-linear",
                          gradient_checkpointing=True)
    named = trainable(peft_model)
    rows = token_rows(make_batches(config, count=2, batch=1, seq=32, seed=1))
    setup = TrainerSetup("cpu", 0, 1, 2, 1, 32, 1e-4, 0, str(tmp_path), resident_blocks=1)
    result, handle = run_trainer_arm("hf-poros", peft_model, named, snapshot(named), rows, setup)
    assert result.status == "ok", result.error
    assert result.extra["resident_blocks"] == [config.num_hidden_layers - 1] and result.extra["budget_plan"] is None
    handle.unpatch()
