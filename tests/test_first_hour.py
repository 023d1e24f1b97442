"""A newcomer's first hour: what a first ``poros train`` / ``merge`` / ``generate`` meets, in the spirit of
tests/test_bad_input.py -- every failure one line naming the fix, nothing lost that could be kept, and
output a user can pass on (a stock-PEFT-loadable adapter, a model card, honest summary lines).

Each case runs the CLI in-process (``poros.cli.main.main``) or the API, and asserts the behaviour a
user sees: the exit status, the one error line and its fix, the files left behind.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from poros import errors
from poros.cli.main import main

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TRAIN_FAST = ["--seq-len", "64", "--device", "cpu", "--logging-steps", "1"]
CHAT = [{"messages": [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5."}]},
        {"messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]}]


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def error_line(stderr: str, command: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith(f"poros {command}: error: ")]
    assert lines, f"no error line in stderr:\n{stderr[-3000:]}"
    return lines[-1]


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        status = main(argv)
    except SystemExit as exit_:
        status = exit_.code
    out, err = capsys.readouterr()
    return status, out, err


@pytest.fixture(scope="module")
def small64(tmp_path_factory) -> dict:
    """A tiny Qwen3 base of hidden size 64 and an adapter trained (as Poros saves it) on it."""
    from poros.testing import load_qlora, save_tiny_checkpoint

    root = tmp_path_factory.mktemp("small64")
    base = save_tiny_checkpoint(root / "small64", "qwen3")
    adapter = root / "adapter64"
    load_qlora(base, lora_rank=4, lora_alpha=8).save_pretrained(adapter)
    return {"base": base, "adapter": adapter}


def _never_loaded(monkeypatch) -> None:
    import poros.dropin.with_adapter
    import poros.loading.load

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the failure was found")

    monkeypatch.setattr(poros.loading.load, "load_pretrained", no_loading)
    monkeypatch.setattr(poros.dropin.with_adapter, "load_pretrained", no_loading)


# -- 1. crashes and misleading errors become one line naming the fix ---------------------------------
@pytest.mark.parametrize("chat", ["--no-chat", "--chat"])
@pytest.mark.parametrize("prompt", ["", "   "], ids=["empty", "blank"])
def test_an_empty_prompt_is_refused_before_the_model_loads(prompt, chat, small64, monkeypatch, capsys):
    """Raw, an empty prompt died with SIGFPE in bitsandbytes' CPU kernel; chat-wrapped, it answered a turn
    nobody wrote (one token)."""
    _never_loaded(monkeypatch)
    status, out, err = run_cli(["generate", "--adapter", str(small64["adapter"]), "--model", str(small64["base"]),
                                "--prompt", prompt, chat], capsys)
    assert status == 1 and "Traceback" not in out + err
    line = error_line(err, "generate")
    assert line.startswith("poros generate: error: ConfigError: the prompt is ") and "--prompt" in line, line


def test_generate_text_refuses_an_empty_prompt_before_any_kernel():
    from transformers import AutoTokenizer

    from poros.assets import asset_path
    from poros.export.generate import generate_text

    tokenizer = AutoTokenizer.from_pretrained(asset_path("poros-tiny-qwen3"))
    assert tokenizer.chat_template  # the chat-wrapped case: it used to generate from the template alone
    with pytest.raises(errors.ConfigError, match="the prompt is empty"):
        generate_text(object(), tokenizer, "")  # no model is touched: the check comes first


@pytest.mark.parametrize("command", ["merge", "generate"])
def test_an_adapter_of_another_base_is_named_in_one_line(command, small64, tmp_path, monkeypatch, capsys):
    """An adapter trained on hidden 64, pointed at the bundled base (hidden 128): it said "this is a bug in
    Poros ... report it" (generate: in one 11,948-character line)."""
    _never_loaded(monkeypatch)
    argv = [command, "--adapter", str(small64["adapter"]), "--model", "poros-tiny-qwen3"]
    argv += ["--output", str(tmp_path / "merged")] if command == "merge" else ["--prompt", "hi"]
    status, out, err = run_cli(argv, capsys)
    assert status == 1 and "Traceback" not in out + err
    line = error_line(err, command)
    assert line.startswith(f"poros {command}: error: CheckpointLoadError: "), line
    assert "trained on a base with hidden size 64, this base (poros-tiny-qwen3) has 128" in line, line
    assert "pass --model" in line and "bug" not in line and len(line) < 700, line
    assert not (tmp_path / "merged").exists() and not list(tmp_path.glob(".merged*"))


