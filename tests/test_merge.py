"""poros merge: shard by shard, tensor for tensor equal to PEFT's merge_and_unload on the bf16 base."""

from __future__ import annotations

import json
import pathlib
import re

import pytest
import torch

pytest.importorskip("bitsandbytes")

import peft  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from poros.errors import ConfigError, UnsupportedAdapterError  # noqa: E402
from poros.loading.load import MULTIMODAL_KEY_MAPPING  # noqa: E402
from poros.export.merge import merge_adapter  # noqa: E402
from poros.testing import MULTIMODAL_FAMILIES, TINY_VARIANTS, load_qlora, save_tiny_checkpoint, tiny_vlm  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CASES = [(family, variant, kind) for family, variants in TINY_VARIANTS.items() for variant in variants
         for kind in ("lora", "rslora", "dora")]


def _adapter(base, directory, kind: str, **lora):
    """An adapter as Poros trains it: NF4 base, LoRA on all linears, lora_B random (so the merge matters)."""
    model = load_qlora(base, use_rslora=kind == "rslora", use_dora=kind == "dora", **lora)
    model.save_pretrained(directory)
    return directory


def _reference(base, adapter, **load) -> dict[str, torch.Tensor]:
    """PEFT's merge_and_unload on the bf16 base, as ``save_pretrained`` writes it: the checkpoint's own layout
    (transformers writes fused MoE experts back as the per-expert tensors the checkpoint holds)."""
    import tempfile

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16, **load)
    merged = peft.PeftModel.from_pretrained(model, adapter).merge_and_unload()
    with tempfile.TemporaryDirectory() as directory:
        merged.save_pretrained(directory)
        written = _written(pathlib.Path(directory))
    tied = {"lm_head.weight": merged.state_dict()["lm_head.weight"]} if "lm_head.weight" not in written else {}
    return {**written, **tied}


def _written(directory) -> dict[str, torch.Tensor]:
    tensors = {}
    for shard in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


@pytest.mark.parametrize(("family", "variant", "kind"), CASES, ids=["-".join(c) for c in CASES])
def test_merge_equals_merge_and_unload(family, variant, kind, tmp_path):
    base = save_tiny_checkpoint(tmp_path / "base", family, variant)
    adapter = _adapter(base, tmp_path / "adapter", kind, lora_rank=4, lora_alpha=8)
    result = merge_adapter(adapter, tmp_path / "merged", model=base, progress=None)
    merged, original, expected = _written(tmp_path / "merged"), _written(base), _reference(base, adapter)
    assert merged.keys() == original.keys()  # the checkpoint's names; no PEFT key
    changed = [name for name in merged if not torch.equal(merged[name], original[name])]
    assert len(changed) == result.merged_modules > 0
    assert all(name.endswith(".weight") for name in changed)
    unequal = [name for name in merged if not torch.equal(merged[name], expected[name])]
    assert unequal == []
    assert set(expected) - set(merged) <= {"lm_head.weight"}  # a tied head is not written, as save_pretrained does


