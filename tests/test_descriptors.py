"""Every registered descriptor against the real transformers models it describes.

Parametrized over ``poros.registry.architectures()`` (``ids=name``) and every tiny variant of
``poros.testing.TINY_VARIANTS``, so a family is tested the moment it registers. The negative tests
show that the contract check catches a wrong path, a missing target and an unlisted linear.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

from hypothesis import given, settings, strategies as st  # noqa: E402

from poros import registry  # noqa: E402
from poros.descriptor import CarriedState, derive  # noqa: E402
from poros.testing import (  # noqa: E402
    TINY_SLIDING_WINDOW,
    TINY_VARIANTS,
    assert_descriptor_matches,
    check_descriptor,
    qlora_model,
    save_tiny_checkpoint,
    tiny_config,
    tiny_model,
)
from poros.testing.strategies import tiny_variant  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DESCRIPTORS = [r.descriptor for r in registry.architectures()]
FAMILY_VARIANTS = [(d, v) for d in DESCRIPTORS for v in TINY_VARIANTS.get(d.name, ())]
SEQUENCE_LENGTH = 2 * TINY_SLIDING_WINDOW  # longer than every sliding window




def _variant_id(case) -> str:
    descriptor, variant = case
    return f"{descriptor.name}-{variant}"


def _token_ids(vocab_size: int = 256, batch: int = 2, length: int = SEQUENCE_LENGTH):
    generator = torch.Generator().manual_seed(1234)
    return torch.randint(3, vocab_size, (batch, length), generator=generator)


@pytest.mark.parametrize("descriptor", DESCRIPTORS, ids=lambda d: d.name)
def test_every_registered_family_has_tiny_variants(descriptor):
    assert TINY_VARIANTS.get(descriptor.name), (
        f"family {descriptor.name!r} is registered but poros.testing.TINY_VARIANTS has no tiny model for it; "
        "add its tiny config to poros/testing/__init__.py so the descriptor contract runs against it"
    )


@pytest.mark.parametrize("descriptor", DESCRIPTORS, ids=lambda d: d.name)
def test_tiny_variants_cover_every_kind_and_optional_feature(descriptor):
    configs = [tiny_config(descriptor.name, v) for v in TINY_VARIANTS.get(descriptor.name, ())]
    used = {kind for c in configs for kind in getattr(c, descriptor.layer_kinds_attr)}
    named = {*descriptor.layer_kinds, *(k for k, _ in descriptor.mask_kinds),
             *(k for k, _ in descriptor.rotary_kinds if k != "*")}
    assert named <= used, f"layer kinds {sorted(named - used)} appear in no tiny variant of {descriptor.name}"
    for attribute, _ in descriptor.optional_features:
        assert any(getattr(c, attribute, None) for c in configs), (
            f"optional feature {attribute!r} is on in no tiny variant, so its names are never checked"
        )


@pytest.mark.parametrize("case", FAMILY_VARIANTS, ids=_variant_id)
def test_descriptor_matches_tiny_model_and_its_checkpoint_round_trips(case, tmp_path):
    descriptor, variant = case
    model = tiny_model(descriptor.name, variant)
    assert_descriptor_matches(descriptor, model)
    assert registry.for_config(model.config) == descriptor
    path = save_tiny_checkpoint(tmp_path / "checkpoint", descriptor.name, variant, max_shard_size="100KB")
    assert len(list(path.glob("*.safetensors"))) > 1 and (path / "model.safetensors.index.json").exists()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    saved, reloaded = model.state_dict(), loaded.state_dict()
    assert saved.keys() == reloaded.keys()
    assert all(torch.equal(tensor, reloaded[key]) for key, tensor in saved.items())  # layer_scalar included


@pytest.mark.parametrize("case", FAMILY_VARIANTS, ids=_variant_id)
def test_descriptor_matches_qlora_model_and_it_trains(case, tmp_path):
    descriptor, variant = case
    import bitsandbytes as bnb

    model = qlora_model(descriptor.name, variant, tmp_path=tmp_path)
    assert_descriptor_matches(descriptor, model)
    assert model.training
    wrapped = [m for m in model.modules() if hasattr(m, "lora_A")]
    assert wrapped and all(type(m.base_layer) is bnb.nn.Linear4bit for m in wrapped)
    assert {m.base_layer.weight.quant_type for m in wrapped} == {"nf4"}
    ids = _token_ids()
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    assert torch.isfinite(loss)
    loss.backward()
    lora = {name: p for name, p in model.named_parameters() if p.requires_grad}
    assert lora and all(".lora_" in name for name in lora)
    without_grad = sorted(name for name, p in lora.items() if p.grad is None or not torch.any(p.grad != 0))
    assert not without_grad, f"LoRA tensors with no gradient: {without_grad}"


def test_load_qlora_options_reach_bitsandbytes_and_peft(tmp_path):
    model = qlora_model("qwen3", tmp_path=tmp_path, use_dora=True, use_rslora=True, double_quant=True,
                        quant_type="fp4", attn_implementation="eager", target_modules=["q_proj", "down_proj"])
    base = model.get_base_model()
    assert base.config._attn_implementation == "eager"
    lora_config = model.peft_config["default"]
    assert lora_config.use_dora and lora_config.use_rslora and set(lora_config.target_modules) == {"q_proj", "down_proj"}
    weight = base.model.layers[0].self_attn.q_proj.base_layer.weight
    assert weight.quant_type == "fp4" and weight.quant_state.nested
    ids = _token_ids()
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    assert torch.isfinite(loss) and base.model.layers[0].mlp.down_proj.lora_magnitude_vector["default"].weight.grad.any()


def test_qlora_all_linear_follows_the_descriptor(tmp_path):
    import bitsandbytes as bnb

    moe = qlora_model("gemma4", "moe", tmp_path=tmp_path).get_base_model()
    router_proj = moe.model.layers[0].router.proj
    assert type(router_proj) is bnb.nn.Linear4bit, "router proj must not get LoRA (descriptor lora_excluded)"
    assert isinstance(moe.model.layers[0].experts.gate_up_proj, torch.nn.Parameter)
    assert moe.model.layers[0].experts.gate_up_proj.dtype == torch.bfloat16  # experts are not quantized
    e2b = qlora_model("gemma4", "e2b", tmp_path=tmp_path).get_base_model()
    assert hasattr(e2b.model.per_layer_model_projection, "lora_A"), "model-level linear gets LoRA"
    assert not hasattr(e2b.lm_head, "lora_A")


def test_load_qlora_is_deterministic_and_lora_init_is_honoured(tmp_path):
    first = qlora_model("qwen2", tmp_path=tmp_path / "a", seed=3)
    second = qlora_model("qwen2", tmp_path=tmp_path / "b", seed=3)
    other = qlora_model("qwen2", tmp_path=tmp_path / "c", seed=4)
    lora = {n: p for n, p in first.named_parameters() if p.requires_grad}
    again = dict(second.named_parameters())
    assert all(torch.equal(p, again[n]) for n, p in lora.items())
    assert any(not torch.equal(p, dict(other.named_parameters())[n]) for n, p in lora.items())
    assert all(torch.any(p != 0) for n, p in lora.items() if ".lora_B." in n)
    zero_b = qlora_model("qwen2", tmp_path=tmp_path / "d", lora_init="default")
    assert all(not torch.any(p != 0) for n, p in zero_b.named_parameters() if ".lora_B." in n)


# -- the tiny models really have the features they exist for ---------------------------------------

def test_gemma4_e2b_shares_kv_and_has_per_layer_inputs():
    model = tiny_model("gemma4", "e2b")
    config = model.config
    modes = config.kv_sharing_modes
    assert config.num_kv_shared_layers > 0 and "reuse" in modes and "store" in modes
    layers = model.model.layers
    for layer, mode in zip(layers, modes):
        assert layer.self_attn.is_kv_shared_layer == (mode == "reuse")
        assert hasattr(layer.self_attn, "k_proj") == (mode != "reuse")
        assert layer.mlp.gate_proj.out_features == config.intermediate_size * (2 if mode == "reuse" else 1)
        assert layer.per_layer_input_gate.out_features == config.hidden_size_per_layer_input
    reused_kinds = {kind for kind, mode in zip(config.layer_types, modes) if mode == "reuse"}
    assert reused_kinds == {"sliding_attention", "full_attention"}
    assert model.model.embed_tokens_per_layer.weight.shape[1] == config.num_hidden_layers * config.hidden_size_per_layer_input
    # global_head_dim is not kept on the config: it becomes per_layer_config[i].head_dim of full layers
    head_dims = {kind: {layers[i].self_attn.head_dim for i, k in enumerate(config.layer_types) if k == kind}
                 for kind in ("sliding_attention", "full_attention")}
    assert head_dims == {"sliding_attention": {16}, "full_attention": {32}}
    assert {float(layer.layer_scalar) for layer in layers} != {1.0}


def test_gemma4_moe_has_experts_and_k_eq_v():
    model = tiny_model("gemma4", "moe")
    config = model.config
    assert config.enable_moe_block and config.attention_k_eq_v and not config.hidden_size_per_layer_input
    for layer, kind in zip(model.model.layers, config.layer_types):
        assert layer.experts.gate_up_proj.shape[0] == config.num_experts == 4
        assert layer.router.proj.out_features == 4 and config.top_k_experts == 2
        assert (layer.self_attn.v_proj is None) == (kind == "full_attention")
    assert not hasattr(model.model, "embed_tokens_per_layer")


def test_qwen3_5_has_both_layer_kinds():
    model = tiny_model("qwen3_5")
    kinds = model.config.layer_types
    assert set(kinds) == {"linear_attention", "full_attention"}
    for layer, kind in zip(model.model.layers, kinds):
        assert hasattr(layer, "linear_attn") == (kind == "linear_attention")
        assert hasattr(layer, "self_attn") == (kind == "full_attention")
    assert tiny_config("qwen3_5", num_layers=2).layer_types == ["linear_attention", "full_attention"]


def test_gemma3_has_both_kinds_and_softcaps():
    model = tiny_model("gemma3")
    config = model.config
    assert set(config.layer_types) == {"sliding_attention", "full_attention"}
    assert tiny_config("gemma3", num_layers=2).layer_types == ["sliding_attention", "full_attention"]
    assert config.final_logit_softcapping == 30.0
    assert config.query_pre_attn_scalar != config.head_dim
    model.train()
    logits = model(input_ids=_token_ids(), use_cache=False).logits
    assert logits.abs().max() <= 30.0


def test_qwen2_sliding_variant_slides():
    model = tiny_model("qwen2", "sliding")
    kinds = model.config.layer_types
    assert "sliding_attention" in kinds and "full_attention" in kinds
    for layer, kind in zip(model.model.layers, kinds):
        expected = TINY_SLIDING_WINDOW if kind == "sliding_attention" else None
        assert layer.self_attn.sliding_window == expected
    assert set(tiny_config("qwen2").layer_types) == {"full_attention"}


@pytest.mark.parametrize("family, variant", [("qwen2", "sliding"), ("gemma3", "default"), ("gemma4", "e2b")])
def test_sliding_window_is_shorter_than_test_sequences(family, variant):
    """Same weights, window 8 vs a window longer than the sequence: the logits must differ."""
    ids = _token_ids()
    logits = {}
    for window in (TINY_SLIDING_WINDOW, 4 * SEQUENCE_LENGTH):
        model = tiny_model(family, variant, sliding_window=window)
        with torch.no_grad():
            logits[window] = model(input_ids=ids, use_cache=False).logits
    assert not torch.equal(*logits.values())


@pytest.mark.parametrize("family", sorted(TINY_VARIANTS))
def test_tiny_model_keeps_fp32_rotary_and_is_seeded(family):
    model = tiny_model(family)
    rotary = {name: b for name, b in model.named_buffers() if name.endswith("inv_freq")}
    assert rotary and all(b.dtype == torch.float32 for b in rotary.values())
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    same, other = tiny_model(family).state_dict(), tiny_model(family, seed=1).state_dict()
    assert all(torch.equal(t, same[k]) for k, t in model.state_dict().items())
    assert any(not torch.equal(t, other[k]) for k, t in model.state_dict().items())


def test_tiny_config_sets_attention_implementation():
    for implementation in ("sdpa", "eager"):
        config = tiny_config("gemma4", "moe", attn_implementation=implementation)
        assert config._attn_implementation == implementation
        assert tiny_model("qwen3", config=tiny_config("qwen3", attn_implementation=implementation)).config._attn_implementation == implementation


@pytest.mark.parametrize("kwargs, rule", [
    (dict(num_heads=4, num_kv_heads=3), "must divide"),
    (dict(head_dim=7), "even"),
    (dict(num_layers=0), "num_layers"),
    (dict(hidden_size=60, num_heads=8), "multiple of num_heads"),
    (dict(vocab_size=4), "vocab_size"),
])
def test_tiny_config_rejects_impossible_shapes(kwargs, rule):
    with pytest.raises(ValueError, match=rule):
        tiny_config("qwen3", **kwargs)


def test_tiny_config_rejects_what_a_family_cannot_express():
    with pytest.raises(ValueError, match="multiple of 8"):
        tiny_config("qwen3_5", head_dim=12)
    with pytest.raises(ValueError, match="no separate head_dim"):
        tiny_config("qwen2", head_dim=32)
    with pytest.raises(ValueError, match="no tiny variant"):
        tiny_config("qwen3_5", "moe")
    with pytest.raises(ValueError, match="no tiny config"):
        tiny_config("llama")


@st.composite
def tiny_shapes(draw):
    """Mostly consistent head counts (KV heads dividing heads), sometimes not."""
    num_heads = draw(st.integers(1, 6))
    divisors = [d for d in range(1, num_heads + 1) if num_heads % d == 0]
    num_kv_heads = draw(st.sampled_from(divisors) | st.integers(1, 6))
    return dict(num_layers=draw(st.integers(1, 5)), num_heads=num_heads, num_kv_heads=num_kv_heads,
                head_dim=draw(st.sampled_from([4, 6, 8, 16, 24])))


@settings(max_examples=20, deadline=None)
@given(case=st.sampled_from([(f, v) for f, vs in TINY_VARIANTS.items() for v in vs]), drawn=tiny_shapes())
def test_drawn_tiny_shapes_build_or_raise_value_error(case, drawn):
    """Any drawn shape either raises ValueError or builds a model that meets its descriptor and runs."""
    family, variant = case
    num_layers, num_heads, head_dim = drawn["num_layers"], drawn["num_heads"], drawn["head_dim"]
    if tiny_variant(family, variant).head_dim_from_hidden:  # qwen2: head_dim is hidden_size // num_heads
        shape = dict(drawn, head_dim=None, hidden_size=num_heads * head_dim)
    else:
        shape = dict(drawn, hidden_size=16 * num_heads)
    try:
        config = tiny_config(family, variant, **shape)
    except ValueError:
        return
    model = tiny_model(family, variant, config=config)
    problems = check_descriptor(registry.get(family), model)
    if num_layers >= 2:  # every layer kind is present, so every name of the descriptor is
        assert not problems
    else:  # a single layer may lack the names of the other kind, nothing else
        assert all("has no " in p and "layers: check a config with every layer kind" in p for p in problems)
    with torch.no_grad():
        logits = model(input_ids=_token_ids(length=5), use_cache=False).logits
    assert logits.shape == (2, 5, 256) and torch.isfinite(logits).all()
    if num_layers >= 2:  # every kind of the variant is represented, as in its default shape
        assert set(config.layer_types) == set(tiny_config(family, variant).layer_types)


# -- the contract check catches what is wrong --------------------------------------------------------

@pytest.fixture(scope="module")
def qwen2_model():
    return tiny_model("qwen2")


def test_wrong_path_is_reported(qwen2_model):
    descriptor = derive(registry.get("qwen2"), final_norm="model.final_norm")
    problems = check_descriptor(descriptor, qwen2_model)
    assert any(p.startswith("final_norm:") and "'final_norm'" in p for p in problems), problems
    with pytest.raises(AssertionError, match="final_norm"):
        assert_descriptor_matches(descriptor, qwen2_model)


def test_missing_target_is_reported(qwen2_model):
    base = registry.get("qwen2")
    descriptor = derive(base, lora_targets_all_linear=(*base.lora_targets_all_linear, "w_proj"))
    [problem] = check_descriptor(descriptor, qwen2_model)
    assert problem.startswith("lora_targets_all_linear entry 'w_proj' is not an nn.Linear in any decoder layer")


def test_unlisted_linear_is_reported_by_full_name(qwen2_model):
    base = registry.get("qwen2")
    descriptor = derive(base, lora_targets_all_linear=tuple(n for n in base.lora_targets_all_linear if n != "down_proj"))
    problems = check_descriptor(descriptor, qwen2_model)
    offenders = [p for p in problems if "neither in lora_targets_all_linear nor in lora_excluded" in p]
    assert len(offenders) == 2 and "model.layers.0.mlp.down_proj" in offenders[0], problems
    assert not check_descriptor(derive(descriptor, lora_excluded=("down_proj",)), qwen2_model)


def test_identity_and_config_attributes_are_checked(qwen2_model):
    base = registry.get("qwen2")
    descriptor = derive(
        base, model_types=("llama",), causal_lm_classes=("LlamaForCausalLM",), config_class="LlamaConfig",
        final_logit_softcapping="logit_cap", never_quantized=(*base.never_quantized, "mlp.norm"),
        mask_kinds=((base.mask_kinds[0][0], "create_mask_that_does_not_exist"),),
        carried_state=(CarriedState(kwarg="side_state", kind="mapping", description="-", enabled_by="use_side"),),
    )
    text = "\n".join(check_descriptor(descriptor, qwen2_model))
    for expected in ("model class Qwen2ForCausalLM", "model_type 'qwen2'", "config class Qwen2Config",
                     "'logit_cap'", "'use_side'", "'side_state' is not a parameter", "'mlp.norm'",
                     "create_mask_that_does_not_exist"):
        assert expected in text


def test_optional_features_are_checked_both_ways():
    gemma4 = registry.get("gemma4")
    moe = tiny_model("gemma4", "moe")
    no_optional = check_descriptor(dataclasses.replace(gemma4, optional_features=()), moe)
    assert any("'per_layer_input_gate' is not an nn.Linear" in p for p in no_optional)
    assert any("model.embed_tokens_per_layer" in p for p in no_optional)
    # names tied to a switch that is off must really be absent
    e2b = tiny_model("gemma4", "e2b")
    wrong_switch = tuple(("enable_moe_block" if a == "hidden_size_per_layer_input" else a, names)
                         for a, names in gemma4.optional_features)
    problems = check_descriptor(dataclasses.replace(gemma4, optional_features=wrong_switch), e2b)
    assert any("'per_layer_input_gate' exists although" in p for p in problems), problems


def test_unlisted_model_level_linear_is_reported():
    gemma4 = registry.get("gemma4")
    optional = tuple((a, tuple(n for n in names if n != "model.per_layer_model_projection"))
                     for a, names in gemma4.optional_features)
    descriptor = derive(gemma4, model_level_linears=(), optional_features=optional)
    problems = check_descriptor(descriptor, tiny_model("gemma4", "e2b"))
    assert problems == [
        "nn.Linear 'model.per_layer_model_projection' outside the decoder layers is not in model_level_linears"
    ]


def test_quantized_never_quantized_entry_is_reported(tmp_path):
    base = registry.get("qwen2")
    model = qlora_model("qwen2", tmp_path=tmp_path, lora_rank=2)
    problems = check_descriptor(derive(base, never_quantized=(*base.never_quantized, "mlp.down_proj")), model)
    assert problems and all("'mlp.down_proj' is 4-bit quantized" in p for p in problems), problems


def test_registered_plugin_is_re_exported():
    import poros.testing.plugins
    import poros.testing

    assert poros.testing.registered_plugin is poros.testing.plugins.registered_plugin
    assert inspect.isfunction(poros.testing.registered_plugin)
