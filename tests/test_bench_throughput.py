"""The bench's machine numbers (tools/bench/throughput.py, kernel_profile.py, sweep.py): N counts a real HF
model's block linears, the FLOPs follow the formulas of docs/benchmarking.md, kernels fall in their
categories, and the sweep's child command lines drop the swept flags."""

from __future__ import annotations

import torch
import transformers

from tools.bench.kernel_profile import breakdown, busy_ms, category, gaps
from tools.bench.sweep import strip
from tools.bench.throughput import add_machine_numbers, block_linear_parameters, flops_per_token

SEVEN = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _config():
    return transformers.Qwen2Config(hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=128)


def test_n_is_the_blocks_seven_linears_of_a_real_model():
    config = _config()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    linears = sum(m.weight.numel() for name, m in model.named_modules()
                  if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in SEVEN)
    assert block_linear_parameters(config) == linears


def test_flops_per_token_and_mfu():
    config, seq = _config(), 32
    n, attention = block_linear_parameters(config), 2 * 3 * seq * 4 * 16
    assert flops_per_token(config, seq, 0.0) == (4 * n + 3 * attention, 4 * n + 3 * attention)
    assert flops_per_token(config, seq, 1.0)[1] == 6 * n + 4 * attention
    arms = {"trl-resident": {"median_step_s": 2.0, "tokens_per_step": 1000},
            "trl-poros": {"median_step_s": 1.0, "tokens_per_step": 1000, "kept_activation_blocks": 3}}
    add_machine_numbers(arms, config, seq, dense_tflops=1e-6)
    model = (4 * n + 3 * attention) * 1000 / 1e12
    assert arms["trl-poros"]["hardware_tflops"] == arms["trl-poros"]["model_tflops"] == round(model, 1)
    assert arms["trl-poros"]["mfu"] == round(round(model, 1) / 1e-6, 4)


def test_kernel_categories_and_idle():
    assert category("nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN") == "gemm"
    assert category("ampere_sgemm_128x64_tn") == "lora"
    assert category("void kDequantizeBlockwise<__nv_bfloat16, 512, 64, 8, 2>") == "dequantize"
    assert category("pytorch_flash::flash_fwd_kernel") == "attention"
    assert category("Memcpy HtoD (Pinned -> Device)") == "h2d"
    assert category("void at::native::multi_tensor_apply_kernel") == "optimizer"
    assert category("void at::native::reduce_kernel<512, 1>") == "elementwise_norm"
    assert busy_ms([(0, 2), (1, 3), (5, 6)]) == 4
    result = breakdown([("ampere_sgemm", 0.0, 1.0), ("nvjet", 1.0, 3.0), ("Memcpy HtoD", 5.0, 6.0)])
    assert result["idle_ms"] == 2 and result["category_ms"]["gemm"] == 2
    # the idle intervals: one of 2 ms between nvjet and the copy, one of 0.05 ms, none inside the overlap
    found = gaps([("a", 0.0, 1.0), ("b", 0.5, 3.0), ("c", 5.0, 6.0), ("d", 6.05, 7.0), ("e", 6.5, 6.6)])
    assert [(g["ms"], g["after"], g["before"]) for g in found["largest"]] == [(2.0, "b", "c"), (0.05, "c", "d")]
    assert found["largest"][0]["offset_ms"] == 3.0
    assert [(b["count"], b["ms"]) for b in found["by_length"]] == [(0, 0), (1, 0.05), (0, 0), (1, 2.0), (0, 0)]


def test_the_sweep_drops_the_flags_it_sets():
    assert strip(["--model", "x", "--seq", "512", "--grad-accum=4", "--json", "a.json", "--cuda-graphs"],
                 ("--seq", "--grad-accum", "--json")) == ["--model", "x", "--cuda-graphs"]


def test_the_step_clock_counts_the_allocator_per_timed_step():
    """``StepClock.allocator``: the caching allocator's counters from the last warm-up step's end to the last step's,
    per timed step (cudaMalloc / cudaFree / retries in the loop stall the host); None without CUDA counters."""
    from tools.bench.trainer_common import ALLOCATOR_COUNTERS, StepClock

    clock = StepClock("cpu")
    assert clock.allocator(warmup=1) is None
    counts = [{key: 0 for key in ALLOCATOR_COUNTERS} for _ in range(4)]  # the start, then three steps
    counts[2]["num_alloc_retries"], counts[3]["num_alloc_retries"] = 1, 5
    counts[3]["num_device_alloc"] = 6
    clock._counters = counts
    per_step = clock.allocator(warmup=1)
    assert per_step["num_alloc_retries"] == 2.5 and per_step["num_device_alloc"] == 3.0


def test_hardware_flops_leave_out_the_products_a_recompute_skipped():
    """A Poros arm's ``skipped_flops`` (a timed step's products its recomputes left out) come off its hardware
    FLOPs, not its model FLOPs; an arm without them is priced as before."""
    config, seq = _config(), 32
    n, attention = block_linear_parameters(config), 2 * 3 * seq * 4 * 16
    skipped = 2 * 2 * seq * 64 * 160  # two down_proj-shaped products over a 32-token micro-batch
    arms = {"trl-poros": {"median_step_s": 1.0, "tokens_per_step": 64, "kept_activation_blocks": 0,
                          "skipped_flops": skipped},
            "trl-poros-before": {"median_step_s": 1.0, "tokens_per_step": 64, "kept_activation_blocks": 0}}
    add_machine_numbers(arms, config, seq, dense_tflops=None)
    whole = (6 * n + 4 * attention) * 64
    assert arms["trl-poros-before"]["hardware_tflops"] == round(whole / 1e12, 1)
    assert arms["trl-poros"]["hardware_tflops"] == round((whole - skipped) / 1e12, 1)
    assert arms["trl-poros"]["model_tflops"] == arms["trl-poros-before"]["model_tflops"]


def test_the_step_clock_reads_counters_per_timed_step():
    """``StepClock.readings``: each is read at the start and after every step, and ``per_timed_step`` is its
    growth per step after the warm-up (the first step's probes are not a timed step's skips)."""
    from tools.bench.trainer_common import StepClock

    clock, count = StepClock("cpu"), [0]
    clock.readings["skips"] = lambda: count[0]
    clock.on_train_begin(None, None, None)
    for grown in (3, 7, 7):  # the warm-up step skipped 3 (after its probes), each timed step 7
        count[0] += grown
        clock.on_step_end(None, None, None)
    assert clock.per_timed_step("skips", warmup=1) == 7.0
    assert clock.per_timed_step("absent", warmup=1) is None
