"""LoRA on MoE experts out of training: ``poros merge`` merges it into the fused expert tensors (as the checkpoint
lays them out: fused on disk for Gemma 4, one matrix per expert for Qwen3.5 MoE), equal to merging by hand in
fp32 then casting; ``poros merge --format gguf`` writes the experts as llama.cpp's converter lays them out, read
back tensor by tensor with gguf's ``GGUFReader``."""

from __future__ import annotations

import peft
import pytest
import torch
import transformers

from poros.export.merge import merge_adapter
from poros.loading.experts import EXPERT_PARAMETERS, experts_modules
from poros.testing import save_tiny_checkpoint

MOE = [("qwen3_5_moe", "default"), ("gemma4", "moe")]
IDS = [f"{f}-{v}" for f, v in MOE]


def expert_adapter(path, directory):
    """A bf16 model with LoRA on q_proj and on both fused expert tensors, every LoRA tensor random, saved; returns
    ``{experts path: {tensor: (A [E, r, in], B [E, out, r], scaling)}}`` in fp32 (PEFT's layout read by hand)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], target_parameters=EXPERT_PARAMETERS)
    torch.manual_seed(0)
    model = peft.get_peft_model(model, config)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, parameter in sorted(model.named_parameters()):
            if parameter.requires_grad:  # the LoRA tensors
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    factors = {}
    for name, module in model.named_modules():
        if type(module).__name__ == "ParamWrapper":
            experts = module.num_experts
            a = module.lora_A["default"].weight.detach().float()
            b = module.lora_B["default"].weight.detach().float()
            path = name.removeprefix("base_model.model.").replace(".base_layer", "")
            factors.setdefault(path, {})[module.parameter_name] = (
                a.view(experts, -1, a.shape[1]), b.view(b.shape[0], -1, experts).permute(2, 0, 1),
                module.scaling["default"])
    model.save_pretrained(directory)
    return factors


@pytest.mark.parametrize(("family", "variant"), MOE, ids=IDS)
def test_merge_puts_expert_lora_into_the_fused_experts_as_fp32_then_cast(family, variant, tmp_path):
    path = save_tiny_checkpoint(tmp_path / "ckpt", family, variant, seed=2, num_layers=2)
    factors = expert_adapter(path, tmp_path / "adapter")
    merge_adapter(tmp_path / "adapter", tmp_path / "merged", model=path, progress=None)
    base = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.bfloat16)
    merged_experts = dict(experts_modules(merged))
    assert len(factors) == 2 and set(factors) == {name for name, _ in experts_modules(base)}
    for name, module in experts_modules(base):
        for tensor, (a, b, scaling) in factors[name].items():
            weight = getattr(module, tensor).detach()
            by_hand = torch.stack([weight[e].float() + scaling * (b[e] @ a[e]) for e in range(weight.shape[0])])
            got = getattr(merged_experts[name], tensor).detach()
            assert not torch.equal(got, weight)
            assert torch.equal(got, by_hand.to(torch.bfloat16)), (name, tensor)


def test_an_adapter_trained_on_nf4_experts_is_peft_s_bf16_layout_and_merges(tmp_path):
    """LoRA on NF4 experts saves what PEFT saves for LoRA on bf16 experts (the same keys and shapes), so the
    adapter loads on the bf16 model and poros merge writes it into the experts."""
    from safetensors.torch import load_file
    from test_moe import FIXED, load

    path = save_tiny_checkpoint(tmp_path / "ckpt", "qwen3_5_moe", seed=2, num_layers=2)
    trained = load(path, FIXED, "nf4+lora")  # quantize_experts, then PEFT's target_parameters; lora_B random
    trained.save_pretrained(tmp_path / "nf4-adapter")
    bf16 = load(path, FIXED, "lora")
    bf16.save_pretrained(tmp_path / "bf16-adapter")
    saved = load_file(tmp_path / "nf4-adapter" / "adapter_model.safetensors")
    reference = load_file(tmp_path / "bf16-adapter" / "adapter_model.safetensors")
    assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in reference.items()}
    assert any(".experts." in key for key in saved)
    merge_adapter(tmp_path / "nf4-adapter", tmp_path / "merged", model=path, progress=None)
    base = dict(experts_modules(transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)))
    merged = dict(experts_modules(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged",
                                                                                    dtype=torch.bfloat16)))
    assert all(not torch.equal(getattr(merged[n], t), getattr(base[n], t)) for n in base for t in
               ("gate_up_proj", "down_proj"))


# -- poros merge --format gguf: the experts as llama.cpp's converter lays them out -----------------------------
#: the tensors the converter always keeps in F32 besides norms, 1-D tensors and non-weights (convert_hf_to_gguf.py's
#: prepare_tensors: the router, the shared expert's gate, DeltaNet's convolution)
ALWAYS_F32 = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight")


#: the routers' weights (Qwen3.5 MoE's ``mlp.gate``, Gemma 4's ``router.proj``) and the factor gguf_base scales them
#: by: random tiny routers give near-equal expert scores, and a top-k choice within rounding of a tie flips between
#: two correct implementations (llama.cpp's CPU GELU is tabulated), which is not what the llama.cpp test checks
ROUTERS, ROUTER_SCALE = ("mlp.gate.weight", "router.proj.weight"), 16.0


def bundled_tokenizer(directory):
    """The bundled byte-level BPE tokenizer (a Qwen-style vocabulary) into ``directory``; returns its size."""
    import shutil

    from poros.assets import asset_path

    directory.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copyfile(asset_path("poros-tiny-qwen3") / name, directory / name)
    return 2048


def gemma_tokenizer(directory):
    """A tiny tokenizer of Gemma's kind into ``directory`` (transformers' GemmaTokenizer: BPE with byte fallback,
    spaces as ``▁``, BOS added; the special tokens, the 256 byte tokens, then BPE trained on the bundled
    conversations, split at newlines as Gemma's vocabulary is) with the bundled chat template; returns its size."""
    import json
    import shutil

    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers.models.gemma.tokenization_gemma import GemmaTokenizer

    from poros.assets import asset_path

    rows = [json.loads(line) for line in asset_path("poros-tiny-chat").read_text().splitlines()]
    vocab = {token: i for i, token in enumerate(["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"] +
                                                [f"<0x{byte:02X}>" for byte in range(256)])}
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.Replace(" ", "▁")
    bpe.pre_tokenizer = pre_tokenizers.Split("\n", behavior="isolated")
    bpe.train_from_iterator([m["content"] for row in rows for m in row["messages"]],
                            trainers.BpeTrainer(vocab_size=2048 - len(vocab), show_progress=False))
    trained = json.loads(bpe.to_str())["model"]
    for token, _ in sorted(trained["vocab"].items(), key=lambda item: item[1]):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(merge.split(" ")) if isinstance(merge, str) else tuple(merge) for merge in trained["merges"]]
    tokenizer = GemmaTokenizer(vocab=vocab, merges=merges, add_bos_token=True)
    tokenizer.save_pretrained(directory)
    shutil.copyfile(asset_path("poros-tiny-qwen3") / "chat_template.jinja", directory / "chat_template.jinja")
    return len(tokenizer)


