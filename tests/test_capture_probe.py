"""tools/capture_probe.py (the H200's ``capture-probe`` step) as a CPU dry run: every case's code path
(the pieces, autocast on the recompute / the backward, the three places, the variants) runs eagerly with
the capture skipped, each case printing one line and landing in the JSON."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")


def test_the_dry_run_walks_every_case_with_its_captures_skipped(tmp_path, capsys):
    from tools import capture_probe

    out = tmp_path / "capture-probe.json"
    assert capture_probe.main(["--device", "cpu", "--pieces", "linear,peft-nf4", "--width", "64", "--rank", "4",
                               "--dry-variants", "--threads", str(torch.get_num_threads()),
                               "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["config"]["dry_run"] is True and "matmul" in report["config"]
    base = [r for r in report["cases"] if "variant_of" not in r]
    assert len(base) == 2 * len(capture_probe.AUTOCAST) * len(capture_probe.WHERE)
    assert all(r["status"] == "ok" and r["captured"] is False for r in report["cases"]), \
        [r.get("error") for r in report["cases"] if r["status"] != "ok"]
    assert len(report["cases"]) == len(base) * (1 + len(capture_probe.MODES) - 1 + 4)
    inside = [r for r in base if r["where"] == "function"]
    assert inside and all(r["grad_enabled_there"] is False for r in inside)  # an autograd backward's own state
    assert {r["thread"] for r in base if r["where"] == "thread"} == {"probe-thread"}
    assert report["summary"]["failed"] == 0 and report["summary"]["failed_by_piece"] == {"linear": "0/9",
                                                                                         "peft-nf4": "0/9"}
    printed = capsys.readouterr().out
    assert printed.count("\n") >= len(report["cases"]) and "peft-nf4/autocast=recompute/where=function" in printed


def test_a_failing_case_reports_its_first_error_line_and_goes_on(capsys):
    from tools import capture_probe

    piece = capture_probe.build_piece("linear", torch.device("cpu"), 64, 4, 0)
    settings = {"mode": "thread_local", "warmup": False, "deterministic": False, "sync_debug": None,
                "autocast": "off", "where": "nowhere"}
    record = capture_probe.run_case("linear/nowhere", piece, torch.device("cpu"), settings, dry=True)
    assert record["status"] == "failed" and record["error"].startswith("KeyError: \"unknown place 'nowhere'")
    assert record["phase"] == "setup"
    assert "linear/nowhere" in capsys.readouterr().out


def test_the_error_chain_reaches_the_call_the_capture_refused():
    from tools import capture_probe

    try:
        try:
            raise RuntimeError("operation not permitted when stream is capturing\nmore")
        except RuntimeError:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
    except RuntimeError as exc:
        chain = capture_probe.error_chain(exc)
    assert chain == ["RuntimeError: CUDA error: operation failed due to a previous error during capture",
                     "RuntimeError: operation not permitted when stream is capturing"]


def test_an_error_in_the_eager_run_is_told_apart_from_a_capture_error():
    from tools import capture_probe

    def call(x):
        raise RuntimeError("no kernel for this")
    piece = capture_probe.Piece("bad", call, [], (1, 4), "raises")
    settings = {"mode": "thread_local", "warmup": True, "deterministic": False, "sync_debug": None,
                "autocast": "recompute", "where": "function"}
    record = capture_probe.run_case("bad", piece, torch.device("cpu"), settings, dry=True)
    assert (record["status"], record["phase"], record["root_error"]) == ("failed", "reference",
                                                                         "RuntimeError: no kernel for this")
