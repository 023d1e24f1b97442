"""The compute probe: times a few real blocks of a run's shapes on the device, so the budget model
(:mod:`poros.plan.budget`) can predict the step; and the host-to-device link
(:func:`measure_link`).

:func:`random_qlora_model` builds a PEFT LoRA model around an NF4 base with random weights the way
``from_pretrained`` does (no bf16 copy of the model ever exists); :func:`probe_compute` cuts the
config to the fewest layers that hold every layer kind, streams it with :func:`poros.prepare`
(every block resident) and times each block's forward and recompute + backward, the head and the
optimizer. It sits above the engine (it runs ``prepare``); ``poros plan --probe`` and the bench
call it.
"""

from __future__ import annotations

import copy
import math
import time
from typing import Any

import torch
from torch import nn

from poros.adapters import lora_target_modules
from poros.devices import resolve_device
from poros.errors import StreamingError
from poros.plan.budget import ComputeTimes, Workload


def measure_link(device: torch.device | str, nbytes: int = 256 * 2**20, repeats: int = 3) -> float:
    """Host-to-device bytes per second of one ``nbytes`` copy from pinned memory (best of ``repeats``
    after a warm-up); on CPU the memcpy a CPU block fetch does."""
    device = torch.device(device)
    on_cuda = device.type == "cuda"
    source = torch.empty(nbytes, dtype=torch.uint8, pin_memory=on_cuda)
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = math.inf
    for attempt in range(repeats + 1):
        if on_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            target.copy_(source, non_blocking=True)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1000
        else:
            began = time.perf_counter()
            target.copy_(source)
            seconds = time.perf_counter() - began
        if attempt:  # the first copy warms up
            best = min(best, seconds)
    return nbytes / best


def _probe_config(text_config: Any, layers: int) -> Any:
    """``text_config`` cut to its first ``layers`` decoder layers (each layer kind present), no KV sharing."""
    values = text_config.to_dict()
    values["num_hidden_layers"] = layers
    if isinstance(values.get("layer_types"), list):
        values["layer_types"] = values["layer_types"][:layers]
    if isinstance(values.get("per_layer_config"), dict):  # per-layer overrides, keyed by layer index
        values["per_layer_config"] = {k: v for k, v in values["per_layer_config"].items() if int(k) < layers}
    if values.get("num_kv_shared_layers"):
        values["num_kv_shared_layers"] = 0  # a sharing layer computes a little less: timed as a full one
    return type(text_config).from_dict(values)


def _probe_layer_count(text_config: Any, limit: int = 8) -> int:
    """The shortest prefix of the layers that holds every layer kind (``layer_types``), at most ``limit``."""
    kinds = list(getattr(text_config, "layer_types", None) or [])
    if not kinds:
        return 1
    wanted, seen = set(kinds), set()
    for count, kind in enumerate(kinds, start=1):
        seen.add(kind)
        if seen == wanted or count == limit:
            return count
    return len(kinds)