#: per family, the tokenizer its tiny GGUF base gets: byte-level BPE for Qwen3.5 MoE (as its real ones), Gemma's
#: own kind for Gemma 4 (llama.cpp's gemma4 tokenizer model)
TOKENIZERS = {"qwen3_5_moe": bundled_tokenizer, "gemma4": gemma_tokenizer}


def gguf_base(directory, family, variant, tokenizer=None):
    """A tiny MoE checkpoint of two layers (one of each kind) with the family's kind of tokenizer
    (:data:`TOKENIZERS`, or ``tokenizer``), its routers decisive (:data:`ROUTER_SCALE`)."""
    from safetensors.torch import load_file, save_file

    size = (tokenizer or TOKENIZERS[family])(directory)
    base = save_tiny_checkpoint(directory, family, variant, seed=2, num_layers=2, vocab_size=size)
    for shard in base.glob("*.safetensors"):
        tensors = load_file(shard)
        scaled = {name: tensor * ROUTER_SCALE if name.endswith(ROUTERS) else tensor for name, tensor in tensors.items()}
        save_file(scaled, shard, metadata={"format": "pt"})
    return base


def tiled_heads(tensor, dim, k_heads, per_k, head_dim):
    """V heads from grouped by K head (``[G0_v0 .. G0_v{r-1}, G1_v0 ..]``) to tiled (``[G0_v0, G1_v0, .., G0_v1 ..]``)
    along ``dim``, written as the index list it is (the converter reshapes and permutes)."""
    order = [group * per_k + j for j in range(per_k) for group in range(k_heads)]
    index = torch.tensor([head * head_dim + i for head in order for i in range(head_dim)])
    return tensor.index_select(dim, index)


