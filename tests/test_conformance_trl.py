"""Conformance: TRL's SFTTrainer as ``trl/scripts/sft.py`` and PEFT's ``examples/sft/train.py`` use it -- the NF4
base handed over with ``peft_config`` (TRL builds the PEFT model), packing, eval and checkpoint saves, TRL's
defaults for gradient checkpointing -- plain and with the one line, compared with ``torch.equal``. The one line
runs each gradient-accumulation window layer-major (``poros.dropin.trainer_window``); TRL's own
``compute_loss`` computes every loss and its metrics (entropy, mean token accuracy, tokens)."""

from __future__ import annotations

import pytest

from conformance_flows import FAMILY_VARIANTS, assert_same_files, assert_same_outcome, assert_same_trainer_state, run_sft
from poros import registry
from poros.testing import save_tiny_checkpoint

trl = pytest.importorskip("trl")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: every family with bf16 on and off, each line (after construction, the callback) in turn
CASES = [(family, variant, bf16, "prepare_trainer" if (i + bf16) % 2 == 0 else "callback")
         for i, (family, variant) in enumerate(FAMILY_VARIANTS) for bf16 in (True, False)]


@pytest.mark.parametrize(("family", "variant", "bf16", "line"), CASES,
                         ids=[f"{f}-{'bf16' if b else 'fp32'}-{line}" for f, _, b, line in CASES])
def test_sft_trainer_with_peft_config_is_bitwise(family, variant, bf16, line, tmp_path):
    """One epoch of 6 packed micro-batches with ``gradient_accumulation_steps=4``: a window of 4 and the
    epoch's end mid-window (a window of 2), eval and a save after each step."""
    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt", family, variant, seed=7)
    flow = dict(bf16=bf16, gradient_accumulation_steps=4, max_steps=-1, num_train_epochs=1, eval_steps=1,
                save_steps=1)
    if registry.get(family).packing_unsupported:  # qwen3_5: linear-attention layers keep packed sequences
        flow["packing"] = False  # apart only with causal_conv1d (TRL refuses without it): padded rows, one per text
    plain = run_sft(checkpoint, tmp_path / "plain", None, **flow)
    streamed = run_sft(checkpoint, tmp_path / "poros", line, **flow)
    assert plain["trainer"].args.bf16 == bf16 and plain["trainer"].args.gradient_checkpointing
    assert len(plain["loss"]) == 2 and len(plain["eval_loss"]) == 2
    assert {"entropy", "mean_token_accuracy", "num_tokens"} <= set(plain["logs"][0])
    assert_same_outcome(plain, streamed)  # TRL's metrics too: the whole log history but its timings
    assert streamed["trainer"]._poros_window.windows_run == 2
    for step in ("checkpoint-1", "checkpoint-2"):
        assert_same_files(tmp_path / "plain" / step, tmp_path / "poros" / step,
                          ("adapter_model.safetensors", "optimizer.pt", "scheduler.pt"))
        assert_same_trainer_state(tmp_path / "plain" / step, tmp_path / "poros" / step)
