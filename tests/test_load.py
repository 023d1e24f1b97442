"""poros.loading.load: checkpoints into the family's causal LM, bitwise the reference's base, with typed errors.

The reference is transformers' own ``AutoModelForCausalLM.from_pretrained(..., quantization_config=
BitsAndBytesConfig(nf4))`` -- the model the parity tests train resident. Multimodal checkpoints
(Gemma 3 4B+, Gemma 4, Qwen 3.5/3.6 are published that way) must give the text tower, with every
weight from the checkpoint: the trap is ``Gemma3ForCausalLM.from_pretrained(vlm)``, which random-
initialises everything with only a warning.
"""

from __future__ import annotations

import json

import pathlib

import pytest
import torch
import transformers

from poros.errors import CheckpointLoadError, UnknownArchitectureError
from poros.loading.load import inspect_checkpoint, load_pretrained, resolve_checkpoint
from poros.testing import MULTIMODAL_FAMILIES, TINY_VARIANTS, save_tiny_checkpoint, tiny_config, tiny_vlm

FAMILIES = sorted(TINY_VARIANTS)


def reference_base(path, **kwargs):
    quantization_config = transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=quantization_config, device_map={"": "cpu"}, dtype=torch.bfloat16, **kwargs)


def assert_same_tensors(mine: dict, theirs: dict) -> None:
    assert sorted(mine) == sorted(theirs)
    different = [key for key in mine if not torch.equal(mine[key], theirs[key])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


@pytest.mark.parametrize("family", FAMILIES)
def test_loaded_base_is_bitwise_the_reference_base(family, tmp_path):
    path = save_tiny_checkpoint(tmp_path / family, family, max_shard_size="20KB")
    loaded = load_pretrained(path, load_tokenizer=False, device="cpu")
    assert loaded.descriptor.name == family
    assert not loaded.info.multimodal and len(loaded.info.weight_files) > 1  # sharded, like real checkpoints
    assert_same_tensors(loaded.model.state_dict(), reference_base(path).state_dict())


@pytest.mark.parametrize("family", FAMILIES)
def test_the_device_paths_move_to_the_host_keeps_every_tensor(family, tmp_path):
    """The CUDA path replaces each block tensor by a host copy as transformers sets it; run that path
    here. transformers re-initialises any tensor that lost its ``_is_hf_initialized`` mark (Gemma 4's
    ``layer_scalar`` buffers became 1.0 on the H200 before the mark was kept)."""
    path = save_tiny_checkpoint(tmp_path / family, family, max_shard_size="20KB")
    loaded = load_pretrained(path, load_tokenizer=False, device="cpu", _blocks_to_host_on_cpu=True)
    assert_same_tensors(loaded.model.state_dict(), reference_base(path).state_dict())


def test_a_transformers_without_the_loading_hook_is_a_clear_error(tmp_path, monkeypatch):
    from transformers import core_model_loading

    path = save_tiny_checkpoint(tmp_path, "qwen3")
    monkeypatch.delattr(core_model_loading, "set_param_for_module")
    with pytest.raises(CheckpointLoadError, match="transformers==5.24"):
        load_pretrained(path, load_tokenizer=False, device="cpu", _blocks_to_host_on_cpu=True)


def save_text_tower(vlm, family: str, path: pathlib.Path) -> pathlib.Path:
    """The VLM's text weights as a text-only checkpoint of the family's causal LM (the expected result)."""
    causal = transformers.AutoModelForCausalLM.from_config(tiny_config(family), dtype=torch.bfloat16)
    state = {key.replace("model.language_model.", "model.", 1): value for key, value in vlm.state_dict().items()
             if key.startswith(("model.language_model.", "lm_head."))}
    causal.load_state_dict(state, strict=True)
    causal.save_pretrained(path)
    return path


@pytest.mark.parametrize("family", MULTIMODAL_FAMILIES)
def test_multimodal_checkpoint_trains_its_text_tower(family, tmp_path):
    vlm = tiny_vlm(family, seed=3)
    vlm.save_pretrained(tmp_path / "vlm", max_shard_size="20KB")
    text_path = save_text_tower(vlm, family, tmp_path / "text")

    loaded = load_pretrained(tmp_path / "vlm", load_tokenizer=False, device="cpu")
    assert loaded.info.multimodal
    assert type(loaded.model) is type(reference_base(text_path))
    assert_same_tensors(loaded.model.state_dict(), reference_base(text_path).state_dict())


@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
def test_the_trap_the_loader_avoids_is_real(family, tmp_path):
    """Loading a Gemma VLM checkpoint with the text class leaves the text weights uninitialised."""
    tiny_vlm(family).save_pretrained(tmp_path)
    text_class = type(transformers.AutoModelForCausalLM.from_config(tiny_config(family)))
    _, info = text_class.from_pretrained(tmp_path, output_loading_info=True)
    assert any(".layers.0." in key for key in info["missing_keys"])


def test_weights_that_would_be_random_initialised_are_an_error(tmp_path):
    vlm = tiny_vlm("gemma3")
    renamed = {key.replace("language_model", "text_tower"): value for key, value in vlm.state_dict().items()}
    vlm.save_pretrained(tmp_path, state_dict=renamed)
    with pytest.raises(CheckpointLoadError, match="randomly initialised") as error:
        load_pretrained(tmp_path, load_tokenizer=False, device="cpu")
    assert "model.layers.0." in str(error.value) and "multimodal" in str(error.value)


def test_missing_shard_names_the_file(tmp_path):
    path = save_tiny_checkpoint(tmp_path, "qwen3", max_shard_size="20KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    lost = sorted(set(index["weight_map"].values()))[1]
    (path / lost).unlink()
    with pytest.raises(CheckpointLoadError, match=lost):
        load_pretrained(path, load_tokenizer=False, device="cpu")


def test_shape_mismatch_is_an_error(tmp_path):
    path = save_tiny_checkpoint(tmp_path, "qwen2")
    config = json.loads((path / "config.json").read_text())
    config["intermediate_size"] *= 2
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointLoadError, match="shapes do not match") as error:
        load_pretrained(path, load_tokenizer=False, device="cpu")
    assert "mlp" in str(error.value)


def test_unknown_architecture_is_an_error(tmp_path):
    transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)) \
        .save_pretrained(tmp_path)
    with pytest.raises(UnknownArchitectureError, match="gpt2"):
        load_pretrained(tmp_path, load_tokenizer=False, device="cpu")


