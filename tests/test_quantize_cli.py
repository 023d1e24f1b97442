"""``poros quantize``: a bf16 checkpoint written as a bnb-4bit one, block by block, for every family.

The reference is transformers itself: ``from_pretrained(src, quantization_config=BitsAndBytesConfig(...))``
then ``save_pretrained``. The output must hold the same keys, dtypes and bytes and the same
``config.json``; stock ``from_pretrained(out)`` must give the logits of the on-the-fly NF4 model
(``torch.equal``); Poros must load from it the very block bytes it makes from the bf16 source.
"""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
import transformers
from safetensors import safe_open

from poros.cli.main import main
from poros.loading.load import load_pretrained
from poros.loading.quantize import quantize_checkpoint
from poros.stream.store import block_layouts
from poros.testing import TINY_VARIANTS, save_tiny_checkpoint, tiny_vlm
from test_parity import make_batch

FAMILIES = sorted(TINY_VARIANTS)


def bnb_config(quant_type: str = "nf4", double_quant: bool = True) -> transformers.BitsAndBytesConfig:
    return transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type,
                                           bnb_4bit_compute_dtype=torch.bfloat16,
                                           bnb_4bit_use_double_quant=double_quant)


def on_the_fly(path, **config):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=bnb_config(**config), device_map={"": "cpu"}, dtype=torch.bfloat16)
    return keep_cpu_layout(model)


def keep_cpu_layout(model):
    """No AVX512-BF16 repack in no-grad eval (it asserts on tiny shapes): both arms compute the same kernel."""
    import bitsandbytes as bnb

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False
    return model


def tensors_of(directory: pathlib.Path) -> dict[str, torch.Tensor]:
    found = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(file, framework="pt") as shard:
            for key in shard.keys():
                found[key] = shard.get_tensor(key)
    return found


def assert_same_checkpoint(mine: pathlib.Path, theirs: pathlib.Path) -> None:
    ours, reference = tensors_of(mine), tensors_of(theirs)
    assert sorted(ours) == sorted(reference)
    wrong = [k for k in ours if ours[k].dtype != reference[k].dtype or ours[k].shape != reference[k].shape
             or not torch.equal(ours[k].view(torch.uint8), reference[k].view(torch.uint8))]
    assert not wrong, f"{len(wrong)} tensors differ from save_pretrained's, e.g. {wrong[:3]}"
    ours_config, reference_config = (json.loads((d / "config.json").read_text()) for d in (mine, theirs))
    assert ours_config == reference_config
    assert ours_config["quantization_config"]["quant_method"] == "bitsandbytes"


def block_bytes(model) -> list[list[torch.Tensor]]:
    """Each block's frozen tensors as the block store packs them (bytes)."""
    from poros.descriptor import resolve_path
    from poros.registry import for_config

    blocks = list(resolve_path(model, for_config(model.config).decoder_layers))
    for block in blocks:
        block.requires_grad_(False)
    return [[t.reshape(-1).view(torch.uint8) for t in tensors] for _, tensors, _ in block_layouts(blocks)]


@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_checkpoint_is_what_save_pretrained_writes(family, tmp_path):
    source = save_tiny_checkpoint(tmp_path / "bf16", family, seed=2, max_shard_size="20KB")
    result = quantize_checkpoint(source, tmp_path / "mine", double_quant=True, device="cpu", max_shard_size=20_000)
    assert result.shards > 1 and (tmp_path / "mine" / "model.safetensors.index.json").is_file()
    on_the_fly(source).save_pretrained(tmp_path / "theirs", max_shard_size="20KB")
    assert_same_checkpoint(tmp_path / "mine", tmp_path / "theirs")
    index = json.loads((tmp_path / "mine" / "model.safetensors.index.json").read_text())
    assert index["metadata"] == json.loads((tmp_path / "theirs" / "model.safetensors.index.json").read_text())[
        "metadata"]


