"""The GPU half of ``poros doctor``: CUDA, the cards, bitsandbytes' kernels, pinned memory, the link,
and what a model needs -- and the rule table that turns what was found into named problems.

Three layers, so that the rules and the printing can be tested with made-up records:

* **probes** (:mod:`poros.doctor.gpu_probe`: :func:`~poros.doctor.gpu_probe.probe`, :func:`~poros.doctor.gpu_probe.model_fit`)
  import torch, bitsandbytes and the planner inside the function and return plain dicts
  (JSON-ready): ``torch``, ``devices``, ``bitsandbytes``, ``pinned``, ``bandwidth``, ``model``;
* **findings** (:func:`findings`) read those dicts only and name what they see, with the facts;
* **problems** (:func:`problems`) render each finding through :data:`RULES`, the table that says
  what it means and how to fix it, and whether it blocks training (a problem) or not (a note).

This module is torch-free (``poros doctor`` renders its problems on a core install too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from poros.spellings import human_bytes

#: GB/s per lane and direction of each PCIe generation, after line encoding (8b/10b up to Gen 2).
PCIE_LANE_GB_PER_S = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}
#: Below this share of the link's rate, pinned host->device copies are reported as slow.
SLOW_LINK_FRACTION = 0.5
#: Other processes holding more than this share of a card's memory is reported.
BUSY_DEVICE_FRACTION = 0.10
TORCH_INDEX = "https://download.pytorch.org/whl"


# =============================================================================================
# The rule table: finding -> problem and fix
# =============================================================================================
@dataclass(frozen=True)
class Rule:
    """What a finding means. ``problem`` and ``fix`` are ``str.format`` templates over its facts;
    ``blocks``: it stops a GPU training run (a problem), or only explains a number (a note)."""

    problem: str
    fix: str
    blocks: bool = True


RULES: dict[str, Rule] = {
    "torch_import_failed": Rule(
        "torch {torch} is installed but does not import: {error}",
        "reinstall it: pip install --force-reinstall torch=={torch_release} (a CUDA build: add --index-url "
        f"{TORCH_INDEX}/cuXYZ)"),
    "torch_cpu_build": Rule(
        "CUDA not available: torch {torch} is the CPU build, and this machine has an NVIDIA driver (CUDA {driver_cuda})",
        f"install a CUDA build: pip install torch=={{torch_release}} --index-url {TORCH_INDEX}/{{wheel_tag}} "
        "(or the newest cuXYZ at most your driver's CUDA {driver_cuda})"),
    "driver_too_old": Rule(
        "CUDA not available: torch {torch} is built for CUDA {runtime}; the driver supports CUDA {driver_cuda} at most",
        "upgrade the NVIDIA driver to one for CUDA {runtime} or newer, or install a torch built for your driver: "
        f"pip install torch=={{torch_release}} --index-url {TORCH_INDEX}/{{wheel_tag}}"),
    "cuda_unavailable": Rule(
        "CUDA not available: torch {torch} (CUDA {runtime}) finds no usable device although {where}",
        "check CUDA_VISIBLE_DEVICES ({visible}) and that the container was started with the GPU "
        "(docker run --gpus all); `nvidia-smi` must list it"),
    "no_cuda_device": Rule(
        "no CUDA device: torch {torch}, no NVIDIA driver loaded",
        "Poros trains on the CPU here (small models only); on a GPU machine install torch with CUDA", blocks=False),
    "arch_unsupported": Rule(
        "cuda:{index} {name} has compute capability {capability}; torch {torch} ships kernels for {arch_list}",
        "install a torch build with sm_{sm} kernels (a newer release or a newer CUDA: see "
        "https://pytorch.org/get-started/locally/)"),
    "bnb_import_failed": Rule(
        "bitsandbytes {version} does not import: {error}",
        "reinstall it: pip install --force-reinstall --no-deps bitsandbytes (or pip install 'poros-train[train]')"),
    "bnb_no_cuda_kernels": Rule(
        "bitsandbytes {version} loaded {library} on a CUDA machine: no CUDA kernels for CUDA {runtime}{error}",
        "install a bitsandbytes wheel built for CUDA {runtime} (pip install --force-reinstall bitsandbytes), or point "
        "BNB_CUDA_VERSION at one it ships"),
    "nf4_smoke_failed": Rule(
        "the NF4 smoke test on {device} failed: {detail}",
        "the NF4 kernels of bitsandbytes {version} do not agree with its CPU code on this card: report it with this "
        "block; try another bitsandbytes release"),
    "pinned_failed": Rule(
        "pinned allocation of {size} failed: {error} (locked-memory limit {memlock})",
        "raise the container's memlock limit (docker run --ulimit memlock=-1:-1; Kubernetes/Slurm: "
        "memlock unlimited in limits.conf) and check the RAM is free; streaming needs the base in pinned memory"),
    "device_memory_in_use": Rule(
        "cuda:{index} has {free} free of {total}: {used} is held by other processes",
        "stop them, or give a --vram-budget that fits the free memory", blocks=False),
    "link_slow": Rule(
        "pinned host->device copies reach {measured} GB/s, {percent}% of the PCIe Gen{gen} x{width} rate "
        "({theoretical} GB/s)",
        "streamed steps are bound by this link: check that the card sits in a x16 slot of the CPU it is near "
        "(nvidia-smi topo -m), and that nothing else copies", blocks=False),
    "model_not_planned": Rule(
        "--model {model} could not be planned: {error}",
        "--model takes a local checkpoint directory, the bundled poros-tiny-qwen3, or a hub id whose config.json is "
        "in the HF cache (hf download ID config.json); the planner needs the training packages"),
    "host_ram_short": Rule(
        "{model}: the NF4 base needs {needed} of host memory; {available} is available ({total} total)",
        "free host memory, or keep the blocks in the NF4 block cache on disk: --host-tier disk, or --host-budget X and the "
        "planner picks the tier (docs/cache-and-host-memory.md)"),
    "card_too_small": Rule(
        "{model} needs a VRAM budget of at least {minimum}; cuda:{index} has {total}",
        "a card with at least {minimum}, or a shorter --seq-len / smaller --batch-size"),
    "budget_below_minimum": Rule(
        "{model}: --vram-budget {budget} is below the minimum {minimum} for this run",
        "pass --vram-budget {minimum_flag} or more"),
}


def wheel_tag(cuda: str | None) -> str:
    """``"12.8"`` -> ``"cu128"``: the PyTorch wheel index for a CUDA version (``cuXYZ`` when unknown)."""
    if not cuda or "." not in cuda:
        return "cuXYZ"
    major, minor = cuda.split(".")[:2]
    return f"cu{major}{minor}"


def _version_tuple(version: str | None) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in (version or "").split(".")[:2])
    except ValueError:
        return ()


# =============================================================================================
# Findings: the reports -> named findings (pure; tests feed it made-up records)
# =============================================================================================
def findings(report: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """``(code, facts)`` for everything in ``report`` (the doctor's JSON) that :data:`RULES` names."""
    torch_info = report.get("torch")
    out = _torch_findings(report, torch_info) if torch_info else []
    return out + _model_findings(report.get("model") or {}, report.get("memory") or {})


def _torch_findings(report: dict[str, Any], torch_info: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = []
    facts = {"torch": torch_info.get("version"), "torch_release": (torch_info.get("version") or "").split("+")[0],
             "runtime": torch_info.get("cuda_runtime"), "driver_cuda": torch_info.get("driver_cuda"),
             "wheel_tag": wheel_tag(torch_info.get("driver_cuda"))}
    if torch_info.get("import_error"):
        return [("torch_import_failed", {**facts, "error": torch_info["import_error"]})]
    driver_loaded = bool(report.get("nvidia_driver") or torch_info.get("driver_cuda"))
    if not torch_info.get("cuda_available"):
        if not driver_loaded:
            out.append(("no_cuda_device", facts))
        elif torch_info.get("cuda_runtime") is None:
            out.append(("torch_cpu_build", facts))
        elif _version_tuple(facts["driver_cuda"]) and (
                _version_tuple(facts["driver_cuda"])[:1] < _version_tuple(facts["runtime"])[:1]):
            out.append(("driver_too_old", facts))
        else:
            where = f"the driver supports CUDA {facts['driver_cuda']}" if facts["driver_cuda"] else "a driver is loaded"
            out.append(("cuda_unavailable", {**facts, "where": where,
                                             "visible": torch_info.get("cuda_visible_devices") or "unset"}))
        return out
    arch_list = torch_info.get("arch_list") or []
    for device in report.get("devices") or []:
        major, minor = device["capability"]
        if arch_list and not arch_supported(major, minor, arch_list):
            out.append(("arch_unsupported", {**facts, "index": device["index"], "name": device["name"],
                                             "capability": f"{major}.{minor}", "sm": f"{major}{minor}",
                                             "arch_list": " ".join(arch_list)}))
        total, free = device.get("total_bytes"), device.get("free_bytes")
        if total and free is not None and (total - free) > BUSY_DEVICE_FRACTION * total:
            out.append(("device_memory_in_use", {"index": device["index"], "free": human_bytes(free), "total": human_bytes(total),
                                                 "used": human_bytes(total - free)}))
    out.extend(_bitsandbytes_findings(report.get("bitsandbytes") or {}, facts))
    pinned = report.get("pinned") or {}
    if pinned.get("ok") is False:
        out.append(("pinned_failed", {"size": human_bytes(pinned.get("requested_bytes")), "error": pinned.get("error"),
                                      "memlock": format_memlock(pinned.get("memlock_soft_bytes"))}))
    out.extend(_link_findings(report))
    return out


def arch_supported(major: int, minor: int, arch_list: list[str]) -> bool:
    """A card runs torch's kernels: its ``sm_XY`` is built, or a ``compute_XY`` PTX at most it (JIT)."""
    if f"sm_{major}{minor}" in arch_list:
        return True
    for arch in arch_list:
        kind, _, number = arch.partition("_")
        if kind == "compute" and number.isdigit() and int(number) <= major * 10 + minor:
            return True
    return False


def _bitsandbytes_findings(bnb: dict[str, Any], facts: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    if not bnb:
        return []
    if bnb.get("import_error"):
        return [("bnb_import_failed", {"version": bnb.get("version"), "error": bnb["import_error"]})]
    out = []
    if not bnb.get("cuda_kernels"):
        error = f" ({bnb['load_error']})" if bnb.get("load_error") else ""
        out.append(("bnb_no_cuda_kernels", {**facts, "version": bnb.get("version"),
                                            "library": bnb.get("library") or "no native library", "error": error}))
    smoke = bnb.get("smoke") or {}
    if smoke.get("ok") is False:
        out.append(("nf4_smoke_failed", {"version": bnb.get("version"), "device": smoke.get("device"),
                                         "detail": smoke.get("error") or smoke_summary(smoke)}))
    return out


def _link_findings(report: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    bandwidth = report.get("bandwidth") or {}
    measured = bandwidth.get("h2d_pinned_gb_per_s")
    devices = [d for d in report.get("devices") or [] if d["index"] == bandwidth.get("device_index")]
    if measured is None or not devices:
        return []
    pcie = devices[0].get("pcie") or {}
    gen, width = pcie.get("max_gen"), pcie.get("current_width") or pcie.get("max_width")
    if gen not in PCIE_LANE_GB_PER_S or not width:
        return []
    theoretical = PCIE_LANE_GB_PER_S[gen] * width
    if measured >= SLOW_LINK_FRACTION * theoretical:
        return []
    return [("link_slow", {"measured": f"{measured:.1f}", "percent": round(100 * measured / theoretical),
                           "gen": gen, "width": width, "theoretical": f"{theoretical:.0f}"})]


def _model_findings(model: dict[str, Any], memory: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    if not model:
        return []
    if model.get("error"):
        return [("model_not_planned", {"model": model["model"], "error": model["error"]})]
    out = []
    name, needed, available = model["model"], model["host_bytes"], memory.get("available_bytes")
    if available is not None and needed > available:
        out.append(("host_ram_short", {"model": name, "needed": human_bytes(needed), "available": human_bytes(available),
                                       "total": human_bytes(memory.get("total_bytes"))}))
    card = model.get("card") or {}
    if card and not card["fits"]:
        out.append(("card_too_small", {"model": name, "minimum": human_bytes(model["minimum_budget_bytes"]),
                                       "index": card["index"], "total": human_bytes(card["total_bytes"])}))
    if model.get("budget_source") == "--vram-budget" and model.get("plan") is None:
        out.append(("budget_below_minimum", {"model": name, "budget": human_bytes(model["budget_bytes"]),
                                             "minimum": human_bytes(model["minimum_budget_bytes"]),
                                             "minimum_flag": budget_flag(model["minimum_budget_bytes"])}))
    return out


def problems(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Every finding of ``report`` rendered through :data:`RULES`: ``{code, blocks, problem, fix}``."""
    out = []
    for code, facts in findings(report):
        rule = RULES[code]
        out.append({"code": code, "blocks": rule.blocks, "problem": rule.problem.format(**facts),
                    "fix": rule.fix.format(**facts)})
    return out


# =============================================================================================
# Printing: rows for the doctor's block
# =============================================================================================
def budget_flag(nbytes: int) -> str:
    """The smallest whole GiB at least ``nbytes``, as a ``--vram-budget`` value (``"9GiB"``)."""
    return f"{-(-nbytes // 2**30)}GiB"


def format_memlock(soft: int | None) -> str:
    return "unlimited" if soft is None else human_bytes(soft)


def smoke_summary(smoke: dict[str, Any]) -> str:
    return (f"codes equal to the CPU's {smoke['codes_equal_fraction']:.4%}, dequantized max |diff| "
            f"{smoke['dequant_max_abs_diff']:.2g}, matmul relative error {smoke['matmul_rel_error']:.2g} "
            f"(CPU {smoke['cpu_matmul_rel_error']:.2g})")


def pcie_text(pcie: dict[str, Any]) -> str:
    if not pcie:
        return "PCIe link not readable"
    text = f"PCIe Gen{pcie.get('current_gen', '?')} x{pcie.get('current_width', '?')}"
    if (pcie.get("max_gen"), pcie.get("max_width")) != (pcie.get("current_gen"), pcie.get("current_width")):
        text += f" now (max Gen{pcie.get('max_gen', '?')} x{pcie.get('max_width', '?')}; idle cards lower the speed)"
    return text + f" [{pcie.get('source')}]"


def format_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    """The doctor's rows for the torch/GPU part of ``report`` (labels and values; values may wrap)."""
    torch_info = report.get("torch")
    if not torch_info:
        return []
    if torch_info.get("import_error"):
        return [("torch", f"{torch_info['version']}: import failed")]
    rows = [("torch", f"{torch_info['version']}, CUDA runtime {torch_info['cuda_runtime'] or 'none (CPU build)'}, "
                      f"driver CUDA {torch_info['driver_cuda'] or 'none'}, cuda available "
                      f"{'yes' if torch_info['cuda_available'] else 'no'}")]
    if not torch_info["cuda_available"]:
        rows.append(("gpu", "no CUDA device"))
    for device in report.get("devices") or []:
        major, minor = device["capability"]
        peers = device.get("peers") or {}
        peer_text = ", ".join(f"cuda:{j} {link}" for j, link in peers.items()) or "none"
        rows.append((f"cuda:{device['index']}", f"{device['name']}, sm_{major}{minor}, {human_bytes(device['total_bytes'])} "
                                                f"total, {human_bytes(device['free_bytes'])} free; "
                                                f"{pcie_text(device.get('pcie') or {})}; peers: {peer_text}"))
    rows.append(("graphs", "CUDA graphs available: cuda_graphs: true replays layer-major's block phases (a run's "
                           "summary counts what ran eagerly and why)" if torch_info["cuda_available"]
                 else "off without a CUDA device (cuda_graphs has no effect; every block runs eagerly)"))
    bnb = report.get("bitsandbytes")
    if bnb:
        if bnb.get("import_error"):
            rows.append(("bitsandbytes", f"{bnb.get('version')}: import failed"))
        else:
            smoke = bnb.get("smoke") or {}
            smoke_text = (f"NF4 smoke test on {smoke['device']}: {'ok' if smoke['ok'] else 'FAILED'}"
                          + (f" ({smoke_summary(smoke)})" if "codes_equal_fraction" in smoke else
                             f" ({smoke['error']})" if smoke.get("error") else "")
                          if smoke.get("device") else "NF4 smoke test: not run (no CUDA device)")
            rows.append(("bitsandbytes", f"{bnb['version']}, library {bnb.get('library') or 'none'}; {smoke_text}"))
    pinned = report.get("pinned")
    if pinned:
        memlock = f"memlock limit {format_memlock(pinned.get('memlock_soft_bytes'))}"
        if pinned.get("ok") is None:
            rows.append(("pinned", f"not tested ({pinned.get('skipped')}); {memlock}"))
        else:
            result = (f"{human_bytes(pinned['requested_bytes'])} pinned in {pinned['seconds']:.2f} s" if pinned["ok"]
                      else f"{human_bytes(pinned['requested_bytes'])} FAILED: {pinned['error']}")
            rows.append(("pinned", f"{result}; {memlock}"))
    bandwidth = report.get("bandwidth")
    if bandwidth and bandwidth.get("skipped"):
        rows.append(("link", f"not measured ({bandwidth['skipped']})"))
    elif bandwidth:
        rows.append(("link", f"host->device {bandwidth['h2d_pinned_gb_per_s']:.1f} GB/s pinned, "
                             f"{bandwidth['h2d_pageable_gb_per_s']:.1f} pageable; device->host "
                             f"{bandwidth['d2h_pinned_gb_per_s']:.1f} pinned, {bandwidth['d2h_pageable_gb_per_s']:.1f} "
                             f"pageable ({bandwidth['bytes'] // 2**20} MiB copies, best of {bandwidth['repeats']}, cuda:"
                             f"{bandwidth['device_index']})"))
    rows.extend(format_model_rows(report.get("model")))
    return rows


def format_model_rows(model: dict[str, Any] | None) -> list[tuple[str, str]]:
    if not model:
        return []
    if model.get("error"):
        return [("model", f"{model['model']}: {model['error']}")]
    rows = [("model", f"{model['model']} ({model['family']}, {model['num_blocks']} blocks, {model['found_in']}); "
                      f"seq_len {model['seq_len']}, batch {model['batch_size']}, NF4"
                      f"{' + double quant' if model['double_quant'] else ''}, LoRA r{model['lora_rank']}"),
            ("host", f"{human_bytes(model['host_bytes'])} for the NF4 base on the host "
                     f"({human_bytes(model['available_host_bytes'])} available); less RAM: --host-tier disk / --host-budget")]
    vram = f"minimum budget {human_bytes(model['minimum_budget_bytes'])} ({budget_flag(model['minimum_budget_bytes'])})"
    plan = model.get("plan")
    if model.get("budget_bytes") is not None:
        vram += f"; at {human_bytes(model['budget_bytes'])} ({model['budget_source']}): "
        vram += (f"predicted peak {human_bytes(plan['peak_bytes'])} allocated, {human_bytes(plan['needed_bytes'])} with the CUDA "
                 f"context and allocator slack; {plan['resident_blocks']} of {model['num_blocks']} blocks resident, "
                 f"{plan['num_slots']} slot{'s' if plan['num_slots'] != 1 else ''}" if plan else "below the minimum")
    rows.append(("vram", vram))
    card = model.get("card")
    if card:
        rows.append(("fits", f"cuda:{card['index']} ({human_bytes(card['total_bytes'])}): "
                             f"{'yes' if card['fits'] else 'no'}"))
    rows.append(("suggested", " ".join(model["suggested_flags"])))
    return rows
