"""Count what one decoder block's recompute and backward hold, on the CPU: the live tensors' bytes.

    python -m tools.saved_bytes                      # tiny Qwen2 (72B ratios), 4096 tokens, mlp_chunks 8
    python -m tools.saved_bytes --seq 4096 --mlp-chunks 1 --top 20

The CPU has no allocator statistics, so a ``TorchDispatchMode`` follows every tensor storage an op
makes (a weak reference each) and sums those still alive after each op: the peak of that sum over one
block's forward with grad and its backward is what the block's recompute holds on any device (the
same autograd graph; the allocator's caching and fragmentation come on top on CUDA). The block is the
real transformers class with bitsandbytes NF4 linears and PEFT LoRA (fp32 LoRA weights, PEFT's
default), the tiled MLP installed as the engine does (``poros.stream.tiling``). It prints the peak in
bytes per token per hidden unit, what was alive there (largest first) and the footprint's estimate of
one block's recompute working set (``poros.plan.footprint.activation_parts``) for the same shapes.
The block's input, its output gradient and the weights are made outside the count.
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LiveBytes(TorchDispatchMode):
    """The bytes of the storages made under this mode and still alive; their peak and what made it."""

    live: int = 0
    peak: int = 0
    at_peak: list = field(default_factory=list)  # (op, shape, dtype, bytes) alive at the peak
    _storages: dict = field(default_factory=dict)  # data_ptr -> (weak ref, bytes, what)

    def __post_init__(self):
        super().__init__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for key, (ref, nbytes, _) in list(self._storages.items()):
            if torch.UntypedStorage._expired(ref):
                del self._storages[key]
                self.live -= nbytes
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            if storage.data_ptr() in self._storages or not storage.nbytes():
                continue
            what = (func.__name__, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))
            self._storages[storage.data_ptr()] = (storage._weak_ref(), storage.nbytes(), what)
            self.live += storage.nbytes()
        if self.live > self.peak:
            self.peak = self.live
            self.at_peak = [(*what, nbytes) for _, nbytes, what in self._storages.values()]
        return out


def block_live_bytes(hidden: int, intermediate: int, heads: int, kv_heads: int, seq: int,
                     mlp_chunks: int) -> tuple[LiveBytes, object]:
    """The live-bytes count of one tiny Qwen2 block's forward with grad and backward, and its PEFT model."""
    from poros.stream.tiling import tile_mlp
    from poros.testing import load_qlora, save_tiny_checkpoint

    directory = Path(tempfile.mkdtemp(prefix="poros-saved-bytes-"))
    save_tiny_checkpoint(directory, "qwen2", hidden_size=hidden, intermediate_size=intermediate,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, num_hidden_layers=1, vocab_size=64)
    model = load_qlora(directory, lora_rank=16, lora_alpha=32, target_modules=list(TARGETS), double_quant=True,
                       attn_implementation="sdpa")
    if mlp_chunks > 1:
        tile_mlp(model, mlp_chunks)
    inner = model.get_base_model().model
    x = torch.randn(1, seq, hidden, dtype=torch.bfloat16, requires_grad=True)
    positions = torch.arange(seq)[None]
    embeddings = inner.rotary_emb(x, positions)
    grad = torch.randn(1, seq, hidden, dtype=torch.bfloat16)
    count = LiveBytes()
    with count:
        out = inner.layers[0](x, attention_mask=None, position_ids=positions, position_embeddings=embeddings)
        (out[0] if isinstance(out, tuple) else out).backward(grad)
        del out
    return count, model


def estimated_recompute(model, seq: int, mlp_chunks: int) -> int:
    """The footprint's one-block recompute working set for the loaded model at ``seq`` tokens."""
    from poros.plan.footprint import activation_parts, model_shapes

    inner = model.get_base_model()
    shapes, value_bytes, attention = model_shapes(inner, list(inner.model.layers), torch.bfloat16)
    return activation_parts(shapes, batch_size=1, seq_len=seq, value_bytes=value_bytes,
                            attn_implementation=attention, mlp_chunks=mlp_chunks).recompute


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=924)  # 72B's 29568 / 8192 ratio
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=1)  # 72B's 64 : 8
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--mlp-chunks", type=int, default=8)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args(argv)
    count, model = block_live_bytes(args.hidden, args.intermediate, args.heads, args.kv_heads, args.seq,
                                    args.mlp_chunks)
    unit = args.seq * args.hidden
    estimate = estimated_recompute(model, args.seq, args.mlp_chunks)
    print(f"peak live {count.peak} bytes ({count.peak / unit:.2f} per token per hidden unit); "
          f"footprint's recompute estimate {estimate} ({estimate / unit:.2f})")
    for op, shape, dtype, nbytes in sorted(count.at_peak, key=lambda item: -item[-1])[:args.top]:
        print(f"  {nbytes / unit:6.2f}  {op} {list(shape)} {dtype}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
