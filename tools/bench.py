"""Bench harness: resident QLoRA (the reference) against Poros streaming, one process, one model.

::

    python -m tools.bench --model qwen2.5-32b --seq 512 --batch 1 --steps 5 --warmup 2 \\
        --arms resident,poros --json out.json
    python -m tools.bench --model qwen2.5-72b --layers 20          # truncated depth, same width
    python -m tools.bench --model qwen2.5-32b --arms poros --vram-limit 8   # an 8 GB card
    python -m tools.bench --model qwen2.5-32b --arms poros --vram-budget 12GiB  # planner: resident blocks
    python -m tools.bench --model qwen2.5-72b --arms resident,control,poros # + reference vs itself
    python -m tools.bench --model tiny --device cpu --steps 2 --warmup 1    # CPU smoke test

What runs, in this order, on ONE model object:

1. **Build.** Random weights at a real shape, built the way ``from_pretrained(...,
   quantization_config=BitsAndBytesConfig(nf4))`` builds a model, minus the checkpoint: the
   skeleton on the meta device under the model's own dtype context, ``replace_with_bnb_linear``
   through transformers' bitsandbytes quantizer (so exactly the modules transformers would
   quantize become ``Linear4bit``; ``lm_head`` does not), then module by module on the device: a
   seeded random bf16 weight -> ``bnb.nn.Params4bit(...).to(device)`` (that call quantizes, as in
   transformers' ``Bnb4bitQuantize``); every other tensor is allocated NaN-filled and initialised
   by the model's own ``initialize_weights`` (norms, embeddings, and the non-persistent buffers:
   rotary ``inv_freq``, Gemma's ``embed_scale``). The bf16 model never exists on the host, and
   nothing is ``.to(bfloat16)``-ed afterwards (that would round the fp32 rotary buffers). A NaN
   left anywhere fails the build. 1-D weights (norms, scalars) get a small seeded perturbation
   so that a wrong norm offset cannot hide behind weights of exactly 1 or 0.
2. **LoRA.** PEFT ``get_peft_model``, r16 / alpha 32 / dropout 0 on q,k,v,o,gate,up,down.
3. **Arm ``resident``** (the reference): HF forward with gradient checkpointing (non-reentrant),
   AdamW, ``warmup + steps`` steps. Arm ``control`` (optional) runs it once more from the same
   initial LoRA state: the reference against itself, i.e. whether this configuration is
   run-to-run deterministic at all.
4. **Arm ``poros``**: LoRA restored to its initial values, a new AdamW, HF checkpointing off,
   ``poros.prepare(model)``, the same steps on the same batches.
5. **Compare.** Step-time and peak-memory ratios, and the max abs difference of every step's
   loss, every LoRA tensor and every AdamW state tensor (0.0 expected: the arms run the same
   kernels in the same order).

Reported per arm: peak ``max_memory_allocated`` and ``max_memory_reserved`` over the arm's steps
(reset after the arm's setup), the allocated memory before its first step (the weights), median
step time over the timed steps (after warm-up), the loss trajectory; for ``poros`` also bytes
copied host->device per step and the achieved GB/s over the timed steps. GB = 1e9 bytes.

Shapes are data (``SHAPES``): the facts of each checkpoint (layers, widths, vocab...) come from
``registry/<family>.toml`` (a shape whose checkpoint the registry does not list is an error);
what the registry does not hold (rotary, norm eps, ...) is written here, under the
``config.json`` it came from. The builder is :func:`poros.doctor.probe.random_nf4_model`, shared with
the planner's compute probe. ``tools`` is a package: the other tools ``from tools import bench``
(run them from the repository root as ``python -m tools.<name>``; ``tools/gpu_run.sh`` does).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from poros import records
from poros.devices import resolve_device
from poros.doctor.probe import measure_link, random_nf4_model

REPO_ROOT = Path(__file__).resolve().parents[1]

GB = 1e9
SEVEN_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: ``control`` is the resident arm again from the same initial state: the reference against itself;
#: ``poros-device`` is Poros with torch's AdamW on the device and no cap (today's step, the small-card
#: arm's yardstick: ``--optimizer-states host`` and ``--vram-budget`` apply to ``poros`` only).
ARMS = ("resident", "control", "poros-device", "poros")


# ---------------------------------------------------------------------------------------------
# Shapes: data, not code.
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    """A model shape to build with random weights.

    Args:
        family: the Poros family (``registry/<family>.toml``).
        model_type: the text config's ``model_type`` (``AutoConfig.for_model``).
        hf_id: the registry entry (``registry/<family>.toml``) whose facts (layers, widths,
            vocab...) are used; ``None`` for synthetic shapes.
        extra: config keyword arguments the registry does not hold (rotary, eps, layer pattern).
    """

    family: str
    model_type: str
    hf_id: str | None
    extra: dict[str, Any] = field(default_factory=dict)


#: Registry keys -> config keyword (the registry writes ``layers`` for ``num_hidden_layers``).
REGISTRY_TO_CONFIG = records.CONFIG_KEYS

_TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=256, max_position_embeddings=512)

SHAPES: dict[str, Shape] = {
    # https://huggingface.co/Qwen/Qwen2.5-7B/blob/main/config.json
    "qwen2.5-7b": Shape("qwen2", "qwen2", "Qwen/Qwen2.5-7B",
        extra=dict(rope_theta=1_000_000.0, rms_norm_eps=1e-6, use_sliding_window=False)),
    # https://huggingface.co/Qwen/Qwen2.5-14B/blob/main/config.json
    "qwen2.5-14b": Shape("qwen2", "qwen2", "Qwen/Qwen2.5-14B",
        extra=dict(rope_theta=1_000_000.0, rms_norm_eps=1e-5, use_sliding_window=False)),
    # https://huggingface.co/Qwen/Qwen2.5-32B/blob/main/config.json
    "qwen2.5-32b": Shape("qwen2", "qwen2", "Qwen/Qwen2.5-32B",
        extra=dict(rope_theta=1_000_000.0, rms_norm_eps=1e-5, use_sliding_window=False)),
    # https://huggingface.co/Qwen/Qwen2.5-72B/blob/main/config.json
    "qwen2.5-72b": Shape("qwen2", "qwen2", "Qwen/Qwen2.5-72B",
        extra=dict(rope_theta=1_000_000.0, rms_norm_eps=1e-5, use_sliding_window=False)),
    # https://huggingface.co/Qwen/Qwen3-8B/blob/main/config.json
    "qwen3-8b": Shape("qwen3", "qwen3", "Qwen/Qwen3-8B",
        extra=dict(rope_theta=1_000_000.0, rms_norm_eps=1e-6)),
    # https://huggingface.co/Qwen/Qwen3-32B/blob/main/config.json
    "qwen3-32b": Shape("qwen3", "qwen3", "Qwen/Qwen3-32B",
        extra=dict(rope_theta=1_000_000.0, rms_norm_eps=1e-6)),
    # https://huggingface.co/Qwen/Qwen3.5-9B/blob/main/config.json (text_config)
    "qwen3.5-9b": Shape("qwen3_5", "qwen3_5_text", "Qwen/Qwen3.5-9B",
        extra=dict(rms_norm_eps=1e-6, linear_key_head_dim=128, linear_value_head_dim=128,
                   rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25,
                                        mrope_section=[11, 11, 10], mrope_interleaved=True))),
    # https://huggingface.co/Qwen/Qwen3.6-27B/blob/main/config.json (text_config)
    # tie_word_embeddings is unconfirmed in the registry; the model card lists a separate LM output
    "qwen3.6-27b": Shape("qwen3_5", "qwen3_5_text", "Qwen/Qwen3.6-27B",
        extra=dict(tie_word_embeddings=False, rms_norm_eps=1e-6, linear_key_head_dim=128, linear_value_head_dim=128,
                   rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25,
                                        mrope_section=[11, 11, 10], mrope_interleaved=True))),
    # https://huggingface.co/google/gemma-3-12b-pt/blob/main/config.json (text_config)
    "gemma3-12b": Shape("gemma3", "gemma3_text", "google/gemma-3-12b-pt",
        extra=dict(rms_norm_eps=1e-6, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                   rope_scaling=dict(rope_type="linear", factor=8.0))),
    # https://huggingface.co/google/gemma-3-27b-pt/blob/main/config.json (text_config)
    # vocab_size is unconfirmed in the registry; the 4B and 12B text configs say 262208
    "gemma3-27b": Shape("gemma3", "gemma3_text", "google/gemma-3-27b-pt",
        extra=dict(vocab_size=262208, rms_norm_eps=1e-6, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                   rope_scaling=dict(rope_type="linear", factor=8.0))),
    # https://huggingface.co/google/gemma-4-E4B-it/blob/main/config.json (text_config)
    "gemma4-e4b": Shape("gemma4", "gemma4_text", "google/gemma-4-E4B-it",
        extra=dict(rms_norm_eps=1e-6, final_logit_softcapping=30.0, use_double_wide_mlp=True,
                   vocab_size_per_layer_input=262144)),
    # https://huggingface.co/google/gemma-4-26B-A4B-it/blob/main/config.json (text_config)
    # attention_k_eq_v / 2 global KV heads: transformers 5.24's Gemma4TextConfig EP-plan comment for this
    # checkpoint ("num_global_key_value_heads=2"); unconfirmed in the registry
    "gemma4-26b-a4b": Shape("gemma4", "gemma4_text", "google/gemma-4-26B-A4B-it",
        extra=dict(rms_norm_eps=1e-6, final_logit_softcapping=30.0, hidden_size_per_layer_input=0,
                   enable_moe_block=True, attention_k_eq_v=True, num_global_key_value_heads=2)),
    # https://huggingface.co/google/gemma-4-31B-it/blob/main/config.json (text_config)
    # attention_k_eq_v / num_global_key_value_heads unconfirmed: the transformers defaults are used
    "gemma4-31b": Shape("gemma4", "gemma4_text", "google/gemma-4-31B-it",
        extra=dict(rms_norm_eps=1e-6, final_logit_softcapping=30.0, hidden_size_per_layer_input=0)),
    # Synthetic shapes for CPU smoke tests: every feature of each family, at width 64.
    "tiny": Shape("qwen2", "qwen2", None, extra=dict(_TINY, num_hidden_layers=2, head_dim=None)),
    "tiny-qwen2": Shape("qwen2", "qwen2", None, extra=dict(_TINY, num_hidden_layers=4, head_dim=None)),
    "tiny-qwen3": Shape("qwen3", "qwen3", None, extra=dict(_TINY, num_hidden_layers=4)),
    "tiny-qwen3_5": Shape("qwen3_5", "qwen3_5_text", None, extra=dict(
        _TINY, num_hidden_layers=4, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16)),
    "tiny-gemma3": Shape("gemma3", "gemma3_text", None, extra=dict(
        _TINY, num_hidden_layers=4, query_pre_attn_scalar=16, sliding_window=8, final_logit_softcapping=30.0,
        rope_scaling=dict(rope_type="linear", factor=8.0),
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"])),
    "tiny-gemma4": Shape("gemma4", "gemma4_text", None, extra=dict(
        _TINY, num_hidden_layers=4, global_head_dim=32, num_kv_shared_layers=2, hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=256, use_double_wide_mlp=True, sliding_window=8, final_logit_softcapping=30.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])),
    "tiny-gemma4-moe": Shape("gemma4", "gemma4_text", None, extra=dict(
        _TINY, num_hidden_layers=4, global_head_dim=32, hidden_size_per_layer_input=0, enable_moe_block=True,
        num_experts=4, top_k_experts=2, moe_intermediate_size=32, attention_k_eq_v=True,
        num_global_key_value_heads=1, sliding_window=8, final_logit_softcapping=30.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])),
}


def _registry_facts(hf_id: str) -> dict[str, Any] | None:
    from poros import records

    found = records.find_checkpoint(hf_id)
    return None if found is None else found[1]


def model_config(name: str, *, layers: int | None = None, **overrides: Any):
    """The HF text config of shape ``name``, optionally truncated to ``layers`` decoder layers.

    Returns:
        ``(config, info)``: ``info`` says where the facts came from and what was passed.

    Raises:
        KeyError: unknown shape; the message lists the known ones.
    """
    from transformers import AutoConfig

    if name not in SHAPES:
        raise KeyError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    shape = SHAPES[name]
    facts, source = {}, "tools/bench.py"
    if shape.hf_id is not None:
        facts = _registry_facts(shape.hf_id)
        if facts is None:
            raise KeyError(f"shape {name!r} names {shape.hf_id!r}, which registry/{shape.family}.toml does not list; "
                           "add the checkpoint's facts there (the registry is where shapes come from).")
        source = f"registry/{shape.family}.toml"
    kwargs = {REGISTRY_TO_CONFIG[k]: v for k, v in facts.items() if k in REGISTRY_TO_CONFIG}
    kwargs.update(shape.extra)
    kwargs.update(overrides)
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    full_layers = kwargs.get("num_hidden_layers")
    if layers is not None:
        kwargs["num_hidden_layers"] = layers
        if "layer_types" in kwargs and len(kwargs["layer_types"]) != layers:
            kwargs["layer_types"] = list(kwargs["layer_types"])[:layers]
        shared = kwargs.get("num_kv_shared_layers")
        if shared and full_layers and "num_kv_shared_layers" not in overrides:
            kwargs["num_kv_shared_layers"] = round(shared * layers / full_layers)
    config = AutoConfig.for_model(shape.model_type, **kwargs)
    # A truncated KV-sharing model may lose the producer of a shared layer kind: share fewer layers.
    while getattr(config, "num_kv_shared_layers", 0):
        try:
            config.kv_sharing_modes
            break
        except ValueError:
            kwargs["num_kv_shared_layers"] = config.num_kv_shared_layers - 1
            config = AutoConfig.for_model(shape.model_type, **kwargs)
    info = {"shape": name, "family": shape.family, "hf_id": shape.hf_id, "facts_from": source,
            "num_hidden_layers": config.num_hidden_layers, "full_depth": full_layers, "config_kwargs": kwargs}
    return config, info


# ---------------------------------------------------------------------------------------------
# Building the model: from_pretrained's path, with random weights instead of a checkpoint.
# ---------------------------------------------------------------------------------------------
def build_model(config, device: str | torch.device, *, seed: int = 0, double_quant: bool = True,
                attn_implementation: str = "sdpa", experts_implementation: str | None = None,
                weight_std: float = 0.02, perturb: float = 0.05):
    """:func:`poros.doctor.probe.random_nf4_model` with the bench's defaults (bf16 compute, NF4, double
    quantization, SDPA): an HF ``*ForCausalLM`` with NF4 ``Linear4bit`` layers and random weights,
    built on ``device`` the way ``from_pretrained`` builds one."""
    return random_nf4_model(config, resolve_device(device, with_index=True), seed=seed, double_quant=double_quant,
                            attn_implementation=attn_implementation, experts_implementation=experts_implementation,
                            weight_std=weight_std, perturb=perturb)


def add_lora(model, *, rank: int = 16, alpha: int = 32, targets: Any = SEVEN_PROJECTIONS,
             target_parameters: list[str] | None = None, gradient_checkpointing: bool = True):
    """PEFT LoRA on ``targets`` (dropout 0), HF gradient checkpointing (non-reentrant) on; returns the PeftModel."""
    from peft import LoraConfig, get_peft_model

    if gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    lora = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
                      target_modules=list(targets) if not isinstance(targets, str) else targets,
                      target_parameters=target_parameters)
    peft_model = get_peft_model(model, lora)
    peft_model.train()  # never eval: bitsandbytes repacks weights in place in eval mode on CPU
    return peft_model


def make_batches(config, *, count: int, batch: int, seq: int, seed: int = 1, left_pad: int = 0) -> list[dict]:
    """``count`` random batches on the host; with ``left_pad`` the last row starts with that many pad tokens."""
    generator = torch.Generator().manual_seed(seed)
    pad = config.pad_token_id if config.pad_token_id is not None else 0
    batches = []
    for _ in range(count):
        input_ids = torch.randint(0, config.vocab_size, (batch, seq), generator=generator)
        attention_mask = torch.ones(batch, seq, dtype=torch.long)
        if left_pad:
            input_ids[-1, :left_pad] = pad
            attention_mask[-1, :left_pad] = 0
        labels = input_ids.masked_fill(attention_mask == 0, -100)
        batches.append({"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels})
    return batches


# ---------------------------------------------------------------------------------------------
# Arms
# ---------------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    """On CUDA: collect cycles (bitsandbytes' Params4bit <-> Linear4bit hold each other, so a dropped
    model stays allocated until ``gc.collect()``), then give cached blocks back. Nothing is measured
    on CPU, where a full collection per call would dominate a smoke test's run time."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def trainable(model) -> list[tuple[str, torch.nn.Parameter]]:
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def snapshot(named: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Host copies (they must not count towards the next arm's device memory)."""
    return {name: t.detach().to("cpu", copy=True) for name, t in named}


def optimizer_snapshot(optimizer, named) -> dict[str, torch.Tensor]:
    out = {}
    for name, param in named:
        for key, value in optimizer.state.get(param, {}).items():
            if isinstance(value, torch.Tensor):
                out[f"{name}::{key}"] = value.detach().to("cpu", copy=True)
    return out


@dataclass
class ArmResult:
    name: str
    status: str = "ok"  # ok | oom | error | skipped
    error: str | None = None
    losses: list[torch.Tensor] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    adapter: dict[str, torch.Tensor] = field(default_factory=dict)
    optimizer: dict[str, torch.Tensor] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def summary(self, warmup: int) -> dict[str, Any]:
        timed = self.step_times[warmup:]
        out = {"status": self.status, "error": self.error,
               "losses": [_json_float(float(x)) for x in self.losses],
               "step_times_s": [round(t, 6) for t in self.step_times],
               "median_step_s": round(statistics.median(timed), 6) if timed else None,
               "timed_steps": len(timed)}
        out.update(self.extra)
        host = self.extra.get("host_times_s", [])[warmup:]
        if host:  # how long the host took to queue a step, beside how long the step took
            out["median_host_s"] = round(statistics.median(host), 6)
        return out


def _steps(batches: list[dict], grad_accum: int) -> list[list[dict]]:
    return [batches[i:i + grad_accum] for i in range(0, len(batches) - grad_accum + 1, grad_accum)]


def run_arm(name: str, call, named_params, batches: list[dict], *, device: torch.device, warmup: int, lr: float,
            vram_limit_gb: float | None = None, on_timed_start=None, grad_accum: int = 1,
            forward_backward=None, profile: bool = False, timed_stats=None, step_hooks=None,
            optimizer_states: str = "device", placement=None) -> ArmResult:
    """AdamW steps of ``call`` over ``batches`` in groups of ``grad_accum`` micro-batches (the first
    ``warmup`` steps untimed); peak memory over the steps. ``forward_backward(micro_batches)``, when
    given, runs a step's forwards and backwards (Poros layer-major) instead of one call per micro-batch.
    ``step_hooks``: ``(begin, end)`` called with the step index around each step, outside its timing.
    ``optimizer_states="host"``: ``poros.HostAdamW`` (the state in pinned host memory) instead of
    ``torch.optim.AdamW``; ``placement``: the model's ``LoraPlacement`` (``lora_placement="host"``), which
    HostAdamW steps with the LoRA tensors."""
    from poros.stream.host_optimizer import adamw

    result = ArmResult(name)
    params = [p for _, p in named_params]
    optimizer = adamw(params, optimizer_states=optimizer_states, lr=lr, placement=placement)
    free_memory(device)
    if device.type == "cuda":
        if vram_limit_gb is not None:
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, vram_limit_gb * GB / total), device)
        torch.cuda.reset_peak_memory_stats(device)
        result.extra["allocated_before_gb"] = round(torch.cuda.memory_allocated(device) / GB, 4)
    steps = _steps(batches, grad_accum)

    def one_step(group: list[dict]) -> list[torch.Tensor]:
        group = [{k: v.to(device) for k, v in batch.items()} for batch in group]
        if grad_accum > 1:  # HF accumulation semantics: each loss is a sum over the step's loss terms
            items = torch.tensor(sum(int((b["labels"][..., 1:] != -100).sum()) for b in group), device=device)
            group = [{**b, "num_items_in_batch": items} for b in group]
        if forward_backward is not None:  # layer-major: the executor drives all micro-batches
            losses = forward_backward(group)
        else:
            losses = []
            for batch in group:
                output = call(**batch, use_cache=False)
                output.loss.backward()
                losses.append(output.loss.detach())
                del output
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return losses

    allocator_before = None
    host_times = result.extra.setdefault("host_times_s", [])
    try:
        for index, group in enumerate(steps):
            if index == warmup:
                if on_timed_start is not None:
                    on_timed_start()
                if device.type == "cuda":
                    allocator_before = torch.cuda.memory_stats(device)
            _sync(device)
            if step_hooks is not None:
                step_hooks[0](index)
            start = time.perf_counter()
            losses = one_step(group)
            host_times.append(round(time.perf_counter() - start, 6))  # the host is done queueing the step
            _sync(device)
            result.step_times.append(time.perf_counter() - start)
            if step_hooks is not None:
                step_hooks[1](index)
            result.losses.extend(loss.to("cpu", copy=True) for loss in losses)
            del losses
        if timed_stats is not None:
            result.extra["timed_stats"] = timed_stats()
        if allocator_before is not None:
            result.extra["allocator_per_step"] = allocator_delta(allocator_before, device, len(steps) - warmup)
        if profile and device.type == "cuda" and steps:  # two more steps, not timed: traced, then sync-checked
            result.extra["profile"] = profile_step(lambda: one_step(steps[-1]), device)
            result.extra["host_syncs"] = sync_check(lambda: one_step(steps[-1]), device)
    except torch.OutOfMemoryError as exc:
        result.status, result.error = "oom", f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    except Exception as exc:  # noqa: BLE001 - recorded in the JSON, the next arm still runs
        result.status, result.error = "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    if device.type == "cuda":
        result.extra["peak_allocated_gb"] = round(torch.cuda.max_memory_allocated(device) / GB, 4)
        result.extra["peak_reserved_gb"] = round(torch.cuda.max_memory_reserved(device) / GB, 4)
        if vram_limit_gb is not None:
            torch.cuda.set_per_process_memory_fraction(1.0, device)
    if result.status == "ok":
        result.adapter = snapshot(named_params)
        result.optimizer = optimizer_snapshot(optimizer, named_params)
    for p in params:
        p.grad = None
    optimizer = None  # its state goes before the next arm measures
    free_memory(device)
    return result


