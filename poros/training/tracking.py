"""Experiment trackers (``report_to``): every metric row of a run, and its config, to TensorBoard,
Weights & Biases, MLflow or trackio -- the names and the scalar layout of HF ``Trainer``.

::

    trackers = open_trackers(config, output_dir)      # report_to: [tensorboard, wandb]
    with trackers:
        trackers.log({"step": 10, "loss": 7.54, "learning_rate": 2e-4, ...})   # train/loss, train/learning_rate
        trackers.log({"step": 10, "eval_loss": 7.61, "eval_perplexity": ...})  # eval/loss, eval/perplexity

Notable choices:

* **The same scalars everywhere.** A tracker gets exactly the rows ``metrics.jsonl`` gets, each
  numeric field under HF's names: ``eval_<name>`` -> ``eval/<name>``, every other field ->
  ``train/<name>``, at the row's ``step``. The config goes in once, at the start.
* **Lazy and optional.** Nothing here imports a tracker until a run asks for it; each lives in an
  extra (``pip install 'poros-train[tensorboard]'``), and a missing one fails before the model
  loads, naming the extra (:func:`check_installed`).
* **Offline-friendly.** TensorBoard writes event files under ``output_dir/runs/``; W&B runs in
  offline mode when no API key is set (``WANDB_API_KEY`` or ``wandb login``) and ``WANDB_MODE`` is
  unset, writing under ``output_dir/wandb/`` for a later ``wandb sync``; MLflow and trackio keep
  their own local defaults (``MLFLOW_TRACKING_URI``, trackio's local store) unless told otherwise.

Torch-free.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import pathlib
import socket
from typing import Any, Iterable

from poros.config import report_to_names
from poros.errors import ConfigError

__all__ = ["TRACKERS", "Trackers", "check_installed", "open_trackers", "scalars", "tracker_names"]

#: report_to name -> (the packages that provide it, any one of them; the extra that installs one).
TRACKERS: dict[str, tuple[tuple[str, ...], str]] = {
    "tensorboard": (("tensorboard", "tensorboardX"), "tensorboard"),
    "wandb": (("wandb",), "wandb"),
    "mlflow": (("mlflow",), "mlflow"),
    "trackio": (("trackio",), "trackio"),
}
#: the project / experiment name when the tracker's own environment variable does not set one.
DEFAULT_PROJECT = "poros"


def _installed(name: str) -> bool:
    return any(importlib.util.find_spec(package) is not None for package in TRACKERS[name][0])


def tracker_names(report_to: str | list[str]) -> list[str]:
    """The trackers ``report_to`` asks for: ``"none"`` -> ``[]``; ``"all"`` -> every installed one."""
    names = report_to_names(report_to)
    if names == ["none"]:
        return []
    if names == ["all"]:
        return [name for name in TRACKERS if _installed(name)]
    return names


def check_installed(report_to: str | list[str]) -> None:
    """Fail before any work when a tracker's package is missing.

    Raises:
        ConfigError: names the tracker, the package and the extra to install.
    """
    for name in tracker_names(report_to):
        if name not in TRACKERS:
            raise ConfigError(f"report_to={report_to!r}: unknown tracker {name!r}; expected one of "
                              f"{', '.join(TRACKERS)}, all or none")
        packages, extra = TRACKERS[name]
        if not _installed(name):
            raise ConfigError(
                f"report_to={report_to!r} asks for {name}, but {' or '.join(packages)} is not installed. Fix: pip "
                f"install 'poros-train[{extra}]' (or drop {name} from report_to)"
            )


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The numeric fields of a metrics row under the trackers' names (``step`` and strings left out)."""
    out = {}
    for key, value in row.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        name = f"eval/{key.removeprefix('eval_')}" if key.startswith("eval_") else f"train/{key}"
        out[name] = float(value)
    return out


