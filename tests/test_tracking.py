"""report_to: TensorBoard event files read back with TensorBoard's own reader; the W&B / MLflow / trackio
adapters reach their package's calls (stand-in modules: the real packages are too heavy for CI); a
missing package fails before the model loads, naming the extra; the plain progress line when piped.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types

import pytest

from poros.training import progress

from poros.training import tracking
from poros.config import PorosConfig
from poros.errors import ConfigError

TRAIN_ROW = {"step": 2, "loss": 7.5, "learning_rate": 2e-4, "grad_norm": 1.25, "tokens_per_second": 100.0,
             "num_tokens": 64, "peak_memory_gb": None, "peak_memory_kind": "process_peak_rss", "h2d_gb_per_s": 0.5}
EVAL_ROW = {"step": 2, "eval_loss": 7.25, "eval_perplexity": 1408.1, "eval_num_tokens": 57, "eval_batches": 3,
            "eval_runtime": 0.1}


def test_rows_become_hf_style_scalars():
    assert tracking.scalars(TRAIN_ROW) == {"train/loss": 7.5, "train/learning_rate": 2e-4, "train/grad_norm": 1.25,
                                           "train/tokens_per_second": 100.0, "train/num_tokens": 64.0,
                                           "train/h2d_gb_per_s": 0.5}
    assert tracking.scalars(EVAL_ROW) == {"eval/loss": 7.25, "eval/perplexity": 1408.1, "eval/num_tokens": 57.0,
                                          "eval/batches": 3.0, "eval/runtime": 0.1}


def test_tensorboard_event_file_holds_the_scalars_and_the_config(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = PorosConfig(report_to="tensorboard", steps=7)
    with tracking.open_trackers(config, tmp_path) as trackers:
        trackers.log(TRAIN_ROW)
        trackers.log(EVAL_ROW)
        trackers.log({**EVAL_ROW, "step": 4, "eval_loss": 7.0})
    (run,) = (tmp_path / "runs").iterdir()
    assert any(path.name.startswith("events.out.tfevents") for path in run.iterdir())
    events = EventAccumulator(str(run))
    events.Reload()
    assert set(events.Tags()["scalars"]) == set(tracking.scalars(TRAIN_ROW)) | set(tracking.scalars(EVAL_ROW))
    assert [(event.step, event.value) for event in events.Scalars("eval/loss")] == [(2, 7.25), (4, 7.0)]
    assert [(event.step, event.value) for event in events.Scalars("train/loss")] == [(2, 7.5)]
    text = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert '"steps": 7' in text and '"report_to": "tensorboard"' in text


def stand_in(monkeypatch, name, **functions):
    """A stand-in module ``name`` recording its calls (importable, find_spec sees it)."""
    calls = []
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    for function, result in functions.items():
        setattr(module, function, lambda *args, _f=function, _r=result, **kwargs: calls.append((_f, args, kwargs))
                or _r)
    monkeypatch.setitem(sys.modules, name, module)
    return calls


def test_wandb_runs_offline_without_a_key_and_logs_the_same_scalars(monkeypatch, tmp_path):
    run_calls = []
    run = types.SimpleNamespace(log=lambda values, step: run_calls.append(("log", values, step)),
                                finish=lambda: run_calls.append(("finish",)))
    calls = stand_in(monkeypatch, "wandb", init=run)
    for variable in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_PROJECT"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc: no key from `wandb login`
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    config = PorosConfig(report_to=["wandb"])
    with tracking.open_trackers(config, tmp_path / "out") as trackers:
        trackers.log(EVAL_ROW)
    (_, args, kwargs), = calls
    assert kwargs == {"project": "poros", "config": config.to_dict(), "dir": str(tmp_path / "out"), "mode": "offline"}
    assert run_calls == [("log", tracking.scalars(EVAL_ROW), 2), ("finish",)]

    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setenv("WANDB_PROJECT", "mine")
    tracking.open_trackers(config, tmp_path / "out").close()
    assert calls[-1][2]["mode"] is None and calls[-1][2]["project"] == "mine"  # online: W&B's own choice


def test_mlflow_and_trackio_adapters_reach_their_calls(monkeypatch, tmp_path):
    mlflow = stand_in(monkeypatch, "mlflow", set_experiment=None, start_run=None, log_params=None, log_metrics=None,
                      end_run=None)
    trackio = stand_in(monkeypatch, "trackio", init=None, log=None, finish=None)
    config = PorosConfig(report_to="mlflow,trackio", lora_rank=8)
    with tracking.open_trackers(config, tmp_path) as trackers:
        trackers.log(TRAIN_ROW)
    assert [call[0] for call in mlflow] == ["set_experiment", "start_run", "log_params", "log_metrics", "end_run"]
    params = mlflow[2][1][0]
    assert params["lora_rank"] == "8" and params["model"] == "poros-tiny-qwen3"
    assert mlflow[3][1] == (tracking.scalars(TRAIN_ROW),) and mlflow[3][2] == {"step": 2}
    assert trackio == [("init", (), {"project": "poros", "config": config.to_dict()}),
                       ("log", (tracking.scalars(TRAIN_ROW),), {"step": 2}), ("finish", (), {})]


def test_a_missing_tracker_fails_before_the_model_loads_and_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(tracking.TRACKERS, "wandb", (("poros_test_absent_package",), "wandb"))
    with pytest.raises(ConfigError, match=r"pip install 'poros-train\[wandb\]'"):
        tracking.check_installed(["tensorboard", "wandb"])
    from poros.training.trainer import PorosTrainer

    # a model path that does not exist: the tracker check must come first
    config = PorosConfig(model=str(tmp_path / "no-model"), report_to="wandb")
    with pytest.raises(ConfigError, match="poros_test_absent_package is not installed"):
        PorosTrainer.from_config(config)


def test_report_to_none_and_all(monkeypatch):
    assert tracking.tracker_names("none") == [] and tracking.open_trackers(PorosConfig(), ".").trackers == []
    for name in ("wandb", "mlflow", "trackio"):
        monkeypatch.setitem(tracking.TRACKERS, name, (("poros_test_absent_package",), name))
    assert tracking.tracker_names("all") == ["tensorboard"]  # tensorboard is in the test extra


# ---------------------------------------------------------------------------------------------
# progress: plain lines when stdout is not a terminal
# ---------------------------------------------------------------------------------------------
class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_plain_progress_prints_after_the_first_step_and_when_quiet_too_long(capsys):
    clock = Clock()
    bar = progress.PlainProgress(20, 2, unit="step", label="train", interval=30.0, clock=clock)  # resumed at 2
    with progress.showing(bar):
        for _ in range(4):
            clock.now += 2.5
            bar.update(1)
        bar.set_postfix(loss="7.5455")
        clock.now += 25  # 30 s since the first line, but the log line below came in between
        progress.echo("step 6/20 | loss 7.5455")  # goes through the bar
        clock.now += 20
        bar.update(1)
        clock.now += 15  # a slow step: 35 s without a line
        bar.update(1)
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "train 3/20 steps (15%) | 2.50 s/step | 42s left",
        "step 6/20 | loss 7.5455",
        "train 8/20 steps (40%) | 11.67 s/step | 2m20s left | loss 7.5455",  # 70 s / 6 steps
    ]


def test_progress_bar_is_plain_when_stdout_is_piped(capsys):
    assert isinstance(progress.progress_bar(10, label="train"), progress.PlainProgress)  # capsys: not a TTY
    nested = progress.progress_bar(10, unit="batch", label="eval", nested=True)
    for _ in range(10):
        nested.update(1)
    assert capsys.readouterr().out == ""  # nested (eval) bars print by time only
