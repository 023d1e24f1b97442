#!/usr/bin/env bash
# Run the GPU parity gate and benchmarks ON the GPU host, from the repo root; JSON and a log go to $OUT.
#
#   tools/gpu_run.sh gate bench:qwen2.5-7b bench:qwen2.5-32b
#   tools/gpu_run.sh bench:qwen2.5-72b:layers=20 bench:qwen2.5-32b:seq=2048
#   tools/gpu_run.sh bench:qwen2.5-32b:arms=poros:vram-limit=8 gate:only=gemma4,gemma4-moe:attn=eager
#   tools/gpu_run.sh bench:qwen2.5-7b:layers=4:deterministic
#   tools/gpu_run.sh bench:qwen2.5-72b:deterministic:optimizer-states=host:vram-limit=8:cap-arms=poros   # small cards
#   tools/gpu_run.sh bench:qwen2.5-32b:deterministic:optimizer-states=host:loss-chunks=8:vram-limit=6:cap-arms=poros
#   tools/gpu_run.sh bench:qwen2.5-72b:deterministic:schedule=layer-major:optimizer-states=host:lora-placement=host:vram-limit=8:cap-arms=poros
#   tools/gpu_run.sh doctor doctor:model=qwen2.5-32b
#   tools/gpu_run.sh merge:qwen2.5-32b:layers=2 merge:qwen2.5-72b:layers=2
#   DEVICE=cpu tools/gpu_run.sh gate:tiny bench:tiny:steps=2:warmup=1     # dry run without a GPU
#   DEVICE=cpu tools/gpu_run.sh doctor:quick doctor:model=poros-tiny-qwen3:vram-budget=2GiB
#   tools/gpu_run.sh cache:qwen2.5-32b:layers=4 cache:qwen2.5-72b:layers=4:host-budget-gib=1
#   tools/gpu_run.sh prequant:qwen2.5-72b:layers=8:cap-gib=8     # poros quantize, bnb-4bit starts, the drop-in at 8 GiB
#   tools/gpu_run.sh long:checkpoint=/tmp/poros-pq/bnb-4bit:seq=32768:vram-budget=22GiB:cap-gib=24:host-budget=40GiB:deterministic
#   tools/gpu_run.sh gate:cuda-graphs:no-diagnose:grad-accum=2:schedule=layer-major:steps=4        # graphs' gate
#   POROS_CUDA_GRAPHS_AUTOCAST=1 tools/gpu_run.sh gate:cuda-graphs:autocast=bf16:no-diagnose:grad-accum=2:schedule=layer-major:steps=4
#   tools/gpu_run.sh bench:qwen2.5-72b:cuda-graphs:schedule=layer-major:deterministic:profile:arms=resident,poros-device,poros
#   tools/gpu_run.sh bench:qwen2.5-32b:arms=trl-resident,trl-poros,unsloth:grad-accum=8:deterministic:steps=2:warmup=1:unsloth-timeout=240
#   tools/gpu_run.sh bench:qwen2.5-72b:arms=hf-resident,hf-poros,unsloth:deterministic:steps=5:warmup=2:unsloth-timeout=300
#   tools/gpu_run.sh bench:qwen2.5-72b:arms=hf-resident,hf-poros:deterministic:steps=3:warmup=1:vram-budget=30GB  # planner: resident blocks
#   tools/gpu_run.sh bench:qwen2.5-32b:layers=8:arms=trl-resident,trl-poros:seq=2048:grad-accum=4:deterministic:cuda-graphs:liger:steps=2:warmup=1
#                  # --liger: the Trainer arms with use_liger_kernel=True (liger-kernel's wheel in .whl/; Triton: torch's)
#   tools/gpu_run.sh gate:liger:only=qwen3,gemma3:cuda-graphs:grad-accum=2:schedule=layer-major:steps=2   # Liger's gate
#
#   tools/gpu_run.sh @tools/gpu_steps/issue-41-h200-2048.steps    # the steps of a file, one per line
#
# `@FILE` stands for the steps FILE lists, one per line (`#` starts a comment; blank lines are skipped); a line
# may start with a number of seconds, that step's limit in place of STEP_TIMEOUT. tools/gpu_steps/ holds the
# issues' device runs, each file sized to one device call (at most 10 minutes).
#
# A step is `gate` (tools/checks/parity_gate.py), `bench:SHAPE` (tools/bench/harness.py --model SHAPE),
# `curve:SHAPE` (tools/bench/vram_curve.py --model SHAPE), `merge:SHAPE` (tools/checks/merge_generate_bench.py
# --model SHAPE: poros merge RAM/time and poros generate tokens/s), `cache:SHAPE` (tools/checks/cache_bench.py
# --model SHAPE: NF4 block cache start times and host tiers), `prequant:SHAPE` (tools/checks/prequant_bench.py
# --model SHAPE: poros quantize, starts from a bnb-4bit checkpoint, the drop-in under a cap), `long`
# (tools/checks/long_context_run.py: one long-context run from a bnb-4bit checkpoint, host peak RSS and disk
# used beside the plan), `load`
# (tools/checks/load_check.py), `eval`
# (tools/checks/eval_check.py: evaluation leaves training bitwise, eval_loss == resident), `doctor`
# (tools/checks/doctor_run.py: `poros doctor`'s block to STEP.txt and its JSON; `:model=SHAPE_OR_DIR`,
# `:vram-budget=X`, `:quick`; DEVICE does not apply: the doctor reports what it finds) or `ddp`
# (tools/checks/ddp_check.py: `ddp:parity:backend=gloo:share-device`, `ddp:scale=qwen2.5-32b:layers=8`), each
# optionally followed by `:key=value` pairs that become `--key value` options (a bare `:flag`
# becomes `--flag`). Steps run one after another; a failing step does not stop the next, and the
# exit status is non-zero if any step failed.
#
# Environment:
#   OUT            where the JSON reports, results.json (all of them merged) and gpu_run.log go
#                  (default ./out). With more than 6 steps only results.json and the log go there:
#                  the GPU tool brings back at most 8 files.
#   POROS_COMMIT   commit recorded in the JSON when the tree has no .git (the GPU copy has none).
#   STEP_TIMEOUT   seconds per step (default: none), so that one stuck step cannot eat the run.
#   BENCH_ARGS / GATE_ARGS   extra options for every bench / gate step.
#   DEVICE         cuda (default) or cpu.
#
# Wheels: if .whl/ holds wheels (bitsandbytes, transformers, peft: ../shared/tools/gpu-wheelhouse),
# they are installed into /tmp/site (once per set of wheels) and put first on PYTHONPATH. If
# .whl-unsloth/ holds wheels (tools/bench/unsloth-wheelhouse), they and .whl/'s bitsandbytes and peft go into
# /tmp/site-unsloth for the `unsloth` bench arm's child process (POROS_UNSLOTH_SITE), never on PYTHONPATH.
set -uo pipefail

