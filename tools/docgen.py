"""The one write-or-check step of the docs generators (tools/gen_*_docs.py).

``python tools/gen_X_docs.py`` rewrites its page; ``--check`` exits 1 when the page on disk is
not what the generator would write (the tests run that, so a page cannot drift from its data).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]


def main(description: str, page: Path, render: Callable[[str], str], argv: list[str] | None = None) -> int:
    """Parse ``--check``; ``render(current page text or "")`` gives the fresh page text."""
    parser = argparse.ArgumentParser(description=description.strip().splitlines()[0])
    parser.add_argument("--check", action="store_true", help=f"exit 1 if {page.relative_to(ROOT)} is stale")
    args = parser.parse_args(argv)
    current = page.read_text(encoding="utf-8") if page.exists() else ""
    fresh = render(current)
    if args.check:
        if fresh != current:
            print(f"{page.relative_to(ROOT)} is stale: run python {Path(sys.argv[0]).as_posix()}", file=sys.stderr)
            return 1
        return 0
    if fresh != current:
        page.write_text(fresh, encoding="utf-8")
        print(f"rewrote {page.relative_to(ROOT)}")
    return 0
