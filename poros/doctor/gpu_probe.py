"""The probes of ``poros doctor``'s GPU half: torch's build and the driver's CUDA, each visible card
(memory, PCIe link, peers), bitsandbytes' native library and an NF4 smoke test on the card, pinning
a few GiB and ``ulimit -l``, the host<->device bandwidth, and what the planner says for a model.

Each returns a plain, JSON-ready dict that :mod:`poros.doctor.diagnostics` reads (findings, rules,
printing). torch, bitsandbytes and the planner are imported inside the functions: ``poros doctor``
imports this module only where torch is installed.
"""

from __future__ import annotations

import ctypes
import os
import resource
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from poros.doctor.diagnostics import budget_flag

#: Host memory pinned by the pinning test, at most (and at most a quarter of the available RAM).
PIN_BYTES = 4 * 2**30
#: One copy of the bandwidth test.
COPY_BYTES = 512 * 2**20
COPY_REPEATS = 3
#: sysfs writes the link speed as GT/s per lane; the generation it means.
PCIE_GEN_OF_GT_PER_S = {"2.5": 1, "5.0": 2, "8.0": 3, "16.0": 4, "32.0": 5, "64.0": 6}


def driver_cuda_version() -> str | None:
    """The newest CUDA the loaded driver supports (``cuDriverGetVersion``), or ``None`` without libcuda."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    version = ctypes.c_int()
    if libcuda.cuDriverGetVersion(ctypes.byref(version)) != 0:
        return None
    return f"{version.value // 1000}.{version.value % 1000 // 10}"


def torch_report() -> dict[str, Any]:
    """torch's build, its CUDA runtime and the driver's CUDA; ``import_error`` when it does not import.

    Raises:
        ModuleNotFoundError: torch itself is not there.
    """
    try:
        import torch
    except ModuleNotFoundError as error:
        if (error.name or "").partition(".")[0] == "torch":
            raise  # absent: a core install in effect
        return _broken_torch(error)  # a dependency of torch is missing
    except Exception as error:  # noqa: BLE001  # a broken install: OSError, undefined symbols...
        return _broken_torch(error)
    available = torch.cuda.is_available()
    return {
        "version": torch.__version__, "cuda_runtime": torch.version.cuda, "driver_cuda": driver_cuda_version(),
        "cuda_available": available, "device_count": torch.cuda.device_count() if available else 0,
        "arch_list": torch.cuda.get_arch_list() if available else [],
        "cudnn": torch.backends.cudnn.version() if available and torch.backends.cudnn.is_available() else None,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }


def nvidia_smi_cards(runner=subprocess.run) -> list[dict[str, Any]]:
    """Each card as ``nvidia-smi --query-gpu`` lists it: its index there (PCI order, which need not be
    CUDA's), UUID, PCI bus id and PCIe link (``pcie``)."""
    if shutil.which("nvidia-smi") is None:
        return []
    fields = ("index,uuid,pci.bus_id,pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,"
              "pcie.link.width.max")
    try:
        result = runner(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                        capture_output=True, text=True, timeout=20, check=True)
    except (OSError, subprocess.SubprocessError):
        return []
    cards = []
    for line in result.stdout.splitlines():
        parts = [part.strip() for part in line.split(",")]
        if len(parts) != 7 or not parts[0].isdigit():
            continue
        values = [int(p) if p.isdigit() else None for p in parts[3:]]
        cards.append({"index": int(parts[0]), "uuid": normalise_uuid(parts[1]), "bus_id": normalise_bus_id(parts[2]),
                      "pcie": {"current_gen": values[0], "max_gen": values[1], "current_width": values[2],
                               "max_width": values[3], "source": "nvidia-smi"}})
    return cards


def normalise_uuid(uuid: str) -> str:
    """``"GPU-5a1c..."`` (nvidia-smi) and ``"5a1c..."`` (torch) -> ``"5a1c..."``."""
    return uuid.strip().lower().removeprefix("gpu-")


def normalise_bus_id(bus_id: str) -> str:
    """``"00000000:1B:00.0"`` (nvidia-smi) and ``"0000:1b:00.0"`` (sysfs) -> ``"0000:1b:00.0"``."""
    parts = bus_id.strip().lower().split(":")
    if len(parts) == 3:
        parts[0] = parts[0][-4:].rjust(4, "0")
    return ":".join(parts)


def sysfs_link(bus_id: str, root: Path = Path("/sys/bus/pci/devices")) -> dict[str, Any]:
    """PCIe link of ``bus_id`` from sysfs (``current_link_speed`` "32.0 GT/s PCIe", ``..._width``)."""
    directory = root / bus_id
    values = {}
    for key, name in (("current_gen", "current_link_speed"), ("max_gen", "max_link_speed"),
                      ("current_width", "current_link_width"), ("max_width", "max_link_width")):
        try:
            text = (directory / name).read_text().split()
        except OSError:
            return {}
        values[key] = PCIE_GEN_OF_GT_PER_S.get(text[0]) if key.endswith("gen") else (
            int(text[0]) if text and text[0].isdigit() else None)
    return {**values, "source": str(directory)}


def topology_links(runner=subprocess.run) -> dict[int, dict[int, str]]:
    """``nvidia-smi topo -m``'s GPU x GPU matrix: ``{i: {j: "NV18" | "PIX" | "SYS" ...}}``."""
    if shutil.which("nvidia-smi") is None:
        return {}
    try:
        text = runner(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return parse_topology(text)


def parse_topology(text: str) -> dict[int, dict[int, str]]:
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return {}
    header = lines[0].split()
    gpus = [name for name in header if name.startswith("GPU") and name[3:].isdigit()]
    out: dict[int, dict[int, str]] = {}
    for line in lines[1:]:
        cells = line.split()
        if not cells or cells[0] not in gpus:
            continue
        row = int(cells[0][3:])
        out[row] = {int(name[3:]): cell for name, cell in zip(gpus, cells[1:]) if int(name[3:]) != row}
    return out


def device_reports(torch_info: dict[str, Any]) -> list[dict[str, Any]]:
    """Each visible CUDA device: name, capability, total/free memory, PCIe link, peers."""
    if not torch_info.get("cuda_available"):
        return []
    import torch

    cards, topology = nvidia_smi_cards(), topology_links()
    count = torch.cuda.device_count()
    devices, smi_index = [], {}
    for index in range(count):
        props = torch.cuda.get_device_properties(index)
        free, total = torch.cuda.mem_get_info(index)
        bus_id = None
        if getattr(props, "pci_bus_id", None) is not None:
            bus_id = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        uuid = normalise_uuid(str(getattr(props, "uuid", "")))
        card = next((c for c in cards if (uuid and c["uuid"] == uuid) or (bus_id and c["bus_id"] == bus_id)), None)
        if card is not None:
            smi_index[index] = card["index"]
            bus_id = bus_id or card["bus_id"]
        pcie = card["pcie"] if card else sysfs_link(bus_id) if bus_id else {}
        devices.append({"index": index, "name": props.name, "capability": [props.major, props.minor],
                        "total_bytes": total, "free_bytes": free, "pci_bus_id": bus_id, "uuid": uuid or None,
                        "nvidia_smi_index": smi_index.get(index), "pcie": pcie, "peers": {},
                        "multiprocessors": props.multi_processor_count})
    for device in devices:  # peers, with the link nvidia-smi topo -m names (by its own indices)
        index = device["index"]
        for other in range(count):
            if other != index and torch.cuda.can_device_access_peer(index, other):
                link = topology.get(smi_index.get(index, -1), {}).get(smi_index.get(other, -1))
                device["peers"][other] = link or "peer access"
    return devices


def bitsandbytes_report(device: str | None) -> dict[str, Any] | None:
    """bitsandbytes' version, the native library it loaded, and the NF4 smoke test on ``device``."""
    import importlib.metadata

    try:
        version = importlib.metadata.version("bitsandbytes")
    except importlib.metadata.PackageNotFoundError:
        return None  # not installed: the doctor's package list says so
    try:
        import bitsandbytes.cextension as cextension
    except Exception as error:  # noqa: BLE001  # a broken install is the finding
        return {"version": version, "import_error": f"{type(error).__name__}: {error}"}
    native = cextension.lib
    load_error = getattr(native, "error_msg", None)  # set on the stand-in bitsandbytes uses when loading failed
    report = {"version": version, "backend": getattr(cextension, "BNB_BACKEND", None),
              "library": loaded_library("libbitsandbytes"),
              "cuda_kernels": bool(getattr(native, "compiled_with_cuda", False)),
              "load_error": load_error if isinstance(load_error, str) else None}
    report["smoke"] = nf4_smoke_test(device) if device else {"device": None}
    return report


def loaded_library(prefix: str, maps: Path = Path("/proc/self/maps")) -> str | None:
    """The path of the shared library whose file name starts with ``prefix`` mapped into this process."""
    try:
        lines = maps.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        path = line.split(maxsplit=5)[-1] if len(line.split()) >= 6 else ""
        if Path(path).name.startswith(prefix):
            return path
    return None


def nf4_smoke_test(device: str, *, rows: int = 256, columns: int = 512, seed: int = 0) -> dict[str, Any]:
    """Quantize a random bf16 weight to NF4 on ``device`` and on the CPU, dequantize, and multiply.

    ``ok`` when the codes agree with the CPU's (all but 0.1 %: a value on a code boundary may round
    either way), the absmax scales agree, and the device's 4-bit matmul is as close to the fp32
    product of its dequantized weight as the CPU's is (within bf16 rounding).
    """
    import torch

    try:
        import bitsandbytes
        import bitsandbytes.functional as functional

        generator = torch.Generator().manual_seed(seed)
        weight = torch.randn(rows, columns, generator=generator).to(torch.bfloat16)
        inputs = torch.randn(4, columns, generator=generator).to(torch.bfloat16)
        results = {}
        for where in ("cpu", device):
            codes, state = functional.quantize_4bit(weight.to(where), blocksize=64, quant_type="nf4")
            dequantized = functional.dequantize_4bit(codes, state)
            product = bitsandbytes.matmul_4bit(inputs.to(where), codes.t(), quant_state=state)
            reference = inputs.float() @ dequantized.float().cpu().t()
            error = ((product.float().cpu() - reference).abs().max() / reference.abs().max()).item()
            results[where] = (codes.cpu(), state.absmax.float().cpu(), dequantized.float().cpu(), error)
        cpu, dev = results["cpu"], results[device]
        smoke = {"device": device, "shape": [rows, columns],
                 "codes_equal_fraction": (cpu[0] == dev[0]).float().mean().item(),
                 "absmax_max_rel_diff": ((cpu[1] - dev[1]).abs() / cpu[1].abs()).max().item(),
                 "dequant_max_abs_diff": (cpu[2] - dev[2]).abs().max().item(),
                 "matmul_rel_error": dev[3], "cpu_matmul_rel_error": cpu[3]}
        smoke["ok"] = (smoke["codes_equal_fraction"] >= 0.999 and smoke["absmax_max_rel_diff"] <= 1e-5
                       and smoke["matmul_rel_error"] <= max(2 * cpu[3], 0.02))
        return smoke
    except Exception as error:  # noqa: BLE001  # a kernel that raises is what the test is for
        return {"device": device, "ok": False, "error": f"{type(error).__name__}: {str(error).splitlines()[0]}"}


def memlock_limit() -> tuple[int | None, int | None]:
    """``ulimit -l`` soft and hard, in bytes; ``None`` is unlimited."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return tuple(None if v == resource.RLIM_INFINITY else v for v in (soft, hard))  # type: ignore[return-value]


def pinned_report(on_cuda: bool, available_host_bytes: int | None) -> dict[str, Any]:
    """Whether ``cudaHostAlloc`` of a few GiB works (``torch.empty(pin_memory=True)``), and ``ulimit -l``."""
    soft, hard = memlock_limit()
    report: dict[str, Any] = {"memlock_soft_bytes": soft, "memlock_hard_bytes": hard, "ok": None}
    if not on_cuda:
        return {**report, "skipped": "no CUDA device"}
    import torch

    nbytes = PIN_BYTES if available_host_bytes is None else min(PIN_BYTES, available_host_bytes // 4 // 2**20 * 2**20)
    report["requested_bytes"] = nbytes
    began = time.perf_counter()
    try:
        buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        buffer[:: 2**20].fill_(1)  # touch it
        report.update(ok=bool(buffer.is_pinned()), seconds=time.perf_counter() - began, error=None)
        del buffer
    except RuntimeError as error:
        report.update(ok=False, seconds=time.perf_counter() - began, error=str(error).splitlines()[0])
    return report


def bandwidth_report(device_index: int, nbytes: int = COPY_BYTES, repeats: int = COPY_REPEATS) -> dict[str, Any]:
    """Best-of-``repeats`` GB/s (10^9 B/s) of host->device and device->host copies, pinned and pageable."""
    import torch

    device = torch.device("cuda", device_index)
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    hosts = {"pinned": torch.ones(nbytes, dtype=torch.uint8, pin_memory=True),
             "pageable": torch.ones(nbytes, dtype=torch.uint8)}
    report: dict[str, Any] = {"device_index": device_index, "bytes": nbytes, "repeats": repeats}
    for memory, host in hosts.items():
        for direction, (target, source) in (("h2d", (on_device, host)), ("d2h", (host, on_device))):
            best = float("inf")
            for attempt in range(repeats + 1):  # the first copy warms up
                torch.cuda.synchronize(device)
                began = time.perf_counter()
                target.copy_(source, non_blocking=memory == "pinned")
                torch.cuda.synchronize(device)
                if attempt:
                    best = min(best, time.perf_counter() - began)
            report[f"{direction}_{memory}_gb_per_s"] = nbytes / best / 1e9
    return report


def _broken_torch(error: BaseException) -> dict[str, Any]:
    import importlib.metadata

    return {"version": importlib.metadata.version("torch"), "import_error": f"{type(error).__name__}: {error}",
            "cuda_runtime": None, "driver_cuda": driver_cuda_version()}


def probe(*, quick: bool, available_host_bytes: int | None) -> dict[str, Any]:
    """The GPU part of the doctor's report: ``torch``, ``devices``, ``bitsandbytes``, ``pinned``, ``bandwidth``.

    Raises:
        ModuleNotFoundError: torch is not importable (a core install): the doctor leaves the part out.
    """
    torch_info = torch_report()
    if torch_info.get("import_error"):
        return {"torch": torch_info}
    on_cuda = torch_info["cuda_available"]
    devices = device_reports(torch_info)
    out: dict[str, Any] = {"torch": torch_info, "devices": devices}
    out["bitsandbytes"] = bitsandbytes_report("cuda:0" if on_cuda else None)
    out["pinned"] = pinned_report(on_cuda, available_host_bytes)
    if not on_cuda:
        out["bandwidth"] = {"skipped": "no CUDA device"}
    elif quick:
        out["bandwidth"] = {"skipped": "--quick"}
    else:
        out["bandwidth"] = bandwidth_report(0)
    return out


def model_fit(model: str, *, vram_budget: str | None, devices: list[dict[str, Any]],
              available_host_bytes: int | None) -> dict[str, Any]:
    """What the planner says for ``model`` on this machine, from its ``config.json`` only (as
    ``poros plan`` / ``poros train --dry-run``): planned as a CUDA run with the embeddings on the
    host, at the config's defaults (seq_len, batch, LoRA). The budget is ``vram_budget``, else the
    first card's total memory, else none (the minimum only)."""
    from poros.config import PorosConfig, parse_budget
    from poros.errors import PorosError
    from poros.plan import budget as planner
    from poros.plan.entry import plan_config, workload_of
    from poros.plan.run_plan import plan_run

    try:
        config = PorosConfig().apply_overrides(["--model", model, "--device", "cuda", "--embeddings-on-host", "true"])
        plan = plan_run(config)
    except PorosError as error:
        return {"model": model, "error": f"{type(error).__name__}: {error}"}
    footprint = plan.footprint()  # the step as poros plan prices it: loss_chunks and packing included
    minimum = planner.minimum_budget(footprint, workload_of(config), embeddings_on_host=True,
                                     context_bytes=planner.CUDA_CONTEXT_BYTES, optimizer_states=config.optimizer_states,
                                     lora_placement=config.lora_placement)
    card = devices[0] if devices else None
    budget, source = None, None
    if vram_budget is not None:
        budget, source = parse_budget(vram_budget), "--vram-budget"
    elif card is not None:
        budget, source = card["total_bytes"], f"cuda:{card['index']} total"
    budget_plan = None
    if budget is not None and budget >= minimum:
        try:
            _, result = plan_config(config, footprint, vram_budget=budget, device="cuda")  # as poros plan plans it
            budget_plan = {"peak_bytes": result.peak.total, "needed_bytes": result.needed_bytes,
                           "resident_blocks": len(result.resident_blocks), "num_slots": result.num_slots,
                           "boundary_states": result.boundary_states,
                           "copy_bytes_per_step": result.copy_bytes_per_step, "notes": list(result.notes)}
        except PorosError:  # refused at the minimum itself: reported as below the minimum
            pass
    host_bytes = plan.host_store_bytes + plan.host_embedding_bytes
    whole_gib = f"{budget // 2**30}GiB" if budget is not None and budget // 2**30 * 2**30 >= minimum else None
    flag = (vram_budget or whole_gib) if budget_plan else None
    suggested = ["poros", "train", "--model", model, "--vram-budget", flag or budget_flag(minimum)]
    return {
        "model": model, "checkpoint": plan.checkpoint, "found_in": plan.found_in, "family": plan.family,
        "num_blocks": plan.num_blocks, "seq_len": config.seq_len, "batch_size": config.batch_size,
        "double_quant": config.double_quant, "lora_rank": config.lora_rank,
        "host_bytes": host_bytes, "available_host_bytes": available_host_bytes,
        "minimum_budget_bytes": minimum, "budget_bytes": budget, "budget_source": source, "plan": budget_plan,
        "card": ({"index": card["index"], "total_bytes": card["total_bytes"], "free_bytes": card["free_bytes"],
                  "fits": minimum <= card["total_bytes"]} if card else None),
        "suggested_flags": suggested,
    }
