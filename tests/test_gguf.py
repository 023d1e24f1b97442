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
from poros.export.gguf import merge_to_gguf  # noqa: E402
from poros.export.merge import merge_adapter  # noqa: E402
from poros.testing import load_qlora, save_tiny_checkpoint  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FAMILIES = ["qwen2", "qwen3"]  # the dense ones; the MoE ones (Qwen3.5 MoE, Gemma 4): tests/test_moe_export.py
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
    # the bundled tokenizer.json splits with GPT-2's regex (a ByteLevel pre-tokenizer): no known digest, its own
    # regex. Under a qwen2 config transformers loads it as its Qwen2Tokenizer, which splits with Qwen2's regex
    # (what transformers does is what llama.cpp must do)
    assert _field(reader, "tokenizer.ggml.model") == "gpt2"
    assert _field(reader, "tokenizer.ggml.pre") == {"qwen2": "qwen2", "qwen3": "gpt-2"}[family]
    assert len(tokens) == len(types) == config.vocab_size
    assert all(tokens[i] == token for token, i in tokenizer.get_vocab().items())
    assert [types[i] for i in tokenizer.added_tokens_decoder] == [gguf.TokenType.CONTROL] * 3
    merges = json.loads((base / "tokenizer.json").read_text())["model"]["merges"]
    assert len(_field(reader, "tokenizer.ggml.merges")) == len(merges)
    assert _field(reader, "tokenizer.ggml.eos_token_id") == tokenizer.eos_token_id
    assert _field(reader, "tokenizer.ggml.padding_token_id") == tokenizer.pad_token_id
    assert "tokenizer.ggml.bos_token_id" not in reader.fields and tokenizer.bos_token_id is None
    assert _field(reader, "tokenizer.ggml.add_bos_token") is False and _field(reader, "tokenizer.ggml.add_eos_token") is False
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
    assert f"into {target} (GGUF q8_0, architecture {family}, pre-tokenizer " in out and "poros merge: shard" in err
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
    ("gemma3", "default", "writes the model types gemma4, gemma4_text, qwen2, qwen3, qwen3_5_moe, qwen3_5_moe_text; "
                         "this base is model_type 'gemma3_text'"),
    ("qwen2", "sliding", "sliding-window attention"),
])
def test_a_base_llama_cpp_would_compute_differently_is_refused(family, variant, needle, tmp_path):
    base = save_tiny_checkpoint(tmp_path / "base", family, variant)
    load_qlora(base, lora_rank=4, lora_alpha=8).save_pretrained(tmp_path / "adapter")
    with pytest.raises(errors.UnsupportedModelError, match=needle):
        merge_to_gguf(tmp_path / "adapter", tmp_path / "out.gguf", model=base, progress=None)
    assert not (tmp_path / "out.gguf").exists() and not list(tmp_path.glob(".out.gguf*"))


# -- the tokenizer as llama.cpp's converter reads it ----------------------------------------------------------
def _tokenizer_with(tmp_path, edit):
    """The bundled tokenizer with ``edit(tokenizer.json as a dict)`` applied, loaded by transformers."""
    import transformers

    from poros.assets import asset_path

    directory = tmp_path / "tokenizer"
    directory.mkdir()
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        shutil.copyfile(asset_path("poros-tiny-qwen3") / name, directory / name)
    spec = json.loads((asset_path("poros-tiny-qwen3") / "tokenizer.json").read_text())
    edit(spec)
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    return transformers.AutoTokenizer.from_pretrained(directory)


def _split_then_bytes(regex):
    def edit(spec):
        spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]}
    return edit


def test_the_pre_tokenizer_is_the_tokenizers_own_where_no_digest_is_known(tmp_path):
    from poros.export.gguf import tokenizer_pre
    from poros.export.llama_vocab import PRE_BY_REGEX

    assert tokenizer_pre(_tokenizer_with(tmp_path, lambda spec: None)) == "gpt-2"  # ByteLevel with GPT-2's regex
    for regex, name in PRE_BY_REGEX.items():
        shutil.rmtree(tmp_path / "tokenizer", ignore_errors=True)
        ignore = name == "llama-bpe"  # llama.cpp's llama-bpe ignores merges for whole-word tokens, as Llama 3 does

        def edit(spec, regex=regex, ignore=ignore):
            _split_then_bytes(regex)(spec)
            spec["model"]["ignore_merges"] = ignore
        assert tokenizer_pre(_tokenizer_with(tmp_path, edit)) == name