def test_pickle_weights_need_an_explicit_opt_in(tmp_path):
    path = save_tiny_checkpoint(tmp_path, "qwen3", max_shard_size="50MB")
    state = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).state_dict()
    torch.save(state, path / "pytorch_model.bin")
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointLoadError, match="allow_pickle=True"):
        load_pretrained(path, load_tokenizer=False, device="cpu")
    loaded = load_pretrained(path, load_tokenizer=False, device="cpu", allow_pickle=True)
    assert loaded.info.weight_format == "pickle"


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointLoadError, match="no config.json"):
        inspect_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(tiny_config("qwen3").to_dict()))
    with pytest.raises(CheckpointLoadError, match="no weights"):
        inspect_checkpoint(tmp_path)
    with pytest.raises(CheckpointLoadError, match="is a file"):
        resolve_checkpoint(tmp_path / "config.json")
    with pytest.raises(CheckpointLoadError, match="no checkpoint directory"):
        resolve_checkpoint(tmp_path / "nothing-here")


def test_hub_id_resolves_from_the_cache_offline(tmp_path, monkeypatch):
    """A hub id works with no network once it is in the HF cache (the layout huggingface_hub writes)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache = tmp_path / "hub"
    repo = cache / "models--poros-test--tiny-qwen3"
    revision = "0" * 40
    save_tiny_checkpoint(repo / "snapshots" / revision, "qwen3")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert resolve_checkpoint("poros-test/tiny-qwen3") == repo / "snapshots" / revision
    with pytest.raises(CheckpointLoadError, match="not in the HF cache"):
        resolve_checkpoint("poros-test/not-cached")


@pytest.mark.skipif(not pathlib.Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_host_memory_during_load_stays_below_the_bf16_model(tmp_path):
    """Peak anonymous RSS while loading ~100 MB of bf16 shards (``tools/bench/load_memory.py``): well under
    their size (NF4 + a tensor in flight), while materialising the shards (the control) reaches it."""
    from tools.bench.load_memory import measure

    result = measure(tmp_path, layers=16)
    bf16, control, streamed = (result["bf16_checkpoint_bytes"], result["control_peak_delta_bytes"],
                               result["poros_peak_delta_bytes"])
    assert bf16 > 90e6
    assert control > 0.9 * bf16, (control, bf16)  # the measurement sees a full read
    assert streamed < 0.75 * bf16, f"load peaked at {streamed / 1e6:.0f} MB for {bf16 / 1e6:.0f} MB bf16"


def test_bundled_tiny_model_resolves(tmp_path):
    pytest.importorskip("poros.assets")
    path = resolve_checkpoint("poros-tiny-qwen3")
    assert (path / "config.json").is_file() and inspect_checkpoint(path).has_tokenizer



