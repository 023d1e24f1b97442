"""How many CPU threads a small model trains fastest with: ``PorosTrainer`` on the CPU, one thread against
torch's default, at a few widths; what ``cpu_threads: auto`` (``poros.devices.ONE_THREAD_BELOW_HIDDEN``)
is chosen from.

::

    python -m tools.bench.cpu_threads                         # widths 128 256 512 1024, 20 steps each, JSON on stdout
    python -m tools.bench.cpu_threads --hidden 128 2048 --steps 10 --rounds 3 --json threads.json

Per width: a random Qwen3 checkpoint (4 blocks, intermediate 3 x hidden, head_dim 32) with the bundled
tokenizer, trained on the bundled chat data (seq_len 512, batch 1) by ``PorosTrainer`` with
``cpu_threads`` 1 and torch's default in turn (``--rounds`` times, alternating, so that a machine's
drift hits both); it prints the median seconds per step of each and their ratio. Run it on the box
whose choice you want (a loaded 2-core box and a quiet 64-core one differ); ``OMP_NUM_THREADS`` must
be unset (it fixes torch's default).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time


def write_checkpoint(directory: pathlib.Path, hidden: int) -> pathlib.Path:
    """A random bf16 Qwen3 of width ``hidden`` with the bundled tokenizer, saved as a checkpoint."""
    import torch
    import transformers

    from poros.assets import asset_path

    tokenizer = transformers.AutoTokenizer.from_pretrained(asset_path("poros-tiny-qwen3"))
    config = transformers.Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=hidden, num_hidden_layers=4, num_attention_heads=max(hidden // 32, 1),
        num_key_value_heads=max(hidden // 64, 1), head_dim=32, intermediate_size=3 * hidden,
        tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM._from_config(config, dtype=torch.bfloat16).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def seconds_per_step(checkpoint: pathlib.Path, threads: int, steps: int, work: pathlib.Path) -> float:
    """One short run with ``threads`` CPU threads: the seconds of ``train()`` per step."""
    import torch

    from poros.training.trainer import PorosTrainer

    torch.set_num_threads(threads)
    trainer = PorosTrainer.from_pretrained(checkpoint, device="cpu", cpu_threads=threads, no_cache=True,
                                           output_dir=str(work / f"run-{threads}-{time.monotonic_ns()}"))
    start = time.perf_counter()
    trainer.train(steps=steps, logging_steps=steps)
    return (time.perf_counter() - start) / steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[128, 256, 512, 1024])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=pathlib.Path, help="also write the report here")
    args = parser.parse_args(argv)
    if os.environ.get("OMP_NUM_THREADS"):
        print("unset OMP_NUM_THREADS: it fixes torch's default thread count", file=sys.stderr)
        return 2
    import torch

    default = torch.get_num_threads()
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        work = pathlib.Path(scratch)
        for hidden in args.hidden:
            checkpoint = write_checkpoint(work / f"qwen3-{hidden}", hidden)
            times: dict[int, list[float]] = {1: [], default: []}
            for _ in range(args.rounds):
                for threads in dict.fromkeys((1, default)):
                    times[threads].append(seconds_per_step(checkpoint, threads, args.steps, work))
            one, many = statistics.median(times[1]), statistics.median(times[default])
            rows.append({"hidden": hidden, "threads_default": default, "s_per_step_1_thread": round(one, 4),
                         "s_per_step_default": round(many, 4), "default_over_1": round(many / one, 3)})
            print(json.dumps(rows[-1]), file=sys.stderr)
    report = {"cpu_count": os.cpu_count(), "load_average": os.getloadavg(), "torch": torch.__version__,
              "steps": args.steps, "rounds": args.rounds, "rows": rows}
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
