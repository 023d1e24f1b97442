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


def _model_missing_a_shard(tmp: Path) -> Path:
    import shutil

    from poros.assets import asset_path

    model = tmp / "copied-model"
    shutil.copytree(asset_path("poros-tiny-qwen3"), model)
    (model / "model-00002-of-00003.safetensors").unlink()  # a copy cut short: the index still names it
    return model


NO_TRAINABLE = {
    "only-user-turns": ([{"messages": [{"role": "user", "content": "hi"}]}] * 3, [],
                        "needs an assistant message"),
    "answers-beyond-seq-len": ([{"messages": [{"role": "user", "content": "word " * 200},
                                              {"role": "assistant", "content": "ok"}]}] * 3, ["--seq-len", "16"],
                               "raise seq_len"),
}


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "train"])
@pytest.mark.parametrize("case", [*NO_TRAINABLE, "index-lists-a-missing-shard"])
def test_a_run_that_would_fail_after_loading_fails_before_and_leaves_no_output_dir(case, dry_run, tmp_path,
                                                                                   monkeypatch, capsys):
    """Both used to pass --dry-run and fail only after the model loaded, leaving an empty output dir."""
    import poros.loading.load

    monkeypatch.chdir(tmp_path)
    out_dir = tmp_path / "runs" / "first"
    argv = ["train", *(["--dry-run"] if dry_run else []), "--device", "cpu", "--output-dir", str(out_dir)]
    if case == "index-lists-a-missing-shard":
        argv += ["--model", str(_model_missing_a_shard(tmp_path))]
        error, fix = "CheckpointLoadError", "1 is missing from"
    else:
        records, extra, fix = NO_TRAINABLE[case]
        argv += ["--dataset", str(write_jsonl(tmp_path / "data.jsonl", records)), *extra]
        error = "DataError"

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the failure was found")

    monkeypatch.setattr(poros.loading.load, "load_pretrained", no_loading)
    status, out, err = run_cli(argv, capsys)
    assert status == 1 and "Traceback" not in out + err, err[-3000:]
    line = error_line(err, "train")
    assert line.startswith(f"poros train: error: {error}: ") and fix in line, line
    assert not (tmp_path / "runs").exists(), "an empty output dir was left behind"


def test_a_dry_run_still_passes_when_a_later_record_is_trainable(tmp_path, capsys):
    records = [{"messages": [{"role": "user", "content": "hi"}]}] * 40 + CHAT  # the first 32 train nothing
    status, out, err = run_cli(["train", "--dry-run", "--dataset", str(write_jsonl(tmp_path / "d.jsonl", records)),
                                "--output-dir", str(tmp_path / "out")], capsys)
    assert status == 0, err[-3000:]


def test_a_python_run_that_fails_on_its_data_leaves_no_empty_output_dir(tmp_path):
    from poros.training.trainer import PorosTrainer

    trainer = PorosTrainer.from_pretrained("poros-tiny-qwen3", device="cpu", seq_len=64, steps=1)
    with pytest.raises(errors.DataError, match="needs an assistant message"):
        trainer.train([{"messages": [{"role": "user", "content": "hi"}]}] * 2, output_dir=str(tmp_path / "a" / "b"))
    assert not (tmp_path / "a").exists()
    (tmp_path / "kept").mkdir()  # a directory the user made stays, even empty
    with pytest.raises(errors.DataError):
        trainer.train([{"messages": [{"role": "user", "content": "hi"}]}] * 2, output_dir=str(tmp_path / "kept"))
    assert (tmp_path / "kept").is_dir() and not list((tmp_path / "kept").iterdir())


# -- disk full at a checkpoint: what is kept, said honestly, and a resume command that resumes ------------
def _disk_full_in_checkpoints(monkeypatch, *, from_step: int) -> None:
    """Every write into checkpoint-{from_step} and later raises ENOSPC (the adapter save is not a checkpoint)."""
    import re

    from poros.training import checkpoint

    real = checkpoint.write_json

    def full(path, payload):
        found = re.search(r"checkpoint-(\d+)", str(path))
        if found and int(found.group(1)) >= from_step:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(path, payload)

    monkeypatch.setattr(checkpoint, "write_json", full)


