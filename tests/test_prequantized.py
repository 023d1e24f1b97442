"""Pre-quantized bnb-4bit checkpoints in, and ``poros.from_pretrained`` (every block on the host as it loads).

A ``*-bnb-4bit`` repo is what ``save_pretrained`` writes for a model loaded with ``BitsAndBytesConfig``:
the tests make exactly that from each family's tiny model on the CPU. Loaded by Poros it must hold the
checkpoint's bytes (which are the bytes of the bf16 source quantized on the fly) and train bitwise like
the resident HF model loaded from the same checkpoint and like the bf16 source quantized on the fly.
A damaged or foreign quantized checkpoint fails in one line naming what is wrong.
"""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import poros
import conformance_flows
from conformance_flows import assert_same_outcome, lora_model, rows, run_trainer, same_bits
from poros.errors import CheckpointLoadError, ConfigError, UnsupportedModelError
from poros.loading.load import load_pretrained
from poros.testing import TINY_VARIANTS, assert_bitwise_training, save_tiny_checkpoint, tiny_vlm, train_adamw
from test_parity import make_batch

FAMILIES = sorted(TINY_VARIANTS)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def keep_cpu_layout(model):
    """``conformance_flows.keep_cpu_layout`` (no AVX512-BF16 repack in no-grad eval), returning the model."""
    conformance_flows.keep_cpu_layout(model)
    return model


def bnb_config(quant_type: str = "nf4", double_quant: bool = True, **more) -> transformers.BitsAndBytesConfig:
    return transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type,
                                           bnb_4bit_compute_dtype=torch.bfloat16,
                                           bnb_4bit_use_double_quant=double_quant, **more)


def on_the_fly(path, config=None):
    """The bf16 source quantized as it loads (the parity reference's base)."""
    return keep_cpu_layout(transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=config or bnb_config(), device_map={"": "cpu"}, dtype=torch.bfloat16))


def resident(path):
    """A pre-quantized checkpoint as stock transformers loads it (no quantization_config: the checkpoint's)."""
    return keep_cpu_layout(transformers.AutoModelForCausalLM.from_pretrained(
        path, device_map={"": "cpu"}, dtype=torch.bfloat16))


def bnb_checkpoint(directory: pathlib.Path, family: str = "qwen3", *, seed: int = 0, config=None,
                   **tiny) -> tuple[pathlib.Path, pathlib.Path]:
    """``(bf16 source, its bnb-4bit export)``: what a ``*-bnb-4bit`` repo holds, sharded."""
    source = save_tiny_checkpoint(directory / "bf16", family, seed=seed, max_shard_size="20KB", **tiny)
    on_the_fly(source, config).save_pretrained(directory / "bnb-4bit", max_shard_size="20KB")
    return source, directory / "bnb-4bit"


