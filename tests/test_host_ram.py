"""Host RAM planned and checked for the machine (issue 43): ``poros plan`` compares the host RAM a run needs
with what the machine has (``POROS_HOST_RAM``, else MemAvailable and the cgroup limit), re-plans
(``boundary_every``, host tier, host budget) where it does not fit, or refuses in one line naming the plan
that would. The long-context acceptance plans: arithmetic only, nothing is loaded."""

from __future__ import annotations

import json
import pytest

from poros import records
from poros.cli.main import main
from poros.plan.host_tiers import PROCESS_HOST_BYTES, machine_host_ram
from poros.plan.budget import kept_states
from poros.testing import save_tiny_checkpoint

GIB = 2**30
CUDA = ["--device", "cuda", "--block-ms", "120,240", "--link-gb-per-s", "25"]


def plan(capsys, model: str, *argv: str) -> tuple[int, dict | None, str]:
    status = main(["plan", "--model", str(model), *argv, "--json"])
    out, err = capsys.readouterr()
    return status, (json.loads(out) if status == 0 else None), err


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_the_machine_ram_is_the_smaller_of_meminfo_and_the_cgroup_room(tmp_path):
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "meminfo").write_text("MemTotal: 67108864 kB\nMemAvailable: 62914560 kB\n")
    assert machine_host_ram({}, str(tmp_path)).available == 60 * GIB
    cgroup = tmp_path / "sys" / "fs" / "cgroup"
    cgroup.mkdir(parents=True)
    (cgroup / "memory.max").write_text(f"{48 * GIB}\n")
    (cgroup / "memory.current").write_text(f"{8 * GIB}\n")
    found = machine_host_ram({}, str(tmp_path))
    assert found.available == 40 * GIB and "memory.max" in found.source
    (cgroup / "memory.max").write_text("max\n")
    assert machine_host_ram({}, str(tmp_path)).available == 60 * GIB
    assert machine_host_ram({"POROS_HOST_RAM": "24GiB"}, str(tmp_path)).available == 24 * GIB  # injected
    assert machine_host_ram({}, str(tmp_path / "nowhere")) is None


def test_72b_at_128k_under_80gib_keeps_no_boundary_state_on_disk(capsys, monkeypatch):
    """Acceptance: --vram-budget 80GiB --host-budget 100GiB on the H200 host (125 GB of RAM): boundary_every
    keeps a fraction of the 172 GB of states, on the host; the recompute's forward is in the copies."""
    monkeypatch.setenv("POROS_HOST_RAM", "120GB")
    status, report, err = plan(capsys, "Qwen/Qwen2.5-72B", "--seq-len", "131072", "--vram-budget", "80GiB", *CUDA,
                               "--host-budget", "100GiB")
    assert status == 0, err
    bp = report["plan"]
    every = bp["boundary_every"]
    assert bp["boundary_states"] == "host" and every > 1
    assert bp["boundary_bytes"] == kept_states(80, every) * 131072 * 8192 * 2
    assert report["host_ram"]["total"] <= 100 * GIB and bp["needed_bytes"] <= 80 * GIB
    assert any(note.startswith(f"boundary_every={every}:") for note in bp["notes"])
    # the recompute's forward: each block but the kept segments' tops crosses the link a third time
    blocks = report["host_ram"]["parts"]["blocks (mapped tier)"]
    assert bp["copy_bytes_per_step"] > 2 * blocks


