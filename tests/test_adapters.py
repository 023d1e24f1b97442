"""The adapter matrix: which PEFT adapter types train under ``poros.prepare`` exactly as resident.

Each case builds the resident reference the way ``tests/test_parity.py`` does (NF4 base, double
quantization, bf16 compute, "all-linear" targets from the family descriptor) but with one PEFT
adapter type, trains it two AdamW steps, then trains the same checkpoint after ``poros.prepare``
and classifies the outcome:

* ``supported-bitwise``: ``torch.equal`` on every loss, trainable tensor and AdamW state tensor;
* ``supported-numerical``: both train, the results differ (the largest differences are recorded);
* ``refused``: the resident PEFT model itself cannot be built or trained on a 4-bit base
  (``where: peft``), or it fails or silently changes the loss under Poros (``where: poros``).

``poros.prepare`` gates adapter types (``poros.dropin.model.SUPPORTED_ADAPTERS``, LoRA only, raising
``UnsupportedAdapterError``; non-LoRA parameters inside a block raise ``TrainableInBlockError``).
Each case records whether that gate refuses it (``gate``) and, to measure what the streaming engine
itself does, classifies the run with the gate lifted for that one adapter type
(:func:`adapter_gates_lifted`): the matrix says which types the allow-list could admit.

Every test asserts the status it expects, so a change either way fails. Run with
``POROS_WRITE_ADAPTER_MATRIX=1`` to (re)write ``docs/adapters.json`` from the outcomes, then
``python -m tools.docs.gen_adapter_docs`` to render ``docs/adapters.md``; ordinary runs write nothing.

Adapter parameters are perturbed after PEFT's init (every trainable float tensor gets
``N(0, 0.02^2)`` noise from a seeded generator), so identity-initialised adapters (LoRA's zero
``B``, IA3's ones, OFT's zero skew...) change the output and every parameter gets a gradient at
step 0.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import pathlib
import platform
import subprocess
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import bitsandbytes
import peft
import pytest
import torch
import transformers

import poros
from poros.testing import TINY_VARIANTS, all_linear_targets, load_qlora, save_tiny_checkpoint
from test_parity import assert_bitwise, make_batch, train, trainable

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROOT = pathlib.Path(__file__).resolve().parents[1]
MATRIX_JSON = ROOT / "docs" / "adapters.json"
WRITE_MATRIX = os.environ.get("POROS_WRITE_ADAPTER_MATRIX") == "1"
SEED = 3
STEPS = 2
#: the default tiny variant of every family (LoRA variants run on all of them)
FAMILIES = [(family, variants[0]) for family, variants in TINY_VARIANTS.items()]
#: where every other adapter type is tried
ADAPTER_FAMILIES = [("qwen3", "default"), ("gemma4", "e2b")]
#: a supported-numerical outcome may drift, but not further than this (absolute, on any loss); a larger
#: difference at step 0 means the streamed model computes another loss: refused (poros)
NUMERICAL_LOSS_BOUND = 1e-2

BITWISE, NUMERICAL, REFUSED = "supported-bitwise", "supported-numerical", "refused"


@dataclass(frozen=True)
class Adapter:
    """One row of the matrix: a PEFT config class, its arguments, and the status expected per family.

    ``options`` are the config's keyword arguments (recorded in the JSON); ``target_modules`` is
    added as the family's "all-linear" leaf names unless ``options`` names its own. ``expected``
    maps family -> status, or ``(status, where)`` for refusals.
    """

    name: str
    config_class: str
    options: dict[str, Any]
    expected: dict[str, Any]
    autocast_adapter_dtype: bool = True
    gated: bool = True
    #: parameter-name fragments besides PEFT's prefix that the lifted frozen-base gate must accept
    extra_markers: tuple[str, ...] = ()
    note: str = ""
    families: tuple[tuple[str, str], ...] = tuple(ADAPTER_FAMILIES)


@dataclass
class Outcome:
    status: str
    where: str | None = None
    error: str | None = None
    code_location: list[str] = field(default_factory=list)
    max_abs_diff_loss: float | None = None
    max_abs_diff_trainable: float | None = None
    differing_trainable: str | None = None
    gate: str | None = None


def _both(status, where=None):
    value = status if where is None else (status, where)
    return {family: value for family, _ in ADAPTER_FAMILIES}


REFUSED_BY_PEFT = (REFUSED, "peft")
ADALORA_RANKNUM = ("PEFT leaves AdaLoRA's `ranknum` scalar trainable (`requires_grad=True`, and AdamW updates it on both "
                   "sides); measured with `ranknum` accepted as an adapter parameter, else the frozen-base gate "
                   "raises `TrainableInBlockError`. ")
PACKED_WEIGHT = "Computes with `base_layer.weight` directly: on a 4-bit base that is the packed uint8 NF4 tensor."
UINT8_GRAD = "Builds trainable tensors from `base_layer.weight`, the packed uint8 NF4 tensor, at init."
REFUSED_BY_POROS = (REFUSED, "poros")

ADAPTERS = [
    Adapter("AdaLoRA", "AdaLoraConfig", {"init_r": 4, "target_r": 2, "total_step": 10}, _both(BITWISE),
            extra_markers=("ranknum",),
            note=ADALORA_RANKNUM + "The orthogonal regularisation that `AdaLoraModel.forward` adds to the loss "
                 "(`orth_reg_weight` 0.5) is included on both sides: `PorosModel` calls the PEFT model's own "
                 "forward. `update_and_allocate` (rank pruning) was not exercised."),
    Adapter("BEFT", "BeftConfig", {}, _both(BITWISE)),
    Adapter("BOFT", "BOFTConfig", {"boft_block_size": 8}, _both(BITWISE)),
    Adapter("C3A", "C3AConfig", {"block_size": 8}, _both(BITWISE)),
    Adapter("DeLoRA", "DeloraConfig", {"r": 4}, _both(*REFUSED_BY_PEFT),
            note="DeLoRA takes the norm of `base_layer.weight` at init: the packed uint8 NF4 tensor."),
    Adapter("DeFT", "DeftConfig", {}, _both(*REFUSED_BY_PEFT), note=PACKED_WEIGHT),
    Adapter("FourierFT", "FourierFTConfig", {"n_frequency": 16}, _both(BITWISE)),
    Adapter("FRoD", "FrodConfig", {}, _both(*REFUSED_BY_PEFT), note=UINT8_GRAD),
    Adapter("GLoRA", "GloraConfig", {}, _both(*REFUSED_BY_PEFT),
            note="PEFT refuses it by name: GLoRA supports only a plain `torch.nn.Linear`."),
    Adapter("GraLoRA", "GraloraConfig", {"r": 8}, _both(BITWISE)),
    Adapter("HiRA", "HiraConfig", {"r": 4}, _both(BITWISE)),
    Adapter("HRA", "HRAConfig", {"r": 4}, _both(*REFUSED_BY_PEFT),
            note="HRA multiplies by `base_layer.weight`, the packed NF4 tensor (no bitsandbytes layer in PEFT)."),
    Adapter("IA3", "IA3Config", {"feedforward_modules": ["down_proj"]}, _both(*REFUSED_BY_PEFT),
            note="The resident model fails on this CPU: PEFT's 4-bit IA3 layer feeds an fp32 activation to the "
                 "bf16 NF4 matmul."),
    Adapter("LN-tuning", "LNTuningConfig", {"target_modules": ["input_layernorm", "post_attention_layernorm"]},
            _both(BITWISE),
            note="Trains copies of the norms; the trainable copies stay on the device, outside the block store."),
    Adapter("Lily", "LilyConfig", {}, _both(BITWISE)),
    Adapter("LoHa", "LoHaConfig", {"r": 4, "alpha": 8}, _both(*REFUSED_BY_PEFT),
            note="LyCORIS layers build their delta against `base_layer.weight`'s shape: the packed NF4 tensor."),
    Adapter("LoKr", "LoKrConfig", {"r": 4, "alpha": 8}, _both(*REFUSED_BY_PEFT),
            note="LyCORIS layers build their delta against `base_layer.weight`'s shape: the packed NF4 tensor."),
    Adapter("MiSS", "MissConfig", {"r": 4}, _both(BITWISE)),
    Adapter("OFT", "OFTConfig", {"r": 0, "oft_block_size": 8}, _both(BITWISE)),
    Adapter("OSF", "OSFConfig", {"effective_rank": 4}, _both(*REFUSED_BY_PEFT), note=UINT8_GRAD),
    Adapter("Peanut", "PeanutConfig", {}, _both(*REFUSED_BY_PEFT), note=PACKED_WEIGHT),
    Adapter("PSOFT", "PsoftConfig", {}, _both(*REFUSED_BY_PEFT),
            note="PEFT refuses it at init: PSOFT needs a float base weight."),
    Adapter("PVeRA", "PveraConfig", {"r": 8}, _both(BITWISE), autocast_adapter_dtype=False,
            note="Like VeRA: the frozen random projections are one buffer shared by every layer; the block store "
                 "keeps tensors that several blocks share resident instead of streaming them. "
                 "Built with `autocast_adapter_dtype=False` (with fp32 adapters the resident model fails on CPU)."),
    Adapter("RandLoRA", "RandLoraConfig", {"r": 8}, _both(*REFUSED_BY_PEFT), autocast_adapter_dtype=False,
            note="The resident model fails on this CPU: an fp32 activation meets the bf16 NF4 matmul."),
    Adapter("RoAd", "RoadConfig", {"group_size": 4}, _both(BITWISE), autocast_adapter_dtype=False,
            note="Built with `autocast_adapter_dtype=False`: with fp32 adapters the resident model fails on CPU."),
    Adapter("Shadow", "ShadowConfig", {}, _both(*REFUSED_BY_PEFT)),
    Adapter("SHiRA", "ShiraConfig", {"r": 4}, _both(BITWISE)),
    Adapter("SuperTuning", "SupertuningConfig", {}, _both(*REFUSED_BY_PEFT), note=PACKED_WEIGHT),
    Adapter("TinyLoRA", "TinyLoraConfig", {}, _both(*REFUSED_BY_PEFT), note=UINT8_GRAD),
    Adapter("UniLoRA", "UniLoraConfig", {}, _both(BITWISE)),
    Adapter("VBLoRA", "VBLoRAConfig", {"r": 4, "num_vectors": 16, "vector_length": 8}, _both(NUMERICAL),
            note="The vector bank is one trainable tensor shared by every layer. Resident autograd sums its "
                 "gradient contributions from all layers in one buffer; Poros runs one backward per block, so "
                 "the same contributions are summed per block and then accumulated into `.grad`: a different "
                 "grouping of the same floating-point additions."),
    Adapter("VeRA", "VeraConfig", {"r": 8}, _both(BITWISE),
            note="`vera_A`/`vera_B` are one frozen buffer shared by every layer; the block store keeps tensors "
                 "that several blocks share resident instead of streaming them (before that it packed the buffer "
                 "per block, and another block's release left the layer a size-0 placeholder)."),
    Adapter("WaveFT", "WaveFTConfig", {"n_frequency": 16}, _both(BITWISE)),
]
LORA_VARIANTS = {"LoRA": {}, "rsLoRA": {"use_rslora": True}, "DoRA": {"use_dora": True}}
LORA_OPTIONS = {"lora_rank": 4, "lora_alpha": 8, "double_quant": True, "seed": SEED}

_outcomes: dict[tuple[str, str], dict[str, Any]] = {}




@pytest.fixture(scope="module", autouse=True)
def matrix_writer():
    """With ``POROS_WRITE_ADAPTER_MATRIX=1``, merge this run's outcomes into ``docs/adapters.json``."""
    yield
    if WRITE_MATRIX and _outcomes:
        write_matrix(_outcomes)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    directory = tmp_path_factory.mktemp("adapters")
    cache: dict[tuple[str, str], pathlib.Path] = {}

    def get(family: str, variant: str) -> pathlib.Path:
        if (family, variant) not in cache:
            cache[family, variant] = save_tiny_checkpoint(directory / f"{family}-{variant}", family, variant,
                                                          seed=SEED)
        return cache[family, variant]

    return get


