"""mlp_chunks: the tiled MLP is bitwise a resident run with the same tiling, every family, micro-major and
layer-major (sliding windows and Qwen3.5's linear attention at sequences past the window / the delta rule's
chunk), with LoRA dropout; and it really changes the kernels' shapes (the untiled run differs)."""

from __future__ import annotations

import pathlib
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings

import poros
from poros import registry
from poros.config import PorosConfig
from poros.errors import ConfigError
from poros.stream.options import StreamOptions
from poros.stream.tiling import mlp_modules, per_token_modules, tile_mlp
from poros.testing import TINY_VARIANTS, load_qlora, save_tiny_checkpoint
from poros.testing.strategies import longest_seq, tiny_setups
from poros.tiny import TINY_SLIDING_WINDOW
from test_chunked_loss import in_graph
from test_host_optimizer import FAMILIES, assert_same, run_steps, steps_of
from test_layer_major import layer_major_steps, resident_steps, with_item_counts
from test_parity import assert_bitwise, make_batch, train, trainable

CASES = [(family, variant) for family, variants in TINY_VARIANTS.items() for variant in variants]


def computed_tiled(loss: torch.Tensor) -> bool:
    """True when the tiled MLP's autograd node is in ``loss``'s graph (the MLP really went through it)."""
    return in_graph(loss, "_TiledMlpFunctionBackward")


def tiled_setups(family: str, variant: str):
    """Sequences past the sliding window (Gemma, Qwen2/3 sliding), and past the first chunk where the
    variant computes in chunks (the delta rule's), 2 to 5 MLP chunks."""
    return tiny_setups(family, variant, max_layers=3, widths=(16,), head_dims=(16,),
                       seq=(TINY_SLIDING_WINDOW + 2, 3 * TINY_SLIDING_WINDOW), past_chunk=16, mlp_chunks=(2, 5),
                       reference_checkpointing=True)


def run_tiled_parity(family: str, variant: str, setup: dict, directory: pathlib.Path) -> None:
    try:
        path = save_tiny_checkpoint(directory / "ckpt", family, variant, seed=setup["seed"], **setup["config"])
    except ValueError:  # a drawn shape the family cannot have (documented in tiny_config)
        assume(False)
    batches = [make_batch(setup["seed"] + s, setup["batch"], setup["seq"], setup["padding"])
               for s in range(setup["steps"])]
    reference = load_qlora(path, seed=setup["seed"])
    tile_mlp(reference, setup["mlp_chunks"])
    assert computed_tiled(reference(**batches[0], use_cache=False).loss)  # resident: the node is in the graph
    reference.zero_grad(set_to_none=True)
    if setup["reference_checkpointing"]:
        reference.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref_losses, ref_opt = train(reference, list(trainable(reference).values()), batches)

    model = load_qlora(path, seed=setup["seed"])
    streamed = poros.prepare(model, mlp_chunks=setup["mlp_chunks"])
    assert streamed._tiled_mlp.modules  # streamed: the node is in each block's recompute, not the forward graph
    losses, opt = train(streamed, streamed.trainable_parameters(), batches)
    assert_bitwise(reference, model, ref_losses, losses, ref_opt, opt)


