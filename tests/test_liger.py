"""Users' fused kernels stream too (issue 41): ``kernels: liger`` and ``use_liger_kernel=True``.

What a CPU can check honestly. Liger's kernels are Triton kernels and a CPU cannot launch them, so no
test here runs a Liger forward; the bitwise check of Liger's kernels streamed against the same Trainer
without Poros is the H200's (``tools/gpu_run.sh bench:...:arms=trl-resident,trl-poros:...:liger``,
``gate:liger``; docs/benchmarking.md). Here, on real tiny models of every family, with real HF and TRL
trainers:

* the planner prices Liger's fused linear cross-entropy and says it replaces ``loss_chunks`` (no Liger needed);
* ``kernels`` is checked like every setting, and asking for Liger without liger-kernel fails in one line;
* with liger-kernel and Triton installed (``pip install 'poros-train[liger]'``; the tests skip without them,
  saying so): ``prepare_trainer`` applies Liger as the Trainer does, to the very module objects the streamed
  blocks run; the banner names what Liger patched; no chunked head is installed under Liger's; ``mlp_chunks``
  tiles over Liger's forwards and tiles again after the Trainer's own second application; Liger's experts
  kernel over NF4-packed experts is refused; and ``trainer.train()`` runs the real path -- the Trainer's own
  Liger call, ``PorosCallback`` streaming after it, layer-major accumulation -- until a streamed decoder layer
  calls Liger's RMSNorm, whose Triton launch a CPU cannot make (the traceback shows the executor's frame above it).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import poros
from poros.config import PorosConfig
from poros.errors import ConfigError, MissingDependencyError
from poros.plan import budget as planner
from poros.plan.activations import fused_loss_bytes
from poros.testing import qlora_model, save_tiny_checkpoint
from poros.testing.models import TINY_VARIANTS

HAVE_LIGER = importlib.util.find_spec("liger_kernel") is not None and importlib.util.find_spec("triton") is not None
needs_liger = pytest.mark.skipif(not HAVE_LIGER, reason="liger-kernel and Triton are not installed "
                                                        "(pip install 'poros-train[liger]')")
FAMILIES = list(TINY_VARIANTS)


# -- without Liger ---------------------------------------------------------------------------------
def test_the_planner_prices_ligers_fused_head_and_says_it_replaces_loss_chunks(tmp_path):
    from poros.plan.run_plan import plan_run

    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt", "qwen3", seed=2)
    common = dict(model=str(checkpoint), device="cpu", seq_len=64, loss_chunks=8)
    chunked, fused = (plan_run(PorosConfig(**common, kernels=k)) for k in ("default", "liger"))
    tokens, value = 64, fused.activation_bytes_per_value
    # one chunk of logits and the whole input gradient (Liger's forward makes it), fp32 per-token losses
    assert fused.logits_bytes == fused_loss_bytes(tokens, fused.hidden_size, fused.vocab_size, value) + tokens * 4
    assert fused.logits_bytes != chunked.logits_bytes
    # Liger's chunk: ceil(1000 / 64) = 16, 64 / 16 = 4 tokens (a power of two); 5 tokens round up to 8 (<= 70)
    assert fused_loss_bytes(64, 64, 1000, 2) == 64 * 64 * 2 + 4 * 1000 * 2
    assert fused_loss_bytes(70, 64, 1000, 2) == 70 * 64 * 2 + 8 * 1000 * 2
    # under a budget: loss_chunks stays 1 and the plan says why
    plan = planner.plan_budget(fused.footprint(), fused.workload,
                               poros.StreamOptions(vram_budget="40GiB", workload=fused.workload))
    assert plan.loss_chunks == 1 and fused.workload.fused_loss
    assert any("fused linear cross-entropy" in note and "replaces loss_chunks=8" in note for note in plan.notes)


def test_ligers_kernels_earn_bitwise_only_where_a_record_gates_them(tmp_path, monkeypatch):
    from poros import records
    from poros.dropin.detection import guarantee_label

    monkeypatch.setenv(records.REGISTRY_DIR_ENV, str(tmp_path))
    record = 'platform = "GPU"\nplatform_class = "cuda-sm90"\nlabel = "bitwise"\nadapter = "lora"\ndate = "2026-12-03"\n'
    (tmp_path / "fam.toml").write_text(f'family = "fam"\n[[validation]]\n{record}')
    assert guarantee_label("fam", ("lora",), "nf4", "cuda-sm90", True)[0] == "bitwise"
    label, reason = guarantee_label("fam", ("lora",), "nf4", "cuda-sm90", True, kernels="liger")
    assert label == "numerical" and "liger's kernels are not gated for fam" in reason and "--liger" in reason
    (tmp_path / "fam.toml").write_text(f'family = "fam"\n[[validation]]\n{record}[[validation]]\n{record}'
                                       'kernels = "liger"\n')
    assert guarantee_label("fam", ("lora",), "nf4", "cuda-sm90", True, kernels="liger")[0] == "bitwise"
    assert guarantee_label("fam", ("lora",), "nf4", "cuda-sm90", False, kernels="liger")[0] == "numerical"


def test_kernels_is_checked_like_every_setting():
    with pytest.raises(ConfigError, match=r"kernels='triton': expected one of default, liger .*kernels: liger"):
        PorosConfig(kernels="triton")
    with pytest.raises(ConfigError, match="kernels='fast'"):
        poros.StreamOptions(kernels="fast")
    assert poros.StreamOptions().kernels == "default" and PorosConfig().kernels == "default"
    with pytest.raises(ConfigError, match=r"unknown key 'use_liger_kernel'.*Poros spells it kernels: liger"):
        PorosConfig(use_liger_kernel=True)  # HF's switch: not an alias (its values are not the field's)


def test_poros_trainer_refuses_liger_off_cuda_before_loading():
    from poros.training.trainer import PorosTrainer

    with pytest.raises(ConfigError, match=r"kernels='liger' on cpu: .*CUDA devices only.*kernels: default"):
        PorosTrainer.from_pretrained("poros-tiny-qwen3", kernels="liger", device="cpu")


@pytest.mark.skipif(HAVE_LIGER, reason="liger-kernel is installed here: the refusal needs it absent")
def test_asking_for_liger_without_it_fails_in_one_line(tmp_path):
    model = qlora_model("qwen3", tmp_path=tmp_path)
    with pytest.raises(MissingDependencyError, match=r"needs liger-kernel.*pip install 'poros-train\[liger\]'"):
        poros.prepare(model, kernels="liger")
    assert not hasattr(model, "store")  # refused before anything moved


# -- with Liger (its kernels never run on a CPU) ----------------------------------------------------
@pytest.fixture(autouse=True)
def ligers_module_patches_undone():
    """Liger also swaps classes and ``apply_rotary_pos_emb`` in transformers' modeling modules, process-wide;
    each test puts them back, so no later test builds a model of Liger's classes (which a CPU cannot run)."""
    import importlib
    import sys

    for family in ("qwen2", "qwen3", "qwen3_5", "qwen3_5_moe", "gemma3", "gemma4"):  # the modules Liger patches
        importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    modules = [m for name, m in list(sys.modules.items())
               if name.startswith("transformers.models.") and name.rsplit(".", 1)[-1].startswith("modeling_")]
    saved = [(m, dict(vars(m))) for m in modules]
    yield
    for module, before in saved:
        for name, value in before.items():
            if vars(module).get(name) is not value:
                setattr(module, name, value)