@pytest.mark.parametrize("family", FAMILIES)
def test_stock_transformers_loads_it_with_the_on_the_fly_logits(family, tmp_path):
    source = save_tiny_checkpoint(tmp_path / "bf16", family, seed=3)
    quantize_checkpoint(source, tmp_path / "nf4", double_quant=True, device="cpu")
    loaded = keep_cpu_layout(transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "nf4", device_map={"": "cpu"}, dtype=torch.bfloat16))
    batch = make_batch(3, 2, 17, "left")
    with torch.no_grad():
        expected = on_the_fly(source)(**batch, use_cache=False).logits
        got = loaded(**batch, use_cache=False).logits
    assert torch.equal(expected, got)


@pytest.mark.parametrize(("quant_type", "double_quant"), [("nf4", False), ("fp4", True)])
def test_poros_loads_its_own_block_bytes_from_it(quant_type, double_quant, tmp_path):
    source = save_tiny_checkpoint(tmp_path / "bf16", "qwen3", seed=4)
    quantize_checkpoint(source, tmp_path / "out", quantization=quant_type, double_quant=double_quant, device="cpu")
    from_bf16 = load_pretrained(source, quantization=quant_type, double_quant=double_quant, device="cpu",
                                load_tokenizer=False)
    from_output = load_pretrained(tmp_path / "out", quantization=quant_type, device="cpu", load_tokenizer=False)
    assert from_output.info.prequantized.describe() == (
        f"pre-quantized ({quant_type}{', double quant' if double_quant else ''})")
    mine, theirs = block_bytes(from_output.model), block_bytes(from_bf16.model)
    assert len(mine) == len(theirs)
    for index, (a, b) in enumerate(zip(mine, theirs)):
        assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b)), f"block {index} differs"


def test_never_more_than_two_blocks_in_memory(tmp_path):
    """Each block is written and dropped when the next starts loading: the one written and the one starting."""
    source = save_tiny_checkpoint(tmp_path / "bf16", "qwen2", seed=5, num_layers=6)
    result = quantize_checkpoint(source, tmp_path / "out", device="cpu")
    assert result.blocks == 6 and result.most_blocks_held == 2


def test_a_multimodal_checkpoint_gives_its_text_tower(tmp_path):
    vlm = tiny_vlm("gemma3", seed=1)
    vlm.save_pretrained(tmp_path / "vlm", max_shard_size="20KB")
    quantize_checkpoint(tmp_path / "vlm", tmp_path / "out", device="cpu")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    assert not any("vision" in key or "language_model" in key for key in tensors_of(tmp_path / "out"))
    expected = load_pretrained(tmp_path / "vlm", device="cpu", load_tokenizer=False).model.state_dict()
    got = load_pretrained(tmp_path / "out", device="cpu", load_tokenizer=False).model.state_dict()
    assert sorted(expected) == sorted(got)
    assert all(torch.equal(expected[k].view(torch.uint8), got[k].view(torch.uint8)) for k in expected)


