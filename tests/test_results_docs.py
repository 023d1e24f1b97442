"""docs/results-h200.md is generated from the committed benchmark JSON: it must not drift from it."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_results_page_matches_the_committed_json():
    result = subprocess.run([sys.executable, "-m", "tools.docs.gen_results_docs", "--check"], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_every_gate_record_in_the_registry_has_its_evidence():
    from poros import records

    for family in records.all_families():
        for record in records.validations(family):
            assert record["label"] in records.LABELS
            evidence = record.get("evidence")
            if evidence:
                assert (ROOT / evidence).exists(), f"{family}: {evidence} is not committed"
