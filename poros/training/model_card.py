"""What a finished run says about itself: the end-of-run summary line, the adapter's model card, and the
base-model reference the saved files carry.

::

    poros: trained 100 steps in 3m12s (412,160 tokens, 2,147 tokens/s); loss 1.2034 (mean of steps 91-100);
    best eval_loss 1.3120 at step 100

    output_dir/README.md     the model card: base, data, steps, losses, eval, Poros version, guarantee
                             label, the command that trained it (PEFT's template is replaced)

Notable choices:

* **The final loss is a mean like the others.** The log lines show the mean over each
  ``logging_steps`` window; the summary shows the same mean over the last window, never a lone
  last-step value beside them.
* **A base reference stock PEFT resolves.** ``adapter_config.json`` and ``poros_config.json`` name
  the base as a hub id, or an absolute path for a local directory and the bundled tiny model (an
  alias only Poros knows), so ``AutoPeftModelForCausalLM.from_pretrained(adapter)`` and ``poros
  merge`` from another directory find it.
* **The card comes from the run's own record**: the last ``train()``'s result (its losses, logged
  rows and evaluations), the run's config and the model's guarantee label.
"""

from __future__ import annotations

import pathlib
import shlex
from typing import Any

#: the model card's file name (the HF hub reads it)
MODEL_CARD_FILE = "README.md"


def base_model_reference(model: str) -> str:
    """How saved files name the base ``model``: the bundled tiny model and a local directory as absolute
    paths (a relative path breaks from another directory, the alias outside Poros), a hub id as it is."""
    from poros.assets import asset_path, is_asset

    if is_asset(model):
        return str(asset_path(model))
    path = pathlib.Path(model).expanduser()
    if path.exists():
        return str(path.resolve())
    return model


def final_loss(losses: list[float], logging_steps: int) -> tuple[float, int, int] | None:
    """``(mean, first step, last step)`` of the last logging window's losses (None when no step ran)."""
    if not losses:
        return None
    window = losses[-max(1, min(logging_steps, len(losses))):]
    return sum(window) / len(window), len(losses) - len(window) + 1, len(losses)


def best_eval(log_history: list[dict[str, Any]]) -> tuple[float, int] | None:
    """``(eval_loss, step)`` of the lowest evaluation of the history (None without one)."""
    rows = [(row["eval_loss"], row["step"]) for row in log_history if row.get("eval_loss") is not None]
    return min(rows) if rows else None


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes // 60}h{minutes % 60:02d}m" if minutes >= 60 else f"{minutes}m{secs:02d}s"


def _loss_text(losses: list[float], logging_steps: int) -> str:
    found = final_loss(losses, logging_steps)
    if found is None:
        return "no step trained"
    mean, first, last = found
    steps = f"step {last}" if first == last else f"mean of steps {first}-{last}"
    return f"loss {mean:.4f} ({steps})"


def summary_line(*, steps: int, losses: list[float], log_history: list[dict[str, Any]], logging_steps: int,
                 seconds: float, tokens: int) -> str:
    """The one line a run ends with: steps, wall time, tokens and their rate, the final loss (a window mean)
    and the best evaluation."""
    rate = f", {tokens / seconds:,.0f} tokens/s" if seconds > 0 else ""
    line = (f"poros: trained {steps} step{'' if steps == 1 else 's'} in {_duration(seconds)} ({tokens:,} "
            f"token{'' if tokens == 1 else 's'}{rate}); {_loss_text(losses, logging_steps)}")
    best = best_eval(log_history)
    if best is not None:
        line += f"; best eval_loss {best[0]:.4f} at step {best[1]}"
    return line


def training_command(launch_command: list[str] | None, config: dict[str, Any]) -> str:
    """The command line that trained the adapter (the CLI's argv), else the Python call with the fields that
    differ from the defaults."""
    if launch_command:
        return shlex.join(launch_command)
    from poros.config import PorosConfig

    defaults = PorosConfig().to_dict()
    changed = "".join(f", {name}={value!r}" for name, value in config.items()
                      if value != defaults.get(name) and name not in ("model", "resume_from"))
    return f"PorosTrainer.from_pretrained({config.get('model')!r}{changed}).train()"


