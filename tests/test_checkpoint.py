"""poros.training.checkpoint without a model: atomic directories, finding and rotating checkpoints, RNG state,
and the resume check that refuses a checkpoint of a different run."""

from __future__ import annotations

import json
import struct
import zipfile
import random

import numpy as np
import pytest
import torch

from poros.training import checkpoint as checkpoints
from poros.config import PorosConfig
from poros.errors import TrainingCheckpointError


def _fake_checkpoint(directory, step, *, config=None, skip=()):
    """A checkpoint directory with every required file (JSON ones real, the tensor files empty but well-formed)."""
    path = directory / f"checkpoint-{step}"
    path.mkdir(parents=True)
    for name in checkpoints.REQUIRED_FILES:
        if name in skip:
            continue
        if name == checkpoints.TRAINER_STATE_FILE:
            payload = json.dumps({"global_step": step})
        elif name == checkpoints.POROS_CONFIG_FILE:
            payload = json.dumps({"config": (config or PorosConfig()).to_dict()})
        elif name.endswith(".json"):
            payload = "{}"
        elif name.endswith(".safetensors"):  # an empty but well-formed file: read_checkpoint checks the header
            (path / name).write_bytes(struct.pack("<Q", 2) + b"{}")
            continue
        else:  # torch.save files are zips: an empty well-formed one
            zipfile.ZipFile(path / name, "w").close()
            continue
        (path / name).write_text(payload)
    return path


def _entries(directory):
    return sorted(p.name for p in directory.iterdir())


def test_atomic_directory_appears_complete_or_not_at_all(tmp_path):
    target = tmp_path / "out" / "adapter"
    with checkpoints.atomic_directory(target) as temporary:
        assert temporary.parent == target.parent and temporary.name.startswith(".adapter.tmp-")
        (temporary / "a.txt").write_text("new")
        assert not target.exists()  # nothing under the final name while writing
    assert _entries(target) == ["a.txt"] and _entries(target.parent) == ["adapter"]

    # a failure while writing leaves the previous directory exactly as it was, and no temporary
    with pytest.raises(RuntimeError, match="disk full"):
        with checkpoints.atomic_directory(target) as temporary:
            (temporary / "b.txt").write_text("half")
            raise RuntimeError("disk full")
    assert _entries(target) == ["a.txt"] and _entries(target.parent) == ["adapter"]

    # replacing: the old directory's entries are gone, the new ones are in
    with checkpoints.atomic_directory(target) as temporary:
        (temporary / "c.txt").write_text("newer")
    assert _entries(target) == ["c.txt"] and _entries(target.parent) == ["adapter"]


