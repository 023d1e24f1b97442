"""``poros doctor``'s host probes, on fake /proc and cgroup trees (v1, v2, hybrid, nested, none)."""

from __future__ import annotations

from pathlib import Path

import pytest

from poros.cli import doctor

GIB = 2**30
V1_UNLIMITED = "9223372036854771712"  # what cgroup v1 writes when no limit is set


def write(root: Path, relative: str, text: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def proc(tmp_path) -> Path:
    """A fake /proc with 64 GiB MemTotal and 40 GiB MemAvailable."""
    root = tmp_path / "proc"
    write(root, "meminfo", f"MemTotal:       {64 * GIB // 1024} kB\nMemFree: 1 kB\nMemAvailable:   {40 * GIB // 1024} kB\n")
    return root


@pytest.fixture
def cgroup(tmp_path) -> Path:
    return tmp_path / "cgroup"


def test_meminfo_is_read_in_bytes(proc):
    assert doctor.read_meminfo(proc) == {"MemTotal": 64 * GIB, "MemFree": 1024, "MemAvailable": 40 * GIB}


def test_no_cgroup_file_reports_meminfo(proc, cgroup):
    memory = doctor.host_memory(proc, cgroup)
    assert memory["total_bytes"] == 64 * GIB and memory["available_bytes"] == 40 * GIB
    assert memory["source"] == f"{proc / 'meminfo'} MemTotal"
    assert memory["cgroup_limit_bytes"] is None


def test_cgroup_v2_limit_below_memtotal_wins(proc, cgroup):
    write(proc, "self/cgroup", "0::/\n")
    write(cgroup, "cgroup.controllers", "cpu memory\n")
    write(cgroup, "memory.max", f"{24 * GIB}\n")
    write(cgroup, "memory.current", f"{20 * GIB}\n")
    memory = doctor.host_memory(proc, cgroup)
    assert memory["total_bytes"] == 24 * GIB
    assert memory["source"] == f"cgroup {cgroup / 'memory.max'}"
    assert memory["available_bytes"] == 4 * GIB  # limit - usage, below MemAvailable
    assert memory["meminfo_total_bytes"] == 64 * GIB


def test_cgroup_v2_max_means_no_limit(proc, cgroup):
    write(proc, "self/cgroup", "0::/\n")
    write(cgroup, "cgroup.controllers", "memory\n")
    write(cgroup, "memory.max", "max\n")
    memory = doctor.host_memory(proc, cgroup)
    assert memory["total_bytes"] == 64 * GIB and memory["cgroup_limit_bytes"] is None


def test_cgroup_v2_takes_the_tightest_ancestor(proc, cgroup):
    write(proc, "self/cgroup", "0::/user.slice/job.scope\n")
    write(cgroup, "cgroup.controllers", "memory\n")
    write(cgroup, "user.slice/memory.max", f"{16 * GIB}\n")
    write(cgroup, "user.slice/job.scope/memory.max", f"{32 * GIB}\n")
    memory = doctor.host_memory(proc, cgroup)
    assert memory["total_bytes"] == 16 * GIB
    assert memory["source"] == f"cgroup {cgroup / 'user.slice' / 'memory.max'}"


def test_cgroup_path_from_another_namespace_falls_back_to_the_mount_root(proc, cgroup):
    write(proc, "self/cgroup", "0::/../host/path\n")
    write(cgroup, "cgroup.controllers", "memory\n")
    write(cgroup, "memory.max", f"{8 * GIB}\n")
    assert doctor.host_memory(proc, cgroup)["total_bytes"] == 8 * GIB


def test_cgroup_limit_above_memtotal_is_reported_but_memtotal_wins(proc, cgroup):
    write(proc, "self/cgroup", "0::/\n")
    write(cgroup, "cgroup.controllers", "memory\n")
    write(cgroup, "memory.max", f"{128 * GIB}\n")
    memory = doctor.host_memory(proc, cgroup)
    assert memory["total_bytes"] == 64 * GIB and memory["source"].endswith("meminfo MemTotal")
    assert memory["cgroup_limit_bytes"] == 128 * GIB


@pytest.mark.parametrize(("limit", "expected"), [(V1_UNLIMITED, 64 * GIB), (str(12 * GIB), 12 * GIB)],
                         ids=["unlimited", "limited"])
def test_cgroup_v1_on_a_hybrid_host(proc, cgroup, limit, expected):
    # As on this project's machines: v1 controllers, plus a unified mount without the memory controller.
    write(proc, "self/cgroup", "4:memory:/process_api/abc\n3:cpuset:/\nnot a cgroup line\n0::/\n")
    write(cgroup, "unified/cgroup.controllers", "\n")
    write(cgroup, "memory/memory.limit_in_bytes", V1_UNLIMITED)
    write(cgroup, "memory/process_api/abc/memory.limit_in_bytes", limit)
    write(cgroup, "memory/process_api/abc/memory.usage_in_bytes", str(2 * GIB))
    memory = doctor.host_memory(proc, cgroup)
    assert memory["total_bytes"] == expected
    if expected < 64 * GIB:
        assert memory["source"] == f"cgroup {cgroup / 'memory/process_api/abc/memory.limit_in_bytes'}"
        assert memory["available_bytes"] == 10 * GIB
    else:
        assert memory["cgroup_limit_bytes"] is None


def test_nvidia_driver_first_line(tmp_path):
    assert doctor.nvidia_driver(tmp_path) is None
    write(tmp_path, "driver/nvidia/version", "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.65\nGCC version: 12\n")
    assert doctor.nvidia_driver(tmp_path) == "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.65"


def test_this_machine_reports_positive_memory_and_cpus():
    memory, cpus = doctor.host_memory(), doctor.cpu_count()
    assert memory["total_bytes"] > 0 and memory["total_bytes"] <= memory["meminfo_total_bytes"]
    assert 1 <= cpus["usable"] <= cpus["online"]
