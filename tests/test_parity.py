"""Streamed training is bit-for-bit the resident HF + bitsandbytes + PEFT training. Zero tolerance.

For every family and tiny variant, hypothesis draws a config (layers, widths, heads, KV heads,
head dim, attention implementation, double quantization), a batch (size, length, no/left/right
padding), a LoRA (rank, alpha) and a number of AdamW steps. The reference trains the HF model
as loaded (with or without HF gradient checkpointing); Poros trains the same checkpoint loaded the
same way after ``poros.prepare``. ``torch.equal`` on every loss, LoRA tensor and AdamW state tensor.
"""

from __future__ import annotations

import pathlib
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings

import poros
from poros.testing import TINY_VARIANTS, load_qlora, save_tiny_checkpoint
from poros.testing import assert_bitwise_training as assert_bitwise  # noqa: F401 (other tests import these)
from poros.testing import train_adamw as train
from poros.testing import trainable_parameters as trainable
from poros.testing.strategies import tiny_setups

CASES = [(family, variant) for family, variants in TINY_VARIANTS.items() for variant in variants]


def parity_setups(family: str, variant: str):
    """Layers from the variant's minimum, widths and head dims drawn (where the config takes a head_dim),
    sequences crossing a chunk where the variant computes in chunks."""
    return tiny_setups(family, variant, kv_heads=(1, 2, 4), widths=(8, 16), head_dims=(16, 32), batch=(1, 3),
                       seq=(9, 24), lora_ranks=(1, 4, 8), lora_alphas=(1, 8, 16, 32), double_quant=True,
                       steps=(1, 3), reference_checkpointing=True)


def make_batch(seed: int, batch: int, seq: int, padding: str, vocab: int = 256):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab, (batch, seq), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    if padding != "none" and batch > 1:
        pad = seq // 3
        if padding == "left":
            attention_mask[-1, :pad] = 0
        else:
            attention_mask[-1, -pad:] = 0
        input_ids[attention_mask == 0] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def run_parity(family: str, variant: str, setup: dict, directory: pathlib.Path, **prepare_options) -> poros.PorosModel:
    try:
        path = save_tiny_checkpoint(directory / "ckpt", family, variant, seed=setup["seed"], **setup["config"])
    except ValueError:  # a drawn shape the family cannot have (documented in tiny_config)
        assume(False)
    lora = {"lora_rank": setup["lora_rank"], "lora_alpha": setup["lora_alpha"], "seed": setup["seed"],
            "double_quant": setup["double_quant"]}
    batches = [make_batch(setup["seed"] + s, setup["batch"], setup["seq"], setup["padding"])
               for s in range(setup["steps"])]

    reference = load_qlora(path, **lora)
    if setup["reference_checkpointing"]:
        reference.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref_losses, ref_opt = train(reference, list(trainable(reference).values()), batches)

    streamed_model = load_qlora(path, **lora)
    streamed = poros.prepare(streamed_model, **prepare_options)
    poros_losses, poros_opt = train(streamed, streamed.trainable_parameters(), batches)
    assert_bitwise(reference, streamed_model, ref_losses, poros_losses, ref_opt, poros_opt)
    return streamed


