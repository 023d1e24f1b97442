"""``poros quantize``: write a bf16 checkpoint as a pre-quantized bitsandbytes 4-bit one, block by block.

A thin shell over :func:`poros.loading.quantize.quantize_checkpoint` (and, with ``--random-weights``,
:func:`poros.loading.random_weights.random_checkpoint`). Exit status: 0 written, 1 a
Poros error (no checkpoint, already pre-quantized, an existing output), 2 a usage error.
"""

from __future__ import annotations

import argparse
import textwrap
from typing import Any

DESCRIPTION = """\
Quantize MODEL (a bf16 checkpoint: directory, hub id or poros-tiny-qwen3) to bitsandbytes 4-bit and
write it to OUT as save_pretrained writes a model loaded with BitsAndBytesConfig(load_in_4bit=True):
the same keys, dtypes and bytes, config.json with its quantization_config. Stock transformers
from_pretrained(OUT) and vLLM's bitsandbytes loader read it; Poros trains on it without quantizing
again (its blocks are byte for byte the NF4 blocks Poros makes from MODEL on the same device type).

The model is never whole in memory: each decoder block is quantized on the device (CUDA when
available), written to the shard being filled and dropped before the next one loads.

--random-weights (a benchmarking aid) needs no weights at all: MODEL is then a config.json, a
directory holding one, or a model name the registry knows (its recorded shape, offline), and each
block is built with random weights (the model class's own init, seeded by --seed and the block),
quantized and written in turn, so a checkpoint far larger than RAM or than its bf16 form's disk is
written with about one block in memory. Its weights are noise: use it to time loads and steps, never
to train a model you keep.
"""

EPILOG = textwrap.dedent("""\
    examples:
      $ poros quantize poros-tiny-qwen3 /tmp/tiny-bnb-4bit --double-quant
      poros: wrote /tmp/tiny-bnb-4bit: nf4 + double quant (quantized on cpu), 4 blocks, 1 shard, 187 tensors, ...

      $ poros quantize Qwen/Qwen2.5-72B ./qwen72b-bnb-4bit --double-quant
      $ poros train --model ./qwen72b-bnb-4bit      # loads the packed bytes as they are
      $ python -c "import transformers; transformers.AutoModelForCausalLM.from_pretrained('./qwen72b-bnb-4bit')"

      $ poros quantize Qwen/Qwen2.5-72B /tmp/qwen72b-random --random-weights --double-quant   # benchmarks only
    """)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "quantize", help="write a bf16 checkpoint as a bnb-4bit one (nf4/fp4), block by block",
        description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", metavar="MODEL", help="the bf16 checkpoint: directory, hub id or poros-tiny-qwen3 "
                                                       "(with --random-weights: a config.json, a directory holding "
                                                       "one, or a known model name)")
    parser.add_argument("output", metavar="OUT", help="the directory to write the 4-bit checkpoint to (new or empty)")
    parser.add_argument("--quantization", default="nf4", choices=("nf4", "fp4"),
                        help="bnb_4bit_quant_type (default nf4)")
    parser.add_argument("--double-quant", action="store_true",
                        help="bnb_4bit_use_double_quant: quantize the scales too (about 0.4 bits per value less)")
    parser.add_argument("--compute-dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                        help="bnb_4bit_compute_dtype and the dtype of the unquantized tensors (default bfloat16)")
    parser.add_argument("--device", default=None,
                        help="where the blocks are quantized: cuda, cuda:N or cpu (default: CUDA when available). "
                             "Quantize on the kind of device you train on for blocks byte-equal to Poros's own")
    parser.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                        help="bytes per safetensors shard, e.g. 5GB, 500MB (default 5GB; the host holds one)")
    parser.add_argument("--revision", default=None, help="hub revision of MODEL")
    parser.add_argument("--random-weights", action="store_true",
                        help="benchmarks: random weights for MODEL's config instead of its weights (none are read)")
    parser.add_argument("--seed", type=int, default=0, help="the random weights' seed (with --random-weights)")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it is not empty")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    import dataclasses

    from poros.cli.output import print_json
    from poros.config import parse_budget
    from poros.loading.quantize import quantize_checkpoint
    from poros.loading.random_weights import random_checkpoint
    from poros.noise import quiet_known_noise

    quiet_known_noise(verbose=getattr(args, "verbose", False))
    common = dict(quantization=args.quantization, double_quant=args.double_quant, compute_dtype=args.compute_dtype,
                  device=args.device, max_shard_size=parse_budget(args.max_shard_size, "max_shard_size"),
                  overwrite=args.overwrite)
    if args.random_weights:
        result = random_checkpoint(args.model, args.output, seed=args.seed, **common)
    else:
        result = quantize_checkpoint(args.model, args.output, revision=args.revision, **common)
    if args.json:
        print_json(dataclasses.asdict(result))
    else:
        print(result.summary())
    return 0
