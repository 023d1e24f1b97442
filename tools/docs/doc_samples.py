"""The sample outputs in docs/ come from running their commands: ``python -m tools.docs.doc_samples`` runs each
sample's command and writes its output into its page; ``--check`` runs them and exits 1 where a page's sample
no longer matches, beyond the numbers that legitimately vary.

A sample is a fenced block between markers that name it::

    <!-- BEGIN SAMPLE: dry-run -->
    ```
    $ poros train --dry-run
    poros train --dry-run: the configuration is valid (all defaults)
    ...
    ```
    <!-- END SAMPLE: dry-run -->

:data:`SAMPLES` says what each runs (``poros`` in-process is not used: a fresh ``python -m poros`` in an
empty directory, stdout and stderr as a piped terminal shows them, with none of the variables a test sets). Paths are written as ``.../`` below the checkout and the temporary
directory. **What varies** (:data:`VARYING`: wall times, rates, memory measured, this machine's
versions and paths, and the values a training run prints: a CPU run is deterministic on one machine, but
torch's CPU kernels for AVX-512 and for AVX2 sum in other orders, so its losses differ in the third digit from
one instruction set to the other) is replaced by ``<varies>`` before two outputs are compared; every other
character must match (the training samples' tests check that the loss falls). ``cost`` marks the samples that train:
``tests/test_doc_samples.py`` reruns the cheap ones; the training samples are compared by the tests that
already run those commands (``tests/test_cli_train.py``) or regenerated here.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


@dataclass(frozen=True)
class Sample:
    """One sample: its ``page`` under docs/, the ``command`` (``poros ...``), whether it ``trains``, the variables
    ``env`` sets (shown before the command, as typed), and ``head``: the lines shown (0: all; then ``...``)."""

    page: str
    command: str
    trains: bool = False
    env: tuple[tuple[str, str], ...] = ()
    head: int = 0

    @property
    def shown(self) -> str:
        """The command line as the page shows it."""
        return " ".join([*(f"{name}={value}" for name, value in self.env), self.command])

    def cut(self, output: str) -> str:
        """``output`` as the page shows it: its first ``head`` lines, then ``...``."""
        lines = output.splitlines()
        return "\n".join(lines[:self.head] + ["..."]) if self.head and len(lines) > self.head else output


SAMPLES = {
    "train-default": Sample("quickstart.md", "poros train", trains=True),
    "train-eval": Sample("quickstart.md", "poros train --eval-split 0.1 --eval-steps 20", trains=True),
    "dry-run": Sample("configuration.md", "poros train --dry-run"),
    "plan-offline": Sample("configuration.md", "poros plan --model Qwen/Qwen2.5-72B --vram-budget 24GiB --device cpu",
                           env=(("HF_HUB_OFFLINE", "1"),), head=2),
    "doctor-cpu": Sample("installation.md", "poros doctor --model poros-tiny-qwen3 --vram-budget 2GiB"),
    "init": Sample("configuration.md", "poros init"),
    "list-architectures": Sample("plugins.md", "poros list-architectures"),
    "plugins": Sample("plugins.md", "poros plugins"),
}

#: (regex, what it stands for) of text that differs from run to run or machine to machine
VARYING = (
    (r"\d+(?:\.\d+)? s\b", "a wall time"),
    (r"[\d,.]+ (?:tokens/s|tok/s|steps/s|GB/s)", "a rate"),
    (r"\d+s left", "a time left"),
    (r"\(\d[\d,]* tokens, ", "tokens counted while timing"),
    (r"peak \d+\.\d+ GB \(\w+\)", "memory measured"),
    (r"\d+(?:\.\d+)? (?:GiB|MiB) (?:total|available)[^\n]*", "this machine's memory"),
    (r"^(?:python|platform|cpus|packages|torch|bitsandbytes|pinned|poros)  +.*(?:\n {15}.*)*", "this machine"),
    (r"\(\d+\.\d+ GiB available\)", "this machine's memory"),
    (r"(?<=loss )\d+\.\d+|(?<=grad_norm )\d+\.\d+|(?<=perplexity )\d+\.\d+",
     "a training value: this CPU's instruction set (AVX-512 or AVX2 kernels) rounds differently"),
)


def masked(text: str) -> str:
    """``text`` with every :data:`VARYING` match replaced by ``<varies>``."""
    for pattern, _ in VARYING:
        text = re.sub(pattern, "<varies>", text, flags=re.M)
    return text


def normalize(text: str, directory: Path) -> str:
    """An output as the docs show it: paths below the checkout and ``directory`` as ``.../``, no trailing
    spaces, progress-bar redraws dropped."""
    lines = []
    for line in text.replace(str(ROOT), "...").replace(str(directory), "...").splitlines():
        line = line.rsplit("\r", 1)[-1].rstrip()
        if line not in ("```", "```text"):  # poros doctor fences its block for pasting into an issue
            lines.append(line)
    return "\n".join(lines).strip("\n")


def run(sample: Sample) -> str:
    """The sample's command run in a fresh process in an empty directory: its output as the docs show it."""
    with tempfile.TemporaryDirectory(prefix="poros-doc-sample-") as directory:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "100", **dict(sample.env)}
        for name in ("HF_HUB_DISABLE_PROGRESS_BARS", "POROS_LOAD_PLUGINS", "OMP_NUM_THREADS"):  # a user's shell
            env.pop(name, None)
        argv = sample.command.split()
        assert argv[0] == "poros", sample.command
        done = subprocess.run([sys.executable, "-m", "poros", *argv[1:]], cwd=directory, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=900, check=False)
        if done.returncode != 0:
            raise SystemExit(f"{sample.command} exited {done.returncode}:\n{done.stdout[-3000:]}")
        return f"$ {sample.shown}\n" + sample.cut(normalize(done.stdout, Path(directory).resolve()))