def test_72b_at_32k_on_a_desktop_maps_a_prequantized_checkpoint(capsys, monkeypatch, tmp_path):
    """Acceptance: a bnb-4bit Qwen2.5-72B at 32K, --vram-budget 24GiB --host-budget 48GiB on a 64 GB machine:
    the blocks mapped from the checkpoint's shards, the boundary states in RAM."""
    checkpoint = tmp_path / "qwen72b-bnb-4bit"
    checkpoint.mkdir()
    config = records.config_json(records.find_checkpoint("Qwen/Qwen2.5-72B")[1])
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True,
                                     "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
                                     "bnb_4bit_compute_dtype": "bfloat16", "bnb_4bit_quant_storage": "uint8"}
    (checkpoint / "config.json").write_text(json.dumps(config))
    monkeypatch.setenv("POROS_HOST_RAM", "64GB")
    status, report, err = plan(capsys, checkpoint, "--seq-len", "32768", "--vram-budget", "24GiB", *CUDA,
                               "--host-budget", "48GiB")
    assert status == 0, err
    assert report["host"]["tier"] == "mapped" and "pre-quantized checkpoint" in report["host"]["reason"]
    assert report["plan"]["boundary_states"] == "host" and report["plan"]["boundary_every"] > 1
    assert report["host_ram"]["total"] <= 48 * GIB


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("host-ram") / "ckpt", "qwen3", num_layers=4)


TINY = ["--device", "cpu", "--seq-len", "64", "--grad-accum", "2", "--stream-schedule", "layer-major",
        "--vram-budget", "2200000"]  # the ring and nothing resident: every block streams


def test_a_run_above_the_machine_ram_is_replanned_to_fit(capsys, monkeypatch, tiny):
    status, roomy, err = plan(capsys, tiny, *TINY)
    assert status == 0, err
    need = roomy["host_ram"]["total"]
    monkeypatch.setenv("POROS_HOST_RAM", str(PROCESS_HOST_BYTES + need - 1))
    status, report, err = plan(capsys, tiny, *TINY)
    assert status == 0, err
    assert "host RAM: the run needs" in err and "planned for host_budget=" in err  # said, on stderr
    assert report["host_ram"]["total"] <= need - 1
    assert roomy["host"]["tier"] == "mapped" and report["host"]["tier"] == "disk"  # the blocks stream from the drive


def test_a_host_budget_the_machine_cannot_give_is_refused_naming_the_plan_that_fits(capsys, monkeypatch, tiny):
    status, roomy, err = plan(capsys, tiny, *TINY)
    need = roomy["host_ram"]["total"]
    monkeypatch.setenv("POROS_HOST_RAM", str(PROCESS_HOST_BYTES + need - 1))
    status, _, err = plan(capsys, tiny, *TINY, "--host-budget", "1GiB")
    assert status == 1
    (line,) = err.strip().splitlines()
    assert "host_budget=1GiB: the run needs" in line and "Fix: --host-budget" in line and "which plans the" in line


def test_a_machine_too_small_for_any_plan_is_refused(capsys, monkeypatch, tiny):
    monkeypatch.setenv("POROS_HOST_RAM", str(PROCESS_HOST_BYTES + 1000))
    status, _, err = plan(capsys, tiny, *TINY)
    assert status == 1
    (line,) = err.strip().splitlines()
    assert "no plan fits it" in line and "POROS_HOST_RAM=" in line


def test_the_trainer_refuses_before_loading(monkeypatch, tiny):
    """PorosTrainer checks the host RAM before any weight is read."""
    from poros.config import PorosConfig
    from poros.errors import HostMemoryError
    from poros.loading import load
    from poros.training.trainer import PorosTrainer

    loads = []
    monkeypatch.setattr(load, "load_pretrained", lambda *a, **k: loads.append(a))
    monkeypatch.setenv("POROS_HOST_RAM", str(PROCESS_HOST_BYTES + 1000))
    config = PorosConfig(model=str(tiny), device="cpu", seq_len=64, grad_accum=2, vram_budget="2200000")
    with pytest.raises(HostMemoryError, match="no plan fits it"):
        PorosTrainer.from_config(config)
    config = config.replace(vram_budget=None)  # no budget: the streamed blocks alone
    with pytest.raises(HostMemoryError, match="the streamed blocks and host tables need"):
        PorosTrainer.from_config(config)
    assert loads == []
