#!/usr/bin/env python3
"""Host memory of poros.loading.load: peak anonymous RSS while loading a checkpoint, against its bf16 size.

Writes a sharded Qwen3-architecture checkpoint (random weights, real transformers class), then in
child processes measures the peak RssAnon (/proc, sampled every 0.5 ms) above the child's baseline:

* ``poros``: ``poros.loading.load.load_pretrained(path, device="cpu")`` (after a one-layer warm-up load, so
  first-call initialisation of bitsandbytes/transformers is not counted);
* ``control``: every shard materialised in memory (``load_file`` + clone), which is what a load
  that holds the bf16 model would cost — it shows the measurement sees a full read.

Memory-mapped shard pages are file-backed and reclaimable, so they are not anonymous RSS.

    python -m tools.bench.load_memory --layers 16 --json registry/results/cpu-2026-11-30/load-memory.json

tests/test_load.py runs :func:`measure` on a 16-layer checkpoint and asserts the bound.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import textwrap

REPO = pathlib.Path(__file__).resolve().parents[2]
SHAPE = dict(hidden_size=512, num_heads=4, num_kv_heads=2, head_dim=128, intermediate_size=1536)

CHILD = textwrap.dedent("""
    import json, sys, threading, time
    import bitsandbytes, torch, transformers, safetensors.torch
    from poros.loading.load import load_pretrained

    def anon_kb():
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1])

    path, mode, warmup = sys.argv[1], sys.argv[2], sys.argv[3]
    if mode == "poros":  # first-call initialisation (bitsandbytes, transformers) is not the load's memory
        load_pretrained(warmup, load_tokenizer=False, device="cpu")
    baseline, peak, running = anon_kb(), [0], [True]
    def sample():
        while running[0]:
            peak[0] = max(peak[0], anon_kb())
            time.sleep(0.0005)
    thread = threading.Thread(target=sample); thread.start()
    if mode == "poros":
        kept = load_pretrained(path, load_tokenizer=False, device="cpu")
    else:  # the control: the bf16 model materialised in memory (load_file alone only maps the files)
        import pathlib
        kept = [{key: value.clone() for key, value in safetensors.torch.load_file(f).items()}
                for f in sorted(pathlib.Path(path).glob("*.safetensors"))]
    time.sleep(0.05)
    running[0] = False; thread.join()
    print(json.dumps({"peak_delta_bytes": (max(peak[0], anon_kb()) - baseline) * 1024}))
""")


def measure(directory: pathlib.Path, *, layers: int = 16) -> dict:
    """Write the checkpoints under ``directory`` and measure both modes; sizes in bytes."""
    from poros.testing import save_tiny_checkpoint

    path = save_tiny_checkpoint(directory / "big", "qwen3", num_layers=layers, max_shard_size="20MB", **SHAPE)
    warmup = save_tiny_checkpoint(directory / "warmup", "qwen3", num_layers=1, **SHAPE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))

    def peak(mode: str) -> int:
        result = subprocess.run([sys.executable, "-c", CHILD, str(path), mode, str(warmup)], capture_output=True,
                                text=True, env=env, check=True)
        return json.loads(result.stdout.strip().splitlines()[-1])["peak_delta_bytes"]

    return {"layers": layers, "shape": SHAPE,
            "bf16_checkpoint_bytes": sum(f.stat().st_size for f in path.glob("*.safetensors")),
            "control_peak_delta_bytes": peak("control"), "poros_peak_delta_bytes": peak("poros")}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--json", type=pathlib.Path)
    parser.add_argument("--commit", help="commit to record (default: git, or $POROS_COMMIT)")
    args = parser.parse_args(argv)
    import torch

    from tools.bench.provenance import environment

    with tempfile.TemporaryDirectory() as directory:
        result = measure(pathlib.Path(directory), layers=args.layers)
    report = {"tool": "tools/bench/load_memory.py", "environment": environment(torch.device("cpu"), args.commit), **result}
    mb = 1e6
    print(f"bf16 shards {result['bf16_checkpoint_bytes'] / mb:.0f} MB: poros load peak "
          f"+{result['poros_peak_delta_bytes'] / mb:.0f} MB anonymous RSS, control "
          f"+{result['control_peak_delta_bytes'] / mb:.0f} MB")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