@pytest.mark.parametrize(("family", "variant"), CASES, ids=[f"{f}-{v}" for f, v in CASES])
def test_streamed_tiled_mlp_is_bitwise_a_resident_run_with_the_same_tiling(family, variant):
    @settings(max_examples=3, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(setup=tiled_setups(family, variant))
    def check(setup):
        with tempfile.TemporaryDirectory() as directory:
            run_tiled_parity(family, variant, setup, pathlib.Path(directory))

    check()


@pytest.mark.parametrize(("family", "variant"), FAMILIES, ids=[f"{f}-{v}" for f, v in FAMILIES])
def test_layer_major_with_tiled_mlp_is_bitwise_resident_accumulation(family, variant, tmp_path):
    """``forward_backward`` over 3 micro-batches per step, with clipping-free AdamW, tiled on both sides."""
    path = save_tiny_checkpoint(tmp_path / "ckpt", family, variant, seed=7)
    seq = longest_seq(family, variant, 2 * TINY_SLIDING_WINDOW + 3)
    steps = [with_item_counts([make_batch(7 + 10 * s + m, 2, seq, "left") for m in range(3)]) for s in range(2)]
    reference = load_qlora(path, seed=7)
    tile_mlp(reference, 4)
    ref_losses, ref_opt = resident_steps(reference, steps)
    model = load_qlora(path, seed=7)
    streamed = poros.prepare(model, mlp_chunks=4)
    losses, opt = layer_major_steps(streamed, steps)
    assert_bitwise(reference, model, ref_losses, losses, ref_opt, opt)


def test_lora_dropout_draws_the_same_masks_in_the_tiled_recompute(tmp_path):
    """LoRA dropout inside the MLP: the tiled node replays its forward's RNG state in backward, so the
    streamed run (forward, block recompute, tiled backward) draws what the resident run draws."""
    path = save_tiny_checkpoint(tmp_path / "ckpt", "qwen3", seed=3)

    def with_dropout(model):
        for module in model.modules():
            if hasattr(module, "lora_dropout"):
                module.lora_dropout["default"] = torch.nn.Dropout(0.25)
        return model

    micro_batches = steps_of(3)
    reference = with_dropout(load_qlora(path, seed=3))
    tile_mlp(reference, 3)
    ref_params = list(trainable(reference).values())
    ref_opt = torch.optim.AdamW(ref_params, lr=1e-2)
    torch.manual_seed(11)
    ref_losses = run_steps(reference, ref_opt, ref_params, micro_batches)
    streamed = poros.prepare(with_dropout(load_qlora(path, seed=3)), mlp_chunks=3)
    parameters = streamed.trainable_parameters()
    opt = torch.optim.AdamW(parameters, lr=1e-2)
    torch.manual_seed(11)
    losses = run_steps(streamed, opt, parameters, micro_batches)
    assert_same(reference, ref_opt, streamed, opt, ref_losses, losses)


def test_tiling_changes_the_gradients_and_remove_gives_the_untiled_run_back(tmp_path):
    """The negative control: the tiled node sums each weight gradient over the chunks, so after a step
    the LoRA tensors are not the untiled run's; ``remove`` (and ``unpatch``) give the MLP's own forward back."""
    path = save_tiny_checkpoint(tmp_path / "ckpt", "qwen3", seed=5)
    batches = [make_batch(5 + s, 2, 20, "none") for s in range(2)]
    untiled = load_qlora(path, seed=5)
    untiled_losses, _ = train(untiled, list(trainable(untiled).values()), batches)

    tiled = load_qlora(path, seed=5)
    handle = tile_mlp(tiled, 4)
    assert computed_tiled(tiled(**batches[0], use_cache=False).loss)
    train(tiled, list(trainable(tiled).values()), batches)
    differing = [name for name, p in trainable(tiled).items() if not torch.equal(p, trainable(untiled)[name])]
    assert any(".mlp." in name for name in differing), "tiling left every MLP adapter bitwise the untiled one"

    again = load_qlora(path, seed=5)
    handle = tile_mlp(again, 4)
    handle.remove()
    assert all("forward" not in vars(m) for m in mlp_modules(again.get_base_model(), registry.get("qwen3")))
    losses, _ = train(again, list(trainable(again).values()), batches)
    assert all(torch.equal(a, b) for a, b in zip(losses, untiled_losses))
    assert all(torch.equal(p, trainable(untiled)[name]) for name, p in trainable(again).items())

    streamed = poros.prepare(load_qlora(path, seed=5), mlp_chunks=2)
    assert streamed._tiled_mlp is not None and streamed.stream_options.mlp_chunks == 2
    restored = streamed.unpatch()
    assert all("forward" not in vars(m) for m in mlp_modules(restored.get_base_model(), registry.get("qwen3")))


def test_one_chunk_installs_nothing_and_bad_values_are_refused(tmp_path):
    model = load_qlora(save_tiny_checkpoint(tmp_path / "ckpt", "qwen3", seed=2), seed=2)
    handle = tile_mlp(model, 1)
    assert handle.modules == [] and all("forward" not in vars(m) for m in mlp_modules(
        model.get_base_model(), registry.get("qwen3")))
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ConfigError, match="mlp_chunks="):
            tile_mlp(model, bad)
    with pytest.raises(ConfigError, match="mlp_chunks=0"):
        StreamOptions(mlp_chunks=0)
    with pytest.raises(ConfigError, match="mlp_chunks"):
        PorosConfig(mlp_chunks=0)
    assert StreamOptions.from_config(PorosConfig(mlp_chunks=8)).mlp_chunks == 8


def test_the_descriptor_names_what_mlp_chunks_leaves_whole():
    """Gemma 4's MoE experts route all tokens of a block together: named, not tiled; dense families: nothing."""
    from types import SimpleNamespace

    gemma4 = registry.get("gemma4")
    assert "MoE experts" in gemma4.mlp_untiled_reason(SimpleNamespace(enable_moe_block=True))
    assert gemma4.mlp_untiled_reason(SimpleNamespace(enable_moe_block=False)) is None
    assert all(registry.get(name).mlp == "mlp" for name in TINY_VARIANTS)
    assert registry.get("qwen2").mlp_untiled_reason(SimpleNamespace()) is None


@pytest.mark.parametrize(("family", "variant"), CASES, ids=[f"{f}-{v}" for f, v in CASES])
def test_the_norms_and_projections_are_tiled_with_the_mlp(family, variant, tmp_path):
    """Issue 32: ``mlp_chunks`` tiles each block's norms and attention (or linear-attention) projections too,
    each in a node that saves only its compute-dtype input: the nodes are in the loss's graph, every layer
    has its norms and its attention projections tiled (Qwen3.5's linear layers their DeltaNet projections,
    Gemma's four norms), and ``remove`` gives every module its own forward back."""
    path = save_tiny_checkpoint(tmp_path / "ckpt", family, variant=variant, seed=3)
    model = load_qlora(path, seed=3)
    descriptor = registry.for_config(model.get_base_model().config)
    layers = list(model.get_base_model().model.layers)
    handle = tile_mlp(model, 2)
    tiled = per_token_modules(model.get_base_model(), descriptor)
    assert set(map(id, tiled)) <= set(map(id, handle.modules))
    for layer in layers:
        names = {name for name, module in layer.named_modules() if "forward" in vars(module)}
        assert {"input_layernorm", "post_attention_layernorm"} <= names, names
        assert {"self_attn.o_proj"} <= names or {"linear_attn.in_proj_qkv", "linear_attn.out_proj"} <= names, names
        if family.startswith("gemma"):
            assert {"pre_feedforward_layernorm", "post_feedforward_layernorm"} <= names
    batch = make_batch(3, 1, 24, "none")
    loss = model(**batch, use_cache=False).loss
    backward_nodes = []
    stack, seen = [loss.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        backward_nodes.append(type(node).__name__)
        stack.extend(next_node for next_node, _ in node.next_functions)
    # one node per tiled module call (q, k, v share their input, each its own node)
    assert backward_nodes.count("_TiledMlpFunctionBackward") >= len(layers) * 3
    handle.remove()
    assert all("forward" not in vars(m) for m in tiled)
