"""``poros.dropin.train_mode.once_per_window``: the Trainer step's ``model.train()`` walks the module tree once a
window where every ``train`` in the tree only sets modes, and at every call otherwise (the Trainer path is
``tests/test_conformance_trainer.py::test_the_step_sets_training_mode_once_per_window_and_stays_bitwise``)."""

from __future__ import annotations

import torch
from torch import nn

from poros.dropin.train_mode import once_per_window, only_sets_modes


class _Counted(nn.Linear):
    """A module whose ``train`` does more than set modes: it counts its calls."""

    calls = 0

    def train(self, mode: bool = True):
        type(self).calls += 1
        return super().train(mode)


def _walks(model: nn.Module, calls: list[bool]) -> list[bool]:
    leaf = model[0]
    seen: list[bool] = []
    original = nn.Module.train

    def counting(self, mode=True):
        if self is leaf:
            seen.append(bool(mode))
        return original(self, mode)

    nn.Module.train = counting
    try:
        with once_per_window(model):
            for mode in calls:
                assert model.train(mode) is model
                assert all(m.training == mode for m in model.modules())
    finally:
        nn.Module.train = original
    return seen


def test_the_same_mode_walks_once_and_a_new_mode_walks_again():
    model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5), nn.Sequential(nn.Linear(2, 2)))
    model.eval()
    assert only_sets_modes(model)
    assert _walks(model, [True, True, True, False, False, True]) == [True, False, True]
    assert "train" not in vars(model)  # the class's method again after the window
    model.eval()
    assert not model[2][0].training


def test_a_train_override_that_does_more_is_called_every_time():
    model = nn.Sequential(nn.Linear(2, 2), _Counted(2, 2))
    assert not only_sets_modes(model)
    _Counted.calls = 0
    assert _walks(model, [True, True, True]) == [True, True, True]
    assert _Counted.calls == 3


def test_an_instance_train_of_the_caller_is_kept_and_respected():
    model = nn.Sequential(nn.Linear(2, 2))
    calls = []

    def own(mode=True):
        calls.append(mode)
        return nn.Module.train(model, mode)

    object.__setattr__(model, "train", own)
    with once_per_window(model):
        model.train()
        model.train()
    assert calls == [True, True]
    assert vars(model)["train"] is own
    assert torch.is_tensor(model[0].weight)
