"""Render the generated block of docs/prepare.md: every H200 run of the Trainer arms (TRL ``SFTTrainer`` and HF
``Trainer``, plain and with the one line, and Unsloth beside them).

    python -m tools.docs.gen_prepare_docs            # rewrite the generated block of docs/prepare.md
    python -m tools.docs.gen_prepare_docs --check    # exit 1 if the page is stale (tests/test_results_docs.py runs this)

The table is results-h200.md's trainer table (``tools.docs.gen_results_docs.render_trainer``), from the same
``registry/results/h200-*/bench-*.json``: one renderer, two pages.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tools.docs import docgen, gen_results_docs

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "prepare.md"
BLOCKS = {"trainer": gen_results_docs.render_trainer}


def main(argv=None) -> int:
    return docgen.main_for_blocks(__doc__, PAGE, BLOCKS, argv)


if __name__ == "__main__":
    sys.exit(main())