def assert_same_state(mine: dict, theirs: dict) -> None:
    assert sorted(mine) == sorted(theirs)
    different = [key for key in mine if not same_bits(mine[key], theirs[key])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


def streamed_from(path, seed: int):
    loaded = load_pretrained(path, device="cpu", load_tokenizer=False, _blocks_to_host_on_cpu=True)
    return poros.prepare(lora_model(keep_cpu_layout(loaded.model), seed=seed)), loaded


BATCHES = [make_batch(11 + step, 2, 19, "left") for step in range(2)]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_loaded_base_is_the_checkpoints_bytes_and_the_bf16_sources(family, tmp_path):
    source, checkpoint = bnb_checkpoint(tmp_path, family, seed=1)
    loaded = load_pretrained(checkpoint, device="cpu", load_tokenizer=False, _blocks_to_host_on_cpu=True)
    assert loaded.info.prequantized.describe() == "pre-quantized (nf4, double quant)"
    assert loaded.model.hf_quantizer.pre_quantized  # no quantize pass: transformers unpacked the stored bytes
    assert_same_state(loaded.model.state_dict(), resident(checkpoint).state_dict())
    assert_same_state(loaded.model.state_dict(), on_the_fly(source).state_dict())


@pytest.mark.parametrize("family", FAMILIES)
def test_training_from_it_is_bitwise_resident_and_the_bf16_source(family, tmp_path):
    source, checkpoint = bnb_checkpoint(tmp_path, family, seed=2)
    streamed, _ = streamed_from(checkpoint, seed=5)
    assert "base pre-quantized (nf4, double quant)" in streamed.detection.summary()
    losses, optimizer = train_adamw(streamed, streamed.trainable_parameters(), BATCHES)
    for reference in (lora_model(resident(checkpoint), seed=5), lora_model(on_the_fly(source), seed=5)):
        expected, expected_optimizer = train_adamw(reference, [p for p in reference.parameters() if p.requires_grad],
                                                   BATCHES)
        assert_bitwise_training(reference, streamed, expected, losses, expected_optimizer, optimizer)


def poros_train(model: pathlib.Path, output_dir: pathlib.Path, *options: str) -> dict:
    """``poros train`` (the CLI, in this process) for 2 steps; its losses, adapter and AdamW state."""
    from poros.cli.main import main

    assert main(["train", "--model", str(model), "--device", "cpu", "--dataset", "synthetic", "--steps", "2",
                 "--seq-len", "16", "--batch-size", "2", "--lora-rank", "4", "--no-cache", "true", "--save-steps", "2",
                 "--logging-steps", "1", "--output-dir", str(output_dir), *options]) == 0
    checkpoint = output_dir / "checkpoint-2"
    return {"losses": json.loads((checkpoint / "trainer_state.json").read_text())["losses"],
            "adapter": load_file(output_dir / "adapter_model.safetensors"),
            "optimizer": torch.load(checkpoint / "optimizer.pt", weights_only=True)["state"]}


@pytest.mark.parametrize("double_quant", [True, False], ids=["double-quant", "single-quant"])
@pytest.mark.parametrize("family", FAMILIES)
def test_poros_train_on_a_save_pretrained_export_is_its_bf16_source(family, double_quant, tmp_path, capsys):
    """The acceptance test: transformers' own save_pretrained of an NF4 load, double quant on and off, trained
    with ``poros train`` is bitwise ``poros train`` on the bf16 source quantized the same way (every loss, every
    LoRA tensor, every AdamW state tensor)."""
    source, checkpoint = bnb_checkpoint(tmp_path, family, seed=19, config=bnb_config(double_quant=double_quant))
    expected = poros_train(source, tmp_path / "from-bf16", "--double-quant", str(double_quant).lower())
    capsys.readouterr()
    got = poros_train(checkpoint, tmp_path / "from-bnb")
    assert f"base pre-quantized (nf4{', double quant' if double_quant else ''})" in capsys.readouterr().out
    assert len(got["losses"]) == 2 and got["losses"] == expected["losses"]
    assert_same_state(got["adapter"], expected["adapter"])
    assert sorted(got["optimizer"]) == sorted(expected["optimizer"])
    for index, state in got["optimizer"].items():
        assert sorted(state) == sorted(expected["optimizer"][index])
        assert all(same_bits(value, expected["optimizer"][index][name]) for name, value in state.items()), index


def test_skipped_modules_stay_bf16_and_train_bitwise(tmp_path):
    """Unsloth's "dynamic" repos keep some block linears unquantized (``llm_int8_skip_modules``)."""
    config = bnb_config(llm_int8_skip_modules=["lm_head", "model.layers.0.mlp.down_proj", "self_attn.o_proj"])
    _, checkpoint = bnb_checkpoint(tmp_path, "qwen2", seed=3, config=config, num_layers=3)
    streamed, loaded = streamed_from(checkpoint, seed=6)
    layers = loaded.model.model.layers
    assert type(layers[0].mlp.down_proj.base_layer) is torch.nn.Linear
    assert type(layers[1].mlp.down_proj.base_layer).__name__ == "Linear4bit"
    assert all(type(layer.self_attn.o_proj.base_layer) is torch.nn.Linear for layer in layers)
    losses, optimizer = train_adamw(streamed, streamed.trainable_parameters(), BATCHES)
    reference = lora_model(resident(checkpoint), seed=6)
    expected, expected_optimizer = train_adamw(reference, [p for p in reference.parameters() if p.requires_grad],
                                               BATCHES)
    assert_bitwise_training(reference, streamed, expected, losses, expected_optimizer, optimizer)


def test_fp4_and_bf16_storage_checkpoints_train_bitwise(tmp_path):
    config = bnb_config("fp4", double_quant=False, bnb_4bit_quant_storage=torch.bfloat16)
    _, checkpoint = bnb_checkpoint(tmp_path, "gemma3", seed=4, config=config)
    streamed, loaded = streamed_from(checkpoint, seed=7)
    assert loaded.info.prequantized.describe() == "pre-quantized (fp4)"
    assert loaded.info.prequantized.quant_storage == "bfloat16"
    losses, optimizer = train_adamw(streamed, streamed.trainable_parameters(), BATCHES)
    reference = lora_model(resident(checkpoint), seed=7)
    expected, expected_optimizer = train_adamw(reference, [p for p in reference.parameters() if p.requires_grad],
                                               BATCHES)
    assert_bitwise_training(reference, streamed, expected, losses, expected_optimizer, optimizer)


def test_the_trainer_and_the_plan_take_a_bnb_checkpoint(tmp_path, capsys):
    from poros.cli.main import main

    config = bnb_config(llm_int8_skip_modules=["lm_head", "model.layers.1.mlp"])
    _, checkpoint = bnb_checkpoint(tmp_path, "qwen3", seed=5, config=config)
    trainer = poros.PorosTrainer.from_pretrained(checkpoint, device="cpu", no_cache=True, lora_rank=4)
    assert trainer.model.detection.prequantized
    result = trainer.train("synthetic", steps=2, seq_len=16, output_dir=str(tmp_path / "run"))
    assert result.steps == 2
    capsys.readouterr()
    assert main(["plan", "--model", str(checkpoint), "--device", "cpu", "--vram-budget", "8GiB", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)["footprint"]["block_bytes"]
    assert planned == [block.nbytes for block in trainer.model.store.blocks]  # skipped modules and double quant


def test_a_bnb_checkpoint_is_never_cached(tmp_path):
    _, checkpoint = bnb_checkpoint(tmp_path, "qwen3", seed=6)
    loaded = load_pretrained(checkpoint, device="cpu", load_tokenizer=False, cache_dir=tmp_path / "cache")
    assert getattr(loaded.model, "poros_block_file", None) is None
    assert not any((tmp_path / "cache").glob("*/manifest.json"))


# -- a bad or partial checkpoint: one line naming what is wrong -------------------------------------------------
def edit_shards(checkpoint: pathlib.Path, drop) -> str:
    """Remove the tensors ``drop(key)`` names from every shard (and the index); returns the first one removed."""
    removed = []
    for shard in sorted(checkpoint.glob("*.safetensors")):
        tensors = load_file(shard)
        gone = sorted(key for key in tensors if drop(key))
        if gone:
            removed += gone
            save_file({k: v for k, v in tensors.items() if k not in gone}, shard, metadata={"format": "pt"})
    index = checkpoint / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"] = {k: v for k, v in data["weight_map"].items() if k not in removed}
    index.write_text(json.dumps(data))
    assert removed
    return removed[0]


def edit_config(checkpoint: pathlib.Path, **quantization) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    config["quantization_config"].update(quantization)
    (checkpoint / "config.json").write_text(json.dumps(config))


def assert_one_line_error(checkpoint, *expected: str) -> None:
    with pytest.raises(CheckpointLoadError) as error:
        load_pretrained(checkpoint, device="cpu", load_tokenizer=False)
    message = str(error.value)
    assert "\n" not in message
    for part in expected:
        assert part in message, message


@pytest.mark.parametrize("companion", ["quant_state.bitsandbytes__nf4", "absmax", "nested_absmax", "quant_map"])
def test_a_missing_quant_state_tensor_is_named(companion, tmp_path):
    _, checkpoint = bnb_checkpoint(tmp_path, seed=7)
    removed = edit_shards(checkpoint, lambda key: key == f"model.layers.1.mlp.up_proj.weight.{companion}")
    assert_one_line_error(checkpoint, removed, "missing", "hf download")


def test_a_packed_weight_without_any_quant_state_is_named(tmp_path):
    _, checkpoint = bnb_checkpoint(tmp_path, seed=8)
    edit_shards(checkpoint, lambda key: key.startswith("model.layers.0.self_attn.q_proj.weight."))
    assert_one_line_error(checkpoint, "model.layers.0.self_attn.q_proj.weight", "packed 4-bit", "quant_state")


def test_quant_states_of_another_type_than_the_config_says(tmp_path):
    _, checkpoint = bnb_checkpoint(tmp_path, seed=9, config=bnb_config("fp4"))
    edit_config(checkpoint, bnb_4bit_quant_type="nf4")
    assert_one_line_error(checkpoint, "bitsandbytes__fp4", "bnb_4bit_quant_type='nf4'")


def test_a_quant_type_poros_does_not_stream(tmp_path):
    _, checkpoint = bnb_checkpoint(tmp_path, seed=10)
    edit_config(checkpoint, bnb_4bit_quant_type="int4")
    assert_one_line_error(checkpoint, "bnb_4bit_quant_type='int4'", "nf4 and fp4")


def test_an_8bit_checkpoint_is_refused(tmp_path):
    source = save_tiny_checkpoint(tmp_path / "bf16", "qwen3", seed=11)
    transformers.AutoModelForCausalLM.from_pretrained(
        source, quantization_config=transformers.BitsAndBytesConfig(load_in_8bit=True), device_map={"": "cpu"},
        dtype=torch.bfloat16).save_pretrained(tmp_path / "int8")
    assert_one_line_error(tmp_path / "int8", "8-bit", "poros quantize")


def test_another_quantization_method_is_refused(tmp_path):
    _, checkpoint = bnb_checkpoint(tmp_path, seed=12)
    config = json.loads((checkpoint / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (checkpoint / "config.json").write_text(json.dumps(config))
    assert_one_line_error(checkpoint, "quant_method='gptq'")


def test_poros_train_names_a_missing_quant_state_in_one_line(tmp_path, capsys):
    """The CLI's exit 1 with the loader's one line (nothing read or trained), for the three refusals."""
    from poros.cli.main import main

    _, checkpoint = bnb_checkpoint(tmp_path, seed=20)
    removed = edit_shards(checkpoint, lambda key: key == "model.layers.0.self_attn.k_proj.weight.quant_state."
                                                        "bitsandbytes__nf4")
    capsys.readouterr()
    arguments = ["--device", "cpu", "--dataset", "synthetic", "--steps", "1", "--output-dir", str(tmp_path / "run")]
    assert main(["train", "--model", str(checkpoint), *arguments]) == 1
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and removed in error and "missing" in error
    edit_config(checkpoint, bnb_4bit_quant_type="int4")
    assert main(["train", "--model", str(checkpoint), *arguments]) == 1
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and "bnb_4bit_quant_type='int4'" in error
    edit_config(checkpoint, load_in_4bit=False, _load_in_4bit=False, load_in_8bit=True, _load_in_8bit=True)
    assert main(["train", "--model", str(checkpoint), *arguments]) == 1
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and "8-bit" in error


# -- poros.from_pretrained: the plain script, every block on the host as it loads -------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_the_drop_in_from_poros_from_pretrained_is_the_plain_script(family, tmp_path):
    """Plain: transformers' from_pretrained + get_peft_model + HF Trainer. Poros: poros.from_pretrained (the
    CUDA path's moves to the host, on the CPU) + get_peft_model + poros.prepare + the same Trainer."""
    source = save_tiny_checkpoint(tmp_path / "bf16", family, seed=13, max_shard_size="20KB")
    flow = dict(train_rows=rows(6, 21), gradient_accumulation_steps=2)
    plain = run_trainer(lora_model(on_the_fly(source), seed=3), tmp_path / "plain", **flow)
    model = poros.from_pretrained(source, quantization_config=bnb_config(), dtype=torch.bfloat16,
                                  _blocks_to_host_on_cpu=True)
    assert model.poros_compute_device == torch.device("cpu")
    streamed = poros.prepare(lora_model(keep_cpu_layout(model), seed=3))
    got = run_trainer(streamed, tmp_path / "poros", **flow)
    assert_same_outcome(plain, got)
    assert got["trainer"].model.store.stats.fetches[0] > 0  # it really streamed


def test_the_drop_in_loads_a_bnb_checkpoint_as_stock_transformers_does(tmp_path):
    _, checkpoint = bnb_checkpoint(tmp_path, "gemma4", seed=14)
    flow = dict(train_rows=rows(4, 21))
    plain = run_trainer(lora_model(resident(checkpoint), seed=4), tmp_path / "plain", **flow)
    model = poros.from_pretrained(checkpoint, dtype=torch.bfloat16, device_map={"": "cpu"},
                                  _blocks_to_host_on_cpu=True)
    assert model.hf_quantizer.pre_quantized
    got = run_trainer(poros.prepare(lora_model(keep_cpu_layout(model), seed=4)), tmp_path / "poros", **flow)
    assert_same_outcome(plain, got)


def test_the_drop_in_refuses_what_it_cannot_load(tmp_path):
    source = save_tiny_checkpoint(tmp_path / "bf16", "qwen3", seed=15)
    with pytest.raises(ConfigError, match="splits the model"):
        poros.from_pretrained(source, device_map={"model.embed_tokens": "cpu", "model.layers": "disk"})
    tiny_vlm("gemma3").save_pretrained(tmp_path / "vlm")
    with pytest.raises(UnsupportedModelError, match="load_pretrained"):
        poros.from_pretrained(tmp_path / "vlm")
    _, checkpoint = bnb_checkpoint(tmp_path / "damaged", seed=16)
    edit_shards(checkpoint, lambda key: key == "model.layers.0.mlp.gate_proj.weight.absmax")
    with pytest.raises(CheckpointLoadError, match="model.layers.0.mlp.gate_proj.weight.absmax"):
        poros.from_pretrained(checkpoint)


def test_trl_with_a_model_from_poros_from_pretrained_is_the_plain_script(tmp_path):
    """TRL's SFTTrainer(model, peft_config=...) + PorosCallback on a model whose blocks loaded to the host."""
    from conformance_flows import run_sft

    source = save_tiny_checkpoint(tmp_path / "bf16", "gemma3", seed=17)
    plain = run_sft(source, tmp_path / "plain", None)
    model = keep_cpu_layout(poros.from_pretrained(source, quantization_config=bnb_config(double_quant=False),
                                                  dtype=torch.bfloat16, _blocks_to_host_on_cpu=True))
    assert_same_outcome(plain, run_sft(source, tmp_path / "poros", "callback", model=model))


def test_releasing_the_loads_segment_keeps_every_value_and_parameter(tmp_path):
    """``prepare`` on a model loaded onto the card moves what shared the load's one big segment with the
    blocks to the host and back (``release_stranded_segments``). On the CPU the moves are real copies:
    the same Parameter objects, and training stays bitwise (gemma4: a 4-bit linear outside the blocks)."""
    from poros.loading.host_blocks import release_stranded_segments

    source = save_tiny_checkpoint(tmp_path / "bf16", "gemma4", seed=18)
    reference = lora_model(on_the_fly(source), seed=8)
    expected, expected_optimizer = train_adamw(reference, [p for p in reference.parameters() if p.requires_grad],
                                               BATCHES)
    streamed = poros.prepare(lora_model(on_the_fly(source), seed=8))
    parameters = [id(p) for p in streamed.parameters()]
    released = release_stranded_segments(streamed, streamed.executor.layers, torch.device("cpu"))
    assert released["moved_bytes"] > 0 and [id(p) for p in streamed.parameters()] == parameters
    # (no data_ptr check: on the CPU the allocator may hand the freed host copy's address back)
    losses, optimizer = train_adamw(streamed, streamed.trainable_parameters(), BATCHES)
    assert_bitwise_training(reference, streamed, expected, losses, expected_optimizer, optimizer)


def test_the_gpu_measurement_tool_dry_runs_on_the_cpu(tmp_path, repo_root, child_env):
    """``tools/checks/prequant_bench.py`` at the tiny shape, every arm as the full-depth H200 steps run them:
    ``poros quantize --random-weights`` from the shape's config.json, the pre-quantized start, the drop-in
    through ``poros.from_pretrained`` and HF Trainer, the plain load then prepare, and ``poros train``."""
    import subprocess
    import sys

    report_file = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-m", "tools.checks.prequant_bench", "--model", "tiny", "--layers", "2", "--device",
                           "cpu", "--seq", "16", "--grad-accum", "1", "--steps", "1", "--threads", "1", "--source",
                           "random", "--arms", "quantize,starts,dropin,stranded,train", "--starts", "prequantized",
                           "--optimizer-states", "host", "--loss-chunks", "2", "--vram-budget", "2GiB",
                           "--train-steps", "2", "--dir", str(tmp_path / "work"), "--json", str(report_file)],
                          cwd=repo_root, env=child_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(report_file.read_text())
    assert report["quantize"]["random_seed"] == 0 and report["quantize"]["double_quant"]
    assert report["quantize"]["blocks"] == 2 and report["quantize"]["peak_rss_bytes"] > 0
    assert not (tmp_path / "work" / "checkpoint").exists()  # no bf16 anywhere
    assert "pre-quantized (nf4, double quant)" in report["starts"]["prequantized"]["detection"]
    assert report["dropin"]["fits"] and len(report["dropin"]["losses"]) == 1
    assert report["dropin"]["optimizer_states"] == "host" and report["dropin"]["prepare_options"]["loss_chunks"] == 2
    assert "pre-quantized (nf4, double quant)" in report["dropin"]["detection"]
    assert report["stranded"]["slot_bytes"] > 0
    train = report["train"]
    assert train["returncode"] == 0 and len(train["step_s"]) == 2 and len(train["launch_to_step_lines_s"]) == 2
    assert "base pre-quantized (nf4, double quant)" in train["detection"]


def test_the_gpu_measurement_tool_refuses_a_bf16_start_without_a_bf16_source(tmp_path):
    from tools.checks import prequant_bench

    with pytest.raises(SystemExit, match="--starts prequantized,prequantized_warm"):
        prequant_bench.main(["--model", "tiny", "--layers", "2", "--device", "cpu", "--source", "random", "--arms",
                             "starts", "--dir", str(tmp_path)])
