"""Output helpers shared by the subcommands: fixed-width tables and JSON."""

from __future__ import annotations

import json
import sys
from typing import Any, Sequence


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Fixed-width text table: columns as wide as their widest cell, two spaces apart.

    A cell that is a list or tuple is joined with ``", "``; an empty cell prints as ``-``.
    """
    cells = [[_cell(value) for value in row] for row in rows]
    widths = [max(len(str(h)), *(len(row[i]) for row in cells)) for i, h in enumerate(headers)]
    lines = [[str(h).upper() for h in headers], ["-" * w for w in widths], *cells]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


def _cell(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        value = ", ".join(str(v) for v in value)
    text = "" if value is None else str(value)
    return text or "-"


def print_json(data: Any) -> None:
    """Pretty JSON on stdout; values JSON does not know (e.g. descriptor extras) print as ``str``."""
    json.dump(data, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")