def random_nf4_model(config: Any, device: torch.device | str, *, compute_dtype: torch.dtype = torch.bfloat16,
                     quant_type: str = "nf4", double_quant: bool = True, seed: int = 0,
                     attn_implementation: str | None = "sdpa", experts_implementation: str | None = None,
                     weight_std: float = 0.02, perturb: float = 0.05, quantize_experts: bool = False) -> nn.Module:
    """An HF ``*ForCausalLM`` with NF4 ``Linear4bit`` layers and random weights, built on ``device``.

    The steps are those of ``from_pretrained(..., quantization_config=BitsAndBytesConfig(
    load_in_4bit=True, bnb_4bit_quant_type=quant_type, bnb_4bit_compute_dtype=compute_dtype,
    bnb_4bit_use_double_quant=double_quant), device_map={"": device})``; only the checkpoint read
    is replaced by a seeded ``randn * weight_std`` per quantized weight. With ``quantize_experts`` each MoE
    experts module's fused tensors are made the same way and packed to NF4 at once
    (:func:`poros.quantize_experts`), one module at a time: the bf16 experts never exist all together;
    ``experts_implementation`` then picks their forward, ``"poros_nf4_grouped"`` or the ``"poros_nf4"`` loop
    (None: grouped where transformers' grouped_mm computes on ``device``).

    Raises:
        ValueError: ``quantize_experts`` with a transformers ``experts_implementation`` (NF4 experts have their own).
        RuntimeError: a tensor was left on the meta device or holds NaN after initialisation.
    """
    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    from transformers.quantizers import AutoHfQuantizer
    from transformers.utils.generic import ContextManagers

    nf4_forwards = {None: None, "poros_nf4_grouped": True, "poros_nf4": False}  # quantize_experts(grouped=...)
    if quantize_experts and experts_implementation not in nf4_forwards:
        raise ValueError(f"quantize_experts computes with its own experts forward; experts_implementation="
                         f"{experts_implementation!r} would replace it: pass poros_nf4_grouped, poros_nf4 or None")
    device = resolve_device(device, with_index=True)
    dtype = compute_dtype
    quant_config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type, bnb_4bit_compute_dtype=dtype,
                                      bnb_4bit_use_double_quant=double_quant)
    quantizer = AutoHfQuantizer.from_config(quant_config, pre_quantized=False)
    model_class = AutoModelForCausalLM._model_mapping[type(config)]
    config = copy.deepcopy(config)  # as from_pretrained: the quantizer writes into the model's config
    # from_pretrained: skeleton on meta under the dtype context, Linear -> Linear4bit (weights untouched).
    with ContextManagers(model_class.get_init_context(dtype, True, False, None)):
        model = model_class(config)
        quantizer.preprocess_model(model=model, dtype=dtype, device_map={"": device}, checkpoint_files=None,
                                   use_kernels=False)

    generator = torch.Generator(device=device).manual_seed(seed)
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    with torch.no_grad():
        # Quantized weights, as Bnb4bitQuantize loads them: Params4bit(bf16 value).to(device) quantizes.
        for module in model.modules():
            if not isinstance(module, bnb.nn.Linear4bit):
                continue
            old = module.weight
            value = torch.randn(old.shape, generator=generator, device=device, dtype=dtype) * weight_std
            module.weight = bnb.nn.Params4bit(value, requires_grad=False, **old.__dict__).to(device)
            del value
            if module.bias is not None:
                bias = torch.randn(module.bias.shape, generator=generator, device=device, dtype=dtype) * weight_std
                module.bias = torch.nn.Parameter(bias, requires_grad=False)
            module._is_hf_initialized = True
        if quantize_experts:
            _random_nf4_experts(model, generator, device, dtype, weight_std, nf4_forwards[experts_implementation])
        # Everything else, as _move_missing_keys_from_meta_to_device does, but NaN-filled so that a
        # tensor the model's own init misses cannot pass unnoticed.
        for name, param in list(model.named_parameters()):
            if not param.is_meta:
                continue
            if name in tied:
                param._is_hf_initialized = True  # tie_weights() below points it at its source
                continue
            _set_tensor(model, name, _placeholder(param, device), parameter=True)
        for name, buffer in list(model.named_buffers()):
            if buffer is not None and buffer.is_meta:
                _set_tensor(model, name, _placeholder(buffer, device), parameter=False)
        torch.manual_seed(seed)
        model.initialize_weights()
        model.tie_weights()
        _check_materialised(model)
        if perturb:
            _perturb_one_dimensional(model, generator, perturb)
    model.eval()  # what from_pretrained returns; the bench trains in train() mode
    model.hf_quantizer = quantizer
    quantizer.postprocess_model(model)
    if attn_implementation is not None:
        model.set_attn_implementation(attn_implementation)
    if experts_implementation is not None and not quantize_experts:
        model.set_experts_implementation(experts_implementation)
    return model


