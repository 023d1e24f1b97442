"""The streaming settings, each declared once: its name, type, default, help and check.

How a run streams (the slot ring, the VRAM and host budgets, where the embedding tables, the
boundary states, AdamW's state and the LoRA tensors live, the host tier, CUDA graphs, the chunk
counts, the guarantee asked for) is set in two ways in: a :class:`~poros.config.PorosConfig` field
(``poros.yaml``, ``--key value``) and a ``poros.prepare`` keyword
(:class:`~poros.stream.options.StreamOptions`). Both classes are built from :data:`STREAMING`, so a
setting has one row here and nowhere else::

    STREAMING ──config_fields──▶ PorosConfig's streaming fields (type-checked, validated, documented)
              └─keyword_fields─▶ StreamOptions's fields (prepare's keywords, checked, normalised)

A row (:class:`Setting`) says the setting's name, its config type and default, its one-line doc
(``poros.yaml``, ``docs/configuration.md``), its choices, the check both ways in run
(:meth:`Setting.check`: one :class:`~poros.errors.ConfigError` line naming the setting, the value
found, what was expected and the fix), and where ``prepare`` differs: its own type, default, help
(``help(poros.prepare)``) and normalisation. Sizes are parsed to bytes here, once per way in
(:func:`~poros.spellings.parse_budget`); ``StreamOptions`` keeps the bytes beside what was written.

**Adding a streaming setting** (docs/architecture.md): one :class:`Setting` row in :data:`STREAMING`
(``where="both"`` for a config field and a prepare keyword, ``"keyword"`` for prepare only); the
config field, the prepare keyword, the YAML line, the ``--key`` flag and the docs table follow. What
it changes is read from ``StreamOptions`` by the engine and the planner; ``poros.plan`` decides any
``"auto"`` it allows.

The documentation of a settings dataclass (every config field: :func:`documented_fields`,
:func:`fields_table`, what ``docs/configuration.md`` embeds) is read from the same field metadata.

Torch-free: the standard library and PyYAML only.
"""

from __future__ import annotations

import dataclasses
import os
import textwrap
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Callable

from poros.errors import ConfigError
from poros.spellings import choice_list, parse_budget, type_name, yaml_line

#: where the streamed blocks may live on the host, the one list of the tier names: ``host_tier``'s choices,
#: the planner (``poros.plan.host_tiers``) and the engine's tier classes (``poros.stream.tiers``) read it
HOST_TIERS = ("pinned", "mapped", "disk")
#: the guarantee labels ``require`` may ask for, weakest first (docs/parity-modes.md)
REQUIRABLE = ("numerical", "bitwise")
#: where layer-major's boundary states may wait (``boundary_states``; None: the planner decides)
BOUNDARY_STATES = ("device", "host", "disk")
#: the places a plan may put AdamW's state (``optimizer_states``) and the streamed blocks' LoRA tensors
#: (``lora_placement``); each also takes ``"auto"`` (the budget decides)
OPTIMIZER_STATES = ("device", "host")
LORA_PLACEMENTS = ("device", "host")
#: which blocks recompute their forward in backward (``recompute``)
RECOMPUTE = ("auto", "all", "none")
#: whether a streamed block's NF4 weights are dequantized once per layer-major block phase (``dequantize_once``)
DEQUANTIZE_ONCE = ("auto", True, False)
#: whose kernels the model's modules run (``kernels``): ``"default"`` (the model's own) or ``"liger"`` (liger-kernel's)
KERNELS = ("default", "liger")

_SAME = object()  # a keyword facet that is the config's


