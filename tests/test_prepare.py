"""poros.prepare: what it detects, the guarantee label, and every gate (raised before any weight moves)."""

from __future__ import annotations

import logging

import bitsandbytes as bnb
import peft
import pytest
import torch

import poros
from poros import errors, records
from poros.dropin.model import guarantee_label, platform_of
from poros.testing import load_qlora, save_tiny_checkpoint
from test_parity import make_batch


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("q3") / "ckpt", "qwen3", seed=3)


def block_weights_in_place(model) -> bool:
    """True while no weight has moved: every block's frozen NF4 weight is still a real tensor."""
    quantized = [m for m in model.get_base_model().model.layers.modules() if isinstance(m, bnb.nn.Linear4bit)]
    return bool(quantized) and all(m.weight.numel() > 0 and m.weight.quant_state.absmax.numel() > 0
                                   for m in quantized)


def test_prepare_detects_and_labels(checkpoint, caplog):
    with caplog.at_level(logging.INFO, logger="poros"):
        model = poros.prepare(load_qlora(checkpoint, seed=3, double_quant=True))
    found = model.detection
    assert (found.family, found.quantization, found.double_quant, found.compute_dtype) == ("qwen3", "nf4", True,
                                                                                          "bfloat16")
    assert found.adapters == ("lora",) and "q_proj" in found.targets
    assert found.provider.startswith("poros.families.qwen3 (poros-train")
    assert found.platform_class == platform_of(torch.device("cpu"))[1]
    has_record = any(r["platform_class"] == found.platform_class and r["label"] == "bitwise"
                     for r in records.validations("qwen3"))
    assert model.guarantee == ("bitwise" if has_record else "unverified")
    assert "poros: guarantee" in caplog.text and "family qwen3" in caplog.text


def test_rslora_is_numerical_until_gated_and_require_refuses_it(checkpoint):
    model = load_qlora(checkpoint, seed=3, use_rslora=True)
    with pytest.raises(errors.GuaranteeError, match="require='bitwise'.*rslora is not gated.*pass require"):
        poros.prepare(model, require="bitwise")
    assert block_weights_in_place(model)
    streamed = poros.prepare(model, require="numerical")
    assert streamed.detection.adapters == ("rslora",)
    if streamed.guarantee != "unverified":
        assert streamed.guarantee == "numerical"


def test_guarantee_label_rules(tmp_path, monkeypatch):
    monkeypatch.setenv(records.REGISTRY_DIR_ENV, str(tmp_path))
    (tmp_path / "fam.toml").write_text(
        'family = "fam"\n[[validation]]\nplatform = "GPU"\nplatform_class = "cuda-sm90"\nlabel = "bitwise"\n'
        'adapter = "lora"\ndate = "2026-11-29"\n'
    )
    assert guarantee_label("fam", ("lora",), "nf4", "cuda-sm80", True)[0] == "unverified"
    assert guarantee_label("fam", ("lora",), "nf4", "cuda-sm90", True)[0] == "bitwise"
    label, reason = guarantee_label("fam", ("lora",), "nf4", "cuda-sm90", False)
    assert label == "numerical" and "use_deterministic_algorithms" in reason
    assert guarantee_label("fam", ("dora",), "nf4", "cuda-sm90", True)[0] == "numerical"
    assert guarantee_label("fam", ("lora",), "fp4", "cuda-sm90", True)[0] == "numerical"


# -- gates ---------------------------------------------------------------------------------------
def test_gate_already_prepared(checkpoint):
    model = load_qlora(checkpoint, seed=3)
    handle = poros.prepare(model)
    with pytest.raises(errors.AlreadyPreparedError, match="unpatch"):
        poros.prepare(model)
    store = handle.store
    handle.unpatch()
    # a handle (or store) kept after unpatch holds no block memory: the weights are back in the model
    assert store.slots == [] and all(block.buffer is None for block in store.blocks)
    poros.prepare(model)  # after unpatch it can be prepared again


def test_gate_base_not_frozen(checkpoint):
    model = load_qlora(checkpoint, seed=3)
    model.get_base_model().lm_head.weight.requires_grad_(True)
    with pytest.raises(errors.BaseNotFrozenError, match="lm_head.*Freeze the base"):
        poros.prepare(model)
    assert block_weights_in_place(model)


def test_gate_trainable_inside_a_block(checkpoint):
    model = load_qlora(checkpoint, seed=3)
    model.get_base_model().model.layers[0].input_layernorm.weight.requires_grad_(True)
    with pytest.raises(errors.TrainableInBlockError, match="input_layernorm.*requires_grad_\\(False\\)"):
        poros.prepare(model)
    assert block_weights_in_place(model)