def test_disk_full_before_the_first_checkpoint_keeps_the_adapter_and_says_nothing_resumes(tmp_path, monkeypatch,
                                                                                         capsys):
    """It lost every step and printed `--resume_from auto`, which starts afresh."""
    out_dir = tmp_path / "out"
    _disk_full_in_checkpoints(monkeypatch, from_step=1)
    status, out, err = run_cli(["train", *TRAIN_FAST, "--steps", "2", "--save-steps", "2", "--dataset",
                                str(write_jsonl(tmp_path / "chat.jsonl", CHAT)), "--output-dir", str(out_dir)], capsys)
    assert status == 1 and "Traceback" not in out + err
    line = error_line(err, "train")
    assert line.startswith("poros train: error: OutputDirError: could not write ") and "checkpoint-2 at step 2" in line
    assert "No space left on device" in line and "nothing to resume" in line and "resume_from auto" not in line
    assert f"the adapter of step 2 was saved to {out_dir}" in line and "--overwrite" in line, line
    assert "free disk space" in line
    names = sorted(p.name for p in out_dir.iterdir())
    assert "adapter_model.safetensors" in names and not [n for n in names if "checkpoint-" in n], names
    record = json.loads((out_dir / "poros_config.json").read_text())
    assert record["steps_done"] == 2


def test_disk_full_after_a_checkpoint_prints_the_command_that_resumes_it(tmp_path, monkeypatch, capsys):
    import shlex

    out_dir = tmp_path / "out"
    dataset = write_jsonl(tmp_path / "chat.jsonl", CHAT)
    _disk_full_in_checkpoints(monkeypatch, from_step=2)
    status, out, err = run_cli(["train", *TRAIN_FAST, "--steps", "3", "--save-steps", "1", "--schedule", "constant",
                                "--dataset", str(dataset), "--output-dir", str(out_dir)], capsys)
    assert status == 1
    line = error_line(err, "train")
    assert "earlier saves are intact, the newest is checkpoint-1 and step 2 is lost" in line, line
    command = line.split("then resume from it with: ", 1)[1]
    argv = shlex.split(command)
    assert argv[:2] == ["poros", "train"] and argv[-2:] == ["--resume_from", str(out_dir / "checkpoint-1")], argv
    monkeypatch.undo()  # the disk has room again: the printed command continues the run
    status, out, err = run_cli(argv[1:], capsys)
    assert status == 0, err[-3000:]
    assert f"resumed from {out_dir / 'checkpoint-1'} at step 1/3" in out
    assert json.loads((out_dir / "poros_config.json").read_text())["steps_done"] == 3


# -- 2-4. a first real run, piped as into a log: output a user can pass on, and no noise -----------------
REPO_ROOT = Path(__file__).resolve().parents[1]


def _child_env(**overrides: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)  # an in-process CLI test of this session may have set it
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.update(POROS_LOAD_PLUGINS="", OMP_NUM_THREADS="1", **overrides)
    return env


@pytest.fixture(scope="module")
def piped_run(tmp_path_factory) -> dict:
    """``poros train --model small64`` (a relative path) from its directory, stdout and stderr piped."""
    import shutil

    from poros.assets import asset_path

    root = tmp_path_factory.mktemp("piped")
    shutil.copytree(asset_path("poros-tiny-qwen3"), root / "small64")
    dataset = write_jsonl(root / "chat.jsonl", CHAT * 2)
    result = subprocess.run(
        [sys.executable, "-m", "poros.cli.main", "train", "--model", "small64", *TRAIN_FAST, "--logging-steps", "2",
         "--steps", "3", "--save-steps", "2", "--eval-split", "0.25", "--eval-steps", "2", "--dataset", str(dataset),
         "--output-dir", "out"], capture_output=True, text=True, timeout=600, cwd=root, env=_child_env())
    assert result.returncode == 0, result.stderr[-3000:]
    return {"root": root, "out": root / "out", "stdout": result.stdout, "stderr": result.stderr}


