"""Long sequences: the attention working set against the masks transformers really hands each layer (every
family, sdpa and eager, padded or not, below and past the sliding window), ``seq_len`` up to the model's
``max_position_embeddings`` (refused above it), and ``poros train --seq-len 4096`` on the bundled model."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from poros import registry
from poros.cli.main import main
from poros.errors import ConfigError
from poros.plan.attention import attention_by_kind, attention_working_set, layer_kinds_of
from poros.testing import TINY_VARIANTS, tiny_model
from poros.tiny import TINY_SLIDING_WINDOW
from poros.training.validation import check_seq_len, longest_sequence
from test_parity import make_batch

CASES = [(family, variant) for family, variants in TINY_VARIANTS.items() for variant in variants]


def masks_per_kind(model, batch) -> dict[str, torch.Tensor | None]:
    """The ``attention_mask`` HF passes to the first decoder layer of each kind (forward pre-hooks with kwargs)."""
    text_config = model.config.get_text_config()
    descriptor = registry.for_config(text_config)
    kinds = getattr(text_config, descriptor.layer_kinds_attr) or [descriptor.layer_kinds[0]] * 99
    seen: dict[str, torch.Tensor | None] = {}
    handles = []
    for layer, kind in zip(model.model.layers, kinds):
        def note(module, args, kwargs, kind=kind):
            seen.setdefault(kind, kwargs.get("attention_mask"))
        handles.append(layer.register_forward_pre_hook(note, with_kwargs=True))
    with torch.no_grad():
        model(**batch, use_cache=False)
    for handle in handles:
        handle.remove()
    return seen


@pytest.mark.parametrize(("family", "variant"), CASES, ids=[f"{f}-{v}" for f, v in CASES])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize(("seq", "padding"), [(TINY_SLIDING_WINDOW - 2, "none"), (3 * TINY_SLIDING_WINDOW, "none"),
                                              (3 * TINY_SLIDING_WINDOW, "left")])
def test_the_attention_working_set_names_the_masks_transformers_builds(family, variant, attn, seq, padding):
    """Where the function says ``flash`` the layer gets no mask (``is_causal``); ``efficient`` / ``math``: a
    ``[rows, 1, seq, seq]`` mask of the bytes it counts; linear attention: no ``seq x seq`` tensor."""
    model = tiny_model(family, variant, attn_implementation=attn).train()
    text_config = model.config.get_text_config()
    descriptor = registry.for_config(text_config)
    batch = make_batch(0, 2, seq, padding)
    seen = masks_per_kind(model, batch)
    kinds = attention_by_kind(descriptor, text_config, seq, 2, padded=padding != "none")
    assert [k.kind for k in kinds] == layer_kinds_of(descriptor, text_config) and set(seen) == {k.kind for k in kinds}
    for kind in kinds:
        mask = seen[kind.kind]
        if kind.kernel in ("flash", "none (linear attention)"):
            assert mask is None or mask.dim() == 2, (kind, None if mask is None else mask.shape)
            assert kind.mask_bytes == 0
        else:
            assert mask is not None and mask.shape[-2:] == (seq, seq), kind
            rows = mask.shape[0] if mask.stride(0) else 1  # an expanded mask holds one row
            assert kind.mask_bytes == rows * seq * seq * mask.element_size(), (kind, mask.shape, mask.stride())
            assert (mask.dtype == torch.bool) == (attn == "sdpa") and kind.kernel == (
                "efficient" if attn == "sdpa" else "math")
    whole = attention_working_set(descriptor, text_config, seq, 2, padded=padding != "none")
    assert whole.bytes == sum(k.mask_bytes for k in kinds) + max(k.transient_bytes for k in kinds)


def test_the_attention_working_set_at_real_shapes_names_each_limit():
    qwen72 = SimpleNamespace(hidden_size=8192, num_attention_heads=64, num_key_value_heads=8, sliding_window=None,
                             layer_types=["full_attention"] * 80, _attn_implementation="sdpa")
    assert attention_working_set(registry.get("qwen2"), qwen72, 32768, 1) == (0, "flash", "full_attention: flash: no "
                                                                              "mask: is_causal, no seq x seq tensor")
    padded = attention_working_set(registry.get("qwen2"), qwen72, 32768, 2, padded=True)
    assert padded.kernel == "efficient" and padded.bytes >= 2 * 32768 ** 2 * 3  # bool mask + its bf16 copy
    gemma4 = SimpleNamespace(hidden_size=5376, num_attention_heads=32, num_key_value_heads=16, head_dim=256,
                             global_head_dim=512, sliding_window=1024, _attn_implementation="sdpa",
                             layer_types=["sliding_attention"] * 5 + ["full_attention"])
    found = attention_working_set(registry.get("gemma4"), gemma4, 32768, 1)
    assert found.kernel == "efficient" and "sliding window" in found.reason and "head_dim 512 > 256" in found.reason
    assert attention_working_set(registry.get("gemma4"), gemma4, 1000, 1).reason.startswith(
        "sliding_attention: flash")  # below the window: no mask
    qwen35 = SimpleNamespace(hidden_size=5120, num_attention_heads=24, num_key_value_heads=4, head_dim=256,
                             layer_types=["linear_attention"] * 3 + ["full_attention"])
    assert attention_working_set(registry.get("qwen3_5"), qwen35, 131072, 1).bytes == 0


def test_seq_len_may_go_up_to_max_position_embeddings_and_no_further(capsys, tmp_path):
    config = SimpleNamespace(max_position_embeddings=32768, rope_parameters={"rope_type": "default"})
    check_seq_len(32768, config)
    with pytest.raises(ConfigError, match="seq_len=32769 is above the model's max_position_embeddings=32768"):
        check_seq_len(32769, config)
    yarn = SimpleNamespace(max_position_embeddings=32768, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})
    assert longest_sequence(yarn) == 131072  # YaRN as the Qwen2.5 cards add it
    status = main(["train", "--dry-run", "--seq-len", "40000", "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert status == 1 and "seq_len=40000 is above" in err and "max_position_embeddings=32768" in err


def test_train_at_seq_len_4096_on_the_bundled_model_runs_on_the_cpu(tmp_path, child_env):
    """4096-token rows (synthetic data fills them) through the tiled MLP and the chunked loss, two steps."""
    output_dir = tmp_path / "adapter"
    done = subprocess.run(
        [sys.executable, "-m", "poros", "train", "--steps", "2", "--seq-len", "4096", "--dataset", "synthetic",
         "--mlp-chunks", "4", "--loss-chunks", "4", "--logging-steps", "1", "--device", "cpu",
         "--output-dir", str(output_dir)],
        capture_output=True, text=True, timeout=600, check=False, env=child_env(POROS_LOAD_PLUGINS="", OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "mlp_chunks=4" in done.stdout and "loss_chunks=4" in done.stdout
    record = json.loads((output_dir / "poros_config.json").read_text())["config"]
    assert (record["seq_len"], record["mlp_chunks"], record["loss_chunks"]) == (4096, 4, 4)
