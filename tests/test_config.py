"""PorosConfig: YAML round trips, strict keys and types, command-line overrides, validation, docs."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from poros.config import FIELD_SECTIONS, PorosConfig, field_docs, fields_markdown
from poros.errors import ConfigError, PorosError

ROOT = Path(__file__).resolve().parents[1]
FIELD_NAMES = [f.name for f in dataclasses.fields(PorosConfig)]

#: A config where every field differs from its default (and every type is exercised).
CHANGED = dict(
    model="Qwen/Qwen2.5-7B", revision="main", quantization="fp4", double_quant=True, compute_dtype="float16",
    quantize_experts=False, output_router_logits=True, lora_on_experts=False,
    lora_rank=8, lora_alpha=16, lora_dropout=0.05, target_modules=["q_proj", "v_proj"], use_rslora=True,
    use_dora=True, dataset="data/chat.jsonl", dataset_split="validation", chat_template="{{ messages }}",
    eval_dataset="data/val.jsonl", eval_dataset_split="test", eval_steps=20, eval_batches=8,
    report_to=["tensorboard", "wandb"],
    seq_len=1024, packing=True, batch_size=2, grad_accum=4, steps=50, lr=1e-4, schedule="linear", warmup=5, weight_decay=0.01,
    max_grad_norm=None, seed=7, logging_steps=1, save_steps=25, save_total_limit=2, output_dir="runs/a",
    resume_from="auto", overwrite=True, device="cuda:1", num_slots=3, deterministic=False, require="bitwise",
    attn_implementation="eager", embeddings_on_host=False, vram_budget="7GiB", stream_schedule="micro-major",
    optimizer_states="host", lora_placement="device", loss_chunks=4, mlp_chunks=4, recompute="none", dequantize_once=True, kernels="liger", cuda_graphs="auto", pause_gc=False,
    pad_to_multiple_of=64,
    host_tier="disk", host_budget="24GiB", read_ahead=4, cache_dir="/data/poros-cache", no_cache=True,
    boundary_every=8,
    epochs=2.5, cpu_threads=3,
)


#: eval_split and eval_dataset exclude each other: the split is changed in a second config.
CHANGED_SPLIT = {**CHANGED, "eval_dataset": None, "eval_split": 0.1}


def test_the_changed_config_changes_every_field():
    # Guards the round-trip tests: a field left at its default would not be tested by them.
    assert sorted({**CHANGED, **CHANGED_SPLIT}) == sorted(FIELD_NAMES)
    defaults = PorosConfig().to_dict()
    assert [name for name in FIELD_NAMES
            if all(values.get(name, defaults[name]) == defaults[name] for values in (CHANGED, CHANGED_SPLIT))] == []


# -- YAML -------------------------------------------------------------------------------------

@pytest.mark.parametrize("commented", [True, False], ids=["commented", "plain"])
@pytest.mark.parametrize("values", [{}, CHANGED, CHANGED_SPLIT], ids=["defaults", "every-field-changed", "eval-split"])
def test_yaml_round_trip(tmp_path, values, commented):
    config = PorosConfig(**values)
    path = tmp_path / "poros.yaml"
    text = config.to_yaml(path, commented=commented)
    assert path.read_text() == text
    assert PorosConfig.from_yaml(path) == config
    assert yaml.safe_load(text) == config.to_dict()  # plain YAML, readable by any YAML parser


def test_commented_yaml_documents_every_field_and_says_how_to_run_it(tmp_path):
    text = PorosConfig().to_yaml(tmp_path / "run.yaml")
    lines = text.splitlines()
    header = "\n".join(lines[:6])
    assert "PorosConfig" in header and f"poros train {tmp_path / 'run.yaml'}" in header and "--dry-run" in header
    for doc in field_docs():
        index = next(i for i, line in enumerate(lines) if line.startswith(f"{doc['name']}:"))
        comment = []
        for line in reversed(lines[:index]):  # the comment block right above the key
            if not line.startswith("#") or line.startswith("# -- "):
                break
            comment.insert(0, line.lstrip("# "))
        assert " ".join(comment).startswith(doc["doc"][:40]), doc["name"]
        for choice in doc["choices"]:
            assert ("null" if choice is None else str(choice)) in " ".join(comment), (doc["name"], choice)
    for section in FIELD_SECTIONS:
        assert f"# -- {section} " in text


@given(
    model=st.text(min_size=1).filter(lambda s: s.strip()),
    chat_template=st.none() | st.text(min_size=1).filter(lambda s: s.strip()),
    revision=st.none() | st.text(),
    target_modules=st.sampled_from(["all-linear", "default"])
    | st.lists(st.text(alphabet="abcdefghijklmnopqrstuvwxyz_.0123456789", min_size=1), min_size=1, max_size=4),
    lr=st.floats(min_value=1e-12, max_value=10, allow_nan=False),
    max_grad_norm=st.none() | st.floats(min_value=1e-6, max_value=1e6),
    steps=st.integers(min_value=1, max_value=10**9),
)
@settings(max_examples=60, deadline=None)
def test_yaml_round_trip_of_any_valid_value(tmp_path_factory, **values):
    # Strings that look like other YAML types ('null', '2e-4', 'yes', '1.5') must come back as strings.
    config = PorosConfig(**values)
    path = tmp_path_factory.mktemp("yaml") / "poros.yaml"
    config.to_yaml(path)
    assert PorosConfig.from_yaml(path) == config


def test_yaml_reads_floats_in_exponent_notation(tmp_path):
    path = tmp_path / "poros.yaml"
    path.write_text("lr: 2e-4\nweight_decay: 1E-2\nsteps: 3\n")
    config = PorosConfig.from_yaml(path)
    assert config.lr == 2e-4 and config.weight_decay == 0.01 and config.steps == 3


def test_empty_yaml_is_the_defaults(tmp_path):
    path = tmp_path / "poros.yaml"
    path.write_text("# nothing set\n")
    assert PorosConfig.from_yaml(path) == PorosConfig()


@pytest.mark.parametrize(("text", "fragments"), [
    ("stpes: 3\n", ["unknown key 'stpes'", "did you mean 'steps'"]),
    ("seq-len: 64\n", ["unknown key 'seq-len'", "did you mean 'seq_len'"]),
    ("zzzz: 1\n", ["unknown key 'zzzz'", "docs/configuration.md"]),
    ("- steps\n", ["holds a list", "expected a mapping"]),
    ("steps: [1\n", ["not valid YAML", "line 1"]),
])
def test_bad_yaml_fails_naming_the_problem_and_the_file(tmp_path, text, fragments):
    path = tmp_path / "poros.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as error:
        PorosConfig.from_yaml(path)
    for fragment in [str(path), *fragments]:
        assert fragment in str(error.value)


def test_missing_yaml_says_how_to_create_one(tmp_path):
    with pytest.raises(ConfigError, match=r"does not exist.*poros init"):
        PorosConfig.from_yaml(tmp_path / "nope.yaml")


# -- types ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("values", "fragment"), [
    ({"steps": "abc"}, "steps='abc' has type str, expected int"),
    ({"seq_len": 1.5}, "seq_len=1.5 has type float, expected int"),
    ({"steps": True}, "steps=True has type bool, expected int"),
    ({"lr": "fast"}, "lr='fast' has type str, expected float"),
    ({"deterministic": "yes"}, "deterministic='yes' has type str, expected bool"),
    ({"deterministic": None}, "deterministic=None has type NoneType, expected bool"),
    ({"model": 7}, "model=7 has type int, expected str"),
    ({"target_modules": ["q_proj", 3]}, "expected str or list of str"),
    ({"max_grad_norm": "none"}, "expected float or null"),
])
def test_wrong_types_fail_by_field(values, fragment):
    with pytest.raises(ConfigError) as error:
        PorosConfig.from_dict(values)
    assert fragment in str(error.value)


def test_float_fields_accept_ints_and_optional_fields_accept_null():
    config = PorosConfig.from_dict({"lr": 1, "weight_decay": 0, "max_grad_norm": None, "save_total_limit": None,
                                    "embeddings_on_host": None})
    assert config.lr == 1.0 and isinstance(config.lr, float) and isinstance(config.weight_decay, float)
    assert config.max_grad_norm is None and config.save_total_limit is None


def test_target_modules_string_of_names_becomes_a_list():
    assert PorosConfig(target_modules="q_proj, v_proj").target_modules == ["q_proj", "v_proj"]
    assert PorosConfig(target_modules=("o_proj",)).target_modules == ["o_proj"]
    assert PorosConfig(target_modules="default").target_modules == "default"


def test_replace_and_from_dict_reject_unknown_keys_by_name():
    with pytest.raises(ConfigError, match=r"unknown key 'lora_rnak'.*did you mean 'lora_rank'"):
        PorosConfig().replace(lora_rnak=8)
    with pytest.raises(ConfigError, match=r"unknown key 'learning_rat'"):  # learning_rate is HF's lr (see below)
        PorosConfig.from_dict({"learning_rat": 1e-4})
    assert PorosConfig().replace(steps=5).steps == 5


def test_config_errors_are_poros_errors():
    assert issubclass(ConfigError, PorosError)


# -- validation -------------------------------------------------------------------------------

@pytest.mark.parametrize(("values", "fragment"), [
    ({"lora_rank": 0}, "lora_rank=0: expected an integer >= 1"),
    ({"seq_len": -5}, "seq_len=-5: expected an integer >= 1"),
    ({"steps": 0}, "steps=0: expected an integer >= 1"),
    ({"num_slots": 0}, "num_slots=0: expected an integer >= 1"),
    ({"quantization": "int8"}, "quantization='int8': expected one of nf4, fp4"),
    ({"compute_dtype": "bf16"}, "compute_dtype='bf16': expected one of bfloat16, float16, float32"),
    ({"schedule": "cosine_with_restarts"}, "expected one of constant, constant_with_warmup, linear, cosine"),
    ({"require": "exact"}, "require='exact': expected one of null, numerical, bitwise"),
    ({"attn_implementation": "flash"}, "expected one of null, sdpa, eager"),
    ({"device": "gpu"}, "device='gpu': expected 'auto', 'cpu', 'cuda' or 'cuda:N'"),
    ({"lr": 0.0}, "lr=0.0: expected a float > 0"),
    ({"lora_dropout": 1.0}, "lora_dropout=1.0: expected a float in [0, 1)"),
    ({"warmup": 100}, "warmup=100: expected fewer warm-up steps than steps=100"),
    ({"warmup": -1}, "warmup=-1: expected an integer >= 0"),
    ({"max_grad_norm": 0.0}, "max_grad_norm=0.0: expected a float > 0 or null"),
    ({"save_steps": -1}, "save_steps=-1: expected an integer >= 0"),
    ({"save_total_limit": 0}, "save_total_limit=0: expected an integer >= 1 or null"),
    ({"target_modules": "everything"}, None),  # a single name: becomes ["everything"], valid here
    ({"target_modules": []}, "target_modules=[]: expected a non-empty list"),
    ({"model": "  "}, "model='  ': expected a non-empty string"),
    ({"resume_from": ""}, "resume_from='': expected 'auto', a checkpoint directory or null"),
])
def test_validate_names_field_value_expectation_and_fix(values, fragment):
    if fragment is None:
        PorosConfig(**values)
        return
    with pytest.raises(ConfigError) as error:
        PorosConfig(**values)
    message = str(error.value)
    assert fragment in message
    assert re.search(re.escape(fragment) + r"[^;\n]*; \S", message), "no fix after the expectation"


def test_validate_lists_every_problem_at_once():
    with pytest.raises(ConfigError) as error:
        PorosConfig(lora_rank=0, lr=-1.0, device="tpu")
    message = str(error.value)
    assert message.count("\n  - ") == 3
    assert "lora_rank=0" in message and "lr=-1.0" in message and "device='tpu'" in message


def test_validate_catches_fields_changed_after_construction():
    config = PorosConfig()
    config.steps = 0
    with pytest.raises(ConfigError, match="steps=0"):
        config.validate()


# -- overrides --------------------------------------------------------------------------------

@pytest.mark.parametrize(("arguments", "expected"), [
    (["--steps", "5"], {"steps": 5}),
    (["--seq-len", "64", "--seq_len", "128"], {"seq_len": 128}),  # dashes and underscores; the last wins
    (["--seq-len=64"], {"seq_len": 64}),
    (["--lr", "1e-4", "--weight-decay", "0"], {"lr": 1e-4, "weight_decay": 0.0}),
    (["--seed", "-1"], None),  # a negative value is a value, not an option (then fails validation)
    (["--deterministic", "false"], {"deterministic": False}),
    (["--deterministic", "0", "--use-dora", "YES"], {"deterministic": False, "use_dora": True}),
    (["--use-dora"], {"use_dora": True}),
    (["--use-dora", "--steps", "3"], {"use_dora": True, "steps": 3}),
    (["--no-deterministic"], {"deterministic": False}),
    (["--max-grad-norm", "null", "--save-total-limit", "None"], {"max_grad_norm": None, "save_total_limit": None}),
    (["--embeddings-on-host", "null"], {"embeddings_on_host": None}),
    (["--embeddings-on-host"], {"embeddings_on_host": True}),
    (["--no-embeddings-on-host"], {"embeddings_on_host": False}),
    (["--target-modules", "q_proj,v_proj"], {"target_modules": ["q_proj", "v_proj"]}),
    (["--target-modules", "o_proj"], {"target_modules": ["o_proj"]}),
    (["--target-modules", "default"], {"target_modules": "default"}),
    (["--require", "bitwise", "--resume-from", "auto"], {"require": "bitwise", "resume_from": "auto"}),
    (["--model", "./my model/", "--chat-template", "{{ messages }}"],
     {"model": "./my model/", "chat_template": "{{ messages }}"}),
    ([], {}),
])
def test_overrides_parse_by_field_type(arguments, expected):
    if expected is None:
        with pytest.raises(ConfigError, match="seed=-1"):
            PorosConfig().apply_overrides(arguments)
        return
    config = PorosConfig().apply_overrides(arguments)
    assert config == PorosConfig(**expected)


@pytest.mark.parametrize(("arguments", "fragments"), [
    (["--stesp", "5"], ["unknown override --stesp", "did you mean 'steps'"]),
    (["--lora-rnak", "8"], ["unknown override --lora-rnak", "did you mean 'lora_rank'"]),
    (["--steps", "five"], ["--steps 'five': expected int", "e.g. --steps 100"]),
    (["--seq-len", "1.5"], ["--seq-len '1.5': expected int"]),
    (["--lr", "fast"], ["--lr 'fast': expected float"]),
    (["--deterministic", "maybe"], ["unexpected argument 'maybe'"]),
    (["--steps"], ["--steps needs a value (int)"]),
    (["--steps", "--lr", "1"], ["--steps needs a value"]),
    (["poros.yaml"], ["unexpected argument 'poros.yaml'", "config file first"]),
    (["--no-use-dora=1"], ["--no-use-dora takes no value"]),
    (["--no-steps"], ["unknown override --no-steps"]),
    (["--steps", "0"], ["command-line overrides", "steps=0: expected an integer >= 1"]),
])
def test_bad_overrides_fail_by_name(arguments, fragments):
    with pytest.raises(ConfigError) as error:
        PorosConfig().apply_overrides(arguments)
    for fragment in fragments:
        assert fragment in str(error.value)


def test_overrides_apply_on_top_of_a_yaml_and_return_a_new_config(tmp_path):
    path = tmp_path / "poros.yaml"
    PorosConfig(steps=10, warmup=5).to_yaml(path)
    base = PorosConfig.from_yaml(path)
    changed = base.apply_overrides(["--steps", "20", "--warmup", "10"])
    assert (changed.steps, changed.warmup) == (20, 10) and (base.steps, base.warmup) == (10, 5)


# -- docs -------------------------------------------------------------------------------------

def test_every_field_has_a_doc_line_and_a_section():
    docs = field_docs()
    assert [d["name"] for d in docs] == FIELD_NAMES
    assert all(d["doc"].strip() and d["section"] for d in docs)
    assert [name for names in FIELD_SECTIONS.values() for name in names] == FIELD_NAMES


def test_configuration_docs_hold_the_generated_field_table():
    page = (ROOT / "docs" / "configuration.md").read_text()
    match = re.search(r"<!-- BEGIN GENERATED: fields -->\n(.*?)<!-- END GENERATED: fields -->", page, re.S)
    assert match, "docs/configuration.md lost its fields markers"
    assert match.group(1) == fields_markdown(), (
        "docs/configuration.md is stale: paste poros.config.fields_markdown() between the fields markers")
    for name in FIELD_NAMES:
        assert f"| `{name}` |" in match.group(1)


# -- other trainers' names, epochs, CPU threads -----------------------------------------------------

#: HF TrainingArguments / TRL SFTConfig / axolotl keys and the PorosConfig field each one sets.
OTHER_NAMES = [("learning_rate", 3e-4, "lr"), ("max_steps", 7, "steps"), ("num_train_epochs", 2.0, "epochs"),
               ("per_device_train_batch_size", 4, "batch_size"), ("gradient_accumulation_steps", 8, "grad_accum"),
               ("max_seq_length", 256, "seq_len"), ("lora_r", 8, "lora_rank"), ("output_dir", "runs/x", "output_dir"),
               ("micro_batch_size", 2, "batch_size"), ("num_epochs", 3.0, "epochs"), ("sequence_len", 128, "seq_len")]


@pytest.mark.parametrize(("alias", "value", "name"), OTHER_NAMES, ids=[alias for alias, _, _ in OTHER_NAMES])
def test_other_trainers_names_set_the_poros_field_everywhere(tmp_path, alias, value, name):
    expected = PorosConfig(**{name: value})
    assert getattr(expected, name) == value
    path = tmp_path / "poros.yaml"
    path.write_text(yaml.safe_dump({alias: value}))
    assert PorosConfig.from_yaml(path) == expected
    assert PorosConfig().apply_overrides([f"--{alias.replace('_', '-')}", str(value)]) == expected
    assert PorosConfig().apply_overrides([f"--{alias}={value}"]) == expected
    assert PorosConfig(**{alias: value}) == expected
    assert PorosConfig().replace(**{alias: value}) == expected
    assert alias not in PorosConfig(**{alias: value}).to_dict() or alias == name  # the config keeps Poros's names


@pytest.mark.parametrize(("typo", "suggested"), [
    ("--learning-rat", "did you mean 'learning_rate' (PorosConfig's 'lr')?"),
    ("--max-step", "did you mean 'max_steps' (PorosConfig's 'steps')?"),
    ("--num-train-epoch", "did you mean 'num_train_epochs' (PorosConfig's 'epochs')?"),
    ("--per-device-batch-size", "did you mean 'per_device_train_batch_size' (PorosConfig's 'batch_size')?"),
])
def test_a_misspelt_other_name_suggests_it_and_its_field(typo, suggested):
    with pytest.raises(ConfigError) as error:
        PorosConfig().apply_overrides([typo, "1"])
    assert suggested in str(error.value)


def test_one_field_under_two_names_is_refused(tmp_path):
    path = tmp_path / "poros.yaml"
    path.write_text("lr: 1.0e-4\nlearning_rate: 2.0e-4\n")
    with pytest.raises(ConfigError, match="'lr' and 'learning_rate' both set PorosConfig's 'lr'"):
        PorosConfig.from_yaml(path)
    with pytest.raises(ConfigError, match="'steps' and 'max_steps' both set"):
        PorosConfig().replace(steps=3, max_steps=4)


@pytest.mark.parametrize(("config", "batches_per_epoch", "steps"), [
    (PorosConfig(epochs=2), 400, 800),                       # steps 0: as many as 2 passes take
    (PorosConfig(epochs=2, grad_accum=4), 400, 200),         # 4 batches per optimizer step
    (PorosConfig(epochs=0.5, grad_accum=3), 10, 2),          # ceil(0.5 x (10 // 3))
    (PorosConfig(epochs=1, grad_accum=8), 3, 1),             # fewer batches than one step: one step per epoch
    (PorosConfig(epochs=3, steps=10), 400, 10),              # a set steps overrides epochs (HF's max_steps)
    (PorosConfig(), 400, 100),                               # no epochs: steps
])
def test_epochs_count_the_steps_of_that_many_passes(config, batches_per_epoch, steps):
    assert config.steps_for_epochs(batches_per_epoch)[0] == steps


def test_epochs_without_steps_and_the_later_source_wins(tmp_path):
    assert PorosConfig(epochs=2).steps == 0 and PorosConfig(num_train_epochs=2, max_steps=5).steps == 5
    assert "overrides epochs=3" in PorosConfig(epochs=3, steps=10).steps_for_epochs(400)[1]
    path = tmp_path / "poros.yaml"
    path.write_text("epochs: 3\n")
    by_epochs = PorosConfig.from_yaml(path)
    assert (by_epochs.steps, by_epochs.epochs) == (0, 3.0)
    assert by_epochs.apply_overrides(["--max-steps", "10"]).steps_for_epochs(400)[0] == 10  # steps given later
    path.write_text("steps: 50\n")
    assert PorosConfig.from_yaml(path).apply_overrides(["--num-train-epochs", "2"]).steps_for_epochs(400)[0] == 800
    by_epochs.to_yaml(path)
    assert PorosConfig.from_yaml(path) == by_epochs  # steps: 0 and epochs: 3 read back the same
    with pytest.raises(ConfigError, match=r"steps=0: expected an integer >= 1 \(0 only with epochs\)"):
        PorosConfig(steps=0)
    with pytest.raises(ConfigError, match="epochs=-1.0: expected a number > 0"):
        PorosConfig(epochs=-1)


@pytest.mark.parametrize(("setting", "device", "hidden", "omp", "threads"), [
    ("auto", "cpu", 128, None, 1),       # a tiny model on the CPU: one thread
    ("auto", "cpu", 4096, None, None),   # a wide one: torch's default
    ("auto", "cpu", 128, "4", None),     # OMP_NUM_THREADS set: the user chose
    ("auto", "cuda", 128, None, None),   # the CPU is not where it computes
    (3, "cpu", 128, None, 3),            # an integer is taken as it is
])
def test_cpu_threads_follow_the_models_width(monkeypatch, setting, device, hidden, omp, threads):
    import torch

    from poros.devices import cpu_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    if omp is not None:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    assert cpu_threads(setting, torch.device(device), hidden) == threads
    assert PorosConfig().apply_overrides(["--cpu-threads", str(setting)]).cpu_threads == setting
    with pytest.raises(ConfigError, match="cpu_threads=0: expected 'auto' or an integer >= 1"):
        PorosConfig(cpu_threads=0)