@pytest.mark.parametrize(("family", "variant"), CASES, ids=[f"{f}-{v}" for f, v in CASES])
def test_streamed_training_is_bitwise_resident(family, variant):
    @settings(max_examples=8, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(setup=parity_setups(family, variant))
    def check(setup):
        with tempfile.TemporaryDirectory() as directory:
            run_parity(family, variant, setup, pathlib.Path(directory))

    check()


BASE_SETUP = {"config": {}, "seed": 3, "batch": 2, "seq": 20, "padding": "left", "lora_rank": 4,
              "lora_alpha": 8, "double_quant": True, "steps": 2, "reference_checkpointing": False}


@pytest.mark.parametrize(("family", "variant"), CASES, ids=[f"{f}-{v}" for f, v in CASES])
def test_default_tiny_model_parity(family, variant, tmp_path):
    """The default tiny model of each variant (every special feature on), no hypothesis shrinking."""
    run_parity(family, variant, BASE_SETUP, tmp_path)


def test_evaluation_logits_equal_resident(tmp_path):
    path = save_tiny_checkpoint(tmp_path / "ckpt", "gemma4", "e2b", seed=1)
    batch = make_batch(1, 2, 20, "left")
    reference = load_qlora(path, seed=1)
    streamed = poros.prepare(load_qlora(path, seed=1))
    with torch.no_grad():
        expected = reference(**batch, use_cache=False)
        got = streamed(**batch)
    assert torch.equal(expected.logits, got.logits)
    assert torch.equal(expected.loss, got.loss)
    # no-grad evaluation releases every block
    assert not streamed.store.stats.resident


def test_unpatch_restores_the_resident_model(tmp_path):
    path = save_tiny_checkpoint(tmp_path / "ckpt", "qwen3_5", seed=2)
    batch = make_batch(2, 2, 16, "right")
    reference = load_qlora(path, seed=2)
    model = load_qlora(path, seed=2)
    streamed = poros.prepare(model)
    streamed(**batch).loss.backward()  # use it once, then put everything back
    restored = streamed.unpatch()
    assert restored is model and streamed is model  # prepare streams the model it is given, in place
    assert type(restored) is type(reference) and not isinstance(restored, poros.PorosModel)
    with torch.no_grad():
        assert torch.equal(reference(**batch, use_cache=False).logits, restored(**batch, use_cache=False).logits)


@pytest.mark.parametrize(("family", "variant"), [("qwen3", "default"), ("gemma4", "e2b")])
def test_embedding_tables_on_host_keep_parity(family, variant, tmp_path):
    """Input / per-layer embedding tables looked up on the host: same rows, same training."""
    streamed = run_parity(family, variant, {**BASE_SETUP, "config": {"tie_word_embeddings": False}}, tmp_path,
                          embeddings_on_host=True)
    moved = {id(t.module) for t in streamed.host_tables}
    assert id(streamed.causal_lm.get_input_embeddings()) in moved
    per_layer_table = bool(getattr(streamed.causal_lm.config, "hidden_size_per_layer_input", 0))  # gemma4 e2b
    assert len(moved) == 1 + per_layer_table  # the input table, and the per-layer inputs' table where there is one


def test_host_embedding_rows_arrive_as_a_leaf():
    """A frozen table's rows cross to the device as a leaf: when a hook made the lookup require grad
    (transformers' input-require-grads), its gradient must not travel back to the host copy."""
    from poros.stream.store import HostEmbedding

    table = torch.nn.Embedding(10, 4).requires_grad_(False)
    table.register_forward_hook(lambda module, args, output: output.requires_grad_(True))  # as transformers does
    host = HostEmbedding(table, "meta")  # a device other than the host's, without a GPU
    rows = table(torch.tensor([[1, 2]]))
    assert rows.is_meta and rows.requires_grad and rows.grad_fn is None  # no copy node back to the host
    host.device = torch.device("cpu")
    assert torch.equal(table(torch.tensor([[1, 2]])), table.weight[[1, 2]].unsqueeze(0))  # the same rows
    plain = HostEmbedding(torch.nn.Embedding(10, 4).requires_grad_(False), "meta").module(torch.tensor([1]))
    assert plain.is_meta and not plain.requires_grad


def _hooks(model: torch.nn.Module) -> dict[str, tuple]:
    """Every module's hooks of every kind, by module name (what unpatch must leave as prepare found it)."""
    kinds = ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_backward_pre_hooks",
             "_state_dict_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks",
             "_load_state_dict_post_hooks")
    return {name: tuple(tuple(getattr(module, kind)) for kind in kinds) for name, module in model.named_modules()}


def test_unpatch_leaves_no_poros_hook_and_every_tensor_home(tmp_path):
    """After unpatch nothing of Poros stays on a module: no HostEmbedding pre-hook moving token ids to the
    host (on CUDA the resident model then fails with "index is on cpu" in embed_tokens), no store guard or
    state-dict hook, no instance forward on the trunk; every tensor back where it was."""
    path = save_tiny_checkpoint(tmp_path / "ckpt", "gemma4", "e2b", seed=3, tie_word_embeddings=False)
    model = load_qlora(path, seed=3)
    model.get_base_model().enable_input_require_grads()  # a hook of transformers' own: it must stay
    before = _hooks(model)
    places = {name: (t.device, t.dtype, tuple(t.shape)) for name, t in model.state_dict().items()}
    streamed = poros.prepare(model, embeddings_on_host=True)
    assert len(streamed.host_tables) == 2  # the input and the per-layer tables
    assert _hooks(model) != before  # the check can see Poros' hooks
    streamed(**make_batch(2, 2, 12, "right")).loss.backward()
    trunk = streamed.executor.trunk
    streamed.unpatch()
    assert _hooks(model) == before
    assert "forward" not in vars(trunk)
    assert {name: (t.device, t.dtype, tuple(t.shape)) for name, t in model.state_dict().items()} == places
