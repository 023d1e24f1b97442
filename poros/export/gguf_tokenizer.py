"""The tokenizer in a GGUF file (``poros merge --format gguf``, :mod:`poros.export.gguf`): where the merged
model's tokenizer comes from (:func:`tokenizer_source`, :func:`load_tokenizer`), llama.cpp's name for its
pre-tokenizer (:func:`tokenizer_pre`, from the split regex), which special tokens it adds
(:func:`added_specials`), and the vocabulary, merges and special ids written (:func:`write_tokenizer`).
"""

from __future__ import annotations

import functools
import os
import pathlib
from typing import Any

from poros.errors import UnsupportedModelError


def write_tokenizer(writer: Any, plan: Any, arch: Any) -> None:  # arch: poros.export.gguf.GgufArchitecture
    """The GPT-2 BPE vocabulary llama.cpp tokenizes with: every id up to the model's vocab size (ids the
    tokenizer lacks become unused ``[PAD<id>]``), added special tokens as control tokens, the merges, the
    pre-tokenizer llama.cpp's converter would choose (:func:`tokenizer_pre`), and from the tokenizer itself
    its BOS/EOS/PAD/UNK ids, whether it adds BOS/EOS (:func:`added_specials`) and its chat template.

    Raises:
        UnsupportedModelError: neither the adapter nor the base has tokenizer files, or llama.cpp would
            tokenize differently (:func:`tokenizer_pre`, :func:`added_specials`).
    """
    import gguf

    source = tokenizer_source(plan)
    tokenizer = load_tokenizer(source)
    pre = tokenizer_pre(tokenizer)
    add_bos, add_eos = added_specials(tokenizer)
    vocab_size = plan.checkpoint.text_config.vocab_size
    by_id = {index: token for token, index in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for index in range(vocab_size):
        token = by_id.get(index)
        if token is None:
            tokens.append(f"[PAD{index}]")
            types.append(gguf.TokenType.UNUSED)
        elif index in added:
            special = added[index].special or looks_special(token)
            if not added[index].normalized:  # llama.cpp takes added tokens as they decode
                token = tokenizer.decode(tokenizer.encode(token, add_special_tokens=False))
            tokens.append(token)
            types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(token)
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(source, load_merges=True, n_vocab=vocab_size)
    for kind in ("bos", "eos", "pad", "unk"):  # the tokenizer's, not config.json's guesses
        special.special_token_ids.pop(kind, None)
        if getattr(tokenizer, f"{kind}_token_id", None) is not None:
            special.special_token_ids[kind] = getattr(tokenizer, f"{kind}_token_id")
    special.add_special_token = {"bos": add_bos, "eos": add_eos}
    special.chat_template = tokenizer.chat_template
    special.add_to_gguf(writer, quiet=True)


def write_sentencepiece_bpe(writer: Any, source: pathlib.Path, model: str, visible: frozenset[str],
                            vocab_size: int) -> None:
    """A SentencePiece-style BPE vocabulary (BPE with byte fallback, spaces as ``▁``: Gemma's) as llama.cpp's
    converter writes it for ``model`` (``Gemma4Model.set_vocab``): gguf-py's ``LlamaHfVocab`` tokens, scores and
    types, the ``visible`` tokens as user-defined (rendered, so llama.cpp's chat parser reads them), the merges
    and special ids of gguf-py's ``SpecialVocab``, no space prefix, BOS added.

    Raises:
        UnsupportedModelError: the tokenizer's size is not the model's vocab size (the converter would cut the
            embedding to the tokenizer; Poros writes every embedding row).
    """
    import gguf
    from gguf.vocab import LlamaHfVocab

    vocab = LlamaHfVocab(source)
    tokens, scores, types = [], [], []
    for text, score, kind in vocab.all_tokens():
        tokens.append(text)
        scores.append(score)
        types.append(gguf.TokenType.USER_DEFINED if text.decode() in visible else kind)
    if len(tokens) != vocab_size:
        raise UnsupportedModelError(
            f"the tokenizer in {source} has {len(tokens)} tokens, the model {vocab_size} embedding rows; llama.cpp "
            f"reads one token per row. Fix: merge to safetensors (poros merge without --format) and convert that with "
            "llama.cpp's convert_hf_to_gguf.py, which cuts the embedding to the tokenizer.")
    writer.add_tokenizer_model(model)
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    gguf.SpecialVocab(source, load_merges=True).add_to_gguf(writer, quiet=True)
    writer.add_add_space_prefix(False)
    writer.add_add_bos_token(True)


def sentencepiece_bpe(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` is BPE with byte fallback (SentencePiece-style, as Gemma's), not byte-level BPE."""
    import json

    backend = getattr(tokenizer, "backend_tokenizer", None)
    model = json.loads(backend.to_str()).get("model", {}) if backend is not None else {}
    return model.get("type") == "BPE" and bool(model.get("byte_fallback"))


def tokenizer_source(plan: Any) -> pathlib.Path:
    """The directory whose tokenizer goes into the file: the adapter's, else the base's.

    Raises:
        UnsupportedModelError: neither has tokenizer files.
    """
    from poros.loading.load import TOKENIZER_FILES

    source = next((path for path in (plan.info.path, plan.base_path)
                   if any((path / name).is_file() for name in TOKENIZER_FILES)), None)
    if source is None:
        raise UnsupportedModelError(f"neither the adapter {plan.info.path} nor the base {plan.base_path} has tokenizer "
                                    "files, and llama.cpp needs the vocabulary in the GGUF file. Fix: save the "
                                    "tokenizer next to the adapter (tokenizer.save_pretrained(adapter_dir)).")
    return source


@functools.lru_cache(maxsize=2)
def load_tokenizer(source: str | os.PathLike) -> Any:
    """The tokenizer in ``source`` (read once per directory: the file's vocabulary and its Modelfile share it)."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(source)


def refuse(reason: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"llama.cpp cannot tokenize as this tokenizer does: {reason}; a GGUF file would answer other prompts than "
        "transformers. Fix: merge to safetensors (poros merge without --format) and serve it with transformers or "
        "vLLM.")


def tokenizer_pre(tokenizer: Any) -> str:
    """The llama.cpp pre-tokenizer (``tokenizer.ggml.pre``) of a byte-level BPE tokenizer, chosen as llama.cpp's
    ``convert_hf_to_gguf.py`` chooses it: the sha256 of the tokenizer's ids for its check text, looked up in its
    table of known tokenizers (:data:`poros.export.llama_vocab.PRE_BY_HASH`); where no digest matches, the name
    whose split regex is the tokenizer's own (:data:`~poros.export.llama_vocab.PRE_BY_REGEX`), provided nothing
    else in ``tokenizer.json`` asks for a step llama.cpp lacks.

    Raises:
        UnsupportedModelError: not a byte-level BPE tokenizer, or one whose split llama.cpp has no name for,
            or one with a step llama.cpp does not take (a normalizer other than NFC, byte fallback, added tokens
            that strip spaces): one line naming it.
    """
    import hashlib
    import json

    from poros.export.llama_vocab import CHECK_TEXT, PRE_BY_HASH, PRE_BY_REGEX

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise refuse(f"it is a {type(tokenizer).__name__} with no tokenizers backend (tokenizer.json)")
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        raise refuse(f"its model is {model.get('type')}{' with byte_fallback' if model.get('byte_fallback') else ''}"
                      ", not the byte-level BPE llama.cpp reads as gpt2")
    digest = hashlib.sha256(str(tokenizer.encode(CHECK_TEXT)).encode()).hexdigest()
    if digest in PRE_BY_HASH:
        return PRE_BY_HASH[digest]
    regex = split_regex(spec.get("pre_tokenizer"))
    name = PRE_BY_REGEX.get(regex or "")
    if name is None:
        raise refuse(f"its pre-tokenizer {json.dumps(spec.get('pre_tokenizer'))[:200]} matches none of llama.cpp's "
                      f"({', '.join(sorted(set(PRE_BY_REGEX.values())))}) and its check-text digest {digest[:12]}... "
                      "no known tokenizer")
    normalizer = (spec.get("normalizer") or {}).get("type")
    if normalizer not in (None, "NFC"):
        raise refuse(f"it normalizes text with {normalizer}, which llama.cpp does not")
    if bool(model.get("ignore_merges")) != (name == "llama-bpe"):
        raise refuse(f"its ignore_merges is {bool(model.get('ignore_merges'))}, llama.cpp's {name} has "
                      f"{name == 'llama-bpe'}")
    if (spec.get("decoder") or {}).get("type") != "ByteLevel":
        raise refuse(f"its decoder is {(spec.get('decoder') or {}).get('type')}, not ByteLevel")
    stripping = [token["content"] for token in spec.get("added_tokens", [])
                 if token.get("lstrip") or token.get("rstrip") or token.get("single_word")]
    if stripping:
        raise refuse(f"its added tokens {stripping[:3]} strip neighbouring spaces or match single words only")
    return name


def split_regex(pre: Any) -> str | None:
    """The one regex a pre-tokenizer splits with, where it is a form llama.cpp implements: a ByteLevel with
    ``use_regex`` (GPT-2's regex), or a Split of a regex (isolated, not inverted) followed by a ByteLevel
    without one. None for anything else."""
    from poros.export.llama_vocab import BYTE_LEVEL_REGEX

    if not isinstance(pre, dict):
        return None
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space"):
        return BYTE_LEVEL_REGEX
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    if not steps or len(steps) != 2:
        return None
    split, level = steps
    if (split.get("type") == "Split" and split.get("behavior") == "Isolated" and not split.get("invert")
            and level.get("type") == "ByteLevel" and not level.get("use_regex", True)
            and not level.get("add_prefix_space")):
        return (split.get("pattern") or {}).get("Regex")
    return None


def added_specials(tokenizer: Any) -> tuple[bool, bool]:
    """Whether the tokenizer puts BOS before and EOS after every text it encodes (``add_bos_token`` and
    ``add_eos_token`` for llama.cpp), read from what it does, not from a config flag.

    Raises:
        UnsupportedModelError: it adds something else, which llama.cpp would not.
    """
    probe = "Hello"
    plain = tokenizer.encode(probe, add_special_tokens=False)
    full = tokenizer.encode(probe)
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    add_bos = bos is not None and full[:1] == [bos] and plain[:1] != [bos]
    add_eos = eos is not None and full[-1:] == [eos] and plain[-1:] != [eos]
    if full != [bos] * add_bos + plain + [eos] * add_eos:
        raise refuse(f"it wraps a text as {full} (the text alone is {plain}); llama.cpp adds only BOS and EOS")
    return add_bos, add_eos


def looks_special(token: str) -> bool:
    """Added tokens some tokenizers leave unmarked that llama.cpp must treat as control tokens."""
    return (token.startswith("<|") and token.endswith("|>")) or token in ("<pad>", "<mask>")


__all__ = ["added_specials", "load_tokenizer", "looks_special", "refuse", "sentencepiece_bpe", "split_regex",
           "tokenizer_pre", "tokenizer_source", "write_sentencepiece_bpe", "write_tokenizer"]
