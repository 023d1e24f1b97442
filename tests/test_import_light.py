"""``import poros`` and the listing commands must work where the ML stack cannot be imported.

A child Python installs a meta-path finder that refuses every heavy package before it imports
poros, then checks that nothing outside the standard library and the core dependencies
(pluggy, pyyaml) was imported.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

BLOCKED = ("torch", "transformers", "peft", "bitsandbytes", "accelerate", "datasets", "safetensors", "numpy")

CHILD = textwrap.dedent("""\
    import importlib.abc, json, sys

    BLOCKED = set(sys.argv[1].split(","))

    class Blocker(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in BLOCKED:
                # what Python raises for a package that is not installed (a core install)
                raise ModuleNotFoundError(f"{name} is blocked by test_import_light", name=name)
            return None

    sys.meta_path.insert(0, Blocker())
    before = set(sys.modules)

    import poros
    assert "torch" not in sys.modules
    families = [r.descriptor.name for r in poros.registry.architectures()]

    import poros.config
    config = poros.PorosConfig().apply_overrides(["--steps", "5"])
    assert poros.config.PorosConfig.from_dict(config.to_dict()) == config and "steps: 5" in config.to_yaml()

    from poros.cli.main import main
    statuses = {}
    for argv in (["list-architectures"], ["list-architectures", "--json"], ["plugins"], ["plugins", "--json"],
                 ["doctor"], ["doctor", "--json"]):
        statuses[" ".join(argv)] = main(argv)
    for argv in (["--help"], ["--version"], ["doctor", "--help"], ["init", "--help"], ["train", "--help"],
                 ["plan", "--help"]):
        try:
            main(argv)
        except SystemExit as exit_:
            statuses[" ".join(argv)] = exit_.code

    imported = {name.partition(".")[0] for name in set(sys.modules) - before}
    # PyYAML's C extension (_yaml) is compiled with Cython, which registers its runtime modules.
    cython = {name for name in imported if name == "cython_runtime" or name.startswith("_cython_")}
    foreign = sorted(imported - set(sys.stdlib_module_names) - {"poros", "pluggy", "yaml", "_yaml"} - cython)
    print("RESULT " + json.dumps({"families": families, "statuses": statuses, "foreign": foreign}))
""")


def test_poros_and_the_cli_run_without_the_ml_stack(child_env):
    result = subprocess.run(
        [sys.executable, "-c", CHILD, ",".join(BLOCKED)],
        capture_output=True, text=True, timeout=60, check=False, env=child_env(POROS_LOAD_PLUGINS=""),
    )
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))
    outcome = json.loads(line.removeprefix("RESULT "))
    assert outcome["families"] == ["qwen2", "qwen3", "qwen3_5", "qwen3_5_moe", "gemma3", "gemma4"]
    assert len(outcome["statuses"]) == 12
    assert all(status == 0 for status in outcome["statuses"].values()), outcome["statuses"]
    assert outcome["foreign"] == [], f"imported beyond stdlib + core deps: {outcome['foreign']}"
    assert "is blocked" not in result.stderr


def test_the_blocker_really_blocks(child_env):
    # Guards the test above: if the blocker let torch through, that test would prove nothing.
    probe = CHILD.split("before = set(sys.modules)")[0] + "import torch\n"
    result = subprocess.run([sys.executable, "-c", probe, ",".join(BLOCKED)],
                            capture_output=True, text=True, timeout=60, check=False, env=child_env())
    assert result.returncode != 0 and "torch is blocked by test_import_light" in result.stderr
