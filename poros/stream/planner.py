"""The memory plan of a streamed run, from the checkpoint's ``config.json`` alone (no weight is read).

``poros train --dry-run`` prints it. The arithmetic:

* **Block bytes are computed, not guessed.** The text tower is built as a skeleton on the meta
  device (``AutoModelForCausalLM.from_config(text_config)``: real module tree, no storage). A
  linear that transformers' bitsandbytes integration would quantize (same rule: exact
  ``nn.Linear``, minus ``get_keys_to_not_convert`` and ``_keep_in_fp32_modules``) counts as the
  packed 4-bit weight (``ceil(numel / 2)`` bytes) plus its ``QuantState`` tensors: fp32 absmax
  per 64 values and the 16-value code table, or with double quantization uint8 absmax, the fp32
  offset, fp32 absmax per 256 absmax values and the 256-value code table. Everything else counts
  at its dtype. Every tensor is padded to the block store's alignment, walked exactly as
  :class:`~poros.stream.store.BlockStore` walks a block, so the result equals the store's host
  buffer sizes (``tests/test_cli_train.py`` checks it on every tiny family).
* **Device memory is an estimate**: ``num_slots`` x the largest block + the modules outside the
  blocks that live on the device + LoRA parameters, gradients and AdamW state (fp32) + the saved
  block-boundary activations (``L x batch x seq x hidden``) + one block's recompute working set +
  the logits and loss. Allocator fragmentation and the CUDA context are not in it.

Multimodal checkpoints (a config with ``text_config``) are planned for their text tower, the part
Poros trains.
"""

from __future__ import annotations

import math
import os
import pathlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from poros.descriptor import ArchitectureDescriptor, resolve_path
from poros.errors import CheckpointLoadError
from poros.stream.store import ALIGN, _frozen_tensors

#: bitsandbytes 4-bit block sizes: values per absmax, and absmax values per nested absmax.
QUANT_BLOCKSIZE = 64
NESTED_BLOCKSIZE = 256
CODE_4BIT_VALUES = 16  # the NF4 / FP4 code table (fp32)
CODE_NESTED_VALUES = 256  # the 8-bit dynamic map of double quantization (fp32)
#: LoRA tensors are fp32 (PEFT upcasts adapters of a 4-bit base): parameter + gradient + AdamW exp_avg
#: and exp_avg_sq, 4 bytes each.
LORA_BYTES_PER_PARAMETER = 16