def render_model_card(record: dict[str, Any], result: Any, command: str) -> str:
    """The model card (``README.md``) of a saved adapter: HF hub metadata, then what trained it and how.

    Args:
        record: the adapter's ``poros_config.json`` (version, family, guarantee, config, base).
        result: the run's :class:`~poros.training.run.TrainResult` (None: saved without training).
        command: how the run was started (:func:`training_command`).
    """
    config = record.get("config", {})
    base = record.get("base_model_name_or_path") or config.get("model")
    hub_id = (isinstance(base, str) and base.count("/") == 1 and not base.startswith((".", "/", "~"))
              and not pathlib.Path(base).exists())
    history = list(getattr(result, "log_history", None) or [])
    logged = ", ".join([f"{row['loss']:.4f} (step {row['step']})" for row in history if "loss" in row][-5:])
    losses = (f"{_loss_text(result.losses, int(config.get('logging_steps') or 1))}; logged: {logged or 'none'}"
              if result is not None else "not recorded (saved before train() returned, or without training)")
    best = best_eval(history)
    evaluations = sum("eval_loss" in row for row in history)
    targets = config.get("target_modules")
    return "\n".join([
        "---", *([f"base_model: {base}"] if hub_id else []), "library_name: peft", "pipeline_tag: text-generation",
        "tags:", "- poros", "- lora", "- qlora", "- peft", "---", "",
        f"# LoRA adapter for {base}",
        "",
        f"A {record.get('family', '?')} LoRA adapter trained with [Poros](https://pypi.org/project/poros-train/) "
        f"{record.get('poros_version', '?')} on an NF4 base streamed block by block.",
        "",
        "| | |",
        "|---|---|",
        f"| base model | `{base}` |",
        f"| data | `{config.get('dataset')}` (split `{config.get('dataset_split', 'train')}`), seq_len "
        f"{config.get('seq_len')}, batch {config.get('batch_size')} x grad_accum {config.get('grad_accum')} |",
        f"| adapter | LoRA r{config.get('lora_rank')}, alpha {config.get('lora_alpha')}, dropout "
        f"{config.get('lora_dropout')}, targets {', '.join(targets) if isinstance(targets, list) else targets}"
        f"{', rsLoRA' if config.get('use_rslora') else ''}{', DoRA' if config.get('use_dora') else ''} |",
        f"| base quantization | {config.get('quantization')}, compute {config.get('compute_dtype')} |",
        f"| optimizer | AdamW lr {config.get('lr')}, schedule {config.get('schedule')}, warmup "
        f"{config.get('warmup')}, seed {config.get('seed')} |",
        f"| steps | {record.get('steps_done')} of {config.get('steps')} |",
        f"| training loss | {losses} |",
        f"| eval loss | {f'best {best[0]:.4f} at step {best[1]} of {evaluations} evaluations' if best else 'none'} |",
        f"| guarantee | `{record.get('guarantee')}`: {record.get('guarantee_reason')} |",
        f"| Poros | {record.get('poros_version')} |",
        "",
        "## How it was trained",
        "",
        "```",
        command,
        "```",
        "",
        "## Use it",
        "",
        "```python",
        "from peft import AutoPeftModelForCausalLM",
        "from transformers import AutoTokenizer",
        "",
        'model = AutoPeftModelForCausalLM.from_pretrained("<this directory>")',
        'tokenizer = AutoTokenizer.from_pretrained("<this directory>")',
        "```",
        "",
        "Or merge it into its base for any loader (`poros merge --adapter <this directory> --output merged`), "
        "or write GGUF for llama.cpp / Ollama (`poros merge ... --format gguf`).",
        "",
    ])


def write_model_card(directory: pathlib.Path, record: dict[str, Any], result: Any = None, *,
                     launch_command: list[str] | None = None) -> pathlib.Path:
    """Write ``directory/README.md`` for the adapter saved there (over PEFT's template); ``result`` as for
    :func:`render_model_card`."""
    card = render_model_card(record, result, training_command(launch_command, record.get("config", {})))
    path = pathlib.Path(directory) / MODEL_CARD_FILE
    path.write_text(card, encoding="utf-8")
    return path


__all__ = ["MODEL_CARD_FILE", "base_model_reference", "best_eval", "final_loss", "render_model_card", "summary_line",
           "training_command", "write_model_card"]
