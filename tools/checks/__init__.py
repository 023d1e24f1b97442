"""The GPU checks the docs cite: the parity gate, DDP, loading, evaluation, the doctor, the trainers, and
the cache, pre-quantized and merge/generate benches. Each runs on the CPU with a tiny model as its dry run."""
