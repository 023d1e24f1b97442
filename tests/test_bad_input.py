"""The bad-input suite: every failure a user can walk into ends in one error line, never a traceback,
and never costs an earlier result.

Each case of :data:`CLI_CASES` runs ``poros`` in-process (``poros.cli.main.main``, the same path as the
console script) and asserts: the exit status (1 for a Poros error, 2 for usage, 0 where the bad input
is handled), the error line ``poros CMD: error: ErrorClass: ...`` with the fix in it, no ``Traceback``
on stdout or stderr, and that the files the case protects (an earlier run's adapter, checkpoints,
metrics, the dataset) are byte for byte unchanged. :data:`API_CASES` do the same through
``PorosTrainer`` (one model loaded for the module). A few cases run as real subprocesses to show that
nothing reaches the terminal but the error line: core-only installs, a concurrent run,
``POROS_DEBUG=1``.

How the hard situations are made honestly -- the tests run as root, which ``chmod`` does not stop:

* **no write permission**: a read-only tmpfs mounted over the directory when this process may mount;
  else ``os.open`` patched to raise ``PermissionError(EACCES)`` for paths inside it.
* **disk full**: a 1 MiB tmpfs as ``output_dir`` when mountable; and, always, ``write_json`` patched
  to raise ``OSError(ENOSPC)`` in the middle of a checkpoint save.
* **a concurrent run**: a real ``poros train`` subprocess holding the directory.
* **a core-only install**: a child Python where ``torch``/``transformers``/``peft``/``bitsandbytes``/
  ``safetensors`` cannot be imported (``sys.modules[name] = None``, which makes ``import`` raise).

``test_docs_follow_the_suite`` keeps docs/own-data.md's troubleshooting table and
docs/api-reference.md's errors table in step with these cases.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from poros import errors
from poros.cli.main import main

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROOT = Path(__file__).resolve().parents[1]
TRAIN_FAST = ["--seq-len", "64", "--device", "cpu", "--logging-steps", "1"]
CHAT = [{"messages": [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5."}]},
        {"messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]}]


# -- helpers --------------------------------------------------------------------------------------
def write_jsonl(path: Path, records: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def snapshot(*paths: Path) -> dict[str, str]:
    """sha256 of every file under ``paths`` (a file or a directory), keyed by path."""
    digest = {}
    for root in paths:
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for file in files:
            digest[str(file)] = hashlib.sha256(file.read_bytes()).hexdigest()
    return digest


def error_line(stderr: str, command: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith(f"poros {command}: error: ")]
    assert lines, f"no error line in stderr:\n{stderr[-3000:]}"
    return lines[-1]


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@contextlib.contextmanager
def tmpfs(directory: Path, options: str):
    """Mount a tmpfs with ``options`` on ``directory``; yields False (nothing mounted) where mounting is not allowed."""
    directory.mkdir(parents=True, exist_ok=True)
    mounted = shutil.which("mount") and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(directory)], capture_output=True, check=False
    ).returncode == 0
    try:
        yield bool(mounted)
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(directory)], capture_output=True, check=False)


@dataclass
class Case:
    """One bad situation for the CLI.

    ``prepare(tmp, ctx)`` makes the situation and returns the argv; ``keep(tmp, ctx)`` names the
    files that must come through unchanged; ``patch(monkeypatch, tmp)`` fakes what cannot be made.
    """

    id: str
    prepare: Callable[[Path, dict], list[str]]
    error: str | None  # the error class on the error line; None: the command succeeds
    fix: str = ""  # a piece of the fix that the error line must hold
    code: int = 1
    keep: Callable[[Path, dict], list[Path]] = lambda tmp, ctx: []
    patch: Callable[[Any, Path], None] | None = None
    doc_row: str | None = None  # the row of docs/own-data.md's troubleshooting table this message matches
    needs_run: bool = False  # uses the finished run (a model load to build it, once per module)
    absent: str = ""  # a piece the error line must not hold (a flag the user did not give)
    max_chars: int = 0  # the error line's longest length (0: not checked)


# -- situations -----------------------------------------------------------------------------------
def _dataset(records_or_text: Any, name: str = "data.jsonl") -> Callable[[Path, dict], list[str]]:
    def prepare(tmp: Path, ctx: dict) -> list[str]:
        path = tmp / name
        if isinstance(records_or_text, bytes):
            path.write_bytes(records_or_text)
        elif isinstance(records_or_text, str):
            path.write_text(records_or_text, encoding="utf-8")
        else:
            write_jsonl(path, records_or_text)
        return ["train", "--dry-run", "--dataset", str(path), "--output-dir", str(tmp / "out")]
    return prepare


def _keep_dataset(name: str = "data.jsonl") -> Callable[[Path, dict], list[Path]]:
    return lambda tmp, ctx: [tmp / name]


def _copy_run(tmp: Path, ctx: dict) -> Path:
    run = tmp / "run"
    shutil.copytree(ctx["finished_run"], run)
    return run


def _resume(damage: Callable[[Path], None], checkpoint: str = "checkpoint-2") -> Callable[[Path, dict], list[str]]:
    def prepare(tmp: Path, ctx: dict) -> list[str]:
        run = _copy_run(tmp, ctx)
        damage(run / checkpoint)
        return ["train", *ctx["run_args"], "--output-dir", str(run), "--resume_from", str(run / checkpoint)]
    return prepare


def _keep_run(tmp: Path, ctx: dict) -> list[Path]:
    return [tmp / "run"]


def _fresh_into_run(*extra: str) -> Callable[[Path, dict], list[str]]:
    def prepare(tmp: Path, ctx: dict) -> list[str]:
        run = _copy_run(tmp, ctx)
        return ["train", *extra, *ctx["run_args"], "--output-dir", str(run)]
    return prepare


def _locked_by(pid: Callable[[], int], host: Callable[[], str] = socket.gethostname, *extra: str):
    def prepare(tmp: Path, ctx: dict) -> list[str]:
        out = tmp / "out"
        out.mkdir()
        (out / ".poros.lock").write_text(json.dumps({"pid": pid(), "host": host(), "started": "2026-01-01T00:00:00Z",
                                                     "command": "poros train --steps 1000"}))
        return ["train", "--dry-run", *extra, "--output-dir", str(out)]
    return prepare


def _results_without_checkpoints(tmp: Path) -> Path:
    """What a finished run with save_steps 0 leaves: an adapter and metrics, no checkpoint."""
    out = tmp / "out"
    out.mkdir()
    (out / "adapter_model.safetensors").write_bytes(b"adapter")
    (out / "metrics.jsonl").write_text(json.dumps({"step": 10, "loss": 1.0}) + "\n")
    return out


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid  # reaped: no process has it (pids are not reused this fast)


def _model_dir(config: dict | None) -> Callable[[Path, dict], list[str]]:
    def prepare(tmp: Path, ctx: dict) -> list[str]:
        model = tmp / "model"
        model.mkdir()
        if config is not None:
            (model / "config.json").write_text(json.dumps(config))
        return ["train", "--dry-run", "--model", str(model), "--output-dir", str(tmp / "out")]
    return prepare


def _other_weights(tmp: Path) -> Path:
    """The bundled base with every weight moved a little: the same shapes, other weights."""
    from safetensors.torch import load_file, save_file

    from poros.assets import asset_path

    base = tmp / "other-base"
    shutil.copytree(asset_path("poros-tiny-qwen3"), base)
    for shard in base.glob("*.safetensors"):
        tensors = load_file(shard)
        save_file({name: t + 1e-3 if t.is_floating_point() else t for name, t in tensors.items()}, shard,
                  metadata={"format": "pt"})
    return base


def _patch_unwritable(monkeypatch, tmp: Path) -> None:
    """No write permission inside ``tmp/ro`` (root ignores mode bits: refuse at the system call instead)."""
    real_open = os.open
    blocked = str(tmp / "ro")

    def guarded_open(path, flags, *args, **kwargs):
        if str(path).startswith(blocked) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", guarded_open)


def _patch_unreadable_dataset(monkeypatch, tmp: Path) -> None:
    real_open = Path.open

    def guarded(self, *args, **kwargs):
        if self.name == "secret.jsonl":
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", guarded)


def _patch_offline_hub(monkeypatch, tmp: Path) -> None:
    """Offline, empty caches; ``datasets.load_dataset`` must not even be called (it would retry for ~35 s)."""
    import datasets

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp / "datasets-cache"))

    def never(*args, **kwargs):
        raise AssertionError("datasets.load_dataset was called for an id that is not cached while offline")

    monkeypatch.setattr(datasets, "load_dataset", never)


HUMAN_GPT = [{"messages": [{"role": "human", "content": "hi"}, {"role": "gpt", "content": "hello"}]}] * 3

CLI_CASES = [
    # -- output directory
    Case("output-dir-is-a-file", lambda tmp, ctx: (tmp / "taken").write_text("notes") and
         ["train", "--dry-run", "--output-dir", str(tmp / "taken")], "OutputDirError", "pass --output-dir",
         keep=lambda tmp, ctx: [tmp / "taken"]),
    Case("train-output-dir-is-a-file", lambda tmp, ctx: (tmp / "taken").write_text("notes") and
         ["train", *TRAIN_FAST, "--output-dir", str(tmp / "taken")], "OutputDirError", "pass --output-dir",
         keep=lambda tmp, ctx: [tmp / "taken"]),
    Case("output-dir-under-a-file", lambda tmp, ctx: (tmp / "taken").write_text("notes") and
         ["train", "--dry-run", "--output-dir", str(tmp / "taken" / "run")], "OutputDirError", "under a directory"),
    Case("output-dir-not-writable", lambda tmp, ctx: (tmp / "ro").mkdir() or
         ["train", *TRAIN_FAST, "--output-dir", str(tmp / "ro" / "run")], "OutputDirError", "you can write to",
         patch=_patch_unwritable),
    Case("output-dir-locked-by-a-live-run", _locked_by(os.getppid), "RunLockedError", "another --output-dir",
         keep=lambda tmp, ctx: [tmp / "out"]),
    Case("output-dir-locked-from-another-host", _locked_by(os.getpid, lambda: "elsewhere.example"), "RunLockedError",
         "delete", keep=lambda tmp, ctx: [tmp / "out"]),
    Case("stale-lock-of-a-dead-run-is-taken-over",
         lambda tmp, ctx: _locked_by(_dead_pid)(tmp, ctx)[2:] and
         ["train", *TRAIN_FAST, "--steps", "1", "--dataset", str(write_jsonl(tmp / "chat.jsonl", CHAT)),
          "--output-dir", str(tmp / "out")], None, code=0),
    Case("fresh-run-into-another-runs-results", _fresh_into_run(), "OutputDirError", "--resume_from auto",
         keep=_keep_run, needs_run=True),
    Case("dry-run-into-another-runs-results", _fresh_into_run("--dry-run"), "OutputDirError", "--overwrite",
         keep=_keep_run, needs_run=True),
    Case("dry-run-into-another-runs-results-with-overwrite", _fresh_into_run("--dry-run", "--overwrite"), None,
         code=0, keep=_keep_run, needs_run=True),  # a dry run validates; it removes nothing
    Case("resume-auto-into-a-finished-run-without-checkpoints", lambda tmp, ctx: _results_without_checkpoints(tmp) and
         ["train", "--dry-run", "--resume_from", "auto", "--output-dir", str(tmp / "out")], "OutputDirError",
         "holds no checkpoint to resume). Fix: pass another --output-dir (output_dir=), or --overwrite",
         keep=lambda tmp, ctx: [tmp / "out"]),
    # -- device
    Case("train-device-cuda-on-cpu-torch", lambda tmp, ctx: ["train", "--device", "cuda", "--output-dir",
                                                             str(tmp / "out")], "DeviceError", "--device cpu"),
    Case("dry-run-device-cuda-on-cpu-torch", lambda tmp, ctx: ["train", "--dry-run", "--device", "cuda"],
         "DeviceError", "--device cpu"),
    Case("plan-device-cuda-on-cpu-torch", lambda tmp, ctx: ["plan", "--device", "cuda", "--vram-budget", "8GiB"],
         "DeviceError", "--device cpu"),
    # -- model
    Case("model-dir-does-not-exist", lambda tmp, ctx: ["train", *TRAIN_FAST, "--model", str(tmp / "no-such-model"),
                                                       "--output-dir", str(tmp / "out")],
         "CheckpointLoadError", "Pass an existing directory"),
    Case("model-dir-without-config", _model_dir(None), "CheckpointLoadError", "config.json"),
    Case("model-type-unknown-to-transformers", _model_dir({"model_type": "llama9000"}), "CheckpointLoadError",
         "does not know; did you mean 'llama'? Fix: correct model_type", absent="git+https", max_chars=400),
    Case("model-of-a-family-poros-does-not-stream", _model_dir({"model_type": "gpt2", "n_layer": 2}),
         "UnknownArchitectureError", "poros plugins"),
    Case("model-is-a-file", lambda tmp, ctx: (tmp / "weights.bin").write_bytes(b"\0" * 16) and
         ["train", "--dry-run", "--model", str(tmp / "weights.bin")], "CheckpointLoadError", "Pass the directory"),
    Case("dry-run-hub-model-not-cached", lambda tmp, ctx: ["train", "--dry-run", "--model", "no-org/no-model-xyz"],
         "CheckpointLoadError", "hf download"),
    # -- configuration
    Case("config-file-missing", lambda tmp, ctx: ["train", "--dry-run", str(tmp / "poros.yaml")], "ConfigError",
         "poros init"),
    Case("config-file-broken-yaml", lambda tmp, ctx: (tmp / "poros.yaml").write_text("steps: [1\n") and
         ["train", "--dry-run", str(tmp / "poros.yaml")], "ConfigError", "poros init",
         keep=lambda tmp, ctx: [tmp / "poros.yaml"]),
    Case("config-file-not-a-mapping", lambda tmp, ctx: (tmp / "poros.yaml").write_text("- steps\n") and
         ["train", "--dry-run", str(tmp / "poros.yaml")], "ConfigError", "poros init"),
    Case("config-file-unknown-key", lambda tmp, ctx: (tmp / "poros.yaml").write_text("stepz: 3\n") and
         ["train", "--dry-run", str(tmp / "poros.yaml")], "ConfigError", "did you mean 'steps'"),
    Case("override-unknown", lambda tmp, ctx: ["train", "--dry-run", "--stpes", "3"], "ConfigError",
         "did you mean 'steps'"),
    Case("override-wrong-type", lambda tmp, ctx: ["train", "--dry-run", "--steps", "abc"], "ConfigError",
         "e.g. --steps 100"),
    Case("override-invalid-value", lambda tmp, ctx: ["train", "--dry-run", "--lr", "-1"], "ConfigError", "e.g. lr:"),
    Case("override-unknown-device", lambda tmp, ctx: ["train", "--dry-run", "--device", "tpu"], "ConfigError",
         "e.g. device: cuda:0"),
    Case("plan-usage-error", lambda tmp, ctx: ["plan", "--head-ms", "abc"], None, code=2),
    Case("plan-budget-below-the-minimum", lambda tmp, ctx: ["plan", "--device", "cpu", "--vram-budget", "1MiB"],
         "ConfigError", "is below the minimum for this run: it needs at least 5.3 MB", max_chars=500),
    Case("plan-model-not-cached", lambda tmp, ctx: ["plan", "--model", "no-org/no-model-xyz", "--vram-budget", "8GiB"],
         "CheckpointLoadError", "Fix: fetch the config first (`hf download no-org/no-model-xyz config.json`)",
         absent="--dry-run"),
    Case("dataset-given-as-the-config", lambda tmp, ctx: ["train", "--dry-run", str(write_jsonl(tmp / "chat.jsonl", CHAT))],
         "ConfigError", "a dataset, given where the config goes (poros train's first argument is a poros.yaml). "
         "Fix: poros train --dataset", keep=lambda tmp, ctx: [tmp / "chat.jsonl"]),
    Case("dataset-json-given-as-the-config",
         lambda tmp, ctx: (tmp / "chat.json").write_text(json.dumps(CHAT)) and ["train", "--dry-run", str(tmp / "chat.json")],
         "ConfigError", "holds records with 'messages': a dataset", absent="Fix the line shown"),
    # -- data parallel: batch_size is per device, so no batch is refused for the ranks (tests/test_run_checks.py)
    # -- datasets (each fails in validation, before any weight is read)
    Case("dataset-missing", lambda tmp, ctx: ["train", *TRAIN_FAST, "--dataset", str(tmp / "nope.jsonl"),
                                              "--output-dir", str(tmp / "out")], "DataError", "check the path",
         doc_row="dataset file ... does not exist"),
    Case("dry-run-dataset-missing", lambda tmp, ctx: ["train", "--dry-run", "--dataset", str(tmp / "nope.jsonl")],
         "DataError", "check the path", doc_row="dataset file ... does not exist"),
    Case("dataset-empty", _dataset(""), "DataError", "non-empty file", keep=_keep_dataset(),
         doc_row="... has no records"),
    Case("dataset-broken-line", _dataset(json.dumps(CHAT[0]) + "\n{\"messages\": [\n"), "DataError",
         "Fix that line", keep=_keep_dataset(), doc_row="...: line N is not valid JSON"),
    Case("dataset-wrong-columns", _dataset([{"question": "a", "answer": "b"}]), "DataError", "rename your columns",
         keep=_keep_dataset(), doc_row="cannot tell the dataset's format from its columns [...]"),
    Case("dataset-unknown-roles", _dataset(HUMAN_GPT), "DataError", "human -> user", keep=_keep_dataset(),
         doc_row="...: no assistant turn in the first N records: the roles [...] are not chat roles"),
    Case("dataset-mixed-formats", _dataset([*CHAT, {"text": "plain text"}]), "DataError",
         "same columns", keep=_keep_dataset(), doc_row="record N has no '...' column"),
    Case("dataset-not-utf8", _dataset(b'{"text": "caf\xe9"}\n'), "DataError",
         "re-save it as UTF-8", keep=_keep_dataset(), doc_row="... is not UTF-8 text"),
    Case("dataset-with-bom", _dataset(b"\xef\xbb\xbf" + json.dumps(CHAT[0]).encode() + b"\n"), None, code=0,
         keep=_keep_dataset()),
    # the huge text is the answer: truncated to seq_len, it trains (a huge question would push the answer
    # beyond seq_len, which --dry-run now refuses: tests/test_first_hour.py)
    Case("dataset-huge-line", _dataset([{"messages": [{"role": "user", "content": "hi"},
                                                      {"role": "assistant", "content": "x" * 4_000_000}]}]), None,
         code=0),
    Case("dataset-csv-huge-cell", _dataset('text\n"' + "y" * 300_000 + '"\n', name="data.csv"), None, code=0),
    Case("dataset-csv-extra-cells", _dataset("text\nhello,world\n", name="data.csv"), "DataError",
         "quote cells", keep=_keep_dataset("data.csv"), doc_row="...: row N has more cells than the header"),
    Case("dataset-is-a-directory", lambda tmp, ctx: (tmp / "saved").mkdir() or
         ["train", "--dry-run", "--dataset", str(tmp / "saved")], "DataError", "load_from_disk",
         doc_row="... is a directory"),
    Case("dataset-unknown-suffix", _dataset("a,b\n", name="data.parquet"), "DataError", "convert it",
         doc_row="cannot read ...: the suffix '.parquet' is not one Poros reads"),
    Case("dataset-json-object-without-records", _dataset('{"rows": []}', name="data.json"), "DataError",
         "wrap the records in a list", doc_row="... holds a JSON object with keys [...]"),
    Case("dataset-record-not-an-object", _dataset("[1, 2]\n"), "DataError", "JSON object",
         doc_row="...: record N is a ..., expected a JSON object"),
    Case("dataset-unreadable", _dataset(CHAT, name="secret.jsonl"), "DataError", "permissions",
         patch=_patch_unreadable_dataset, doc_row="cannot read ...: Permission denied"),
    Case("dataset-hub-id-not-cached-offline", lambda tmp, ctx: ["train", *TRAIN_FAST, "--dataset", "no-org/no-data",
                                                                "--output-dir", str(tmp / "out")],
         "DataError", "loaded once online", patch=_patch_offline_hub,
         doc_row="dataset '...' is not a local file and not in the Hugging Face cache"),
    Case("dataset-name-without-suffix", lambda tmp, ctx: (tmp / "mydata.jsonl").write_text(json.dumps(CHAT[0])) and
         ["train", "--dry-run", "--dataset", "mydata", "--output-dir", str(tmp / "out")], "DataError",
         "did you mean 'mydata.jsonl'", patch=_patch_offline_hub,
         doc_row="dataset '...' is not a local file and not in the Hugging Face cache"),
    # -- checkpoints: each file truncated, each file missing, a wrong path, another run's math
    *[Case(f"checkpoint-{name}-truncated", _resume(lambda ckpt, name=name: truncate(ckpt / name)),
           "TrainingCheckpointError", "resume from another checkpoint", keep=_keep_run, needs_run=True)
      for name in ("adapter_model.safetensors", "adapter_config.json", "optimizer.pt", "scheduler.pt",
                   "rng_state.pth", "trainer_state.json", "data_state.json", "poros_config.json")],
    *[Case(f"checkpoint-{name}-missing", _resume(lambda ckpt, name=name: (ckpt / name).unlink()),
           "TrainingCheckpointError", "resume from an earlier checkpoint", keep=_keep_run, needs_run=True)
      for name in ("adapter_model.safetensors", "adapter_config.json", "optimizer.pt", "scheduler.pt",
                   "rng_state.pth", "trainer_state.json", "data_state.json", "poros_config.json")],
    Case("checkpoint-path-does-not-exist", _resume(lambda ckpt: None, checkpoint="checkpoint-9"),
         "TrainingCheckpointError", "checkpoint-1, checkpoint-2", keep=_keep_run, needs_run=True),
    Case("resume-auto-on-a-finished-run",
         lambda tmp, ctx: ["train", *ctx["run_args"], "--output-dir", str(_copy_run(tmp, ctx)), "--resume_from", "auto"],
         "TrainingCheckpointError", "the run is finished, there is nothing to resume", keep=_keep_run, needs_run=True),
    *[Case(f"{command[0]}{'-gguf' if 'gguf' in command else ''}-truncated-adapter",
           lambda tmp, ctx, command=command: (truncate(_copy_run(tmp, ctx) / "adapter_model.safetensors") or
                                              [command[0], "--adapter", str(tmp / "run"), *command[1:]])
           + ([] if command[0] == "generate" else ["--output", str(tmp / "exported")]),
           "CheckpointLoadError", "is truncated: its header lists", keep=_keep_run, needs_run=True)
      for command in (("merge",), ("generate", "--prompt", "hi"), ("merge", "--format", "gguf"))],
    Case("merge-into-another-base-of-the-same-shapes",
         lambda tmp, ctx: ["merge", "--adapter", str(_copy_run(tmp, ctx)), "--model", str(_other_weights(tmp)),
                           "--output", str(tmp / "merged")],
         "CheckpointLoadError", "holds other weights of the same shapes", keep=_keep_run, needs_run=True),
    Case("resume-with-other-math", lambda tmp, ctx: _resume(lambda ckpt: None)(tmp, ctx) + ["--lr", "1e-3"],
         "TrainingCheckpointError", "lr", keep=_keep_run, needs_run=True),
    Case("interrupted-save-left-a-partial-checkpoint",  # checkpoint-1 the last complete one: a run to resume
         lambda tmp, ctx: _resume(lambda ckpt: (ckpt.parent / ".checkpoint-3.tmp-99-abcdef").mkdir() or
                                  shutil.rmtree(ckpt.parent / "checkpoint-2") or
                                  shutil.copytree(ckpt, ckpt.parent / "checkpoint-3") and
                                  (ckpt.parent / "checkpoint-3" / "optimizer.pt").unlink(),
                                  checkpoint="checkpoint-1")(tmp, ctx)[:-2] + ["--resume_from", "auto", "--dry-run"],
         None, code=0, needs_run=True),
    Case("resume-from-the-incomplete-one-of-an-interrupted-save",
         lambda tmp, ctx: _resume(lambda ckpt: shutil.copytree(ckpt, ckpt.parent / "checkpoint-3") and
                                  (ckpt.parent / "checkpoint-3" / "rng_state.pth").unlink())(tmp, ctx)[:-1]
         + [str(tmp / "run" / "checkpoint-3")], "TrainingCheckpointError", "resume_from='auto'", needs_run=True,
         keep=lambda tmp, ctx: [tmp / "run" / "checkpoint-2", tmp / "run" / "adapter_model.safetensors"]),
]


# -- the finished run every damage case copies ---------------------------------------------------
@pytest.fixture(scope="module")
def ctx(tmp_path_factory) -> dict:
    """A finished ``poros train`` run (checkpoint-1, checkpoint-2, adapter, metrics), made once."""
    run = tmp_path_factory.mktemp("finished") / "run"
    dataset = write_jsonl(run.parent / "chat.jsonl", CHAT * 4)
    run_args = [*TRAIN_FAST, "--steps", "2", "--save-steps", "1", "--dataset", str(dataset)]
    lazy: dict = {"run_args": run_args}

    def build() -> Path:
        if "finished_run" not in lazy:
            import io
            from contextlib import redirect_stderr, redirect_stdout

            out, err = io.StringIO(), io.StringIO()
            with redirect_stdout(out), redirect_stderr(err):
                status = main(["train", *run_args, "--output-dir", str(run)])
            assert status == 0, err.getvalue()[-3000:]
            lazy["finished_run"], lazy["finished_output"] = run, out.getvalue() + err.getvalue()
        return run

    lazy["build"] = build
    return lazy


@pytest.mark.parametrize("case", CLI_CASES, ids=[case.id for case in CLI_CASES])
def test_cli_bad_input(case: Case, ctx, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a default ./poros_output lands here
    if case.needs_run:
        ctx["build"]()
        capsys.readouterr()
    argv = case.prepare(tmp_path, ctx)
    kept = case.keep(tmp_path, ctx)
    before = snapshot(*kept)
    if case.patch is not None:
        case.patch(monkeypatch, tmp_path)
    if case.error is not None:  # every failure here is found before a weight is read
        import poros.dropin.with_adapter  # binds load_pretrained by name (poros generate): patched there too
        import poros.loading.load

        def no_loading(*args, **kwargs):
            raise AssertionError("the model was loaded before the failure was found")

        monkeypatch.setattr(poros.loading.load, "load_pretrained", no_loading)
        monkeypatch.setattr(poros.dropin.with_adapter, "load_pretrained", no_loading)
    try:
        status = main(argv)
    except SystemExit as exit_:  # argparse's usage errors
        status = exit_.code
    monkeypatch.undo()
    out, err = capsys.readouterr()
    assert status == case.code, f"exit {status}, expected {case.code}\n{err[-3000:]}"
    assert "Traceback" not in out + err
    if case.error is not None:
        line = error_line(err, argv[0])
        assert line.startswith(f"poros {argv[0]}: error: {case.error}: "), line
        assert case.fix in line, line
        assert not case.absent or case.absent not in line, line
        assert not case.max_chars or len(line) <= case.max_chars, f"{len(line)} characters: {line}"
        if case.doc_row is not None:
            message = line.split(f"{case.error}: ", 1)[1]
            assert re.match(doc_pattern(case.doc_row), message), f"{message!r} does not match {case.doc_row!r}"
    assert snapshot(*kept) == before, "an earlier result was changed"
    assert not list(tmp_path.rglob(".poros.lock")) or case.id.startswith("output-dir-locked"), "a lock was left behind"


# -- the Python API ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trainer():
    from poros.training.trainer import PorosTrainer

    return PorosTrainer.from_pretrained("poros-tiny-qwen3", device="cpu", seq_len=64, steps=1, logging_steps=1)


def earlier_run(trainer, tmp: Path) -> None:
    """A finished API run in tmp/out: checkpoint-1, checkpoint-2, the adapter, metrics."""
    out = tmp / "out"
    trainer.train(write_jsonl(tmp / "chat.jsonl", CHAT * 4), output_dir=str(out), steps=2, save_steps=1,
                  schedule="constant")  # a constant schedule: resumable with more steps
    trainer.save(out)


def lock_by_live_process(trainer, tmp: Path) -> None:
    (tmp / "out").mkdir()
    (tmp / "out" / ".poros.lock").write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname()}))


@dataclass
class ApiCase:
    """One bad situation for ``PorosTrainer``: ``prepare`` builds the earlier state, ``call`` fails (or not)."""

    id: str
    call: Callable[[Any, Path, Any], Any]  # (trainer, tmp, monkeypatch)
    error: type[errors.PorosError] | None
    fix: str = ""
    prepare: Callable[[Any, Path], None] = lambda trainer, tmp: None
    keep: Callable[[Path], list[Path]] = lambda tmp: []
    doc_row: str | None = None
    check: Callable[[Path], None] = lambda tmp: None


def _disk_full_at_checkpoint_3(trainer, tmp: Path, monkeypatch):
    from poros.training import checkpoint

    real = checkpoint.write_json

    def full(path, payload):
        if "checkpoint-3" in str(path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(path, payload)

    monkeypatch.setattr(checkpoint, "write_json", full)
    return trainer.train(tmp / "chat.jsonl", output_dir=str(tmp / "out"), steps=3, save_steps=1, resume_from="auto",
                         schedule="constant")


def _no_partial_checkpoint(tmp: Path) -> None:
    names = sorted(p.name for p in (tmp / "out").iterdir())
    assert "checkpoint-3" not in names and not [n for n in names if ".tmp-" in n], names


def _only_the_new_run(tmp: Path) -> None:
    names = sorted(p.name for p in (tmp / "out").iterdir())
    assert not [n for n in names if n.startswith("checkpoint-")] and "adapter_model.safetensors" not in names, names
    rows = [json.loads(line) for line in (tmp / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1]  # this run's rows only, never a mix of two runs


def _truncate_adapter_and_resume(trainer, tmp: Path, monkeypatch):
    truncate(tmp / "out" / "checkpoint-2" / "adapter_model.safetensors")
    return trainer.train(tmp / "chat.jsonl", output_dir=str(tmp / "out"), steps=3, resume_from="auto",
                         schedule="constant")


HALF_BAD = CHAT * 4 + [{"messages": [{"role": "user", "content": "only a question"}]}] * 3

API_CASES = [
    ApiCase("api-fresh-run-into-another-runs-results",
            lambda tr, tmp, mp: tr.train(tmp / "chat.jsonl", output_dir=str(tmp / "out")),
            errors.OutputDirError, "(resume_from='auto' in Python), pass another --output-dir (output_dir=), or "
            "--overwrite (overwrite=True)", prepare=earlier_run, keep=lambda tmp: [tmp / "out"]),
    ApiCase("api-overwrite-replaces-the-earlier-run-whole",
            lambda tr, tmp, mp: tr.train(tmp / "chat.jsonl", output_dir=str(tmp / "out"), overwrite=True),
            None, prepare=earlier_run, check=_only_the_new_run),
    ApiCase("api-output-dir-locked-by-a-live-run",
            lambda tr, tmp, mp: tr.train(CHAT, output_dir=str(tmp / "out")),
            errors.RunLockedError, "another --output-dir", prepare=lock_by_live_process,
            keep=lambda tmp: [tmp / "out"]),
    ApiCase("api-disk-full-during-a-checkpoint", _disk_full_at_checkpoint_3, errors.OutputDirError,
            "free disk space", prepare=earlier_run,
            keep=lambda tmp: [tmp / "out" / "checkpoint-2", tmp / "out" / "adapter_model.safetensors"],
            check=_no_partial_checkpoint),
    ApiCase("api-resume-truncated-adapter", _truncate_adapter_and_resume, errors.TrainingCheckpointError,
            "resume from another checkpoint", prepare=earlier_run, keep=lambda tmp: [tmp / "out" / "checkpoint-1"]),
    ApiCase("api-all-examples-too-long",
            lambda tr, tmp, mp: tr.train([{"messages": [{"role": "user", "content": "word " * 200},
                                                        {"role": "assistant", "content": "ok"}]}],
                                         output_dir=str(tmp / "out"), seq_len=16),
            errors.DataError, "raise seq_len", doc_row="no trainable tokens ...: ... beyond seq_len=..."),
    ApiCase("api-only-user-turns",
            lambda tr, tmp, mp: tr.train([{"messages": [{"role": "user", "content": "hi"}]}] * 2,
                                         output_dir=str(tmp / "out")),
            errors.DataError, "needs an assistant message",
            doc_row="no trainable tokens in any of the N examples: ... had nothing to train on"),
    ApiCase("api-unknown-roles-are-named",
            lambda tr, tmp, mp: tr.train(HUMAN_GPT, output_dir=str(tmp / "out")),
            errors.DataError, "['gpt', 'human']",
            doc_row="no trainable tokens in any of the N examples: ... had nothing to train on"),
    ApiCase("api-half-bad-data-trains-and-warns",
            lambda tr, tmp, mp: tr.train(HALF_BAD, output_dir=str(tmp / "out")), None,
            doc_row="WARNING poros: dropped N of M examples"),
]


@pytest.mark.parametrize("case", API_CASES, ids=[case.id for case in API_CASES])
def test_api_bad_input(case: ApiCase, trainer, tmp_path, monkeypatch, caplog):
    case.prepare(trainer, tmp_path)
    kept = case.keep(tmp_path)
    before = snapshot(*kept)
    if case.error is None:
        with caplog.at_level("WARNING", logger="poros"):
            case.call(trainer, tmp_path, monkeypatch)
        if case.doc_row is not None:
            warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
            assert any(re.match(doc_pattern(case.doc_row.removeprefix("WARNING ")), w) for w in warnings), warnings
    else:
        with pytest.raises(errors.PorosError) as raised:
            case.call(trainer, tmp_path, monkeypatch)
        assert type(raised.value) is case.error, repr(raised.value)
        assert case.fix in str(raised.value), str(raised.value)
        if case.doc_row is not None:
            assert re.match(doc_pattern(case.doc_row), str(raised.value)), str(raised.value)
    monkeypatch.undo()
    case.check(tmp_path)
    assert snapshot(*kept) == before, "an earlier result was changed"
    assert not (tmp_path / "out" / ".poros.lock").exists() or case.id == "api-output-dir-locked-by-a-live-run"


# -- what only a real mount can show (skipped where this process may not mount) -----------------------
def test_read_only_output_dir_on_a_real_read_only_mount(tmp_path, capsys):
    with tmpfs(tmp_path / "ro", "ro,size=64k") as mounted:
        if not mounted:
            pytest.skip("cannot mount a tmpfs here; output-dir-not-writable covers it with a patched os.open")
        status = main(["train", *TRAIN_FAST, "--output-dir", str(tmp_path / "ro" / "run")])
        out, err = capsys.readouterr()
    assert status == 1 and "Traceback" not in out + err
    line = error_line(err, "train")
    assert line.startswith("poros train: error: OutputDirError: ") and "writable file system" in line, line


def test_disk_full_on_a_real_tiny_tmpfs(ctx, tmp_path, capsys):
    """The first checkpoint fits, the second does not: exit 1, one line, checkpoint-1 complete, no partial."""
    from poros.training.checkpoint import list_checkpoints

    one = sum(p.stat().st_size for p in (ctx["build"]() / "checkpoint-1").iterdir())
    capsys.readouterr()
    out_dir = tmp_path / "disk"
    with tmpfs(out_dir, f"size={int(one * 1.5)}") as mounted:
        if not mounted:
            pytest.skip("cannot mount a tmpfs here; api-disk-full-during-a-checkpoint covers it with a patched write")
        status = main(["train", *ctx["run_args"], "--steps", "3", "--output-dir", str(out_dir)])
        out, err = capsys.readouterr()
        names = sorted(p.name for p in out_dir.iterdir())
        complete = [p.name for p in list_checkpoints(out_dir)]
    assert status == 1 and "Traceback" not in out + err, err[-3000:]
    line = error_line(err, "train")
    assert line.startswith("poros train: error: OutputDirError: ") and "free disk space" in line, line
    assert complete == ["checkpoint-1"] and not [n for n in names if ".tmp-" in n], names


# -- real processes: nothing but the error line reaches the terminal ---------------------------------
CORE_ONLY = ("import sys\nfor name in ('torch', 'transformers', 'peft', 'bitsandbytes', 'safetensors'):\n"
             "    sys.modules[name] = None  # import raises ModuleNotFoundError, as on a core-only install\n"
             "from poros.cli.main import main\nsys.exit(main(sys.argv[1:]))\n")


@pytest.mark.parametrize(("argv", "code", "error", "fix"), [
    (["train"], 1, "MissingDependencyError", "pip install 'poros-train[train]'"),
    (["train", "--dry-run"], 1, "MissingDependencyError", "pip install 'poros-train[train]'"),
    (["plan", "--vram-budget", "8GiB"], 1, "MissingDependencyError", "pip install 'poros-train[train]'"),
    (["generate", "--adapter", "nowhere", "--prompt", "hi"], 1, "MissingDependencyError",
     "pip install 'poros-train[train]'"),
], ids=["train-core-only", "dry-run-core-only", "plan-core-only", "generate-core-only"])
def test_core_only_install_gets_the_install_hint(argv, code, error, fix, tmp_path, child_env):
    result = subprocess.run([sys.executable, "-c", CORE_ONLY, *argv], capture_output=True, text=True, timeout=120,
                            cwd=tmp_path, env=child_env(POROS_LOAD_PLUGINS=""), check=False)
    assert result.returncode == code, result.stderr[-3000:]
    assert "Traceback" not in result.stdout + result.stderr
    line = error_line(result.stderr, argv[0])
    assert line.startswith(f"poros {argv[0]}: error: {error}: ") and fix in line, line


@pytest.mark.parametrize(("argv", "env", "code", "needle"), [
    (["train", "--device", "cuda"], {}, 1, "poros train: error: DeviceError: "),
    (["train", "--dry-run", "--output-dir", "taken"], {}, 1, "poros train: error: OutputDirError: "),
    (["train", "--dry-run", "--output-dir", "taken"], {"POROS_DEBUG": "1"}, 1, "Traceback"),
], ids=["device-cuda", "output-dir-is-a-file", "poros-debug-shows-the-traceback"])
def test_real_process_prints_one_line_or_the_traceback_when_asked(argv, env, code, needle, tmp_path, child_env):
    (tmp_path / "taken").write_text("notes")
    result = subprocess.run([sys.executable, "-m", "poros.cli.main", *argv], capture_output=True, text=True,
                            timeout=120, cwd=tmp_path, env=child_env(POROS_LOAD_PLUGINS="", **env), check=False)
    assert result.returncode == code, result.stderr[-3000:]
    assert needle in result.stderr
    if "POROS_DEBUG" not in env:
        assert "Traceback" not in result.stdout + result.stderr
        assert len([line for line in result.stderr.splitlines() if line.strip()]) == 1, result.stderr


def test_a_bug_is_one_line_that_says_how_to_get_the_traceback(monkeypatch, capsys, tmp_path):
    from poros.cli import train

    def broken(config):
        raise TypeError("unsupported operand")

    monkeypatch.setattr(train, "dry_run", broken)
    status = main(["train", "--dry-run", "--output-dir", str(tmp_path / "out")])
    out, err = capsys.readouterr()
    assert status == 1 and "Traceback" not in out + err
    line = error_line(err, "train")
    assert line.startswith("poros train: error: TypeError: unsupported operand") and "POROS_DEBUG=1" in line


def test_concurrent_run_into_the_same_output_dir_fails_at_once_and_the_first_survives(tmp_path, capsys, child_env):
    """A real second process: the first holds the lock; the second fails naming it; the first then finishes its
    own work (interrupted with SIGINT: it writes its checkpoint and exits 130), untouched by the second."""
    out = tmp_path / "out"
    dataset = write_jsonl(tmp_path / "chat.jsonl", CHAT * 4)
    first = subprocess.Popen(
        [sys.executable, "-m", "poros.cli.main", "train", *TRAIN_FAST, "--steps", "100000", "--dataset", str(dataset),
         "--output-dir", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=child_env(POROS_LOAD_PLUGINS="", OMP_NUM_THREADS="1"))
    try:
        metrics = out / "metrics.jsonl"
        for _ in range(1200):  # wait for the first run's first logged step: it holds its lock, and its stop handler
            # is in place (the file exists, empty, from before the training loop, when a SIGINT still means "nothing
            # to resume": the race that made this test fail now and then)
            if (metrics.exists() and metrics.stat().st_size > 0) or first.poll() is not None:
                break
            time.sleep(0.1)
        assert first.poll() is None, first.communicate()[1][-3000:]
        status = main(["train", *TRAIN_FAST, "--steps", "1", "--dataset", str(dataset), "--output-dir", str(out)])
        _, err = capsys.readouterr()
        assert status == 1 and "Traceback" not in err
        line = error_line(err, "train")
        assert line.startswith("poros train: error: RunLockedError: ") and f"pid {first.pid}" in line, line
        assert "another --output-dir" in line
        assert json.loads((out / ".poros.lock").read_text())["pid"] == first.pid  # the second left it alone
    finally:
        first.send_signal(signal.SIGINT)
        stdout, stderr = first.communicate(timeout=300)
    assert first.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stdout + stderr and "resume with" in stdout, (stdout + stderr)[-4000:]
    for notice in ("Failed to load CPU gemm_4bit_forward", "is_gradient_checkpointing"):  # quiet by default
        assert notice not in stdout + stderr
    assert not (out / ".poros.lock").exists()
    from poros.training.checkpoint import list_checkpoints

    assert list_checkpoints(out), sorted(p.name for p in out.iterdir())


# -- quiet by default ---------------------------------------------------------------------------------
@pytest.mark.parametrize("verbose", [False, True], ids=["quiet", "verbose"])
def test_known_third_party_noise_is_hidden_unless_verbose(verbose, capsys):
    import logging
    import warnings

    from poros.noise import QUIET_LOG_RECORDS, quiet_known_noise

    name, start = QUIET_LOG_RECORDS[0]
    logger = logging.getLogger(name)
    filters = list(logger.filters)
    logger.filters[:] = []  # in-process CLI cases of this session installed the filter already
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_known_noise(verbose=verbose)
        try:
            handler = logging.StreamHandler(sys.stderr)
            logger.addHandler(handler)
            logger.warning(f"{start}: No module named 'kernels'")
            logger.warning("another bitsandbytes warning")
            logger.removeHandler(handler)
            warnings.warn("`is_gradient_checkpointing` is deprecated and will be removed in v6.", FutureWarning)
            warnings.warn("another FutureWarning", FutureWarning)
        finally:
            logger.filters[:] = filters
    err = capsys.readouterr().err
    shown = [str(w.message) for w in caught]
    assert "another bitsandbytes warning" in err and "another FutureWarning" in shown
    assert (start in err) is verbose
    assert any("is_gradient_checkpointing" in m for m in shown) is verbose


# -- the data loader under fuzzing: it loads, or raises a PorosError; never anything else ---------------
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8)
ROLES = st.sampled_from(["user", "assistant", "system", "human", "gpt", "", "tool"])
MESSAGE = st.fixed_dictionaries({"role": ROLES | JSON_VALUES, "content": st.text(max_size=30) | JSON_VALUES})
RECORD = st.one_of(
    st.fixed_dictionaries({"messages": st.lists(MESSAGE, max_size=4) | JSON_VALUES}),
    st.fixed_dictionaries({"text": st.text(max_size=40) | JSON_VALUES}),
    st.fixed_dictionaries({"prompt": st.text(max_size=20) | JSON_VALUES, "completion": st.text(max_size=20)}),
    st.fixed_dictionaries({"instruction": st.text(max_size=20), "output": JSON_VALUES | st.text(max_size=20)}),
    st.fixed_dictionaries({"conversations": st.lists(st.fixed_dictionaries(
        {"from": st.sampled_from(["human", "gpt", "system", "alien"]), "value": st.text(max_size=20)}), max_size=3)}),
    st.dictionaries(st.text(max_size=10), JSON_VALUES, max_size=4),
    JSON_VALUES,
)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from poros.assets import asset_path

    return AutoTokenizer.from_pretrained(asset_path("poros-tiny-qwen3"))


def _load(path: Path, tokenizer) -> None:
    from poros.data import load_dataset

    try:
        load_dataset(str(path), tokenizer, seq_len=32)
    except errors.PorosError:
        pass


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(records=st.lists(RECORD, max_size=5) | RECORD.map(lambda record: [record] * 3), junk=st.sampled_from([""] * 4 + ["\n", "{", "\ufeff", "\n\n[1]\n"]))
def test_fuzzed_jsonl_loads_or_raises_a_poros_error(records, junk, tokenizer, tmp_path):
    path = tmp_path / "fuzz.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + junk, encoding="utf-8")
    _load(path, tokenizer)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(header=st.lists(st.sampled_from(["text", "messages", "prompt", "completion", "instruction", "output", "x"]),
                       min_size=1, max_size=3),
       rows=st.lists(st.lists(st.text(max_size=15) | JSON_VALUES.map(json.dumps), max_size=4), max_size=4),
       raw=st.binary(max_size=12))
def test_fuzzed_csv_loads_or_raises_a_poros_error(header, rows, raw, tokenizer, tmp_path):
    import csv
    import io

    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(header)
    writer.writerows(rows)
    path = tmp_path / "fuzz.csv"
    path.write_bytes(buffer.getvalue().encode("utf-8") + raw)
    _load(path, tokenizer)


# -- the docs are checked against this suite ------------------------------------------------------------
#: rows of own-data.md's troubleshooting table exercised elsewhere (the reason says where)
ROWS_TESTED_ELSEWHERE = {
    "could not load the Hugging Face dataset '...'": "needs the network: tests/test_data.py (offline cache)",
    "record N: a ShareGPT turn comes from '...'": "tests/test_data.py",
    "the chat template failed on a conversation with roles [...]": "tests/test_data.py",
    "the chat template does not render conversations prefix by prefix": "tests/test_data.py (templates)",
    "WARNING ... multi-turn conversations became one example per assistant turn": "tests/test_data.py (Qwen3)",
    "the dataset has N examples, fewer than one batch of B": "tests/test_data.py (batches)",
    "cannot resume the data position: num_examples ... (saved) vs ... (now)": "tests/test_checkpoint.py",
}
#: error classes of the api-reference table raised elsewhere (the prepare gates, plugins, the engine)
CLASSES_TESTED_ELSEWHERE = {"UnsupportedModelError and the prepare gates": "tests/test_streaming.py, test_adapters.py",
                            "DistributedError": "tests/test_distributed.py (ranks with different versions)"}


def doc_pattern(row: str) -> str:
    """A troubleshooting row as a regex over the message: ``...`` is anything, N/M/B a number."""
    parts = re.split(r"(\.\.\.|\b[NMB]\b)", row)
    return "".join(".*?" if p == "..." else r"\d+" if p in ("N", "M", "B") else re.escape(p) for p in parts)


def _table_first_column(page: str, heading: str) -> list[str]:
    section = page.split(heading, 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("|---")]
    return [row.split(" | ")[0].removeprefix("| ").replace("`", "").strip() for row in rows[1:]]


def test_docs_follow_the_suite():
    rows = _table_first_column((ROOT / "docs" / "own-data.md").read_text(encoding="utf-8"), "## Troubleshooting")
    covered = {case.doc_row for case in [*CLI_CASES, *API_CASES] if case.doc_row}
    assert covered - set(rows) == set(), "docs/own-data.md's troubleshooting table lacks these rows of the suite"
    untested = set(rows) - covered - set(ROWS_TESTED_ELSEWHERE)
    assert untested == set(), "rows of docs/own-data.md's troubleshooting table that no case of the suite raises"

    documented = set(_table_first_column((ROOT / "docs" / "api-reference.md").read_text(encoding="utf-8"),
                                         "## Errors"))
    raised = {case.error for case in CLI_CASES if case.error} | {case.error.__name__ for case in API_CASES
                                                                 if case.error} | {"MissingDependencyError"}
    assert raised - documented == set(), "docs/api-reference.md's errors table lacks classes the suite raises"
    assert documented - raised - set(CLASSES_TESTED_ELSEWHERE) == set(), "documented classes no case raises"
    for name in raised:
        assert issubclass(getattr(errors, name), errors.PorosError)


def test_the_suite_has_at_least_40_cases():
    assert len(CLI_CASES) + len(API_CASES) >= 40


def test_the_lock_appears_whole_never_half_written(tmp_path, monkeypatch):
    """A data-parallel job's other ranks read rank 0's lock (``check_unlocked``) while rank 0 creates it.
    Created empty and written after, it was read as "an unreadable lock" and the rank refused the run
    (2 of 30 `poros train --nproc-per-node 2` runs here); it now appears with its whole record."""
    from poros.training import run_lock

    seen, real_fdopen = [], os.fdopen

    def watching(descriptor, *args, **kwargs):  # the moment the record is being written
        seen.append(run_lock.read_lock(tmp_path))
        return real_fdopen(descriptor, *args, **kwargs)

    monkeypatch.setattr(run_lock.os, "fdopen", watching)
    with run_lock.hold(tmp_path, command="poros train --steps 3"):
        owner = run_lock.read_lock(tmp_path)
    assert seen == [None]  # nothing under the lock's name until it is complete
    assert owner["pid"] == os.getpid() and owner["command"] == "poros train --steps 3"
    assert not list(tmp_path.iterdir())  # the lock and its private file are gone

    # a private file a killed process left is swept by the next run; a live process's is left alone
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    left = tmp_path / f".poros.lock.{socket.gethostname()}.{int(dead.stdout)}.tmp"
    live = tmp_path / f".poros.lock.{socket.gethostname()}.{os.getppid()}.tmp"
    left.write_text("{}")
    live.write_text("{}")
    monkeypatch.undo()
    with run_lock.hold(tmp_path):
        pass
    assert not left.exists() and live.exists()


def test_counts_and_sizes_read_as_words():
    """Issue 44's "1 epochs" and GGUF sizes of "0.00 GiB": one epoch is singular, a small file is in MiB."""
    import pathlib

    from poros.config import PorosConfig

    _, note = PorosConfig(steps=0, epochs=1).steps_for_epochs(400)
    assert note.startswith("1 epoch of 400 batches"), note
    _, note = PorosConfig(steps=0, epochs=2).steps_for_epochs(400)
    assert note.startswith("2 epochs of 400 batches"), note
    pytest.importorskip("gguf")
    from poros.export.gguf import GgufResult

    summary = GgufResult(pathlib.Path("tiny.gguf"), pathlib.Path("base"), 1, 47, 28, 1_310_720, 0.2, None, [],
                         gguf_type="q8_0", architecture="qwen3", tokenizer_pre="gpt-2").summary()
    assert "1.2 MiB in 0.2 s" in summary and "GiB" not in summary, summary
