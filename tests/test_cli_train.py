"""``poros init`` and ``poros train``: the YAML, overrides, the --dry-run plan against the real block
store of every family, exit statuses, and one end-to-end run through the real entry point.

Exit statuses of ``poros train``: 0 trained (or planned), 1 a Poros error (bad config value, unknown
override, checkpoint not available offline), 2 an argparse usage error, 130 interrupted.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from poros.cli.main import main
from poros.config import PorosConfig
from poros.testing import TINY_VARIANTS, load_qlora, save_tiny_checkpoint

DEFAULT_VARIANTS = [(family, variants[0]) for family, variants in TINY_VARIANTS.items()]


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """One tiny sharded checkpoint per family (its default variant)."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {family: save_tiny_checkpoint(root / family, family, variant) for family, variant in DEFAULT_VARIANTS}


# -- poros init -------------------------------------------------------------------------------

def test_init_writes_the_commented_defaults_and_prints_the_next_command(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    status, out, _ = run_cli(capsys, "init")
    assert status == 0
    assert PorosConfig.from_yaml(tmp_path / "poros.yaml") == PorosConfig()
    assert "# " in (tmp_path / "poros.yaml").read_text().splitlines()[0]
    assert "poros train poros.yaml --dry-run" in out and "poros train poros.yaml " in out


def test_init_refuses_to_overwrite_without_force(capsys, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("steps: 3\n")
    status, out, err = run_cli(capsys, "init", str(path))
    assert status == 1 and out == ""
    assert "already exists" in err and "--force" in err
    assert path.read_text() == "steps: 3\n"
    status, _, _ = run_cli(capsys, "init", str(path), "--force", "--model", "Qwen/Qwen3-8B", "--dataset", "synthetic")
    assert status == 0
    assert PorosConfig.from_yaml(path) == PorosConfig(model="Qwen/Qwen3-8B", dataset="synthetic")


def test_init_into_a_new_directory_and_not_onto_a_directory(capsys, tmp_path):
    status, _, _ = run_cli(capsys, "init", str(tmp_path / "runs" / "a.yaml"))
    assert status == 0 and (tmp_path / "runs" / "a.yaml").is_file()
    status, _, err = run_cli(capsys, "init", str(tmp_path / "runs"))
    assert status == 1 and "is a directory" in err


# -- poros train: configuration and overrides -------------------------------------------------

def test_unknown_override_fails_by_name_with_exit_1(capsys, tmp_path):
    config = tmp_path / "poros.yaml"
    PorosConfig().to_yaml(config)
    status, out, err = run_cli(capsys, "train", str(config), "--stpes", "10", "--dry-run")
    assert status == 1 and out == ""
    assert "unknown override --stpes" in err and "did you mean 'steps'" in err


def test_bad_config_file_and_bad_values_exit_1(capsys, tmp_path):
    status, _, err = run_cli(capsys, "train", str(tmp_path / "missing.yaml"), "--dry-run")
    assert status == 1 and "does not exist" in err and "poros init" in err
    status, _, err = run_cli(capsys, "train", "--seq-len", "0", "--dry-run")
    assert status == 1 and "seq_len=0" in err
    status, _, err = run_cli(capsys, "train", "--dry-run", "--steps", "5", "extra.yaml")
    assert status == 1 and "unexpected argument 'extra.yaml'" in err


def test_abbreviated_options_are_overrides_not_dry_run(capsys):
    status, _, err = run_cli(capsys, "train", "--dry", "--steps", "3")
    assert status == 1 and "unknown override --dry" in err


def test_overrides_reach_the_config_wherever_dry_run_stands(capsys, tmp_path, checkpoints):
    config = tmp_path / "poros.yaml"
    PorosConfig(model=str(checkpoints["qwen3"]), steps=10).to_yaml(config)
    for argv in (["train", "--dry-run", str(config), "--seq-len", "64", "--device", "cpu"],
                 ["train", str(config), "--seq_len=64", "--dry-run", "--device", "cpu"]):
        status, out, err = run_cli(capsys, *argv)
        assert status == 0, err
        assert "changed from the defaults:" in out and "seq_len=64" in out and "steps=10" in out
        assert "batch 1 x seq 64" in out


# -- poros train --dry-run: the plan against the real block store ---------------------------------

@pytest.mark.parametrize(("family", "variant"), DEFAULT_VARIANTS, ids=[f for f, _ in DEFAULT_VARIANTS])
def test_dry_run_plan_equals_the_block_store(capsys, checkpoints, family, variant):
    import poros
    from poros.plan.run_plan import plan_run

    path = checkpoints[family]
    status, out, err = run_cli(capsys, "train", "--model", str(path), "--device", "cpu", "--dry-run")
    assert status == 0, err
    plan = plan_run(PorosConfig(model=str(path), device="cpu"))
    # the model below carries no expert LoRA (load_qlora): compare it with the plan of such a run
    no_expert_lora = plan_run(PorosConfig(model=str(path), device="cpu", lora_on_experts=False))
    assert f"family      {family} " in out
    assert "peak device memory (estimate)" in out and "expected host RAM (estimate" in out
    assert "Nothing was loaded or trained" in out

    from poros.loading.experts import experts_modules

    model = load_qlora(path, lora_rank=16, lora_alpha=32)
    if experts_modules(model):  # an MoE model: the run packs its experts to NF4 (quantize_experts' default)
        poros.quantize_experts(model)
    model = poros.prepare(model)
    assert list(plan.block_bytes) == [block.nbytes for block in model.store.blocks]
    assert plan.host_store_bytes == model.store.host_bytes
    assert no_expert_lora.lora_parameters == sum(p.numel() for p in model.trainable_parameters())
    assert plan.lora_parameters >= no_expert_lora.lora_parameters  # the default run's expert LoRA on top
    assert plan.num_blocks == len(model.store.blocks)
    assert f"{plan.host_store_bytes:,}" in out


@pytest.mark.parametrize("family", ["qwen3", "gemma4"])
def test_dry_run_plan_with_double_quant_and_dora_equals_the_block_store(checkpoints, family):
    import poros
    from poros.plan.run_plan import plan_run

    path = checkpoints[family]
    plan = plan_run(PorosConfig(model=str(path), device="cpu", double_quant=True, use_dora=True, lora_rank=4,
                                target_modules="default"))
    model = poros.prepare(load_qlora(path, lora_rank=4, double_quant=True, use_dora=True,
                                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    assert list(plan.block_bytes) == [block.nbytes for block in model.store.blocks]
    assert plan.lora_parameters == sum(p.numel() for p in model.trainable_parameters())


def test_dry_run_plans_the_text_tower_of_a_multimodal_checkpoint(capsys, tmp_path, checkpoints):
    import transformers

    from poros.plan.run_plan import plan_run
    from poros.testing import tiny_config

    multimodal = transformers.Gemma3Config(
        text_config=tiny_config("gemma3").to_dict(),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14),
    )
    multimodal.save_pretrained(tmp_path)  # config.json only: a dry run reads no weights
    status, out, err = run_cli(capsys, "train", "--model", str(tmp_path), "--device", "cpu", "--dry-run")
    assert status == 0, err
    assert "model_type gemma3_text, text tower of gemma3" in out
    text_only = plan_run(PorosConfig(model=str(checkpoints["gemma3"]), device="cpu"))
    assert plan_run(PorosConfig(model=str(tmp_path), device="cpu")).block_bytes == text_only.block_bytes


def test_dry_run_finds_a_hub_id_in_the_hf_cache_and_never_downloads(capsys, tmp_path, monkeypatch, checkpoints):
    import huggingface_hub

    commit = "0" * 40
    repo = tmp_path / "models--poros-test--tiny-qwen2"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text((checkpoints["qwen2"] / "config.json").read_text())
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))

    status, out, err = run_cli(capsys, "train", "--model", "poros-test/tiny-qwen2", "--device", "cpu", "--dry-run")
    assert status == 0, err
    assert "poros-test/tiny-qwen2 (HF cache:" in out and "family      qwen2 " in out

    status, out, err = run_cli(capsys, "train", "--model", "poros-test/not-cached", "--dry-run")
    assert status == 1 and out == ""
    assert "not in the HF cache" in err and "never downloads" in err and "hf download poros-test/not-cached" in err


def test_dry_run_on_the_bundled_default(capsys):
    status, out, err = run_cli(capsys, "train", "--dry-run", "--device", "cpu")
    assert status == 0, err
    assert "(all defaults)" not in out  # --device cpu changed one field
    assert "poros-tiny-qwen3 (bundled with poros:" in out and "family      qwen3 " in out


BENCH_RECORDS = [  # the cut-depth bench runs that had a Poros arm (an Unsloth smoke run has none)
    path for path in sorted((Path(__file__).resolve().parents[1] / "registry" / "results").glob("h200-*/bench-*layers-*.json"))
    if "poros" in json.loads(path.read_text())["arms"]]


@pytest.mark.parametrize("record_path", BENCH_RECORDS, ids=[f"{p.parent.name}/{p.stem}" for p in BENCH_RECORDS])
def test_plan_matches_the_block_store_measured_on_the_h200(tmp_path, monkeypatch, record_path):
    """Real shapes (cut to a few layers) as tools/bench/harness.py built them on the GPU: exact block bytes,
    and a peak estimate at or above the peak the bench measured."""
    from poros.plan.run_plan import plan_run
    from tools.bench.shapes import model_config
    record = json.loads(record_path.read_text())
    setup, measured = record["config"], record["arms"]["poros"]
    config, _ = model_config(setup["model"], layers=setup["model_info"]["num_hidden_layers"])
    config.save_pretrained(tmp_path)
    plan = plan_run(PorosConfig(
        model=str(tmp_path), device="cuda", seq_len=setup["seq"], batch_size=setup["batch"],
        double_quant=setup["quantization"]["double_quant"], compute_dtype=setup["quantization"]["compute_dtype"],
        target_modules=setup["lora"]["targets"], lora_rank=setup["lora"]["rank"], num_slots=setup["num_slots"],
        embeddings_on_host=True, grad_accum=setup.get("grad_accum", 1),
        stream_schedule=setup.get("schedule", "micro-major"),
        quantize_experts=bool(setup.get("quantize_experts")),  # records before --quantize-experts: bf16 experts
        lora_on_experts=bool(setup["lora"].get("on_experts")),  # records before --lora-on-experts: none
    ))
    # the bench's --vram-budget may keep some blocks on the device: the host store holds the rest
    assert plan.host_store_bytes == measured["host_bytes"] + measured.get("resident_bytes", 0)
    assert plan.largest_block_bytes == measured["slot_bytes"]
    assert plan.lora_parameters == record["build"]["trainable_parameters"]
    assert plan.peak_device_bytes_estimate >= measured["peak_allocated_gb"] * 1e9


def test_planner_quantized_bytes_follow_bitsandbytes():
    from poros.plan.footprint import padded, quantized_tensor_bytes

    # 64x64 weight: 2048 packed bytes, 64 fp32 absmax, 16-value fp32 code table.
    assert quantized_tensor_bytes(4096, double_quant=False) == [2048, 256, 64]
    # double quant: uint8 absmax, fp32 offset, one nested fp32 absmax per 256 absmax, 256-value code.
    assert quantized_tensor_bytes(4096, double_quant=True) == [2048, 64, 64, 4, 4, 1024]
    assert quantized_tensor_bytes(65, double_quant=False) == [33, 8, 64]
    assert [padded(n) for n in (0, 1, 512, 513)] == [0, 512, 512, 1024]


# -- poros train: running ---------------------------------------------------------------------

class _InterruptedTrainer:
    launch_command = None

    def train(self):
        from poros.training.trainer import TrainResult

        return TrainResult(steps=1, losses=[1.0], final_loss=1.0, interrupted=True, output_dir=Path("."),
                           last_checkpoint=Path("checkpoint-1"))

    def save(self, directory):  # pragma: no cover - must not be called for an interrupted run
        raise AssertionError("an interrupted run must not save over the adapter")


def test_interrupted_run_exits_130_and_hands_the_command_to_the_trainer(capsys, monkeypatch, tmp_path):
    from poros.training.trainer import PorosTrainer

    trainer = _InterruptedTrainer()
    seen = []
    monkeypatch.setattr(PorosTrainer, "from_config", classmethod(lambda cls, config: seen.append(config) or trainer))
    config = tmp_path / "poros.yaml"
    PorosConfig(steps=7, output_dir=str(tmp_path / "run")).to_yaml(config)
    status, _, _ = run_cli(capsys, "train", str(config), "--seq-len", "64")
    assert status == 130
    assert seen[0] == PorosConfig(steps=7, seq_len=64, output_dir=str(tmp_path / "run"))
    assert trainer.launch_command == ["poros", "train", str(config), "--seq-len", "64"]


def test_train_end_to_end_through_the_entry_point(tmp_path, child_env):
    """``python -m poros.cli.main train`` on the bundled model and data: adapter out, loadable by stock PEFT."""
    output_dir = tmp_path / "adapter"
    result = subprocess.run(
        [sys.executable, "-m", "poros.cli.main", "train", "--steps", "2", "--seq-len", "64", "--logging-steps", "1",
         "--output-dir", str(output_dir), "--device", "cpu"],
        capture_output=True, text=True, timeout=300, check=False, env=child_env(POROS_LOAD_PLUGINS="", OMP_NUM_THREADS="1"),  # 1 thread: fast even on a busy CPU
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for name in ("adapter_model.safetensors", "adapter_config.json", "poros_config.json"):
        assert (output_dir / name).is_file(), name
    record = json.loads((output_dir / "poros_config.json").read_text())
    assert record["config"]["steps"] == 2 and record["config"]["seq_len"] == 64

    # The printed loading recipe works as printed.
    snippet = re.search(r"Load it with PEFT:\n\n((?:    .*\n?)+)", result.stdout)
    assert snippet, result.stdout[-2000:]
    namespace: dict = {}
    exec(textwrap.dedent(snippet.group(1)), namespace)  # noqa: S102 - our own printed snippet
    names = [name for name, _ in namespace["model"].named_parameters() if "lora_A" in name]
    assert names and all(".default." in name for name in names)


def test_the_first_run_learns_visibly_on_one_cpu_thread(tmp_path, child_env):
    """``poros train`` with the defaults (the pretrained bundled model, 100 steps) on the CPU (as a user types it,
    in an empty directory: docs/quickstart.md's first sample is this run's output): one torch thread
    for the tiny model (cpu_threads auto), and the loss the run prints ends below 60 % of its first logged value
    (the last logged window and the final step)."""
    from tools.docs import doc_samples

    env = child_env()
    for name in ("OMP_NUM_THREADS", "POROS_LOAD_PLUGINS", "HF_HUB_DISABLE_PROGRESS_BARS"):  # a user's shell
        env.pop(name, None)  # OMP_NUM_THREADS set would be the user's choice, and cpu_threads auto would keep it
    done = subprocess.run([sys.executable, "-m", "poros", "train"], cwd=tmp_path, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=600, check=False, env=env)
    assert done.returncode == 0, done.stdout[-3000:]
    # the same run is quickstart.md's first sample: it matches, beyond the numbers that vary
    output = "$ poros train\n" + doc_samples.normalize(done.stdout, tmp_path.resolve())
    assert doc_samples.differences("train-default", output) == [], "python -m tools.docs.doc_samples train-default"
    assert "poros: 1 CPU thread (cpu_threads='auto')" in done.stdout
    logged = [float(loss) for loss in re.findall(r"^step \d+/100 \| loss ([0-9.]+)", done.stdout, re.M)]
    # the end-of-run summary: "trained 100 steps in ... s (...); loss X (mean of steps 91-100)"
    final = float(re.search(r"trained 100 steps in .*; loss ([0-9.]+) \(mean of steps 91-100\)", done.stdout).group(1))
    assert len(logged) == 10
    assert logged[-1] < 0.6 * logged[0] and final < 0.6 * logged[0], (logged, final)


def test_train_help_lists_the_common_fields_by_group_with_defaults_and_other_names(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    groups = [line.strip() for line in out.splitlines() if line.startswith("  ") and not line.startswith("   ")]
    for section in ("model", "LoRA adapter", "data", "optimisation", "logging and checkpoints", "runtime and streaming"):
        assert section in groups, section
    for fragment in ("--batch-size 1", "[--per-device-train-batch-size --micro-batch-size]", "--lr 0.0002",
                     "[--learning-rate]", "--steps 100", "[--max-steps]", "--epochs null", "[--num-train-epochs",
                     "--lora-rank 16", "[--lora-r]", "--seq-len 512", "[--max-seq-length", "--output-dir ./poros_output",
                     "--cpu-threads auto"):
        assert fragment in out, fragment
