"""The benchmark harness, split by job: ``tools.bench.shapes`` (shapes from ``registry/*.toml``),
``tools.bench.models`` (the model builder, ``poros.doctor.probe.random_nf4_model``, LoRA and batches),
``tools.bench.arms`` (the arms and their parity), ``tools.bench.trainer_arms`` /
``tools.bench.trainer_common`` (HF Trainer and TRL SFTTrainer arms), ``tools.bench.unsloth_arm`` /
``tools.bench.unsloth_child`` (the Unsloth arm's process), ``tools.bench.timeline`` (the profiler and the
copy timeline), ``tools.bench.provenance`` (device, versions, date, commit), ``tools.bench.report``
(printed lines) and ``tools.bench.harness``, the command line over them (``python -m tools.bench``).
The curve, host-overhead, CPU-thread and load-memory measurements sit beside it."""
