"""A bf16 HF Trainer with gradient accumulation and the one line replays both block phases from graphs.

Under ``bf16=True`` the Trainer enters autocast per forward; ``prepare_trainer`` runs each accumulation
window as one ``forward_backward`` (layer-major), and with the autocast capture on (the default) each
block's forward AND its recompute+backward are captured once per key and replayed for the rest. A
recorder stands in for ``torch.cuda.graph`` on the CPU (``test_gemma4_graphs.ReplayedOnCPU``: a replay
reruns the captured body on the static buffers, the capture's own outputs are poisoned); the run stays the
plain Trainer's bits. On the H200 the same path captured every phase once the step ran off the legacy
stream (docs/prepare.md)."""

from __future__ import annotations

import pytest

import poros
from conformance_flows import assert_same_outcome, load, rows, run_trainer
from poros.stream.graphs import AUTOCAST_SWITCH
from poros.testing import save_tiny_checkpoint
from test_gemma4_graphs import ReplayedOnCPU

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class PhaseCounting(ReplayedOnCPU):
    """The recorder, counting captures and replays per phase (``_capture_forward`` / ``_capture_backward``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.counts: dict[str, int] = {}

    def _capture_forward(self, *args, **kwargs):
        return self._counted("forward", super()._capture_forward(*args, **kwargs))

    def _capture_backward(self, *args, **kwargs):
        return self._counted("backward", super()._capture_backward(*args, **kwargs))

    def _counted(self, phase, graph):
        self.counts[f"{phase} captures"] = self.counts.get(f"{phase} captures", 0) + 1
        replay = graph.replay

        def counted():
            self.counts[f"{phase} replays"] = self.counts.get(f"{phase} replays", 0) + 1
            return replay()

        graph.replay = counted
        return graph


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_bf16_trainer_windows_replay_forward_and_backward_bitwise(family, tmp_path, monkeypatch):
    monkeypatch.delenv(AUTOCAST_SWITCH, raising=False)  # the default: captured under autocast
    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt", family, seed=7)
    flow = dict(train_rows=rows(8, 29), gradient_accumulation_steps=4, max_steps=-1, num_train_epochs=1, bf16=True)
    plain = run_trainer(load(checkpoint), tmp_path / "plain", **flow)
    handles = []

    def line(trainer):
        handle = poros.prepare_trainer(trainer)
        handle.executor.graphs = PhaseCounting(handle.store, handle.executor.layers)
        handles.append(handle)

    streamed = run_trainer(load(checkpoint), tmp_path / "poros", line=line, **flow)
    assert_same_outcome(plain, streamed)
    graphs = handles[0].executor.graphs
    assert graphs.report.failures == [] and "autocast cache" not in graphs.report.eager
    counts = graphs.counts
    assert counts.get("forward captures", 0) >= 1 and counts.get("backward captures", 0) >= 1
    assert counts.get("forward replays", 0) >= 1 and counts.get("backward replays", 0) >= 1