def test_atomic_directory_merge_keeps_other_entries(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    (target / "same.txt").write_text("old")
    (target / "checkpoint-3").mkdir()
    with checkpoints.atomic_directory(target, merge=True, written_last="marker.json") as temporary:
        (temporary / "same.txt").write_text("new")
        (temporary / "marker.json").write_text("{}")
    assert _entries(target) == ["checkpoint-3", "keep.txt", "marker.json", "same.txt"]
    assert (target / "same.txt").read_text() == "new" and (target / "keep.txt").read_text() == "mine"
    assert _entries(tmp_path) == ["out"]


def test_atomic_directory_refuses_a_file(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(TrainingCheckpointError, match="is a file"):
        with checkpoints.atomic_directory(tmp_path / "file"):
            pass


def test_listing_skips_incomplete_and_partial_saves_and_sorts_by_step(tmp_path):
    for step in (2, 10, 9):
        _fake_checkpoint(tmp_path, step)
    _fake_checkpoint(tmp_path, 12, skip=(checkpoints.OPTIMIZER_FILE,))  # e.g. a partial copy
    (tmp_path / ".checkpoint-11.tmp-123-abcdef").mkdir()  # a save killed mid-write
    (tmp_path / "checkpoint-x").mkdir()
    assert [p.name for p in checkpoints.list_checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-9",
                                                                        "checkpoint-10"]
    assert checkpoints.latest_checkpoint(tmp_path) == tmp_path / "checkpoint-10"
    assert checkpoints.latest_checkpoint(tmp_path / "missing") is None

    removed = checkpoints.remove_partial_saves(tmp_path)
    assert [p.name for p in removed] == [".checkpoint-11.tmp-123-abcdef"]
    assert "checkpoint-12" in _entries(tmp_path)  # incomplete checkpoints are reported, never deleted


def test_rotation_keeps_the_newest(tmp_path):
    for step in (1, 2, 3, 4):
        _fake_checkpoint(tmp_path, step)
    assert checkpoints.rotate_checkpoints(tmp_path, None) == []
    deleted = checkpoints.rotate_checkpoints(tmp_path, 2)
    assert [p.name for p in deleted] == ["checkpoint-1", "checkpoint-2"]
    assert _entries(tmp_path) == ["checkpoint-3", "checkpoint-4"]  # nothing half-deleted left behind


def test_rotation_never_deletes_the_checkpoint_just_written(tmp_path):
    """Checkpoints of a later step left by another run in the same output_dir are not this run's."""
    for step in (200, 300):
        _fake_checkpoint(tmp_path, step)
    newest = _fake_checkpoint(tmp_path, 50)
    assert checkpoints.rotate_checkpoints(tmp_path, 2, newest=newest) == []
    _fake_checkpoint(tmp_path, 60)
    _fake_checkpoint(tmp_path, 70)
    deleted = checkpoints.rotate_checkpoints(tmp_path, 2, newest=tmp_path / "checkpoint-70")
    assert [p.name for p in deleted] == ["checkpoint-50"]
    assert _entries(tmp_path) == ["checkpoint-200", "checkpoint-300", "checkpoint-60", "checkpoint-70"]


def test_replacing_a_checkpoint_interrupted_between_the_renames_keeps_the_old_one(tmp_path, monkeypatch):
    target = _fake_checkpoint(tmp_path, 5)
    real_rename, calls = checkpoints.os.rename, []

    def rename(source, destination):
        calls.append(destination)
        if len(calls) == 2:  # the new directory into place: a second Ctrl-C lands here
            raise KeyboardInterrupt
        real_rename(source, destination)

    monkeypatch.setattr(checkpoints.os, "rename", rename)
    with pytest.raises(KeyboardInterrupt):
        with checkpoints.atomic_directory(target) as temporary:
            (temporary / "new").write_text("new")
    monkeypatch.setattr(checkpoints.os, "rename", real_rename)
    assert (target / checkpoints.TRAINER_STATE_FILE).exists() and not (target / "new").exists()
    assert _entries(tmp_path) == ["checkpoint-5"]


def test_read_checkpoint_names_what_is_missing(tmp_path):
    _fake_checkpoint(tmp_path, 4)
    _fake_checkpoint(tmp_path, 6, skip=(checkpoints.RNG_STATE_FILE,))
    assert checkpoints.read_checkpoint(tmp_path / "checkpoint-4").step == 4
    with pytest.raises(TrainingCheckpointError, match="lacks rng_state.pth"):
        checkpoints.read_checkpoint(tmp_path / "checkpoint-6")
    with pytest.raises(TrainingCheckpointError, match="complete ones beside it: checkpoint-4"):
        checkpoints.read_checkpoint(tmp_path / "checkpoint-5")
    (tmp_path / "checkpoint-4" / checkpoints.DATA_STATE_FILE).write_text("{not json")
    with pytest.raises(TrainingCheckpointError, match="cannot parse"):
        checkpoints.read_checkpoint(tmp_path / "checkpoint-4")


def test_resume_check_names_every_field_that_changes_the_math(tmp_path):
    saved = PorosConfig(lora_rank=8, seq_len=64, steps=20)
    checkpoint = checkpoints.read_checkpoint(_fake_checkpoint(tmp_path, 10, config=saved))
    same_math = saved.replace(logging_steps=1, save_steps=5, output_dir="elsewhere", num_slots=3)
    checkpoints.check_resumable(checkpoint, same_math.to_dict())  # no error

    with pytest.raises(TrainingCheckpointError) as error:
        checkpoints.check_resumable(checkpoint, saved.replace(lora_rank=16, batch_size=2, seed=1).to_dict())
    message = str(error.value)
    for expected in ("lora_rank: checkpoint 8, this run 16", "batch_size: checkpoint 1, this run 2",
                     "seed: checkpoint 42, this run 1", "lora_rank=8"):
        assert expected in message
    assert "seq_len" not in message

    # steps sets the length of a cosine schedule, not of a constant one
    with pytest.raises(TrainingCheckpointError, match="steps: checkpoint 20, this run 40"):
        checkpoints.check_resumable(checkpoint, saved.replace(steps=40).to_dict())
    constant = checkpoints.read_checkpoint(_fake_checkpoint(tmp_path, 12, config=saved.replace(schedule="constant")))
    checkpoints.check_resumable(constant, saved.replace(schedule="constant", steps=40).to_dict())
    with pytest.raises(TrainingCheckpointError, match="past this run's steps=11"):
        checkpoints.check_resumable(constant, saved.replace(schedule="constant", steps=11).to_dict())


def test_rng_state_round_trips_through_a_weights_only_file(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    torch.save(checkpoints.capture_rng_state(), tmp_path / "rng.pth")
    expected = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    checkpoints.restore_rng_state(torch.load(tmp_path / "rng.pth", weights_only=True))
    again = (random.random(), np.random.rand(), torch.rand(3))
    assert expected[:2] == again[:2] and torch.equal(expected[2], again[2])
