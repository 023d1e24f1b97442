"""Checks `poros train --dry-run` makes before anything loads, and a trainer's later train() calls."""

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


def test_dry_run_refuses_a_batch_the_ranks_do_not_divide(capsys, tmp_path):
    status, out = run(capsys, "train", "--model", TINY, "--output-dir", str(tmp_path / "o"), "--dry-run",
                      "--nproc-per-node", "2", "--batch-size", "3")
    assert status == 1 and "DistributedError" in out and not (tmp_path / "o").exists()


def test_a_second_train_of_one_trainer_continues_its_own_run(tmp_path):
    """api-reference: each train() call is one run and the adapter carries over; the second call must not
    take the first call's metrics.jsonl for another run's results."""
    from poros import PorosTrainer

    trainer = PorosTrainer.from_pretrained(TINY, output_dir=str(tmp_path / "o"), device="cpu")
    trainer.train("synthetic", steps=2, logging_steps=1, seq_len=16)
    trainer.train("synthetic", steps=4, logging_steps=1, seq_len=16)
    rows = [json.loads(line) for line in (tmp_path / "o" / "metrics.jsonl").read_text().splitlines()]
    assert trainer.global_step == 4 and rows
