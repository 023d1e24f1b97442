"""``poros merge`` and ``poros generate`` through the real entry point: train the bundled tiny model,
merge its adapter (the base found from poros_config.json), generate with it."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("bitsandbytes")

from poros.cli.main import main  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A LoRA adapter trained 2 steps by `poros train` on the bundled tiny Qwen3 (CPU)."""
    output = tmp_path_factory.mktemp("run") / "adapter"
    assert main(["train", "--steps", "2", "--seq-len", "32", "--output-dir", str(output), "--device", "cpu"]) == 0
    return output


def test_merge_cli_writes_a_checkpoint_transformers_loads(trained, tmp_path, capsys):
    import peft
    import transformers

    from poros.loading.load import read_adapter

    capsys.readouterr()
    merged = tmp_path / "merged"
    assert main(["merge", "--adapter", str(trained), "--output", str(merged), "--json"]) == 0
    out, err = capsys.readouterr()
    result = json.loads(out)
    assert result["merged_modules"] > 0 and "poros merge: shard 1/" in err
    base = read_adapter(trained).base_model
    from poros.loading.load import resolve_checkpoint

    reference = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(resolve_checkpoint(base), dtype=torch.bfloat16), trained,
    ).merge_and_unload().state_dict()
    model = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.bfloat16)
    assert all(torch.equal(tensor, reference[name]) for name, tensor in model.state_dict().items())
    assert main(["merge", "--adapter", str(trained), "--output", str(merged)]) == 1  # exists
    assert "--overwrite" in capsys.readouterr().err


def test_generate_cli_prints_text_and_tokens_per_second(trained, capsys):
    capsys.readouterr()
    status = main(["generate", "--adapter", str(trained), "--prompt", "Hello", "--max-new-tokens", "5",
                   "--device", "cpu"])
    out, err = capsys.readouterr()
    assert status == 0
    assert "tokens/s" in err and "new tokens after a" in err


def test_generate_cli_without_an_adapter_exits_1(tmp_path, capsys):
    assert main(["generate", "--adapter", str(tmp_path), "--prompt", "x"]) == 1
    assert "adapter_config.json" in capsys.readouterr().err


def test_trainer_generate_uses_the_adapter_as_trained(tmp_path):
    """PorosTrainer.generate after training gives the text that the saved adapter gives when loaded again."""
    from poros import PorosTrainer
    from poros.export.generate import generate_text
    from poros.dropin.with_adapter import load_with_adapter

    trainer = PorosTrainer.from_pretrained("poros-tiny-qwen3", device="cpu", lr=1e-2, output_dir=str(tmp_path / "run"))
    trainer.train(steps=2, seq_len=32)
    text = trainer.generate("Hello", max_new_tokens=6)
    assert trainer.model.training  # back in training mode for the next steps
    trainer.save(tmp_path / "adapter")
    model, tokenizer = load_with_adapter(tmp_path / "adapter", device="cpu")
    assert generate_text(model, tokenizer, "Hello", max_new_tokens=6).text == text
