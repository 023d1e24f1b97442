"""Mixture-of-experts: the ``qwen3_5_moe`` family and Gemma 4's MoE, streamed bit-for-bit as resident.

Three ways to hold the experts, each drawn by hypothesis per MoE family and trained resident and
streamed from the same checkpoint, ``torch.equal`` on every loss, LoRA tensor and AdamW state:

* bf16 experts as transformers leaves them (LoRA on the linears);
* LoRA on the experts too, through PEFT's ``target_parameters`` (``ParamWrapper`` on the fused 3-D tensors);
* NF4 experts (``poros.quantize_experts``), grouped (``poros_nf4_grouped``, the default where grouped_mm
  computes: CPU torch >= 2.9) and the loop (``poros_nf4``): the resident NF4-expert model is the reference.

Plus: PorosTrainer against a plain HF + bitsandbytes + PEFT loop (bf16 and NF4 experts, the router aux loss
off and on), the router aux loss (``output_router_logits``) micro-major and layer-major, the streamed bytes of
NF4 experts against bf16, the grouped forward against the loop (one dequantize of all experts is the
per-expert bytes; no bf16 expert weight saved for backward; its blocks captured and replayed with a CPU
recorder), ``poros list-architectures`` and ``poros plan`` of a known MoE checkpoint, the trainer's default
and the graph reasons.
"""

from __future__ import annotations

import math

import json
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
from poros.assets import asset_path
from poros.data import BatchIterator, load_dataset
from poros.errors import PorosError
from poros.loading.experts import (EXPERT_PARAMETERS, EXPERTS_IMPLEMENTATION, FUSED_EXPERT_TENSORS,
                                   adopt_expert_lora, dequantized_expert, experts_modules, is_quantized)
from poros.loading import experts_grouped
from poros.loading.experts_grouped import GROUPED_EXPERTS_IMPLEMENTATION, dequantize_all
from poros.stream.store import packed_block_bytes
from poros.testing import all_linear_targets, load_qlora, save_tiny_checkpoint, tiny_config
from test_layer_major import layer_major_steps, resident_steps, with_item_counts
from test_parity import assert_bitwise, make_batch, parity_setups, train, trainable
from test_trainer import adapters, assert_same_training_state, load_reference_base, optimizer_states

ROOT = pathlib.Path(__file__).resolve().parents[1]
MOE = [("qwen3_5_moe", "default"), ("gemma4", "moe")]
IDS = [f"{f}-{v}" for f, v in MOE]


def load(path, setup: dict, experts: str):
    """The checkpoint as the reference loads it, with its experts ``"bf16"``, ``"nf4"`` or with LoRA on them
    through target_parameters, beside LoRA on the attention projections: ``"lora"`` (bf16 experts),
    ``"nf4+lora"`` (quantize_experts, then get_peft_model) or ``"lora+nf4"`` (get_peft_model, then quantize)."""
    lora = {"lora_rank": setup["lora_rank"], "lora_alpha": setup["lora_alpha"], "seed": setup["seed"],
            "double_quant": setup["double_quant"]}
    if "lora" not in experts:
        model = load_qlora(path, **lora)
        if experts == "bf16":
            return model
        return poros.quantize_experts(model, grouped={"nf4": None, "nf4-loop": False}[experts])
    quantization = transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16,
        bnb_4bit_use_double_quant=setup["double_quant"])
    base = transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=quantization,
                                                             device_map={"": "cpu"}, dtype=torch.bfloat16)
    config = peft.LoraConfig(r=setup["lora_rank"], lora_alpha=setup["lora_alpha"], lora_dropout=0.0,
                             target_modules=["q_proj", "v_proj"], target_parameters=EXPERT_PARAMETERS)
    if experts == "nf4+lora":
        poros.quantize_experts(base)
    torch.manual_seed(setup["seed"])
    model = peft.get_peft_model(base, config)
    if experts == "lora+nf4":
        poros.quantize_experts(model)
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


