"""``poros doctor``'s GPU half (poros.doctor.diagnostics): the rule table on made-up device records, the
printing, the probes' parsers on fake nvidia-smi / sysfs text, and the real thing on this CPU
machine (no CUDA device, reported cleanly; ``--model`` on the bundled tiny Qwen3)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from poros.doctor import diagnostics

from poros.doctor import gpu_probe
from poros.cli import doctor
from poros.cli.main import main
from poros.spellings import human_bytes

GIB = 2**30
DRIVER = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.65"


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    status = main(list(argv))
    return status, capsys.readouterr().out


def h200(**changes) -> dict:
    """A healthy one-card report as the probes write it (an H200 on PCIe Gen5 x16)."""
    report = {
        "nvidia_driver": DRIVER,
        "memory": {"total_bytes": 128 * GIB, "available_bytes": 120 * GIB},
        "torch": {"version": "2.13.0+cu128", "cuda_runtime": "12.8", "driver_cuda": "13.0", "cuda_available": True,
                  "device_count": 1, "arch_list": ["sm_80", "sm_90", "sm_100", "sm_120", "compute_120"]},
        "devices": [{"index": 0, "name": "NVIDIA H200", "capability": [9, 0], "total_bytes": 140 * GIB,
                     "free_bytes": 139 * GIB, "pci_bus_id": "0000:1b:00.0", "peers": {},
                     "pcie": {"current_gen": 5, "max_gen": 5, "current_width": 16, "max_width": 16,
                              "source": "nvidia-smi"}}],
        "bitsandbytes": {"version": "0.50.2", "library": "/site/bitsandbytes/libbitsandbytes_cuda128.so",
                         "cuda_kernels": True, "load_error": None,
                         "smoke": {"device": "cuda:0", "ok": True, "codes_equal_fraction": 1.0,
                                   "absmax_max_rel_diff": 0.0, "dequant_max_abs_diff": 0.0,
                                   "matmul_rel_error": 0.002, "cpu_matmul_rel_error": 0.002}},
        "pinned": {"memlock_soft_bytes": None, "memlock_hard_bytes": None, "ok": True, "requested_bytes": 4 * GIB,
                   "seconds": 0.9, "error": None},
        "bandwidth": {"device_index": 0, "bytes": 512 * 2**20, "repeats": 3, "h2d_pinned_gb_per_s": 55.0,
                      "h2d_pageable_gb_per_s": 8.0, "d2h_pinned_gb_per_s": 55.5, "d2h_pageable_gb_per_s": 6.0},
    }
    for path, value in changes.items():  # "torch.cuda_available": False
        *parents, key = path.split(".")
        target = report
        for parent in parents:
            target = target[int(parent)] if isinstance(target, list) else target[parent]
        target[key] = value
    return report


def model_record(**changes) -> dict:
    record = {"model": "Qwen/Qwen2.5-32B", "host_bytes": 20 * GIB, "minimum_budget_bytes": 3 * GIB,
              "budget_bytes": 140 * GIB, "budget_source": "cuda:0 total", "plan": {"peak_bytes": 30 * GIB},
              "card": {"index": 0, "total_bytes": 140 * GIB, "free_bytes": 139 * GIB, "fits": True}}
    record.update(changes)
    return record


def gpu_part(report: dict) -> dict:
    """``report`` without the host's fields, with its problems: what ``doctor.gpu_report`` returns."""
    part = {key: value for key, value in report.items() if key not in ("memory", "nvidia_driver")}
    return {**part, "problems": diagnostics.problems(report)}


def codes(report: dict) -> list[str]:
    return [problem["code"] for problem in diagnostics.problems(report)]


# -- the rule table ----------------------------------------------------------------------------