def test_a_piped_run_has_no_progress_bar_redraws_and_no_known_notice(piped_run):
    text = piped_run["stdout"] + piped_run["stderr"]
    assert "Loading weights" not in text and "\r" not in text, piped_run["stderr"][-2000:]
    assert "kernels-community" not in text and "Token indices sequence length" not in text


def test_the_run_says_the_truth_about_determinism_on_the_cpu(piped_run):
    """The config says deterministic: true, and the CPU run printed "deterministic algorithms off"."""
    line = next(line for line in piped_run["stdout"].splitlines() if line.startswith("poros: platform "))
    assert "deterministic algorithms off" not in line
    assert "deterministic (CPU kernels; torch's deterministic-algorithms switch only matters on CUDA)" in line


def test_the_run_ends_with_a_summary_line_whose_final_loss_is_a_window_mean(piped_run):
    import re

    line = next(line for line in piped_run["stdout"].splitlines() if line.startswith("poros: trained "))
    assert re.fullmatch(r"poros: trained 3 steps in \d+\.\d s \([\d,]+ tokens, [\d,]+ tokens/s\); loss \d+\.\d{4} "
                        r"\(mean of steps 2-3\); best eval_loss \d+\.\d{4} at step [23]", line), line


def test_summary_line_reports_the_mean_the_log_lines_use():
    from poros.training.model_card import summary_line

    line = summary_line(steps=12, losses=[9.0] * 10 + [2.0, 4.0], log_history=[
        {"step": 10, "eval_loss": 3.5}, {"step": 12, "eval_loss": 3.25}], logging_steps=10, seconds=125.0, tokens=5000)
    assert line == ("poros: trained 12 steps in 2m05s (5,000 tokens, 40 tokens/s); loss 7.8000 (mean of steps 3-12); "
                    "best eval_loss 3.2500 at step 12")
    assert "loss 4.0000 (step 1)" in summary_line(steps=1, losses=[4.0], log_history=[], logging_steps=10,
                                                   seconds=1.0, tokens=1)


def test_every_file_written_is_readable_by_others(piped_run):
    """adapter_model.safetensors was written 0600 (safetensors' own writer), the rest 0644."""
    from poros.training.checkpoint import plain_file_mode

    files = [p for p in piped_run["out"].rglob("*") if p.is_file() and p.name != ".poros.lock"]
    assert any(p.name == "adapter_model.safetensors" and p.parent == piped_run["out"] for p in files)
    modes = {str(p.relative_to(piped_run["out"])): oct(p.stat().st_mode & 0o777) for p in files}
    assert set(modes.values()) == {oct(plain_file_mode())}, modes


def test_the_adapter_names_its_base_so_stock_peft_and_merge_find_it_from_anywhere(piped_run, tmp_path, monkeypatch,
                                                                                 capsys):
    """adapter_config.json said `small64` (relative to where training ran) or `poros-tiny-qwen3` (an alias
    only Poros knows); stock PEFT and `poros merge` from another directory could not find the base."""
    from peft import AutoPeftModelForCausalLM

    base = str((piped_run["root"] / "small64").resolve())
    assert json.loads((piped_run["out"] / "adapter_config.json").read_text())["base_model_name_or_path"] == base
    assert json.loads((piped_run["out"] / "poros_config.json").read_text())["base_model_name_or_path"] == base
    assert json.loads((piped_run["out"] / "poros_config.json").read_text())["config"]["model"] == "small64"
    monkeypatch.chdir(tmp_path)  # somewhere else: a relative name would not resolve here
    model = AutoPeftModelForCausalLM.from_pretrained(piped_run["out"])
    assert model.peft_config["default"].base_model_name_or_path == base
    status, out, err = run_cli(["merge", "--adapter", str(piped_run["out"]), "--output", str(tmp_path / "merged")],
                               capsys)
    assert status == 0, err[-2000:]
    assert (tmp_path / "merged" / "config.json").is_file()


