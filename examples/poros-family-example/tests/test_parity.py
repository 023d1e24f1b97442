"""The plugin's own parity test: a tiny Llama built through ``poros.testing`` (from the
``TINY_VARIANTS`` this package declares), trained resident and streamed by Poros, must give the
same bits -- every loss, every LoRA tensor, every AdamW state tensor (``torch.equal``).

Run it with the plugin importable (``pip install -e .`` or ``PYTHONPATH=.``): ``python -m pytest tests``.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

import poros  # noqa: E402
import poros_family_example  # noqa: E402
from poros.testing import (  # noqa: E402
    assert_bitwise_training,
    assert_descriptor_matches,
    load_qlora,
    registered_plugin,
    save_tiny_checkpoint,
    tiny_model,
    train_adamw,
    trainable_parameters,
)


@pytest.fixture
def llama():
    with registered_plugin(poros_family_example, name="poros-family-example-test"):
        yield "llama"


def _batches(steps: int, batch: int = 2, seq: int = 12, vocab: int = 256):
    generator = torch.Generator().manual_seed(7)
    out = []
    for _ in range(steps):
        ids = torch.randint(3, vocab, (batch, seq), generator=generator)
        mask = torch.ones_like(ids)
        mask[-1, : seq // 3] = 0  # left padding on the last row
        ids[mask == 0] = 0
        out.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return out


def test_the_tiny_model_meets_the_descriptor(llama):
    assert_descriptor_matches(poros_family_example.DESCRIPTOR, tiny_model(llama))


def test_streamed_training_is_bitwise_resident(llama, tmp_path):
    path = save_tiny_checkpoint(tmp_path / "tiny-llama", llama, seed=3)
    batches = _batches(steps=2)
    reference = load_qlora(path, lora_rank=4, lora_alpha=8, seed=3, double_quant=True)
    ref_losses, ref_opt = train_adamw(reference, list(trainable_parameters(reference).values()), batches)

    model = load_qlora(path, lora_rank=4, lora_alpha=8, seed=3, double_quant=True)
    streamed = poros.prepare(model)
    assert streamed.detection.family == "llama"
    losses, opt = train_adamw(streamed, streamed.trainable_parameters(), batches)
    assert len(losses) == 2
    assert_bitwise_training(reference, model, ref_losses, losses, ref_opt, opt)