CASES = {
    "healthy": (h200(), []),
    "torch_import_failed": ({"torch": {"version": "2.13.0", "import_error": "OSError: libcudart.so.12: cannot open",
                                       "cuda_runtime": None, "driver_cuda": "12.8"}}, ["torch_import_failed"]),
    "cpu build with a driver": (h200(**{"torch.version": "2.13.0+cpu", "torch.cuda_runtime": None,
                                        "torch.cuda_available": False}), ["torch_cpu_build"]),
    "driver older than the runtime": (h200(**{"torch.cuda_runtime": "13.0", "torch.driver_cuda": "12.4",
                                              "torch.cuda_available": False}), ["driver_too_old"]),
    "driver loaded, no device": (h200(**{"torch.cuda_available": False}), ["cuda_unavailable"]),
    "no driver": (h200(**{"torch.cuda_available": False, "torch.driver_cuda": None, "nvidia_driver": None}),
                  ["no_cuda_device"]),
    "card newer than the build": (h200(**{"torch.arch_list": ["sm_80", "sm_90"], "devices.0.capability": [12, 0]}),
                                  ["arch_unsupported"]),
    "bitsandbytes import": (h200(bitsandbytes={"version": "0.50.2", "import_error": "RuntimeError: boom"}),
                            ["bnb_import_failed"]),
    "bitsandbytes cpu library": (h200(**{"bitsandbytes.cuda_kernels": False,
                                         "bitsandbytes.library": "/site/libbitsandbytes_cpu.so"}),
                                 ["bnb_no_cuda_kernels"]),
    "nf4 smoke": (h200(**{"bitsandbytes.smoke.ok": False, "bitsandbytes.smoke.codes_equal_fraction": 0.5}),
                  ["nf4_smoke_failed"]),
    "pinning": (h200(**{"pinned.ok": False, "pinned.error": "CUDA error: out of memory",
                        "pinned.memlock_soft_bytes": 64 * 1024}), ["pinned_failed"]),
    "busy card": (h200(**{"devices.0.free_bytes": 40 * GIB}), ["device_memory_in_use"]),
    "slow link": (h200(**{"bandwidth.h2d_pinned_gb_per_s": 12.0}), ["link_slow"]),
    "model not planned": ({"model": {"model": "org/missing", "error": "CheckpointLoadError: not cached"}},
                          ["model_not_planned"]),
    "host ram": ({**h200(), "model": model_record(host_bytes=200 * GIB)}, ["host_ram_short"]),
    "small card": ({**h200(), "model": model_record(budget_source="cuda:0 total", plan=None, minimum_budget_bytes=
                   150 * GIB, card={"index": 0, "total_bytes": 140 * GIB, "free_bytes": 0, "fits": False})},
                   ["card_too_small"]),
    "budget": ({**h200(), "model": model_record(budget_source="--vram-budget", budget_bytes=GIB, plan=None)},
               ["budget_below_minimum"]),
}


@pytest.mark.parametrize("name", CASES)
def test_each_finding_is_named_from_the_records(name):
    report, expected = CASES[name]
    assert codes(report) == expected


def test_every_rule_has_a_case():
    # a rule no record can trigger is dead text; one a case misses is untested
    assert {code for _, expected in CASES.values() for code in expected} == set(diagnostics.RULES)


def test_problems_carry_the_fix_with_the_facts():
    cpu_build = diagnostics.problems(CASES["cpu build with a driver"][0])[0]
    assert cpu_build["blocks"]
    assert cpu_build["problem"].startswith("CUDA not available: torch 2.13.0+cpu is the CPU build")
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu130" in cpu_build["fix"]
    pinned = diagnostics.problems(CASES["pinning"][0])[0]
    assert "pinned allocation of 4.0 GiB failed: CUDA error: out of memory (locked-memory limit 64.0 KiB)" \
        == pinned["problem"]
    assert pinned["fix"].startswith("raise the container's memlock limit")
    budget = diagnostics.problems(CASES["budget"][0])[0]
    assert budget["fix"] == "pass --vram-budget 3GiB or more"
    notes = [p for name in ("no driver", "busy card", "slow link") for p in diagnostics.problems(CASES[name][0])]
    assert notes and not any(note["blocks"] for note in notes)


@pytest.mark.parametrize("major,minor,arch_list,supported", [
    (9, 0, ["sm_80", "sm_90"], True),
    (8, 9, ["sm_80", "sm_90"], False),
    (12, 0, ["sm_90", "compute_90"], True),  # PTX JIT-compiles forward
    (8, 0, ["sm_90", "compute_90"], False),
])
def test_arch_supported(major, minor, arch_list, supported):
    assert diagnostics.arch_supported(major, minor, arch_list) is supported


def test_wheel_tag():
    assert diagnostics.wheel_tag("12.8") == "cu128" and diagnostics.wheel_tag(None) == "cuXYZ"


# -- printing ----------------------------------------------------------------------------------

