"""The bench harness and the parity gate run on CPU and report exact parity (no timing asserted).

Each tool runs once as a subprocess, its smoke command as documented (``python -m tools.bench --model
tiny --device cpu``, ``python -m tools.checks.parity_gate --device cpu --tiny``), both at the same time; the
JSON each writes is checked. The gate also appends its records to a copy of the registry, which
must still parse and give the families the ``bitwise`` status through ``poros.records``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")
pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[1]

ENVIRONMENT_KEYS = {"platform", "platform_class", "torch", "transformers", "peft", "bitsandbytes", "date", "commit"}
RECORD_KEYS = ENVIRONMENT_KEYS | {"label", "adapter", "max_diff_loss", "max_diff_adapter", "max_diff_optimizer",
                                  "source"}
GATE_VARIANTS = {"qwen2", "qwen3", "qwen3_5", "gemma3", "gemma4", "gemma4-moe"}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory, child_env):
    """Both smoke commands, started together; ``{name: (json path, registry copy)}`` once both exit 0."""
    folder = tmp_path_factory.mktemp("tools")
    registry = folder / "registry"
    shutil.copytree(REPO / "registry", registry)
    commands = {
        "bench": ["-m", "tools.bench", "--model", "tiny", "--device", "cpu", "--steps", "2", "--warmup", "1",
                  "--json", str(folder / "bench.json")],
        "gate": ["-m", "tools.checks.parity_gate", "--device", "cpu", "--tiny", "--json", str(folder / "gate.json"),
                 "--append-registry", "--registry-dir", str(registry)],
        "curve": ["-m", "tools.bench.vram_curve", "--model", "tiny-qwen2", "--device", "cpu", "--points", "3", "--steps", "1",
                  "--warmup", "1", "--grad-accum", "2", "--deterministic", "--json", str(folder / "curve.json")],
    }
    running = {name: subprocess.Popen([sys.executable, *args], cwd=REPO, env=child_env(POROS_COMMIT="test"),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
               for name, args in commands.items()}
    failures = []
    for name, process in running.items():
        output, _ = process.communicate(timeout=300)
        if process.returncode != 0:
            failures.append(f"{' '.join(commands[name])} exited {process.returncode}:\n{output}")
    assert not failures, "\n\n".join(failures)
    return {"bench": folder / "bench.json", "gate": folder / "gate.json", "curve": folder / "curve.json",
            "registry": registry}


def test_vram_curve_smoke(smoke):
    """Budgets from the two-slot minimum to all-resident: more budget, more resident blocks; every point
    bitwise against the resident arm, with the planner's prediction beside the measurement."""
    report = json.loads(smoke["curve"].read_text())
    rows = report["rows"]
    assert len(rows) == 3 and all(row["status"] == "ok" for row in rows)
    assert rows[0]["resident_blocks"] == 0 and rows[0]["num_slots"] == 2
    assert rows[-1]["resident_blocks"] == rows[-1]["blocks"] == 4 and rows[-1]["bytes_copied_per_step"] == 0
    assert [r["resident_blocks"] for r in rows] == sorted(r["resident_blocks"] for r in rows)
    assert all(row["parity"]["bitwise"] for row in rows)
    assert all(row["predicted_peak_gb"] and row["predicted_copy_bytes_per_step"] == row["bytes_copied_per_step"]
               for row in rows)
    assert report["resident"]["status"] == "ok" and report["config"]["schedule"] == "layer-major"
    # how long the host took to queue each step is recorded beside the step (0 < host <= step)
    assert all(0 < row["median_host_s"] <= row["median_step_s"] for row in rows)


def test_vram_curve_names_the_ends_of_its_range():
    from tools.bench import vram_curve

    args = vram_curve.parse_args(["--budgets", "all,min,6GiB"])
    assert vram_curve.resolve_budgets(args.budgets, args.points, 2 * 2**30, 5 * 2**30) == ["5.00GiB", "2.00GiB", "6GiB"]
    assert vram_curve.resolve_budgets(None, 2, 2 * 2**30, 5 * 2**30) == ["2.00GiB", "5.00GiB"]


