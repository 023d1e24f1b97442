"""Byte counts in words, the one place they are formatted; torch-free. Binary units for sizes people
read (``human_bytes``: ``poros doctor``, ``poros plan``'s host line, ``poros merge``) and decimal GB as
the bench and the results pages write them (``format_gb``: the planner and its report, ``poros
cache``). Two named functions because both forms are printed and asserted; everything else calls them."""

from __future__ import annotations


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
