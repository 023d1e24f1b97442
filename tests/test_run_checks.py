"""Checks `poros train --dry-run` makes before anything loads, as the run itself makes them."""

from __future__ import annotations

import json

from poros.cli.main import main

TINY = "poros-tiny-qwen3"


def run(capsys, *argv: str) -> tuple[int, str]:
    status = main(list(argv))
    captured = capsys.readouterr()
    return status, captured.out + captured.err


def test_dry_run_checks_the_eval_dataset_too(capsys, tmp_path):
    status, out = run(capsys, "train", "--model", TINY, "--output-dir", str(tmp_path / "o"), "--dry-run",
                      "--eval-dataset", str(tmp_path / "missing.jsonl"))
    assert status == 1 and "missing.jsonl" in out and "Traceback" not in out


def test_dry_run_takes_the_batch_per_device_over_ranks(capsys, tmp_path):
    """batch_size counts per device (HF's per_device_train_batch_size): 3 over 2 ranks is no error any more
    (it was a DistributedError while the batch was global), and the plan shows the per-device batch."""
    status, out = run(capsys, "train", "--model", TINY, "--output-dir", str(tmp_path / "o"), "--dry-run",
                      "--nproc-per-node", "2", "--batch-size", "3")
    assert status == 0 and "batch 3 x seq" in out and "DistributedError" not in out
    assert not (tmp_path / "o").exists()