def _liger_forward(module) -> str | None:
    forward = module.__dict__.get("forward")
    function = getattr(forward, "__func__", None)
    return function.__qualname__ if function is not None and function.__module__.startswith("liger_kernel") else None


@needs_liger
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("flow", ["trl", "hf"])
def test_prepare_trainer_streams_the_modules_liger_patched(family, flow, tmp_path, capsys):
    import transformers
    import trl

    model = qlora_model(family, tmp_path=tmp_path)
    args = dict(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], max_steps=1, use_liger_kernel=True,
                per_device_train_batch_size=1, gradient_accumulation_steps=2)
    rows = [{"input_ids": [1, 2, 3, 4]}] * 2
    if flow == "trl":
        from datasets import Dataset

        from poros.assets import asset_path

        tokenizer = transformers.AutoTokenizer.from_pretrained(asset_path("poros-tiny-qwen3"))
        trainer = trl.SFTTrainer(model=model, args=trl.SFTConfig(**args, max_length=4),
                                 train_dataset=Dataset.from_list(rows), processing_class=tokenizer)
    else:
        trainer = transformers.Trainer(model=model, args=transformers.TrainingArguments(**args),
                                       train_dataset=rows)
    causal_lm = model.get_base_model()
    layer_ids = [id(layer) for layer in causal_lm.model.layers]
    handle = poros.prepare_trainer(trainer, loss_chunks=4)
    banner = capsys.readouterr().err
    report = handle.kernel_report
    assert handle is model and report.applied and "kernels liger (rms_norm x" in banner
    # the streamed blocks are the layer objects Liger patched: each one's norms run Liger's forward
    layers = handle.executor.layers
    assert [id(layer) for layer in layers] == layer_ids
    assert all(_liger_forward(layer.input_layernorm) == "LigerRMSNorm.forward" for layer in layers)
    assert all(any("MLP" in (_liger_forward(m) or "") for m in layer.mlp.modules()) for layer in layers)
    # TRL keeps its own fused head (it turns Liger's off); HF's Trainer takes Liger's, which replaces loss_chunks
    fused = flow == "hf"
    assert report.fused_loss is fused and (handle._chunked_loss is None) is fused
    assert (_liger_forward(causal_lm) is not None) is fused
    assert handle.stream_options.loss_chunks == (1 if fused else 4)
    assert trainer.model is model and _liger_forward(causal_lm.model.norm) == "LigerRMSNorm.forward"
    handle.unpatch()