def qwen35_reference(tensors, config, names):
    """What the converter makes of a Qwen3.5 MoE checkpoint: the experts stacked, A_log -> -exp, the convolution
    squeezed, 1 added to the zero-centred norms, the V heads tiled (there are more V heads than K heads)."""
    k_heads, v_heads = config.linear_num_key_heads, config.linear_num_value_heads
    per_k, qk, v_dim = v_heads // k_heads, 2 * config.linear_key_head_dim * k_heads, config.linear_value_head_dim
    out = {}
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp.experts"
        for projection, short in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
            out[f"blk.{layer}.ffn_{short}_exps.weight"] = torch.stack(
                [tensors.pop(f"{prefix}.{e}.{projection}.weight") for e in range(config.num_experts)])
    tiled = {"in_proj_qkv.weight": lambda t: torch.cat([t[:qk], tiled_heads(t[qk:], 0, k_heads, per_k, v_dim)]),
             "in_proj_z.weight": lambda t: tiled_heads(t, 0, k_heads, per_k, v_dim),
             "in_proj_a.weight": lambda t: tiled_heads(t, 0, k_heads, per_k, 1),
             "in_proj_b.weight": lambda t: tiled_heads(t, 0, k_heads, per_k, 1),
             "A_log": lambda t: -torch.exp(tiled_heads(t, 0, k_heads, per_k, 1)),
             "dt_bias": lambda t: tiled_heads(t, 0, k_heads, per_k, 1),
             "out_proj.weight": lambda t: tiled_heads(t, 1, k_heads, per_k, v_dim),
             "conv1d.weight": lambda t: torch.cat([t[:qk, 0], tiled_heads(t[qk:, 0], 0, k_heads, per_k, v_dim)])}
    renamed = {"A_log": "ssm_a", "dt_bias": "ssm_dt.bias"}
    for name, tensor in tensors.items():
        block, _, leaf = name.removeprefix("model.layers.").partition(".linear_attn.")
        if leaf:
            tensor = tiled[leaf](tensor) if leaf in tiled else tensor
            out[f"blk.{block}.{renamed[leaf]}" if leaf in renamed else names.get_name(name, (".weight",))] = tensor
        else:
            out[names.get_name(name, (".weight", ".bias"))] = tensor + 1 if name.endswith("norm.weight") else tensor
    return out