@pytest.mark.parametrize("experts", ["nf4", "nf4-loop", "lora", "nf4+lora", "lora+nf4"])
@pytest.mark.parametrize(("family", "variant"), MOE, ids=IDS)
def test_streamed_moe_training_is_bitwise_resident(family, variant, experts):
    """bf16 experts are drawn by tests/test_parity.py (every tiny variant); here NF4 experts (the default,
    grouped on this CPU, and the loop) and LoRA'd experts."""
    @settings(max_examples=2, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(setup=parity_setups(family, variant).filter(lambda s: s["config"]["num_layers"] >= 2))
    def check(setup):
        with tempfile.TemporaryDirectory() as directory:
            model = run_moe_parity(family, variant, {**setup, "reference_checkpointing": False},
                                   pathlib.Path(directory), experts)
            modules = experts_modules(model)
            assert modules and all(is_quantized(m) == ("nf4" in experts) for _, m in modules)
            if experts in ("nf4", "nf4-loop"):
                assert model.config.get_text_config()._experts_implementation == (
                    GROUPED_EXPERTS_IMPLEMENTATION if experts == "nf4" else EXPERTS_IMPLEMENTATION)
            if "lora" in experts:  # two LoRA pairs per experts module (gate_up_proj and down_proj), trained
                expert_lora = [name for name in trainable(model) if ".experts." in name and ".lora_" in name]
                assert len(expert_lora) == 4 * len(modules), expert_lora

    check()


FIXED = {"config": {"num_layers": 4}, "seed": 5, "batch": 2, "seq": 18, "padding": "left", "lora_rank": 4,
         "lora_alpha": 8, "double_quant": False, "steps": 2}


@pytest.mark.parametrize("experts", ["bf16", "nf4", "nf4+lora", "lora+nf4"])
def test_router_aux_loss_is_bitwise_resident(experts, tmp_path):
    """output_router_logits=True: the loss adds router_aux_loss_coef x the load-balancing loss over every
    block's router logits; their gradients flow back through each streamed block's recompute. With LoRA on the
    NF4 experts in both orders too (Gemma 4's MoE has no router aux loss in transformers)."""
    aux = {"output_router_logits": True, "router_aux_loss_coef": 0.5}
    model = run_moe_parity("qwen3_5_moe", "default", FIXED, tmp_path, experts, **aux)
    with torch.no_grad():
        out = model(**make_batch(1, 2, 12, "none"), use_cache=False)
    assert out.aux_loss is not None and out.aux_loss > 0 and len(out.router_logits) == 4


def write_chat(path: pathlib.Path) -> pathlib.Path:
    """16 short conversations of different lengths (batches of 2 get right padding), digits in every one."""
    with path.open("w") as handle:
        for index in range(16):
            answer = f"It is {2 * index + 3}." + " Yes." * (index % 3)
            handle.write(json.dumps({"messages": [{"role": "user", "content": f"{index} plus {index + 3}?"},
                                                  {"role": "assistant", "content": answer}]}) + "\n")
    return path


@pytest.mark.parametrize("router", [False, True], ids=["no-aux", "aux"])
@pytest.mark.parametrize("experts", ["bf16", "nf4"])
def test_trainer_is_bitwise_a_plain_peft_loop(experts, router, tmp_path, capsys):
    """PorosTrainer on qwen3_5_moe == an HF + bitsandbytes + PEFT loop: the same batches, AdamW, schedule,
    clipping, quantize_experts, output_router_logits and LoRA on the experts (the trainer's default
    lora_on_experts: PEFT's target_parameters, on NF4 or bf16 experts) in both arms; grad_accum 2 (the trainer runs
    layer-major, the loop micro-major); torch.equal on the losses, every LoRA tensor and AdamW state.

    Both arms tokenize with the checkpoint's tokenizer as ``AutoTokenizer.from_pretrained(checkpoint)`` loads
    it: for a ``qwen3_5_moe_text`` config.json transformers picks ``Qwen3_5Tokenizer`` (whatever the
    tokenizer_config says), which splits digits one by one, unlike the bundled tokenizer object the
    checkpoint was saved with. A loop over that object's batches trains on other tokens: its step-0 loss
    was 7.5924 against the trainer's 7.6262, with bf16 experts and the aux loss off in both."""
    bundled = transformers.AutoTokenizer.from_pretrained(asset_path("poros-tiny-qwen3"))
    path = save_tiny_checkpoint(tmp_path / "ckpt", "qwen3_5_moe", seed=5, num_layers=4, vocab_size=len(bundled),
                                router_aux_loss_coef=0.5)
    bundled.save_pretrained(path)
    chat = write_chat(tmp_path / "chat.jsonl")
    settings = dict(steps=2, seq_len=32, batch_size=2, grad_accum=2, lr=2e-2, schedule="linear", warmup=0,
                    weight_decay=0.01, max_grad_norm=0.5, seed=11)
    trainer = poros.PorosTrainer.from_pretrained(str(path), lora_rank=4, lora_alpha=8, seed=11, device="cpu",
                                                 output_dir=str(tmp_path / "out"), quantize_experts=experts == "nf4",
                                                 output_router_logits=router)
    assert ("poros: MoE router aux loss on (output_router_logits=true, set): the loss adds router_aux_loss_coef=0.5"
            if router else "poros: MoE router aux loss off (output_router_logits=false, set)") in capsys.readouterr().out
    result = trainer.train(chat, **settings)
    assert all(is_quantized(m) == (experts == "nf4") for _, m in experts_modules(trainer.model))
    assert trainer.model.store.stats.fetches[0] == 2 * 2  # layer-major: once per direction per step

    tokenizer = transformers.AutoTokenizer.from_pretrained(path)  # the class the trainer loads
    assert type(trainer.tokenizer) is type(tokenizer)
    assert load_dataset(chat, bundled, seq_len=32).examples != load_dataset(chat, tokenizer, seq_len=32).examples
    model = load_reference_base(path)
    if experts == "nf4":
        poros.quantize_experts(model)  # the trainer's default forward: grouped where grouped_mm computes
    model.config.output_router_logits = router
    torch.manual_seed(11)
    reference = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM",
                                                           target_modules=all_linear_targets(model),
                                                           target_parameters=EXPERT_PARAMETERS))
    reference.train()
    parameters = list(adapters(reference).values())
    optimizer = torch.optim.AdamW(parameters, lr=2e-2, weight_decay=0.01)
    scheduler = transformers.get_scheduler("linear", optimizer, num_warmup_steps=0, num_training_steps=2)
    batches = BatchIterator(load_dataset(chat, tokenizer, seq_len=32, seed=11), batch_size=2,
                            pad_token_id=tokenizer.pad_token_id, seed=11)
    losses, padded = [], False
    for step in range(2):
        micro_batches = [batches.next_batch() for _ in range(2)]
        padded |= any(bool((batch["attention_mask"] == 0).any()) for batch in micro_batches)
        items = sum((batch["labels"][..., 1:] != -100).sum() for batch in micro_batches)
        if step == 0:  # control: the aux loss is in the loss exactly when output_router_logits is on
            with torch.no_grad():
                outputs = [reference(**batch, num_items_in_batch=items, use_cache=False, output_router_logits=False)
                           for batch in micro_batches]
                without_aux = sum(out.loss for out in outputs)
        step_loss = 0
        for batch in micro_batches:
            out = reference(**batch, num_items_in_batch=items, use_cache=False)
            assert (out.aux_loss is not None) == router
            out.loss.backward()
            step_loss = step_loss + out.loss.detach()
        torch.nn.utils.clip_grad_norm_(parameters, 0.5)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(step_loss)

    assert padded, "the test data must put padding into the batches"
    assert (float(without_aux) != float(losses[0])) == router
    assert result.losses == [float(loss) for loss in losses]  # float(float32) is exact: torch.equal
    reference_adapters = adapters(reference)
    assert_same_training_state(reference_adapters, optimizer_states(optimizer, reference_adapters),
                               trainer.model, trainer.optimizer)


