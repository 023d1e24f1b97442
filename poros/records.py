"""Registry data (``registry/<family>.toml``): known checkpoints and validation records. Torch-free.

Schema of one family file::

    family = "qwen2"

    [[checkpoint]]
    hf_id = "Qwen/Qwen2.5-7B"           # what users pass to from_pretrained
    config = "https://huggingface.co/Qwen/Qwen2.5-7B/blob/main/config.json"  # where the facts come from
    params = "7.6B"
    layers = 28
    hidden_size = 3584
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
    source = "tools/parity_gate.py"     # the script that produced it
"""

from __future__ import annotations

import functools
import tomllib
from pathlib import Path
from typing import Any

LABELS = ("bitwise", "numerical", "unverified")


def data_dir() -> Path:
    """Folder holding the TOML files: the installed ``poros.registry_data`` package, else ``registry/``."""
    try:
        import importlib.resources

        return Path(str(importlib.resources.files("poros.registry_data")))
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[1] / "registry"


@functools.lru_cache(maxsize=None)
def load(family: str) -> dict[str, Any]:
    path = data_dir() / f"{family}.toml"
    if not path.exists():
        return {"family": family, "checkpoint": [], "validation": []}
    with path.open("rb") as fh:
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


def family_of_checkpoint(hf_id: str) -> str | None:
    """Family that lists ``hf_id`` among its known checkpoints (case-insensitive)."""
    wanted = hf_id.lower()
    for family in all_families():
        if any(c.get("hf_id", "").lower() == wanted for c in checkpoints(family)):
            return load(family).get("family", family)
    return None
