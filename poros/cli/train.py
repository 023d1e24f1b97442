"""``poros train``: train a LoRA adapter from a ``poros.yaml`` and/or ``--key value`` overrides.

``poros train`` alone trains the bundled tiny Qwen3 on the bundled chat data on the CPU, so a
fresh install can go from nothing to a saved adapter without a download or a GPU.
Exit status: 0 trained and saved (or ``--dry-run`` printed the plan), 1 a Poros error (a bad
config value or override, a missing checkpoint, an output_dir in use...), 2 a usage error, 130
interrupted (the checkpoint written on the interrupt is printed with the command that resumes it).
"""

from __future__ import annotations

import argparse
import textwrap
from typing import Any

from poros.cli.arguments import keep_unknown_arguments, load_config, split_arguments  # noqa: F401 (re-exported)

DESCRIPTION = """\
Train a LoRA adapter on a frozen 4-bit base that streams through the device block by block.

  CONFIG          a poros.yaml (write one with `poros init`); optional: without it every
                  field has its default (the bundled tiny model and chat data, on the CPU)
  --KEY VALUE     override any PorosConfig field after CONFIG: --steps 50, --seq-len 256,
                  --lr 1e-4, --target-modules q_proj,v_proj, --max-grad-norm null,
                  --use-dora / --no-use-dora. Keys take dashes or underscores, and HF / TRL /
                  axolotl names mean the same field (--learning-rate, --max-steps,
                  --num-train-epochs, --per-device-train-batch-size ...); values are
                  checked against the field's type; an unknown key fails by name (exit 1)

On success the adapter (adapter_model.safetensors + adapter_config.json, PEFT's format), the
tokenizer and poros_config.json are in output_dir, and the command prints how to load them
with stock PEFT. Ctrl-C finishes the step in flight, writes a checkpoint, prints the command
that resumes it and exits with status 130.
"""

EPILOG = textwrap.dedent("""\
    examples:
      $ poros train                                  # bundled tiny Qwen3 + bundled chat data, CPU
      $ poros train --steps 20 --output-dir /tmp/tiny-lora
      $ poros train poros.yaml                       # the file written by `poros init`
      $ poros train poros.yaml --model Qwen/Qwen2.5-7B --dataset data/chat.jsonl --seq-len 1024
      $ poros train --eval-split 0.1 --eval-steps 50 --report-to tensorboard   # held-out eval_loss

      $ poros train --num-train-epochs 2 --learning-rate 1e-4   # HF's names: 2 passes over the data
      $ poros train --nproc-per-node 2 --batch-size 4   # 2 ranks (torch.distributed.run), 4 rows each
      $ torchrun --nproc-per-node 8 -m poros train poros.yaml    # the same, started by torchrun

      $ poros train --dry-run                        # validate, print the memory plan; nothing loaded
      poros train --dry-run: the configuration is valid (all defaults)
      model       poros-tiny-qwen3 (bundled with poros: .../poros/assets/tiny-qwen3)
      family      qwen3 (model_type qwen3): 4 decoder blocks, hidden 128, vocab 2048
      base        nf4, compute bfloat16
      adapters    LoRA r16 on 28 linears (all-linear): 155,648 trainable parameters
      run         batch 1 x seq 512, 2 device slots, device cpu
      blocks      116,224 B x 4 (host store, exact)
      ...

      $ poros train poros.yaml --stpes 10
      poros train: error: ConfigError: unknown override --stpes: PorosConfig has no field 'stpes'; did you mean
      'steps'? ...
    """)

#: The fields ``poros train --help`` lists, by group (every field: docs/configuration.md).
COMMON_FIELDS = ("model", "quantization", "lora_rank", "lora_alpha", "target_modules", "dataset", "seq_len",
                 "chat_template", "eval_split", "eval_steps", "report_to", "batch_size", "grad_accum", "steps",
                 "epochs", "lr", "schedule", "warmup", "logging_steps", "save_steps", "output_dir", "resume_from",
                 "device", "vram_budget", "cpu_threads")


def common_fields_help() -> str:
    """The common fields by group, each as ``--key DEFAULT``, its doc's first clause and its other names."""
    import re

    from poros.config import field_docs
    from poros.spellings import aliases_of

    lines, section = ["common fields by group: --KEY DEFAULT, what it is [the field's HF / TRL / axolotl names]",
                      "(every field: docs/configuration.md, or the commented poros.yaml `poros init` writes):"], None
    for doc in field_docs():
        if doc["name"] not in COMMON_FIELDS:
            continue
        if doc["section"] != section:
            section = doc["section"]
            lines.append(f"  {section}")
        default = "null" if doc["default"] is None else str(doc["default"]).lower() if isinstance(
            doc["default"], bool) else doc["default"]
        short = re.split(r"(?<=[a-z0-9)'])(?:[.;:] | \(|, e\.g\.)", doc["doc"], maxsplit=1)[0].rstrip(".")
        others = " ".join(f"--{alias.replace('_', '-')}" for alias in aliases_of(doc["name"]))
        text = f"{short} [{others}]" if others else short
        key = f"    --{doc['name'].replace('_', '-')} {default}"
        lines += textwrap.wrap(text, width=100, initial_indent=f"{key:<40}" if len(key) < 40 else key + " ",
                               subsequent_indent=" " * 40, break_on_hyphens=False)
    return "\n".join(lines) + "\n"


