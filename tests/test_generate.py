"""poros.export.generate: greedy decoding through the streamed model gives the resident PEFT model's tokens."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("bitsandbytes")

from poros import prepare  # noqa: E402
from poros.testing import TINY_VARIANTS, qlora_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CASES = [(family, variant) for family, variants in TINY_VARIANTS.items() for variant in variants]
UNTIED = {"tie_word_embeddings": False}  # a table tied to the head stays on the device
PROMPT_TOKENS, NEW_TOKENS = 5, 10  # prompt + new > the tiny sliding window (8): sliding masks decode too


def _without_cpu_repacking(model):
    """bitsandbytes repacks NF4 weights for AVX512-BF16 CPUs in eval mode (and fails on some tiny Qwen 3.5
    shapes); switch that off so the test runs the same kernels on every CPU, resident and streamed alike."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    return model


def _prompt(batch: int = 1) -> torch.Tensor:
    return torch.randint(3, 100, (batch, PROMPT_TOKENS), generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize(("family", "variant"), CASES, ids=[f"{f}-{v}" for f, v in CASES])
def test_greedy_equals_resident(family, variant, tmp_path):
    resident = _without_cpu_repacking(qlora_model(family, variant, tmp_path=tmp_path / "resident")).eval()
    prompt = _prompt()
    options = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    with torch.no_grad():
        expected = resident.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), **options)
    streamed = prepare(_without_cpu_repacking(qlora_model(family, variant, tmp_path=tmp_path / "streamed")))
    lengths = []  # sequence length reaching the first block: the prompt once, then one token (KV cache)
    streamed.executor.layers[0].register_forward_pre_hook(lambda module, args: lengths.append(args[0].shape[1]))
    fetches_before = list(streamed.store.stats.fetches)
    got = streamed.generate(prompt, attention_mask=torch.ones_like(prompt), **options)
    assert got.shape == (1, PROMPT_TOKENS + NEW_TOKENS)
    assert torch.equal(got, expected)
    assert streamed.training  # generate puts the mode back
    assert lengths == [PROMPT_TOKENS] + [1] * (NEW_TOKENS - 1)
    # one forward per new token (the prompt's, then one per decoded token), each block fetched in each
    fetched = [after - before for after, before in zip(streamed.store.stats.fetches, fetches_before)]
    assert fetched == [NEW_TOKENS] * len(fetched)


def test_sampling_and_padding_equal_resident(tmp_path):
    """Seeded sampling (temperature, top-p) and a left-padded batch of two: the resident model's tokens."""
    resident = _without_cpu_repacking(qlora_model("qwen3", tmp_path=tmp_path / "resident")).eval()
    streamed = prepare(_without_cpu_repacking(qlora_model("qwen3", tmp_path=tmp_path / "streamed")))
    prompt = _prompt(batch=2)
    mask = torch.ones_like(prompt)
    mask[1, :2] = 0  # the second prompt is three tokens, left-padded
    options = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=True, temperature=0.8, top_p=0.9,
                   pad_token_id=0)
    torch.manual_seed(3)
    with torch.no_grad():
        expected = resident.generate(input_ids=prompt, **options)
    torch.manual_seed(3)
    got = streamed.generate(prompt, **options)
    assert torch.equal(got, expected)


def test_generate_text_reports_tokens_per_second(tmp_path):
    """generate_text: chat template when the tokenizer has one, the new tokens only, their rate."""
    from poros.assets import asset_path
    from poros.export.generate import generate_text
    from poros.loading.load import load_pretrained

    loaded = load_pretrained(asset_path("poros-tiny-qwen3"), device="cpu")
    model = prepare(loaded.model.requires_grad_(False))
    tokenizer = loaded.tokenizer
    assert tokenizer.chat_template
    result = generate_text(model, tokenizer, "Hello", max_new_tokens=4)
    assert 1 <= len(result.token_ids) <= 4 and result.tokens_per_second > 0
    expected_prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], tokenize=False,
                                                    add_generation_prompt=True)
    assert result.prompt_tokens == len(tokenizer(expected_prompt, add_special_tokens=False)["input_ids"])
    raw = generate_text(model, tokenizer, "Hello", max_new_tokens=4, chat=False)
    assert raw.prompt_tokens == len(tokenizer("Hello")["input_ids"])


@pytest.mark.parametrize("options", [dict(resident_blocks=1), dict(num_slots=1), dict(host_tier="mapped"),
                                     dict(host_tier="disk", read_ahead=2)],
                         ids=["resident-block", "one-slot", "mapped-tier", "disk-tier"])
def test_greedy_with_resident_blocks_or_one_slot(options, tmp_path):
    """A resident block is never fetched; one slot fetches every block anew; a host tier serves the blocks
    from a file (the disk tier's read-ahead guesses a training order, decoding runs forward only): the same
    tokens every way."""
    if "host_tier" in options:
        options = {**options, "cache_dir": str(tmp_path / "cache")}
    resident = _without_cpu_repacking(qlora_model("gemma3", tmp_path=tmp_path / "resident")).eval()
    prompt = _prompt()
    generation = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    with torch.no_grad():
        expected = resident.generate(input_ids=prompt, **generation)
    streamed = prepare(_without_cpu_repacking(qlora_model("gemma3", tmp_path=tmp_path / "streamed")), **options)
    assert torch.equal(streamed.generate(prompt, **generation), expected)
    assert not any(streamed.store.stats.fetches[i] for i in streamed.store.resident_blocks)


def test_generate_with_host_embeddings_gives_the_trunk_device_inputs(tmp_path, monkeypatch):
    """With ``embeddings_on_host`` the first parameter (what HF's ``model.device`` reads) is the host-kept
    table, so HF's generate moves position ids and the mask to the host; the streamed trunk must hand HF's
    layers and rotary inputs on the compute device (H200: rotary "cuda:0 and cpu"). "meta" stands in for
    the GPU: the trunk is stopped at its inputs."""

    class Stop(Exception):
        pass

    streamed = prepare(qlora_model("qwen2", tmp_path=tmp_path, config_kwargs=UNTIED), embeddings_on_host=True)
    assert streamed.host_tables and streamed.device == streamed.store.device
    monkeypatch.setattr(streamed.store, "device", torch.device("meta"))
    assert streamed.device == torch.device("meta")  # the prepared model reports its compute device
    seen = []

    def trunk(*args, **kwargs):
        seen.append({key: value.device.type for key, value in kwargs.items() if isinstance(value, torch.Tensor)})
        raise Stop

    monkeypatch.setattr(streamed.executor, "_trunk_class_forward", trunk)
    prompt = _prompt()
    with pytest.raises(Stop):
        streamed.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=2, do_sample=False)
    assert seen and set(seen[0]) >= {"input_ids", "position_ids"}, seen
    assert set(seen[0].values()) == {"meta"}, seen


def test_greedy_equals_resident_with_host_embeddings(tmp_path):
    """Generation with the input table on the host: the resident model's tokens."""
    resident = _without_cpu_repacking(qlora_model("qwen2", tmp_path=tmp_path / "resident", config_kwargs=UNTIED)).eval()
    prompt = _prompt()
    options = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    with torch.no_grad():
        expected = resident.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), **options)
    streamed = prepare(_without_cpu_repacking(qlora_model("qwen2", tmp_path=tmp_path / "streamed", config_kwargs=UNTIED)),
                       embeddings_on_host=True)
    assert streamed.host_tables
    assert torch.equal(streamed.generate(prompt, attention_mask=torch.ones_like(prompt), **options), expected)