def test_bracketed_ratios_divide_each_round_by_the_resident_runs_around_it():
    """A machine that slows down during the run: each round's arm is compared with the mean of the
    resident runs just before and after it, so the drift cancels."""
    from tools.bench import vram_curve

    rows = [{"budget": "min", "round": 0, "median_step_s": 11.0}, {"budget": "all", "round": 0, "median_step_s": 12.0},
            {"budget": "min", "round": 1, "median_step_s": 13.2}, {"budget": "all", "round": 1, "median_step_s": 14.4},
            {"budget": "min", "round": 2, "median_step_s": None}]
    out = vram_curve.bracketed_ratios(rows, [10.0, 12.0, 12.0])
    assert out["min"] == {"ratios": [1.0, 1.1], "median": 1.05}
    assert out["all"]["ratios"] == [1.0909, 1.2] and out["all"]["median"] == pytest.approx(1.1455, abs=1e-4)
    assert rows[0]["ratio_step_bracketed"] == 1.0 and "ratio_step_bracketed" not in rows[4]


def test_sync_check_counts_each_synchronising_call_and_where_it_came_from(monkeypatch):
    """CUDA's sync debug mode warns once per synchronising call; the check counts them per call site
    (other warnings are not counted). Run here with the mode switch stubbed: there is no GPU."""
    import warnings

    import torch

    from tools.bench.report import diagnostics_line
    from tools.bench.timeline import sync_check

    modes = []
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)

    def item_call():
        warnings.warn("called a synchronizing CUDA operation")

    def step():
        for _ in range(3):
            item_call()
        warnings.warn("something else")

    report = sync_check(step, torch.device("cpu"))
    assert report["syncs"] == 3 and len(report["sites"]) == 1
    assert report["sites"][0]["calls"] == 3 and report["sites"][0]["where"].startswith("test_tools_smoke.py:")
    assert "item_call" in report["sites"][0]["where"] and modes == ["warn", 0]
    line = diagnostics_line({"median_host_s": 0.5, "median_step_s": 1.0, "host_syncs": report})
    assert "host queued a step in 0.500 s of 1.0 s" in line and "3 host syncs" in line


def test_copy_timeline_attributes_each_stall_to_its_block_and_phase(monkeypatch):
    """The CUDA-event bookkeeping of ``bench --timeline``, on a fake clock: a wait stalls the compute by
    max(0, copy done - compute reached it); the phase turns to backward when block indices go down."""
    import torch

    from tools.bench.timeline import CopyTimeline

    clock = {"gpu": 0.0}

    class FakeEvent:
        def __init__(self, enable_timing=False):
            self.at = None

        def record(self, stream=None):
            self.at = clock["gpu"]

        def elapsed_time(self, other):
            return other.at - self.at

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)

    class Block:
        def __init__(self, index):
            self.index, self.resident, self.slot = index, False, None

    class Store:  # what BlockStore does for its observers
        device, copy_stream = "cuda", None

        def __init__(self):
            self.blocks = [Block(i) for i in range(3)]
            self.observers = []

        def fetch(self, index):
            block = self.blocks[index]
            if block.resident or block.slot is not None:
                return
            block.slot = 0
            for observer in self.observers:
                observer.on_fetch(index)

        def wait(self, index):
            if self.blocks[index].resident:
                return
            for observer in self.observers:
                observer.on_wait(index)

    store = Store()
    timeline = CopyTimeline(store)
    begin, end = timeline.hooks(warmup=1)
    begin(0)  # a warm-up step: not traced
    store.fetch(0)
    store.blocks[0].slot = None
    end(0)
    begin(1)

    def copy(index, done_at):  # the copy finishes at done_at (ms after the step began)
        clock["gpu"] = done_at
        store.fetch(index)

    def want(index, at):
        clock["gpu"] = at
        store.wait(index)

    copy(0, 5.0); want(0, 1.0)          # forward, block 0: waited 4 ms
    copy(1, 8.0); want(1, 9.0)          # forward, block 1: copy was done first: no stall
    want(2, 12.0)                       # block 2 never copied this step (resident in a slot): no stall
    store.blocks[1].slot = None         # released after the forward
    copy(1, 20.0); want(1, 18.5)        # backward (index went down), block 1: 1.5 ms
    store.blocks[0].resident = True
    want(0, 30.0)                       # a resident block is never waited for
    end(1)
    timeline.detach()
    assert store.observers == []
    (step,) = timeline.steps
    assert step["stall_forward_ms"] == 4.0 and step["stall_backward_ms"] == 1.5
    assert step["waits"] == 4 and step["stalled_waits"] == 2
    assert step["largest_stalls"][0] == {"ms": 4.0, "block": 0, "phase": "forward"}
    assert timeline.summary()["median_stall_forward_ms"] == 4.0