def test_the_bundled_model_is_named_by_its_path():
    from poros.assets import asset_path
    from poros.training.model_card import base_model_reference

    assert base_model_reference("poros-tiny-qwen3") == str(asset_path("poros-tiny-qwen3"))
    assert base_model_reference("Qwen/Qwen2.5-7B") == "Qwen/Qwen2.5-7B"


def test_the_model_card_says_what_trained_the_adapter(piped_run):
    """It was PEFT's template: "[More Information Needed]" in every field."""
    import re

    card = (piped_run["out"] / "README.md").read_text()
    record = json.loads((piped_run["out"] / "poros_config.json").read_text())
    assert "[More Information Needed]" not in card
    assert card.startswith("---\n") and "library_name: peft" in card
    assert f"| base model | `{record['base_model_name_or_path']}` |" in card
    assert f"`{piped_run['root'] / 'chat.jsonl'}`" in card and "seq_len 64" in card
    assert "| steps | 3 of 3 |" in card and "(mean of steps 2-3)" in card and "logged: " in card
    assert re.search(r"\| eval loss \| best \d+\.\d{4} at step [23] of 2 evaluations \|", card), card
    assert f"| guarantee | `{record['guarantee']}`: " in card and f"| Poros | {record['poros_version']} |" in card
    assert "poros train --model small64 " in card and "--output-dir out" in card


def test_poros_doctor_hides_the_kernels_community_notice():
    result = subprocess.run([sys.executable, "-m", "poros.cli.main", "doctor", "--quick"], capture_output=True,
                            text=True, timeout=300, env=_child_env())
    assert "Failed to load CPU gemm_4bit_forward" not in result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr


# -- 3. a visible drop-in ---------------------------------------------------------------------------------
@pytest.mark.parametrize("entry", ["prepare", "prepare_trainer", "PorosCallback"])
def test_the_drop_in_says_in_one_stderr_line_that_it_took_effect(entry, small64, capsys):
    """It went to the `poros` logger at INFO, which no script configures: a user saw nothing."""
    from types import SimpleNamespace

    import poros
    from poros.testing import load_qlora

    model = load_qlora(small64["base"], lora_rank=4, lora_alpha=8)
    capsys.readouterr()
    args = SimpleNamespace(torch_compile=False)
    if entry == "prepare":
        prepared = poros.prepare(model)
    elif entry == "prepare_trainer":
        prepared = poros.prepare_trainer(SimpleNamespace(args=args, model=model))
    else:
        callback = poros.PorosCallback()
        callback.on_init_end(args, None, None, model=model)
        prepared = callback.model
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.startswith("poros: ")]
    assert lines == [f"poros: streaming qwen3: 2 of 2 decoder blocks from the host (pinned) through 2 device slots "
                     f"on cpu; guarantee {prepared.detection.guarantee}"], err
    assert "poros:" not in out
    prepared.unpatch()


def test_poros_trainer_prints_its_detection_instead_of_the_banner(capsys):
    from poros.training.trainer import PorosTrainer

    PorosTrainer.from_pretrained("poros-tiny-qwen3", device="cpu")
    out, err = capsys.readouterr()
    assert "poros: streaming" not in out + err
    assert "poros: family qwen3" in out


# -- 4. noise: plural forms -------------------------------------------------------------------------------
def test_one_new_token_is_singular():
    from poros.export.generate import Generation

    assert Generation("hi", "x", [5], 3, 0.5).summary().startswith("poros: 1 new token after a 3-token prompt")
    assert Generation("hi", "xy", [5, 6], 3, 0.5).summary().startswith("poros: 2 new tokens after")
