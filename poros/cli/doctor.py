"""``poros doctor``: what this machine and install look like, as a block to paste into a bug report.

The host part is torch-free on purpose: package versions come from ``importlib.metadata`` (nothing
is imported), host memory from ``/proc/meminfo`` and the cgroup limits, so the doctor runs where
torch is missing or broken -- the very machines that need it. Where torch is installed, the GPU
part follows (:mod:`poros.doctor.gpu_probe`, imported inside :func:`gpu_report`): CUDA, the cards,
bitsandbytes' kernels, pinned memory, the link, and with ``--model`` what the planner says; every
finding that blocks training becomes a named problem with its fix (:data:`poros.doctor.diagnostics.RULES`).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import sys
import textwrap
from pathlib import Path
from typing import Any

from poros.cli.output import print_json

from poros.packages import INSTALL_HINT, OPTIONAL_PACKAGES, TRAIN_PACKAGES, installed_version  # noqa: F401
from poros.spellings import human_bytes

DESCRIPTION = """\
Print what Poros needs to know about this machine, in a ```text block ready to paste into an
issue: Python and platform, the installed versions of torch, transformers, peft, bitsandbytes,
safetensors, datasets and accelerate (read from package metadata), host memory (the smaller of
/proc/meminfo MemTotal and the cgroup memory limit, and which one it is), usable CPUs, and plugins
that failed to load or register.

Where torch is installed it also reports: the torch build and its CUDA runtime against the
driver's CUDA; each visible card (name, compute capability, total and free memory, PCIe link,
NVLink peers); the native library bitsandbytes loaded and an NF4 quantize -> matmul -> dequantize
smoke test on the card compared with the CPU; whether pinning a few GiB of host memory works, and
the locked-memory limit (ulimit -l); the measured host<->device bandwidth, pinned and pageable
(--quick skips it). With --model, what the planner says for that model on this machine: the NF4
base's host bytes against free RAM, the minimum VRAM budget, the predicted peak, whether the card
fits, and the flags to train with.

Every finding that blocks training is a named problem with its fix; findings that only explain a
number are notes. Exit status 1 when a plugin problem or a blocking problem was found; missing
training packages are reported with the command that installs them, and are not an error (a
torch-free install is a valid install).
"""

EPILOG = textwrap.dedent("""\
    examples:
      $ poros doctor                     # everything, with the pinning and bandwidth tests
      $ poros doctor --quick             # no bandwidth measurement
      $ poros doctor --model Qwen/Qwen2.5-32B --vram-budget 24GiB   # + the planner (config.json only)
      $ poros doctor --model ./my-checkpoint --json

      On a CPU machine with the training packages:
      ```text
      poros          0.1.0 (/work/main/poros)
      ...
      plugins        5 loaded, families: qwen2, qwen3, qwen3_5, gemma3, gemma4
      torch          2.13.0+cpu, CUDA runtime none (CPU build), driver CUDA none, cuda available no
      gpu            no CUDA device
      bitsandbytes   0.50.2, library .../bitsandbytes/libbitsandbytes_cpu.so; NF4 smoke test: not
                     run (no CUDA device)
      pinned         not tested (no CUDA device); memlock limit 8.0 MiB
      link           not measured (no CUDA device)
      notes          [no_cuda_device] no CUDA device: torch 2.13.0+cpu, no NVIDIA driver loaded;
                     Poros trains on the CPU here (small models only); on a GPU machine install
                     torch with CUDA
      problems       none
      ```

      $ poros doctor --json | python -c "import json, sys; print(json.load(sys.stdin)['memory'])"
      {'total_bytes': 25276510208, 'source': '/proc/meminfo MemTotal', 'available_bytes': 23961403392,
       'meminfo_total_bytes': 25276510208, 'cgroup_limit_bytes': None, 'cgroup_limit_source': None}
    """)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "doctor",
        help="report versions, host memory, plugins, CUDA, the cards, bitsandbytes, the link (paste-ready)",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--quick", action="store_true",
                        help="skip the host<->device bandwidth measurement")
    parser.add_argument("--model", metavar="ID_OR_DIR",
                        help="also say what the planner needs for this model on this machine (its config.json only: "
                             "a local directory, a bundled model or an HF id whose config is cached)")
    parser.add_argument("--vram-budget", metavar="SIZE",
                        help="plan --model for this budget (e.g. 24GiB) instead of the first card's memory")
    parser.add_argument("--disk", action="store_true",
                        help="also measure the sequential read rate of the NF4 block cache's drive (writes, reads "
                             "and removes a 256 MiB file; the disk host tier streams at this rate)")
    parser.set_defaults(run=run)
    return parser


# -- host memory ----------------------------------------------------------------------------

def read_meminfo(proc_root: Path = Path("/proc")) -> dict[str, int]:
    """``/proc/meminfo`` as bytes per field (``MemTotal``, ``MemAvailable``...); empty if unreadable."""
    try:
        text = (proc_root / "meminfo").read_text()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        parts = value.split()
        if parts and parts[0].isdigit():
            out[key.strip()] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


def cgroup_memory_limit(
    proc_root: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")
) -> dict[str, Any] | None:
    """The tightest memory limit on this process's cgroup and its ancestors, v2 or v1.

    Reads ``/proc/self/cgroup`` for the process's cgroup paths, then ``memory.max`` (v2, mounted
    at ``cgroup_root`` or ``cgroup_root/unified``) and ``memory.limit_in_bytes`` (v1, under
    ``cgroup_root/memory``) from that cgroup up to the mount root. Returns
    ``{"limit_bytes", "source", "usage_bytes"}`` or ``None`` when no finite limit is set.
    """
    try:
        lines = (proc_root / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    candidates = []  # (mount, path inside it, limit file, usage file)
    for line in lines:
        fields = line.split(":", 2)  # hierarchy id : controllers : path
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "":
            for mount in (cgroup_root, cgroup_root / "unified"):
                if (mount / "cgroup.controllers").exists():
                    candidates.append((mount, path, "memory.max", "memory.current"))
                    break
        elif "memory" in controllers.split(","):
            candidates.append((cgroup_root / "memory", path, "memory.limit_in_bytes", "memory.usage_in_bytes"))
    best = None
    for mount, path, limit_file, usage_file in candidates:
        leaf = Path(os.path.normpath(mount / path.lstrip("/")))
        if not leaf.is_relative_to(mount) or not leaf.is_dir():
            leaf = mount  # a path from another cgroup namespace: only the mount root is ours
        usage = _read_int(leaf / usage_file)
        for directory in (leaf, *leaf.parents):
            limit = _read_int(directory / limit_file)
            if limit is not None and (best is None or limit < best["limit_bytes"]):
                best = {"limit_bytes": limit, "source": str(directory / limit_file), "usage_bytes": usage}
            if directory == mount:
                break
    return best


#: cgroup v1 writes "no limit" as a page-aligned 2**63 - 1; anything from 1 EiB up means the same.
NO_LIMIT_BYTES = 2**60


def _read_int(path: Path) -> int | None:
    """Integer content of a cgroup file; ``None`` for a missing file and for no limit (``max``, v1's 2**63)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and int(text) < NO_LIMIT_BYTES else None


def host_memory(proc_root: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> dict[str, Any]:
    """Memory this process can use: the smaller of MemTotal and the cgroup limit, and where it came from.

    ``available_bytes`` is MemAvailable, lowered to ``limit - usage`` when the cgroup limit binds.
    Streaming keeps the whole NF4 base in host memory, so this is the number that decides the
    largest model a machine can train.
    """
    meminfo = read_meminfo(proc_root)
    total, available = meminfo.get("MemTotal"), meminfo.get("MemAvailable")
    cgroup = cgroup_memory_limit(proc_root, cgroup_root)
    report: dict[str, Any] = {
        "total_bytes": total,
        "source": f"{proc_root / 'meminfo'} MemTotal" if total is not None else "unknown",
        "available_bytes": available,
        "meminfo_total_bytes": total,
        "cgroup_limit_bytes": cgroup["limit_bytes"] if cgroup else None,
        "cgroup_limit_source": cgroup["source"] if cgroup else None,
    }
    if cgroup and (total is None or cgroup["limit_bytes"] < total):
        report["total_bytes"] = cgroup["limit_bytes"]
        report["source"] = f"cgroup {cgroup['source']}"
        if cgroup["usage_bytes"] is not None:
            headroom = max(cgroup["limit_bytes"] - cgroup["usage_bytes"], 0)
            report["available_bytes"] = headroom if available is None else min(available, headroom)
    return report


def cpu_count() -> dict[str, Any]:
    try:
        usable, source = len(os.sched_getaffinity(0)), "sched_getaffinity"
    except (AttributeError, OSError):  # not on Linux
        usable, source = os.cpu_count(), "os.cpu_count"
    return {"usable": usable, "source": source, "online": os.cpu_count()}


def nvidia_driver(proc_root: Path = Path("/proc")) -> str | None:
    """First line of ``/proc/driver/nvidia/version`` (the kernel driver), or ``None``."""
    try:
        return (proc_root / "driver" / "nvidia" / "version").read_text().splitlines()[0].strip()
    except (OSError, IndexError):
        return None


# -- plugins --------------------------------------------------------------------------------

def plugin_report() -> dict[str, Any]:
    """Loaded plugins, registered families, and every problem loading or registering them."""
    from poros import registry
    from poros.errors import PorosError

    reg = registry.registry()
    problems = []
    try:
        reg.load_plugins()
    except PorosError as exc:
        problems.append(f"{type(exc).__name__}: {exc}")
    try:  # load_plugins checks once per process; check again so the doctor always sees it
        reg.check_pending()
    except PorosError as exc:
        problems.append(f"{type(exc).__name__}: {exc}")
    try:
        families = [r.descriptor.name for r in registry.architectures()]
    except PorosError as exc:
        families = []
        problems.append(f"{type(exc).__name__}: {exc}")
    return {
        "loaded": [name for name, _ in reg.plugin_manager.list_name_plugin()],
        "families": families,
        "load_errors": [{"plugin": name, "error": error} for name, error in reg.load_errors],
        "problems": list(dict.fromkeys(problems)),
        registry.LOAD_PLUGINS_ENV: os.environ.get(registry.LOAD_PLUGINS_ENV),
    }


# -- the report -----------------------------------------------------------------------------

def report() -> dict[str, Any]:
    import poros

    packages = {name: installed_version(name) for name in (*TRAIN_PACKAGES, *OPTIONAL_PACKAGES)}
    missing = [name for name in TRAIN_PACKAGES if packages[name] is None]
    return {
        "poros": {"version": poros.__version__, "location": str(Path(poros.__file__).parent)},
        "python": {
            "version": platform.python_version(),
            "implementation": platform.python_implementation(),
            "executable": sys.executable,
        },
        "platform": {"platform": platform.platform(), "machine": platform.machine(), "system": platform.system()},
        "cpus": cpu_count(),
        "memory": host_memory(),
        "nvidia_driver": nvidia_driver(),
        "packages": packages,
        "missing_train_packages": missing,
        "install_hint": INSTALL_HINT if missing else None,
        "plugins": plugin_report(),
    }


def gpu_report(data: dict[str, Any], *, quick: bool = False, model: str | None = None,
               vram_budget: str | None = None) -> dict[str, Any]:
    """The torch part of the report (:mod:`poros.doctor.gpu_probe`: CUDA, cards, bitsandbytes, pinning, the
    link, ``--model``) and ``problems``, its named findings (:mod:`poros.doctor.diagnostics`). Where torch is
    not installed, only ``problems`` (and ``model``'s error when one was asked for)."""
    from poros.doctor import diagnostics
    from poros.doctor import gpu_probe

    available = data["memory"]["available_bytes"]
    part: dict[str, Any] = {}
    if data["packages"]["torch"] is not None:
        try:
            part = gpu_probe.probe(quick=quick, available_host_bytes=available)
        except ModuleNotFoundError as error:  # metadata without the module: a core install in effect
            part = {"torch_skipped": f"torch is not importable ({error})"}
    if model is not None:
        if part.get("torch") and "import_error" not in part["torch"]:
            part["model"] = gpu_probe.model_fit(model, vram_budget=vram_budget, devices=part.get("devices") or [],
                                                available_host_bytes=available)
        else:
            part["model"] = {"model": model, "error": f"--model needs torch and the planner: {INSTALL_HINT}"}
    part["problems"] = diagnostics.problems({**data, **part})
    return part


def format_report(data: dict[str, Any]) -> str:
    """The report as the paste-ready ```text block."""
    memory, cpus, plugins = data["memory"], data["cpus"], data["plugins"]
    memory_line = f"{human_bytes(memory['total_bytes'])} total ({memory['source']}), {human_bytes(memory['available_bytes'])} available"
    if memory["source"].startswith("cgroup"):
        memory_line += f"; host MemTotal {human_bytes(memory['meminfo_total_bytes'])}"
    packages = [f"{name} {version or 'not installed'}" for name, version in data["packages"].items()]
    plugin_line = f"{len(plugins['loaded'])} loaded, families: {', '.join(plugins['families']) or 'none'}"
    env_setting = plugins["POROS_LOAD_PLUGINS"]
    if env_setting is not None:
        plugin_line += f" (POROS_LOAD_PLUGINS={env_setting!r})"
    problems = [*plugins["problems"], *(f"plugin {e['plugin']} failed to load: {e['error']}" for e in plugins["load_errors"])]
    named = data.get("problems") or []
    problems += [f"[{p['code']}] {p['problem']}; fix: {p['fix']}" for p in named if p["blocks"]]
    notes = [f"[{p['code']}] {p['problem']}; {p['fix']}" for p in named if not p["blocks"]]
    if data["missing_train_packages"]:
        problems.append(
            f"not installed for training: {', '.join(data['missing_train_packages'])}; install with "
            f"{data['install_hint']} (add torch==<version> to choose the torch build)"
        )
    rows = [
        ("poros", f"{data['poros']['version']} ({data['poros']['location']})"),
        ("python", f"{data['python']['version']} {data['python']['implementation']} ({data['python']['executable']})"),
        ("platform", f"{data['platform']['platform']} ({data['platform']['machine']})"),
        ("cpus", f"{cpus['usable']} usable ({cpus['source']}), {cpus['online']} online"),
        ("memory", memory_line),
        ("nvidia driver", data["nvidia_driver"] or "none (/proc/driver/nvidia/version absent)"),
        ("packages", _wrap(", ".join(packages))),
        ("plugins", plugin_line),
        *((label, _wrap(value)) for label, value in _gpu_rows(data)),
        *([("notes", "\n".join(_wrap(note) for note in notes))] if notes else []),
        ("problems", "\n".join(_wrap(problem) for problem in problems) or "none"),
    ]
    width = max(len(label) for label, _ in rows) + 2
    lines = []
    for label, value in rows:
        first, *rest = value.splitlines()
        lines.append(label.ljust(width) + first)
        lines.extend(" " * width + line for line in rest)
    return "```text\n" + "\n".join(lines) + "\n```"


def _gpu_rows(data: dict[str, Any]) -> list[tuple[str, str]]:
    if not data.get("torch") and not data.get("model"):
        return []
    from poros.doctor import diagnostics

    return diagnostics.format_rows(data)


def _wrap(text: str) -> str:
    return "\n".join(textwrap.wrap(text, width=80, break_on_hyphens=False))


def run(args: argparse.Namespace) -> int:
    if args.vram_budget is not None and args.model is None:
        from poros.errors import ConfigError

        raise ConfigError(f"--vram-budget {args.vram_budget} plans a model: add --model ID_OR_DIR (e.g. --model "
                          "Qwen/Qwen2.5-32B), or leave --vram-budget out.")
    from poros.noise import quiet_known_noise

    quiet_known_noise()  # bitsandbytes' kernels-community notice, printed as the GPU part imports it
    data = report()
    data.update(gpu_report(data, quick=args.quick, model=args.model, vram_budget=args.vram_budget))
    if getattr(args, "disk", False):  # the disk host tier's drive (poros.plan.host_tiers)
        from poros.loading.cache import cache_root
        from poros.plan.host_tiers import measure_disk_read

        data["disk_read"] = measure_disk_read(cache_root())
    if args.json:
        print_json(data)
    else:
        print(format_report(data))
        if "disk_read" in data:
            disk = data["disk_read"]
            print(f"disk read: {disk['gb_per_s']:.2f} GB/s sequential ({'O_DIRECT' if disk['direct'] else 'buffered'}, "
                  f"{disk['bytes'] >> 20} MiB) under {disk['path']}")
    return exit_status(data)


def exit_status(data: dict[str, Any]) -> int:
    """1 when a plugin problem or a problem that blocks training was found (notes do not count), else 0."""
    plugins = data["plugins"]
    blocking = [problem for problem in data.get("problems", []) if problem["blocks"]]
    return 1 if plugins["problems"] or plugins["load_errors"] or blocking else 0