def block(name: str, page_text: str) -> str:
    """The text of sample ``name``'s fenced block in ``page_text`` (without the fences)."""
    found = re.search(rf"<!-- BEGIN SAMPLE: {re.escape(name)} -->\n```[a-z]*\n(.*?)\n```\n<!-- END SAMPLE: "
                      rf"{re.escape(name)} -->", page_text, flags=re.S)
    if found is None:
        raise SystemExit(f"docs/{SAMPLES[name].page}: no sample {name!r}; add its BEGIN/END SAMPLE markers")
    return found.group(1)


def replace_block(name: str, page_text: str, output: str) -> str:
    pattern = re.compile(rf"(<!-- BEGIN SAMPLE: {re.escape(name)} -->\n```[a-z]*\n).*?(\n```\n<!-- END SAMPLE: "
                         rf"{re.escape(name)} -->)", flags=re.S)
    return pattern.sub(lambda m: m.group(1) + output + m.group(2), page_text)


def differences(name: str, output: str) -> list[str]:
    """The lines where the page's sample ``name`` and ``output`` differ beyond :data:`VARYING` (empty: it matches)."""
    import difflib

    shown = masked(block(name, (DOCS / SAMPLES[name].page).read_text(encoding="utf-8")))
    fresh = masked(output)
    if shown == fresh:
        return []
    return list(difflib.unified_diff(shown.splitlines(), fresh.splitlines(), "docs", "command", lineterm="", n=0))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("names", nargs="*", help=f"samples to run (default all: {', '.join(SAMPLES)})")
    parser.add_argument("--check", action="store_true", help="exit 1 where a page's sample no longer matches")
    args = parser.parse_args(argv)
    stale = 0
    for name in args.names or SAMPLES:
        sample = SAMPLES[name]
        output = run(sample)
        page = DOCS / sample.page
        if args.check:
            diff = differences(name, output)
            if diff:
                stale += 1
                print(f"docs/{sample.page} sample {name!r} is stale:\n" + "\n".join(diff), file=sys.stderr)
            continue
        text = page.read_text(encoding="utf-8")
        fresh = replace_block(name, text, output)
        if fresh != text:
            page.write_text(fresh, encoding="utf-8")
            print(f"rewrote docs/{sample.page} sample {name!r}")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