@dataclass(frozen=True)
class Setting:
    """One streaming setting.

    Attributes:
        name: the config field and the prepare keyword.
        type: the config field's type (what YAML and ``--key value`` are checked against).
        default: the config field's default.
        doc: the one line ``poros.yaml`` and ``docs/configuration.md`` print (with ``choices``).
        help: what ``StreamOptions`` (``help(poros.prepare)``) says of the keyword.
        problem: ``value -> None`` when valid, else ``(expected, fix)``.
        choices: the values the docs list (None spelled null).
        example: a value for error messages (``--key EXAMPLE``); empty: the default.
        where: ``"both"`` (a config field and a prepare keyword) or ``"keyword"`` (prepare only).
        keyword_type, keyword_default: prepare's, where they differ from the config's.
        size: a size (``"7GiB"``, bytes): ``StreamOptions`` keeps its bytes beside it (:meth:`to_bytes`).
        normalise: prepare's value as ``StreamOptions`` keeps it (after :meth:`check`).
    """

    name: str
    type: Any
    default: Any
    doc: str
    help: str
    problem: Callable[[Any], tuple[str, str] | None] = lambda value: None
    choices: tuple[Any, ...] = ()
    example: str = ""
    where: str = "both"
    size: bool = False
    keyword_type: Any = _SAME
    keyword_default: Any = _SAME
    normalise: Callable[[Any], Any] = lambda value: value

    def message(self, value: Any) -> str | None:
        """The one-line problem of ``value`` (``name=value: expected ...; fix``), or None."""
        found = self.problem(value)
        return None if found is None else f"{self.name}={value!r}: expected {found[0]}; {found[1]}"

    def check(self, value: Any) -> None:
        """Raise unless ``value`` is a valid ``name``.

        Raises:
            ConfigError: the setting, the value, what was expected and the fix.
        """
        message = self.message(value)
        if message is not None:
            raise ConfigError(message)

    def to_bytes(self, value: Any) -> int | None:
        """A size setting's bytes, parsed once (None stays None).

        Raises:
            ConfigError: not a size, with this setting's message.
        """
        if value is None:
            return None
        try:
            return parse_budget(value, self.name)
        except ConfigError:
            raise ConfigError(self.message(value)) from None

    @property
    def prepare_type(self) -> Any:
        return self.type if self.keyword_type is _SAME else self.keyword_type

    @property
    def prepare_default(self) -> Any:
        return self.default if self.keyword_default is _SAME else self.keyword_default


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _at_least(low: int, meaning: str, example: str, *, optional: bool = False):
    def problem(value: Any) -> tuple[str, str] | None:
        if (optional and value is None) or (_integer(value) and value >= low):
            return None
        return f"an integer >= {low} ({meaning})", f"e.g. {example}"
    return problem


def _one_of(choices: tuple[Any, ...], meaning: str, fix: str):
    def problem(value: Any) -> tuple[str, str] | None:
        if any(value is choice or (isinstance(value, str) and value == choice) for choice in choices):
            return None
        return f"one of {', '.join('null' if c is None else str(c) for c in choices)} ({meaning})", fix
    return problem


def _size(examples: str, fix: str):
    def problem(value: Any) -> tuple[str, str] | None:
        if value is None:
            return None
        try:
            parse_budget(value)
        except ConfigError:
            return f"a size such as {examples}, an int of bytes, or null", fix
        return None
    return problem


def _resident_blocks(value: Any) -> int | tuple[int, ...] | None:
    """``resident_blocks`` as an int N >= 0, a sorted tuple of distinct indices, or None."""
    if value is None or _integer(value):
        return value
    return tuple(sorted(set(value)))


def _resident_problem(value: Any) -> tuple[str, str] | None:
    if value is None or (_integer(value) and value >= 0):
        return None
    items = list(value) if isinstance(value, Iterable) and not isinstance(value, (str, bytes)) else None
    if items is None or not all(_integer(i) and i >= 0 for i in items):
        return ("a number of blocks >= 0 (the last ones stay on the device) or a list of block indices >= 0",
                "e.g. resident_blocks: 2")
    return None


