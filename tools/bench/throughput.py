"""The machine's numbers for each bench arm: model and hardware TFLOP/s and MFU against the dense bf16 rate the
same run measured (docs/benchmarking.md, "FLOPs and MFU", writes the formulas out).

* ``N``: the decoder blocks' linear weights (q, k, v, o, gate, up, down: the parameters the token's GEMMs
  multiply), from the config; embeddings and the head are not in it (the head is one more GEMM per token, small
  against N at these shapes, and left out as the convention is).
* **model FLOPs per token** = ``4 N + 3 A``: the forward's ``2 N`` and the input gradient's ``2 N`` (the base is
  frozen: no weight gradient), and attention, ``A = 2 L S H_q d`` for the forward (``QK^T`` and ``PV``, each
  ``2 x S/2 x H_q x d`` per token and layer, ``S/2`` the average causal context), its backward twice that. LoRA's
  own FLOPs (rank << hidden) are left out.
* **hardware FLOPs per token** = model + the recomputed forwards, ``(2 N + A)`` times the fraction of blocks
  recomputed (1 for HF's and Unsloth's gradient checkpointing; Poros: ``(L - kept) / L``), less the FLOPs of
  the products a Poros recompute leaves out (``skipped_flops`` a timed step, counted as they are skipped:
  ``poros.stream.recompute_tail``).
* **MFU** = model FLOP/s / the dense bf16 rate: the best of several ``8192 x 8192 x 8192`` bf16 matmuls timed at the
  start of the run (``2 x 8192^3`` FLOPs each).
"""

from __future__ import annotations

from typing import Any

import torch

DENSE_SIZE = 8192


def dense_bf16_tflops(device: torch.device, *, size: int = DENSE_SIZE, repeats: int = 20) -> float | None:
    """The device's measured dense bf16 matmul rate in TFLOP/s (best of ``repeats`` timed runs after warm-up);
    None off CUDA."""
    if device.type != "cuda":
        return None
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        torch.matmul(a, b)
    torch.cuda.synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.matmul(a, b)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1000)
    del a, b
    torch.cuda.empty_cache()
    return round(2 * size ** 3 / best / 1e12, 1)


def block_linear_parameters(config: Any) -> int:
    """N: every decoder block's q, k, v, o, gate, up, down weights (``config``: the text config). An MoE block
    counts the MLP width a token goes through: its routed experts' (``num_experts_per_tok``) plus the shared
    expert's; its attention is counted as full attention on every layer (linear-attention layers alike)."""
    hidden = config.hidden_size
    inter = getattr(config, "intermediate_size", None)
    if getattr(config, "moe_intermediate_size", None):
        inter = (config.moe_intermediate_size * config.num_experts_per_tok
                 + (getattr(config, "shared_expert_intermediate_size", None) or 0))
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q = config.num_attention_heads * head_dim
    kv = config.num_key_value_heads * head_dim
    per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * inter
    return per_layer * config.num_hidden_layers


def flops_per_token(config: Any, seq: int, recomputed_fraction: float) -> tuple[float, float]:
    """``(model, hardware)`` FLOPs per trained token at ``seq`` tokens a row (module docstring)."""
    n = block_linear_parameters(config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    attention_forward = 2 * config.num_hidden_layers * seq * config.num_attention_heads * head_dim  # causal: S/2 each
    model = 4 * n + 3 * attention_forward
    return model, model + recomputed_fraction * (2 * n + attention_forward)


def recomputed_fraction(arm: str, summary: dict, layers: int) -> float:
    """The fraction of blocks whose forward ran twice: 1 for checkpointed arms; a Poros arm's kept blocks do not."""
    if "poros" not in arm:
        return 1.0
    kept = summary.get("kept_activation_blocks") or 0
    return max(0.0, (layers - kept) / layers) if layers else 1.0


def add_machine_numbers(arms: dict[str, dict], config: Any, seq: int, dense_tflops: float | None,
                        layers: int | None = None) -> None:
    """Each arm with a median step and tokens per step gains ``model_tflops``, ``hardware_tflops`` and ``mfu``
    (against ``dense_tflops``; None without it)."""
    layers = layers or config.num_hidden_layers
    for name, summary in arms.items():
        step, tokens = summary.get("median_step_s"), summary.get("tokens_per_step")
        if not step or not tokens:
            continue
        depth = summary.get("layers") or layers  # Unsloth at a truncated depth is priced at its own
        shaped = _with_layers(config, depth)
        model, hardware = flops_per_token(shaped, seq, recomputed_fraction(name, summary, depth))
        hardware -= (summary.get("skipped_flops") or 0) / tokens
        summary["model_tflops"] = round(model * tokens / step / 1e12, 1)
        summary["hardware_tflops"] = round(hardware * tokens / step / 1e12, 1)
        summary["mfu"] = round(summary["model_tflops"] / dense_tflops, 4) if dense_tflops else None


class _Shaped:
    def __init__(self, config: Any, layers: int) -> None:
        self._config, self.num_hidden_layers = config, layers

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


def _with_layers(config: Any, layers: int) -> Any:
    return config if layers == config.num_hidden_layers else _Shaped(config, layers)


__all__ = ["DENSE_SIZE", "add_machine_numbers", "block_linear_parameters", "dense_bf16_tflops", "flops_per_token",
           "recomputed_fraction"]