def load_with_adapter(path: pathlib.Path, adapter: Adapter):
    """Load ``path`` as :func:`poros.testing.load_qlora` does, wrapped by ``adapter``'s PEFT config."""
    quantization_config = transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16,
        bnb_4bit_use_double_quant=True,
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=quantization_config, device_map={"": "cpu"}, dtype=torch.bfloat16,
    )
    options = {"target_modules": all_linear_targets(model), **adapter.options}
    config = getattr(peft, adapter.config_class)(task_type="CAUSAL_LM", **options)
    torch.manual_seed(SEED)
    peft_model = peft.get_peft_model(model, config, autocast_adapter_dtype=adapter.autocast_adapter_dtype)
    generator = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for _, parameter in sorted(peft_model.named_parameters()):
            if parameter.requires_grad and parameter.is_floating_point():
                noise = torch.randn(parameter.shape, generator=generator) * 0.02
                parameter.add_(noise.to(parameter.dtype))
    peft_model.train()
    return peft_model


def _code_location(error: BaseException) -> list[str]:
    """The innermost frames of ``error`` that lie in PEFT, Poros or bitsandbytes, as ``file:line in function``."""
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if any(part in f.filename for part in ("/peft/", "/poros/", "/bitsandbytes/"))]
    return [f"{_short(f.filename)}:{f.lineno} in {f.name}: {(f.line or '').strip()}" for f in frames[-2:]]