USAGE = "poros train [-h] [--dry-run] [--verbose] [--nproc-per-node N] [CONFIG] [--KEY VALUE ...]"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "train",
        help="train a LoRA adapter (bundled tiny model by default; --dry-run prints the memory plan)",
        description=DESCRIPTION + "\n" + common_fields_help(),
        epilog=EPILOG,
        usage=USAGE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # `--dr 5` must be an unknown override, not --dry-run
    )
    parser.add_argument("--dry-run", action="store_true",
                        help="validate the config and print the memory plan (from config.json only) without "
                             "loading weights or training")
    parser.add_argument("--verbose", action="store_true",
                        help="also show the known third-party notices Poros hides (see poros.noise)")
    parser.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                        help="data parallel: start N ranks on this node through torch.distributed.run (the "
                             "launcher torchrun is); each streams its own blocks, rank 0 writes. Multi-node: "
                             "torchrun --nnodes ... -m poros train (docs/multi-gpu.md)")
    parser.set_defaults(run=run)
    keep_unknown_arguments(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    import shlex
    import sys

    from poros import distributed

    from poros.training import run_lock
    from poros.noise import quiet_known_noise
    from poros.training.validation import require_run_packages, validate_run

    quiet_known_noise(verbose=getattr(args, "verbose", False))
    arguments = list(getattr(args, "arguments", []))
    config = load_config(arguments)
    require_run_packages("poros train" + (" --dry-run" if args.dry_run else ""))
    validate_run(config, dry_run=args.dry_run)  # before any weight is read, and before any rank starts
    if args.dry_run:
        return dry_run(config)
    if args.nproc_per_node is not None and args.nproc_per_node > 1 and not distributed.launched_by_torchrun():
        return distributed.launch(args.nproc_per_node, ["train", *(["--verbose"] if args.verbose else []), *arguments])
    world = distributed.world()
    ranks = world.local_size if world.distributed else 1  # the resume command starts as many ranks
    launch_command = ["poros", "train", *(["--nproc-per-node", str(ranks)] if ranks > 1 else []), *arguments]
    # one run per output_dir, through the final save (data parallel: rank 0 holds it for the job's ranks)
    with run_lock.hold(config.output_dir, command=shlex.join(launch_command)):
        status, together = train(config, launch_command=launch_command)
    # Every rank leaves the job (a no-op without one): with the others when it got to the end of the run
    # with them, alone when a Ctrl-C stopped it on its own while loading (its peers may be anywhere).
    try:
        distributed.leave_process_group(barrier=together)
    except Exception as error:  # noqa: BLE001 -- a peer that failed: this rank's results are already written
        print(f"poros train: leaving the process group failed ({type(error).__name__}: {error}).", file=sys.stderr)
    return status


def dry_run(config) -> int:
    """Print the validated settings that differ from the defaults and the memory plan; load nothing."""
    from poros.cli.report import format_plan
    from poros.config import PorosConfig
    from poros.plan.run_plan import plan_run

    plan = plan_run(config)
    defaults = PorosConfig().to_dict()
    changed = [f"{name}={value!r}" for name, value in config.to_dict().items() if value != defaults[name]]
    print("poros train --dry-run: the configuration is valid"
          + (f" (changed from the defaults: {', '.join(changed)})" if changed else " (all defaults)"))
    print(format_plan(plan))
    print("Nothing was loaded or trained. Run the same command without --dry-run to train.")
    return 0


def train(config, *, launch_command: list[str]) -> tuple[int, bool]:
    """Load, train, save: the exit status (0, or 130 when interrupted), and whether every rank of a data-
    parallel job got here together (False: this rank stopped on its own, before training started)."""
    import sys

    from poros.distributed import world
    from poros.training.stop import StopRequest
    from poros.training.trainer import PorosTrainer

    try:
        trainer = PorosTrainer.from_config(config)
        trainer.launch_command = launch_command
        result = trainer.train()
    except KeyboardInterrupt:  # before training started (loading) or a second Ctrl-C: nothing to resume
        print("poros train: interrupted; nothing was saved.", file=sys.stderr)
        return 130, False
    if result.interrupted:
        return 130, True  # the ranks agreed to stop; the trainer wrote checkpoint-{step} and said how to resume
    # A signal during the final save (a preemption's SIGTERM) waits for the save: with save_steps 0
    # the adapter is the only copy of the run.
    with StopRequest() as stop:
        output_dir = trainer.save(config.output_dir)  # data parallel: rank 0 writes
    if world().is_main:
        print(loading_instructions(config.model, output_dir))
    if stop.signal_name is not None:
        print(f"poros train: {stop.signal_name} arrived during the final save; the adapter was saved first.",
              file=sys.stderr)
        return 130, True
    return 0, True


def loading_instructions(model: str, output_dir: Any) -> str:
    """How to load the saved adapter with stock transformers + PEFT (the bundled model by its path)."""
    from pathlib import Path

    from poros.assets import asset_path, is_asset

    base = str(asset_path(model)) if is_asset(model) else model
    directory = str(output_dir)
    has_tokenizer = (Path(directory) / "tokenizer_config.json").is_file()
    lines = [
        f"poros train: the adapter is in {directory} (adapter_model.safetensors, adapter_config.json"
        + (", tokenizer" if has_tokenizer else "") + ", poros_config.json). Load it with PEFT:",
        "",
        "    from peft import PeftModel",
        "    from transformers import AutoModelForCausalLM" + (", AutoTokenizer" if has_tokenizer else ""),
        f"    base = AutoModelForCausalLM.from_pretrained({base!r})",
        f"    model = PeftModel.from_pretrained(base, {directory!r})",
    ]
    if has_tokenizer:
        lines.append(f"    tokenizer = AutoTokenizer.from_pretrained({directory!r})")
    return "\n".join(lines)
