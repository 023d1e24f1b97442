"""The ``poros`` CLI, in-process and as a subprocess: list-architectures, plugins, doctor."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

import poros
from poros import records, registry
from poros.cli import doctor
from poros.cli.main import SUBCOMMANDS, main
from poros.descriptor import decoder_family
from poros.testing.plugins import registered_plugin

from conftest import BUILTIN_FAMILIES

LLAMA = decoder_family(name="llama", display_name="Llama", model_types=("llama",),
                       causal_lm_classes=("LlamaForCausalLM",))


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def table_column(output: str, column: int = 0) -> list[str]:
    """Cells of one column of a fixed-width table (rows after the header and its dashes)."""
    return [line.split()[column] for line in output.splitlines()[2:] if line.strip()]


# -- the parser ------------------------------------------------------------------------------

def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"poros {poros.__version__}"


def test_help_lists_every_subcommand_and_each_has_examples(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    top = capsys.readouterr().out
    commands = [module.rsplit(".", 1)[-1].replace("_", "-") for module in SUBCOMMANDS]
    for command in commands:
        assert command in top
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = capsys.readouterr().out
        assert f"usage: poros {command}" in text and "examples:" in text and f"$ poros {command}" in text


def test_no_command_prints_help_and_fails(capsys):
    status, out, _ = run_cli(capsys)
    assert status == 2 and "usage: poros" in out


# -- list-architectures ------------------------------------------------------------------------

def test_list_architectures_table(capsys):
    status, out, _ = run_cli(capsys, "list-architectures")
    assert status == 0
    header = out.splitlines()[0].split()
    assert header[:2] == ["NAME", "HF"] and "PROVIDER" in header and "STATUS" in header
    names = table_column(out)
    assert names == [r.descriptor.name for r in registry.architectures()]
    assert names[:len(BUILTIN_FAMILIES)] == BUILTIN_FAMILIES
    assert "qwen3_5_text, qwen3_5" in out and f"poros-train {poros.__version__}" in out


def test_list_architectures_json(capsys):
    status, out, _ = run_cli(capsys, "list-architectures", "--json")
    assert status == 0
    families = json.loads(out)
    assert [f["name"] for f in families][:len(BUILTIN_FAMILIES)] == BUILTIN_FAMILIES
    gemma4 = next(f for f in families if f["name"] == "gemma4")
    assert gemma4["model_types"] == ["gemma4_text", "gemma4"]
    assert gemma4["distribution"] == "poros-train" and gemma4["plugin"] == "poros.families.gemma4"
    assert gemma4["status"] in records.LABELS
    assert gemma4["descriptor"]["carried_state"][0]["kwarg"] == "shared_kv_states"


def test_list_architectures_shows_status_and_platforms_from_the_records(capsys, monkeypatch, tmp_path):
    (tmp_path / "qwen3.toml").write_text(
        'family = "qwen3"\n\n[[validation]]\nplatform = "NVIDIA H200"\nlabel = "bitwise"\n\n'
        '[[validation]]\nplatform = "cpu-x86_64"\nlabel = "numerical"\n'
    )
    monkeypatch.setattr(records, "data_dir", lambda: tmp_path)
    _, out, _ = run_cli(capsys, "list-architectures")
    rows = {line.split()[0]: line for line in out.splitlines()[2:]}
    assert "bitwise" in rows["qwen3"] and "NVIDIA H200 (bitwise), cpu-x86_64 (numerical)" in rows["qwen3"]
    assert "unverified" in rows["qwen2"]


def test_list_architectures_includes_plugin_families(capsys, family_plugin):
    with registered_plugin(family_plugin(LLAMA, name="llama-plugin")):
        _, out, _ = run_cli(capsys, "list-architectures", "--json")
    llama = json.loads(out)[-1]
    assert llama["name"] == "llama" and llama["plugin"] == "llama-plugin"


def test_a_registry_error_exits_1_with_the_message(capsys, family_plugin):
    with registered_plugin(family_plugin(decoder_family(
        name="llama", display_name="Llama", model_types=("qwen2",), causal_lm_classes=("LlamaForCausalLM",)
    ), name="clashing-plugin")):
        status, out, err = run_cli(capsys, "list-architectures")
    assert status == 1 and out == ""
    assert err.startswith("poros list-architectures: error: DuplicateArchitectureError: 'qwen2' is claimed twice")
    assert "clashing-plugin" in err


# -- plugins ---------------------------------------------------------------------------------

def test_plugins_table_and_json(capsys, family_plugin):
    status, out, _ = run_cli(capsys, "plugins")
    assert status == 0
    assert table_column(out)[:len(BUILTIN_FAMILIES)] == [f"poros.families.{name}" for name in BUILTIN_FAMILIES]
    with registered_plugin(family_plugin(LLAMA, name="llama-plugin")):
        _, out, _ = run_cli(capsys, "plugins", "--json")
    data = json.loads(out)
    by_name = {p["name"]: p for p in data["plugins"]}
    assert by_name["poros.families.qwen2"]["distribution"] == "poros-train"
    assert by_name["poros.families.qwen2"]["builtin"] is True
    assert by_name["llama-plugin"]["families"] == ["llama"]
    assert by_name["llama-plugin"]["hooks"] == ["poros_register_architectures"]
    assert data["load_errors"] == []


# -- doctor ----------------------------------------------------------------------------------

def test_doctor_json_fields(capsys):
    status, out, _ = run_cli(capsys, "doctor", "--json")
    assert status == 0
    data = json.loads(out)
    assert data["poros"]["version"] == poros.__version__
    assert data["python"]["version"] == ".".join(map(str, sys.version_info[:3]))
    assert set(data["packages"]) == {*doctor.TRAIN_PACKAGES, *doctor.OPTIONAL_PACKAGES}
    assert data["memory"]["total_bytes"] > 0 and data["memory"]["source"]
    assert data["cpus"]["usable"] >= 1
    assert data["plugins"]["families"][:len(BUILTIN_FAMILIES)] == BUILTIN_FAMILIES and data["plugins"]["problems"] == []
    missing = [name for name in doctor.TRAIN_PACKAGES if data["packages"][name] is None]
    assert data["missing_train_packages"] == missing
    assert data["install_hint"] == (doctor.INSTALL_HINT if missing else None)


def test_doctor_text_is_a_paste_ready_block(capsys):
    status, out, _ = run_cli(capsys, "doctor")
    lines = out.strip().splitlines()
    assert status == 0 and lines[0] == "```text" and lines[-1] == "```"
    labels = [line.split()[0] for line in lines[1:-1] if not line.startswith(" ")]
    host = ["poros", "python", "platform", "cpus", "memory", "nvidia", "packages", "plugins"]
    # with torch importable the GPU half follows (poros.doctor.diagnostics; tests/test_doctor_gpu.py)
    if torch.cuda.is_available():
        assert labels[:10] == [*host, "torch", "cuda:0"] and labels[-1] == "problems"
    else:
        assert labels == [*host, "torch", "gpu", "graphs", "bitsandbytes", "pinned", "link", "notes", "problems"]


def test_doctor_reports_missing_training_packages_with_the_install_hint(capsys, monkeypatch):
    monkeypatch.setattr(doctor, "installed_version", lambda name: None if name in ("torch", "peft") else "1.0")
    status, out, _ = run_cli(capsys, "doctor")
    assert status == 0  # a torch-free install is valid
    text = " ".join(out.split())  # the block wraps long lines
    assert "torch not installed" in text
    assert "not installed for training: torch, peft; install with pip install 'poros-train[train]'" in text


def test_doctor_reports_plugin_problems_and_exits_1(capsys, family_plugin):
    class Misspelled:
        @poros.hookimpl
        def poros_register_architecture(self, register):
            pass

    manager = registry.registry().plugin_manager
    plugin = Misspelled()
    manager.register(plugin, name="misspelled-plugin")
    try:
        status, out, _ = run_cli(capsys, "doctor", "--json")
    finally:
        manager.unregister(plugin)
    problems = json.loads(out)["plugins"]["problems"]
    assert status == 1 and len(problems) == 1
    assert problems[0].startswith("PluginError: plugin 'misspelled-plugin'")

    with registered_plugin(family_plugin(decoder_family(
        name="qwen2", display_name="Qwen2 again", model_types=("qwen2x",), causal_lm_classes=("X",)
    ), name="clashing-plugin")):
        status, out, _ = run_cli(capsys, "doctor")
    assert status == 1 and "DuplicateArchitectureError: 'qwen2' is claimed twice" in out


def test_doctor_train_packages_match_the_train_extra(repo_root):
    pyproject = tomllib.loads((repo_root / "pyproject.toml").read_text())
    extra = pyproject["project"]["optional-dependencies"]["train"]
    names = [requirement.split(">")[0].split("=")[0].split("<")[0].split("[")[0].strip() for requirement in extra]
    assert names == list(doctor.TRAIN_PACKAGES)


# -- as a subprocess ------------------------------------------------------------------------

def run_subprocess(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=60, check=False)


def test_subprocess_list_architectures_and_doctor(child_env):
    env = child_env(POROS_LOAD_PLUGINS="")  # built-ins only, whatever else is installed
    module = [sys.executable, "-m", "poros.cli.main"]
    table = run_subprocess([*module, "list-architectures"], env)
    assert table.returncode == 0, table.stderr
    assert table_column(table.stdout) == BUILTIN_FAMILIES
    as_json = run_subprocess([*module, "list-architectures", "--json"], env)
    assert [f["name"] for f in json.loads(as_json.stdout)] == BUILTIN_FAMILIES
    report = run_subprocess([*module, "doctor", "--json"], env)
    assert report.returncode == 0, report.stderr
    assert json.loads(report.stdout)["plugins"]["POROS_LOAD_PLUGINS"] == ""
    plugins = run_subprocess([*module, "plugins"], env)
    assert plugins.returncode == 0 and "entry-point plugins were not loaded (built-ins only)" in plugins.stdout


def test_console_script(child_env):
    script = shutil.which("poros", path=str(Path(sys.executable).parent))
    if script is None:
        pytest.skip("the `poros` console script is not installed in this environment (pip install -e . adds it)")
    result = run_subprocess([script, "list-architectures"], child_env(POROS_LOAD_PLUGINS=""))
    assert result.returncode == 0, result.stderr
    assert table_column(result.stdout) == BUILTIN_FAMILIES