STREAMING: tuple[Setting, ...] = (
    Setting(
        "num_slots", int, 2,
        "Decoder blocks on the device at once (2: one computes while the next arrives).",
        "device slots in the block ring (2: compute one block while the next arrives; None means 2). With "
        "``vram_budget`` the ring asked for; the planner gives fewer only when the budget cannot hold them.",
        _at_least(1, "2 overlaps copy and compute", "num_slots: 2", optional=True),
        normalise=lambda value: 2 if value is None else value),
    Setting(
        "embeddings_on_host", bool | None, None,
        "Keep frozen untied embedding tables in host memory; null: on when the device is CUDA.",
        "keep frozen embedding tables that are not tied to the head (the input embedding, a per-layer "
        "embedding table) in host memory and look tokens up there; only the looked-up rows cross the link. "
        "None: on when the compute device is CUDA. With several ranks on the node and a model loaded through "
        "the NF4 block cache, the ranks map one copy of each table (a file beside the cache entry) instead of "
        "each holding its own.",
        lambda value: None if value in (None, True, False) else
        ("true, false or null (null: on when the device is CUDA)", "e.g. embeddings_on_host: true"),
        example="true"),
    Setting(
        "require", str | None, None,
        "Refuse to train unless the run earns this guarantee label (see docs/parity-modes.md); null accepts any.",
        "``\"bitwise\"`` or ``\"numerical\"``: ``prepare`` raises :class:`~poros.errors.GuaranteeError` if "
        "the label that applies is weaker.",
        _one_of((None, *REQUIRABLE), "null accepts any guarantee label; docs/parity-modes.md",
                "pick one of null, numerical, bitwise"),
        choices=(None, *REQUIRABLE), example="bitwise"),
    Setting(
        "resident_blocks", int | tuple[int, ...] | None, None, "",
        "blocks kept on the device for good instead of streamed: an int N for the last N blocks (the last "
        "of forward are the first of backward), or block indices.",
        _resident_problem, where="keyword", normalise=_resident_blocks),
    Setting(
        "vram_budget", str | None, None,
        "Device memory the run may use, e.g. '7GiB', '24GB', '7000MiB', '7.5G' (binary): the planner picks "
        "the device slots and keeps as many of the last blocks resident as fit, and with layer-major "
        "accumulation moves the boundary states to pinned host memory when the budget cannot hold them "
        "(`poros plan` shows its plan); null: stream every block.",
        "device memory the run may use (``\"7GiB\"``, ``\"24GB\"``, an int of bytes): the planner "
        "(``poros.plan.budget.plan_budget``) picks the slots and the resident blocks for it and logs its "
        "decision; the plan is kept as ``PorosModel.budget_plan``. ``prepare`` needs ``workload`` with it; "
        "excludes ``resident_blocks``.",
        _size("'7GiB', '24GB', '7000MiB' or '7.5G'", "e.g. vram_budget: 7GiB"),
        example="7GiB", size=True, keyword_type=str | int | None),
    Setting(
        "workload", "Workload | None", None, "",
        "the step the budget is planned for: a :class:`Workload` or a dict of its fields (``batch_size``, "
        "``seq_len``, ``grad_accum``, ``schedule``, ``packed``); its ``loss_chunks`` is the option's (one "
        "value: a workload's own, given without ``loss_chunks``, becomes the option).",
        where="keyword"),
    Setting(
        "boundary_states", str | None, None, "",
        "where layer-major accumulation (``forward_backward``) keeps the M x L block inputs until backward: "
        "``\"device\"``, ``\"host\"`` (pinned host memory, copied on a side stream; bitwise the same) or "
        "``\"disk\"`` (files under the cache's spill/ directory). None: the planner decides under "
        "``vram_budget`` (host only when the budget needs it), else the device.",
        lambda value: None if value is None or value in BOUNDARY_STATES else (
            "'device', 'host' (pinned host memory, for layer-major accumulation when the device cannot hold the "
            "M x L block inputs) or 'disk' (files under the cache's spill/ directory, when the host cannot hold "
            "them either), or null", "null lets the budget planner decide"),
        where="keyword"),
    Setting(
        "boundary_every", int | str, "auto",
        "Keep the state before every k-th block for backward (on the device, the host or disk as the plan puts "
        "the boundary states) and recompute the k - 1 between from it, one more forward through the segment's "
        "blocks (bitwise the same): an integer >= 1, or 'auto' (the planner picks k from vram_budget, "
        "host_budget and the machine's RAM; 1 when everything fits).",
        "k: keep the input of every k-th block for backward (where ``boundary_states`` says) and recompute the "
        "k - 1 between from it, one more forward without grad through the segment's blocks "
        "(``poros.stream.segments``; bitwise the same, both schedules): an int >= 1, or ``\"auto\"``: the "
        "planner's choice under ``vram_budget`` and ``host_budget`` (the smallest k that fits the budget with "
        "the boundary states off the disk), 1 without a budget. None: 1 (the config's default is "
        "``\"auto\"``).",
        lambda value: None if value is None or value == "auto" or (_integer(value) and value >= 1) else (
            "'auto' or an integer >= 1 (1 keeps every block's input; k keeps every k-th and recomputes the others "
            "in backward)", "e.g. boundary_every: 8"),
        example="8", keyword_type=int | str | None, keyword_default=None),
    Setting(
        "optimizer_states", str, "auto",
        "Where AdamW's exp_avg / exp_avg_sq live: 'device', 'host' (pinned host memory, stepped on the device a "
        "chunk at a time by poros.HostAdamW: bitwise torch's AdamW, 8 bytes per LoRA value off the device) or "
        "'auto' (on the host only when vram_budget cannot hold them beside the num_slots slot ring).",
        "with ``vram_budget``, where the plan puts AdamW's state: ``\"device\"``, ``\"host\"`` or ``\"auto\"`` "
        "(host only when the slot ring does not fit with it on the device). ``prepare`` moves no optimizer: "
        "the plan's choice is ``PorosModel.budget_plan.optimizer_states``, which PorosTrainer applies "
        "(``poros.stream.host_optimizer.adamw``) and a loop of your own should too (``poros.HostAdamW`` when "
        "it says ``\"host\"``).",
        _one_of(("auto", *OPTIMIZER_STATES), "auto: the budget decides", "pick one, e.g. optimizer_states: host"),
        choices=("auto", *OPTIMIZER_STATES)),
    Setting(
        "lora_placement", str, "auto",
        "Where the streamed blocks' LoRA parameters and gradients live between uses: 'device', 'host' (pinned "
        "host memory: they come in with their block, the gradients go back after its last backward, "
        "poros.HostAdamW steps them a chunk at a time; bitwise the same; layer-major only, with "
        "optimizer_states auto or host) or 'auto' (on the host only when vram_budget cannot hold them on the "
        "device).",
        "where the streamed blocks' LoRA parameters and gradients live between uses: ``\"device\"`` (default; "
        "None means it) or ``\"host\"`` (pinned; they come in with their block and the gradients go back after "
        "its last backward; layer-major ``forward_backward`` and ``poros.HostAdamW`` with "
        "``placement=model.lora_placement`` only; bitwise the same). With ``vram_budget`` and ``\"auto\"`` the "
        "planner decides (host only when the budget needs it: the plan's ``lora_placement``); ``\"auto\"`` "
        "without a budget is ``\"device\"``.",
        lambda value: _one_of(("auto", *LORA_PLACEMENTS), "auto: the budget decides",
                              "pick one, e.g. lora_placement: device")(value) if value is not None else None,
        choices=("auto", *LORA_PLACEMENTS), keyword_default="device",
        normalise=lambda value: value or "device"),
    Setting(
        "loss_chunks", int, 1,
        "Compute the head and the loss over this many chunks of tokens, each chunk recomputed in backward (the "
        "whole logits never exist; training outputs carry logits=None); 1: HF's own head and loss. Above 1 "
        "bitwise a resident run with the same loss_chunks, numerically HF's (another sum order).",
        "the loss over this many token chunks, each chunk's fp32 working set recomputed in backward "
        "(``poros.stream.chunked_loss``; ``prepare`` installs it, ``unpatch`` removes it); 1: HF's own loss. "
        "With ``vram_budget`` the planner may raise it (and ``mlp_chunks``) when the budget cannot hold the "
        "step otherwise: the plan's ``loss_chunks``.",
        _at_least(1, "1: HF's own loss", "loss_chunks: 8")),
    Setting(
        "mlp_chunks", int, 1,
        "Run each block's MLP, norms and attention projections over this many sequence chunks, each saving only "
        "its input; 1: whole. Above 1 bitwise a resident run with the same mlp_chunks (tiling.tile_mlp); "
        "vram_budget may raise it.",
        "each decoder block's MLP, norms and attention projections over this many sequence chunks in forward, "
        "recompute and backward, each saving only its input (``poros.stream.tiling``; ``prepare`` installs it, "
        "``unpatch`` removes it): one chunk's ``batch x seq x intermediate_size`` activations and one chunk's "
        "fp32 norm and LoRA input copies alive at a time; 1: the MLP over the whole sequence. Bitwise a "
        "resident run with the same tiling (``poros.stream.tiling.tile_mlp``), not the untiled one.",
        _at_least(1, "1: the MLP over the whole sequence", "mlp_chunks: 8")),
    Setting(
        "recompute", str, "auto",
        "Which blocks recompute their forward in backward: 'all' (each block keeps only its input), 'none' (each "
        "keeps its forward's saved tensors until its backward) or 'auto' (the last blocks keep theirs, as many as "
        "vram_budget or, without one on CUDA, the free device memory holds; `poros plan` shows how many). Bitwise "
        "the same whichever.",
        "which blocks recompute their forward in backward: ``\"all\"`` (every block saves only its input and "
        "is recomputed), ``\"none\"`` (every block runs its forward with autograd and keeps its saved tensors "
        "until its backward) or ``\"auto\"`` (the last blocks keep theirs: with ``vram_budget`` the plan's "
        "``kept_activation_blocks``; without one, on CUDA, as many as the free device memory holds at the first "
        "training step, refitted once at the second from the first's measured peak; none on a CPU without a "
        "budget, and none under CUDA graphs at micro-batches under "
        "``poros.stream.recompute_choice.GRAPHS_MIN_TOKENS`` tokens). Recompute is exact, so every choice "
        "trains the same bits (``poros.stream.kept``).",
        _one_of(RECOMPUTE, "auto: keep the activations of as many blocks as memory allows",
                "pick one, e.g. recompute: auto"),
        choices=RECOMPUTE),
    Setting(
        "dequantize_once", bool | str, "auto",
        "Layer-major accumulation: dequantize a streamed block's NF4 weights once for its M forwards and once for "
        "its M recomputes and backwards, holding the dequantized copy for the phase (one block's linear weights "
        "in the compute dtype); true, false or 'auto' (on when vram_budget holds the copy; off without a budget on "
        "CPU, in micro-major and at one micro-batch). Bitwise the same either way, gated on the CPU and on the "
        "H200.",
        "layer-major accumulation: each streamed block's NF4 weights dequantized once per block phase (its M "
        "forwards, its M recomputes and backwards) instead of once per call, the copy held while the phase runs "
        "(``poros.stream.dequantize_once``: bitsandbytes' own dequantization and matmul, so bitwise the same). "
        "``True``, ``False`` or ``\"auto\"``: with ``vram_budget`` the plan's ``dequantize_once`` (on when the "
        "budget holds the copy, layer-major with M > 1); without one, on CUDA, when the free device memory holds "
        "it at the first step; off on a CPU without a budget and, under CUDA graphs, at micro-batches under "
        "``poros.stream.recompute_choice.GRAPHS_MIN_TOKENS`` tokens (a held block runs eagerly).",
        lambda value: None if value is True or value is False or value == "auto" else (
            "true, false or 'auto' (on when the VRAM budget holds one block's dequantized weights)",
            "e.g. dequantize_once: auto"),
        choices=DEQUANTIZE_ONCE, example="true"),
    Setting(
        "kernels", str, "default",
        "Whose kernels the model runs: 'default' (its own modules) or 'liger' (liger-kernel's RMSNorm, RoPE, "
        "SwiGLU/GeGLU and fused linear cross-entropy, applied to the model instance before streaming, as HF's "
        "TrainingArguments(use_liger_kernel=True) applies them; pip install 'poros-train[liger]', CUDA only). "
        "The fused linear cross-entropy replaces loss_chunks; `poros plan` says so.",
        "``\"liger\"``: apply liger-kernel's kernels to the model instance before streaming, the call HF's "
        "``Trainer`` makes for ``TrainingArguments(use_liger_kernel=True)`` (``poros.dropin.kernels``); its "
        "patched modules are the same module objects, so the streamed blocks run them, recompute reruns them and "
        "CUDA graphs capture them. Liger's fused linear cross-entropy replaces ``loss_chunks`` (the logits are "
        "never whole either way). ``\"default\"``: the model as given (a model Liger already patched stays "
        "patched, and ``prepare`` reads what it finds). ``prepare_trainer`` applies Liger itself when the "
        "trainer's ``args.use_liger_kernel`` is set.",
        _one_of(KERNELS, "liger: liger-kernel's fused kernels", "pick one, e.g. kernels: liger"),
        choices=KERNELS, example="liger"),
    Setting(
        "cuda_graphs", bool | str, False,
        "Replay each streamed block's forward and recompute+backward from a CUDA graph captured once per device "
        "slot and block kind: the eager kernels, bit for bit, without their host cost. true, false or 'auto' "
        "(on on CUDA, off where a vram_budget has no room for the graphs' memory); off on CPU. Blocks that cannot "
        "be captured run eagerly, and the summary says why.",
        "``True`` / ``\"auto\"``: on CUDA, replay each block phase from a captured CUDA graph "
        "(``poros.stream.graphs``; bitwise the eager kernels, without their host cost); blocks that cannot be "
        "captured run eagerly and ``PorosModel.executor.graphs.report`` says why. Off on CPU whatever the "
        "setting (``poros.plan.cuda_graphs_on`` decides); under a ``vram_budget``, ``\"auto\"`` is off where the "
        "plan fits only without the graphs' pool and buffers, and the plan says so "
        "(``poros.plan.entry.graphs_decided``). Default ``False``.",
        lambda value: None if value is True or value is False or value == "auto" else (
            "true, false or 'auto' (graphs on when the device is CUDA)", "e.g. cuda_graphs: true"),
        example="true"),
    Setting(
        "pause_gc", bool, True,
        "Pause Python's cyclic garbage collector while a layer-major step runs (PorosTrainer's and "
        "prepare_trainer's accumulation, model.forward_backward) and restore it after: a step whose blocks keep "
        "their activations holds many Python objects, and the collector's passes over them stall the host that "
        "feeds the GPU. Changes no bit; false: Python collects whenever it decides.",
        "``True``: automatic garbage collection is off while ``forward_backward`` runs and restored after "
        "(``poros.stream.gc_pause``; the collector was found scanning the kept graphs' objects many times a step "
        "while the GPU waited); it decides no value, so the bits are the same. ``False``: untouched.",
        lambda value: None if value is True or value is False else ("true or false", "e.g. pause_gc: false"),
        example="false"),
    Setting(
        "host_tier", str | None, None,
        "Where the streamed NF4 blocks live on the host: 'pinned' (page-locked RAM, one copy per process), "
        "'mapped' (the NF4 block cache file mapped and registered for DMA: one copy per node in the page cache), "
        "'disk' (read from the cache file into a small pinned ring ahead of use, for host RAM smaller than the "
        "model); null: mapped when the model loads through the cache, else pinned, or what host_budget needs "
        "(docs/cache-and-host-memory.md).",
        "where the streamed blocks live on the host: ``\"pinned\"``, ``\"mapped\"`` or ``\"disk\"`` "
        "(``docs/cache-and-host-memory.md``). A model loaded through the NF4 block cache is served from its "
        "entry; any other model is first written to a spill file. None: ``\"mapped\"`` for a model loaded "
        "through the cache (no copy at the start; the node's ranks share the entry's pages; where the device "
        "will not register the mapping, pinned copies), else ``\"pinned\"``.",
        _one_of((None, *HOST_TIERS), "null: the host budget decides", "pick one, e.g. host_tier: disk"),
        choices=(None, *HOST_TIERS)),
    Setting(
        "host_budget", str | None, None,
        "Host RAM the blocks may use, e.g. '24GiB': the planner keeps them on the host when they fit and streams "
        "them from disk through a ring of read_ahead blocks when they do not; null: no limit.",
        "host RAM the blocks may use (``\"24GiB\"``, bytes): without ``host_tier``, the planner "
        "(``poros.plan.host_tiers.choose_host_tier``) keeps them on the host as above when they fit and streams "
        "them from disk otherwise; the decision is kept as ``PorosModel.host_plan``.",
        _size("'24GiB', '32GB' or '16G'", "e.g. host_budget: 24GiB"),
        example="24GiB", size=True, keyword_type=str | int | None),
    Setting(
        "read_ahead", int, 3,
        "Ring buffers of the disk tier (>= 2): one copying to the device, the rest read ahead.",
        "ring buffers of the disk tier (>= 2; None: 3, or with ``host_budget`` what fits).",
        _at_least(2, "the disk tier's ring: one buffer copying to the device, one being read", "read_ahead: 3",
                  optional=True),
        keyword_type=int | None, keyword_default=None),
    Setting(
        "cache_dir", str | None, None,
        "Root of the NF4 block cache (the first load quantizes and writes the blocks, later loads map them); "
        "null: $POROS_CACHE_DIR, else ~/.cache/poros.",
        "cache root whose ``spill/`` directory takes spill files (None: as for the cache).",
        normalise=lambda value: None if value is None else os.fspath(value)),
)

