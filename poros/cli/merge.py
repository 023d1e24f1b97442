"""``poros merge``: merge a trained LoRA adapter into its base checkpoint, one tensor at a time.

Writes a plain HF checkpoint (safetensors shards + index, config, tokenizer) that transformers,
vLLM and every other loader read as a base model, or with ``--format gguf`` one GGUF file for
llama.cpp and Ollama (:mod:`poros.export.gguf`). Host memory stays at about the largest tensor
of the base (plus the adapter): a 72B model merges on a machine that cannot hold it. Exit status:
0 merged, 1 a Poros error (no adapter or base, an adapter it cannot merge, an existing output), 2 a
usage error.
"""

from __future__ import annotations

import argparse
import textwrap
from typing import Any

DESCRIPTION = """\
Merge a LoRA adapter (LoRA, rsLoRA or DoRA, as `poros train` saves it) into its base model.

The base is read tensor by tensor, each shard written as it is read; each adapted weight is
merged with PEFT's own LoRA layer and merge(), so the result is tensor for tensor what PEFT's
merge_and_unload gives on the base loaded in --dtype (on the same device type). The base
defaults to the one the adapter was trained on (poros_config.json / adapter_config.json
base_model_name_or_path); pass --model for the original bf16 checkpoint when training used
another copy. A multimodal checkpoint keeps its vision tower.
"""

EPILOG = textwrap.dedent("""\
    examples:
      $ poros train --steps 20 --output-dir /tmp/tiny-lora
      $ poros merge --adapter /tmp/tiny-lora --output /tmp/tiny-merged
      poros merge: shard 1/3, 10/28 adapted weights merged, 0.0 s elapsed, ~0 s left
      ...
      poros: merged 28 adapted weights into /tmp/tiny-merged: 3 shards, 47 tensors, 2.5 MiB in 0.1 s, peak RSS ...

      $ poros merge --adapter ./qwen32b-lora --model Qwen/Qwen2.5-32B --output ./qwen32b-merged
      $ python -c "import transformers; transformers.AutoModelForCausalLM.from_pretrained('./qwen32b-merged')"
      $ vllm serve ./qwen32b-merged

      $ poros merge --adapter /tmp/tiny-lora --format gguf --gguf-type q8_0 --output /tmp/tiny.gguf
      poros: merged 28 adapted weights into /tmp/tiny.gguf (GGUF q8_0, architecture qwen3, pre-tokenizer gpt-2): 47 ...
      $ llama-cli -m /tmp/tiny.gguf -p "Name three colours."      # or: ollama create tiny -f /tmp/tiny.Modelfile
    """)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "merge", help="merge a LoRA adapter into its base checkpoint, tensor by tensor (low host memory)",
        description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_adapter_arguments(parser)
    parser.add_argument("--output", required=True, metavar="PATH",
                        help="the directory to write the merged checkpoint to (--format gguf: the .gguf file)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                        help="dtype of the base's floating tensors, read and written (default bfloat16)")
    parser.add_argument("--device", default="cpu",
                        help="where adapted weights are merged: cpu (default) or cuda (bits equal "
                             "merge_and_unload run on that device type)")
    parser.add_argument("--format", default="safetensors", choices=("safetensors", "gguf"),
                        help="safetensors (default): an HF checkpoint directory; gguf: one .gguf file for llama.cpp "
                             "and Ollama, with an Ollama NAME.Modelfile beside it (qwen2, qwen3; needs pip install 'poros-train[gguf]')")
    parser.add_argument("--gguf-type", choices=("bf16", "f16", "f32", "q8_0"), default=None,
                        help="with --format gguf: the type of the weight matrices (default bf16; norms stay f32)")
    parser.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.set_defaults(run=run)
    return parser


def add_adapter_arguments(parser: argparse.ArgumentParser) -> None:
    """``--adapter DIR`` and ``--model BASE``, as ``poros merge`` and ``poros generate`` take them."""
    parser.add_argument("--adapter", required=True, metavar="DIR", help="the adapter directory (poros train output)")
    parser.add_argument("--model", metavar="BASE",
                        help="base checkpoint: directory or hub id (default: the adapter's base_model_name_or_path)")


def run(args: argparse.Namespace) -> int:
    import dataclasses
    import sys

    from poros.cli.output import print_json
    from poros.export.merge import merge_adapter
    from poros.noise import quiet_known_noise

    quiet_known_noise(verbose=getattr(args, "verbose", False))  # third-party notices, as in poros train
    if args.format == "gguf":
        from poros.export.gguf import merge_to_gguf

        result = merge_to_gguf(args.adapter, args.output, model=args.model, gguf_type=args.gguf_type or "bf16",
                               dtype=args.dtype, device=args.device, overwrite=args.overwrite, progress=sys.stderr)
    elif args.gguf_type is not None:
        from poros.errors import ConfigError

        raise ConfigError(f"--gguf-type {args.gguf_type} without --format gguf: the type is the GGUF file's. Fix: add "
                          "--format gguf, or leave --gguf-type out for a safetensors checkpoint.")
    else:
        result = merge_adapter(args.adapter, args.output, model=args.model, dtype=args.dtype, device=args.device,
                               overwrite=args.overwrite, progress=sys.stderr)
    if args.json:
        print_json(dataclasses.asdict(result))
    else:
        print(result.summary())
    return 0
