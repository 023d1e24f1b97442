"""tools/checks/merge_generate_bench.py runs on CPU as documented and reports (no timing asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("bitsandbytes")

REPO = Path(__file__).resolve().parents[1]


def test_merge_generate_bench_smoke(tmp_path, child_env):
    report_path = tmp_path / "merge.json"
    command = [sys.executable, "-m", "tools.checks.merge_generate_bench", "--model", "tiny", "--device", "cpu", "--layers", "2",
               "--shard-size", "100KB", "--prompt-tokens", "8", "--new-tokens", "4", "--json", str(report_path)]
    done = subprocess.run(command, cwd=REPO, env=child_env(POROS_COMMIT="test", OMP_NUM_THREADS="1"),
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert report["environment"]["commit"] == "test"
    merge, generate = report["merge"], report["generate"]
    assert merge["returncode"] == 0 and merge["merged_modules"] == 2 * 7 and merge["shards"] > 1
    assert merge["peak_rss_bytes"] >= merge["baseline_rss_bytes"] > 0
    assert generate["tokens_equal"] and generate["arms"]["streamed"]["sequence"] == 8 + 4
    assert "poros merge: shard 1/" in done.stderr