def test_merged_checkpoint_is_a_plain_hf_checkpoint(tmp_path):
    """Loads in transformers with no missing or unexpected key; the layout vLLM reads; tokenizer copied."""
    from poros.assets import asset_path

    base = asset_path("poros-tiny-qwen3")
    adapter = _adapter(base, tmp_path / "adapter", "lora")
    transformers.AutoTokenizer.from_pretrained(base).save_pretrained(adapter)
    (adapter / "poros_config.json").write_text(json.dumps({"base_model_name_or_path": str(base), "config": {}}))
    merged_dir = tmp_path / "merged"
    merge_adapter(adapter, merged_dir, progress=None)  # the base from poros_config.json
    model, info = transformers.AutoModelForCausalLM.from_pretrained(merged_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    expected = _reference(base, adapter)
    assert all(torch.equal(tensor, expected[name]) for name, tensor in model.state_dict().items())
    config = json.loads((merged_dir / "config.json").read_text())
    assert "quantization_config" not in config and config.get("dtype", "bfloat16") == "bfloat16"
    files = sorted(p.name for p in merged_dir.iterdir())
    assert not [name for name in files if name.startswith(("adapter_", "poros_config"))]
    assert "tokenizer.json" in files or "tokenizer_config.json" in files
    shards = [name for name in files if name.endswith(".safetensors")]
    if len(shards) > 1:
        index = json.loads((merged_dir / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"].values()) == set(shards)
        assert all(re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", name) for name in shards)
        assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size()
                                                      for t in _written(merged_dir).values())
    else:
        assert shards == ["model.safetensors"]
    assert not any("lora" in name for name in _written(merged_dir))


@pytest.mark.parametrize("family", MULTIMODAL_FAMILIES)
def test_multimodal_checkpoint_merges_its_text_tower(family, tmp_path):
    """The adapter names the causal LM's modules; the checkpoint keeps model.language_model.* and its vision tower."""
    base = tmp_path / "vlm"
    tiny_vlm(family).save_pretrained(base, max_shard_size="200KB")
    text_config = transformers.AutoConfig.from_pretrained(base).get_text_config()
    adapter = tmp_path / "adapter"
    model = load_qlora_text(base, text_config)
    model.save_pretrained(adapter)
    merge_adapter(adapter, tmp_path / "merged", model=base, progress=None)
    merged, original = _written(tmp_path / "merged"), _written(base)
    assert merged.keys() == original.keys()
    # the text LM loaded with the multimodal key mapping saves under the checkpoint's own names again
    expected = _reference(base, adapter, config=text_config, key_mapping=MULTIMODAL_KEY_MAPPING)
    vision = [name for name in original if name not in expected]  # the towers the text LM has not
    assert vision and all(torch.equal(merged[name], original[name]) for name in vision)
    text = [name for name in merged if name in expected]
    assert len(text) == len([n for n in expected if n != "lm_head.weight" or n in merged])
    assert [name for name in text if not torch.equal(merged[name], expected[name])] == []
    assert sum(not torch.equal(merged[name], original[name]) for name in text) > 0


def load_qlora_text(base, text_config):
    """The text tower of a multimodal checkpoint, NF4 + LoRA (what poros.loading.load gives training)."""
    from poros.loading.load import load_pretrained

    loaded = load_pretrained(base, device="cpu", load_tokenizer=False)
    torch.manual_seed(0)
    targets = sorted({name.rsplit(".", 1)[-1] for name, module in loaded.model.named_modules()
                      if "Linear" in type(module).__name__ and "lm_head" not in name})
    model = peft.get_peft_model(loaded.model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters()):
            if ".lora_B." in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
    return model


def test_merge_refuses_what_it_cannot_do(tmp_path):
    base = save_tiny_checkpoint(tmp_path / "base", "qwen3")
    adapter = _adapter(base, tmp_path / "adapter", "lora")
    (tmp_path / "taken").mkdir()
    with pytest.raises(ConfigError, match="exists"):
        merge_adapter(adapter, tmp_path / "taken", model=base, progress=None)
    with pytest.raises(ConfigError, match="base"):
        merge_adapter(adapter, base, model=base, progress=None)
    other = save_tiny_checkpoint(tmp_path / "other", "qwen3", num_layers=1)
    with pytest.raises(UnsupportedAdapterError, match="no weight for"):
        merge_adapter(adapter, tmp_path / "merged", model=other, progress=None)
    assert not (tmp_path / "merged").exists()


@given(rank=st.sampled_from([1, 2, 4]), alpha=st.sampled_from([1, 3, 8]),
       kind=st.sampled_from(["lora", "rslora", "dora"]),
       targets=st.sets(st.sampled_from(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
                       min_size=1),
       pattern=st.booleans(), layers=st.sampled_from([None, [1]]))
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_merge_resolves_the_adapter_config_as_peft_does(rank, alpha, kind, targets, pattern, layers, tmp_path_factory):
    """Drawn LoraConfigs: rank/alpha patterns, layers_to_transform, target subsets -- still merge_and_unload's bits."""
    root = tmp_path_factory.mktemp("drawn")
    base = save_tiny_checkpoint(root / "base", "qwen2")
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    target = sorted(targets)[0]
    parent = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    config = peft.LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=sorted(targets), use_rslora=kind == "rslora",
        use_dora=kind == "dora", layers_to_transform=layers,
        rank_pattern={f"layers.1.{parent}.{target}": 3} if pattern else {},  # one module's path
        alpha_pattern={target: 5} if pattern else {})  # a leaf name: every layer's
    torch.manual_seed(0)
    adapted = peft.get_peft_model(model, config)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in sorted(adapted.named_parameters()):
            if ".lora_B." in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    adapted.save_pretrained(root / "adapter")
    merge_adapter(root / "adapter", root / "merged", model=base, progress=None)
    merged, expected = _written(root / "merged"), _reference(base, root / "adapter")
    assert [name for name in merged if not torch.equal(merged[name], expected[name])] == []


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_merge_in_float32(kind, tmp_path):
    """--dtype float32: the base is read in float32 (as from_pretrained(dtype=float32) loads it) and written so."""
    base = save_tiny_checkpoint(tmp_path / "base", "gemma3")
    adapter = _adapter(base, tmp_path / "adapter", kind)
    merge_adapter(adapter, tmp_path / "merged", model=base, dtype="float32", progress=None)
    merged = _written(tmp_path / "merged")
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    expected = peft.PeftModel.from_pretrained(model, adapter).merge_and_unload().state_dict()
    assert all(tensor.dtype == torch.float32 for tensor in merged.values())
    assert [name for name in merged if not torch.equal(merged[name], expected[name])] == []
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["dtype"] == "float32"


def track_reads(monkeypatch) -> list:
    """Patch ``ShardReader.read`` to fail when a tensor is read while one read before it is still alive;
    returns the list of (weak references to) the tensors read. tests/test_gguf.py uses it too."""
    import gc
    import weakref

    from poros.export.merge import ShardReader

    alive, read = [], ShardReader.read

    def tracked(self, name):
        if any(ref() is not None for ref in alive):
            gc.collect()  # PEFT's layers hold reference cycles: what they held goes with a collection
        assert [ref for ref in alive if ref() is not None] == []
        tensor = read(self, name)
        alive.append(weakref.ref(tensor))
        return tensor

    monkeypatch.setattr(ShardReader, "read", tracked)
    return alive


def test_merge_holds_one_base_tensor_at_a_time(tmp_path, monkeypatch):
    """Host memory: when a tensor is read, no tensor read before it is still alive (read, merged, written, dropped)."""
    base = save_tiny_checkpoint(tmp_path / "base", "qwen2")
    adapter = _adapter(base, tmp_path / "adapter", "dora")
    alive = track_reads(monkeypatch)
    result = merge_adapter(adapter, tmp_path / "merged", model=base, progress=None)
    assert len(alive) == result.tensors
