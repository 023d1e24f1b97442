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


def test_dry_run_takes_any_batch_over_ranks_since_batch_size_is_per_device(capsys, tmp_path):
    status, out = run(capsys, "train", "--model", TINY, "--output-dir", str(tmp_path / "o"), "--dry-run",
                      "--nproc-per-node", "2", "--batch-size", "3")
    assert status == 0 and "batch 3 x seq 512" in out and not (tmp_path / "o").exists()

