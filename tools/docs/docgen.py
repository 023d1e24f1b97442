"""The one write-or-check step of the docs generators (tools/docs/gen_*.py).

``python -m tools.docs.gen_X`` rewrites its page; ``--check`` exits 1 when the page on disk is
not what the generator would write (the tests run that, so a page cannot drift from its data).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]


def accum_label(config: dict) -> str:
    """A run's micro-batches per optimizer step, with the Poros schedule when there are several, and
    where the Poros arm kept AdamW's state when it was not the device, CUDA graphs, a chunked loss, a tiled
    MLP and host-kept boundary states."""
    accum = config.get("grad_accum", 1)
    label = str(accum) if accum == 1 else f"{accum} ({config.get('schedule', 'micro-major')})"
    label += ", AdamW state on the host" if config.get("optimizer_states") == "host" else ""
    label += ", CUDA graphs" if config.get("cuda_graphs") else ""
    label += f", loss in {config['loss_chunks']} chunks" if config.get("loss_chunks", 1) > 1 else ""
    label += f", MLP in {config['mlp_chunks']} chunks" if config.get("mlp_chunks", 1) > 1 else ""
    return label + (", boundary states on the host" if config.get("boundary_states") == "host" else "")


def arm_label(name: str, arm: dict) -> str:
    """A bench arm's name as the results tables print it: ``trl-poros + liger`` where the arm trained Liger's
    kernels (``tools/bench --liger``: the arm's ``kernels`` record), else the name."""
    return f"{name} + liger" if arm.get("kernels") else name


def shared_mark(record: dict) -> str:
    """`` (GPU shared)`` after the step time of a run that shared the GPU with another process (the ``shared_gpu``
    note its record carries, added when it was collected): its times are not clean; its memory and parity are."""
    return " (GPU shared)" if record.get("shared_gpu") else ""


def parity_label(comparison: dict | None) -> str:
    """A bench comparison in words: ``bitwise (0.0)``, or how far the losses differ; ``-`` for none."""
    if not comparison:
        return "-"
    if comparison.get("bitwise"):
        return "bitwise (0.0)"
    return f"differs (loss {comparison['max_diff_loss']:.1e})"


def json_link(path: Path, label: str | None = None) -> str:
    """A table cell linking a record under ``registry/`` from a page in ``docs/``: ``[label](../path)``, the
    file's name by default."""
    return f"[{label or path.name}](../{path.relative_to(ROOT).as_posix()})"


def rows_or_pending(rows: list[str]) -> str:
    """A generated table's text: its two header rows and its rows, or, while no H200 run has made a row, one row
    saying so (as wide as the header)."""
    if len(rows) == 2:
        rows = [*rows, "| pending the H200 run " + "| " * (rows[0].count("|") - 2) + "|"]
    return "\n".join(rows)


def fill_blocks(page_text: str, blocks: dict[str, Callable[[], str]], page: Path) -> str:
    """Replace the text between ``<!-- BEGIN GENERATED: name -->`` and ``<!-- END GENERATED: name -->``
    with ``blocks[name]()`` for every name; the prose around the markers is kept."""
    for name, function in blocks.items():
        pattern = re.compile(rf"(<!-- BEGIN GENERATED: {name} -->\n).*?(<!-- END GENERATED: {name} -->)", re.S)
        if not pattern.search(page_text):
            raise SystemExit(f"{page}: no generated block {name!r}; add the BEGIN/END markers")
        page_text = pattern.sub(lambda m: m.group(1) + function() + "\n" + m.group(2), page_text)
    return page_text


class NotRenderable(Exception):
    """A generated file this machine cannot write byte for byte (a package the file is pinned to is missing or at
    another version); the message says which and how to install it."""


def main(description: str, page: Path, render: Callable[[str], str], argv: list[str] | None = None,
         files: dict[Path, Callable[[], bytes]] | None = None) -> int:
    """Parse ``--check``; ``render(current page text or "")`` gives the fresh page text, ``files`` the generated files
    beside it (a plot the page shows) and the function that renders each one's bytes."""
    parser = argparse.ArgumentParser(description=description.strip().splitlines()[0])
    parser.add_argument("--check", action="store_true", help=f"exit 1 if {page.relative_to(ROOT)} is stale")
    args = parser.parse_args(argv)
    current = page.read_text(encoding="utf-8") if page.exists() else ""
    fresh = render(current)
    generator = f"python -m tools.docs.{Path(sys.argv[0]).stem}"
    status = 0
    if args.check and fresh != current:
        print(f"{page.relative_to(ROOT)} is stale: run {generator}", file=sys.stderr)
        status = 1
    elif not args.check and fresh != current:
        page.write_text(fresh, encoding="utf-8")
        print(f"rewrote {page.relative_to(ROOT)}")
    for path, render_file in (files or {}).items():
        name = path.relative_to(ROOT)
        try:
            data = render_file()
        except NotRenderable as reason:
            print(f"{name} not {'checked' if args.check else 'rewritten'}: {reason}", file=sys.stderr)
            status = status if args.check else 1
            continue
        if (path.read_bytes() if path.exists() else None) == data:
            continue
        if args.check:
            print(f"{name} is stale: run {generator}", file=sys.stderr)
            status = 1
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            print(f"rewrote {name}")
    return status


def main_for_blocks(description: str, page: Path, blocks: dict[str, Callable[[], str]], argv: list[str] | None = None,
                    *, quiet: bool = False, files: dict[Path, Callable[[], bytes]] | None = None) -> int:
    """:func:`main` for a page of generated blocks (:func:`fill_blocks`) and the ``files`` beside it; ``quiet``:
    transformers' warnings and log lines off (a generator that builds configs)."""
    if quiet:
        import logging
        import warnings

        warnings.filterwarnings("ignore")
        logging.getLogger("transformers").setLevel(logging.ERROR)
    return main(description, page, lambda text: fill_blocks(text, blocks, page), argv, files)