def test_a_card_prints_as_one_paste_ready_block(monkeypatch):
    report = {**doctor.report(), **gpu_part(h200(**{"pinned.ok": False, "pinned.error": "cudaHostAlloc failed",
                                                   "pinned.memlock_soft_bytes": 64 * 1024}))}
    text = doctor.format_report(report)
    lines = text.splitlines()
    assert lines[0] == "```text" and lines[-1] == "```"
    flat = " ".join(text.split())
    assert "cuda:0 NVIDIA H200, sm_90, 140.0 GiB total, 139.0 GiB free; PCIe Gen5 x16 [nvidia-smi]; peers: none" in flat
    assert "library /site/bitsandbytes/libbitsandbytes_cuda128.so; NF4 smoke test on cuda:0: ok" in flat
    assert ("host->device 55.0 GB/s pinned, 8.0 pageable; device->host 55.5 pinned, 6.0 pageable "
            "(512 MiB copies, best of 3, cuda:0)") in flat
    assert "pinned 4.0 GiB FAILED: cudaHostAlloc failed; memlock limit 64.0 KiB" in flat
    assert "problems [pinned_failed] pinned allocation of 4.0 GiB failed" in flat
    assert "fix: raise the container's memlock limit" in flat


def test_blocking_problems_set_the_exit_status(capsys, monkeypatch):
    monkeypatch.setattr(doctor, "gpu_report", lambda data, **_: gpu_part(CASES["pinning"][0]))
    status, out = run_cli(capsys, "doctor")
    assert status == 1 and "[pinned_failed]" in out
    monkeypatch.setattr(doctor, "gpu_report", lambda data, **_: gpu_part(CASES["busy card"][0]))
    status, out = run_cli(capsys, "doctor")
    assert status == 0 and "notes" in out and "[device_memory_in_use]" in out and "problems       none" in out


# -- the probes' parsers -------------------------------------------------------------------------

def test_nvidia_smi_cards_and_topology(monkeypatch):
    monkeypatch.setattr(gpu_probe.shutil, "which", lambda name: "/usr/bin/nvidia-smi")

    def runner(command, **_):
        if command[1] == "topo":
            text = ("\tGPU0\tGPU1\tNIC0\tCPU Affinity\tNUMA Affinity\n"
                    "GPU0\t X \tNV18\tSYS\t0-63\t0\nGPU1\tNV18\t X \tSYS\t0-63\t0\nNIC0\tSYS\tSYS\t X\n")
        else:
            text = ("0, GPU-5A1C0000-aaaa, 00000000:1B:00.0, 5, 5, 16, 16\n"
                    "1, GPU-77770000-bbbb, 00000000:9A:00.0, 1, 5, 16, [N/A]\n")
        return subprocess.CompletedProcess(command, 0, text, "")

    cards = gpu_probe.nvidia_smi_cards(runner)
    assert [(c["index"], c["uuid"], c["bus_id"]) for c in cards] == [
        (0, "5a1c0000-aaaa", "0000:1b:00.0"), (1, "77770000-bbbb", "0000:9a:00.0")]
    assert cards[1]["pcie"] == {"current_gen": 1, "max_gen": 5, "current_width": 16, "max_width": None,
                                "source": "nvidia-smi"}
    assert gpu_probe.topology_links(runner) == {0: {1: "NV18"}, 1: {0: "NV18"}}
    assert "idle cards lower the speed" in diagnostics.pcie_text(cards[1]["pcie"])
    monkeypatch.setattr(gpu_probe.shutil, "which", lambda name: None)
    assert gpu_probe.nvidia_smi_cards(runner) == [] and gpu_probe.topology_links(runner) == {}


def test_sysfs_link(tmp_path):
    device = tmp_path / "0000:1b:00.0"
    device.mkdir()
    for name, value in (("current_link_speed", "16.0 GT/s PCIe"), ("max_link_speed", "32.0 GT/s PCIe"),
                        ("current_link_width", "8"), ("max_link_width", "16")):
        (device / name).write_text(value + "\n")
    assert gpu_probe.sysfs_link("0000:1b:00.0", tmp_path) == {
        "current_gen": 4, "max_gen": 5, "current_width": 8, "max_width": 16, "source": str(device)}
    assert gpu_probe.sysfs_link("0000:00:00.0", tmp_path) == {}


def test_loaded_library(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r--p 00000000 fe:00 1  /usr/lib/libc.so.6\n"
                    "7f02-7f03 r-xp 00000000 fe:00 2  /site/bitsandbytes/libbitsandbytes_cuda128.so\n")
    assert gpu_probe.loaded_library("libbitsandbytes", maps) == "/site/bitsandbytes/libbitsandbytes_cuda128.so"
    assert gpu_probe.loaded_library("libcudart", maps) is None


