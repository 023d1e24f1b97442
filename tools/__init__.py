"""Poros's tools beside the package, by job, each folder a package so that they import each other
normally (``from tools.bench.arms import run_arm``). Run them from the repository root as modules
(``tools/gpu_run.sh`` runs them that way; no tool edits ``sys.path``):

- ``tools.bench``: the benchmark harness (``python -m tools.bench --model tiny --device cpu``), its
  shapes, arms, report and the Unsloth arm; see docs/benchmarking.md.
- ``tools.docs``: the generators of the docs' generated blocks (``python -m tools.docs.gen_results_docs``).
- ``tools.checks``: the GPU checks the docs cite (``python -m tools.checks.parity_gate --device cpu --tiny``).
- ``tools.make_tiny_default``: builds the tiny default checkpoint in ``poros/assets``.

The planner's calibration against the H200 records lives in the package (``poros.plan.calibration``).
"""
