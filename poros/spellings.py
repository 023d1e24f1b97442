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

* Values as the command line and YAML spell them: ``--key value`` overrides (:func:`parse_overrides`,
  :func:`parse_value`: ``true``/``on``, ``null``, ``1e-4``, ``q_proj,v_proj``), the type check of a value
  (:func:`check_type`) and one ``key: value`` YAML line (:func:`yaml_line`; :class:`YamlLoader` reads
  YAML 1.2 floats such as ``2e-4``).

Torch-free: the standard library and PyYAML only.
"""

from __future__ import annotations

import difflib
import re
import types
import typing
from collections.abc import Callable, Iterable
from typing import Any

import yaml

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


#: other trainers' keys whose values are not the field's (so not aliases): what an unknown-key message says instead
SPELLED_OTHERWISE: dict[str, str] = {
    "use_liger_kernel": "kernels: liger (HF's and TRL's use_liger_kernel: true)",
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
    hint = (f"; Poros spells it {SPELLED_OTHERWISE[key]}." if key in SPELLED_OTHERWISE else
            f"; did you mean {found!r}?" if found in names else
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


def report_to_names(value: str | list[str]) -> list[str]:
    """``"tensorboard"`` -> ``["tensorboard"]``; ``"tensorboard, wandb"`` and lists -> the names, stripped."""
    items = value.split(",") if isinstance(value, str) else value
    return [item.strip() for item in items if item.strip()]

# -- values as the command line and YAML spell them -------------------------------------------------
BOOL_WORDS = {"true": True, "false": False, "1": True, "0": False, "yes": True, "no": False,
              "on": True, "off": False}
NULL_WORDS = ("null", "none", "~")


def allowed_types(hint: Any) -> tuple[Any, ...]:
    """``str | list[str] | None`` -> ``(str, list[str], NoneType)``."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)


def type_name(hint: Any) -> str:
    names = []
    for allowed in allowed_types(hint):
        if allowed is type(None):
            names.append("null")
        elif typing.get_origin(allowed) is list:
            names.append("list of str")
        else:
            names.append(allowed.__name__)
    return " or ".join(names)


def check_type(name: str, value: Any, hint: Any, example: Callable[[str], str]) -> Any:
    """``value`` if it has a type ``hint`` allows (int -> float for float fields, tuple -> list); ``example(name)``
    is a value the error message suggests."""
    for allowed in allowed_types(hint):
        if allowed is type(None) and value is None:
            return None
        if allowed is bool and isinstance(value, bool):
            return value
        if allowed is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if allowed is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if allowed is str and isinstance(value, str):
            return value
        if typing.get_origin(allowed) is list and isinstance(value, (list, tuple)) \
                and all(isinstance(item, str) for item in value):
            return list(value)
    raise ConfigError(
        f"{name}={value!r} has type {type(value).__name__}, expected {type_name(hint)}; e.g. {name}: "
        f"{example(name)}"
    )


def parse_value(name: str, text: str, hint: Any, example: Callable[[str], str]) -> Any:
    """Parse one command-line string by the field's type (see :func:`parse_overrides`)."""
    allowed = allowed_types(hint)
    lowered = text.strip().lower()
    if type(None) in allowed and lowered in NULL_WORDS:
        return None
    for kind in allowed:
        if kind is bool and lowered in BOOL_WORDS:
            return BOOL_WORDS[lowered]
        if kind is int:
            try:
                return int(text)
            except ValueError:
                pass
        if kind is float:
            try:
                return float(text)
            except ValueError:
                pass
        if typing.get_origin(kind) is list and ("," in text or str not in allowed):
            return [item.strip() for item in text.split(",") if item.strip()]
        if kind is str:
            return text
    raise ConfigError(f"--{name.replace('_', '-')} {text!r}: expected {type_name(hint)}; e.g. "
                      f"--{name.replace('_', '-')} {example(name)}")