@pytest.mark.parametrize(("family", "variant"), MOE, ids=IDS)
def test_layer_major_with_nf4_experts_is_bitwise_resident_accumulation(family, variant, tmp_path):
    """Layer-major accumulation (each block's bytes serve every micro-batch), NF4 experts, and for
    qwen3_5_moe the router aux loss across micro-batches."""
    router_aux = hasattr(tiny_config(family, variant), "router_aux_loss_coef")  # qwen3_5_moe's load-balancing loss
    aux = {"output_router_logits": True, "router_aux_loss_coef": 0.5} if router_aux else {}
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
def test_expert_lora_on_the_host_is_bitwise_resident(family, variant, tmp_path):
    """lora_placement="host" (what the planner picks when expert LoRA and its AdamW state outgrow the budget:
    Qwen3.5-122B-A10B r16 under 16 GiB): each block's LoRA tensors, the NF4 experts' included, travel with it;
    layer-major, clipping, host AdamW; bitwise the resident NF4-expert + expert-LoRA run."""
    from test_host_optimizer import assert_same
    from test_lora_placement import placed_run, steps_of

    path = save_tiny_checkpoint(tmp_path / "ckpt", family, variant, seed=5, num_layers=2)
    reference = load(path, FIXED, "nf4+lora")
    steps = steps_of(5)
    ref_losses, ref_opt = resident_steps(reference, steps, max_grad_norm=0.5)
    model = load(path, FIXED, "nf4+lora")
    streamed = poros.prepare(model, lora_placement="host")
    losses, opt = placed_run(streamed, steps)
    assert_same(reference, ref_opt, model, opt, ref_losses, losses)
    travelling = {id(p) for ps in streamed.lora_placement.parameters.values() for p in ps}
    assert {id(p) for n, p in model.named_parameters() if ".experts." in n and ".lora_" in n} <= travelling