def _short(filename: str) -> str:
    for anchor in ("/peft/", "/poros/", "/bitsandbytes/"):
        if anchor in filename:
            return anchor.strip("/") + "/" + filename.split(anchor, 1)[1]
    return filename


def _error_text(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"


@contextlib.contextmanager
def adapter_gates_lifted(peft_model, extra_markers: tuple[str, ...] = ()):
    """Let ``poros.prepare`` accept ``peft_model``'s adapter type, to measure the engine; restored on exit.

    Adds the PEFT type to ``poros.dropin.model.SUPPORTED_ADAPTERS`` and PEFT's own parameter prefix of the
    type (``BaseTuner.prefix``: ``"oft_"``, ``"hada_"``...) to the adapter-parameter markers of the
    frozen-base gate, plus ``extra_markers``. Nothing else is relaxed.
    """
    import poros.dropin.model as prepare_module

    config = next(iter(peft_model.peft_config.values()))
    peft_type = str(config.peft_type).rsplit(".", 1)[-1].upper()
    prefix = getattr(peft_model.base_model, "prefix", None)
    additions = {"SUPPORTED_ADAPTERS": (peft_type,), "_ADAPTER_MARKERS": (*([prefix] if prefix else []), *extra_markers)}
    saved = {name: getattr(prepare_module, name) for name in additions if hasattr(prepare_module, name)}
    for name, value in saved.items():
        setattr(prepare_module, name, (*value, *additions[name]))
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(prepare_module, name, value)


def classify(load: Callable[[], Any], batches, extra_markers: tuple[str, ...] = ()) -> Outcome:
    """Train resident and streamed from ``load()`` and classify the result (see the module docstring)."""
    try:
        reference = load()
        ref_losses, ref_opt = train(reference, list(trainable(reference).values()), batches)
    except Exception as error:  # noqa: BLE001 - every failure of the resident model is a refusal by PEFT
        return Outcome(REFUSED, "peft", _error_text(error), _code_location(error))
    model = load()
    try:
        streamed = poros.prepare(model)
        gate = "allowed"
    except poros.errors.UnsupportedModelError as refusal:  # a gate: raised before any weight moved
        gate = f"refused: {_error_text(refusal)}"
        streamed = None
    try:
        if streamed is None:
            with adapter_gates_lifted(model, extra_markers):
                streamed = poros.prepare(model)
        losses, opt = train(streamed, streamed.trainable_parameters(), batches)
    except Exception as error:  # noqa: BLE001
        return Outcome(REFUSED, "poros", _error_text(error), _code_location(error), gate=gate)
    try:
        assert_bitwise(reference, model, ref_losses, losses, ref_opt, opt)
    except AssertionError as difference:
        loss_diff = max((a.float() - b.float()).abs().item() for a, b in zip(ref_losses, losses))
        first_step = (ref_losses[0].float() - losses[0].float()).abs().item()
        if first_step > NUMERICAL_LOSS_BOUND:  # not rounding: the streamed model computes another loss
            return Outcome(REFUSED, "poros", f"trains a different loss: step 0 loss {ref_losses[0].item():.6f} "
                           f"(resident) != {losses[0].item():.6f} (streamed)", max_abs_diff_loss=loss_diff,
                           gate=gate)
        ref_params, params = trainable(reference), trainable(model)
        diffs = {n: (ref_params[n].float() - params[n].float()).abs().max().item() for n in ref_params}
        return Outcome(NUMERICAL, error=str(difference).splitlines()[0][:300], max_abs_diff_loss=loss_diff,
                       max_abs_diff_trainable=max(diffs.values()),
                       differing_trainable=f"{sum(d > 0 for d in diffs.values())}/{len(diffs)}", gate=gate)
    return Outcome(BITWISE, max_abs_diff_loss=0.0, max_abs_diff_trainable=0.0, gate=gate)


def record(adapter: str, family: str, variant: str, outcome: Outcome, config: dict, note: str = "") -> None:
    _outcomes[adapter, family] = {"adapter": adapter, "family": family, "variant": variant, "config": config,
                                  "note": note, **{k: v for k, v in vars(outcome).items() if v not in (None, [])}}


def check_expected(outcome: Outcome, expected, gated: bool) -> None:
    status, where = expected if isinstance(expected, tuple) else (expected, None)
    assert (outcome.status, outcome.where) == (status, where), f"expected {status} ({where}), got {outcome}"
    if where != "peft":  # PEFT's refusals never reach poros.prepare
        assert outcome.gate is not None and outcome.gate.startswith("refused" if gated else "allowed"), outcome.gate
        if gated:
            assert "UnsupportedAdapterError" in outcome.gate and "docs/adapters.md" in outcome.gate, outcome.gate
    if status == NUMERICAL:
        assert 0 <= outcome.max_abs_diff_loss <= NUMERICAL_LOSS_BOUND, outcome


def _batches():
    return [make_batch(SEED + step, 2, 16, "left") for step in range(STEPS)]


@pytest.mark.parametrize("variant_name", list(LORA_VARIANTS))
@pytest.mark.parametrize(("family", "variant"), FAMILIES, ids=[f for f, _ in FAMILIES])
def test_lora_variants_stream_bitwise(variant_name, family, variant, checkpoints):
    path = checkpoints(family, variant)
    options = {**LORA_OPTIONS, **LORA_VARIANTS[variant_name]}
    outcome = classify(lambda: load_qlora(path, **options), _batches())
    config = {"class": "LoraConfig", "r": 4, "lora_alpha": 8, **LORA_VARIANTS[variant_name]}
    record(variant_name, family, variant, outcome, config)
    check_expected(outcome, BITWISE, gated=False)


CASES = [(adapter, family, variant) for adapter in ADAPTERS for family, variant in adapter.families]


@pytest.mark.parametrize(("adapter", "family", "variant"), CASES, ids=[f"{a.name}-{f}" for a, f, _ in CASES])
def test_adapter_type(adapter, family, variant, checkpoints):
    path = checkpoints(family, variant)
    outcome = classify(lambda: load_with_adapter(path, adapter), _batches(), adapter.extra_markers)
    config = {"class": adapter.config_class, **adapter.options}
    if not adapter.autocast_adapter_dtype:
        config["autocast_adapter_dtype"] = False
    record(adapter.name, family, variant, outcome, config, adapter.note)
    check_expected(outcome, adapter.expected[family], adapter.gated)


def test_adapter_shared_across_blocks_differs_only_by_grouping(checkpoints):
    """VBLoRA's drift is the gradient grouping of its shared bank, not a wrong gradient: after one
    backward the bank's gradient is close to the resident one, every per-layer tensor's is equal."""
    adapter = next(a for a in ADAPTERS if a.name == "VBLoRA")
    path = checkpoints("qwen3", "default")
    batch = _batches()[0]
    reference = load_with_adapter(path, adapter)
    reference(**batch, use_cache=False).loss.backward()
    model = load_with_adapter(path, adapter)
    with adapter_gates_lifted(model):
        streamed = poros.prepare(model)
    streamed(**batch).loss.backward()
    ref_params, params = trainable(reference), trainable(model)
    shared = [n for n in ref_params if "vector_bank" in n]
    assert shared
    for name in ref_params:
        if name in shared:
            torch.testing.assert_close(params[name].grad, ref_params[name].grad)
        else:
            assert torch.equal(params[name].grad, ref_params[name].grad), name


def write_matrix(outcomes: dict[tuple[str, str], dict[str, Any]]) -> None:
    """Merge ``outcomes`` into ``docs/adapters.json`` (rows keyed by adapter and family), sorted."""
    existing = json.loads(MATRIX_JSON.read_text()) if MATRIX_JSON.exists() else {"results": []}
    rows = {(r["adapter"], r["family"]): r for r in existing["results"]}
    rows.update(outcomes)
    order = [*LORA_VARIANTS, *(a.name for a in ADAPTERS)]
    families = list(TINY_VARIANTS)
    ordered = sorted(rows.values(), key=lambda r: (order.index(r["adapter"]) if r["adapter"] in order else len(order),
                                                   r["adapter"], families.index(r["family"])))
    document = {"environment": environment(), "results": ordered}
    MATRIX_JSON.write_text(json.dumps(document, indent=2) + "\n")


def environment() -> dict[str, str]:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True, check=True).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--", "poros"], cwd=ROOT, capture_output=True,
                                 text=True, check=True).stdout.strip()
        commit += "+uncommitted changes under poros/" if changed else ""
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return {
        "platform": f"CPU {platform.machine()} ({platform.system()})",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "bitsandbytes": bitsandbytes.__version__,
        "date": datetime.date.today().isoformat(),
        "commit": commit,
        "steps": str(STEPS),
    }


def test_adapter_docs_match_the_committed_json():
    result = subprocess.run([sys.executable, "-m", "tools.docs.gen_adapter_docs", "--check"], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
