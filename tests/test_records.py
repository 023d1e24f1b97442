"""The registry data (``registry/<family>.toml``) and the page generated from it. Torch-free."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from poros import records, registry

REPO = Path(__file__).resolve().parents[1]
FAMILY_FILES = sorted(records.data_dir().glob("*.toml"))
ENTRIES = [(path.stem, entry) for path in FAMILY_FILES for entry in tomllib.loads(path.read_text())["checkpoint"]]
INT_FACTS = ("layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
             "head_dim", "vocab_size", "max_position_embeddings")


def entry_id(value):
    return value["hf_id"] if isinstance(value, dict) else str(value)


def test_there_is_one_file_per_builtin_family():
    builtin = {r.descriptor.name for r in registry.architectures() if r.plugin in registry.DEFAULT_PLUGINS}
    assert {path.stem for path in FAMILY_FILES} == builtin


@pytest.mark.parametrize("path", FAMILY_FILES, ids=lambda p: p.stem)
def test_file_parses_and_names_its_family(path):
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    assert data["family"] == path.stem
    assert data["checkpoint"], f"{path.name} lists no checkpoint"
    assert records.checkpoints(path.stem) == data["checkpoint"]
    assert records.validations(path.stem) == data.get("validation", [])


@pytest.mark.parametrize("family,entry", ENTRIES, ids=entry_id)
def test_checkpoint_entry_is_complete(family, entry):
    assert entry["config"] == f"https://huggingface.co/{entry['hf_id']}/blob/main/config.json"
    assert entry["model_type"] in registry.get(family).model_types, (
        f"{entry['hf_id']}: model_type {entry['model_type']!r} is not claimed by family {family!r}"
    )
    assert isinstance(entry["multimodal"], bool)
    assert isinstance(entry.get("tie_word_embeddings", False), bool)
    for key in INT_FACTS:
        if key in entry:
            assert isinstance(entry[key], int) and entry[key] > 0, f"{entry['hf_id']}: {key}={entry[key]!r}"
    assert entry["num_attention_heads"] % entry["num_key_value_heads"] == 0
    for field, overrides in records.OVERRIDE_FIELDS.items():
        assert set(entry.get(overrides, {})) <= set(entry), f"{overrides} overrides a fact the entry lacks"
        assert overrides not in entry or field in entry, f"{overrides} without {field}"


def test_checkpoint_ids_are_unique_across_families():
    seen: dict[str, str] = {}
    for family, entry in ENTRIES:
        for hf_id in records.checkpoint_ids(entry):
            assert hf_id.lower() not in seen, f"{hf_id} listed by {seen.get(hf_id.lower())} and {family}"
            seen[hf_id.lower()] = family


@pytest.mark.parametrize("family,entry", ENTRIES, ids=entry_id)
def test_every_checkpoint_id_finds_its_family(family, entry):
    for hf_id in records.checkpoint_ids(entry):
        assert records.family_of_checkpoint(hf_id.upper()) == family
        assert registry.get(hf_id).name == family


def test_sibling_lookup_applies_its_overrides():
    family, facts = records.find_checkpoint("Qwen/Qwen2.5-7B-Instruct")
    assert family == "qwen2"
    assert facts["hf_id"] == "Qwen/Qwen2.5-7B-Instruct"
    assert facts["max_position_embeddings"] == 32768
    assert records.find_checkpoint("Qwen/Qwen2.5-7B")[1]["max_position_embeddings"] == 131072
    assert records.find_checkpoint("not/a-checkpoint") is None
    assert registry.get("Qwen/Qwen2.5-32B").name == "qwen2"


VALIDATION = """
[[validation]]
platform = "{platform}"
platform_class = "test"
label = "{label}"
"""


def write_family(directory: Path, family: str, labels: list[str]) -> None:
    text = f'family = "{family}"\n' + "".join(VALIDATION.format(platform=f"p{i}", label=label)
                                             for i, label in enumerate(labels))
    (directory / f"{family}.toml").write_text(text, encoding="utf-8")


def test_status_is_the_strongest_label(tmp_path, monkeypatch):
    monkeypatch.setenv(records.REGISTRY_DIR_ENV, str(tmp_path))
    write_family(tmp_path, "empty", [])
    write_family(tmp_path, "weak", ["unverified"])
    write_family(tmp_path, "mixed", ["unverified", "numerical"])
    write_family(tmp_path, "strong", ["numerical", "bitwise", "unverified"])
    assert records.data_dir() == tmp_path
    assert records.status("absent") == "unverified"
    assert records.status("empty") == "unverified"
    assert records.status("weak") == "unverified"
    assert records.status("mixed") == "numerical"
    assert records.status("strong") == "bitwise"
    assert records.validated_platforms("mixed") == ["p0 (unverified)", "p1 (numerical)"]
    assert records.all_families() == ["empty", "mixed", "strong", "weak"]


@pytest.mark.parametrize("path", FAMILY_FILES, ids=lambda p: p.stem)
def test_a_record_appended_to_a_real_file_counts(path, tmp_path, monkeypatch):
    # The tools append [[validation]] tables at the end of these files; that must stay valid TOML.
    monkeypatch.setenv(records.REGISTRY_DIR_ENV, str(tmp_path))
    copy = tmp_path / path.name
    existing = tomllib.loads(path.read_text(encoding="utf-8")).get("validation", [])
    copy.write_text(path.read_text(encoding="utf-8") + VALIDATION.format(platform="Test GPU", label="bitwise"))
    assert records.status(path.stem) == "bitwise"
    assert records.checkpoints(path.stem) == tomllib.loads(path.read_text(encoding="utf-8"))["checkpoint"]
    assert len(records.validations(path.stem)) == len(existing) + 1
    assert "Test GPU (bitwise)" in records.validated_platforms(path.stem)


def load_generator():
    from tools.docs import gen_architecture_docs

    return gen_architecture_docs


def test_architecture_docs_are_up_to_date():
    generator = load_generator()
    page = generator.DOC_PATH.read_text(encoding="utf-8")
    assert generator.update(page) == page, "docs/architecture-support.md is stale: run python -m tools.docs.gen_architecture_docs"


def test_architecture_docs_list_every_checkpoint():
    page = load_generator().DOC_PATH.read_text(encoding="utf-8")
    for _, entry in ENTRIES:
        for hf_id in records.checkpoint_ids(entry):
            assert f"`{hf_id}`" in page