OUT=${OUT:-./out}
DEVICE=${DEVICE:-cuda}
export PYTHONUNBUFFERED=1

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  if [ $# -eq 0 ]; then
    echo "usage: tools/gpu_run.sh STEP|@FILE... (STEP: gate[:k=v...] | bench:SHAPE[:k=v...] | curve:SHAPE[:k=v...] | merge:SHAPE[:k=v...] | cache:SHAPE[:k=v...] | load[:k=v...] | doctor[:k=v...])" >&2
    exit 2
  fi
  mkdir -p "$OUT"
fi

# ":key=value:flag" -> "--key", "value", "--flag", one word per line.
options() {
  local IFS=':' part
  for part in $1; do
    [ -z "$part" ] && continue
    if [[ $part == *=* ]]; then printf -- '--%s\n%s\n' "${part%%=*}" "${part#*=}"; else printf -- '--%s\n' "$part"; fi
  done
}

install_wheels() {
  if ! compgen -G ".whl/*.whl" > /dev/null; then
    echo "no .whl/*.whl: using the installed bitsandbytes/transformers/peft"
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    return 0
  fi
  local stamp
  stamp=$(ls -l .whl/*.whl | md5sum | cut -d' ' -f1)
  if [ "$(cat /tmp/site/.poros-wheels 2>/dev/null)" != "$stamp" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || return 1
    echo "$stamp" > /tmp/site/.poros-wheels
  fi
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
  install_unsloth_wheels
}

# .whl-unsloth/ (tools/bench/unsloth-wheelhouse) + bitsandbytes and peft from .whl/ -> /tmp/site-unsloth, for the
# Unsloth arm's child process only (tools/bench/unsloth_arm.py reads POROS_UNSLOTH_SITE); the host's transformers.
install_unsloth_wheels() {
  compgen -G ".whl-unsloth/*.whl" > /dev/null || return 0
  local stamp
  local -a wheels=(.whl-unsloth/*.whl)
  wheels+=($(ls .whl/bitsandbytes-*.whl .whl/peft-*.whl 2>/dev/null))
  stamp=$(ls -l "${wheels[@]}" | md5sum | cut -d' ' -f1)
  if [ "$(cat /tmp/site-unsloth/.poros-wheels 2>/dev/null)" != "$stamp" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site-unsloth "${wheels[@]}" \
      || { echo "unsloth wheel install failed: the unsloth arm will fail"; return 0; }
    echo "$stamp" > /tmp/site-unsloth/.poros-wheels
  fi
  export POROS_UNSLOTH_SITE=/tmp/site-unsloth
}

print_environment() {
  echo "== $(date -u +%Y-%m-%dT%H:%M:%SZ) $(hostname) commit=${POROS_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
  nvidia-smi || echo "(no nvidia-smi)"
  python3 - <<'PY'
import importlib, importlib.metadata, platform
import torch
print("python", platform.python_version(), "| torch", torch.__version__, "cuda", torch.version.cuda,
      "| cuda available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability(),
          "memory %.1f GB" % (torch.cuda.get_device_properties(0).total_memory / 1e9))
for name in ("transformers", "peft", "bitsandbytes", "accelerate", "safetensors", "trl", "triton", "liger_kernel"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", None) or importlib.metadata.version(name.replace("_", "-")),
              module.__file__)
    except Exception as exc:  # noqa: BLE001
        print(name, "MISSING:", exc)
PY
}

merge_reports() {  # every *.json of $1 into $2, keyed by file stem
  python3 - "$1" "$2" <<'PY'
import json, pathlib, sys
source, target = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
merged = {}
for path in sorted(source.glob("*.json")):
    if path.resolve() == target.resolve():
        continue
    try:
        merged[path.stem] = json.loads(path.read_text())
    except ValueError as exc:
        merged[path.stem] = {"unreadable": str(exc)}
target.write_text(json.dumps(merged, indent=1) + "\n")
print(f"merged {len(merged)} reports into {target}")
PY
}

# The steps of the command line, `@FILE` arguments expanded into STEPS (and each line's own limit into LIMITS).
expand_steps() {
  local arg line first
  STEPS=() LIMITS=()
  for arg in "$@"; do
    if [[ $arg != @* ]]; then STEPS+=("$arg") LIMITS+=(""); continue; fi
    [ -r "${arg#@}" ] || { echo "no steps file ${arg#@}"; return 2; }
    while IFS= read -r line || [ -n "$line" ]; do
      line=${line%%#*}
      read -r first line <<< "$line"
      [ -z "$first" ] && continue
      if [[ $first =~ ^[0-9]+$ ]]; then
        [ -z "$line" ] && { echo "${arg#@}: a limit without a step"; return 2; }
        STEPS+=("$line") LIMITS+=("$first")
      else
        STEPS+=("$first${line:+ $line}") LIMITS+=("")
      fi
    done < "${arg#@}"
  done
}

main() {
  local json_dir=$OUT status=0 step kind rest model file start rc i
  local -a summary=() extra=() cmd=() limit=() STEPS LIMITS
  expand_steps "$@" || return 2
  install_wheels || { echo "wheel install failed"; return 3; }
  print_environment
  if [ ${#STEPS[@]} -gt 6 ]; then json_dir=$(mktemp -d); fi

  for i in "${!STEPS[@]}"; do
    step=${STEPS[$i]}
    limit=()
    if [ -n "${LIMITS[$i]}" ]; then limit=(timeout "${LIMITS[$i]}")
    elif [ -n "${STEP_TIMEOUT:-}" ]; then limit=(timeout "$STEP_TIMEOUT"); fi
    kind=${step%%:*}
    rest=${step#"$kind"}; rest=${rest#:}
    file=$(printf '%s' "$step" | tr -c 'A-Za-z0-9._-' '-')
    # a file name is at most 255 bytes: a longer step keeps its first 200 characters and a hash of the whole
    if [ ${#file} -gt 200 ]; then file="${file:0:200}-$(printf '%s' "$step" | sha1sum | cut -c1-10)"; fi
    case $kind in
      gate)
        mapfile -t extra < <(options "$rest")
        # shellcheck disable=SC2086  # GATE_ARGS is a word list on purpose
        cmd=(python3 -m tools.checks.parity_gate --device "$DEVICE" --json "$json_dir/$file.json"
             ${extra[@]+"${extra[@]}"} ${GATE_ARGS:-}) ;;
      bench)
        model=${rest%%:*}; rest=${rest#"$model"}; rest=${rest#:}
        mapfile -t extra < <(options "$rest")
        # shellcheck disable=SC2086
        cmd=(python3 -m tools.bench --device "$DEVICE" --model "$model" --json "$json_dir/$file.json"
             ${extra[@]+"${extra[@]}"} ${BENCH_ARGS:-}) ;;
      curve)
        model=${rest%%:*}; rest=${rest#"$model"}; rest=${rest#:}
        mapfile -t extra < <(options "$rest")
        cmd=(python3 -m tools.bench.vram_curve --device "$DEVICE" --model "$model" --json "$json_dir/$file.json"
             ${extra[@]+"${extra[@]}"}) ;;
      ddp)
        mapfile -t extra < <(options "$rest")
        cmd=(python3 -m tools.checks.ddp_check --device "$DEVICE" --json "$json_dir/$file.json" ${extra[@]+"${extra[@]}"}) ;;
      merge)
        model=${rest%%:*}; rest=${rest#"$model"}; rest=${rest#:}
        mapfile -t extra < <(options "$rest")
        cmd=(python3 -m tools.checks.merge_generate_bench --device "$DEVICE" --model "$model" --json "$json_dir/$file.json"
             ${extra[@]+"${extra[@]}"}) ;;
      cache)
        model=${rest%%:*}; rest=${rest#"$model"}; rest=${rest#:}
        mapfile -t extra < <(options "$rest")
        cmd=(python3 -m tools.checks.cache_bench --device "$DEVICE" --model "$model" --json "$json_dir/$file.json"
             ${extra[@]+"${extra[@]}"}) ;;
      prequant)
        model=${rest%%:*}; rest=${rest#"$model"}; rest=${rest#:}
        mapfile -t extra < <(options "$rest")
        cmd=(python3 -m tools.checks.prequant_bench --device "$DEVICE" --model "$model" --json "$json_dir/$file.json"
             ${extra[@]+"${extra[@]}"}) ;;
      long)
        mapfile -t extra < <(options "$rest")
        cmd=(python3 -m tools.checks.long_context_run --device "$DEVICE" --json "$json_dir/$file.json"
             ${extra[@]+"${extra[@]}"}) ;;
      load)
        mapfile -t extra < <(options "$rest")
        cmd=(python3 -m tools.checks.load_check --device "$DEVICE" --json "$json_dir/$file.json" ${extra[@]+"${extra[@]}"}) ;;
      eval)
        mapfile -t extra < <(options "$rest")
        cmd=(python3 -m tools.checks.eval_check --device "$DEVICE" --json "$json_dir/$file.json" ${extra[@]+"${extra[@]}"}) ;;
      doctor)
        mapfile -t extra < <(options "$rest")
        cmd=(python3 -m tools.checks.doctor_run --json "$json_dir/$file.json" ${extra[@]+"${extra[@]}"}) ;;
      *)
        echo "unknown step $step (expected gate[:k=v...], bench:SHAPE[:k=v...], curve:SHAPE[:k=v...], merge:SHAPE[:k=v...], cache:SHAPE[:k=v...], load[:k=v...], eval[:k=v...], doctor[:k=v...] or ddp[:k=v...])"
        summary+=("$step rc=2"); status=1; continue ;;
    esac
    echo
    echo "== step $step: ${cmd[*]}"
    start=$(date +%s)
    ${limit[@]+"${limit[@]}"} "${cmd[@]}"
    rc=$?
    summary+=("$step rc=$rc $(( $(date +%s) - start ))s")
    [ $rc -ne 0 ] && status=1
  done

  merge_reports "$json_dir" "$OUT/results.json"
  echo
  echo "== summary"
  printf '%s\n' "${summary[@]}"
  return $status
}

if [ "${BASH_SOURCE[0]}" != "$0" ]; then return 0; fi  # sourced (tests/test_gpu_steps.py): the functions only
main "$@" 2>&1 | tee -a "$OUT/gpu_run.log"
exit "${PIPESTATUS[0]}"
