"""Mixture-of-experts: the ``qwen3_5_moe`` family and Gemma 4's MoE, streamed bit-for-bit as resident.

Three ways to hold the experts, each drawn by hypothesis per MoE family and trained resident and
streamed from the same checkpoint, ``torch.equal`` on every loss, LoRA tensor and AdamW state:

* bf16 experts as transformers leaves them (LoRA on the linears);
* LoRA on the experts too, through PEFT's ``target_parameters`` (``ParamWrapper`` on the fused 3-D tensors);
* NF4 experts (``poros.quantize_experts``): the resident NF4-expert model is the reference.

Plus: the router aux loss (``output_router_logits``) micro-major and layer-major, the streamed bytes of
NF4 experts against bf16, ``poros list-architectures`` and ``poros plan`` of a known MoE checkpoint, the
trainer's default and the graph reason.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys
import tempfile

import peft
import pytest
import torch
import transformers
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import poros
from poros.errors import PorosError
from poros.loading.experts import EXPERTS_IMPLEMENTATION, experts_modules, is_quantized
from poros.stream.store import packed_block_bytes
from poros.testing import load_qlora, save_tiny_checkpoint
from test_layer_major import layer_major_steps, resident_steps, with_item_counts
from test_parity import assert_bitwise, make_batch, parity_setups, train, trainable

ROOT = pathlib.Path(__file__).resolve().parents[1]
MOE = [("qwen3_5_moe", "default"), ("gemma4", "moe")]
IDS = [f"{f}-{v}" for f, v in MOE]
#: PEFT's target_parameters for the fused experts (the same leaf names in both families)
EXPERT_PARAMETERS = ["experts.gate_up_proj", "experts.down_proj"]


def load(path, setup: dict, experts: str):
    """The checkpoint as the reference loads it, with its experts ``"bf16"``, ``"nf4"`` or ``"lora"`` (bf16
    with LoRA on them through target_parameters, beside LoRA on the attention projections)."""
    lora = {"lora_rank": setup["lora_rank"], "lora_alpha": setup["lora_alpha"], "seed": setup["seed"],
            "double_quant": setup["double_quant"]}
    if experts != "lora":
        model = load_qlora(path, **lora)
        return poros.quantize_experts(model) if experts == "nf4" else model
    quantization = transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16,
        bnb_4bit_use_double_quant=setup["double_quant"])
    base = transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=quantization,
                                                             device_map={"": "cpu"}, dtype=torch.bfloat16)
    config = peft.LoraConfig(r=setup["lora_rank"], lora_alpha=setup["lora_alpha"], lora_dropout=0.0,
                             target_modules=["q_proj", "v_proj"], target_parameters=EXPERT_PARAMETERS)
    torch.manual_seed(setup["seed"])
    model = peft.get_peft_model(base, config)
    generator = torch.Generator().manual_seed(setup["seed"])
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters()):
            if ".lora_B." in name:
                parameter.copy_((torch.randn(parameter.shape, generator=generator) * 0.02).to(parameter.dtype))
    return model.train()


def run_moe_parity(family, variant, setup, directory, experts, **config):
    try:
        path = save_tiny_checkpoint(directory / "ckpt", family, variant, seed=setup["seed"],
                                    **{**setup["config"], **config})
    except ValueError:
        assume(False)
    batches = [make_batch(setup["seed"] + s, setup["batch"], setup["seq"], setup["padding"])
               for s in range(setup["steps"])]
    reference = load(path, setup, experts)
    ref_losses, ref_opt = train(reference, list(trainable(reference).values()), batches)
    model = load(path, setup, experts)
    streamed = poros.prepare(model)
    poros_losses, poros_opt = train(streamed, streamed.trainable_parameters(), batches)
    assert_bitwise(reference, model, ref_losses, poros_losses, ref_opt, poros_opt)
    return model


@pytest.mark.parametrize("experts", ["nf4", "lora"])
@pytest.mark.parametrize(("family", "variant"), MOE, ids=IDS)
def test_streamed_moe_training_is_bitwise_resident(family, variant, experts):
    """bf16 experts are drawn by tests/test_parity.py (every tiny variant); here NF4 and LoRA'd experts."""
    @settings(max_examples=2, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(setup=parity_setups(family, variant).filter(lambda s: s["config"]["num_layers"] >= 2))
    def check(setup):
        with tempfile.TemporaryDirectory() as directory:
            model = run_moe_parity(family, variant, {**setup, "reference_checkpointing": False},
                                   pathlib.Path(directory), experts)
            modules = experts_modules(model)
            assert modules and all(is_quantized(m) == (experts == "nf4") for _, m in modules)
            if experts == "lora":
                assert any(".experts." in name and "lora_A" in name for name in trainable(model))

    check()


FIXED = {"config": {"num_layers": 4}, "seed": 5, "batch": 2, "seq": 18, "padding": "left", "lora_rank": 4,
         "lora_alpha": 8, "double_quant": False, "steps": 2}


@pytest.mark.parametrize("experts", ["bf16", "nf4"])
def test_router_aux_loss_is_bitwise_resident(experts, tmp_path):
    """output_router_logits=True: the loss adds router_aux_loss_coef x the load-balancing loss over every
    block's router logits; their gradients flow back through each streamed block's recompute."""
    aux = {"output_router_logits": True, "router_aux_loss_coef": 0.5}
    model = run_moe_parity("qwen3_5_moe", "default", FIXED, tmp_path, experts, **aux)
    with torch.no_grad():
        out = model(**make_batch(1, 2, 12, "none"), use_cache=False)
    assert out.aux_loss is not None and out.aux_loss > 0 and len(out.router_logits) == 4


@pytest.mark.parametrize(("family", "variant"), MOE, ids=IDS)
def test_layer_major_with_nf4_experts_is_bitwise_resident_accumulation(family, variant, tmp_path):
    """Layer-major accumulation (each block's bytes serve every micro-batch), NF4 experts, and for
    qwen3_5_moe the router aux loss across micro-batches."""
    aux = {"output_router_logits": True, "router_aux_loss_coef": 0.5} if family == "qwen3_5_moe" else {}
    path = save_tiny_checkpoint(tmp_path / "ckpt", family, variant, seed=9, num_layers=3, **aux)
    steps = [with_item_counts([make_batch(10 * s + m, 2, 14, "right") for m in range(3)]) for s in range(2)]
    reference = poros.quantize_experts(load_qlora(path, seed=9, lora_rank=4))
    ref_losses, ref_opt = resident_steps(reference, steps)
    model = poros.quantize_experts(load_qlora(path, seed=9, lora_rank=4))
    streamed = poros.prepare(model)
    streamed.store.stats.reset()
    poros_losses, poros_opt = layer_major_steps(streamed, steps)
    assert_bitwise(reference, model, ref_losses, poros_losses, ref_opt, poros_opt)
    assert max(streamed.store.stats.fetches) <= 2 * len(steps)


@pytest.mark.parametrize(("family", "variant"), MOE, ids=IDS)
def test_nf4_experts_stream_under_0_4_of_the_bf16_block_bytes(family, variant, tmp_path):
    """An expert-heavy tiny shape (16 experts): NF4 is 0.5 byte per value plus a 4-byte scale per 64."""
    shape = {"num_experts": 16, "moe_intermediate_size": 128, "num_layers": 2}
    path = save_tiny_checkpoint(tmp_path / "ckpt", family, variant, seed=1, **shape)
    bf16 = load_qlora(path, seed=1)
    nf4 = poros.quantize_experts(load_qlora(path, seed=1))
    layers = lambda m: list(m.get_base_model().model.layers)  # noqa: E731
    bf16_bytes, nf4_bytes = sum(packed_block_bytes(layers(bf16))), sum(packed_block_bytes(layers(nf4)))
    assert nf4_bytes < 0.4 * bf16_bytes, (nf4_bytes, bf16_bytes)
    streamed = poros.prepare(nf4)
    assert sum(block.nbytes for block in streamed.store.blocks) == nf4_bytes


def test_quantize_experts_refuses_what_it_cannot_pack(tmp_path):
    path = save_tiny_checkpoint(tmp_path / "dense", "qwen3", seed=0)
    with pytest.raises(PorosError, match="no fused MoE experts"):
        poros.quantize_experts(load_qlora(path))
    moe = save_tiny_checkpoint(tmp_path / "moe", "qwen3_5_moe", seed=0, num_layers=2)
    with pytest.raises(PorosError, match="target_parameters"):
        poros.quantize_experts(load(moe, {**FIXED, "lora_rank": 2}, "lora"))


def test_nf4_experts_blocks_name_why_cuda_graphs_keep_them_eager(tmp_path):
    """The dequantize-per-routed-expert loop syncs with the host: the families' graph_unsafe names it."""
    path = save_tiny_checkpoint(tmp_path / "ckpt", "qwen3_5_moe", seed=0, num_layers=2)
    model = load_qlora(path)
    descriptor = poros.registry.for_config(model.config)
    assert descriptor.graph_unsafe_reason(model.config) is None  # transformers' grouped_mm: captured
    poros.quantize_experts(model)
    assert model.config._experts_implementation == EXPERTS_IMPLEMENTATION
    assert descriptor.graph_unsafe_reason(model.config) == "MoE routing (num_experts, experts_implementation='poros_nf4')"


@pytest.mark.parametrize("requested", [None, False])
def test_the_trainer_quantizes_moe_experts_by_default_and_says_so(requested, tmp_path, capsys):
    path = save_tiny_checkpoint(tmp_path / "ckpt", "qwen3_5_moe", seed=0, num_layers=2)
    trainer = poros.PorosTrainer.from_pretrained(str(path), output_dir=str(tmp_path / "out"), device="cpu",
                                                 quantize_experts=requested, lora_rank=2, lora_alpha=4)
    out = capsys.readouterr().out
    modules = experts_modules(trainer.model)
    assert modules and all(is_quantized(m) == (requested is None) for _, m in modules)
    assert ("MoE experts in NF4 (quantize_experts=auto)" if requested is None
            else "MoE experts kept in bf16 (quantize_experts=false)") in out


def child_env(**overrides):
    import os

    env = dict(os.environ, PYTHONPATH=str(ROOT), POROS_REGISTRY_DIR=str(ROOT / "registry"), OMP_NUM_THREADS="1")
    env.update(overrides)
    return env


def test_list_architectures_lists_qwen3_5_moe():
    done = subprocess.run([sys.executable, "-m", "poros", "list-architectures"], capture_output=True, text=True,
                          env=child_env(), timeout=120)
    assert done.returncode == 0, done.stderr
    assert any(line.split()[:3] == ["qwen3_5_moe", "qwen3_5_moe_text,", "qwen3_5_moe"]
               for line in done.stdout.splitlines())


def test_plan_of_qwen3_5_122b_a10b_counts_its_experts_offline(tmp_path):
    cache = tmp_path / "hf"
    cache.mkdir()
    env = child_env(HF_HUB_OFFLINE="1", HF_HOME=str(cache), HF_HUB_CACHE=str(cache / "hub"))
    command = [sys.executable, "-m", "poros", "plan", "--model", "Qwen/Qwen3.5-122B-A10B", "--vram-budget", "16GiB",
               "--device", "cpu"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "family      qwen3_5_moe (model_type qwen3_5_moe_text, text tower of qwen3_5_moe): 48 decoder blocks" \
        in done.stdout
    assert "experts     256 experts in each of 48 blocks: 231.93 GB in bf16, 65.23 GB in NF4" in done.stdout
    assert "predicted peak allocated" in done.stdout
    kept = subprocess.run([*command, "--quantize-experts", "false"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert kept.returncode == 0, kept.stderr[-3000:]
    assert "(quantize_experts=false)" in kept.stdout


def test_bench_runs_nf4_experts_in_both_arms_bitwise(tmp_path):
    """tools/bench.py --quantize-experts on the tiny MoE shape: the resident NF4-expert arm and the streamed
    arm, bitwise, with tokens/s per arm (the H200 steps in the report run the same code at real shapes)."""
    import json

    report = tmp_path / "bench.json"
    done = subprocess.run([sys.executable, "-m", "tools.bench", "--model", "tiny-qwen3_5_moe", "--quantize-experts",
                           "--device", "cpu", "--steps", "1", "--warmup", "1", "--commit", "test", "--json",
                           str(report)], cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(report.read_text())
    assert result["config"]["quantize_experts"] is True and result["comparison"]["bitwise"] is True
    assert all(arm["status"] == "ok" and arm["tokens_per_s"] > 0 for arm in result["arms"].values())
