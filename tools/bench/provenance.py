"""Provenance: what every JSON record of a tool carries (device, platform class, library versions,
date, commit) and a GPU tool's common start (determinism, CPU threads, the device).

``git_commit`` reads ``$POROS_COMMIT`` where the tree has no ``.git`` (the GPU host's copy);
``environment_line`` is the one line a tool prints of it.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import warnings
from pathlib import Path
from typing import Any

import torch

from poros.devices import resolve_device

REPO_ROOT = Path(__file__).resolve().parents[2]


def configure_threads(threads: int | None) -> None:
    """Width-64 ops run several times faster on one thread than on a busy machine's several."""
    if threads:
        torch.set_num_threads(threads)


def add_run_arguments(parser: argparse.ArgumentParser, what: str) -> None:
    """The options every checkpoint-writing tool takes: ``--dir`` (where ``what`` goes), ``--device``,
    ``--deterministic``, ``--threads``, ``--commit``, ``--json``."""
    parser.add_argument("--dir", default=None, help=f"where {what} go (default: a temp dir, removed at the end)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--deterministic", action="store_true")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--commit", default=None)
    parser.add_argument("--json", default=None)


def start_tool(args: argparse.Namespace) -> tuple[torch.device, dict[str, Any]]:
    """A GPU tool's common start (bench, parity gate, VRAM curve): quiet transformers' checkpointing
    warning, deterministic algorithms and CPU threads as asked; returns the device and the environment."""
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    configure_determinism(args.deterministic)
    configure_threads(args.threads)
    device = resolve_device(args.device, with_index=True)
    return device, environment(device, args.commit)


def configure_determinism(enabled: bool) -> None:
    """Deterministic algorithms on; call before the first CUDA operation (cuBLAS reads the env var then)."""
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)


def git_commit(explicit: str | None = None) -> str:
    """``explicit``, else ``$POROS_COMMIT``, else ``git rev-parse --short HEAD`` (``-dirty`` when tracked
    files changed), else ``"unknown"`` (a copy of the tree without ``.git``, e.g. on the GPU host)."""
    if explicit or os.environ.get("POROS_COMMIT"):
        return explicit or os.environ["POROS_COMMIT"]

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True, check=True,
                              timeout=10).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        return f"{commit}-dirty" if git("status", "--porcelain", "--untracked-files=no") else commit
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def environment(device: torch.device, commit: str | None = None) -> dict[str, Any]:
    """Device, platform class, library versions, date and commit, as every record carries them."""
    import bitsandbytes
    import peft
    import transformers

    device = resolve_device(device, with_index=True)
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        name, platform_class = torch.cuda.get_device_name(device), f"cuda-sm{major}{minor}"
    else:
        name = platform_class = f"cpu-{platform.machine()}"
    return {
        "platform": name, "platform_class": platform_class,
        "torch": torch.__version__.split("+")[0], "torch_build": torch.__version__,
        "cuda": torch.version.cuda, "transformers": transformers.__version__, "peft": peft.__version__,
        "bitsandbytes": bitsandbytes.__version__, "python": platform.python_version(),
        "date": datetime.date.today().isoformat(), "commit": git_commit(commit),
        # the caching allocator's settings change what fits under a cap (expandable segments)
        "cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
    }



def environment_line(env: dict[str, Any]) -> str:
    """One line of :func:`environment`: device, library versions, date, commit."""
    return (f"{env['platform']} ({env['platform_class']}) | torch {env['torch_build']} transformers "
            f"{env['transformers']} peft {env['peft']} bitsandbytes {env['bitsandbytes']} | {env['date']} {env['commit']}")