SETTINGS: dict[str, Setting] = {setting.name: setting for setting in STREAMING}


def config_fields(cls: type) -> type:
    """Class decorator (under ``@dataclass``): ``cls`` gains every setting of :data:`STREAMING` that is a
    config field, after its own fields, with its type, default and doc (``metadata``)."""
    for setting in STREAMING:
        if setting.where == "both":
            cls.__annotations__[setting.name] = setting.type
            setattr(cls, setting.name, field(default=setting.default, metadata={
                "doc": setting.doc, "choices": setting.choices, "section": ""}))
    return cls


def keyword_fields(cls: type) -> type:
    """Class decorator (under ``@dataclass``): ``cls`` gains every setting of :data:`STREAMING` as a field
    with prepare's type and default, in the table's order, and the settings' help in its docstring."""
    annotations = {setting.name: setting.prepare_type for setting in STREAMING}
    annotations.update(cls.__dict__.get("__annotations__", {}))
    cls.__annotations__ = annotations
    for setting in STREAMING:
        setattr(cls, setting.name, setting.prepare_default)
    lines = [textwrap.fill(f"{setting.name}: {setting.help}", width=110, initial_indent=" " * 8,
                           subsequent_indent=" " * 12, break_on_hyphens=False) for setting in STREAMING]
    cls.__doc__ = (cls.__doc__ or "").replace("{settings}", "\n".join(lines).lstrip())
    return cls


