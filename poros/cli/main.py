"""``poros``: the command-line entry point (``poros.cli.main:main``).

Each subcommand lives in its own module (listed in :data:`SUBCOMMANDS`) that defines
``add_parser(subparsers)`` -- which builds its parser with help, description and an epilog of real
example sessions, and sets ``run`` as the parser default -- and ``run(args) -> int``.
Nothing here imports torch; a subcommand that needs it imports it inside ``run``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from poros import __version__
from poros.errors import PorosError

SUBCOMMANDS = (
    "poros.cli.init",
    "poros.cli.train",
    "poros.cli.plan",
    "poros.cli.merge",
    "poros.cli.generate",
    "poros.cli.list_architectures",
    "poros.cli.plugins",
    "poros.cli.doctor",
)

EPILOG = """\
examples:
  $ poros train                       # bundled tiny Qwen3 + bundled chat data on the CPU -> ./poros_output
  $ poros init                        # write a commented poros.yaml with every setting
  $ poros train poros.yaml --dry-run  # validate it and print the memory plan; nothing is loaded
  $ poros train poros.yaml --steps 50 --lr 1e-4   # any setting can be overridden by name
  $ poros plan poros.yaml --vram-budget 8GiB      # slots, resident blocks, peak and step for a budget
  $ poros merge --adapter ./poros_output --output ./merged   # adapter into its base, tensor by tensor
  $ poros generate --adapter ./poros_output --prompt "Hi"    # try the adapter (greedy, tokens/s)
  $ poros doctor                      # versions, memory, plugins, CUDA, cards, the link: paste-ready
  $ poros list-architectures          # the model families this install can stream
  $ poros plugins                     # which package provides each family
  $ poros list-architectures --json   # the same, machine-readable

Run `poros COMMAND --help` for the options of one command.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="poros",
        description=(
            "Poros fine-tunes large LLMs (QLoRA) on small GPUs by streaming the frozen NF4 base "
            "block by block, bit-for-bit identical to resident training."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"poros {__version__}")
    subparsers = parser.add_subparsers(title="commands", dest="command", metavar="COMMAND")
    for module_name in SUBCOMMANDS:
        importlib.import_module(module_name).add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0 ok, 1 a Poros error, 2 a usage error)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return args.run(args)
    except PorosError as exc:
        print(f"poros {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `poros ... | head`: the reader left; exit quietly like other Unix tools
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
