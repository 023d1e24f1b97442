"""Where a configuration's checkpoint config comes from, offline: :func:`locate_checkpoint_config` (a local
directory, the bundled model, or a hub id already in the HF cache: its ``config.json`` is enough, no
weights), :func:`load_text_config` (the config and its text tower's) and :func:`config_source` (both, with
where it was found, for the plan's header). What :mod:`poros.plan.run_plan` and the pre-flight checks read.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

from poros.errors import CheckpointLoadError


def locate_checkpoint_config(model: str, *, revision: str | None = None) -> tuple[pathlib.Path, str]:
    """The directory holding ``model``'s ``config.json``, without downloading anything.

    A local directory and a model bundled with poros resolve as :func:`poros.loading.load.resolve_checkpoint`
    resolves them; a hub id only through the HF cache (its ``config.json`` is enough: the plan
    needs no weights).

    Returns:
        ``(directory, where)``; ``where`` says how it was found, for the plan's header.

    Raises:
        CheckpointLoadError: no such directory, or a hub id whose ``config.json`` is not cached.
    """
    from poros.assets import is_asset
    from poros.loading.load import resolve_checkpoint

    path = pathlib.Path(model).expanduser()
    hub_like = model.count("/") == 1 and not model.startswith((".", "/", "~")) and not path.exists()
    if not hub_like:
        directory = resolve_checkpoint(model, revision=revision)
        return directory, "bundled with poros" if is_asset(model) else "local directory"
    import huggingface_hub

    cached = huggingface_hub.try_to_load_from_cache(model, "config.json", revision=revision)
    if isinstance(cached, str) and os.path.isfile(cached):
        return pathlib.Path(cached).parent, "HF cache"
    raise CheckpointLoadError(
        f"{model!r}{f' (revision {revision})' if revision else ''} is not a local directory and its config.json "
        f"is not in the HF cache ({huggingface_hub.constants.HF_HUB_CACHE}), and a plan reads only the cache: it "
        f"never downloads. Fix: fetch the config first (`hf download {model} config.json`), or pass a local "
        "checkpoint directory."
    )


def load_text_config(directory: pathlib.Path) -> tuple[Any, Any]:
    """``(config, text_config)`` of a checkpoint directory (:func:`poros.loading.load.read_config`), or of a
    known hub id that is no directory: the shape its registry record holds (:func:`poros.records.config_json`)."""
    from poros import records
    from poros.loading.load import read_config

    known = None if pathlib.Path(directory).is_dir() else records.find_checkpoint(str(directory))
    if known is None:
        return read_config(directory)
    import transformers

    fields = records.config_json(known[1])
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    return config, config.get_text_config()


def config_source(model: str, *, revision: str | None = None) -> tuple[pathlib.Path, str]:
    """:func:`locate_checkpoint_config`, else, for a hub id the registry knows, ``(model, where)``: the plan
    is then made from the shape its record holds, offline, and ``where`` says so.

    Raises:
        CheckpointLoadError: as :func:`locate_checkpoint_config`, for a model the registry does not know.
    """
    from poros import records

    try:
        return locate_checkpoint_config(model, revision=revision)
    except CheckpointLoadError:
        known = records.find_checkpoint(model)
        if known is None:
            raise
        return pathlib.Path(model), (f"not in the HF cache; planned offline from its record in registry/{known[0]}"
                                     f".toml (the shape of {known[1].get('config', model)})")


__all__ = ["config_source", "load_text_config", "locate_checkpoint_config"]
