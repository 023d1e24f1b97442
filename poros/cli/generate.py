"""``poros generate``: try a trained adapter -- generate text with the base + adapter, blocks streamed.

Loads the base as the adapter was trained (4-bit, blocks on the host), adds the adapter with PEFT,
and runs transformers' ``generate`` with a KV cache on the device; each decoder block streams in
for each token, so a model that does not fit the device still generates. Prints the text as it
comes and the rate in tokens/s. Exit status: 0 generated, 1 a Poros error, 2 a usage error.
"""

from __future__ import annotations

import argparse
import textwrap
from typing import Any

DESCRIPTION = """\
Generate text with a trained adapter on its base model.

Greedy by default (the tokens the resident PEFT model gives); --temperature > 0 samples
(--top-p, --seed). The tokenizer's chat template wraps the prompt as one user turn when the
tokenizer has one (--no-chat feeds the raw text). Each block crosses the host-to-device link once
per token: streaming trades speed for memory; --resident-blocks N keeps the last N on the device.
"""

EPILOG = textwrap.dedent("""\
    examples:
      $ poros train --steps 20 --output-dir /tmp/tiny-lora
      $ poros generate --adapter /tmp/tiny-lora --prompt "Name three colours." --max-new-tokens 32
      ...
      poros: 32 new tokens after a 15-token prompt in ... s: ... tokens/s

      $ poros generate --adapter ./qwen32b-lora --prompt "Summarise: ..." --temperature 0.7 --top-p 0.9 --seed 1
      $ poros generate --adapter ./qwen32b-lora --model /data/Qwen2.5-32B --prompt "2+2=" --no-chat
    """)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from poros.cli.merge import add_adapter_arguments

    parser = subparsers.add_parser(
        "generate", help="generate text with a trained adapter (blocks streamed, KV cache on the device)",
        description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_adapter_arguments(parser)
    parser.add_argument("--prompt", required=True, help="the prompt ('-' reads it from stdin)")
    parser.add_argument("--max-new-tokens", type=int, metavar="N",
                        help="tokens to generate at most (default: poros.export.generate.DEFAULT_MAX_NEW_TOKENS, 128)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; > 0: sample")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0)")
    parser.add_argument("--seed", type=int, help="seed for sampling")
    parser.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                        help="wrap the prompt in the tokenizer's chat template (default: when it has one)")
    parser.add_argument("--device", default="auto", help="auto (CUDA when available), cuda, cuda:1 or cpu")
    parser.add_argument("--resident-blocks", type=int, metavar="N", help="keep the last N blocks on the device")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    import sys

    from poros.export.generate import check_prompt, generate_text
    from poros.dropin.with_adapter import load_with_adapter
    from poros.noise import quiet_known_noise

    quiet_known_noise(verbose=getattr(args, "verbose", False))  # third-party notices, as in poros train
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    check_prompt(prompt)  # before minutes of loading
    device = None if args.device == "auto" else args.device
    model, tokenizer = load_with_adapter(args.adapter, model=args.model, device=device,
                                         resident_blocks=args.resident_blocks)
    streamer = _streamer(tokenizer)
    options = {} if args.max_new_tokens is None else {"max_new_tokens": args.max_new_tokens}
    result = generate_text(model, tokenizer, prompt, temperature=args.temperature, top_p=args.top_p,
                           seed=args.seed, chat=args.chat, streamer=streamer, **options)
    if streamer is None:
        print(result.text)
    print(result.summary(), file=sys.stderr)
    return 0


def _streamer(tokenizer: Any):
    """Prints the new text as it is generated (not the prompt)."""
    if tokenizer is None:
        return None
    import transformers

    return transformers.TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