ALLOCATOR_COUNTERS = ("num_alloc_retries", "num_sync_all_streams", "num_device_alloc", "num_device_free",
                      "allocation.all.allocated", "segment.all.allocated")


def allocator_delta(before: dict[str, Any], device: torch.device, steps: int) -> dict[str, float]:
    """Per timed step: the CUDA caching allocator's counters since ``before`` (retries and device
    allocations/frees mean cudaMalloc/cudaFree in the loop, which synchronise the host)."""
    after = torch.cuda.memory_stats(device)
    return {key: round((after.get(key, 0) - before.get(key, 0)) / max(steps, 1), 2) for key in ALLOCATOR_COUNTERS}


def sync_check(step, device: torch.device, top: int = 8) -> dict[str, Any]:
    """Run ``step`` with CUDA sync debugging on: how many operations made the host wait for the
    device, and where (the innermost frames outside torch). Not timed."""
    sites: dict[str, int] = {}

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-1]
                  if "/torch/" not in f.filename and not f.filename.endswith("warnings.py")]
        site = " < ".join(f"{Path(f.filename).name}:{f.lineno}:{f.name}" for f in reversed(frames[-3:]))
        sites[site] = sites.get(site, 0) + 1

    _sync(device)
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():  # restores showwarning on the way out
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    _sync(device)
    ranked = sorted(sites.items(), key=lambda kv: -kv[1])[:top]
    return {"syncs": sum(sites.values()), "sites": [{"calls": n, "where": where} for where, n in ranked]}


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def _intersect(a, b) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def profile_step(step, device: torch.device) -> dict[str, Any]:
    """The copy/compute timeline of one step (torch.profiler, CUDA activity), in milliseconds.

    ``kernel_busy``: union of kernel intervals; ``h2d_busy``: union of host->device copies;
    ``h2d_exposed``: copying while no kernel runs (the copy not hidden under compute);
    ``idle``: neither (launch overhead, host synchronisation, Python); the longest gaps are listed
    with the kernel before them.
    """
    from torch.profiler import ProfilerActivity, profile

    _sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as trace:
        step()
        _sync(device)
    kernels, copies, named, small_copies = [], [], [], []
    host_waits: dict[str, list[float]] = {}
    runtime: dict[str, list[float]] = {}  # CUDA runtime calls made by the host: count and time
    kernel_time: dict[str, list[float]] = {}  # kernel name -> [calls, ms]
    for event in trace.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            took = (event.time_range.end - event.time_range.start) / 1000.0
            if event.name.startswith("cuda"):
                entry = runtime.setdefault(event.name, [0, 0.0])
                entry[0] += 1
                entry[1] += took
                # CUDA runtime calls on the host that wait for the device
                if "Synchronize" in event.name or event.name == "cudaMemcpy":
                    host_waits.setdefault(event.name, []).append(took)
            continue
        interval = (event.time_range.start / 1000.0, event.time_range.end / 1000.0)
        if "Memcpy HtoD" in event.name:
            # block fetches take milliseconds; anything under 0.1 ms is a small copy (batch, scalars)
            (copies if interval[1] - interval[0] >= 0.1 else small_copies).append(interval)
        elif "Memcpy" not in event.name and "Memset" not in event.name:
            kernels.append(interval)
            named.append((interval, event.name))
            entry = kernel_time.setdefault(event.name, [0, 0.0])
            entry[0] += 1
            entry[1] += interval[1] - interval[0]
    if not kernels:
        return {"error": "no CUDA kernels traced"}
    begin = min(a for a, _ in kernels + copies)
    end = max(b for _, b in kernels + copies)
    busy_kernels, busy_copies = _union(kernels), _union(copies)
    overlap = _length(_intersect(busy_kernels, busy_copies))
    active = _union(busy_kernels + busy_copies)
    gaps = sorted(((b[0] - a[1], a[1]) for a, b in zip(active, active[1:])), reverse=True)[:5]
    durations = sorted(b - a for a, b in copies)
    named.sort()
    def before(t):
        return next((name for (s, e), name in reversed(named) if e <= t + 1e-6), None)
    ops = sorted(trace.key_averages(), key=lambda a: -a.self_cpu_time_total)
    return {
        "span_ms": round(end - begin, 3),
        "kernels": len(kernels), "kernel_sum_ms": round(sum(b - a for a, b in kernels), 3),
        "top_kernels": [{"name": name[:90], "calls": n, "ms": round(ms, 3)}
                        for name, (n, ms) in sorted(kernel_time.items(), key=lambda kv: -kv[1][1])[:12]],
        "runtime_calls": {name: {"calls": n, "ms": round(ms, 3)}
                          for name, (n, ms) in sorted(runtime.items(), key=lambda kv: -kv[1][1])},
        "top_host_ops": [{"name": a.key[:60], "calls": a.count, "self_ms": round(a.self_cpu_time_total / 1000.0, 3)}
                         for a in ops if not a.key.startswith("cuda")][:25],
        "kernel_busy_ms": round(_length(busy_kernels), 3),
        "h2d_busy_ms": round(_length(busy_copies), 3),
        "h2d_exposed_ms": round(_length(busy_copies) - overlap, 3),
        "idle_ms": round((end - begin) - _length(active), 3),
        "host_waits": {name: {"calls": len(times), "ms": round(sum(times), 3)} for name, times in host_waits.items()},
        "h2d_copies": len(copies), "h2d_copy_ms_median": round(durations[len(durations) // 2], 3) if durations else None,
        "h2d_small_copies": len(small_copies), "h2d_small_copy_ms": round(_length(_union(small_copies)), 3),
        "longest_gaps": [{"ms": round(ms, 3), "at_ms": round(at - begin, 3), "after": (before(at) or "")[:80]}
                         for ms, at in gaps],
    }


class CopyTimeline:
    """How long the compute stream waited for block copies in each timed step: CUDA events, no profiler.

    Observes the store (``store.observers``): after each copy an event on the copy stream (*copy
    done*); before each wait an event on the compute stream (*wanted*: the compute reached the
    block) and the host clock. A wait stalls the compute by ``max(0, done - wanted)`` -- time
    the GPU lost to the link, unlike the profiler's *exposed copy*, which also counts copies that
    run while the GPU waits for the host. ``gpu_lag``: how long after the host issued a wait the
    compute stream reached it -- near zero the GPU is starved by the host (launch-bound), large
    the host runs ahead of the GPU.
    """

    def __init__(self, store) -> None:
        self.store = store
        self._copy_done: dict[int, Any] = {}
        self._waits: list[tuple[int, Any, float, Any]] = []
        self._origin = None
        self._host_origin = 0.0
        self.steps: list[dict[str, Any]] = []
        store.observers.append(self)

    def detach(self) -> None:
        """Stop observing the store."""
        self.store.observers.remove(self)

    def on_fetch(self, index: int) -> None:
        """The store issued block ``index``'s copy (it is called only when a copy happened)."""
        if self._origin is not None:
            done = torch.cuda.Event(enable_timing=True)
            done.record(self.store.copy_stream)
            self._copy_done[index] = done

    def on_wait(self, index: int) -> None:
        """The compute stream is about to wait for block ``index``'s copy."""
        if self._origin is not None and not self.store.blocks[index].resident:
            wanted = torch.cuda.Event(enable_timing=True)
            wanted.record(torch.cuda.current_stream(self.store.device))
            self._waits.append((index, wanted, time.perf_counter(), self._copy_done.get(index)))

    def hooks(self, warmup: int):
        """``(begin, end)`` for :func:`run_arm`: trace the steps from index ``warmup`` on."""
        def begin(step: int) -> None:
            if step >= warmup:
                self._copy_done, self._waits = {}, []
                self._origin = torch.cuda.Event(enable_timing=True)
                self._origin.record(torch.cuda.current_stream(self.store.device))
                self._host_origin = time.perf_counter()

        def end(step: int) -> None:
            if step >= warmup and self._origin is not None:
                torch.cuda.synchronize(self.store.device)
                try:  # a diagnostic must not cost the arm
                    self.steps.append(self._step_summary())
                except Exception as exc:  # noqa: BLE001
                    self.steps.append({"error": f"{type(exc).__name__}: {exc}"})
                self._origin = None
        return begin, end

    def _step_summary(self) -> dict[str, Any]:
        stalls = {"forward": 0.0, "backward": 0.0}
        lags, worst, phase, previous = [], [], "forward", -1
        for index, wanted, host_time, done in self._waits:
            if index < previous:
                phase = "backward"
            previous = index
            at = self._origin.elapsed_time(wanted)
            lags.append(at - (host_time - self._host_origin) * 1000.0)
            stall = max(0.0, self._origin.elapsed_time(done) - at) if done is not None else 0.0
            stalls[phase] += stall
            worst.append((stall, index, phase))
        lags.sort()
        worst.sort(reverse=True)
        return {
            "waits": len(self._waits), "copies": len(self._copy_done),
            "stall_forward_ms": round(stalls["forward"], 3), "stall_backward_ms": round(stalls["backward"], 3),
            "stalled_waits": sum(1 for s, _, _ in worst if s > 0.05),
            "gpu_lag_ms_median": round(lags[len(lags) // 2], 3) if lags else None,
            "gpu_lag_ms_p10": round(lags[len(lags) // 10], 3) if lags else None,
            "waits_gpu_starved": sum(1 for lag in lags if lag < 0.1),
            "largest_stalls": [{"ms": round(s, 3), "block": i, "phase": p} for s, i, p in worst[:3] if s > 0],
        }

    def summary(self) -> dict[str, Any]:
        """Per-step records and their medians (milliseconds)."""
        def median(key):
            values = sorted(step[key] for step in self.steps if step.get(key) is not None)
            return values[len(values) // 2] if values else None
        return {"steps": self.steps,
                **{f"median_{k}": median(k) for k in ("stall_forward_ms", "stall_backward_ms", "gpu_lag_ms_median",
                                                       "waits_gpu_starved", "waits")}}


def link_gb_per_s(device: torch.device) -> float | None:
    """Pinned host->device GB/s of one 1 GiB copy (best of 5, :func:`poros.doctor.probe.measure_link`): the link
    the poros arm streams over; None off CUDA."""
    if device.type != "cuda":
        return None
    bytes_per_s = measure_link(device, nbytes=1 << 30, repeats=5)
    free_memory(device)
    return round(bytes_per_s / GB, 3)


def restore(named_params, initial: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, param in named_params:
            param.copy_(initial[name])


def compare_runs(peft_model, batches: list[dict], *, arms=("resident", "poros"), device: torch.device, warmup: int, lr: float = 1e-3,
                 vram_limit_gb: float | None = None, num_slots: int = 2, grad_accum: int = 1,
                 schedule: str = "micro-major", profile: bool = False, vram_budget: str | None = None,
                 compute=None, link_bytes_per_s: float | None = None, timeline: bool = False,
                 optimizer_states: str = "device", capped_arms: tuple[str, ...] | None = None,
                 loss_chunks: int = 1, cuda_graphs: bool = False, lora_placement: str = "device") -> dict[str, Any]:
    """Run the arms on one model, one after the other, from the same LoRA state; compare them.

    ``optimizer_states`` is the Poros arm's (the reference keeps torch's AdamW on the device);
    ``capped_arms``: the arms ``vram_limit_gb`` applies to (default: all).

    ``vram_budget`` goes to ``poros.prepare`` (the planner picks slots and resident blocks); the
    poros arm records the planner's prediction for the setup prepare made (``prediction``: peak,
    copy bytes, and the step when ``compute`` times and the link are given) next to what it measures.

    Returns:
        ``{"arms": {name: ArmResult}, "comparison": compare(...)}``.
    """
    device = resolve_device(device, with_index=True)
    named = trainable(peft_model)
    initial = snapshot(named)

    def limit(arm: str) -> float | None:
        return vram_limit_gb if capped_arms is None or arm in capped_arms else None

    results: dict[str, ArmResult] = {}
    # Capped arms first, on an allocator no earlier arm has fragmented: a live tensor left inside a
    # big segment of an uncapped arm keeps that segment reserved, and the cap counts reserved bytes
    # (seen at 72B: 20.8 GB reserved-unallocated under an 8 GB cap).
    order = sorted((a for a in ARMS if a in arms), key=lambda a: limit(a) is None)
    for name in order:
        restore(named, initial)
        if name in ("resident", "control"):
            results[name] = run_arm(name, peft_model, named, batches, device=device, warmup=warmup, lr=lr,
                                    vram_limit_gb=limit(name), grad_accum=grad_accum, profile=profile)
            continue
        results[name], handle = run_poros_arm(
            peft_model, batches, device=device, warmup=warmup, lr=lr, vram_limit_gb=limit(name),
            num_slots=num_slots, grad_accum=grad_accum, schedule=schedule, profile=profile,
            vram_budget=vram_budget if name == "poros" else None, compute=compute,
            link_bytes_per_s=link_bytes_per_s, timeline=timeline,
            optimizer_states=optimizer_states if name == "poros" else "device", loss_chunks=loss_chunks,
            cuda_graphs=cuda_graphs and name == "poros",
            lora_placement=lora_placement if name == "poros" else "device")
        results[name].name = name
        if handle is not None and name != order[-1]:
            handle.unpatch()  # the next arm runs the model as it was
        handle = None
        free_memory(device)
    if "poros" in arms and results["poros"].status == "error" and "poros.prepare" in (results["poros"].error or ""):
        return {"arms": results, "comparison": None}
    return {"arms": results, "comparison": compare(results, warmup)}


def run_poros_arm(peft_model, batches: list[dict], *, device: torch.device, warmup: int, lr: float,
                  vram_limit_gb: float | None = None, num_slots: int = 2, grad_accum: int = 1,
                  schedule: str = "micro-major", profile: bool = False, vram_budget: str | None = None,
                  compute=None, link_bytes_per_s: float | None = None, timeline: bool = False,
                  optimizer_states: str = "device", loss_chunks: int = 1, cuda_graphs: bool = False,
                  lora_placement: str = "device"):
    """``poros.prepare`` the model (HF checkpointing off) and run the Poros arm; returns ``(ArmResult, handle)``.

    The arm records the planner's prediction for the setup prepare made (``prediction``: peak, copy
    bytes, and the step when ``compute`` times and the link are given) next to what it measures;
    with ``timeline`` the copy stalls of each timed step (:class:`CopyTimeline`). ``handle`` is the
    ``PorosModel`` (``unpatch()`` it to run another arm), or None when ``prepare`` failed.
    """
    import poros
    from poros.stream import planner
    from poros.stream.footprint import predict_prepared

    peft_model.get_base_model().activation_checkpointing_disable()
    batch, seq = batches[0]["input_ids"].shape
    workload = planner.Workload(batch_size=batch, seq_len=seq, grad_accum=grad_accum, schedule=schedule,
                                loss_chunks=loss_chunks)
    try:
        streamed = poros.prepare(peft_model, num_slots=num_slots, vram_budget=vram_budget,
                                 workload=workload if vram_budget is not None else None,
                                 optimizer_states=optimizer_states, cuda_graphs=cuda_graphs,
                                 lora_placement=lora_placement)
    except Exception as exc:  # noqa: BLE001 - recorded in the JSON like an arm failure
        return ArmResult("poros", status="error",
                         error=f"poros.prepare: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"), None
    try:  # the planner's prediction for this setup, recorded next to the measurement
        prediction = predict_prepared(streamed, workload, compute=compute, link_bytes_per_s=link_bytes_per_s,
                                      optimizer_states=optimizer_states)
    except Exception as exc:  # noqa: BLE001 - a planner bug must not cost the measurement
        prediction = {"error": f"{type(exc).__name__}: {exc}"}
    store = streamed.store
    copies = CopyTimeline(store) if timeline and store.on_cuda else None
    result = run_arm("poros", streamed, trainable(streamed), batches, device=device, warmup=warmup, lr=lr,
                     vram_limit_gb=vram_limit_gb, on_timed_start=store.stats.reset, grad_accum=grad_accum,
                     forward_backward=streamed.forward_backward if schedule == "layer-major" else None,
                     profile=profile, step_hooks=copies.hooks(warmup) if copies else None,
                     timed_stats=lambda: {"bytes": store.stats.bytes_copied, "fetches": sum(store.stats.fetches)},
                     optimizer_states=optimizer_states, placement=streamed.lora_placement)
    if copies is not None:
        copies.detach()
        result.extra["copy_timeline"] = copies.summary()
    timed_steps = len(result.step_times[warmup:])
    timed_time = sum(result.step_times[warmup:])
    counted = result.extra.pop("timed_stats", None) or {"bytes": store.stats.bytes_copied,
                                                         "fetches": sum(store.stats.fetches)}
    copied = counted["bytes"]
    result.extra.update({
        "lora_placement": "host" if streamed.lora_placement is not None else "device",  # what prepare applied
        "host_bytes": store.host_bytes,
        "slot_bytes": store.slot_bytes,
        "num_slots": store.num_slots,
        "resident_blocks": list(store.resident_blocks),
        "resident_bytes": store.resident_bytes,
        "blocks": len(store.blocks),
        "bytes_copied_per_step": copied // timed_steps if timed_steps else None,
        "fetches_per_step": counted["fetches"] / timed_steps if timed_steps else None,
        "h2d_gb_per_s": round(copied / timed_time / GB, 3) if timed_time else None,
        "prediction": prediction,
        "budget_plan": streamed.budget_plan.to_dict() if streamed.budget_plan is not None else None,
        "cuda_graphs": streamed.executor.graphs.report.to_dict() if streamed.executor.graphs is not None else None,
    })
    return result, streamed


def _max_abs_diff(a: dict[str, torch.Tensor] | list, b) -> tuple[float | None, bool]:
    pairs = list(zip(a, b)) if isinstance(a, list) else [(a[k], b.get(k)) for k in a]
    if isinstance(a, dict) and set(a) != set(b):
        return None, False
    worst, equal = 0.0, True
    for x, y in pairs:
        if y is None or x.shape != y.shape or x.dtype != y.dtype:
            return None, False
        equal = equal and torch.equal(x, y)
        if x.numel():
            diff = (x.double() - y.double()).abs().max().item()
            worst = math.nan if math.isnan(diff) or math.isnan(worst) else max(worst, diff)
    return worst, equal


def parity(reference: ArmResult, other: ArmResult) -> dict[str, Any]:
    """Max abs diffs and ``torch.equal`` of every step's loss, every LoRA tensor, every AdamW state tensor."""
    loss, loss_equal = _max_abs_diff(reference.losses, other.losses)
    loss_equal = loss_equal and len(reference.losses) == len(other.losses)
    adapter, adapter_equal = _max_abs_diff(reference.adapter, other.adapter)
    optim, optim_equal = _max_abs_diff(reference.optimizer, other.optimizer)
    return {
        "max_diff_loss": _json_float(loss), "max_diff_adapter": _json_float(adapter),
        "max_diff_optimizer": _json_float(optim),
        "equal_loss": loss_equal, "equal_adapter": adapter_equal, "equal_optimizer": optim_equal,
        "bitwise": bool(loss_equal and adapter_equal and optim_equal),
        "adapter_tensors": len(reference.adapter), "optimizer_tensors": len(reference.optimizer),
    }


def compare(results: dict[str, ArmResult], warmup: int = 0) -> dict[str, Any] | None:
    """Poros against resident: parity and the ratios poros/resident (``None`` when either did not finish).

    With a ``control`` arm (resident run again), ``"control"`` holds its parity against the first
    resident run: whether the reference is run-to-run deterministic in this configuration.
    """
    finished = {name: r for name, r in results.items() if r.status == "ok"}
    resident = finished.get("resident")
    out = None
    if resident is not None and "poros" in finished:
        streamed = finished["poros"]
        out = parity(resident, streamed)
        for key in ("median_step_s", "peak_allocated_gb", "peak_reserved_gb"):
            a, b = resident.summary(warmup).get(key), streamed.summary(warmup).get(key)
            if a and b is not None:
                out[f"ratio_{key}"] = round(b / a, 4)
    if resident is not None and "control" in finished:
        out = out or {}
        out["control"] = parity(resident, finished["control"])
    if "poros-device" in finished and "poros" in finished:  # the poros arm against today's step (poros-device)
        out = out or {}
        base, small = finished["poros-device"], finished["poros"]
        out["poros_device"] = {"parity": parity(base, small)}  # poros-device vs poros (resident vs poros: above)
        for key in ("median_step_s", "peak_allocated_gb"):
            a, b = base.summary(warmup).get(key), small.summary(warmup).get(key)
            if a and b is not None:
                out["poros_device"][f"ratio_{key}"] = round(b / a, 4)
    return out


def _json_float(value):
    if value is None or not isinstance(value, float) or math.isfinite(value):
        return value
    return str(value)  # "nan" / "inf": JSON has no literal for them


# ---------------------------------------------------------------------------------------------
# Provenance
# ---------------------------------------------------------------------------------------------
def configure_threads(threads: int | None) -> None:
    """Width-64 ops run several times faster on one thread than on a busy machine's several."""
    if threads:
        torch.set_num_threads(threads)


def start_tool(args: argparse.Namespace) -> tuple[torch.device, dict[str, Any]]:
    """A GPU tool's common start (bench, parity gate, VRAM curve): quiet transformers' checkpointing
    warning, deterministic algorithms and CPU threads as asked; returns the device and the environment."""
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    configure_determinism(args.deterministic)
    configure_threads(args.threads)
    device = resolve_device(args.device, with_index=True)
    return device, environment(device, args.commit)


def configure_determinism(enabled: bool) -> None:
    """Deterministic algorithms on; call before the first CUDA operation (cuBLAS reads the env var then)."""
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)


def git_commit(explicit: str | None = None) -> str:
    """``explicit``, else ``$POROS_COMMIT``, else ``git rev-parse --short HEAD`` (``-dirty`` when tracked
    files changed), else ``"unknown"`` (a copy of the tree without ``.git``, e.g. on the GPU host)."""
    if explicit or os.environ.get("POROS_COMMIT"):
        return explicit or os.environ["POROS_COMMIT"]

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True, check=True,
                              timeout=10).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        return f"{commit}-dirty" if git("status", "--porcelain", "--untracked-files=no") else commit
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def environment(device: torch.device, commit: str | None = None) -> dict[str, Any]:
    """Device, platform class, library versions, date and commit, as every record carries them."""
    import bitsandbytes
    import peft
    import transformers

    device = resolve_device(device, with_index=True)
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        name, platform_class = torch.cuda.get_device_name(device), f"cuda-sm{major}{minor}"
    else:
        name = platform_class = f"cpu-{platform.machine()}"
    return {
        "platform": name, "platform_class": platform_class,
        "torch": torch.__version__.split("+")[0], "torch_build": torch.__version__,
        "cuda": torch.version.cuda, "transformers": transformers.__version__, "peft": peft.__version__,
        "bitsandbytes": bitsandbytes.__version__, "python": platform.python_version(),
        "date": datetime.date.today().isoformat(), "commit": git_commit(commit),
        # the caching allocator's settings change what fits under a cap (expandable segments)
        "cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
    }


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------
def _format(value, digits=3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def environment_line(env: dict[str, Any]) -> str:
    return (f"{env['platform']} ({env['platform_class']}) | torch {env['torch_build']} transformers "
            f"{env['transformers']} peft {env['peft']} bitsandbytes {env['bitsandbytes']} | {env['date']} {env['commit']}")


def print_table(report: dict[str, Any]) -> None:
    env, cfg = report["environment"], report["config"]
    print(f"\n{cfg['model']} ({cfg['model_info']['num_hidden_layers']} layers) seq {cfg['seq']} batch {cfg['batch']}"
          f" on {environment_line(env)}")
    header = f"{'arm':<14}{'status':<8}{'peak alloc GB':>14}{'peak resv GB':>14}{'median step s':>15}" \
             f"{'H2D GB/s':>10}{'MB/step':>10}  losses"
    print(header)
    print("-" * len(header))
    for name, arm in report["arms"].items():
        per_step = arm.get("bytes_copied_per_step")
        losses = " ".join(f"{x:.6f}" if isinstance(x, float) else str(x) for x in arm["losses"])
        print(f"{name:<14}{arm['status']:<8}{_format(arm.get('peak_allocated_gb')):>14}"
              f"{_format(arm.get('peak_reserved_gb')):>14}{_format(arm.get('median_step_s'), 4):>15}"
              f"{_format(arm.get('h2d_gb_per_s')):>10}{_format(per_step / 1e6 if per_step else None, 1):>10}  {losses}")
        if arm.get("error"):
            print(f"          {arm['error'].splitlines()[0]}")
    link, fraction = report["build"].get("link_h2d_gb_per_s"), report["arms"].get("poros", {}).get("h2d_fraction_of_link")
    if link:
        print(f"pinned host->device link: {link} GB/s; poros achieved {_format(fraction, 3)} of it over its timed steps")
    timeline = report["arms"].get("poros", {}).get("copy_timeline")
    if timeline:
        print(timeline_line(timeline))
    comparison = report.get("comparison") or {}
    if "bitwise" in comparison:
        print(f"poros/resident: step time x{_format(comparison.get('ratio_median_step_s'))}, "
              f"peak allocated x{_format(comparison.get('ratio_peak_allocated_gb'))}")
        print(_parity_line("parity poros vs resident", comparison))
    if "control" in comparison:
        print(_parity_line("control resident vs resident", comparison["control"]))


def timeline_line(timeline: dict[str, Any]) -> str:
    """One line from :meth:`CopyTimeline.summary`."""
    return (f"copy stalls per step (median): forward {_format(timeline.get('median_stall_forward_ms'), 1)} ms, "
            f"backward {_format(timeline.get('median_stall_backward_ms'), 1)} ms; the GPU reached a block "
            f"{_format(timeline.get('median_gpu_lag_ms_median'), 2)} ms after the host asked for it (median); "
            f"{timeline.get('median_waits_gpu_starved')} of {timeline.get('median_waits')} waits found the GPU "
            "starved by the host (< 0.1 ms)")


def diagnostics_line(summary: dict[str, Any]) -> str:
    """One line of what an arm measured beside its step time: how long the host took to queue a step,
    the caching allocator's device calls, and (with ``--profile``) kernels, idle GPU and host syncs."""
    parts = []
    if summary.get("median_host_s") is not None:
        parts.append(f"host queued a step in {summary['median_host_s']:.3f} s of {summary.get('median_step_s')} s")
    allocator = summary.get("allocator_per_step")
    if allocator:
        parts.append(f"allocator per step: {allocator['num_device_alloc']} cudaMalloc, {allocator['num_device_free']} "
                     f"cudaFree, {allocator['num_alloc_retries']} retries, {allocator['allocation.all.allocated']} allocations")
    profile = summary.get("profile") or {}
    if "kernels" in profile:
        parts.append(f"traced step: {profile['kernels']} kernels, {profile['kernel_sum_ms']:.0f} ms of kernels, GPU idle "
                     f"{profile['idle_ms']:.0f} of {profile['span_ms']:.0f} ms")
    syncs = summary.get("host_syncs")
    if syncs is not None:
        where = f" (most at {syncs['sites'][0]['where']})" if syncs["sites"] else ""
        parts.append(f"{syncs['syncs']} host syncs{where}")
    return "; ".join(parts)


def _parity_line(title: str, diffs: dict[str, Any]) -> str:
    return (f"{title}: max|dloss| {diffs['max_diff_loss']}  max|dadapter| {diffs['max_diff_adapter']}  "
            f"max|doptimizer| {diffs['max_diff_optimizer']}  ({'bitwise' if diffs['bitwise'] else 'NOT bitwise'}, "
            f"{diffs['adapter_tensors']} LoRA tensors, {diffs['optimizer_tensors']} AdamW state tensors)")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Resident QLoRA vs Poros streaming on random weights at real shapes; prints a table, writes JSON.",
        epilog="shapes: " + ", ".join(SHAPES),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-32b", choices=sorted(SHAPES), metavar="SHAPE")
    parser.add_argument("--layers", type=int, help="truncate to N decoder layers (same width)")
    parser.add_argument("--seq", type=int, help="tokens per row (default 512; 64 for the tiny-* shapes)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5, help="timed steps after warm-up (median over these)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--arms", default="resident,poros",
                        help="comma list of: " + ", ".join(ARMS) + " (control: resident again, the reference "
                             "against itself); they run in that order")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--deterministic", action="store_true",
                        help="torch.use_deterministic_algorithms(True), CUBLAS_WORKSPACE_CONFIG=:4096:8")
    parser.add_argument("--vram-limit", type=float, metavar="GB",
                        help="cap the process (set_per_process_memory_fraction) during each arm's steps")
    parser.add_argument("--cap-arms", help="comma list of the arms --vram-limit caps (default: every arm), e.g. "
                                           "poros: the reference runs uncapped for the parity check")
    parser.add_argument("--loss-chunks", type=int, default=1, metavar="N",
                        help="both arms compute the loss over N token chunks (poros.stream.chunked_loss; bitwise "
                             "between the arms, numerically HF's default loss); 1: HF's loss")
    parser.add_argument("--optimizer-states", default="device", choices=("device", "host"),
                        help="Poros arm: AdamW's state on the device (torch.optim.AdamW) or in pinned host memory "
                             "(poros.HostAdamW, stepped a chunk at a time); the reference keeps torch's AdamW")
    parser.add_argument("--lora-placement", default="device", choices=("device", "host", "auto"),
                        help="Poros arm: the streamed blocks' LoRA parameters and gradients on the device, or in "
                             "pinned host memory travelling with their block (poros.prepare(lora_placement=...); "
                             "needs --optimizer-states host and --schedule layer-major); auto: the --vram-budget "
                             "planner decides")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="the poros arm replays its block phases from CUDA graphs (prepare(cuda_graphs=True))")
    parser.add_argument("--slots", type=int, default=2, help="device slots of the Poros block ring")
    parser.add_argument("--vram-budget", metavar="SIZE",
                        help="poros.prepare(vram_budget=SIZE), e.g. 8GiB: the planner picks slots and resident blocks")
    parser.add_argument("--probe", action=argparse.BooleanOptionalAction, default=None,
                        help="time one block with the planner's compute probe before building, so the JSON holds "
                             "the planner's step prediction (default: on CUDA when the poros arm runs)")
    parser.add_argument("--grad-accum", type=int, default=1, metavar="M",
                        help="micro-batches per optimizer step (HF num_items_in_batch semantics when M > 1)")
    parser.add_argument("--profile", action="store_true",
                        help="trace one extra step per arm (CUDA): copy/compute busy, exposed copy, idle gaps")
    parser.add_argument("--timeline", action="store_true",
                        help="Poros arm on CUDA: per timed step, how long compute waited for block copies (CUDA "
                             "events) and how far the GPU trails the host")
    parser.add_argument("--schedule", default="micro-major", choices=("micro-major", "layer-major"),
                        help="Poros arm with --grad-accum: one model call per micro-batch, or layer-major")
    parser.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"))
    parser.add_argument("--experts", choices=("grouped_mm", "eager", "batched_mm"), help="MoE experts implementation")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--alpha", type=int, default=32)
    parser.add_argument("--targets", default=",".join(SEVEN_PROJECTIONS), help="comma list, or all-linear")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-double-quant", action="store_true", help="bnb_4bit_use_double_quant=False")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: 1 for tiny shapes on CPU)")
    parser.add_argument("--commit", help="commit to record (default: git, or $POROS_COMMIT)")
    parser.add_argument("--json", type=Path, help="write the report here")
    args = parser.parse_args(argv)
    if args.threads is None and args.model.startswith("tiny") and args.device == "cpu":
        args.threads = 1
    if args.seq is None:
        args.seq = 64 if args.model.startswith("tiny") else 512
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = set(args.arms) - set(ARMS)
    if unknown or not args.arms:
        parser.error(f"--arms {','.join(args.arms)}: expected a comma list of {', '.join(ARMS)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.vram_limit and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
        # Under a cap the allocator's reserved bytes count: without expandable segments, segments left
        # partly used by building the model stay reserved (20 GB of them OOM-ed a 72B run at 4 GB
        # allocated under 8 GB). Set before the first CUDA allocation; recorded in the environment.
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    device, env = start_tool(args)
    targets = "all-linear" if args.targets == "all-linear" else tuple(args.targets.split(","))
    config, info = model_config(args.model, layers=args.layers)
    link = link_gb_per_s(device) if "poros" in args.arms else None
    compute = None
    if "poros" in args.arms and (args.probe or (args.probe is None and device.type == "cuda")):
        from poros.doctor import probe  # the planner's own probe, before the model takes the memory
        from poros.stream import planner

        compute = probe.probe_compute(
            config, planner.Workload(args.batch, args.seq, args.grad_accum, args.schedule, args.loss_chunks), device,
            compute_dtype=torch.bfloat16, double_quant=not args.no_double_quant, attn_implementation=args.attn,
            lora_rank=args.rank, lora_alpha=args.alpha, target_modules=list(targets) if not isinstance(targets, str)
            else targets)
        free_memory(device)

    start = time.perf_counter()
    model = build_model(config, device, seed=args.seed, double_quant=not args.no_double_quant,
                        attn_implementation=args.attn, experts_implementation=args.experts)
    peft_model = add_lora(model, rank=args.rank, alpha=args.alpha, targets=targets)
    if args.loss_chunks > 1:  # on the model both arms run, so the parity check compares like with like
        from poros.stream.chunked_loss import use_chunked_loss

        use_chunked_loss(peft_model, args.loss_chunks)
    free_memory(device)
    build_s = time.perf_counter() - start
    allocated = torch.cuda.memory_allocated(device) / GB if device.type == "cuda" else None
    batches = make_batches(config, count=(args.warmup + args.steps) * args.grad_accum, batch=args.batch, seq=args.seq,
                           seed=args.seed + 1)

    outcome = compare_runs(peft_model, batches, arms=args.arms, device=device, warmup=args.warmup, lr=args.lr,
                           vram_limit_gb=args.vram_limit, num_slots=args.slots, grad_accum=args.grad_accum,
                           schedule=args.schedule, profile=args.profile, vram_budget=args.vram_budget, compute=compute,
                           timeline=args.timeline, optimizer_states=args.optimizer_states,
                           capped_arms=tuple(args.cap_arms.split(",")) if args.cap_arms else None,
                           loss_chunks=args.loss_chunks, cuda_graphs=args.cuda_graphs, lora_placement=args.lora_placement,
                           link_bytes_per_s=link * GB if link else None)
    report = {
        "tool": "tools/bench.py",
        "environment": env,
        "config": {
            "model": args.model, "model_info": info, "seq": args.seq, "batch": args.batch, "steps": args.steps,
            "warmup": args.warmup, "arms": args.arms, "deterministic": args.deterministic,
            "vram_limit_gb": args.vram_limit, "vram_budget": args.vram_budget, "num_slots": args.slots,
            "capped_arms": args.cap_arms.split(",") if args.cap_arms else None,
            "optimizer_states": args.optimizer_states, "loss_chunks": args.loss_chunks, "cuda_graphs": args.cuda_graphs,
            "lora_placement": args.lora_placement,
            "timeline": args.timeline,
            "grad_accum": args.grad_accum,
            "schedule": args.schedule, "attn_implementation": args.attn,
            "experts_implementation": args.experts, "lora": {"rank": args.rank, "alpha": args.alpha,
                                                             "dropout": 0.0, "targets": targets},
            "optimizer": {"name": "AdamW", "lr": args.lr}, "gradient_checkpointing": "non-reentrant (resident)",
            "quantization": {"quant_type": "nf4", "double_quant": not args.no_double_quant,
                             "compute_dtype": "bfloat16"},
            "seed": args.seed, "cpu_threads": torch.get_num_threads(),
        },
        "build": {"seconds": round(build_s, 2), "link_h2d_gb_per_s": link,
                  "allocated_after_build_gb": None if allocated is None else round(allocated, 4),
                  "trainable_parameters": sum(p.numel() for _, p in trainable(peft_model))},
        "arms": {name: result.summary(args.warmup) for name, result in outcome["arms"].items()},
        "comparison": outcome["comparison"],
    }
    achieved = report["arms"].get("poros", {}).get("h2d_gb_per_s")
    if link and achieved is not None:
        report["arms"]["poros"]["h2d_fraction_of_link"] = round(achieved / link, 4)
    print_table(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(f"wrote {args.json}")
    failed = any(arm["status"] == "error" for arm in report["arms"].values())
    mismatch = not (report["comparison"] or {}).get("bitwise", True)
    return 1 if failed or mismatch else 0


if __name__ == "__main__":
    sys.exit(main())
