"""Install poros and examples/poros-family-example as wheels into a fresh venv, as a user would.

Proves, end to end and outside this checkout: the entry point group ``poros`` is honoured, the
example's family is listed with its distribution, ``POROS_LOAD_PLUGINS`` selects plugins, and
the wheel ships the registry TOML files. Wheels are built here (``--no-build-isolation``: no
download) from a copy of the sources, so no stale ``build/`` folder can leak into them; the venv
gets pluggy and pyyaml copied from this environment, so nothing is fetched.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import BUILTIN_FAMILIES

SKIP_COPY = shutil.ignore_patterns(".git", ".venv", "venv", "build", "dist", "*.egg-info", "__pycache__",
                                   ".hypothesis", ".pytest_cache", "poros_output")


def run(command: list, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run([str(c) for c in command], capture_output=True, text=True, timeout=120, check=False,
                            **kwargs)
    assert result.returncode == 0, f"{command} failed:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def venv(tmp_path_factory, repo_root) -> Path:
    """A fresh venv holding exactly poros-train, poros-family-example, pluggy and pyyaml."""
    root = tmp_path_factory.mktemp("example-plugin")
    created = subprocess.run([sys.executable, "-m", "venv", root / "venv"], capture_output=True, text=True,
                             timeout=120, check=False)
    if created.returncode != 0:
        pytest.skip(f"cannot create a venv here: {created.stderr.strip()[-300:]}")
    python = root / "venv" / "bin" / "python"

    source = root / "src"
    shutil.copytree(repo_root, source, ignore=SKIP_COPY)
    run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "--wheel-dir", root / "wheels", source, source / "examples" / "poros-family-example"])
    wheels = sorted((root / "wheels").glob("*.whl"))
    assert [w.name.split("-")[0] for w in wheels] == ["poros_family_example", "poros_train"]
    run([python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", *wheels])

    site_packages = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    for module in ("pluggy", "yaml", "_yaml"):
        spec = importlib.util.find_spec(module)
        if spec is not None and spec.submodule_search_locations:
            shutil.copytree(spec.submodule_search_locations[0], site_packages / module, ignore=SKIP_COPY)
    return root / "venv"


def in_venv(venv: Path, program: str, *argv: str, **env_overrides: str) -> subprocess.CompletedProcess:
    """Run ``venv/bin/<program>`` outside the checkout, with no variable that could point back into it."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "POROS_LOAD_PLUGINS", "POROS_REGISTRY_DIR")}
    env.update(env_overrides)
    return run([venv / "bin" / program, *argv], env=env, cwd=venv.parent)


def poros_cli(venv: Path, *argv: str, **env_overrides: str) -> subprocess.CompletedProcess:
    return in_venv(venv, "poros", *argv, **env_overrides)


def table_column(output: str) -> list[str]:
    return [line.split()[0] for line in output.splitlines()[2:] if line.strip()]


def test_example_family_is_listed_with_its_distribution(venv):
    listing = poros_cli(venv, "list-architectures").stdout
    assert table_column(listing) == [*BUILTIN_FAMILIES, "llama"]
    llama_row = listing.splitlines()[-1].split()
    assert llama_row[:4] == ["llama", "llama", "poros-family-example", "0.1.0"]

    plugins = json.loads(poros_cli(venv, "plugins", "--json").stdout)
    example = next(p for p in plugins["plugins"] if p["name"] == "llama")
    assert example["distribution"] == "poros-family-example" and example["families"] == ["llama"]
    assert example["builtin"] is False and plugins["load_errors"] == []


@pytest.mark.parametrize(("setting", "expected"), [
    ("", BUILTIN_FAMILIES),
    ("llama", [*BUILTIN_FAMILIES, "llama"]),
    ("poros-family-example", [*BUILTIN_FAMILIES, "llama"]),
    ("some-other-plugin", BUILTIN_FAMILIES),
], ids=["empty", "entry-point", "distribution", "other"])
def test_load_plugins_env_in_an_installed_venv(venv, setting, expected):
    listing = poros_cli(venv, "list-architectures", "--json", POROS_LOAD_PLUGINS=setting).stdout
    assert [family["name"] for family in json.loads(listing)] == expected


def test_the_installed_wheel_is_used_and_ships_the_registry_data(venv, repo_root):
    report = json.loads(poros_cli(venv, "doctor", "--json").stdout)
    assert Path(report["poros"]["location"]).is_relative_to(venv)
    probe = ("import json, poros.records as r; "
             "print(json.dumps({'dir': str(r.data_dir()), 'families': r.all_families()}))")
    shipped = json.loads(in_venv(venv, "python", "-c", probe).stdout)
    assert Path(shipped["dir"]).is_relative_to(venv)
    assert shipped["families"] == sorted(p.stem for p in (repo_root / "registry").glob("*.toml"))


def test_example_descriptor_meets_the_contract(repo_root, monkeypatch):
    """The example's Llama descriptor describes the real LlamaForCausalLM (docs/plugins.md shows this test)."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from poros.testing import check_descriptor

    monkeypatch.syspath_prepend(str(repo_root / "examples" / "poros-family-example"))
    from poros_family_example import DESCRIPTOR

    for options in ({}, {"attention_bias": True, "mlp_bias": True}, {"tie_word_embeddings": True}):
        config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, **options)
        assert check_descriptor(DESCRIPTOR, transformers.LlamaForCausalLM(config)) == [], options


def test_example_parity_test_builds_its_tiny_model_through_poros_testing(repo_root):
    """The example's own test suite (examples/poros-family-example/tests): its tiny Llama comes from
    the ``TINY_VARIANTS`` it declares next to its descriptor, through ``poros.testing``, and trains
    bit for bit as the resident reference."""
    pytest.importorskip("torch")
    pytest.importorskip("bitsandbytes")
    example = repo_root / "examples" / "poros-family-example"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo_root), str(example)]), "OMP_NUM_THREADS": "1"}
    env.pop("POROS_LOAD_PLUGINS", None)
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"], cwd=example,
                            capture_output=True, text=True, timeout=600, check=False, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "2 passed" in result.stdout
