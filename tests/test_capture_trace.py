"""``tools/capture_trace.py``: the tracer the H200 probe wraps around the engine's captures restores every
patched method and keeps a failed capture's whole exception chain and traceback (CPU: no capture opens)."""

from __future__ import annotations

import pytest
import torch

from poros.stream.graphs import BlockGraphs
from tools.capture_trace import WRAPPED, tracing


def test_tracing_keeps_a_failed_capture_and_restores_what_it_patched():
    before = {(o, m): getattr(getattr(torch.cuda, o), m) for o, m in WRAPPED}
    record, enter = BlockGraphs._record, torch.cuda.graph.__enter__
    with tracing() as log:
        assert BlockGraphs._record is not record
        with pytest.raises(AttributeError):
            BlockGraphs._record(object(), 3, lambda block: [])  # no pool: fails before any capture opens
    assert BlockGraphs._record is record and torch.cuda.graph.__enter__ is enter
    assert all(getattr(getattr(torch.cuda, o), m) is f for (o, m), f in before.items())
    (failure,) = log.to_dict()["failures"]
    assert failure["block"] == 3 and failure["chain"][0].startswith("AttributeError")
    assert "_record" in failure["traceback"] and log.calls == [] and log.captures == 0
