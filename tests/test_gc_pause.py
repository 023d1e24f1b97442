"""``pause_gc``: Python's cyclic garbage collector makes no pass while a layer-major step runs, and is as it was
after the step, also when the step fails; with ``pause_gc=False`` it runs as Python decides. The bits are the same
either way (the collector decides no value); the step's losses are checked against each other."""

from __future__ import annotations

import gc

import pytest
import torch

import poros
from poros.errors import ConfigError
from poros.testing import load_qlora, save_tiny_checkpoint
from test_layer_major import with_item_counts
from test_parity import make_batch

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture()
def eager_collector():
    """Collections every few allocations (so a step would surely see some), counted; the collector restored."""
    thresholds, enabled = gc.get_threshold(), gc.isenabled()
    passes: list[int] = []

    def count(phase, info):
        if phase == "start":
            passes.append(info["generation"])

    gc.set_threshold(50, 5, 5)
    gc.enable()
    gc.callbacks.append(count)
    try:
        yield passes
    finally:
        gc.callbacks.remove(count)
        gc.set_threshold(*thresholds)
        (gc.enable if enabled else gc.disable)()


def _step(tmp_path, **options):
    path = tmp_path / "ckpt"
    if not path.exists():
        save_tiny_checkpoint(path, "qwen3", seed=5, num_layers=3)
    streamed = poros.prepare(load_qlora(path, seed=5), recompute="none", **options)
    micro_batches = with_item_counts([make_batch(s, 2, 12, "none") for s in range(3)])
    return streamed, micro_batches


def test_no_collection_runs_while_the_blocks_of_a_layer_major_step_run(tmp_path, eager_collector):
    """Every decoder-layer call of the step (M forwards, M recomputes or kept backwards per block) sees the same
    number of passes so far: none ran between the first and the last. The pass the step's leftovers are due
    comes after it, when the collector is back on."""
    streamed, micro_batches = _step(tmp_path)
    assert streamed.stream_options.pause_gc is True  # the default
    seen: list[int] = []
    for layer in streamed.executor.layers:
        layer.register_forward_pre_hook(lambda *_: seen.append(len(eager_collector)))
    paused = streamed.forward_backward(micro_batches)
    assert len(seen) == 3 * 3 and len(set(seen)) == 1 and gc.isenabled()
    control, _ = _step(tmp_path, pause_gc=False)  # the negative control: the same step, the collector left alone
    for layer in control.executor.layers:
        layer.register_forward_pre_hook(lambda *_: seen.append(len(eager_collector)))
    seen.clear()
    collected = control.forward_backward(micro_batches)
    assert len(set(seen)) > 1, "no pass ran during the control step: the test would prove nothing"
    assert all(torch.equal(a, b) for a, b in zip(paused, collected))


def test_a_collector_the_user_turned_off_stays_off(tmp_path, eager_collector):
    streamed, micro_batches = _step(tmp_path)
    gc.disable()
    streamed.forward_backward(micro_batches)
    assert not gc.isenabled()


def test_the_collector_comes_back_when_the_step_fails(tmp_path, eager_collector, monkeypatch):
    from poros.stream import executor

    streamed, micro_batches = _step(tmp_path)

    def failing(self, *args, **kwargs):
        assert not gc.isenabled()  # paused while the step runs
        raise RuntimeError("out of memory (simulated)")

    monkeypatch.setattr(executor.StreamingExecutor, "_backward_block", failing)
    with pytest.raises(RuntimeError, match="simulated"):
        streamed.forward_backward(micro_batches)
    assert gc.isenabled()


def test_pause_gc_is_checked_and_carried_by_the_config():
    with pytest.raises(ConfigError, match="pause_gc"):
        poros.PorosConfig(pause_gc="sometimes")
    from poros.stream.options import StreamOptions

    assert StreamOptions.from_config(poros.PorosConfig(pause_gc=False)).pause_gc is False
