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
    "poros.cli.cache",
    "poros.cli.quantize",
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
  $ poros cache                       # the NF4 block cache: quantized blocks of earlier loads
  $ poros train --host-tier disk --host-budget 16GiB   # host RAM smaller than the model
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


def error_line(command: str, error: BaseException) -> str:
    """``poros train: error: DataError: <message on one line>`` -- the one line a failure prints."""
    message = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    return f"poros {command}: error: {type(error).__name__}: {message}"


def _reinstall_hint() -> str:
    from poros.cli.doctor import INSTALL_HINT

    return f"{INSTALL_HINT}, then `poros doctor` to see what is installed."


def _os_error_fix(error: OSError) -> str:
    import errno

    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return "free disk space, or pass an --output-dir on another disk"
    if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "pass paths you can read and write, or fix their permissions"
    return "check the path in the message"


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0 ok, 1 a Poros error, 2 a usage error).

    A failure prints one line, ``poros COMMAND: error: ErrorClass: what was found ... Fix: ...``, and
    no traceback; ``POROS_DEBUG=1`` re-raises it with its traceback instead.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    debug = os.environ.get("POROS_DEBUG", "").strip() not in ("", "0")
    try:
        return args.run(args)
    except BrokenPipeError:  # `poros ... | head`: the reader left; exit quietly like other Unix tools
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except PorosError as exc:
        if debug:
            raise
        print(error_line(args.command, exc), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"poros {args.command}: interrupted.", file=sys.stderr)
        return 130
    except ImportError as exc:  # a package of the train extra that this install lacks (a core-only install)
        if debug:
            raise
        from poros.training.validation import RUN_PACKAGES, missing_dependency

        package = (exc.name or "").partition(".")[0]
        if package not in (*RUN_PACKAGES, "datasets"):
            print(f"{error_line(args.command, exc)} -- a broken install? Fix: {_reinstall_hint()}", file=sys.stderr)
            return 1
        print(error_line(args.command, missing_dependency(f"poros {args.command}", [package])), file=sys.stderr)
        return 1
    except OSError as exc:  # a file system error no check foresaw (a disk filled mid-run...)
        if debug:
            raise
        print(f"{error_line(args.command, exc)}. Fix: {_os_error_fix(exc)}.", file=sys.stderr)
        return 1
    except Exception as exc:  # a bug: one line, and how to get the traceback for the report
        if debug:
            raise
        print(f"{error_line(args.command, exc)} -- this is a bug in Poros or a library it calls. Fix: rerun with "
              "POROS_DEBUG=1 for the traceback and report it with the output of `poros doctor`.", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