def test_bench_smoke(smoke):
    report = json.loads(smoke["bench"].read_text())
    assert ENVIRONMENT_KEYS <= set(report["environment"])
    assert report["environment"]["commit"] == "test"
    assert report["config"]["model"] == "tiny" and report["config"]["steps"] == 2
    for name in ("resident", "poros"):
        arm = report["arms"][name]
        assert arm["status"] == "ok", arm.get("error")
        assert len(arm["losses"]) == 3 and len(arm["step_times_s"]) == 3 and arm["timed_steps"] == 2
        assert arm["median_step_s"] is not None
    poros_arm = report["arms"]["poros"]
    assert poros_arm["blocks"] == 2 and poros_arm["host_bytes"] > 0
    assert poros_arm["bytes_copied_per_step"] >= poros_arm["host_bytes"]  # every block at least once a step
    comparison = report["comparison"]
    assert comparison["max_diff_loss"] == 0.0
    assert comparison["max_diff_adapter"] == 0.0
    assert comparison["max_diff_optimizer"] == 0.0
    assert comparison["bitwise"] is True
    assert comparison["adapter_tensors"] == 2 * 7 * 2  # 2 layers x 7 projections x (A, B)
    assert comparison["optimizer_tensors"] == 3 * comparison["adapter_tensors"]  # step, exp_avg, exp_avg_sq


def test_parity_gate_smoke(smoke, monkeypatch):
    registry = smoke["registry"]
    report = json.loads(smoke["gate"].read_text())
    assert {v["variant"] for v in report["variants"]} == GATE_VARIANTS
    for variant in report["variants"]:
        assert variant["label"] == "bitwise", variant
        comparison = variant["comparison"]
        assert (comparison["max_diff_loss"], comparison["max_diff_adapter"], comparison["max_diff_optimizer"]) \
            == (0.0, 0.0, 0.0)
        assert comparison["equal_loss"] and comparison["equal_adapter"] and comparison["equal_optimizer"]
        assert len(variant["arms"]["resident"]["losses"]) == 3
    assert len(report["records"]) == len(GATE_VARIANTS)
    for record in report["records"]:
        assert RECORD_KEYS <= set(record), RECORD_KEYS - set(record)
        assert record["source"] == "tools/checks/parity_gate.py" and record["adapter"] == "lora"

    from poros import records

    monkeypatch.setenv(records.REGISTRY_DIR_ENV, str(registry))
    expected = {"qwen2": 1, "qwen3": 1, "qwen3_5": 1, "gemma3": 1, "gemma4": 2}  # gemma4 and gemma4-moe
    for family, count in expected.items():
        appended = [r for r in records.validations(family) if r.get("commit") == "test"]
        assert len(appended) == count and all(r["label"] == "bitwise" for r in appended), appended
        assert records.status(family) == "bitwise"
        original = (REPO / "registry" / f"{family}.toml").read_text()
        assert (registry / f"{family}.toml").read_text().startswith(original)  # appended, not rewritten


def test_compare_reports_a_one_ulp_difference():
    """The comparison a bitwise label rests on notices the smallest possible difference."""
    import torch

    from tools.bench.arms import ArmResult, compare

    base = torch.tensor([1.0, 2.0, 3.0])
    nudged = base.clone()
    nudged[1] = torch.nextafter(nudged[1], torch.tensor(10.0))
    same = ArmResult("resident", losses=[base[0]], adapter={"a": base}, optimizer={"a::exp_avg": base})
    other = ArmResult("poros", losses=[base[0]], adapter={"a": nudged}, optimizer={"a::exp_avg": base})
    result = compare({"resident": same, "poros": other})
    assert result["bitwise"] is False and result["equal_adapter"] is False
    assert result["max_diff_adapter"] == pytest.approx(2.0 ** -22)
    assert result["equal_loss"] and result["equal_optimizer"]


def test_diagnosis_names_the_kernel_whose_swap_makes_it_bitwise(monkeypatch):
    """A numerical variant is rerun with the other attention / experts kernel; the fixing swap is named."""
    from tools.checks import parity_gate

    def fake_run(variant, args, device, *, attn, experts):
        bitwise = experts == "eager"  # pretend grouped_mm is the culprit
        return {"comparison": {"bitwise": bitwise, "max_diff_loss": 0.0 if bitwise else 1e-3,
                               "max_diff_adapter": 0.0}, "nondeterministic_kernels": [], "arms": {}}

    monkeypatch.setattr(parity_gate, "run_variant", fake_run)
    variant = next(v for v in parity_gate.VARIANTS if v.moe)
    report = {"attn_implementation": "sdpa", "experts_implementation": "grouped_mm", "nondeterministic_kernels": []}
    diagnosis = parity_gate.diagnose(variant, None, None, report)
    assert [t["swap"] for t in diagnosis["trials"]] == ["attention=eager", "experts=eager"]
    assert diagnosis["kernel"] == "experts implementation grouped_mm (bitwise with eager)"


