"""``tools/gpu_run.sh @FILE`` and the issues' device runs in ``tools/gpu_steps/``: a device call costs scarce
device time, so a steps file that would fail on the GPU (an unknown option, a step past the call's limit) fails
here first. The steps are read by the script's own ``expand_steps`` and ``options`` (the script, sourced)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tools.bench.harness import parse_args
from tools.bench.shapes import SHAPES

ROOT = Path(__file__).resolve().parents[1]
STEP_FILES = sorted((ROOT / "tools" / "gpu_steps").glob("*.steps"))
#: one device call runs at most 600 s; the wheels' install and the environment's print take about 30
CALL_SECONDS = 570

# For each step of "$@": its limit, its kind, then the tool's arguments as gpu_run.sh builds them (one per line).
EXPAND = r"""
source tools/gpu_run.sh
expand_steps "$@" || exit $?
for i in "${!STEPS[@]}"; do
  step=${STEPS[$i]} kind=${STEPS[$i]%%:*}
  rest=${step#"$kind"}; rest=${rest#:}
  printf '== %s %s\n' "${LIMITS[$i]:--}" "$kind"
  if [[ $kind == bench ]]; then model=${rest%%:*}; rest=${rest#"$model"}; rest=${rest#:}; printf -- '--model\n%s\n' "$model"; fi
  options "$rest"
done
"""


def expand(*arguments: str) -> tuple[int, list[tuple[str, str, list[str]]]]:
    done = subprocess.run(["bash", "-c", EXPAND, "expand", *arguments], cwd=ROOT, capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "OUT": "/nonexistent"})
    steps: list[tuple[str, str, list[str]]] = []
    for line in done.stdout.splitlines():
        if line.startswith("== "):
            _, limit, kind = line.split(" ")
            steps.append((limit, kind, []))
        elif steps:
            steps[-1][2].append(line)
    return done.returncode, steps


def test_a_steps_file_expands_to_its_lines_with_their_own_limits(tmp_path):
    listed = tmp_path / "call.steps"
    listed.write_text("# a device call\n\n  90 bench:tiny:steps=1:warmup=0   # its own limit\n"
                      "gate:only=qwen3:cuda-graphs\n")
    status, steps = expand("doctor:quick", f"@{listed}")
    assert status == 0
    assert steps == [("-", "doctor", ["--quick"]),
                     ("90", "bench", ["--model", "tiny", "--steps", "1", "--warmup", "0"]),
                     ("-", "gate", ["--only", "qwen3", "--cuda-graphs"])]


def test_a_missing_steps_file_or_a_limit_without_a_step_is_refused(tmp_path):
    assert expand(f"@{tmp_path / 'none.steps'}")[0] == 2
    listed = tmp_path / "bad.steps"
    listed.write_text("120\n")
    assert expand(f"@{listed}")[0] == 2


def test_gpu_run_refuses_a_missing_steps_file_before_installing_anything(tmp_path):
    done = subprocess.run(["bash", "tools/gpu_run.sh", f"@{tmp_path / 'none.steps'}"], cwd=ROOT, capture_output=True,
                          text=True, env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out")})
    assert done.returncode == 2 and "no steps file" in done.stdout


@pytest.mark.parametrize("path", STEP_FILES, ids=lambda path: path.name)
def test_each_device_call_fits_one_call_and_its_bench_steps_parse(path):
    """Every step has its own limit, the limits fit one device call, and every bench step's options are the
    harness's (``parse_args``: known flags, a known shape, known arms)."""
    status, steps = expand(f"@{path}")
    assert status == 0 and steps, path.name
    assert all(limit != "-" for limit, _, _ in steps), f"{path.name}: give every step its limit"
    assert sum(int(limit) for limit, _, _ in steps) <= CALL_SECONDS, f"{path.name}: more than one device call"
    for _, kind, arguments in steps:
        assert kind == "bench", f"{path.name}: only bench steps are checked here; add the check for {kind}"
        args = parse_args(["--device", "cuda", *arguments])
        assert args.model in SHAPES
