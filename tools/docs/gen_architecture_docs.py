"""Regenerate the fact blocks of docs/architecture-support.md from the descriptors and registry data.

The page mixes prose (status labels, traps) with facts that must not drift from the code: the
family summary table and, per family, the descriptor details and the known checkpoints. Those
facts live between marker comments::

    <!-- BEGIN GENERATED: summary -->          ... <!-- END GENERATED: summary -->
    <!-- BEGIN GENERATED: family qwen2 -->     ... <!-- END GENERATED: family qwen2 -->

and this script rewrites only what is between them, from ``poros.registry.architectures()``
(built-in families), ``poros.records`` (``registry/<family>.toml``) and, for the MoE table
(``moe measured``), the H200 bench records in ``registry/results/``. Everything else on the
page is hand-written and left alone. Torch-free.

Usage::

    python -m tools.docs.gen_architecture_docs           # rewrite the page in place
    python -m tools.docs.gen_architecture_docs --check   # exit 1 if the page is stale (tests run this)
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

from poros import records, registry
from poros.descriptor import NORM_STYLES, ArchitectureDescriptor
from tools.docs import docgen  # write or --check

REPO = Path(__file__).resolve().parents[2]

DOC_PATH = REPO / "docs" / "architecture-support.md"
BLOCK = re.compile(
    r"(<!-- BEGIN GENERATED: (?P<name>[^>]+?) -->\n)(?P<body>.*?)(<!-- END GENERATED: (?P=name) -->)",
    re.DOTALL,
)
#: Checkpoint fields that get their own column; any other fact goes to "other facts".
COLUMNS = (
    ("params", "params"),
    ("layers", "layers"),
    ("hidden_size", "hidden"),
    ("intermediate_size", "FFN"),
    (("num_attention_heads", "num_key_value_heads"), "heads Q/KV"),
    ("head_dim", "head dim"),
    ("vocab_size", "vocab"),
    ("tie_word_embeddings", "tied head"),
    ("max_position_embeddings", "context"),
    ("multimodal", "VLM"),
    ("model_type", "model_type"),
)
NOT_FACTS = {"hf_id", "instruct_id", "base_id", "config", "instruct_overrides", "base_overrides"}
MISSING = "–"


def builtin_registrations() -> list[registry.Registration]:
    """Built-in families only, so an installed third-party plugin never changes the page."""
    return [r for r in registry.architectures() if r.plugin in registry.DEFAULT_PLUGINS]


# -- cells ---------------------------------------------------------------------------------------
def code_list(values: tuple[str, ...] | list[str]) -> str:
    return ", ".join(f"`{v}`" for v in values) if values else MISSING


def carried_state(descriptor: ArchitectureDescriptor) -> str:
    if not descriptor.carried_state:
        return "none (hidden states only)"
    parts = []
    for state in descriptor.carried_state:
        condition = f", when `{state.enabled_by}`" if state.enabled_by else ""
        parts.append(f"`{state.kwarg}` ({state.kind}{condition})")
    return "; ".join(parts)


def norm_quirks(descriptor: ArchitectureDescriptor) -> str:
    parts = [f"RMSNorm {descriptor.norm_style}: {NORM_STYLES[descriptor.norm_style]}"]
    if descriptor.embedding_scale:
        parts.append(f"embedding scale: {descriptor.embedding_scale}")
    if descriptor.final_logit_softcapping:
        parts.append(f"final logit soft-cap from `config.{descriptor.final_logit_softcapping}`")
    parts.append(f"head tied to the embedding when `config.{descriptor.tied_embeddings}`")
    return "; ".join(parts)


def lora_targets(descriptor: ArchitectureDescriptor) -> str:
    text = f"default: {code_list(descriptor.lora_targets_default)}<br>all-linear: {code_list(descriptor.lora_targets_all_linear)}"
    if descriptor.lora_excluded:
        text += f"<br>excluded: {code_list(descriptor.lora_excluded)}"
    return text


def fact(value: Any) -> str:
    if value is None:
        return MISSING
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def cell(value: str) -> str:
    return value.replace("|", "\\|").replace("\n", " ")


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


# -- blocks --------------------------------------------------------------------------------------
def summary_block() -> str:
    header = ["family", "HF model types", "transformers classes", "layer kinds", "carried cross-block state",
              "norm quirks", "LoRA targets", "never quantized (per layer)", "status"]
    rows = []
    for reg in builtin_registrations():
        d = reg.descriptor
        rows.append([
            f"[`{d.name}`](#{d.name}) {d.display_name}",
            code_list(d.model_types),
            code_list(d.causal_lm_classes),
            code_list(d.layer_kinds),
            carried_state(d),
            norm_quirks(d),
            lora_targets(d),
            code_list(d.never_quantized),
            f"**{records.status(d.name)}**",
        ])
    return table(header, rows)


def checkpoint_table(family: str) -> str:
    header = ["checkpoint", "siblings", *(label for _, label in COLUMNS), "other facts", "source"]
    rows = []
    for entry in records.checkpoints(family):
        siblings = []
        for field, overrides in (("instruct_id", "instruct_overrides"), ("base_id", "base_overrides")):
            if entry.get(field):
                differs = ", ".join(f"{k} {v}" for k, v in entry.get(overrides, {}).items())
                siblings.append(f"`{entry[field]}`" + (f" ({differs})" if differs else ""))
        row = [f"`{entry['hf_id']}`", "<br>".join(siblings) or MISSING]
        for key, _ in COLUMNS:
            if isinstance(key, tuple):
                row.append("/".join(fact(entry.get(k)) for k in key))
            else:
                row.append(fact(entry.get(key)))
        known = {k for key, _ in COLUMNS for k in (key if isinstance(key, tuple) else (key,))}
        other = [f"{k} {fact(v)}" for k, v in entry.items() if k not in known | NOT_FACTS]
        row.append(", ".join(other) or MISSING)
        row.append(f"[config.json]({entry['config']})")
        rows.append(row)
    if not rows:
        return "_No known checkpoints recorded._"
    return table(header, rows)


def family_block(reg: registry.Registration) -> str:
    d = reg.descriptor
    validated = records.validated_platforms(d.name)
    lines = [
        f"- **Status:** **{records.status(d.name)}**"
        + (f" on {', '.join(validated)}" if validated else " (no validation records yet)"),
        f"- **Names accepted by lookup:** {code_list(d.all_names)} and every known checkpoint id below",
        f"- **transformers:** {code_list(d.causal_lm_classes)} with `{d.config_class}`; "
        f"provided by {reg.distribution} (plugin `{reg.plugin}`)",
        f"- **Module paths:** layers `{d.decoder_layers}`, embeddings `{d.embeddings}`, final norm "
        f"`{d.final_norm}`, head `{d.head}`, rotary `{d.rotary}`"
        + (f", prelude {code_list(d.prelude_modules)}" if d.prelude_modules else ""),
        f"- **Rotary:** " + "; ".join(f"{'all layers' if kind == '*' else kind}: {desc}" for kind, desc in d.rotary_kinds),
        f"- **Masks:** " + "; ".join(f"{kind}: `{fn}`" for kind, fn in d.mask_kinds),
        f"- **Layer call:** `{d.layer_call}`",
        f"- **Carried state:** {carried_state(d)}",
    ]
    lines += [f"  - `{s.kwarg}`: {s.description}" for s in d.carried_state]
    lines += [
        f"- **Norms:** {norm_quirks(d)}",
        f"- **LoRA targets:** default {code_list(d.lora_targets_default)}; all-linear "
        f"{code_list(d.lora_targets_all_linear)}"
        + (f"; excluded {code_list(d.lora_excluded)}" if d.lora_excluded else ""),
        f"- **Model-level `nn.Linear` (quantized):** {code_list(d.model_level_linears)}",
        f"- **Never quantized, streamed in the compute dtype:** {code_list(d.never_quantized)}",
    ]
    if d.notes:
        lines.append("- **Descriptor notes:**")
        lines += [f"  - {note}" for note in d.notes]
    lines += [
        "",
        f"Known checkpoints (`registry/{d.name}.toml`; {MISSING} = not stated in the config, or not "
        "confirmed: see the `# unconfirmed:` comments in that file):",
        "",
        checkpoint_table(d.name),
    ]
    return "\n".join(lines)


def moe_records() -> list[tuple[Path, dict]]:
    """The H200 bench records of a Qwen3.5 MoE shape with NF4 experts (``--quantize-experts``), by shape."""
    from tools.docs.gen_results_docs import bench_reports

    found = [(path, report) for path, report in bench_reports()
             if report["config"]["model_info"]["family"] == "qwen3_5_moe" and report["config"].get("quantize_experts")]
    return sorted(found, key=lambda item: item[1]["config"]["model_info"]["full_depth"])


def moe_measured_block() -> str:
    """The MoE table: per record, the resident arm (NF4 experts, uncapped) and the streamed arm under its cap."""
    rows = []
    for path, report in moe_records():
        config, comparison = report["config"], report.get("comparison")
        shape = config["model_info"]["hf_id"].split("/")[-1]
        depth = config["model_info"]
        if depth["num_hidden_layers"] != depth["full_depth"]:
            shape += f" ({depth['num_hidden_layers']} of {depth['full_depth']} layers)"
        link = f"[JSON](../{path.relative_to(REPO).as_posix()})"
        for arm, cap, parity in (("resident", "none", "reference"),
                                 ("poros", f"{config['vram_limit_gb']:g} GB" if config.get("vram_limit_gb") else "none",
                                  docgen.parity_label(comparison))):
            measured = report["arms"][arm]
            lora = f"r{config['lora']['rank']}" + (" + experts" if config["lora"].get("on_experts") else "")
            graphs = " (CUDA graphs)" if arm == "poros" and config.get("cuda_graphs") else ""
            if measured.get("status", "ok") != "ok":  # a failed arm is a row too: what stopped it
                reason = (measured.get("error") or "failed").split(":")[0].strip()
                rows.append([shape, cap, arm + graphs, f"NF4 (`{config['experts_implementation']}`)", lora,
                             f"{config.get('grad_accum', 1)}", "-", f"failed: {reason}", "-", "-", link])
                continue
            rows.append([shape, cap, arm + graphs, f"NF4 (`{config['experts_implementation']}`)", lora,
                         f"{config.get('grad_accum', 1)}", f"{measured['peak_allocated_gb']:.2f} GB",
                         f"{measured['median_step_s']:.3f} s{docgen.shared_mark(config)}", f"{measured['tokens_per_s']:,.0f}", parity, link])
    return table(["shape", "cap", "arm", "experts", "LoRA", "micro-batches", "peak allocated", "step time",
                  "tokens/s", "parity", "record"], rows)


#: tools/moe_quant_error.py's JSON: NF4 experts against bf16 experts, per MoE family
QUANT_ERROR = REPO / "registry" / "results" / "cpu-2026-12-03" / "moe-quant-error.json"


def quant_error_block() -> str:
    """The table of NF4 against bf16 experts, one row per family, from :data:`QUANT_ERROR`."""
    import json

    rows = json.loads(QUANT_ERROR.read_text())["rows"]
    lines = ["| family | shape (random weights) | logit KL (NF4 from bf16) | top-1 agreement | "
             "loss after N steps, bf16 experts | NF4 experts |", "|---|---|---|---|---|---|"]
    for r in rows:
        shape = r["shape"]
        lines.append(f"| `{r['family']}` | {shape['num_layers']} layers, hidden {shape['hidden_size']}, "
                     f"{shape['num_experts']} experts of {shape['moe_intermediate_size']} | {r['logit_kl']:.2e} | "
                     f"{r['top1_agreement']:.1%} | {r['loss_bf16_experts']:.4f} (N={r['steps']}) | "
                     f"{r['loss_nf4_experts']:.4f} |")
    return "\n".join(lines) + f"\n\nFrom `{QUANT_ERROR.relative_to(REPO)}` (`python -m tools.moe_quant_error`, CPU)."


def render_blocks() -> dict[str, str]:
    blocks = {"summary": summary_block(), "moe quant error": quant_error_block()}
    for reg in builtin_registrations():
        blocks[f"family {reg.descriptor.name}"] = family_block(reg)
    blocks["moe measured"] = moe_measured_block()
    return blocks


def update(text: str) -> str:
    """``text`` with every generated block rewritten.

    Raises:
        SystemExit: a block this script renders has no markers on the page (add them where the
            block belongs), or the page has markers for a block it does not render.
    """
    blocks = render_blocks()
    found = [m.group("name") for m in BLOCK.finditer(text)]
    missing = [name for name in blocks if name not in found]
    unknown = [name for name in found if name not in blocks]
    if missing or unknown:
        raise SystemExit(
            f"{DOC_PATH.name}: blocks without markers {missing}, markers without a block {unknown}. "
            "Add '<!-- BEGIN GENERATED: <name> -->' / '<!-- END GENERATED: <name> -->' pairs for the "
            "missing ones (e.g. a new family's section) and remove the unknown ones."
        )
    return BLOCK.sub(lambda m: f"{m.group(1)}{blocks[m.group('name')]}\n{m.group(4)}", text)


def main(argv: list[str] | None = None) -> int:
    return docgen.main(__doc__, DOC_PATH, update, argv)


if __name__ == "__main__":
    sys.exit(main())
