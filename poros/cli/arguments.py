"""The arguments ``poros train`` and ``poros plan`` share: ``[CONFIG] [--key value ...]``, kept past
argparse (:func:`keep_unknown_arguments`), split (:func:`split_arguments`) and read into a
:class:`~poros.config.PorosConfig` (:func:`load_config`). Torch-free."""

from __future__ import annotations

import argparse


def keep_unknown_arguments(parser: argparse.ArgumentParser) -> None:
    """Let ``CONFIG`` and ``--key value`` overrides through the top-level ``parse_args``.

    argparse hands a subcommand's arguments to the subparser's ``parse_known_args`` and rejects
    whatever comes back unparsed. This subparser returns nothing unparsed: every argument it does
    not know is kept, in order, in ``args.arguments`` for :func:`split_arguments` and
    :meth:`PorosConfig.apply_overrides <poros.config.PorosConfig.apply_overrides>`, which check
    them against the config's fields.
    """
    parse_known_args = parser.parse_known_args

    def keep_unknown(args=None, namespace=None):
        namespace, unknown = parse_known_args(args, namespace)
        namespace.arguments = list(unknown)
        return namespace, []

    parser.parse_known_args = keep_unknown  # type: ignore[method-assign]


def split_arguments(arguments: list[str]) -> tuple[str | None, list[str]]:
    """``["poros.yaml", "--steps", "5"]`` -> ``("poros.yaml", ["--steps", "5"])``: CONFIG is the first
    argument when it does not start with ``-``."""
    if arguments and not arguments[0].startswith("-"):
        return arguments[0], arguments[1:]
    return None, list(arguments)


def load_config(arguments: list[str]):
    """The :class:`~poros.config.PorosConfig` of ``[CONFIG] [--key value ...]``.

    Raises:
        ConfigError: an unreadable or invalid CONFIG, or a bad override (named, with the closest field).
    """
    from poros.config import PorosConfig

    config_path, overrides = split_arguments(arguments)
    config = PorosConfig.from_yaml(config_path) if config_path is not None else PorosConfig()
    return config.apply_overrides(overrides)


__all__ = ["keep_unknown_arguments", "load_config", "split_arguments"]
