#!/usr/bin/env python3
"""Can this host page-lock a mapped block file for DMA, and how fast? (the mapped tier's question)

The mapped host tier (``poros/stream/tiers.py``) once streamed from a copy-on-write mapping of the NF4
block cache entry, and on the H200 host a run with it stopped answering. This probe takes the steps
one at a time, each in a child process with its own time limit, so a step that hangs is named
instead of eating the run. Its answer on the H200 (2026-12-01, commit 6183630,
``registry/results/h200-2026-12-01/host-register.json``): the tier's sequence hung with the
copy-on-write mapping and its pages dropped, and ran with the shared read-only mapping the tier uses
since 3c9fe55 (its times: docs/results-h200.md). The cases:

1. write a ``--mib`` file, map it as ``BlockFile.mapping`` does (MAP_PRIVATE, read/write);
2. ``cudaHostRegister`` read-only, then (new child) with flags 0, then (new child) a MAP_SHARED
   read-only mapping registered read-only; each: seconds, error code, a copy to the device and
   its GB/s.
3. the mapped tier's own sequence, which the three cases above do not repeat (they passed on the
   H200 while the tier hung): CUDA and torch's pinned host allocator in use first, the mapping as a
   torch tensor (``torch.frombuffer``), registered read-only, then block-sized views copied on a side
   stream with ``non_blocking`` and an event per copy, as the block store fetches; with the tier's
   shared read-only mapping, its pages in the page cache and dropped from it
   (``posix_fadvise(DONTNEED)``), and with the copy-on-write mapping the tier used when it hung.

    python -m tools.host_register_probe --mib 512 --json out/host-register.json
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES = {  # name -> (mapping kind, cudaHostRegister flags, how)
    "private_readonly_flag": ("private", 8, "plain"),  # cudaHostRegisterReadOnly
    "private_default_flag": ("private", 0, "plain"),
    "shared_readonly_flag": ("shared", 8, "plain"),
    "tier_sequence_cached": ("shared", 8, "tier"),  # the mapped tier since 3c9fe55: shared, read-only
    "tier_sequence_cold": ("shared", 8, "tier-cold"),
    "private_tier_sequence_cold": ("private", 8, "tier-cold"),  # the tier that hung (copy-on-write mapping)
}
BLOCK_MIB = 64  # the size of the views the tier sequence copies, one after another


def tier_sequence(path: str, kind: str, flags: int, cold: bool) -> dict:
    """What MappedTier.attach and BlockStore.fetch do, in that order, timed step by step."""
    import warnings

    import torch

    steps: dict[str, float] = {}
    began = time.perf_counter()
    torch.cuda.init()
    scratch = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)  # the caching host allocator in use
    slot = torch.empty(BLOCK_MIB << 20, dtype=torch.uint8, device="cuda")
    slot.copy_(scratch[: slot.numel()], non_blocking=True)
    torch.cuda.synchronize()
    steps["torch_ready_s"] = time.perf_counter() - began
    if cold:
        with open(path, "rb") as handle:
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    with open(path, "rb") as handle:
        if kind == "shared":
            mapped = mmap.mmap(handle.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        else:
            mapped = mmap.mmap(handle.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a read-only buffer: torch warns, and copies from it fine
        host = torch.frombuffer(mapped, dtype=torch.uint8)
    cudart = torch.cuda.cudart()
    began = time.perf_counter()
    error = int(cudart.cudaHostRegister(host.data_ptr(), host.numel(), flags))
    steps["register_s"] = time.perf_counter() - began
    out: dict = {"register_error": error, "pinned_per_torch": bool(host.is_pinned()) if error == 0 else None}
    stream, block = torch.cuda.Stream(), BLOCK_MIB << 20
    began = time.perf_counter()
    copied = 0
    for offset in range(0, host.numel() - block + 1, block):
        with torch.cuda.stream(stream):
            slot.copy_(host[offset: offset + block], non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        done.synchronize()
        copied += block
    steps["copies_s"] = time.perf_counter() - began
    out["h2d_gb_per_s"] = round(copied / steps["copies_s"] / 1e9, 2) if copied else None
    if error == 0:
        out["unregister_error"] = int(cudart.cudaHostUnregister(host.data_ptr()))
    out.update({name: round(value, 3) for name, value in steps.items()})
    return out


def child(path: str, kind: str, flags: int, how: str = "plain") -> dict:
    if how != "plain":
        return tier_sequence(path, kind, flags, cold=how == "tier-cold")
    import warnings

    import numpy
    import torch

    with open(path, "rb") as handle:
        if kind == "shared":
            mapped = mmap.mmap(handle.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        else:
            mapped = mmap.mmap(handle.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    array = numpy.frombuffer(mapped, dtype=numpy.uint8)
    pointer, size = array.ctypes.data, array.size
    cudart = torch.cuda.cudart()
    torch.cuda.init()
    began = time.perf_counter()
    error = int(cudart.cudaHostRegister(pointer, size, flags))
    out = {"register_error": error, "register_s": round(time.perf_counter() - began, 3)}
    if error == 0:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a read-only mapping: torch warns, and copies it fine
            host = torch.from_numpy(array)
        device = torch.empty(size, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        began = time.perf_counter()
        device.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        out["h2d_gb_per_s"] = round(size / (time.perf_counter() - began) / 1e9, 2)
        out["unregister_error"] = int(cudart.cudaHostUnregister(pointer))
    return out


def _environment() -> dict:
    """Device, torch, date and commit, without initializing CUDA in this process (the cases do, each in a child)."""
    import datetime
    import shutil

    import torch

    from tools.bench.provenance import git_commit

    device = None
    if shutil.which("nvidia-smi"):
        try:
            done = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                  capture_output=True, text=True, timeout=30)
            device = done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else None
        except (OSError, subprocess.TimeoutExpired):
            device = None  # the cases still run; only the record lacks the name
    return {"device": device, "torch_build": torch.__version__, "cuda": torch.version.cuda,
            "date": datetime.date.today().isoformat(), "commit": git_commit()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--dir", default=None, help="where the file goes (default: $TMPDIR or /tmp)")
    parser.add_argument("--timeout", type=float, default=40.0, help="seconds per case")
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", nargs=4, metavar=("PATH", "KIND", "FLAGS", "HOW"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], int(args.child[2]), args.child[3])))
        return 0
    directory = args.dir or os.environ.get("TMPDIR", "/tmp")
    report = {"tool": "host_register_probe", "environment": _environment(), "mib": args.mib, "dir": directory,
              "filesystem": _filesystem(directory), "cases": {}}
    with tempfile.NamedTemporaryFile(dir=directory, suffix=".bin") as handle:
        chunk = os.urandom(1 << 20)
        for _ in range(args.mib):
            handle.write(chunk)
        handle.flush()
        os.fsync(handle.fileno())
        for name, (kind, flags, how) in CASES.items():
            began = time.perf_counter()
            child_process = subprocess.Popen([sys.executable, "-m", "tools.host_register_probe", "--child",
                                              handle.name, kind, str(flags), how],
                                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                stdout, stderr = child_process.communicate(timeout=args.timeout)
                lines = stdout.strip().splitlines()
                result = json.loads(lines[-1]) if child_process.returncode == 0 and lines else \
                    {"error": (stderr.strip().splitlines() or ["?"])[-1][:300], "returncode": child_process.returncode}
            except subprocess.TimeoutExpired:
                # A child stuck in the driver (pinning pages) may not die at once: never wait on it unbounded.
                child_process.kill()
                try:
                    child_process.wait(timeout=5)
                    result = {"error": f"no answer within {args.timeout:.0f} s (hung; killed)"}
                except subprocess.TimeoutExpired:
                    result = {"error": f"no answer within {args.timeout:.0f} s (hung; could not be killed)"}
            result["wall_s"] = round(time.perf_counter() - began, 2)
            report["cases"][name] = result
            print(f"host_register_probe: {name}: {result}", file=sys.stderr, flush=True)
    text = json.dumps(report, indent=1)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    print(text)
    return 0


def _filesystem(directory: str) -> str | None:
    try:
        found = subprocess.run(["df", "-T", directory], capture_output=True, text=True, timeout=5).stdout.splitlines()
        return found[-1].split()[1] if len(found) > 1 else None
    except (OSError, subprocess.SubprocessError):
        return None


if __name__ == "__main__":
    sys.exit(main())
