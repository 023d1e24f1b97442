"""``poros list-architectures``: the model families this install can stream, and how well each is validated."""

from __future__ import annotations

import argparse
import textwrap
from typing import Any

from poros.cli.output import print_json, table

DESCRIPTION = """\
List every registered model family: its registry name, the HF config.model_type values it
claims, the plugin distribution that provides it, its guarantee label from the validation
records in the registry data (bitwise, numerical or unverified) and the platforms those records
come from. Built-in families and third-party plugins are listed alike.
"""

EPILOG = textwrap.dedent("""\
    examples:
      $ poros list-architectures         # with examples/poros-family-example installed
      NAME     HF MODEL TYPES         PROVIDER                    STATUS      VALIDATED PLATFORMS
      -------  ---------------------  --------------------------  ----------  -------------------
      qwen2    qwen2                  poros-train 0.1.0           unverified  -
      qwen3    qwen3                  poros-train 0.1.0           unverified  -
      qwen3_5  qwen3_5_text, qwen3_5  poros-train 0.1.0           unverified  -
      gemma3   gemma3_text, gemma3    poros-train 0.1.0           unverified  -
      gemma4   gemma4_text, gemma4    poros-train 0.1.0           unverified  -
      llama    llama                  poros-family-example 0.1.0  unverified  -

      $ POROS_LOAD_PLUGINS= poros list-architectures --json | python -c \\
          "import json, sys; print([f['name'] for f in json.load(sys.stdin)])"
      ['qwen2', 'qwen3', 'qwen3_5', 'gemma3', 'gemma4']
    """)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "list-architectures",
        help="list the registered model families and their validation status",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", action="store_true", help="print JSON (one object per family, full descriptor)")
    parser.set_defaults(run=run)
    return parser


def rows() -> list[dict[str, Any]]:
    """One dict per registered family: identity, provider, status, platforms, checkpoints, descriptor."""
    from poros import records, registry

    out = []
    for registration in registry.architectures():
        descriptor = registration.descriptor
        out.append({
            "name": descriptor.name,
            "display_name": descriptor.display_name,
            "model_types": list(descriptor.model_types),
            "aliases": list(descriptor.aliases),
            "plugin": registration.plugin,
            "distribution": registration.distribution,
            "version": registration.version,
            "status": records.status(descriptor.name),
            "validated_platforms": records.validated_platforms(descriptor.name),
            "checkpoints": [
                hf_id for entry in records.checkpoints(descriptor.name) for hf_id in records.checkpoint_ids(entry)
            ],
            "descriptor": descriptor.to_dict(),
        })
    return out


def run(args: argparse.Namespace) -> int:
    families = rows()
    if args.json:
        print_json(families)
        return 0
    print(table(
        ("name", "HF model types", "provider", "status", "validated platforms"),
        [(f["name"], f["model_types"], f"{f['distribution']} {f['version']}", f["status"], f["validated_platforms"])
         for f in families],
    ))
    return 0