@pytest.mark.parametrize(("family", "variant"), MOE, ids=IDS)
def test_nf4_experts_stream_under_0_4_of_the_bf16_block_bytes(family, variant, tmp_path):
    """An expert-heavy tiny shape (16 experts): NF4 is 0.5 byte per value plus a 4-byte scale per 64."""
    shape = {"num_experts": 16, "moe_intermediate_size": 128, "num_layers": 2}
    path = save_tiny_checkpoint(tmp_path / "ckpt", family, variant, seed=1, **shape)
    bf16 = load_qlora(path, seed=1)
    nf4 = poros.quantize_experts(load_qlora(path, seed=1))
    adopt_expert_lora(nf4, drop_placeholders=True)  # as prepare does: the placeholders PEFT would wrap go
    layers = lambda m: list(m.get_base_model().model.layers)  # noqa: E731
    bf16_bytes, nf4_bytes = sum(packed_block_bytes(layers(bf16))), sum(packed_block_bytes(layers(nf4)))
    assert nf4_bytes < 0.4 * bf16_bytes, (nf4_bytes, bf16_bytes)
    streamed = poros.prepare(nf4)
    assert sum(block.nbytes for block in streamed.store.blocks) == nf4_bytes


def test_the_prepared_model_prices_the_dequantized_experts(tmp_path):
    """What predict_prepared (the bench's recorded prediction) reads after prepare: the grouped forward's whole
    dequantized fused expert tensor, counted from the module's experts (the store empties the codes' buffer in
    the block; read from its shape, the count was 0 and the 122B-A10B prediction 23 % low)."""
    from poros.plan.budget import Workload
    from poros.plan.footprint import grouped_experts_values, predict_prepared

    path = save_tiny_checkpoint(tmp_path / "ckpt", "qwen3_5_moe", seed=0, num_layers=2, num_experts=16,
                                moe_intermediate_size=128)
    model = poros.quantize_experts(load_qlora(path, lora_rank=2))
    layer = model.get_base_model().model.layers[0]
    values = grouped_experts_values(layer)
    assert values == 16 * 2 * 128 * 64  # gate_up_proj [E, 2I, H], the larger
    streamed = poros.prepare(model)
    assert layer.mlp.experts.gate_up_proj_nf4.numel() == 0  # the store's placeholder
    parts = predict_prepared(streamed, Workload(1, 16, 1, "micro-major"))["activation_parts"]
    assert parts["block recompute: one dequantized weight"] == values * 2


def test_quantize_experts_refuses_what_it_cannot_pack(tmp_path):
    path = save_tiny_checkpoint(tmp_path / "dense", "qwen3", seed=0)
    with pytest.raises(PorosError, match="no fused MoE experts"):
        poros.quantize_experts(load_qlora(path))


@pytest.mark.parametrize("order", ["nf4+lora", "lora+nf4"])
def test_target_parameters_that_match_nothing_name_the_expert_parameters(order, tmp_path):
    """LoRA on NF4 experts through PEFT's own call: a target_parameters entry that matches nothing after
    quantization (PEFT only warns) is an error naming the fused expert parameters that exist."""
    from poros.errors import UnsupportedAdapterError

    path = save_tiny_checkpoint(tmp_path / "moe", "qwen3_5_moe", seed=0, num_layers=2)
    quantization = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                   bnb_4bit_compute_dtype=torch.bfloat16)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=quantization,
                                                              device_map={"": "cpu"}, dtype=torch.bfloat16)
    config = peft.LoraConfig(r=2, target_modules=["q_proj"], target_parameters=["experts.gate_proj"])
    expected = r"\['experts.gate_proj'\] match no parameter.*\['experts.gate_up_proj', 'experts.down_proj'\]"
    if order == "nf4+lora":
        poros.quantize_experts(model)
        with pytest.warns(RuntimeWarning, match="no parameter was matched"):
            model = peft.get_peft_model(model, config)
        with pytest.raises(UnsupportedAdapterError, match=expected):
            poros.prepare(model)
    else:
        with pytest.warns(RuntimeWarning, match="no parameter was matched"):
            model = peft.get_peft_model(model, config)
        with pytest.raises(UnsupportedAdapterError, match=expected):
            poros.quantize_experts(model)