def test_nf4_smoke_test_compares_against_the_cpu():
    # on the CPU it compares the CPU with itself: every code equal, the matmul within bf16 rounding
    smoke = gpu_probe.nf4_smoke_test("cpu", rows=64, columns=128)
    assert smoke["ok"] and smoke["codes_equal_fraction"] == 1.0 and smoke["dequant_max_abs_diff"] == 0.0
    assert 0 < smoke["matmul_rel_error"] < 0.02
    broken = gpu_probe.nf4_smoke_test("no-such-device", rows=64, columns=128)
    assert broken["ok"] is False and broken["error"].startswith("RuntimeError")


# -- this machine ---------------------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the report of a machine without CUDA")
def test_no_cuda_device_is_reported_cleanly(capsys):
    status, out = run_cli(capsys, "doctor", "--json")
    data = json.loads(out)
    assert status == 0
    assert data["torch"]["version"] == torch.__version__ and data["torch"]["cuda_available"] is False
    assert data["devices"] == [] and data["bandwidth"] == {"skipped": "no CUDA device"}
    assert data["pinned"]["ok"] is None and data["pinned"]["skipped"] == "no CUDA device"
    assert data["bitsandbytes"]["smoke"] == {"device": None}
    assert not any(problem["blocks"] for problem in data["problems"])
    status, out = run_cli(capsys, "doctor")
    assert status == 0 and "\ngpu            no CUDA device\n" in out
    assert "NF4 smoke test: not run (no CUDA device)" in " ".join(out.split())
    assert "\ngraphs         off without a CUDA device (cuda_graphs has no effect" in out


def test_model_on_the_bundled_tiny_qwen3(capsys, repo_root):
    status, out = run_cli(capsys, "doctor", "--quick", "--json", "--model", "poros-tiny-qwen3",
                          "--vram-budget", "2GiB")
    model = json.loads(out)["model"]
    assert status == 0
    assert model["family"] == "qwen3" and model["num_blocks"] == 4 and model["found_in"] == "bundled with poros"
    assert 0 < model["host_bytes"] < 2**20 and model["minimum_budget_bytes"] < 2 * GIB
    assert model["plan"]["resident_blocks"] == 4 and model["plan"]["needed_bytes"] <= 2 * GIB
    assert model["suggested_flags"] == ["poros", "train", "--model", "poros-tiny-qwen3", "--vram-budget", "2GiB"]

    directory = str(repo_root / "poros" / "assets" / "tiny-qwen3")
    status, out = run_cli(capsys, "doctor", "--quick", "--model", directory, "--vram-budget", "64MiB")
    flat = " ".join(out.split())
    assert status == 1  # a budget below the minimum blocks the run
    assert "(qwen3, 4 blocks, local directory)" in flat and "below the minimum" in flat
    assert "[budget_below_minimum]" in flat and "fix: pass --vram-budget 1GiB or more" in flat


def test_vram_budget_needs_a_model(capsys):
    assert main(["doctor", "--vram-budget", "8GiB"]) == 1
    assert "add --model ID_OR_DIR" in capsys.readouterr().err


def test_model_that_is_not_there_is_reported(capsys, tmp_path):
    status, out = run_cli(capsys, "doctor", "--quick", "--json", "--model", str(tmp_path / "missing"))
    data = json.loads(out)
    assert status == 1 and data["model"]["error"].startswith("CheckpointLoadError")
    assert [p["code"] for p in data["problems"] if p["blocks"]] == ["model_not_planned"]


def test_gpu_run_doctor_step_writes_text_and_json(tmp_path, repo_root, monkeypatch):
    # tools/checks/doctor_run.py, as `tools/gpu_run.sh doctor:model=SHAPE` runs it: a bench shape's config is
    # written to a scratch directory and the report names the model by its id, not that directory
    from tools.checks import doctor_run

    out = tmp_path / "doctor.json"
    status = doctor_run.main(["--model", "tiny-qwen3", "--quick", "--vram-budget", "2GiB", "--json", str(out)])
    record = json.loads(out.read_text())
    assert status == 0 and record["tool"] == "doctor" and record["commit"] and record["date"]
    assert record["text"] == out.with_suffix(".txt").read_text().rstrip("\n")
    model = record["report"]["model"]
    assert model["family"] == "qwen3" and model["found_in"].startswith("config.json from tools/bench/harness.py")
    assert model["suggested_flags"][3] == model["model"] == "tiny-qwen3"
    assert doctor_run.SCRATCH_PREFIX not in record["text"] and doctor_run.SCRATCH_PREFIX not in json.dumps(model)