def test_gate_accelerate_offload(checkpoint):
    model = load_qlora(checkpoint, seed=3)
    model.get_base_model().hf_device_map = {"model.embed_tokens": 0, "model.layers": "cpu", "lm_head": 0}
    with pytest.raises(errors.OffloadedModelError, match="model.layers.*device_map=\\{'': 0\\}"):
        poros.prepare(model)
    assert block_weights_in_place(model)


def test_gate_eight_bit_base(checkpoint):
    model = load_qlora(checkpoint, seed=3)
    model.get_base_model().model.extra_projection = bnb.nn.Linear8bitLt(8, 8, has_fp16_weights=False)
    with pytest.raises(errors.QuantizationError, match="8 bits.*load_in_4bit=True"):
        poros.prepare(model)
    assert block_weights_in_place(model)


def test_gate_adapter_type_not_in_matrix(checkpoint):
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint, quantization_config=transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                                        bnb_4bit_compute_dtype=torch.bfloat16),
        device_map={"": "cpu"}, dtype=torch.bfloat16)
    model = peft.get_peft_model(base, peft.IA3Config(target_modules=["k_proj", "v_proj", "down_proj"],
                                                     feedforward_modules=["down_proj"], task_type="CAUSAL_LM"))
    with pytest.raises(errors.UnsupportedAdapterError, match="IA3.*docs/adapters.md.*LoraConfig"):
        poros.prepare(model)
    assert block_weights_in_place(model)


def test_gate_reentrant_checkpointing_before_and_after_prepare(checkpoint):
    model = load_qlora(checkpoint, seed=3)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(errors.CheckpointingError, match="reentrant.*use_reentrant': False"):
        poros.prepare(model)
    assert block_weights_in_place(model)

    model.gradient_checkpointing_disable()
    streamed = poros.prepare(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(errors.CheckpointingError):
        streamed(**make_batch(0, 1, 8, "none"))
    # non-reentrant HF checkpointing enabled after prepare (HF Trainer does that) is switched off
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    streamed(**make_batch(0, 1, 8, "none")).loss.backward()
    assert not any(layer.gradient_checkpointing for layer in model.get_base_model().model.layers)


def test_gate_use_cache_in_training(checkpoint):
    streamed = poros.prepare(load_qlora(checkpoint, seed=3))
    with pytest.raises(errors.CacheDuringTrainingError, match="use_cache=False"):
        streamed(**make_batch(0, 1, 8, "none"), use_cache=True)
    with torch.no_grad():
        streamed(**make_batch(0, 1, 8, "none"), use_cache=True)  # evaluation may ask for it; it is ignored


def test_gate_not_a_causal_lm(checkpoint):
    import transformers

    trunk = transformers.AutoModel.from_pretrained(checkpoint, dtype=torch.bfloat16)
    with pytest.raises(errors.UnsupportedModelError, match="Qwen3Model.*AutoModelForCausalLM"):
        poros.prepare(trunk)


def test_to_the_compute_device_keeps_the_streamed_placement(checkpoint, monkeypatch, tmp_path):
    """HF Trainer / accelerate call ``model.to(args.device)`` on a model without ``hf_device_map`` (one
    loaded through poros.from_pretrained has none): on CUDA ``nn.Module.to`` brought the host-kept
    embedding table back to the card and the first lookup failed. A prepared model's ``to`` on its
    compute device moves nothing; another device or a dtype is refused by name."""
    import transformers

    from poros.testing.models import Rows

    model = poros.prepare(load_qlora(checkpoint, seed=3), embeddings_on_host=True)
    applied = []
    original = torch.nn.Module._apply
    monkeypatch.setattr(torch.nn.Module, "_apply", lambda self, fn, *a, **k: applied.append(self) or original(
        self, fn, *a, **k))
    assert model.to("cpu") is model and model.to(torch.device("cpu")) is model and model.cpu() is model
    assert model.to(device="cpu", non_blocking=True) is model
    assert model.to(torch.device("cpu", 0)) is model  # accelerate's ranks on the CPU name cpu:0
    for asked in [("meta",), (torch.bfloat16,), ("cpu", torch.float32)]:
        with pytest.raises(errors.DeviceError, match=r"computes on cpu.*unpatch\(\) first"):
            model.to(*asked)
    ids = torch.randint(0, model.config.vocab_size, (4, 16))
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2,
                                          report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args,
                                   train_dataset=Rows([{"input_ids": i, "labels": i.clone()} for i in ids]))
    trainer.train()
    assert applied == [] and model.host_tables and all(
        t.module.weight.device.type == "cpu" for t in model.host_tables)
