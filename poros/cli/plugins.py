"""``poros plugins``: which plugins are loaded, which distribution provides each, and what failed to load."""

from __future__ import annotations

import argparse
import os
import textwrap
from typing import Any

from poros.cli.output import print_json, table
from poros.registry import DEFAULT_PLUGINS

DESCRIPTION = """\
List the loaded Poros plugins: the built-in families ({families}: ordinary plugins of the
poros-train distribution) and every installed package that declares an entry point in the
group "poros". For each: the distribution and version that provides it, the hooks it
implements and the families it registered. Plugins that failed to load are listed after the
table. POROS_LOAD_PLUGINS limits which entry points load: unset loads all, empty loads the
built-ins only, "a,b" loads the entry points or distributions named.
"""

EPILOG = textwrap.dedent("""\
    examples:
      $ poros plugins                    # with examples/poros-family-example installed
      NAME                        DISTRIBUTION          VERSION  HOOKS                         FAMILIES
      --------------------------  --------------------  -------  ----------------------------  -----------
      poros.families.qwen2        poros-train           0.1.0    poros_register_architectures  qwen2
      poros.families.qwen3        poros-train           0.1.0    poros_register_architectures  qwen3
      poros.families.qwen3_5      poros-train           0.1.0    poros_register_architectures  qwen3_5
      poros.families.qwen3_5_moe  poros-train           0.1.0    poros_register_architectures  qwen3_5_moe
      poros.families.gemma3       poros-train           0.1.0    poros_register_architectures  gemma3
      poros.families.gemma4       poros-train           0.1.0    poros_register_architectures  gemma4
      llama                       poros-family-example  0.1.0    poros_register_architectures  llama

      $ POROS_LOAD_PLUGINS= poros plugins | tail -n 1
      POROS_LOAD_PLUGINS='': entry-point plugins were not loaded (built-ins only).

      $ poros plugins --json             # {"plugins": [...], "load_errors": [...], "POROS_LOAD_PLUGINS": null}
    """)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "plugins",
        help="list loaded plugins, who provides them, and load errors",
        description=DESCRIPTION.format(families=", ".join(name.rsplit(".", 1)[-1] for name in DEFAULT_PLUGINS)),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", action="store_true", help="print JSON: {plugins: [...], load_errors: [...]}")
    parser.set_defaults(run=run)
    return parser


def report() -> dict[str, Any]:
    """Loaded plugins (see :func:`poros.registry.plugin_listing`), load errors and the env setting."""
    from poros import registry

    plugins = registry.plugin_listing()
    return {
        "plugins": plugins,
        "load_errors": [{"plugin": name, "error": error} for name, error in registry.registry().load_errors],
        registry.LOAD_PLUGINS_ENV: os.environ.get(registry.LOAD_PLUGINS_ENV),
    }


def run(args: argparse.Namespace) -> int:
    from poros.registry import LOAD_PLUGINS_ENV

    data = report()
    if args.json:
        print_json(data)
        return 0
    print(table(
        ("name", "distribution", "version", "hooks", "families"),
        [(p["name"], p["distribution"], p["version"], p["hooks"], p["families"]) for p in data["plugins"]],
    ))
    setting = data[LOAD_PLUGINS_ENV]
    if setting is not None:
        print(f"\n{LOAD_PLUGINS_ENV}={setting!r}: " + (
            f"only the entry points or distributions {setting!r} were loaded besides the built-ins."
            if setting.strip() else "entry-point plugins were not loaded (built-ins only)."))
    if data["load_errors"]:
        print("\nFailed to load (skipped):")
        for failure in data["load_errors"]:
            print(f"  {failure['plugin']}: {failure['error']}")
    return 0
