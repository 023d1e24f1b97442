"""poros merge --format gguf: the merged model for llama.cpp / Ollama, read back with gguf-py's own GGUFReader.

Every tensor of the file is checked against the merged safetensors checkpoint (``poros merge``, itself
tested equal to PEFT's merge_and_unload): F32 and BF16 bit for bit, Q8_0 as the bytes gguf-py's own
``quants.quantize`` makes of the same merged tensor (and so their dequantized values); names and shapes
as llama.cpp's converter gives them; the metadata llama.cpp reads.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

pytest.importorskip("bitsandbytes")
gguf = pytest.importorskip("gguf")

from safetensors.torch import load_file  # noqa: E402

from poros import errors  # noqa: E402
from poros.cli.main import main  # noqa: E402
from poros.export.gguf import GGUF_ARCHITECTURES, merge_to_gguf  # noqa: E402
from poros.export.merge import merge_adapter  # noqa: E402
from poros.testing import load_qlora, save_tiny_checkpoint  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FAMILIES = sorted(GGUF_ARCHITECTURES)  # qwen2, qwen3
VOCAB = 2048  # the bundled tokenizer's: the GGUF vocabulary is the tokenizer's, one entry per embedding row


def _base_with_tokenizer(directory, family):
    """A tiny checkpoint of ``family`` with the bundled byte-level BPE tokenizer (a Qwen-style vocabulary)."""
    from poros.assets import asset_path

    base = save_tiny_checkpoint(directory, family, vocab_size=VOCAB)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copyfile(asset_path("poros-tiny-qwen3") / name, base / name)
    return base


@pytest.fixture(scope="module", params=FAMILIES)
def merged(request, tmp_path_factory):
    """``(family, base, adapter, merged safetensors tensors, tmp)`` for one family."""
    tmp = tmp_path_factory.mktemp(request.param)
    base = _base_with_tokenizer(tmp / "base", request.param)
    adapter = tmp / "adapter"
    load_qlora(base, lora_rank=4, lora_alpha=8).save_pretrained(adapter)  # lora_B random: the merge matters
    merge_adapter(adapter, tmp / "merged", model=base, progress=None)
    tensors = {}
    for shard in sorted((tmp / "merged").glob("*.safetensors")):
        tensors.update(load_file(shard))
    return request.param, base, adapter, tensors, tmp


def _llama_names(family, tensors):
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[family.upper()], 2)
    return {names.get_name(key, try_suffixes=(".weight", ".bias")): key for key in tensors}


def _converted(tensor, qtype):
    return gguf.quants.quantize(tensor.float().numpy(), qtype).view(np.uint8)


def _field(reader, key):
    return reader.fields[key].contents()


@pytest.mark.parametrize("gguf_type", ["bf16", "q8_0"])
def test_every_tensor_is_the_merged_tensor(merged, gguf_type):
    family, base, adapter, tensors, tmp = merged
    path = tmp / f"model-{gguf_type}.gguf"
    result = merge_to_gguf(adapter, path, model=base, gguf_type=gguf_type, progress=None)
    reader = gguf.GGUFReader(path)
    by_name = _llama_names(family, tensors)
    assert sorted(t.name for t in reader.tensors) == sorted(by_name) and result.tensors == len(tensors)
    assert result.merged_modules == 2 * 7
    quantized = gguf.GGMLQuantizationType[gguf_type.upper()]
    original = {}
    for shard in sorted(base.glob("*.safetensors")):
        original.update(load_file(shard))
    unequal, changed = [], []
    for stored in reader.tensors:
        expected = tensors[by_name[stored.name]]
        assert tuple(int(d) for d in reversed(stored.shape)) == tuple(expected.shape), stored.name
        data = np.asarray(stored.data)
        if expected.dim() <= 1 or stored.name.endswith("_norm.weight"):  # norms and biases: F32, exact
            assert stored.tensor_type == gguf.GGMLQuantizationType.F32, stored.name
            same = np.array_equal(data.reshape(-1), expected.float().numpy().reshape(-1))
        elif gguf_type == "bf16":  # the merged bf16 bits themselves
            assert stored.tensor_type == quantized, stored.name
            same = np.array_equal(data.view(np.uint16).reshape(-1),
                                  expected.contiguous().view(torch.int16).numpy().view(np.uint16).reshape(-1))
        else:  # gguf-py's own Q8_0 of the same merged tensor, byte for byte and so dequantized
            assert stored.tensor_type == quantized, stored.name
            reference = gguf.quants.quantize(expected.float().numpy(), quantized)
            same = np.array_equal(data.reshape(-1), reference.reshape(-1)) and np.array_equal(
                gguf.quants.dequantize(data, quantized), gguf.quants.dequantize(reference, quantized))
        if not same:
            unequal.append(stored.name)
        base_bytes = _converted(original[by_name[stored.name]], stored.tensor_type).reshape(-1)
        if not np.array_equal(np.ascontiguousarray(data).reshape(-1).view(np.uint8), base_bytes):
            changed.append(stored.name)
    assert unequal == []
    assert len(changed) == result.merged_modules  # the adapted weights, and only they, differ from the base's


def test_the_metadata_llama_cpp_reads(merged):
    import transformers

    family, base, adapter, tensors, tmp = merged
    path = tmp / "meta.gguf"
    merge_to_gguf(adapter, path, model=base, gguf_type="q8_0", progress=None)
    reader = gguf.GGUFReader(path)
    config = transformers.AutoConfig.from_pretrained(base)
    prefix = family
    assert _field(reader, "general.architecture") == family
    assert _field(reader, "general.file_type") == gguf.LlamaFileType.MOSTLY_Q8_0
    assert _field(reader, f"{prefix}.block_count") == config.num_hidden_layers
    assert _field(reader, f"{prefix}.embedding_length") == config.hidden_size
    assert _field(reader, f"{prefix}.feed_forward_length") == config.intermediate_size
    assert _field(reader, f"{prefix}.context_length") == config.max_position_embeddings
    assert _field(reader, f"{prefix}.attention.head_count") == config.num_attention_heads
    assert _field(reader, f"{prefix}.attention.head_count_kv") == config.num_key_value_heads
    assert _field(reader, f"{prefix}.rope.freq_base") == pytest.approx(config.rope_parameters["rope_theta"])
    assert _field(reader, f"{prefix}.attention.layer_norm_rms_epsilon") == pytest.approx(config.rms_norm_eps)
    if getattr(config, "head_dim", None) is not None:
        assert _field(reader, f"{prefix}.attention.key_length") == config.head_dim
    tokenizer = transformers.AutoTokenizer.from_pretrained(base)
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type")
    assert _field(reader, "tokenizer.ggml.model") == "gpt2" and _field(reader, "tokenizer.ggml.pre") == "qwen2"
    assert len(tokens) == len(types) == config.vocab_size
    assert all(tokens[i] == token for token, i in tokenizer.get_vocab().items())
    assert [types[i] for i in tokenizer.added_tokens_decoder] == [gguf.TokenType.CONTROL] * 3
    merges = json.loads((base / "tokenizer.json").read_text())["model"]["merges"]
    assert len(_field(reader, "tokenizer.ggml.merges")) == len(merges)
    assert _field(reader, "tokenizer.ggml.eos_token_id") == tokenizer.eos_token_id
    assert _field(reader, "tokenizer.chat_template") == (base / "chat_template.jinja").read_text()


def test_gguf_holds_one_base_tensor_at_a_time(merged, monkeypatch):
    from test_merge import track_reads

    family, base, adapter, tensors, tmp = merged
    alive = track_reads(monkeypatch)
    result = merge_to_gguf(adapter, tmp / "one-at-a-time.gguf", model=base, progress=None)
    assert len(alive) == result.tensors


def test_the_cli_writes_gguf_and_refuses_what_it_cannot(merged, capsys):
    family, base, adapter, tensors, tmp = merged
    target = tmp / "cli.gguf"
    status = main(["merge", "--adapter", str(adapter), "--model", str(base), "--format", "gguf", "--gguf-type", "q8_0",
                   "--output", str(target)])
    out, err = capsys.readouterr()
    assert status == 0, err
    assert f"into {target} (GGUF q8_0, architecture {family})" in out and "poros merge: shard" in err
    assert gguf.GGUFReader(target).fields["general.architecture"].contents() == family
    for argv, error, fix in (
            (["--format", "gguf", "--output", str(target)], "ConfigError", "--overwrite"),
            (["--gguf-type", "q8_0", "--output", str(tmp / "x")], "ConfigError", "add --format gguf")):
        status = main(["merge", "--adapter", str(adapter), "--model", str(base), *argv])
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert status == 1 and line.startswith(f"poros merge: error: {error}: ") and fix in line, line


def test_a_failure_mid_file_leaves_nothing(merged, monkeypatch):
    from poros.export import gguf as exporter

    family, base, adapter, tensors, tmp = merged
    calls, real = [], exporter.convert

    def failing(tensor, qtype):
        calls.append(1)
        if len(calls) == 5:
            raise OSError(28, "No space left on device")
        return real(tensor, qtype)

    monkeypatch.setattr(exporter, "convert", failing)
    with pytest.raises(OSError):
        merge_to_gguf(adapter, tmp / "broken.gguf", model=base, progress=None)
    assert not (tmp / "broken.gguf").exists() and not list(tmp.glob(".broken.gguf*"))


@pytest.mark.parametrize(("family", "variant", "needle"), [
    ("gemma3", "default", "writes the llama.cpp architectures qwen2, qwen3; this base is model_type 'gemma3_text'"),
    ("qwen2", "sliding", "sliding-window attention"),
])
def test_a_base_llama_cpp_would_compute_differently_is_refused(family, variant, needle, tmp_path):
    base = save_tiny_checkpoint(tmp_path / "base", family, variant)
    load_qlora(base, lora_rank=4, lora_alpha=8).save_pretrained(tmp_path / "adapter")
    with pytest.raises(errors.UnsupportedModelError, match=needle):
        merge_to_gguf(tmp_path / "adapter", tmp_path / "out.gguf", model=base, progress=None)
    assert not (tmp_path / "out.gguf").exists() and not list(tmp_path.glob(".out.gguf*"))