@pytest.mark.parametrize(("edit", "reason"), [
    (_split_then_bytes(r"\p{L}+|\s+|."), "matches none of llama.cpp's"),
    (lambda spec: spec.update(normalizer={"type": "Lowercase"}), "it normalizes text with Lowercase"),
    (lambda spec: spec["added_tokens"][1].update(lstrip=True), "strip neighbouring spaces"),
    (lambda spec: spec["model"].update(ignore_merges=True), "its ignore_merges is True"),
], ids=["unknown-split", "lowercase", "lstrip", "ignore-merges"])
def test_a_tokenizer_llama_cpp_cannot_reproduce_is_refused_in_one_line(edit, reason, tmp_path):
    from poros.export.gguf import tokenizer_pre

    with pytest.raises(errors.UnsupportedModelError, match="llama.cpp cannot tokenize as this tokenizer does") as info:
        tokenizer_pre(_tokenizer_with(tmp_path, edit))
    assert reason in str(info.value) and "Fix: merge to safetensors" in str(info.value)
    assert "\n" not in str(info.value)


def test_a_tokenizer_that_adds_bos_says_so(tmp_path):
    from poros.export.gguf import added_specials

    def edit(spec):
        spec["post_processor"] = {"type": "TemplateProcessing", "single": [
            {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [0], "tokens": ["<|endoftext|>"]}}}

    tokenizer = _tokenizer_with(tmp_path, edit)
    tokenizer.bos_token = "<|endoftext|>"
    assert tokenizer.encode("Hello")[0] == 0 and added_specials(tokenizer) == (True, False)


def test_the_check_text_is_the_converters():
    """The vendored check text, code point for code point (its digest as a guard against an edit of the data)."""
    import hashlib

    from poros.export.llama_vocab import CHECK_TEXT, KNOWN_HASHES, PRE_BY_HASH

    assert hashlib.sha256(CHECK_TEXT.encode()).hexdigest()[:16] == CHECK_TEXT_DIGEST
    assert len(KNOWN_HASHES) == 83 and PRE_BY_HASH["e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea"] == "qwen2"
    assert PRE_BY_HASH["b6dc8df998e1cfbdc4eac8243701a65afe638679230920b50d6f17d81c098166"] == "olmo"  # the later if


CHECK_TEXT_DIGEST = "a36179c1e2b1cfcf"


# -- the Ollama Modelfile, against Ollama's documented grammar (docs/modelfile.md of ollama/ollama) ------------
#: the instructions of docs/modelfile.md's Format table (the Modelfile is not case sensitive)
MODELFILE_INSTRUCTIONS = {"FROM", "PARAMETER", "TEMPLATE", "SYSTEM", "ADAPTER", "LICENSE", "MESSAGE"}
#: docs/modelfile.md's "Valid Parameters and Values": name -> value type
MODELFILE_PARAMETERS = {"mirostat": int, "mirostat_eta": float, "mirostat_tau": float, "num_ctx": int,
                        "repeat_last_n": int, "repeat_penalty": float, "temperature": float, "seed": int, "stop": str,
                        "tfs_z": float, "num_predict": int, "top_k": int, "top_p": float, "min_p": float}
#: the template variables docs/modelfile.md documents, and the actions it shows
GO_ACTION = r"\{\{-? *(?:\.(?:System|Prompt|Response)|if \.(?:System|Prompt|Response)|end) *-?\}\}"


def parse_modelfile(text):
    """``[(INSTRUCTION, argument)]`` as docs/modelfile.md's grammar reads a Modelfile: ``# comment`` lines,
    ``INSTRUCTION arguments`` lines, an argument in triple quotes over several lines; any other line fails."""
    import re

    parsed, lines = [], iter(text.splitlines())
    for line in lines:
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        instruction, _, argument = line.partition(" ")
        assert instruction.upper() in MODELFILE_INSTRUCTIONS, f"not an instruction: {line!r}"
        if argument.startswith('"""'):
            body = argument[3:]
            while not body.endswith('"""'):
                body += "\n" + next(lines)  # StopIteration: an unterminated """
            argument = body[:-3]
            assert '"""' not in argument
        elif argument.startswith('"'):
            assert re.fullmatch(r'"(?:[^"\\]|\\.)*"', argument), f"a badly quoted argument: {line!r}"
            argument = re.sub(r"\\(.)", r"\1", argument[1:-1])
        parsed.append((instruction.upper(), argument))
    return parsed