class Trackers:
    """The trackers of one run; :meth:`log` sends a metrics row to each, :meth:`close` ends them."""

    def __init__(self, trackers: Iterable[Any] = ()) -> None:
        self.trackers = list(trackers)

    def log(self, row: dict[str, Any]) -> None:
        values = scalars(row)
        for tracker in self.trackers:
            tracker.log(values, int(row["step"]))

    def close(self) -> None:
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            tracker.close()

    def __enter__(self) -> Trackers:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def open_trackers(config: Any, output_dir: str | os.PathLike) -> Trackers:
    """Start the trackers of ``config.report_to`` and log ``config`` to each.

    Args:
        config: the run's :class:`~poros.config.PorosConfig`.
        output_dir: where the run writes; TensorBoard's event files go in ``output_dir/runs/``.

    Raises:
        ConfigError: a tracker's package is missing (see :func:`check_installed`).
    """
    check_installed(config.report_to)
    settings = config.to_dict()
    output_dir = pathlib.Path(output_dir)
    opened: list[Any] = []
    try:
        for name in tracker_names(config.report_to):
            opened.append(_OPENERS[name](settings, output_dir))
    except BaseException:
        Trackers(opened).close()
        raise
    return Trackers(opened)


# -- one class per tracker: __init__(config dict, output_dir) starts a run; log(values, step); close() --------------
class TensorBoardTracker:
    """Event files in ``output_dir/runs/<date>_<host>/`` (HF's layout); the config as a text summary.

    Writes with ``torch.utils.tensorboard`` when ``tensorboard`` is installed, else ``tensorboardX``.
    """

    def __init__(self, config: dict[str, Any], output_dir: pathlib.Path) -> None:
        if importlib.util.find_spec("tensorboard") is not None:
            from torch.utils.tensorboard import SummaryWriter
        else:
            from tensorboardX import SummaryWriter
        stamp = datetime.datetime.now().strftime("%b%d_%H-%M-%S")
        self.log_dir = output_dir / "runs" / f"{stamp}_{socket.gethostname()}"
        self.writer = SummaryWriter(log_dir=str(self.log_dir))
        self.writer.add_text("config", "```json\n" + json.dumps(config, indent=2) + "\n```")
        self.writer.flush()

    def log(self, values: dict[str, float], step: int) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()  # a crash or a kill keeps what was logged

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A W&B run in project ``WANDB_PROJECT`` (default ``poros``); offline without an API key."""

    def __init__(self, config: dict[str, Any], output_dir: pathlib.Path) -> None:
        import wandb

        mode = None  # W&B's own choice: WANDB_MODE, or online with a key
        if not os.environ.get("WANDB_MODE") and not _wandb_key():
            mode = "offline"
            from poros.training.progress import echo

            echo(f"poros: wandb has no API key (WANDB_API_KEY or `wandb login`): logging offline under "
                 f"{output_dir / 'wandb'}; upload later with `wandb sync`")
        output_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", DEFAULT_PROJECT), config=config,
                              dir=str(output_dir), mode=mode)

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


def _wandb_key() -> bool:
    """An API key in ``WANDB_API_KEY`` or in ``~/.netrc`` (where ``wandb login`` puts it)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    import netrc

    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


class MLflowTracker:
    """An MLflow run in experiment ``MLFLOW_EXPERIMENT_NAME`` (default ``poros``); the config as params."""

    def __init__(self, config: dict[str, Any], output_dir: pathlib.Path) -> None:
        import mlflow

        self.mlflow = mlflow
        mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", DEFAULT_PROJECT))
        mlflow.start_run()
        mlflow.log_params({key: json.dumps(value) if not isinstance(value, str) else value
                           for key, value in config.items()})

    def log(self, values: dict[str, float], step: int) -> None:
        self.mlflow.log_metrics(values, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


class TrackioTracker:
    """A trackio run in project ``TRACKIO_PROJECT_NAME`` (default ``poros``), stored locally by default."""

    def __init__(self, config: dict[str, Any], output_dir: pathlib.Path) -> None:
        import trackio

        self.trackio = trackio
        trackio.init(project=os.environ.get("TRACKIO_PROJECT_NAME", DEFAULT_PROJECT), config=config)

    def log(self, values: dict[str, float], step: int) -> None:
        self.trackio.log(values, step=step)

    def close(self) -> None:
        self.trackio.finish()


_OPENERS = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker, "mlflow": MLflowTracker,
            "trackio": TrackioTracker}