def gemma4_reference(tensors, config, names):
    """What the converter makes of a Gemma 4 MoE checkpoint: the fused experts kept, the router's scales and the
    layer scalar renamed, the proportional RoPE of the full layers as rope_freqs (1 rotated, 1e30 not)."""
    head_dim = config.to_dict()["per_layer_config"][str(config.layer_types.index("full_attention"))]["head_dim"]
    rotated = int(head_dim * config.rope_parameters["full_attention"]["partial_rotary_factor"] / 2)
    out = {"rope_freqs.weight": torch.tensor([1.0] * rotated + [1e30] * (head_dim // 2 - rotated))}
    special = {"router.scale": "ffn_gate_inp.scale", "router.per_expert_scale": "ffn_down_exps.scale",
               "layer_scalar": "layer_output_scale.weight", "experts.gate_up_proj": "ffn_gate_up_exps.weight",
               "experts.down_proj": "ffn_down_exps.weight"}
    for name, tensor in tensors.items():
        block, _, leaf = name.removeprefix("model.layers.").partition(".")
        out[f"blk.{block}.{special[leaf]}" if leaf in special else names.get_name(name, (".weight", ".bias"))] = tensor
    return out


#: per family: the GGUF architecture, the reference conversion, the tensors its expert LoRA changes
GGUF = {"qwen3_5_moe": ("qwen35moe", qwen35_reference, {"ffn_gate_exps.weight", "ffn_up_exps.weight",
                                                        "ffn_down_exps.weight"}),
        "gemma4": ("gemma4", gemma4_reference, {"ffn_gate_up_exps.weight", "ffn_down_exps.weight"})}


def expected_gguf(family, checkpoint, config):
    """``{llama.cpp name: fp32 tensor}`` the converter makes of ``checkpoint`` (name -> tensor), spelled out per
    family (:data:`GGUF`), names of plain tensors from gguf-py's TensorNameMap."""
    import gguf

    arch, reference, _ = GGUF[family]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    return reference({name: tensor.float() for name, tensor in checkpoint.items()}, config, names)


@pytest.fixture(scope="module", params=MOE, ids=IDS)
def moe_gguf(request, tmp_path_factory):
    """``(family, base, merged safetensors {name: tensor}, the GGUF files {type: path}, tmp)`` for one MoE family:
    LoRA on q_proj and on both fused expert tensors, merged and written as bf16 and q8_0 GGUF."""
    from safetensors.torch import load_file

    from poros.export.gguf import merge_to_gguf

    family, variant = request.param
    tmp = tmp_path_factory.mktemp(family)
    base = gguf_base(tmp / "base", family, variant)
    expert_adapter(base, tmp / "adapter")
    merge_adapter(tmp / "adapter", tmp / "merged", model=base, progress=None)
    merged = {}
    for shard in sorted((tmp / "merged").glob("*.safetensors")):
        merged.update(load_file(shard))
    files = {}
    for gguf_type in ("bf16", "q8_0"):
        files[gguf_type] = tmp / f"{gguf_type}.gguf"
        merge_to_gguf(tmp / "adapter", files[gguf_type], model=base, gguf_type=gguf_type, progress=None)
    return family, base, merged, files, tmp


def assert_reads_back(path, expected, gguf_type):
    """Every tensor of the GGUF file ``path`` (GGUFReader) is ``expected`` (``{llama.cpp name: fp32 tensor}``): the
    names, the shapes, the types (F32 for norms, 1-D tensors, non-weights and :data:`ALWAYS_F32`; ``gguf_type`` for
    the rest) and the bytes (F32 bit for bit; bf16 / Q8_0 as gguf's own quantize of the expected tensor)."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(path)
    assert sorted(t.name for t in reader.tensors) == sorted(expected), gguf_type
    asked = gguf.GGMLQuantizationType[gguf_type.upper()]
    unequal = []
    for stored in reader.tensors:
        want = expected[stored.name]
        assert tuple(int(d) for d in reversed(stored.shape)) == tuple(want.shape), stored.name
        data = np.asarray(stored.data)
        f32 = want.dim() <= 1 or stored.name.endswith(("_norm.weight", *ALWAYS_F32)) or not stored.name.endswith(
            ".weight")
        assert stored.tensor_type == (gguf.GGMLQuantizationType.F32 if f32 else asked), (stored.name, gguf_type)
        reference = want.numpy() if f32 else gguf.quants.quantize(want.numpy(), asked)
        if not np.array_equal(data.reshape(-1).view(np.uint8), reference.reshape(-1).view(np.uint8)):
            unequal.append(stored.name)
    assert unequal == [], gguf_type


def test_gguf_reads_back_the_merged_experts_as_llama_cpp_lays_them_out(moe_gguf):
    """Every tensor of the file, read back with gguf's GGUFReader, is the merged checkpoint's after the converter's
    transforms (:func:`assert_reads_back`), as bf16 and as Q8_0. The expert LoRA is in the expert tensors, and
    q_proj's in attn_q: the merge changed those and nothing else."""
    import transformers
    from safetensors.torch import load_file

    family, base, merged, files, tmp = moe_gguf
    config = transformers.AutoConfig.from_pretrained(base)
    expected = expected_gguf(family, merged, config)
    original = {}
    for shard in sorted(base.glob("*.safetensors")):
        original.update(load_file(shard))
    untouched = expected_gguf(family, original, config)
    for gguf_type, path in files.items():
        assert_reads_back(path, expected, gguf_type)
    changed = {name.split(".", 2)[-1] for name in expected if not torch.equal(expected[name], untouched[name])}
    assert changed == {"attn_q.weight", *GGUF[family][2]}, changed


@pytest.mark.parametrize("family", [family for family, _ in MOE])
def test_gguf_writes_the_text_tower_of_a_multimodal_checkpoint(family, tmp_path):
    """Real Qwen3.5 MoE and Gemma 4 checkpoints are multimodal: the GGUF holds the text tower under llama.cpp's
    names, converted as for a text checkpoint, and leaves the vision tower out (llama.cpp reads it from an mmproj
    file the converter writes apart). Gemma 4's tiny VLM has the E2B text tower (per-layer inputs, KV sharing,
    the double-wide MLP), which the same converter writes."""
    import shutil

    import transformers
    from safetensors.torch import load_file
    from test_merge import load_qlora_text

    from poros.assets import asset_path
    from poros.export.gguf import merge_to_gguf
    from poros.testing import tiny_vlm

    base = tmp_path / "vlm"
    tiny_vlm(family, vocab_size=2048).save_pretrained(base, max_shard_size="200KB")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copyfile(asset_path("poros-tiny-qwen3") / name, base / name)
    text_config = transformers.AutoConfig.from_pretrained(base).get_text_config()
    load_qlora_text(base, text_config).save_pretrained(tmp_path / "adapter")
    merge_adapter(tmp_path / "adapter", tmp_path / "merged", model=base, progress=None)
    merged = {}
    for shard in sorted((tmp_path / "merged").glob("*.safetensors")):
        merged.update(load_file(shard))
    text = {name.replace("model.language_model.", "model.", 1): tensor for name, tensor in merged.items()
            if name.startswith(("model.language_model.", "lm_head."))}
    assert len(text) < len(merged)  # the vision tower is in the checkpoint
    merge_to_gguf(tmp_path / "adapter", tmp_path / "vlm.gguf", model=base, gguf_type="bf16", progress=None)
    assert_reads_back(tmp_path / "vlm.gguf", expected_gguf(family, text, text_config), "bf16")


def qwen35_metadata(config):
    """The keys llama.cpp's qwen35moe loader reads beyond the common ones: DeltaNet's sizes, which layers are
    recurrent, the shared expert, the partial interleaved mRoPE."""
    return {"expert_used_count": config.num_experts_per_tok,
            "expert_shared_feed_forward_length": config.shared_expert_intermediate_size,
            "ssm.conv_kernel": config.linear_conv_kernel_dim, "ssm.state_size": config.linear_key_head_dim,
            "ssm.group_count": config.linear_num_key_heads, "ssm.time_step_rank": config.linear_num_value_heads,
            "ssm.inner_size": config.linear_value_head_dim * config.linear_num_value_heads,
            "attention.recurrent_layers": [t == "linear_attention" for t in config.layer_types],
            "full_attention_interval": 4,
            "rope.dimension_count": int(config.head_dim * config.rope_parameters["partial_rotary_factor"]),
            "rope.dimension_sections": [*config.rope_parameters["mrope_section"], 0],
            "rope.freq_base": config.rope_parameters["rope_theta"],
            "attention.key_length": config.head_dim, "attention.value_length": config.head_dim}


def gemma4_metadata(config):
    """The keys llama.cpp's gemma4 loader reads beyond the common ones: the sliding layers' window, head dim, KV
    heads and RoPE base beside the full layers', the logit soft-cap."""
    hparams = config.to_dict()
    full = hparams["per_layer_config"][str(config.layer_types.index("full_attention"))]
    return {"expert_used_count": config.top_k_experts, "attention.sliding_window": config.sliding_window,
            "attention.sliding_window_pattern": [t == "sliding_attention" for t in config.layer_types],
            "attention.key_length": full["head_dim"], "attention.value_length": full["head_dim"],
            "attention.key_length_swa": hparams["head_dim"], "attention.value_length_swa": hparams["head_dim"],
            "attention.head_count_kv": [hparams["num_key_value_heads"] if t == "sliding_attention" else
                                        full["num_key_value_heads"] for t in config.layer_types],
            "rope.dimension_count": full["head_dim"], "rope.dimension_count_swa": hparams["head_dim"],
            "rope.freq_base": config.rope_parameters["full_attention"]["rope_theta"],
            "rope.freq_base_swa": config.rope_parameters["sliding_attention"]["rope_theta"],
            "final_logit_softcapping": config.final_logit_softcapping,
            "attention.shared_kv_layers": 0, "embedding_length_per_layer_input": 0}


METADATA = {"qwen3_5_moe": qwen35_metadata, "gemma4": gemma4_metadata}


def test_gguf_metadata_is_what_llama_cpp_reads_for_the_moe_architecture(moe_gguf):
    import gguf
    import transformers

    family, base, merged, files, tmp = moe_gguf
    config = transformers.AutoConfig.from_pretrained(base)
    fields = gguf.GGUFReader(files["q8_0"]).fields
    arch = GGUF[family][0]
    expected = {"block_count": config.num_hidden_layers, "embedding_length": config.hidden_size,
                "context_length": config.max_position_embeddings, "feed_forward_length": config.intermediate_size,
                "attention.head_count": config.num_attention_heads, "expert_count": config.num_experts,
                "expert_feed_forward_length": config.moe_intermediate_size,
                "attention.layer_norm_rms_epsilon": config.rms_norm_eps, **METADATA[family](config)}
    assert fields["general.architecture"].contents() == arch
    got = {key: fields[f"{arch}.{key}"].contents() for key in expected}
    def same(value, want) -> bool:  # floats as stored in GGUF (f32), the rest exactly (lists per layer)
        return value == pytest.approx(want) if isinstance(want, float) else value == want

    assert all(same(got[k], v) for k, v in expected.items()), {k: (got[k], v) for k, v in expected.items()
                                                             if not same(got[k], v)}


def test_gguf_refuses_a_layer_whose_experts_are_incomplete():
    """A Qwen3.5 MoE checkpoint that lacks one expert's matrix is refused in one line, naming what it expected."""
    from poros import errors
    from poros.export.gguf_arch import Qwen35Converter, Source
    from poros.testing import tiny_config

    config = tiny_config("qwen3_5_moe", num_layers=2)
    sources = [Source(0, f"model.layers.0.mlp.experts.{e}.{p}.weight", f"model.layers.0.mlp.experts.{e}.{p}.weight",
                      (4, 4)) for e in (0, 1, 3) for p in ("gate_proj", "up_proj", "down_proj")]
    expected = r"experts \[0, 1, 3\].*expected one for each of the 4"
    with pytest.raises(errors.UnsupportedModelError, match=expected) as info:
        Qwen35Converter("qwen35moe", config).plan(sources)
    assert "\n" not in str(info.value)


def test_gguf_splits_a_fused_gate_up_proj_on_disk_into_gate_and_up_experts():
    """A Qwen3.5 MoE checkpoint with the experts fused on disk (``experts.gate_up_proj [E, 2 x ff, hidden]``, as
    transformers holds them) is split as the converter splits it: the first ff rows of every expert to
    ffn_gate_exps, the rest to ffn_up_exps; ``down_proj`` to ffn_down_exps as it is."""
    from poros.export.gguf_arch import Qwen35Converter, Source
    from poros.testing import tiny_config

    config = tiny_config("qwen3_5_moe", num_layers=2)
    experts, ff, hidden = config.num_experts, config.moe_intermediate_size, config.hidden_size
    gate_up = torch.randn(experts, 2 * ff, hidden)
    down = torch.randn(experts, hidden, ff)
    sources = [Source(0, "model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.gate_up_proj",
                      tuple(gate_up.shape)),
               Source(0, "model.layers.0.mlp.experts.down_proj", "model.layers.0.mlp.experts.down_proj",
                      tuple(down.shape))]
    planned = {item.name: item for item in Qwen35Converter("qwen35moe", config).plan(sources)}
    assert sorted(planned) == ["blk.0.ffn_down_exps.weight", "blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight"]
    assert planned["blk.0.ffn_gate_exps.weight"].shape() == (experts, ff, hidden)
    assert torch.equal(planned["blk.0.ffn_gate_exps.weight"].build([gate_up]), gate_up[:, :ff])
    assert torch.equal(planned["blk.0.ffn_up_exps.weight"].build([gate_up]), gate_up[:, ff:])
    assert torch.equal(planned["blk.0.ffn_down_exps.weight"].build([down]), down)


def test_gguf_writes_gemma_s_own_tokenizer_as_llama_cpp_s_gemma4_model(tmp_path):
    """Gemma 4 with a tokenizer of Gemma's kind (BPE with byte fallback): the vocabulary as llama.cpp's converter
    writes it (``tokenizer.ggml.model`` gemma4, every token with its score and type, the merges, BOS added, no space
    prefix); tests/test_gguf_llama_cpp.py checks llama.cpp tokenizes with it as transformers does."""
    import json

    import gguf
    import transformers

    from poros.export.gguf import merge_to_gguf

    base = gguf_base(tmp_path / "base", "gemma4", "moe", tokenizer=gemma_tokenizer)
    expert_adapter(base, tmp_path / "adapter")
    result = merge_to_gguf(tmp_path / "adapter", tmp_path / "out.gguf", model=base, progress=None)
    assert result.tokenizer_pre == "gemma4"
    fields = gguf.GGUFReader(tmp_path / "out.gguf").fields
    tokenizer = transformers.AutoTokenizer.from_pretrained(base)
    tokens = fields["tokenizer.ggml.tokens"].contents()
    types = fields["tokenizer.ggml.token_type"].contents()
    assert fields["tokenizer.ggml.model"].contents() == "gemma4" and "tokenizer.ggml.pre" not in fields
    assert tokens == tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))) and len(tokens) == len(tokenizer)
    assert [types[i] for i in range(5)] == [gguf.TokenType.CONTROL] * 5  # <pad> <eos> <bos> <unk> <mask>
    assert all(types[tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>")] == gguf.TokenType.BYTE for b in range(256))
    assert len(fields["tokenizer.ggml.scores"].contents()) == len(tokens)
    spec = json.loads((base / "tokenizer.json").read_text())
    assert len(fields["tokenizer.ggml.merges"].contents()) == len(spec["model"]["merges"])
    assert fields["tokenizer.ggml.add_bos_token"].contents() is True
    assert fields["tokenizer.ggml.add_space_prefix"].contents() is False
    assert fields["tokenizer.ggml.bos_token_id"].contents() == tokenizer.bos_token_id
    assert fields["tokenizer.ggml.eos_token_id"].contents() == tokenizer.eos_token_id


def test_gguf_holds_one_gguf_tensor_s_sources_at_a_time(moe_gguf, monkeypatch):
    """Host memory while writing MoE GGUF: when a GGUF tensor's bytes are written, every checkpoint tensor read for
    it has been dropped; at most one layer's matrices of one projection (num_experts of them, for the stacked
    experts) are alive at once."""
    import gc
    import weakref

    import gguf
    import transformers

    from poros.export.gguf import merge_to_gguf
    from poros.export.merge import ShardReader

    family, base, merged, files, tmp = moe_gguf
    experts = transformers.AutoConfig.from_pretrained(base).num_experts
    alive, most, read, write = [], [0], ShardReader.read, gguf.GGUFWriter.write_tensor_data

    def tracked(self, name):
        tensor = read(self, name)
        alive.append(weakref.ref(tensor))
        most[0] = max(most[0], sum(ref() is not None for ref in alive))
        return tensor

    def written(self, *args, **kwargs):
        if any(ref() is not None for ref in alive):
            gc.collect()  # PEFT's layers hold reference cycles: what they held goes with a collection
        assert [ref for ref in alive if ref() is not None] == []
        return write(self, *args, **kwargs)

    monkeypatch.setattr(ShardReader, "read", tracked)
    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", written)
    merge_to_gguf(tmp / "adapter", tmp / "one-at-a-time.gguf", model=base, progress=None)
    assert 1 <= most[0] <= experts and len(alive) == len(merged)


def test_gguf_refuses_a_gemma_tokenizer_smaller_than_the_embedding_in_one_line(tmp_path):
    """llama.cpp reads one token per embedding row; the converter cuts the embedding to a smaller Gemma tokenizer,
    Poros writes every row: refused before a tensor is read, naming both sizes and the fix."""
    from poros import errors
    from poros.export.gguf import merge_to_gguf

    base = gguf_base(tmp_path / "base", "gemma4", "moe", tokenizer=lambda directory: gemma_tokenizer(directory) + 64)
    expert_adapter(base, tmp_path / "adapter")
    with pytest.raises(errors.UnsupportedModelError, match=r"has \d+ tokens, the model \d+ embedding rows") as info:
        merge_to_gguf(tmp_path / "adapter", tmp_path / "out.gguf", model=base, progress=None)
    assert "\n" not in str(info.value) and "Fix: merge to safetensors" in str(info.value)
    assert not list(tmp_path.glob("*out.gguf*"))