def documented_fields(cls: type, hints: dict[str, Any]) -> list[dict[str, Any]]:
    """One dict per field of the dataclass ``cls`` (its types ``hints``), from the field's metadata:
    ``name``, ``type`` (as the docs write it), ``default``, ``choices``, ``doc`` and ``section`` (the
    last section title above it)."""
    out, section = [], ""
    for f in dataclasses.fields(cls):
        section = f.metadata["section"] or section
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
        out.append({"name": f.name, "type": type_name(hints[f.name]), "default": default,
                    "choices": list(f.metadata["choices"]), "doc": f.metadata["doc"], "section": section})
    return out


def fields_table(docs: list[dict[str, Any]]) -> str:
    """The Markdown tables of ``docs`` (:func:`documented_fields`), one per section: name, type, default
    (as YAML writes it), what it does with its choices."""
    lines, sections = [], {}
    for doc in docs:
        sections.setdefault(doc["section"], []).append(doc)
    for section, rows in sections.items():
        lines += [f"**{section}**", "", "| field | type | default | what it does |", "|---|---|---|---|"]
        for doc in rows:
            default = yaml_line("x", doc["default"]).removeprefix("x: ")
            choices = f" Choices: {choice_list(doc['choices'])}." if doc["choices"] else ""
            text = f"{doc['doc']}{choices}".replace("|", "\\|")
            lines.append(f"| `{doc['name']}` | {doc['type']} | `{default}` | {text} |")
        lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"


def problems(values: Any, where: str = "both") -> list[str]:
    """Every setting's problem in ``values`` (an object with the settings as attributes), one line each."""
    found = [setting.message(getattr(values, setting.name)) for setting in STREAMING
             if where == "keyword" or setting.where == where]
    return [line for line in found if line is not None]


__all__ = ["BOUNDARY_STATES", "DEQUANTIZE_ONCE", "HOST_TIERS", "KERNELS", "LORA_PLACEMENTS", "OPTIMIZER_STATES", "RECOMPUTE", "REQUIRABLE", "SETTINGS",
           "STREAMING", "Setting", "config_fields", "documented_fields", "fields_table", "keyword_fields",
           "problems"]
