"""``poros init``: write a commented ``poros.yaml`` holding every PorosConfig field at its default."""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path
from typing import Any

DEFAULT_PATH = "poros.yaml"

DESCRIPTION = """\
Write a training configuration: every PorosConfig field with its default value, one comment line
saying what it does and, where the choice is closed, the values it accepts. Edit the file, check
it with `poros train PATH --dry-run` (validates it and prints the memory plan without loading
weights), then train with `poros train PATH`. An existing file is never overwritten unless
--force is given.
"""

EPILOG = textwrap.dedent("""\
    examples:
      $ poros init
      poros init: wrote poros.yaml (model poros-tiny-qwen3, dataset poros-tiny-chat; every field is
      documented in the file and in docs/configuration.md)
      next:
        poros train poros.yaml --dry-run    # validate and print the memory plan, nothing loaded
        poros train poros.yaml              # train; the adapter goes to output_dir

      $ poros init runs/qwen32b.yaml --model Qwen/Qwen2.5-32B --dataset data/chat.jsonl

      $ poros init
      poros init: error: poros.yaml already exists; expected a path that does not exist yet. Pass
      --force to overwrite it, or give another PATH (poros init other.yaml).
    """)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "init",
        help="write a commented poros.yaml with every training setting",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("path", nargs="?", default=DEFAULT_PATH, metavar="PATH",
                        help=f"file to write (default: {DEFAULT_PATH})")
    parser.add_argument("--force", action="store_true", help="overwrite PATH if it exists")
    parser.add_argument("--model", help="model to put in the file (HF id, local directory or a bundled name)")
    parser.add_argument("--dataset", help="dataset to put in the file (HF id, .jsonl/.json/.csv, 'synthetic' "
                                          "or a bundled name)")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Write the YAML; a :class:`~poros.errors.ConfigError` (exit 1) when PATH exists without --force."""
    from poros.config import PorosConfig
    from poros.errors import ConfigError

    path = Path(args.path)
    if path.is_dir():
        raise ConfigError(f"{path} is a directory; expected a file name. Write e.g. `poros init "
                          f"{path / DEFAULT_PATH}`.")
    if path.exists() and not args.force:
        raise ConfigError(f"{path} already exists; expected a path that does not exist yet. Pass --force to "
                          f"overwrite it, or give another PATH (poros init other.yaml).")
    changes = {name: value for name, value in (("model", args.model), ("dataset", args.dataset))
               if value is not None}
    config = PorosConfig().replace(**changes)
    path.parent.mkdir(parents=True, exist_ok=True)
    config.to_yaml(path)
    print(f"poros init: wrote {path} (model {config.model}, dataset {config.dataset}; every field is documented "
          "in the file and in docs/configuration.md)")
    print("next:")
    print(f"  poros train {path} --dry-run    # validate and print the memory plan, nothing loaded")
    print(f"  poros train {path}              # train; the adapter goes to output_dir")
    return 0
