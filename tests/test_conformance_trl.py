"""Conformance: TRL's SFTTrainer as ``trl/scripts/sft.py`` and PEFT's ``examples/sft/train.py`` use it -- the NF4
base handed over with ``peft_config`` (TRL builds the PEFT model), packing, eval and checkpoint saves, TRL's
defaults for bf16 and gradient checkpointing -- plain and with the one line, compared with ``torch.equal``."""

from __future__ import annotations

import pytest

from conformance_flows import assert_same_files, assert_same_outcome, run_sft
from poros.testing import save_tiny_checkpoint

trl = pytest.importorskip("trl")
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize(("family", "variant", "line"), [("qwen3", "default", "prepare_trainer"),
                                                         ("gemma4", "e2b", "callback")],
                         ids=["qwen3-prepare_trainer", "gemma4-callback"])
def test_sft_trainer_with_peft_config_is_bitwise(family, variant, line, tmp_path):
    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt", family, variant, seed=7)
    plain = run_sft(checkpoint, tmp_path / "plain", None)
    streamed = run_sft(checkpoint, tmp_path / "poros", line)
    assert plain["trainer"].args.bf16 and plain["trainer"].args.gradient_checkpointing
    assert len(plain["loss"]) == 2 and len(plain["eval_loss"]) == 1
    assert_same_outcome(plain, streamed)
    assert_same_files(tmp_path / "plain" / "checkpoint-2", tmp_path / "poros" / "checkpoint-2",
                      ("adapter_model.safetensors", "optimizer.pt"))