def padded(nbytes: int) -> int:
    """Bytes a tensor of ``nbytes`` occupies in a block buffer (every tensor starts ALIGN-aligned)."""
    return -(-nbytes // ALIGN) * ALIGN


def quantized_tensor_bytes(numel: int, *, double_quant: bool) -> list[int]:
    """Unpadded byte sizes of the tensors bitsandbytes keeps for a 4-bit weight of ``numel`` values.

    ``[packed weight, absmax, code]``; with double quantization
    ``[packed weight, absmax (uint8), code, offset, nested absmax, nested code]``.
    """
    blocks = math.ceil(numel / QUANT_BLOCKSIZE)
    packed = math.ceil(numel / 2)  # two 4-bit values per uint8
    if not double_quant:
        return [packed, 4 * blocks, 4 * CODE_4BIT_VALUES]
    return [packed, blocks, 4 * CODE_4BIT_VALUES, 4, 4 * math.ceil(blocks / NESTED_BLOCKSIZE),
            4 * CODE_NESTED_VALUES]


# ---------------------------------------------------------------------------------------------
# The checkpoint's config, offline
# ---------------------------------------------------------------------------------------------
def locate_checkpoint_config(model: str, *, revision: str | None = None) -> tuple[pathlib.Path, str]:
    """The directory holding ``model``'s ``config.json``, without downloading anything.

    A local directory and the bundled ``poros-tiny-qwen3`` resolve as :func:`poros.load.resolve_checkpoint`
    resolves them; a hub id only through the HF cache (its ``config.json`` is enough: the plan
    needs no weights).

    Returns:
        ``(directory, where)``; ``where`` says how it was found, for the plan's header.

    Raises:
        CheckpointLoadError: no such directory, or a hub id whose ``config.json`` is not cached.
    """
    from poros.assets import is_asset
    from poros.load import resolve_checkpoint

    path = pathlib.Path(model).expanduser()
    hub_like = model.count("/") == 1 and not model.startswith((".", "/", "~")) and not path.exists()
    if not hub_like:
        directory = resolve_checkpoint(model, revision=revision)
        return directory, "bundled with poros" if is_asset(model) else "local directory"
    import huggingface_hub

    cached = huggingface_hub.try_to_load_from_cache(model, "config.json", revision=revision)
    if isinstance(cached, str) and os.path.isfile(cached):
        return pathlib.Path(cached).parent, "HF cache"
    raise CheckpointLoadError(
        f"{model!r}{f' (revision {revision})' if revision else ''} is not a local directory and its config.json "
        f"is not in the HF cache ({huggingface_hub.constants.HF_HUB_CACHE}); --dry-run reads only the cache and "
        f"never downloads. Fetch the config first (`hf download {model} config.json`), or pass a local "
        "checkpoint directory."
    )


def load_text_config(directory: pathlib.Path) -> tuple[Any, Any]:
    """``(config, text_config)`` of a checkpoint directory; ``text_config is config`` for a text model.

    Raises:
        CheckpointLoadError: no ``config.json``, or transformers cannot read it.
    """
    import json

    import transformers

    config_file = directory / "config.json"
    if not config_file.is_file():
        raise CheckpointLoadError(f"{directory} has no config.json: not a transformers checkpoint directory. "
                                  "Point at the directory that save_pretrained wrote.")
    try:
        config = transformers.AutoConfig.from_pretrained(directory)
    except (ValueError, KeyError, OSError, json.JSONDecodeError) as exc:
        raise CheckpointLoadError(
            f"{config_file} could not be read by transformers {transformers.__version__}: {exc}. A newer model "
            "type may need a newer transformers; a hand-edited config must be valid JSON."
        ) from exc
    return config, config.get_text_config()


def meta_skeleton(text_config: Any, compute_dtype: torch.dtype) -> nn.Module:
    """The causal LM of ``text_config`` on the meta device (module tree and shapes, no storage),
    with every tensor frozen as in a QLoRA base."""
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(text_config, dtype=compute_dtype)
    model.requires_grad_(False)
    return model


def quantized_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The linears bitsandbytes would quantize on load, by name: transformers' own rule
    (``replace_with_bnb_linear``: exact ``nn.Linear``, skipping the output embedding, tied weights,
    the last module and ``_keep_in_fp32_modules``)."""
    from transformers.quantizers.base import HfQuantizer
    from transformers.quantizers.quantizers_utils import should_convert_module

    keep = HfQuantizer.get_modules_to_not_convert(model, None, getattr(model, "_keep_in_fp32_modules", None))
    return {name: module for name, module in model.named_modules()
            if type(module) is nn.Linear and should_convert_module(name, keep)}


# ---------------------------------------------------------------------------------------------
# Bytes
# ---------------------------------------------------------------------------------------------
def block_bytes(blocks: list[nn.Module], quantized_weights: set[int], *, double_quant: bool) -> list[int]:
    """Host-store bytes of each block, as :class:`~poros.stream.store.BlockStore` packs it.

    Args:
        blocks: the decoder layers of a (meta) skeleton, frozen.
        quantized_weights: ``id`` of every weight parameter that is stored 4-bit.
        double_quant: the QuantStates carry nested statistics.
    """
    seen_in: dict[tuple[int, str], set[int]] = {}
    for index, block in enumerate(blocks):
        for _, owner, attr, _, _ in _frozen_tensors(block):
            seen_in.setdefault((id(owner), attr), set()).add(index)
    shared = {key for key, where in seen_in.items() if len(where) > 1}  # stays resident, as in the store
    sizes = []
    for block in blocks:
        total = 0
        for _, owner, attr, _, tensor in _frozen_tensors(block):
            if (id(owner), attr) in shared:
                continue
            if id(owner) in quantized_weights:
                total += sum(padded(n) for n in quantized_tensor_bytes(tensor.numel(), double_quant=double_quant))
            else:
                total += padded(tensor.numel() * tensor.element_size())
        sizes.append(total)
    return sizes


def _tensor_bytes(tensor: torch.Tensor, quantized_weights: set[int], double_quant: bool) -> int:
    if id(tensor) in quantized_weights:
        return sum(quantized_tensor_bytes(tensor.numel(), double_quant=double_quant))
    return tensor.numel() * tensor.element_size()


def lora_targets(model: nn.Module, target_modules: str | list[str]) -> dict[str, nn.Linear]:
    """The linears a LoRA config would wrap, by name: the names :func:`poros.trainer.lora_target_modules`
    gives PEFT, matched by PEFT's rule (a name equal to the module path or to its last components).

    Raises:
        ConfigError: a listed name matches no linear of the model.
    """
    from poros.trainer import lora_target_modules

    names = lora_target_modules(model, target_modules)
    return {path: module for path, module in model.named_modules()
            if isinstance(module, nn.Linear) and any(path == name or path.endswith("." + name) for name in names)}


def host_embedding_tables(model: nn.Module, descriptor: ArchitectureDescriptor) -> list[nn.Embedding]:
    """Frozen embedding tables ``prepare(embeddings_on_host=True)`` keeps on the host: the input and
    prelude embeddings that are not tied to the head (identity, as the skeleton has no storage)."""
    from poros.errors import DescriptorError

    disabled = descriptor.disabled_names(model.config)
    head_weight = getattr(resolve_path(model, descriptor.head), "weight", None)
    tables = []
    for path in (descriptor.embeddings, *(p for p in descriptor.prelude_modules if p not in disabled)):
        try:
            module = resolve_path(model, path)
        except DescriptorError:
            continue
        if isinstance(module, nn.Embedding) and module.weight is not head_weight:
            tables.append(module)
    return tables


# ---------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    """What ``--dry-run`` prints. Sizes in bytes; the ``*_estimate`` properties are estimates."""

    model: str
    checkpoint: str  # the directory the config came from
    found_in: str  # "bundled with poros" | "local directory" | "HF cache"
    family: str
    model_type: str
    text_tower_of: str | None  # the multimodal model_type whose text tower is planned, else None
    num_blocks: int
    hidden_size: int
    vocab_size: int
    quantization: str
    double_quant: bool
    compute_dtype: str
    block_bytes: tuple[int, ...]  # host store, per block (exact)
    non_block_bytes: int  # frozen tensors outside the blocks (embeddings, final norm, head, rotary...)
    host_embedding_bytes: int  # the part of non_block_bytes kept on the host (embeddings_on_host)
    lora_rank: int
    use_dora: bool
    lora_modules: int
    lora_parameters: int
    target_modules: str  # as configured, for the header
    batch_size: int
    seq_len: int
    num_slots: int
    device: str  # resolved: "cpu", "cuda", "cuda:N"
    activation_bytes_per_value: int  # compute dtype size
    recompute_bytes: int  # one block's recompute working set (estimate)
    logits_bytes: int  # logits + fp32 loss working set (estimate)

    @property
    def largest_block_bytes(self) -> int:
        return max(self.block_bytes, default=0)

    @property
    def host_store_bytes(self) -> int:
        return sum(self.block_bytes)

    @property
    def slot_bytes(self) -> int:
        return self.num_slots * self.largest_block_bytes

    @property
    def device_non_block_bytes(self) -> int:
        return self.non_block_bytes - self.host_embedding_bytes

    @property
    def lora_state_bytes(self) -> int:
        return self.lora_parameters * LORA_BYTES_PER_PARAMETER

    @property
    def boundary_activation_bytes(self) -> int:
        return self.num_blocks * self.batch_size * self.seq_len * self.hidden_size * self.activation_bytes_per_value

    @property
    def peak_device_bytes_estimate(self) -> int:
        return (self.slot_bytes + self.device_non_block_bytes + self.lora_state_bytes
                + self.boundary_activation_bytes + self.recompute_bytes + self.logits_bytes)

    @property
    def host_ram_bytes_estimate(self) -> int:
        """Host store + host embeddings; on a CPU run the device's share is host memory as well."""
        host = self.host_store_bytes + self.host_embedding_bytes
        if self.device == "cpu":
            host += self.peak_device_bytes_estimate
        return host


def plan_run(config: Any) -> Plan:
    """The memory plan of a :class:`~poros.config.PorosConfig`, from the checkpoint's config only.

    Raises:
        CheckpointLoadError: the checkpoint's ``config.json`` is not available offline or unreadable.
        UnknownArchitectureError: no registered family claims its ``model_type``.
        ConfigError: ``target_modules`` names a linear the model does not have.
    """
    from poros import registry
    from poros.trainer import resolve_device

    directory, found_in = locate_checkpoint_config(config.model, revision=config.revision)
    full_config, text_config = load_text_config(directory)
    descriptor = registry.for_config(text_config)
    compute_dtype = getattr(torch, config.compute_dtype)
    model = meta_skeleton(text_config, compute_dtype)
    blocks = list(resolve_path(model, descriptor.decoder_layers))
    quantized = quantized_linears(model)
    quantized_weights = {id(module.weight) for module in quantized.values()}
    sizes = block_bytes(blocks, quantized_weights, double_quant=config.double_quant)

    in_blocks = {id(t) for block in blocks for t in [*block.parameters(), *block.buffers()]}
    outside = {id(t): t for t in [*model.parameters(), *model.buffers()] if id(t) not in in_blocks}
    non_block = sum(_tensor_bytes(t, quantized_weights, config.double_quant) for t in outside.values())

    device = str(resolve_device(config.device))
    on_host = config.embeddings_on_host if config.embeddings_on_host is not None else device.startswith("cuda")
    host_tables = host_embedding_tables(model, descriptor) if on_host else []
    host_embedding = sum(t.weight.numel() * t.weight.element_size() for t in host_tables)

    targets = lora_targets(model, config.target_modules)
    lora_parameters = sum(config.lora_rank * (m.in_features + m.out_features)
                          + (m.out_features if config.use_dora else 0) for m in targets.values())

    value_bytes = torch.empty((), dtype=compute_dtype, device="meta").element_size()
    hidden = text_config.hidden_size
    vocab = text_config.vocab_size
    tokens = config.batch_size * config.seq_len
    return Plan(
        model=config.model, checkpoint=str(directory), found_in=found_in, family=descriptor.name,
        model_type=text_config.model_type,
        text_tower_of=full_config.model_type if text_config is not full_config else None,
        num_blocks=len(blocks), hidden_size=hidden, vocab_size=vocab, quantization=config.quantization,
        double_quant=config.double_quant, compute_dtype=config.compute_dtype, block_bytes=tuple(sizes),
        non_block_bytes=non_block, host_embedding_bytes=host_embedding, lora_rank=config.lora_rank,
        use_dora=config.use_dora, lora_modules=len(targets),
        lora_parameters=lora_parameters,
        target_modules=(config.target_modules if isinstance(config.target_modules, str)
                        else ",".join(config.target_modules)),
        batch_size=config.batch_size, seq_len=config.seq_len, num_slots=config.num_slots, device=device,
        activation_bytes_per_value=value_bytes,
        recompute_bytes=recompute_working_set(blocks, text_config, tokens, value_bytes, config.batch_size,
                                              config.seq_len, config.attn_implementation),
        logits_bytes=tokens * vocab * (value_bytes + 4 + 4),  # logits, fp32 upcast for the loss, its gradient
    )


def recompute_working_set(blocks: list[nn.Module], text_config: Any, tokens: int, value_bytes: int,
                          batch_size: int, seq_len: int, attn_implementation: str | None) -> int:
    """Estimate of what one block's recompute holds at once, from the largest block's shapes.

    Per token: 6 hidden-wide values (residuals, norms) and twice the output width of every linear
    in the block (each output and what the next op makes of it); plus the largest 4-bit weight
    dequantized to the compute dtype in forward and backward; plus, for eager attention, the
    ``batch x heads x seq x seq`` scores and probabilities.
    """
    hidden = text_config.hidden_size
    linear_outputs = max((sum(m.out_features for m in block.modules() if isinstance(m, nn.Linear))
                          for block in blocks), default=0)
    largest_linear = max((m.weight.numel() for block in blocks for m in block.modules() if isinstance(m, nn.Linear)),
                         default=0)
    working = tokens * (6 * hidden + 2 * linear_outputs) * value_bytes + 2 * largest_linear * value_bytes
    if attn_implementation == "eager":
        heads = text_config.to_dict().get("num_attention_heads") or 1  # a plain read: some configs are per-layer
        working += 2 * batch_size * heads * seq_len * seq_len * value_bytes
    return working


# ---------------------------------------------------------------------------------------------
# Printing
# ---------------------------------------------------------------------------------------------
def human_bytes(nbytes: int) -> str:
    """``1536`` -> ``"1.5 KiB"`` (binary units)."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _runs(sizes: tuple[int, ...]) -> str:
    """``(5, 5, 7)`` -> ``"5 B x 2, 7 B x 1"``: block sizes in order, consecutive equal ones grouped."""
    groups: list[list[int]] = []
    for size in sizes:
        if groups and groups[-1][0] == size:
            groups[-1][1] += 1
        else:
            groups.append([size, 1])
    return ", ".join(f"{size:,} B x {count}" for size, count in groups)


def format_plan(plan: Plan) -> str:
    """The plan as text: a header and two fixed-width tables (host, device), estimates labelled."""
    from poros.cli.output import table

    tower = f", text tower of {plan.text_tower_of}" if plan.text_tower_of else ""
    quant = f"{plan.quantization}{' + double quant' if plan.double_quant else ''}"
    adapter = (f"LoRA r{plan.lora_rank}{' + DoRA' if plan.use_dora else ''} on {plan.lora_modules} linears "
               f"({plan.target_modules}): {plan.lora_parameters:,} trainable parameters")
    header = [
        f"model       {plan.model} ({plan.found_in}: {plan.checkpoint})",
        f"family      {plan.family} (model_type {plan.model_type}{tower}): {plan.num_blocks} decoder blocks, "
        f"hidden {plan.hidden_size}, vocab {plan.vocab_size}",
        f"base        {quant}, compute {plan.compute_dtype}",
        f"adapters    {adapter}",
        f"run         batch {plan.batch_size} x seq {plan.seq_len}, {plan.num_slots} device slots, device "
        f"{plan.device}",
        f"blocks      {_runs(plan.block_bytes)} (host store, exact)",
    ]
    host_rows = [
        (f"block store ({plan.num_blocks} blocks)", plan.host_store_bytes),
        ("embedding tables kept on host", plan.host_embedding_bytes),
    ]
    if plan.device == "cpu":
        host_rows.append(("device share (device is cpu: see below)",
                          plan.host_ram_bytes_estimate - plan.host_store_bytes - plan.host_embedding_bytes))
    host_rows.append(("expected host RAM (estimate, without the runtime)", plan.host_ram_bytes_estimate))
    device_rows = [
        (f"device slots ({plan.num_slots} x largest block)", plan.slot_bytes),
        ("modules outside the blocks", plan.device_non_block_bytes),
        ("LoRA params + grads + AdamW state (fp32)", plan.lora_state_bytes),
        (f"boundary activations ({plan.num_blocks} x {plan.batch_size} x {plan.seq_len} x {plan.hidden_size} x "
         f"{plan.activation_bytes_per_value} B)", plan.boundary_activation_bytes),
        ("one block's recompute working set (estimate)", plan.recompute_bytes),
        ("logits and loss (estimate)", plan.logits_bytes),
        ("peak device memory (estimate)", plan.peak_device_bytes_estimate),
    ]

    def rows(items):
        return [(label, f"{nbytes:,}", human_bytes(nbytes)) for label, nbytes in items]

    return "\n".join([
        *header, "",
        table(("host memory", "bytes", "size"), rows(host_rows)), "",
        table(("device memory", "bytes", "size"), rows(device_rows)), "",
        "Estimates: block bytes are exact; the device peak leaves out the CUDA context and allocator "
        "fragmentation.",
    ])


__all__ = ["Plan", "block_bytes", "format_plan", "human_bytes", "locate_checkpoint_config", "plan_run",
           "quantized_tensor_bytes"]