def test_an_adapter_that_fits_passes_the_check(small64):
    import transformers

    from poros.export.adapter_fit import adapted_shapes, check_adapter_fits

    config = transformers.AutoConfig.from_pretrained(small64["base"])
    weights = small64["adapter"] / "adapter_model.safetensors"
    assert len(adapted_shapes(weights)) == 2 * 7  # two blocks, seven linears each
    check_adapter_fits(small64["adapter"], weights, str(small64["base"]), config)


def test_an_adapter_of_another_intermediate_size_names_the_module(small64, tmp_path):
    import transformers

    from poros.export.adapter_fit import check_adapter_fits

    config = transformers.AutoConfig.from_pretrained(small64["base"])
    config.intermediate_size = 256  # same hidden size, a wider MLP: the message names module and shapes
    with pytest.raises(errors.CheckpointLoadError, match=r"mlp\.down_proj maps 128 -> 64 features, the base's "
                                                         r"layer 256 -> 64"):
        check_adapter_fits(small64["adapter"], small64["adapter"] / "adapter_model.safetensors", "wide", config)


@pytest.fixture
def tmpfs_or_patch(monkeypatch):
    """``make(directory)``: ``directory`` becomes unwritable -- a read-only tmpfs mounted on it where this
    process may mount, else ``os.open`` refusing writes inside it (the tests run as root, which chmod does not
    stop). Returns whether a real mount was made."""
    import shutil

    mounted: list[Path] = []

    def make(directory: Path) -> bool:
        directory.mkdir(parents=True, exist_ok=True)
        if shutil.which("mount") and subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs",
                                                     str(directory)], capture_output=True).returncode == 0:
            mounted.append(directory)
            return True
        real_open = os.open

        def guarded_open(path, flags, *args, **kwargs):
            if str(path).startswith(str(directory)) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
            return real_open(path, flags, *args, **kwargs)

        monkeypatch.setattr(os, "open", guarded_open)
        return False

    yield make
    for directory in mounted:
        subprocess.run(["umount", "-l", str(directory)], capture_output=True)


@pytest.mark.parametrize("where", ["read-only-file-system", "under-a-regular-file"])
def test_an_unwritable_cache_dir_warns_naming_both_fixes_and_trains(where, tmp_path, tmpfs_or_patch, monkeypatch,
                                                                     capsys, caplog):
    """On a read-only file system the run stopped with a raw OSError naming neither POROS_CACHE_DIR nor
    --no-cache; under a regular file it warned and trained. Now both warn alike, naming both, and train."""
    if where == "read-only-file-system":
        tmpfs_or_patch(tmp_path / "ro")
        cache = tmp_path / "ro"  # the directory exists: mkdir passes, the lock file is where it failed
    else:
        (tmp_path / "notes").write_text("a file")
        cache = tmp_path / "notes" / "cache"
    monkeypatch.setenv("POROS_CACHE_DIR", str(cache))
    out_dir = tmp_path / "out"
    with caplog.at_level("WARNING", logger="poros"):
        status, out, err = run_cli(["train", *TRAIN_FAST, "--steps", "1", "--dataset",
                                    str(write_jsonl(tmp_path / "chat.jsonl", CHAT)), "--output-dir", str(out_dir)],
                                   capsys)
    assert status == 0, err[-3000:]
    warnings = [r.getMessage() for r in caplog.records if "NF4 block cache" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert f"at {cache} (" in warnings[0] and "comes from POROS_CACHE_DIR" in warnings[0]
    assert "training without the cache" in warnings[0]
    assert "set POROS_CACHE_DIR" in warnings[0] and "--no-cache" in warnings[0]
    assert (out_dir / "adapter_model.safetensors").is_file()