def test_installation_page_lists_every_rule(repo_root):
    page = (repo_root / "docs" / "installation.md").read_text()
    table = [line.split("|")[1].strip().strip("`") for line in page.splitlines() if line.startswith("| `")]
    assert set(diagnostics.RULES) <= set(table), sorted(set(diagnostics.RULES) - set(table))


@pytest.mark.parametrize("total,fits,flag", [(140 * GIB, True, "140GiB"), (100 * 2**20, False, "1GiB")])
def test_model_fit_on_a_made_up_card(total, fits, flag):
    card = {**h200()["devices"][0], "total_bytes": total, "free_bytes": total}
    model = gpu_probe.model_fit("poros-tiny-qwen3", vram_budget=None, devices=[card], available_host_bytes=8 * GIB)
    assert model["budget_source"] == "cuda:0 total" and model["budget_bytes"] == total
    assert model["card"]["fits"] is fits and (model["plan"] is not None) is fits
    assert model["suggested_flags"][-2:] == ["--vram-budget", flag]
    report = {**h200(**{"devices.0.total_bytes": total, "devices.0.free_bytes": total}), "model": model}
    assert codes(report) == ([] if fits else ["card_too_small"])
    rows = dict(diagnostics.format_model_rows(model))
    assert rows["fits"] == f"cuda:0 ({human_bytes(total)}): {'yes' if fits else 'no'}"


def test_device_reports_match_cards_by_uuid_and_name_peers_by_nvidia_smi_index(monkeypatch):
    # Two cards whose CUDA order (fastest first) is the reverse of nvidia-smi's PCI order: the PCIe
    # link and the NVLink name must follow the card, not the index. torch.cuda's four calls are
    # replaced with made-up properties; nothing else of torch is.
    from types import SimpleNamespace

    props = [SimpleNamespace(name="NVIDIA H200", major=9, minor=0, multi_processor_count=132, uuid="77770000-bbbb",
                             pci_domain_id=0, pci_bus_id=0x9A, pci_device_id=0),
             SimpleNamespace(name="NVIDIA H200", major=9, minor=0, multi_processor_count=132, uuid="5a1c0000-aaaa")]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props[index])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (139 * GIB, 140 * GIB))
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: True)
    link = {"current_gen": 5, "max_gen": 5, "current_width": 16, "max_width": 16, "source": "nvidia-smi"}
    monkeypatch.setattr(gpu_probe, "nvidia_smi_cards", lambda: [
        {"index": 0, "uuid": "5a1c0000-aaaa", "bus_id": "0000:1b:00.0", "pcie": {**link, "current_width": 8}},
        {"index": 1, "uuid": "77770000-bbbb", "bus_id": "0000:9a:00.0", "pcie": link}])
    monkeypatch.setattr(gpu_probe, "topology_links", lambda: {0: {1: "NV18"}, 1: {0: "NV18"}})

    devices = gpu_probe.device_reports({"cuda_available": True})
    assert [(d["index"], d["nvidia_smi_index"], d["pci_bus_id"]) for d in devices] == [
        (0, 1, "0000:9a:00.0"), (1, 0, "0000:1b:00.0")]
    assert devices[0]["pcie"]["current_width"] == 16 and devices[1]["pcie"]["current_width"] == 8
    assert devices[0]["peers"] == {1: "NV18"} and devices[1]["peers"] == {0: "NV18"}
    assert json.loads(json.dumps(devices))  # JSON-ready
    assert gpu_probe.device_reports({"cuda_available": False}) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the failure path of a machine without CUDA")
def test_a_failed_pin_is_reported_not_raised():
    pinned = gpu_probe.pinned_report(True, 64 * GIB)
    assert pinned["ok"] is False and pinned["error"] and pinned["requested_bytes"] == gpu_probe.PIN_BYTES
    assert codes({**h200(), "pinned": pinned}) == ["pinned_failed"]
    small = gpu_probe.pinned_report(True, 4 * 2**20 + 5)  # a quarter of the available memory at most
    assert small["requested_bytes"] == 2**20
