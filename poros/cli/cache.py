"""``poros cache``: list the NF4 block cache's entries, or clear them. Torch-free."""

from __future__ import annotations

import argparse
import textwrap
from typing import Any

from poros.cli.output import print_json, table
from poros.spellings import format_gb

DESCRIPTION = """\
The NF4 block cache holds each quantized checkpoint's decoder blocks, packed exactly as Poros
streams them, so a later run maps them instead of reading and quantizing the checkpoint again.
It lives in --cache-dir, else $POROS_CACHE_DIR, else ~/.cache/poros. See
docs/cache-and-host-memory.md.

  poros cache                   list the entries: model, quantization, size, last use
  poros cache clear             remove every entry
  poros cache clear --model X   remove the entries of model X (as given to --model)
"""

EPILOG = textwrap.dedent("""\
    examples:
      $ poros cache
      NAME                                       MODEL             CONFIG              SIZE      LAST USE
      -----------------------------------------  ----------------  ------------------  --------  ----------------
      poros-tiny-qwen3-baaab3c62eee78fcff07a3d2  poros-tiny-qwen3  nf4 bfloat16 cpu    490.0 kB  2026-12-01 02:05

      $ poros cache clear --model Qwen/Qwen2.5-32B
      removed 1 entry (Qwen--Qwen2.5-32B-...)
    """)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "cache", help="list or clear the NF4 block cache (quantized blocks of earlier loads)",
        description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", nargs="?", choices=("list", "clear"), default="list",
                        help="list (default) or clear entries")
    parser.add_argument("--model", help="with clear: only the entries of this model (HF id or path as loaded)")
    parser.add_argument("--cache-dir", help="the cache root (default: $POROS_CACHE_DIR, else ~/.cache/poros)")
    parser.add_argument("--json", action="store_true", help="list as JSON")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from poros.loading import cache

    root = cache.cache_root(args.cache_dir)
    if args.action == "clear":
        removed = cache.clear(root, args.model)
        print(f"removed {len(removed)} entr{'y' if len(removed) == 1 else 'ies'}"
              f"{' (' + ', '.join(removed) + ')' if removed else ''} from {root}")
        return 0
    entries = cache.list_entries(root)
    if args.json:
        print_json([{"name": e.name, "model": e.model, "config": e.config, "bytes": e.size,
                     "last_use": e.last_use.isoformat(timespec="seconds") if e.last_use else None,
                     "problem": e.problem} for e in entries])
        return 0
    if not entries:
        print(f"no entries in {root}")
        return 0
    print(table(("name", "model", "config", "size", "last use"),
                [(e.name, e.model, e.problem or e.config, format_gb(e.size),
                  e.last_use.strftime("%Y-%m-%d %H:%M") if e.last_use else "-") for e in entries]))
    print(f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'}, {format_gb(sum(e.size for e in entries))} in {root}")
    return 0
