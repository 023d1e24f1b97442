"""Poros's measuring and doc-generating tools, a package so they import each other normally:
``from tools import bench``. Run them from the repository root as modules, e.g.
``python -m tools.bench --model tiny --device cpu`` (``tools/gpu_run.sh`` runs them that way);
see docs/benchmarking.md. ``tools.bench`` is the harness library: shapes (from ``registry/*.toml``),
the model builder (``poros.doctor.probe.random_nf4_model``), the arms, parity and provenance."""