def _random_nf4_experts(model, generator, device, dtype, weight_std: float, grouped: bool | None) -> None:
    """Every experts module's fused tensors: seeded random bf16 on ``device``, packed to NF4 module by module
    (``grouped``: :func:`poros.quantize_experts`' choice of forward)."""
    from poros.loading.experts import FUSED_EXPERT_TENSORS, experts_modules, quantize_experts

    for _, module in experts_modules(model):
        for name in FUSED_EXPERT_TENSORS:
            old = getattr(module, name)
            value = torch.randn(old.shape, generator=generator, device=device, dtype=dtype) * weight_std
            setattr(module, name, torch.nn.Parameter(value, requires_grad=False))
        quantize_experts(module, grouped=grouped)
        module._is_hf_initialized = True


def _placeholder(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if tensor.is_floating_point():
        return torch.full(tensor.shape, float("nan"), dtype=tensor.dtype, device=device)
    return torch.zeros(tensor.shape, dtype=tensor.dtype, device=device)


def _set_tensor(model, name: str, value: torch.Tensor, *, parameter: bool) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    if parameter:
        value = torch.nn.Parameter(value, requires_grad=value.is_floating_point())
    setattr(parent, attr, value)  # keeps a buffer's persistent / non-persistent status


def _check_materialised(model) -> None:
    bad = []
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor is None:
            continue
        if tensor.is_meta:
            bad.append(f"{name} (still on meta)")
        elif tensor.is_floating_point() and bool(torch.isnan(tensor).any()):
            bad.append(f"{name} (NaN: the model's initialize_weights did not set it)")
    if bad:
        raise RuntimeError(f"build left {len(bad)} tensors uninitialised: {', '.join(bad[:8])}. Initialise them in "
                           "random_nf4_model (poros/doctor/probe.py) the way the model's _init_weights would.")


def _perturb_one_dimensional(model, generator: torch.Generator, scale: float) -> None:
    """``+ scale * randn`` on every 1-D floating tensor that is neither quantized nor a non-persistent buffer:
    norm weights, biases, Gemma 4's ``layer_scalar`` and router scales, Gated DeltaNet's ``A_log``..."""
    import bitsandbytes as bnb

    non_persistent = {name for name, _ in model.named_non_persistent_buffers()}
    seen: set[int] = set()
    tensors = [t for _, t in model.named_parameters()]
    tensors += [t for n, t in model.named_buffers() if n not in non_persistent]
    for tensor in tensors:
        if (id(tensor) in seen or isinstance(tensor, bnb.nn.Params4bit) or tensor.dim() != 1
                or not tensor.is_floating_point()):
            continue
        seen.add(id(tensor))
        noise = torch.randn(tensor.shape, generator=generator, device=tensor.device, dtype=torch.float32)
        tensor.add_((noise * scale).to(tensor.dtype))


def random_qlora_model(text_config: Any, device: torch.device | str, *, compute_dtype: torch.dtype,
                       quant_type: str = "nf4", double_quant: bool = False, attn_implementation: str | None = None,
                       lora_rank: int = 16, lora_alpha: int = 32, target_modules: str | list[str] = "all-linear",
                       seed: int = 0) -> nn.Module:
    """A PEFT LoRA model around :func:`random_nf4_model` (random NF4 weights, built the way
    ``from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True))`` builds one,
    so no bf16 copy of the model ever exists). For timing, not for parity."""
    import peft

    model = random_nf4_model(text_config, device, compute_dtype=compute_dtype, quant_type=quant_type,
                             double_quant=double_quant, seed=seed, attn_implementation=attn_implementation)
    lora = peft.LoraConfig(r=lora_rank, lora_alpha=lora_alpha, lora_dropout=0.0, task_type="CAUSAL_LM",
                           target_modules=lora_target_modules(model, target_modules))
    peft_model = peft.get_peft_model(model, lora)
    peft_model.train()
    return peft_model


def probe_compute(text_config: Any, workload: Workload, device: torch.device | str, *,
                  compute_dtype: torch.dtype = torch.bfloat16, quant_type: str = "nf4", double_quant: bool = False,
                  attn_implementation: str | None = None, lora_rank: int = 16, lora_alpha: int = 32,
                  target_modules: str | list[str] = "all-linear", warmup: int = 1, iterations: int = 3,
                  lora_parameters: int | None = None) -> ComputeTimes:
    """Time one micro-batch's work per block at the run's real shapes: a random NF4 + LoRA model of
    ``text_config`` cut to the fewest layers that hold every layer kind, every block resident (no
    copy), streamed by :func:`poros.prepare` so the executor's own recompute and overheads are in
    the numbers, on the workload's schedule (layer-major: ``forward_backward`` over its M
    micro-batches, whose overheads differ). CUDA events (host clock on CPU) at each block's entry,
    forward and recompute, at the final norm and after backward give each block's forward, its
    recompute + backward and the head's forward + backward, per micro-batch; the median of
    ``iterations`` after ``warmup``. Each real block gets the times of the probed block of its kind.
    The optimizer step is timed on the probe's adapters and scaled to ``lora_parameters`` (default:
    to the model's number of blocks).

    Raises:
        torch.OutOfMemoryError: the probe model does not fit on the device.
    """
    import statistics

    from poros.dropin.model import prepare

    device = torch.device(device)
    on_cuda = device.type == "cuda"
    layers = _probe_layer_count(text_config)
    model = random_qlora_model(_probe_config(text_config, layers), device, compute_dtype=compute_dtype,
                               quant_type=quant_type, double_quant=double_quant,
                               attn_implementation=attn_implementation, lora_rank=lora_rank, lora_alpha=lora_alpha,
                               target_modules=target_modules)
    streamed = prepare(model, resident_blocks=layers, embeddings_on_host=on_cuda)
    probe_lora_parameters = sum(p.numel() for p in streamed.trainable_parameters())
    clock = _Clock(device)
    hooks = [layer.register_forward_pre_hook(lambda module, args, i=i: clock.mark(f"block {i}"))
             for i, layer in enumerate(streamed.executor.layers)]
    hooks.append(streamed.executor.final_norm.register_forward_pre_hook(lambda module, args: clock.mark("head")))
    optimizer = torch.optim.AdamW(streamed.trainable_parameters(), lr=1e-6)
    generator = torch.Generator().manual_seed(0)
    samples: list[dict[str, float]] = []
    micro = workload.grad_accum if workload.schedule == "layer-major" else 1
    try:
        for iteration in range(warmup + iterations):
            batches = _random_batches(workload, micro, text_config.vocab_size, generator, device)
            clock.clear()
            clock.mark("start")
            if micro > 1:
                items = torch.tensor(micro * workload.batch_size * (workload.seq_len - 1), device=device)
                streamed.forward_backward([{**batch, "num_items_in_batch": items} for batch in batches])
            else:
                streamed(**batches[0]).loss.backward()
            clock.mark("end")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            clock.mark("optimizer")
            labels, times = clock.read()
            if iteration >= warmup:
                samples.append(_segments(labels, times, layers, micro))
    finally:
        for hook in hooks:
            hook.remove()
        streamed.unpatch()
        del streamed, model, optimizer
        if on_cuda:
            torch.cuda.empty_cache()
    median = {key: statistics.median(s[key] for s in samples) for key in samples[0]}
    probed = _probed_blocks(text_config, layers)
    blocks = text_config.num_hidden_layers
    # AdamW's time grows with the parameters: scale to the run's (by default, to its number of blocks)
    optimizer_s = median["optimizer"] * (lora_parameters / probe_lora_parameters if lora_parameters
                                         and probe_lora_parameters else blocks / layers)
    name = torch.cuda.get_device_name(device) if on_cuda else "cpu"
    return ComputeTimes(
        forward_s=tuple(median[f"forward {block}"] for block in probed),
        backward_s=tuple(median[f"backward {block}"] for block in probed),
        head_s=median["head"], optimizer_s=optimizer_s,
        source=f"probe on {name} ({layers} block{'s' if layers > 1 else ''} at batch {workload.batch_size} x seq "
               f"{workload.seq_len}{f', layer-major over {micro}' if micro > 1 else ''}, median of {iterations})",
    )


class _Clock:
    """The labelled marks of one probe iteration: CUDA events on a CUDA device, the host clock elsewhere."""

    def __init__(self, device: torch.device):
        self.device = device
        self.on_cuda = device.type == "cuda"
        self.marks: list[tuple[str, Any]] = []

    def mark(self, label: str) -> None:
        if self.on_cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append((label, event))
        else:
            self.marks.append((label, time.perf_counter()))

    def clear(self) -> None:
        self.marks.clear()

    def read(self) -> tuple[list[str], list[float]]:
        """``(labels, seconds since the first mark)``, after waiting for the device."""
        marks = self.marks
        if self.on_cuda:
            torch.cuda.synchronize(self.device)
            times = [0.0] + [marks[0][1].elapsed_time(e) / 1000 for _, e in marks[1:]]
        else:
            times = [t - marks[0][1] for _, t in marks]
        return [label for label, _ in marks], times


def _random_batches(workload: Workload, micro: int, vocab: int, generator: torch.Generator,
                    device: torch.device) -> list[dict[str, torch.Tensor]]:
    """``micro`` batches of random token ids at the workload's shape, labels equal to the inputs."""
    batches = []
    for _ in range(micro):
        ids = torch.randint(0, vocab, (workload.batch_size, workload.seq_len), generator=generator).to(device)
        batches.append({"input_ids": ids, "labels": ids})
    return batches


def _probed_blocks(text_config: Any, layers: int) -> list[int]:
    """For each block of the model, the probed block (of the first ``layers``) of its layer kind; the first
    probed block for a kind the probe lacks or a config without ``layer_types``."""
    kinds = list(getattr(text_config, "layer_types", None) or [])
    probed_kinds = kinds[:layers]

    def probed(i: int) -> int:
        kind = kinds[i] if i < len(kinds) else None
        return probed_kinds.index(kind) if kind in probed_kinds else 0

    return [probed(i) for i in range(text_config.num_hidden_layers)]


def _segments(labels: list[str], times: list[float], layers: int, micro: int = 1) -> dict[str, float]:
    """Per-block forward and recompute + backward, head and optimizer seconds, per micro-batch, from
    one iteration's marks: ``start``, each block's entries in forward (M of them layer-major), the
    head's, each block's recompute entries, ``end``, ``optimizer``. A block's time runs from its
    first entry to the next block's (or the head's, or ``end``)."""
    at = dict(enumerate(times))
    heads = [i for i, label in enumerate(labels) if label == "head"]
    end = labels.index("end")

    def first(label: str, after: int, before: int) -> int:
        return next(i for i in range(after, before) if labels[i] == label)

    try:
        forward = [first(f"block {b}", 0, heads[0]) for b in range(layers)]
        backward = [first(f"block {b}", heads[-1], end) for b in range(layers - 1, -1, -1)]
    except (StopIteration, IndexError):
        raise StreamingError(f"the probe's marks do not follow the executor's order for {layers} blocks and {micro} "
                             f"micro-batches: {labels}") from None
    out = {}
    for position, index in enumerate(forward):
        following = forward[position + 1] if position + 1 < layers else heads[0]
        out[f"forward {position}"] = (at[following] - at[index]) / micro
    for position, index in enumerate(backward):
        following = backward[position + 1] if position + 1 < layers else end
        out[f"backward {layers - 1 - position}"] = (at[following] - at[index]) / micro
    out["head"] = (at[backward[0]] - at[heads[0]]) / micro
    out["optimizer"] = at[labels.index("optimizer")] - at[end]
    return out


__all__ = ["measure_link", "probe_compute", "random_nf4_model", "random_qlora_model"]
