"""What a :class:`~poros.config.PorosConfig` source may spell besides field names and typed values.

* Other trainers' names for fields (:data:`FIELD_ALIASES`): HF ``TrainingArguments``, TRL's
  ``SFTConfig`` and axolotl's YAML. A ``poros.yaml``, a ``--key value`` override, ``PorosConfig(...)``,
  ``replace`` and ``PorosTrainer`` take either name; the config keeps Poros's own
  (``PorosConfig(learning_rate=1e-4).lr == 1e-4``), and a misspelling is matched against both.
* Sizes, both ways: read from what people write (:func:`parse_budget`: ``"7GiB"``, ``"24GB"``, ``"7.5G"``)
  and written back in words, the one place byte counts are formatted: binary units for sizes people read
  (:func:`human_bytes`: ``poros doctor``, ``poros plan``'s host line, ``poros merge``) and decimal GB as the
  bench and the results pages write them (:func:`format_gb`: the planner and its report, ``poros cache``).
  Two named functions because both forms are printed and asserted; everything else calls them.

Torch-free: the standard library only.
"""

from __future__ import annotations

import difflib
import re
from typing import Any

from poros.errors import ConfigError

#: other name -> the PorosConfig field it means. Only names whose meaning is the field's exactly (same
#: unit, same values); ``output_dir`` is both a Poros field and HF's name.
FIELD_ALIASES: dict[str, str] = {
    "learning_rate": "lr",                        # HF, TRL, axolotl
    "max_steps": "steps",                         # HF, TRL (a set steps overrides epochs, as max_steps does)
    "num_train_epochs": "epochs",                 # HF, TRL
    "num_epochs": "epochs",                       # axolotl
    "per_device_train_batch_size": "batch_size",  # HF, TRL: batch_size is per device
    "micro_batch_size": "batch_size",             # axolotl
    "gradient_accumulation_steps": "grad_accum",  # HF, TRL, axolotl
    "max_seq_length": "seq_len",                  # TRL (before max_length)
    "max_length": "seq_len",                      # TRL
    "sequence_len": "seq_len",                    # axolotl
    "lora_r": "lora_rank",                        # axolotl
    "lora_target_modules": "target_modules",      # axolotl
    "warmup_steps": "warmup",                     # HF, TRL, axolotl
    "lr_scheduler_type": "schedule",              # HF, TRL
    "lr_scheduler": "schedule",                   # axolotl
    "base_model": "model",                        # axolotl
    "model_name_or_path": "model",                # HF example scripts
}


def known_fields(given: dict[str, Any], names: list[str], source: str) -> dict[str, Any]:
    """``given`` with every alias replaced by the field name it means (order kept).

    Args:
        given: ``{key: value}`` from ``source`` (a YAML file, keywords).
        names: the PorosConfig field names.

    Raises:
        ConfigError: a key that is neither a field nor an alias (named, with the closest of both), or two
            keys naming one field (``lr`` and ``learning_rate``).
    """
    out: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for key, value in given.items():
        name = FIELD_ALIASES.get(key, key) if key not in names else key
        if name not in names:
            raise ConfigError(f"{source}: unknown key {key!r}; PorosConfig has no such field{suggestion(str(key), names)}")
        if name in out:
            raise ConfigError(f"{source}: {spelled[name]!r} and {key!r} both set PorosConfig's {name!r} "
                              f"({out[name]!r} and {value!r}); expected one of them. Keep one key.")
        out[name], spelled[name] = value, key
    return out


def suggestion(key: str, names: list[str]) -> str:
    """The end of an unknown-key message: the closest field, or alias with its field (``; did you mean
    'max_steps' (PorosConfig's 'steps')?``), and where every field is listed."""
    close = difflib.get_close_matches(key, [*names, *FIELD_ALIASES], n=1, cutoff=0.5)
    found = close[0] if close else None
    hint = (f"; did you mean {found!r}?" if found in names else
            f"; did you mean {found!r} (PorosConfig's {FIELD_ALIASES[found]!r})?" if found else ".")
    return hint + " Every field is listed in docs/configuration.md (or run `poros init` for a commented poros.yaml)."


def aliases_of(name: str) -> list[str]:
    """The other names of field ``name``, in :data:`FIELD_ALIASES` order."""
    return [alias for alias, field in FIELD_ALIASES.items() if field == name and alias != name]


_SIZE_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20,
               "g": 2**30, "gb": 10**9, "gib": 2**30, "t": 2**40, "tb": 10**12, "tib": 2**40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*")


def parse_budget(value: str | int, name: str = "vram_budget") -> int:
    """Bytes of a VRAM budget: ``"7GiB"`` (2^30), ``"7GB"`` (10^9), ``"7000MiB"``, ``"7.5G"`` (a bare
    K/M/G/T is binary, as in ``ls -h``), ``"24 GiB"``, or an int of bytes.

    Raises:
        ConfigError: not a positive size in one of those forms.
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"{name}={value!r} ({type(value).__name__}): expected a size such as '7GiB', "
                          "'7GB', '7000MiB', '7.5G' or an int of bytes.")
    if isinstance(value, int):
        number, unit = float(value), ""
    else:
        match = _SIZE.fullmatch(value)
        if not match or match.group(2).lower() not in _SIZE_UNITS:
            raise ConfigError(f"{name}={value!r} is not a size: expected a number and a unit such as '7GiB' "
                              "(2^30 bytes), '7GB' (10^9), '7000MiB', '7.5G' (binary) or an int of bytes, e.g. "
                              f"--{name.replace('_', '-')} 7GiB.")
        number, unit = float(match.group(1)), match.group(2).lower()
    nbytes = int(number * _SIZE_UNITS[unit])
    if nbytes <= 0:
        raise ConfigError(f"{name}={value!r} is {nbytes} bytes; a budget must be positive, e.g. 7GiB.")
    return nbytes


def human_bytes(nbytes: int | float | None) -> str:
    """``1536`` -> ``"1.5 KiB"``, ``4 * 2**30`` -> ``"4.0 GiB"`` (binary units, one decimal; whole bytes
    below 1 KiB); ``None`` (not known) -> ``"unknown"``."""
    if nbytes is None:
        return "unknown"
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_gb(nbytes: float) -> str:
    """``5_195_600_000`` -> ``"5.20 GB"`` (decimal units, as the bench and the results pages write
    them); below 0.1 GB in MB or kB."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= size * (0.1 if unit == "GB" else 1):
            return f"{nbytes / size:.2f} {unit}" if unit == "GB" else f"{nbytes / size:.1f} {unit}"
    return f"{int(nbytes)} B"


__all__ = ["FIELD_ALIASES", "aliases_of", "format_gb", "human_bytes", "known_fields", "parse_budget", "suggestion"]
