"""Registry data (``registry/<family>.toml``): known checkpoints and validation records. Torch-free.

Schema of one family file::

    family = "qwen2"

    [[checkpoint]]
    hf_id = "Qwen/Qwen2.5-7B"           # what users pass to from_pretrained
    instruct_id = "Qwen/Qwen2.5-7B-Instruct"  # optional sibling with the same facts (also base_id)
    instruct_overrides = { max_position_embeddings = 32768 }  # optional: where that sibling differs (base_overrides)
    config = "https://huggingface.co/Qwen/Qwen2.5-7B/blob/main/config.json"  # where the facts come from
    model_type = "qwen2"                # config.json model_type (top level: "gemma3" for a VLM)
    params = "7.6B"
    layers = 28                         # num_hidden_layers (of the text tower for a VLM)
    hidden_size = 3584
    intermediate_size = 18944
    num_attention_heads = 28
    num_key_value_heads = 4
    head_dim = 128                      # only where the config states it
    vocab_size = 152064
    tie_word_embeddings = false
    max_position_embeddings = 131072
    multimodal = false                  # true: the checkpoint stores a VLM, Poros trains its text tower

    [[validation]]                      # one per parity/benchmark record, appended by tools/
    platform = "NVIDIA H200"            # or "cpu-x86_64"
    platform_class = "cuda-sm90"        # what the guarantee label generalises over
    torch = "2.11.0"; transformers = "5.24.0"; peft = "0.21.2"; bitsandbytes = "0.50.2"
    date = "2026-11-29"; commit = "abc1234"
    label = "bitwise"                   # bitwise | numerical | unverified
    adapter = "lora"
    max_diff_loss = 0.0; max_diff_adapter = 0.0; max_diff_optimizer = 0.0
    peak_allocated_gb = 5.1             # optional, for benchmark records
    source = "tools/checks/parity_gate.py"     # the script that produced it

Family-specific facts use the config's own key (``global_head_dim``, ``num_kv_shared_layers``,
``num_experts``...). A fact that could not be confirmed is left out, with an ``# unconfirmed:``
comment in the file. Every id (``hf_id``, ``instruct_id``, ``base_id``) resolves to its entry
through :func:`find_checkpoint`.

:func:`config_json` turns an entry's facts into the ``config.json`` they were read from, as far as
they go: what ``poros plan`` plans a known model from when its own ``config.json`` is not in the
HF cache.

The folder is ``$POROS_REGISTRY_DIR`` when that is set (tests, or a checkout of newer records),
else the installed ``poros.registry_data`` package, else ``registry/`` beside the package.
"""

from __future__ import annotations

import functools
import os
import tomllib
from pathlib import Path
from typing import Any

LABELS = ("bitwise", "numerical", "unverified")
REGISTRY_DIR_ENV = "POROS_REGISTRY_DIR"
#: Fields of a checkpoint entry that name a Hub repository sharing the entry's facts.
ID_FIELDS = ("hf_id", "instruct_id", "base_id")
#: Sub-table of facts that differ in a sibling's config, per sibling id field.
OVERRIDE_FIELDS = {"instruct_id": "instruct_overrides", "base_id": "base_overrides"}
#: Checkpoint facts that are ``config.json`` keys, by the key they are (``layers`` is ``num_hidden_layers``).
CONFIG_KEYS = {"layers": "num_hidden_layers", **{key: key for key in (
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "vocab_size", "tie_word_embeddings", "max_position_embeddings", "sliding_window",
    "query_pre_attn_scalar", "global_head_dim", "num_global_key_value_heads", "attention_k_eq_v",
    "num_kv_shared_layers", "hidden_size_per_layer_input", "use_double_wide_mlp", "num_experts",
    "top_k_experts", "moe_intermediate_size", "linear_num_key_heads", "linear_num_value_heads",
    "linear_key_head_dim", "linear_value_head_dim", "num_experts_per_tok", "shared_expert_intermediate_size",
)}}


def data_dir() -> Path:
    """Folder holding the TOML files: ``$POROS_REGISTRY_DIR``, else ``poros.registry_data``, else ``registry/``."""
    override = os.environ.get(REGISTRY_DIR_ENV)
    if override:
        return Path(override)
    try:
        import importlib.resources

        return Path(str(importlib.resources.files("poros.registry_data")))
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[1] / "registry"


def load(family: str) -> dict[str, Any]:
    """The parsed ``<family>.toml`` (``checkpoint`` and ``validation`` default to empty lists)."""
    path = data_dir() / f"{family}.toml"
    if not path.exists():
        return {"family": family, "checkpoint": [], "validation": []}
    return _read(str(path), path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=None)
def _read(path: str, mtime_ns: int) -> dict[str, Any]:
    # Keyed on path and mtime: a new data dir or an appended record is read afresh.
    with open(path, "rb") as fh:
        data = tomllib.load(fh)
    data.setdefault("checkpoint", [])
    data.setdefault("validation", [])
    return data


def all_families() -> list[str]:
    return sorted(p.stem for p in data_dir().glob("*.toml"))


def checkpoints(family: str) -> list[dict[str, Any]]:
    return list(load(family)["checkpoint"])


def validations(family: str) -> list[dict[str, Any]]:
    return list(load(family)["validation"])


def status(family: str) -> str:
    """Strongest label any record gives the family (``unverified`` when it has none)."""
    labels = {r.get("label") for r in validations(family)}
    return next((label for label in LABELS if label in labels), "unverified")


def validated_platforms(family: str) -> list[str]:
    return sorted({f"{r.get('platform')} ({r.get('label')})" for r in validations(family)})


def checkpoint_ids(entry: dict[str, Any]) -> list[str]:
    """Every Hub id an entry describes: ``hf_id`` first, then ``instruct_id`` and ``base_id``."""
    return [entry[field] for field in ID_FIELDS if entry.get(field)]


def find_checkpoint(hf_id: str) -> tuple[str, dict[str, Any]] | None:
    """``(family, facts)`` for a known Hub id (case-insensitive), else ``None``.

    ``facts`` is the entry with ``hf_id`` set to the id asked for and, for a sibling id, that
    sibling's overrides (``instruct_overrides`` / ``base_overrides``) applied.
    """
    wanted = hf_id.lower()
    for family in all_families():
        data = load(family)
        for entry in data["checkpoint"]:
            for field in ID_FIELDS:
                if not entry.get(field) or str(entry[field]).lower() != wanted:  # "" matches no absent id
                    continue
                facts = {k: v for k, v in entry.items() if k not in OVERRIDE_FIELDS.values()}
                facts.update(entry.get(OVERRIDE_FIELDS.get(field, ""), {}))
                facts["hf_id"] = entry[field]
                return data.get("family", family), facts
    return None


def family_of_checkpoint(hf_id: str) -> str | None:
    """Family that lists ``hf_id`` (or it as an instruct/base sibling) among its known checkpoints."""
    found = find_checkpoint(hf_id)
    return found[0] if found else None


def config_json(facts: dict[str, Any]) -> dict[str, Any]:
    """The ``config.json`` of an entry's facts (:func:`find_checkpoint`), as far as they go: ``model_type``
    and the :data:`CONFIG_KEYS` facts, under ``text_config`` for a multimodal checkpoint (whose facts
    are its text tower's). Whatever the entry does not record is left to the model type's defaults."""
    fields = {CONFIG_KEYS[key]: value for key, value in facts.items() if key in CONFIG_KEYS}
    if facts.get("multimodal"):
        return {"model_type": facts["model_type"], "text_config": fields}
    return {"model_type": facts["model_type"], **fields}