@needs_liger
def test_kernels_liger_applies_it_for_poros_trainer_and_tiling_keeps_ligers_forward(tmp_path):
    from poros.dropin.kernels import apply_liger
    from poros.stream.options import StreamOptions

    config = PorosConfig(kernels="liger", mlp_chunks=2, loss_chunks=4, seq_len=16, device="cpu")
    model = qlora_model("qwen3", tmp_path=tmp_path)
    handle = poros.prepare(model, options=StreamOptions.from_config(config))  # what PorosTrainer calls
    mlp = handle.executor.layers[0].mlp
    assert handle.kernel_report.fused_loss and handle._chunked_loss is None
    assert mlp.forward._poros_inner.__func__.__qualname__ == "LigerSwiGLUMLP.forward"  # tiled over Liger's
    apply_liger(model)  # the Trainer's second call when train() starts rebinds Liger's forward over the tiled one
    assert _liger_forward(mlp) == "LigerSwiGLUMLP.forward"
    rebound = [m for m in handle._tiled_mlp.modules if _liger_forward(m) is not None]  # the MLPs and norms
    assert len(rebound) > 2 and handle._tiled_mlp.retile() == len(rebound)  # the next streamed forward's gate
    assert mlp.forward._poros_tiled is mlp and _liger_forward(mlp) is None
    handle.unpatch()
    assert _liger_forward(mlp) == "LigerSwiGLUMLP.forward"  # unpatched: Liger's forward, as the user left it