def parse_overrides(arguments: Iterable[str], names: list[str], hints: dict[str, Any],
                    example: Callable[[str], str]) -> dict[str, Any]:
    """The field changes command-line overrides spell (nanoGPT's configurator, type-checked): ``--key
    value``, ``--key=value``, ``--flag`` (a bool field set to true) and ``--no-flag`` (false), for the
    fields ``names`` of types ``hints``; ``--seq-len`` and ``--seq_len`` are the same key, another
    trainer's name means its field (:data:`FIELD_ALIASES`). Values are parsed by the field's type
    (:func:`parse_value`); ``example(name)`` is a value an error message suggests.

    Raises:
        ConfigError: an argument that is not ``--key``, an unknown key (named, with the closest field),
            a missing or unparsable value.
    """
    arguments = list(arguments)
    changes: dict[str, Any] = {}
    index = 0
    while index < len(arguments):
        argument = arguments[index]
        index += 1
        if not argument.startswith("--") or len(argument) == 2:
            raise ConfigError(
                f"unexpected argument {argument!r}; overrides are --key value pairs (e.g. --steps 50). Put "
                "the config file first: poros train poros.yaml --steps 50."
            )
        key, has_value, value = argument[2:].partition("=")
        key = key.replace("-", "_")
        key = FIELD_ALIASES.get(key, key) if key not in names else key  # --learning-rate: lr
        negated = False
        if key not in names and key.startswith("no_") and key[3:] in names \
                and bool in allowed_types(hints[key[3:]]):
            key, negated = key[3:], True
        if key not in names:
            raise ConfigError(f"unknown override --{argument[2:].partition('=')[0]}: PorosConfig has no field "
                              f"{key!r}{suggestion(key, names)}")
        allowed = allowed_types(hints[key])
        if negated:
            if has_value:
                raise ConfigError(f"--no-{key.replace('_', '-')} takes no value (got {value!r}); write "
                                  f"--{key.replace('_', '-')} {value} instead")
            changes[key] = False
            continue
        if not has_value:
            following = arguments[index] if index < len(arguments) else None
            takes_following = following is not None and (following.lower() in BOOL_WORDS or (
                type(None) in allowed and following.lower() in NULL_WORDS) or (
                str in allowed and not following.startswith("--")))  # a bool-or-word field: --cuda-graphs auto
            if bool in allowed and not takes_following:
                changes[key] = True  # a bare --flag
                continue
            if following is None or (following.startswith("--") and len(following) > 2):
                raise ConfigError(f"--{key.replace('_', '-')} needs a value ({type_name(hints[key])}), e.g. "
                                  f"--{key.replace('_', '-')} {example(key)}")
            value = following
            index += 1
        changes[key] = parse_value(key, value, hints[key], example)
    return changes


def choice_list(choices: Iterable[Any]) -> str:
    return ", ".join("null" if choice is None else str(choice) for choice in choices)


def yaml_line(name: str, value: Any) -> str:
    """``name: value`` as YAML; lists in flow style (``[q_proj, v_proj]``). Strings that would read
    back as another type (``'null'``, ``'2e-4'``) are quoted."""
    if isinstance(value, list):
        return f"{name}: " + yaml.dump(value, Dumper=YamlDumper, default_flow_style=True, width=1_000).strip()
    return yaml.dump({name: value}, Dumper=YamlDumper, default_flow_style=False, width=1_000).rstrip("\n")


class YamlLoader(yaml.SafeLoader):
    """SafeLoader that also reads YAML 1.2 floats without a dot (``2e-4``), which YAML 1.1 calls strings."""


class YamlDumper(yaml.SafeDumper):
    """SafeDumper that quotes the strings :class:`YamlLoader` would read as floats (``'2e-4'``)."""


for _resolving in (YamlLoader, YamlDumper):
    _resolving.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(
        r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))
del _resolving


__all__ = ["BOOL_WORDS", "FIELD_ALIASES", "NULL_WORDS", "SPELLED_OTHERWISE", "YamlDumper", "YamlLoader", "aliases_of", "allowed_types",
           "check_type", "choice_list", "format_gb", "human_bytes", "known_fields", "parse_budget", "parse_overrides",
           "parse_value", "report_to_names", "suggestion", "type_name", "yaml_line"]