def test_validation_table_is_toml():
    import tomllib

    from tools.checks import parity_gate

    record = {"platform": "NVIDIA H200", "label": "numerical", "max_diff_loss": 1.5e-05, "max_diff_adapter": "nan",
              "deterministic": True, "kernel": 'sdpa "efficient" backward', "skipped": None}
    parsed = tomllib.loads(parity_gate.toml_table(record))["validation"][0]
    assert parsed["platform"] == "NVIDIA H200" and parsed["max_diff_loss"] == 1.5e-05
    assert parsed["deterministic"] is True and parsed["kernel"] == 'sdpa "efficient" backward'
    assert parsed["max_diff_adapter"] != parsed["max_diff_adapter"]  # nan
    assert "skipped" not in parsed


def test_a_refused_kernel_is_named_and_labels_numerical(monkeypatch):
    """A kernel that deterministic mode refuses is named, measured with warn_only, and labelled numerical."""
    import argparse

    import torch

    from tools.checks import parity_gate

    refusal = ("RuntimeError: cumsum_cuda_kernel does not have a deterministic implementation, but you set "
               "'torch.use_deterministic_algorithms(True)'.\nTraceback ...")
    calls = []

    def fake_run(variant, args, device, *, attn, experts):
        calls.append(torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled())
        if len(calls) == 1:
            return {"arms": {"resident": {"error": refusal}, "poros": {"error": refusal}}, "comparison": None,
                    "nondeterministic_kernels": [], "attn_implementation": attn, "experts_implementation": experts,
                    "variant": variant.name}
        return {"arms": {"resident": {"error": None}}, "nondeterministic_kernels": ["cumsum_cuda_kernel"],
                "comparison": {"bitwise": True, "max_diff_loss": 0.0, "max_diff_adapter": 0.0,
                               "max_diff_optimizer": 0.0},
                "attn_implementation": attn, "experts_implementation": experts, "variant": variant.name,
                "layers": 4, "width_of": "Qwen/Qwen3.5-9B", "hidden_size": 4096}

    monkeypatch.setattr(parity_gate, "run_variant", fake_run)
    previous = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True)
    try:
        args = argparse.Namespace(deterministic=True, attn="sdpa", experts="grouped_mm", no_diagnose=True, seq=256,
                                  batch=2, pad=32, steps=3)
        variant = next(v for v in parity_gate.VARIANTS if v.name == "qwen3_5")
        report = parity_gate.gate_variant(variant, args, None)
        assert calls == [False, True]  # the rerun measured with warn_only
        assert not torch.is_deterministic_algorithms_warn_only_enabled()  # and strict mode came back
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])
    assert report["label"] == "numerical"
    assert report["nondeterministic_kernels"] == ["cumsum_cuda_kernel"]
    env = dict.fromkeys(ENVIRONMENT_KEYS, "x")
    record = parity_gate.validation_record(report, env, args)
    assert record["label"] == "numerical" and record["kernel"] == "cumsum_cuda_kernel"
    assert "equal in this run" in record["note"]


def test_save_load_check_feeds_the_batch_on_the_compute_device():
    """The gate's batches are made on the host (``run_arm`` moves each); ``save_load_check``'s forwards must
    move theirs too, or the resident arm's embedding (on the GPU) gets host token ids (H200: "index is on
    cpu ... index_select"). "meta" stands in for the GPU: the forward is stopped at its inputs."""
    import torch

    import poros
    from tools.checks import parity_gate
    from tools.bench.models import add_lora, build_model, make_batches
    from tools.bench.shapes import model_config

    class Stop(Exception):
        pass

    config, _ = model_config("tiny-qwen2")
    peft_model = add_lora(build_model(config, "cpu", seed=0), rank=4, alpha=8)
    batch = make_batches(config, count=1, batch=1, seq=8)[0]
    poros.prepare(peft_model)
    seen = []

    def record(module, args, kwargs):
        seen.append({key: value.device.type for key, value in kwargs.items() if isinstance(value, torch.Tensor)})
        raise Stop

    peft_model.register_forward_pre_hook(record, with_kwargs=True)
    with pytest.raises(Stop):
        parity_gate.save_load_check(peft_model, batch, torch.device("meta"))
    assert seen == [{"input_ids": "meta", "attention_mask": "meta", "labels": "meta"}]
