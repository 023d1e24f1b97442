"""Poros's measuring and doc-generating tools, a package so that they import each other normally
(``from tools.arms import run_arm``). Run them from the repository root as modules, e.g.
``python -m tools.bench --model tiny --device cpu`` (``tools/gpu_run.sh`` runs them that way; no tool
edits ``sys.path``); see docs/benchmarking.md. The harness is split by job: ``tools.shapes`` (shapes
from ``registry/*.toml``), ``tools.models`` (the model builder, ``poros.doctor.probe.random_nf4_model``,
LoRA and batches), ``tools.arms`` (the arms and their parity), ``tools.trainer_arms`` / ``tools.trainer_common`` (HF Trainer and TRL SFTTrainer arms), ``tools.unsloth_arm`` / ``tools.unsloth_child`` (the Unsloth arm's process), ``tools.timeline`` (the profiler and
the copy timeline), ``tools.provenance`` (device, versions, date, commit), ``tools.report`` (printed
lines) and ``tools.bench``, the command line over them."""