def test_the_cli_writes_it_and_refuses_what_it_cannot(tmp_path, capsys):
    source = save_tiny_checkpoint(tmp_path / "bf16", "qwen3", seed=6)
    out = tmp_path / "out"
    capsys.readouterr()
    assert main(["quantize", str(source), str(out), "--double-quant", "--device", "cpu", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["quant_type"] == "nf4" and result["double_quant"] and result["blocks"] == 2
    assert json.loads((out / "config.json").read_text())["quantization_config"]["bnb_4bit_use_double_quant"]

    assert main(["quantize", str(source), str(out), "--device", "cpu"]) == 1  # OUT is not empty
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "--overwrite" in error
    assert main(["quantize", str(out), str(tmp_path / "again"), "--device", "cpu"]) == 1  # already 4-bit
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "pre-quantized (nf4, double quant) already" in error
    assert main(["quantize", str(source), str(out), "--device", "cpu", "--overwrite", "--quantization", "fp4"]) == 0
    assert json.loads((out / "config.json").read_text())["quantization_config"]["bnb_4bit_quant_type"] == "fp4"
    assert not list(tmp_path.glob(".out.partial-*"))  # the staging directory is gone


# -- --random-weights: a benchmarking aid, from a config alone ---------------------------------------------------
def config_only(directory: pathlib.Path, family: str, **tiny) -> pathlib.Path:
    """A directory holding nothing but ``config.json`` (what a benchmark of a model too big for the disk has)."""
    from poros.testing import tiny_config

    tiny_config(family, **tiny).save_pretrained(directory)
    assert sorted(p.name for p in directory.iterdir()) == ["config.json"]
    return directory


@pytest.mark.parametrize("family", FAMILIES)
def test_random_weights_are_the_random_bf16_model_quantized(family, tmp_path):
    """The streamed writer's output is what ``quantize_checkpoint`` writes for the bf16 model the same seeds
    make (keys, dtypes, bytes, config.json), and stock transformers loads it with nothing left to initialise."""
    from poros.loading.random_weights import model_config_of, random_checkpoint, random_model

    config = config_only(tmp_path / "config", family)
    result = random_checkpoint(config, tmp_path / "random", seed=7, double_quant=True, device="cpu",
                               max_shard_size=20_000)
    assert result.random_seed == 7 and result.shards > 1 and "random weights (seed 7)" in result.summary()
    random_model(model_config_of(config)[0], seed=7).save_pretrained(tmp_path / "bf16", max_shard_size="20KB")
    quantize_checkpoint(tmp_path / "bf16", tmp_path / "reference", double_quant=True, device="cpu")
    assert_same_checkpoint(tmp_path / "random", tmp_path / "reference")
    _, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "random", device_map={"": "cpu"}, dtype=torch.bfloat16, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]


def test_random_weights_load_and_train_in_poros_from_the_cli(tmp_path, capsys):
    import poros
    from poros.testing import train_adamw

    config = config_only(tmp_path / "config", "qwen3", num_layers=3)
    capsys.readouterr()
    assert main(["quantize", str(config / "config.json"), str(tmp_path / "out"), "--random-weights", "--seed", "2",
                 "--double-quant", "--device", "cpu", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["random_seed"] == 2 and result["blocks"] == 3 and result["most_blocks_held"] == 1
    loaded = load_pretrained(tmp_path / "out", device="cpu", load_tokenizer=False, _blocks_to_host_on_cpu=True)
    assert loaded.info.prequantized.describe() == "pre-quantized (nf4, double quant)"
    import peft

    model = peft.get_peft_model(keep_cpu_layout(loaded.model), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    streamed = poros.prepare(model)
    losses, _ = train_adamw(streamed, streamed.trainable_parameters(), [make_batch(1, 2, 9, "left")])
    assert torch.isfinite(torch.tensor(losses)).all()
    assert main(["quantize", str(config), str(tmp_path / "other"), "--random-weights", "--seed", "3", "--device", "cpu",
                 "--json"]) == 0
    other = tensors_of(tmp_path / "other")["model.layers.0.mlp.up_proj.weight"]
    assert not torch.equal(other, tensors_of(tmp_path / "out")["model.layers.0.mlp.up_proj.weight"])  # the seed


def test_random_weights_hold_one_block_at_a_time(tmp_path, monkeypatch):
    """Every block is serialized while it is the only one with values (the others are meta tensors)."""
    from poros.loading import random_weights

    held = []
    serialize = random_weights.serialize_modules

    def counting(model, modules):
        held.append(sum(any(t.device.type != "meta" for t in [*layer.parameters(), *layer.buffers()])
                        for layer in model.model.layers))
        return serialize(model, modules)

    monkeypatch.setattr(random_weights, "serialize_modules", counting)
    result = random_weights.random_checkpoint(config_only(tmp_path / "config", "qwen2", num_layers=5),
                                              tmp_path / "out", device="cpu")
    assert result.blocks == 5 and held == [1, 1, 1, 1, 1, 0]  # five blocks, then the modules outside them


def test_random_weights_take_a_known_model_name_offline_and_refuse_an_unknown_one(tmp_path):
    from poros.errors import CheckpointLoadError
    from poros.loading.random_weights import model_config_of

    config, directory = model_config_of("Qwen/Qwen2.5-72B")  # the registry's record: no download, no file
    assert directory is None and config.num_hidden_layers == 80 and config.hidden_size == 8192
    with pytest.raises(CheckpointLoadError, match="hf download nobody/nothing config.json") as error:
        model_config_of("nobody/nothing")
    assert "\n" not in str(error.value)