@needs_liger
def test_a_family_liger_has_no_kernels_for_is_named_and_packed_experts_are_refused(tmp_path):
    from poros.dropin.kernels import KernelReport, apply_liger, unpatched_reason

    model = qlora_model("qwen3", tmp_path=tmp_path / "a")
    causal_lm = model.get_base_model()
    causal_lm.config.model_type = "qwen3_unknown"  # a registered family's model liger-kernel does not list
    apply_liger(model)  # (an earlier test's class-level swaps may have built it of Liger's classes already)
    assert "forward" not in causal_lm.__dict__  # the instance untouched: no fused head, no rebound module
    assert not any("forward" in m.__dict__ for m in causal_lm.model.layers.modules())
    reason = unpatched_reason(causal_lm)
    assert "has no kernels for model type 'qwen3_unknown' (Qwen3ForCausalLM)" in reason
    assert KernelReport(unpatched=reason).summary() == f"liger not applied: {reason}"  # the banner's words

    # experts poros.quantize_experts packed to NF4: a trainer's Liger experts kernel over them is refused (the
    # Trainer would bind it again at train()); Poros's own kernels: liger leaves them Poros's NF4 forward
    moe, other = (qlora_model("qwen3_5_moe", tmp_path=tmp_path / d) for d in "bc")  # before Liger swaps classes
    poros.quantize_experts(moe)
    poros.quantize_experts(other)
    apply_liger(moe)
    with pytest.raises(ConfigError, match=r"Liger's experts kernel .*packed to NF4.*'swiglu': False"):
        poros.prepare(moe)
    assert torch.is_tensor(next(moe.parameters()))
    moe = other
    handle = poros.prepare(moe, kernels="liger")
    experts = [m for name, m in moe.named_modules() if name.endswith("mlp.experts")]
    assert experts and all("forward" not in m.__dict__ for m in experts)
    assert "experts: Poros's NF4 forward" in handle.kernel_report.summary()
    assert all(_liger_forward(layer.mlp.shared_expert) for layer in handle.executor.layers)
    handle.unpatch()


def _sft_trainer(model, tmp_path, **extra):
    import transformers
    import trl
    from datasets import Dataset

    from poros.assets import asset_path

    tokenizer = transformers.AutoTokenizer.from_pretrained(asset_path("poros-tiny-qwen3"))
    args = trl.SFTConfig(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], max_steps=1, max_length=4,
                         use_liger_kernel=True, per_device_train_batch_size=1, gradient_accumulation_steps=2)
    return trl.SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list([{"input_ids": [1, 2, 3, 4]}] * 2),
                          processing_class=tokenizer, **extra)


def _reached_liger_in_a_streamed_block(raised) -> None:
    """The failed launch came from Liger's module inside a decoder layer the streaming executor called."""
    files = [str(entry.path) for entry in raised.traceback]
    executor = max(i for i, f in enumerate(files) if f.endswith("poros/stream/executor.py"))
    layer = next(i for i, f in enumerate(files) if i > executor and "/models/qwen3/modeling_qwen3.py" in f)
    assert any("liger_kernel/transformers/rms_norm.py" in f for f in files[layer:]), files


@needs_liger
def test_the_trainers_own_liger_call_at_train_leaves_the_streamed_model_as_prepared(tmp_path, capsys):
    """``train()`` applies Liger again (HF's call), then its first forward reaches Liger's first Triton launch,
    which a CPU cannot make: up to there, the real path. ``PorosCallback`` streams at ``on_train_begin``, after
    that call, with TRL's final config (its fused head kept, Liger's fused cross-entropy off)."""
    callback = poros.PorosCallback()
    model = qlora_model("qwen3", tmp_path=tmp_path / "a")
    trainer = _sft_trainer(model, tmp_path / "a", callbacks=[callback])
    assert callback.model is None  # not at on_init_end: TRL sets its liger_kernel_config after it
    with pytest.raises(RuntimeError, match="driver") as raised:  # Liger's first kernel, on a CPU
        trainer.train()
    _reached_liger_in_a_streamed_block(raised)
    handle = callback.model
    assert handle is model and handle.kernel_report.applied and not handle.kernel_report.fused_loss
    assert handle.executor.trunk.__dict__["forward"] == handle.executor.trunk_forward  # still streamed
    assert "kernels liger (rms_norm x" in capsys.readouterr().err
    handle.unpatch()

    model = qlora_model("qwen3", tmp_path=tmp_path / "b")
    trainer = _sft_trainer(model, tmp_path / "b")
    handle = poros.prepare_trainer(trainer, loss_chunks=4)
    forward, chunked = model.get_base_model().__dict__.get("forward"), handle._chunked_loss
    with pytest.raises(RuntimeError, match="driver") as raised:
        trainer.train()
    _reached_liger_in_a_streamed_block(raised)
    # the second application rebound the same functions: TRL's head under Poros's chunked head, Liger's norms
    assert model.get_base_model().__dict__.get("forward") is forward and chunked is not None and chunked.head.active
    assert _liger_forward(handle.executor.layers[0].mlp) == "LigerSwiGLUMLP.forward"
    handle.unpatch()