def ollama_render(template, messages):
    """What Ollama makes of a template with .System/.Prompt/.Response for a conversation (its legacy path in
    template.go: one execution per user turn and its answer, the last cut after .Response)."""
    import re

    def execute(values, cut):
        out, skipping = [], []
        for piece in re.split(r"(\{\{[^}]*\}\})", template):
            action = re.fullmatch(r"\{\{-? *(.*?) *-?\}\}", piece)
            if action is None:
                if not any(skipping):
                    out.append(piece)
                continue
            word = action.group(1)
            if word.startswith("if ."):
                skipping.append(not values[word[4:]])
            elif word == "end":
                skipping.pop()
            elif not any(skipping):
                out.append(values[word[1:]])
                if cut and word == ".Response":
                    return "".join(out)
        return "".join(out)

    text, turn = [], {"System": "", "Prompt": "", "Response": ""}
    for message in messages:
        role, content = message["role"], message["content"]
        if role == "system":
            if turn["Prompt"] or turn["Response"]:
                text.append(execute(turn, False))
                turn = {"System": "", "Prompt": "", "Response": ""}
            turn["System"] = content
        elif role == "user":
            if turn["Response"]:
                text.append(execute(turn, False))
                turn = {"System": "", "Prompt": "", "Response": ""}
            turn["Prompt"] = content
        else:
            turn["Response"] = content
    text.append(execute(turn, True))
    return "".join(text)


def test_the_modelfile_is_ollamas_grammar_and_renders_as_the_chat_template(merged):
    import re

    import transformers

    from poros.assets import asset_path

    family, base, adapter, tensors, tmp = merged
    result = merge_to_gguf(adapter, tmp / "ollama.gguf", model=base, gguf_type="q8_0", progress=None)
    assert result.modelfile == tmp / "ollama.Modelfile" and f"ollama create NAME -f {result.modelfile}" in result.summary()
    parsed = parse_modelfile(result.modelfile.read_text())
    assert [argument for instruction, argument in parsed if instruction == "FROM"] == ["./ollama.gguf"]
    assert (result.modelfile.parent / "ollama.gguf").is_file()  # FROM is relative to the Modelfile
    parameters = [argument.split(" ", 1) for instruction, argument in parsed if instruction == "PARAMETER"]
    for name, value in parameters:
        kind = MODELFILE_PARAMETERS[name]
        if kind is str:
            assert re.fullmatch(r'"(?:[^"\\]|\\.)*"', value), value
        else:
            kind(value)
    assert {name: value for name, value in parameters if name != "stop"} == {
        "temperature": "0", "repeat_penalty": "1", "num_predict": "128"}
    assert [value for name, value in parameters if name == "stop"] == ['"<|im_start|>"', '"<|im_end|>"']
    (template,) = [argument for instruction, argument in parsed if instruction == "TEMPLATE"]
    assert "{{" not in re.sub(GO_ACTION, "", template) and template.count("{{ if") == template.count("{{ end }}")
    tokenizer = transformers.AutoTokenizer.from_pretrained(base)
    rows = [json.loads(line) for line in asset_path("poros-tiny-chat").read_text().splitlines()]
    conversations = [row["messages"][:-1] for row in rows] + [
        [{"role": "system", "content": "Be brief."}, *rows[0]["messages"], *rows[1]["messages"][:-1]]]
    for messages in conversations:
        assert ollama_render(template, messages) == tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True)


def test_a_chat_template_that_is_not_fixed_text_gets_no_template_line(tmp_path):
    from poros.export.modelfile import chat_turns, modelfile_text

    def edit(spec):
        pass

    tokenizer = _tokenizer_with(tmp_path, edit)
    tokenizer.chat_template = ("{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are helpful.<|im_end|>\n"
                               "{% endif %}" + tokenizer.chat_template)  # a default system prompt
    assert isinstance(chat_turns(tokenizer), str)  # the reason it is not converted
    text = modelfile_text("model.gguf", tokenizer, 128)
    assert "TEMPLATE" not in text.replace("# no TEMPLATE", "") and "# no TEMPLATE: the chat template is not converted" in text
    parse_modelfile(text)