def routed(module, tokens: int, seed: int):
    """``hidden_states [T, H]`` (bf16, requiring grad), ``top_k_index`` and ``top_k_weights [T, k]`` for one
    experts module, k its config's ``num_experts_per_tok`` (distinct experts per token, as a router picks)."""
    generator = torch.Generator().manual_seed(seed)
    config, hidden = module.config, module.hidden_dim
    k = getattr(config, "num_experts_per_tok", None) or config.top_k_experts
    index = torch.stack([torch.randperm(module.num_experts, generator=generator)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=generator).softmax(-1).to(torch.bfloat16)
    states = torch.randn(tokens, hidden, generator=generator).to(torch.bfloat16).requires_grad_(True)
    return states, index, weights


@pytest.mark.parametrize(("family", "variant"), MOE, ids=IDS)
def test_one_dequantize_of_all_experts_is_the_per_expert_bytes(family, variant, tmp_path):
    """Per-expert blockwise NF4 laid end to end is the NF4 of the concatenation when no block straddles two
    experts (rows * cols % blocksize == 0), so one dequantize of all E experts equals E dequantizes."""
    import bitsandbytes.functional as bnb_functional

    path = save_tiny_checkpoint(tmp_path / "ckpt", family, variant, seed=3, num_layers=2)
    model = load_qlora(path)
    bf16 = {(name, t): getattr(m, t).detach().clone()
            for name, m in experts_modules(model) for t in FUSED_EXPERT_TENSORS}
    poros.quantize_experts(model)
    for name, module in experts_modules(model):
        for tensor_name in FUSED_EXPERT_TENSORS:
            (rows, cols), dtype, blocksize = module.poros_nf4[tensor_name]
            assert rows * cols % blocksize == 0
            codes, state = bnb_functional.quantize_4bit(bf16[name, tensor_name], blocksize=blocksize, quant_type="nf4")
            packed, absmax = getattr(module, f"{tensor_name}_nf4"), getattr(module, f"{tensor_name}_absmax")
            assert torch.equal(codes.view(-1), packed.view(-1)) and torch.equal(state.absmax, absmax.view(-1))
            at_once = dequantize_all(packed, absmax, module.nf4_code, (rows, cols), dtype, blocksize)
            one_by_one = torch.stack([dequantized_expert(module, tensor_name, e) for e in range(module.num_experts)])
            assert at_once.shape == (module.num_experts, rows, cols) and torch.equal(at_once, one_by_one)
    # past bitsandbytes' int count of values the experts are dequantized in runs (the limit shrunk to 2.5 experts)
    module = experts_modules(model)[0][1]
    (rows, cols), dtype, blocksize = module.poros_nf4["down_proj"]
    packed, absmax = module.down_proj_nf4, module.down_proj_absmax
    whole = dequantize_all(packed, absmax, module.nf4_code, (rows, cols), dtype, blocksize)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(experts_grouped, "MAX_VALUES_PER_CALL", rows * cols * 5 // 2)
        assert torch.equal(dequantize_all(packed, absmax, module.nf4_code, (rows, cols), dtype, blocksize), whole)
    # a matrix whose blocks would straddle two experts (6 x 10 = 60 values) is dequantized expert by expert
    weights = torch.randn(3, 6, 10).to(torch.bfloat16)
    states = [bnb_functional.quantize_4bit(w.contiguous(), blocksize=64, quant_type="nf4") for w in weights]
    packed = torch.stack([c.view(-1) for c, _ in states])
    absmax = torch.stack([s.absmax.view(-1) for _, s in states])
    at_once = dequantize_all(packed, absmax, states[0][1].code, (6, 10), torch.bfloat16, 64)
    assert torch.equal(at_once, torch.stack([bnb_functional.dequantize_4bit(c, s) for c, s in states]))


@pytest.mark.parametrize(("family", "variant"), MOE, ids=IDS)
def test_grouped_nf4_forward_and_input_grad_match_the_loop(family, variant, tmp_path):
    """The same NF4 weights through both forwards: one bf16 rounding of the per-token sum apart at most
    (the loop adds each expert's output into a bf16 accumulator, the grouped forward sums the k outputs at
    once): rtol 2**-7 (bf16's epsilon) and atol 1e-5 against outputs of order 1e-2."""
    path = save_tiny_checkpoint(tmp_path / "ckpt", family, variant, seed=4, num_layers=2)
    model = poros.quantize_experts(load_qlora(path))
    results = {}
    for grouped in (True, False):
        poros.quantize_experts(model, grouped=grouped)
        for name, module in experts_modules(model):
            states, index, weights = routed(module, tokens=40, seed=7)
            out = module(states, index, weights)
            out.float().square().sum().backward()
            results[grouped, name] = (out.detach(), states.grad)
    for name, _ in experts_modules(model):
        for grouped, loop in zip(results[True, name], results[False, name]):
            assert grouped.abs().max() > 0
            torch.testing.assert_close(grouped, loop, rtol=2 ** -7, atol=1e-5)


@pytest.mark.parametrize("grouped", [True, False])
def test_nf4_experts_backward_keeps_no_bf16_expert_weight(grouped, tmp_path):
    """Everything autograd saves in an NF4 experts forward (a saved-tensor hook): the packed codes, their
    scales and the NF4 code, the int32 group offsets, activations of [tokens, width]; never a floating
    tensor the size of one expert's matrix, let alone of all E."""
    path = save_tiny_checkpoint(tmp_path / "ckpt", "qwen3_5_moe", "default", seed=2, num_layers=2)
    model = poros.quantize_experts(load_qlora(path), grouped=grouped)
    _, module = experts_modules(model)[0]
    states, index, weights = routed(module, tokens=6, seed=1)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = module(states, index, weights)
    out.float().sum().backward()
    smallest = min(r * c for (r, c), _, _ in module.poros_nf4.values())
    floating = [t for t in saved if t.is_floating_point() and t.dtype != torch.float32]
    assert floating and all(t.numel() < smallest for t in floating), [tuple(t.shape) for t in floating]
    pointers = {t.data_ptr() for t in saved}
    assert {getattr(module, f"{t}_nf4").data_ptr() for t in FUSED_EXPERT_TENSORS} <= pointers
    assert {t.dtype for t in saved if t.numel() >= smallest // 2} <= {torch.uint8}
    if grouped:
        assert any(t.dtype == torch.int32 and t.shape == (module.num_experts,) for t in saved)  # the offsets


@pytest.mark.parametrize("experts", ["nf4", "nf4+lora"])
@pytest.mark.parametrize(("family", "variant"), MOE, ids=IDS)
def test_replayed_grouped_nf4_blocks_train_bitwise_resident(family, variant, experts, tmp_path):
    """Grouped NF4 experts, with and without LoRA on them: every block captured and replayed with the CPU recorder
    of tests/test_gemma4_graphs.py (it reruns the captured body on the static buffers and poisons the capture's
    outputs), layer-major 2 steps x 3 micro-batches: bitwise the resident run. Qwen3.5 MoE's blocks are captured
    too: its text model passes position_ids as an expanded view, which the descriptor's contiguous_arguments
    hands the block as a contiguous copy (an expanded view kept them eager: "argument layout")."""
    from test_gemma4_graphs import ReplayedOnCPU

    path = save_tiny_checkpoint(tmp_path / "ckpt", family, variant, seed=5, num_layers=4)
    plan = [with_item_counts([make_batch(5 + 10 * s + m, 2, 14, "left") for m in range(3)]) for s in range(2)]
    setup = {**FIXED, "seed": 5}
    reference = load(path, setup, experts)
    ref_losses, ref_opt = resident_steps(reference, plan)
    model = load(path, setup, experts)
    streamed = poros.prepare(model)
    assert streamed.descriptor.graph_unsafe_reason(streamed.config.get_text_config()) is None
    streamed.executor.graphs = ReplayedOnCPU(streamed.store, streamed.executor.layers)
    poros_losses, poros_opt = layer_major_steps(streamed, plan)
    assert_bitwise(reference, model, ref_losses, poros_losses, ref_opt, poros_opt)
    report = streamed.executor.graphs.report
    assert report.failures == [] and set(report.eager) == {"warm-up"}, (report.failures, report.eager)
    assert report.replays > 0 and report.replays + report.eager["warm-up"] == 2 * 2 * 3 * len(streamed.executor.layers)


@pytest.mark.parametrize(("family", "variant"), MOE, ids=IDS)
def test_captured_grouped_experts_dequantize_into_the_graphs_held_scratch(family, variant, monkeypatch, tmp_path):
    """Inside a capture the grouped forward's whole dequantized fused tensor goes to the graphs' one held scratch
    (poros.stream.capture_scratch), not the pool: the CPU recorder, told every capture is one, runs each capture and
    each replay with the scratch active, and the layer-major step lends it to its eager warm-ups; every dequantize
    then writes the same buffer, the largest fused tensor's size, and training stays bitwise the resident run.
    unpatch lets go of it."""
    from poros.loading import experts_grouped
    from poros.stream import capture_scratch
    from test_gemma4_graphs import ReplayedOnCPU

    inside = []  # a capture (or its replay) runs

    class WithScratch(ReplayedOnCPU):
        def _record(self, index, body, autocast=None):
            def held(block):
                inside.append(block)
                try:
                    with capture_scratch.active(self.scratch):
                        return body(block)
                finally:
                    inside.pop()
            return super()._record(index, held, autocast)

    monkeypatch.setattr(capture_scratch, "capturing", lambda device: bool(inside))
    written = []
    real = experts_grouped.dequantize_nf4

    def counted(*args, **kwargs):
        written.append(kwargs.get("out"))
        return real(*args, **kwargs)

    monkeypatch.setattr(experts_grouped, "dequantize_nf4", counted)
    path = save_tiny_checkpoint(tmp_path / "ckpt", family, variant, seed=5, num_layers=4)
    plan = [with_item_counts([make_batch(5 + 10 * s + m, 2, 14, "left") for m in range(3)]) for s in range(2)]
    setup = {**FIXED, "seed": 5}
    reference = load(path, setup, "nf4+lora")
    ref_losses, ref_opt = resident_steps(reference, plan)
    model = load(path, setup, "nf4+lora")
    streamed = poros.prepare(model)
    graphs = streamed.executor.graphs = WithScratch(streamed.store, streamed.executor.layers)
    written.clear()
    poros_losses, poros_opt = layer_major_steps(streamed, plan)
    assert_bitwise(reference, model, ref_losses, poros_losses, ref_opt, poros_opt)
    assert graphs.report.replays > 0 and set(graphs.report.eager) == {"warm-up"}
    (buffers,) = graphs.scratch.buffers.values()  # one device, one dtype
    largest = max(m.num_experts * math.prod(shape) for layer in streamed.executor.layers for m in layer.modules()
                  for shape, _, _ in getattr(m, "poros_nf4", {}).values())
    assert [b.numel() for b in buffers] == [largest]  # the first capture dequantizes the largest fused tensor
    into = [out for out in written if out is not None]
    assert into and {out.data_ptr() for out in into} == {buffers[0].data_ptr()}
    assert None not in written  # the eager warm-ups write there too: no transient beside the held buffer
    streamed.unpatch()
    assert graphs.scratch.buffers == {}


@pytest.mark.parametrize(("family", "variant"), MOE, ids=IDS)
def test_the_planner_counts_the_held_expert_scratch_as_the_graphs_and_not_in_a_captures_transient(family, variant,
                                                                                                   tmp_path):
    """With CUDA graphs the largest fused NF4 expert tensor, dequantized, lives in the graphs' capture scratch for
    the whole run: the predicted peak counts it as persistent (the H100's 8-layer 35B-A3B at a 6 GB cap peaked
    0.9 GB over the plan at the head and loss, which ignored it), and a capture's working set holds the largest
    linear's dequantized weight instead."""
    import dataclasses

    from poros.plan.footprint import footprint_of_model
    from poros.plan.peak import predict_peak
    from poros.stream.options import Workload

    path = save_tiny_checkpoint(tmp_path / "ckpt", family, variant, seed=5, num_layers=2)
    model = load(path, {**FIXED, "seed": 5}, "nf4+lora")
    causal = model.get_base_model()
    layers = list(causal.model.layers)
    workload = Workload(2, 14, grad_accum=3, schedule="layer-major")
    footprint = footprint_of_model(causal, layers, [], workload, device=torch.device("cpu"),
                                   compute_dtype=torch.bfloat16)
    largest = max(m.num_experts * math.prod(shape) for layer in layers for m in layer.modules()
                  for shape, _, _ in getattr(m, "poros_nf4", {}).values())
    assert footprint.expert_scratch_bytes == 2 * largest  # bf16
    assert footprint.captured_recompute_bytes <= footprint.recompute_bytes
    plain = predict_peak(footprint, workload)
    graphed = predict_peak(dataclasses.replace(footprint, cuda_graphs=True), workload)
    held = dict(graphed.persistent)
    (name,) = [name for name in held if name.startswith("CUDA graphs")]
    assert "expert scratch" in name and held[name] >= footprint.expert_scratch_bytes
    assert graphed.total > plain.total
    # micro-major lends no scratch (its captures are off by default, its warm-ups allocate afresh): none counted
    micro = Workload(2, 14, grad_accum=3, schedule="micro-major")
    held = dict(predict_peak(dataclasses.replace(footprint, cuda_graphs=True), micro).persistent)
    (name,) = [name for name in held if name.startswith("CUDA graphs")]
    from poros.stream.placement import graph_statics_bytes

    without = dataclasses.replace(footprint, expert_scratch_bytes=0)
    assert "expert scratch" not in name and held[name] == graph_statics_bytes(without, 2)
    # poros plan's budget path: the footprint it prices, the chunked re-pricings too, carry the graphs
    from poros.config import PorosConfig
    from poros.plan.entry import plan_config
    from poros.plan.footprint import chunked_footprints, model_shapes

    shapes, value_bytes, attention = model_shapes(causal, layers, torch.bfloat16)
    config = PorosConfig(model=str(path), device="cuda", seq_len=14, batch_size=2, grad_accum=3,
                         stream_schedule="layer-major", cuda_graphs=True)
    _, budget = plan_config(config, footprint, vram_budget="80GB", device="cuda", footprint_for=chunked_footprints(
        footprint, shapes, workload, value_bytes=value_bytes, attn_implementation=attention))
    assert budget.footprint.cuda_graphs
    assert [n for n, _ in budget.peak.persistent if "expert scratch" in n]
    # the memory plan without a budget (poros train --dry-run's predicted peak) counts them as well
    from poros.plan.run_plan import plan_run

    assert plan_run(config).footprint().cuda_graphs
    assert not plan_run(dataclasses.replace(config, cuda_graphs=False)).footprint().cuda_graphs


def test_grouped_nf4_experts_are_graph_eligible_and_the_loop_names_why_it_is_not(tmp_path):
    """The dequantize-per-routed-expert loop syncs with the host: the families' graph_unsafe names it; the
    grouped NF4 forward (the default where grouped_mm computes) is captured like transformers' grouped_mm."""
    for family, variant in MOE:
        path = save_tiny_checkpoint(tmp_path / family, family, variant, seed=0, num_layers=2)
        model = load_qlora(path)
        config = model.config.get_text_config()
        descriptor = poros.registry.for_config(model.config)
        assert descriptor.graph_unsafe_reason(config) is None  # transformers' grouped_mm: captured
        poros.quantize_experts(model)
        assert config._experts_implementation == GROUPED_EXPERTS_IMPLEMENTATION
        assert descriptor.graph_unsafe_reason(config) is None
        poros.quantize_experts(model, grouped=False)  # packed already: only the forward changes
        assert config._experts_implementation == EXPERTS_IMPLEMENTATION
        attribute = descriptor.graph_unsafe[0][0]  # the family's MoE switch (num_experts, enable_moe_block)
        assert descriptor.graph_unsafe_reason(config) == \
            f"MoE routing ({attribute}, experts_implementation='poros_nf4')"
        poros.quantize_experts(model)  # no choice given: a packed model keeps the forward it has
        assert config._experts_implementation == EXPERTS_IMPLEMENTATION


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
    # output_router_logits unset: the model config's (transformers' default for Qwen3.5/3.6 MoE: false)
    assert "poros: MoE router aux loss off (output_router_logits=false, the model config's): the loss is the LM " \
        "loss alone" in out
    if requested is None:  # grouped_mm computes on this CPU (torch >= 2.9): the graph-capturable forward
        assert f"forward {GROUPED_EXPERTS_IMPLEMENTATION}" in out


@pytest.mark.parametrize("flag", [None, "--no-lora-on-experts"])
def test_the_trainer_puts_lora_on_the_experts_by_default(flag, tmp_path, capsys):
    """lora_on_experts (default true): LoRA of rank lora_rank per expert on both fused tensors of every NF4 experts
    module, said in the summary; --no-lora-on-experts: LoRA on the linears only."""
    from poros.config import PorosConfig

    path = save_tiny_checkpoint(tmp_path / "ckpt", "qwen3_5_moe", seed=0, num_layers=2)
    config = PorosConfig().replace(model=str(path), output_dir=str(tmp_path / "out"), device="cpu", lora_rank=2,
                                   lora_alpha=4).apply_overrides([flag] if flag else [])
    trainer = poros.PorosTrainer.from_config(config)
    out = capsys.readouterr().out
    modules = experts_modules(trainer.model)
    assert len(modules) == 2 and all(is_quantized(m) for _, m in modules)
    expert_lora = {name: p for name, p in trainer.model.named_parameters() if ".experts." in name and ".lora_" in name}
    if flag:
        assert expert_lora == {} and "poros: MoE experts without LoRA (lora_on_experts=false)" in out
        return
    assert len(expert_lora) == 2 * 2 * 2 and all(p.requires_grad for p in expert_lora.values())
    experts = modules[0][1].num_experts
    assert {p.shape[0] for n, p in expert_lora.items() if ".lora_A." in n} == {2 * experts}  # rank 2 per expert
    assert f"poros: LoRA on the MoE experts (lora_on_experts=true): rank 2 per expert on experts.gate_up_proj and " \
        f"experts.down_proj, {experts} experts x 2 modules" in out
    assert {id(p) for p in expert_lora.values()} <= {id(p) for p in trainer.model.trainable_parameters()}


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
    # lora_on_experts (default): rank 16 per expert on both fused tensors, 48 x 256 x 16 x (5120 + 4096)
    assert "LoRA rank 16 per expert (lora_on_experts): 1811.9 M parameters, 28.99 GB with gradients and AdamW " \
        "state" in done.stdout
    assert "predicted peak allocated" in done.stdout
    kept = subprocess.run([*command, "--quantize-experts", "false", "--no-lora-on-experts"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert kept.returncode == 0, kept.stderr[-3000:]
    assert "(quantize_experts=false); no LoRA on the experts (lora_on_experts=false)" in kept.stdout


def test_bench_runs_nf4_experts_in_both_arms_bitwise(tmp_path):
    """tools/bench/harness.py --quantize-experts on the tiny MoE shape: the resident NF4-expert arm and the streamed
    arm, bitwise, with tokens/s per arm (the H200 steps in the report run the same code at real shapes)."""
    import json

    report = tmp_path / "bench.json"
    done = subprocess.run([sys.executable, "-m", "tools.bench", "--model", "tiny-qwen3_5_moe", "--quantize-experts",
                           "--lora-on-experts", "--device", "cpu", "--steps", "1", "--warmup", "1", "--commit", "test", "--json",
                           str(report)], cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(report.read_text())
    assert result["config"]["quantize_experts"] is True and result["comparison"]["bitwise"] is True
    assert result["config"]["lora"]["on_experts"] is True  # LoRA on the NF4 experts in both arms
    assert result["config"]["experts_implementation"] == GROUPED_EXPERTS_IMPLEMENTATION  # the default here
    assert all(arm["status"] == "ok" and arm["tokens_per_s"] > 0 for arm in result["arms"].values())
