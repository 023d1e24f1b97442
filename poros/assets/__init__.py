"""Files bundled with Poros: the tiny default model and its chat dataset (torch-free).

Two names resolve to files inside the installed package, so that a quickstart, a smoke test or
CI can train end to end with nothing downloaded:

* ``"poros-tiny-qwen3"`` (:data:`TINY_MODEL`): a directory in HF layout -- a ``Qwen3ForCausalLM``
  (hidden 128, 4 layers, bf16, multi-shard safetensors) pretrained a little on plain text of the
  bundled kind, so that a first LoRA run on the chat data visibly learns, and a byte-level BPE
  tokenizer (vocab 2048) with a ChatML chat template.
* ``"poros-tiny-chat"`` (:data:`TINY_CHAT`): a JSON-lines chat dataset, one
  ``{"messages": [...]}`` conversation per line.

``tools/make_tiny_default.py`` generates both, deterministically.
"""

from __future__ import annotations

import pathlib

TINY_MODEL = "poros-tiny-qwen3"
TINY_CHAT = "poros-tiny-chat"

#: bundled name -> path relative to this package's directory.
ASSETS: dict[str, str] = {
    TINY_MODEL: "tiny-qwen3",
    TINY_CHAT: "tiny-chat.jsonl",
}

ASSETS_DIR = pathlib.Path(__file__).resolve().parent


def asset_path(name: str) -> pathlib.Path:
    """The path of a bundled asset.

    Args:
        name: a key of :data:`ASSETS` (``"poros-tiny-qwen3"`` or ``"poros-tiny-chat"``).

    Returns:
        The file or directory inside the installed ``poros/assets/``.

    Raises:
        LookupError: ``name`` is not a bundled asset; the message lists the names that are.
        FileNotFoundError: the asset is missing from the installation (a wheel built without its
            package data); the message says how to regenerate or reinstall it.
    """
    relative = ASSETS.get(name)
    if relative is None:
        raise LookupError(f"no bundled asset named {name!r}; bundled: {', '.join(sorted(ASSETS))}")
    path = ASSETS_DIR / relative
    if not path.exists():
        raise FileNotFoundError(
            f"bundled asset {name!r} is missing: expected {path}. Reinstall poros-train, or in a source "
            "checkout run `python -m tools.make_tiny_default` to regenerate poros/assets/"
        )
    return path


def is_asset(name: object) -> bool:
    """Whether ``name`` is the name of a bundled asset (a string key of :data:`ASSETS`)."""
    return isinstance(name, str) and name in ASSETS


__all__ = ["ASSETS", "ASSETS_DIR", "TINY_CHAT", "TINY_MODEL", "asset_path", "is_asset"]
