"""The GGUF files ``poros merge --format gguf`` writes, read by a real llama.cpp: node-llama-cpp's prebuilt CPU
build (npm ``node-llama-cpp`` 3.22.1 with ``@node-llama-cpp/linux-x64``), driven by tests/llama_cpp_check.mjs.

For the bundled model with an adapter (random ``lora_B``, so the merge changes every adapted weight), exported
as f32, bf16 and q8_0, and for every one of the 400 bundled conversations:

* llama.cpp's tokens of the rendered conversation are the HF tokenizer's, for each file;
* greedy continuations of the prompt (the conversation up to its answer) are transformers' on the merged
  checkpoint, token for token, for f32;
* the first-token logits are within :data:`LOGIT_TOLERANCE` of transformers' (float32 on the merged
  checkpoint) for each type.

``.ci/run`` installs node-llama-cpp and sets ``POROS_NODE_LLAMA_CPP`` to its folder: with the variable set, a
llama.cpp that does not run fails the test. Without it (a checkout with no npm install) the module is skipped,
naming the command that installs it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("bitsandbytes")
pytest.importorskip("gguf")

import torch  # noqa: E402

from poros.cli.main import main  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "llama_cpp_check.mjs"
#: the variable naming the folder node-llama-cpp is installed in (.ci/run sets it)
VARIABLE = "POROS_NODE_LLAMA_CPP"
INSTALL = "npm install --prefix DIR node-llama-cpp@3.22.1 @node-llama-cpp/linux-x64@3.22.1"
TYPES = ("f32", "bf16", "q8_0")
#: the largest |llama.cpp - transformers| allowed on a first-token logit, per type: about twice the largest
#: difference seen over the 400 prompts (2.1e-5, 0.059, 0.33; the logits span about 26), llama.cpp with its
#: KV cache in f32. f32: the same weights, other kernels and summation orders; bf16: llama.cpp also rounds
#: activations to bf16 in its matmuls; q8_0: 8-bit weights (32 per block, one f16 scale) and activations.
LOGIT_TOLERANCE = {"f32": 1e-4, "bf16": 0.125, "q8_0": 0.7}
GREEDY_TOKENS = 8


def node_llama_cpp() -> Path:
    """The folder node-llama-cpp is installed in: ``$POROS_NODE_LLAMA_CPP`` (it must work), else skip."""
    folder = os.environ.get(VARIABLE)
    if not folder:
        pytest.skip(f"llama.cpp is not installed here: set {VARIABLE}=DIR after `{INSTALL}` (.ci/run does)")
    package = Path(folder) / "node_modules" / "node-llama-cpp"
    assert package.is_dir(), f"{VARIABLE}={folder} is set but {package} does not exist: `{INSTALL}`"
    assert shutil.which("node"), f"{VARIABLE}={folder} is set but node is not on PATH"
    return Path(folder)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The adapter exported with ``poros merge --format gguf`` as each type, and the merged checkpoint."""
    from poros.assets import asset_path
    from poros.testing import load_qlora

    folder = node_llama_cpp()
    tmp = tmp_path_factory.mktemp("llama-cpp")
    base = asset_path("poros-tiny-qwen3")
    load_qlora(base, lora_rank=4, lora_alpha=8).save_pretrained(tmp / "adapter")  # lora_B random
    return folder, base, tmp, export_all(base, tmp, "tiny")


def export_all(base: Path, tmp: Path, stem: str) -> dict:
    """``tmp/adapter`` on ``base`` written by ``poros merge --format gguf`` as each of :data:`TYPES` (``{type:
    file}``), and merged to safetensors in ``tmp/merged``."""
    from poros.export.merge import merge_adapter

    files = {}
    for gguf_type in TYPES:
        files[gguf_type] = tmp / f"{stem}-{gguf_type}.gguf"
        status = main(["merge", "--adapter", str(tmp / "adapter"), "--model", str(base), "--format", "gguf",
                       "--gguf-type", gguf_type, "--output", str(files[gguf_type])])
        assert status == 0
    merge_adapter(tmp / "adapter", tmp / "merged", model=base, progress=None)
    return files


def conversations(tokenizer):
    from poros.assets import asset_path

    rows = [json.loads(line) for line in asset_path("poros-tiny-chat").read_text().splitlines()]
    texts = [tokenizer.apply_chat_template(row["messages"], tokenize=False) for row in rows]
    prompts = [tokenizer.apply_chat_template(row["messages"][:-1], tokenize=False, add_generation_prompt=True)
               for row in rows]
    return texts, prompts


def llama_cpp(folder: Path, tmp: Path, files: dict, texts: list, prompts: list, vocab: int) -> dict:
    """Run the node script once for every file: its tokens, greedy tokens (f32) and first-token logits."""
    request = {"models": [{"name": name, "path": str(path), "texts": texts, "prompts": prompts, "vocab": vocab,
                           "greedy": GREEDY_TOKENS if name == "f32" else 1, "logits": True}
                          for name, path in files.items()]}
    (tmp / "request.json").write_text(json.dumps(request))
    out = tmp / "llama-cpp-out"
    out.mkdir(exist_ok=True)
    result = subprocess.run(["node", str(SCRIPT), str(tmp / "request.json"), str(out)], capture_output=True,
                            text=True, timeout=600, env={**os.environ, VARIABLE: str(folder)}, check=False)
    assert result.returncode == 0, f"llama.cpp (node-llama-cpp in {folder}) failed:\n{result.stderr[-3000:]}"
    answers = {}
    for name in files:
        answers[name] = json.loads((out / f"{name}.json").read_text())
        answers[name]["logits"] = np.fromfile(out / f"{name}.logits.f32", dtype="<f4").reshape(len(prompts), vocab)
    return answers


def transformers_answers(merged: Path, tokenizer, prompts: list) -> tuple[list, np.ndarray]:
    """Greedy tokens and first-token logits of transformers (float32) on the merged checkpoint; prompts of one
    length run as one batch (no padding, so each row is computed as alone)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    encoded = [tokenizer.encode(prompt) for prompt in prompts]
    greedy: list = [None] * len(prompts)
    logits = np.zeros((len(prompts), model.config.vocab_size), dtype=np.float32)
    by_length: dict[int, list[int]] = {}
    for index, ids in enumerate(encoded):
        by_length.setdefault(len(ids), []).append(index)
    with torch.no_grad():
        for indices in by_length.values():
            batch = torch.tensor([encoded[i] for i in indices])
            out = model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=GREEDY_TOKENS,
                                 min_new_tokens=GREEDY_TOKENS, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id)
            for row, index in enumerate(indices):
                greedy[index] = out.sequences[row, batch.shape[1]:].tolist()
                logits[index] = out.logits[0][row].float().numpy()
    return greedy, logits


def test_llama_cpp_reads_the_gguf_as_transformers_does(exported):
    import transformers

    folder, base, tmp, files = exported
    tokenizer = transformers.AutoTokenizer.from_pretrained(base)
    texts, prompts = conversations(tokenizer)
    assert len(texts) == 400
    vocab = transformers.AutoConfig.from_pretrained(base).vocab_size
    answers = llama_cpp(folder, tmp, files, texts, prompts, vocab)
    greedy, logits = transformers_answers(tmp / "merged", tokenizer, prompts)

    expected_tokens = [tokenizer.encode(text) for text in texts]
    differences = {name: float(np.abs(answers[name]["logits"] - logits).max()) for name in files}
    for name in files:
        same = sum(got == want for got, want in zip(answers[name]["tokens"], expected_tokens))
        assert same == 400, f"{name}: {same} of 400 conversations tokenize as transformers does"
        assert answers[name]["prompt_tokens"] == [tokenizer.encode(prompt) for prompt in prompts]
    assert all(differences[name] <= LOGIT_TOLERANCE[name] for name in files), \
        f"max |logit difference| {differences}, allowed {LOGIT_TOLERANCE} (logits span {np.ptp(logits):.1f})"
    same_greedy = sum(got == want for got, want in zip(answers["f32"]["greedy"], greedy))
    assert same_greedy == 400, f"f32: {same_greedy} of 400 greedy continuations equal transformers'"


#: the MoE families (tests/test_moe_export.py): tiny random-weight models with LoRA on q_proj and on the experts
MOE = [("qwen3_5_moe", "default"), ("gemma4", "moe")]
MOE_PROMPTS = 48
#: the largest |llama.cpp - transformers| allowed on a first-token logit of the tiny random MoE models (logits span
#: about 1.3), per family and type: about twice the largest difference seen over the prompts (Qwen3.5 MoE 1.8e-7,
#: 0.0015, 0.044; Gemma 4 3.8e-4, 0.14, 0.19). Qwen3.5 MoE in f32 is the same computation to rounding; Gemma 4's
#: GELU is llama.cpp's tabulated one (f16 inputs) on the CPU, and in bf16 and q8_0 a token's top-2 experts can
#: differ from transformers' where two router scores are that close, hence their wider bounds.
MOE_TOLERANCE = {"qwen3_5_moe": {"f32": 1e-6, "bf16": 0.003, "q8_0": 0.09},
                 "gemma4": {"f32": 0.0008, "bf16": 0.3, "q8_0": 0.4}}


@pytest.fixture(scope="module", params=MOE, ids=[family for family, _ in MOE])
def moe_exported(request, tmp_path_factory):
    """A tiny MoE with random LoRA on q_proj and the experts, exported with ``poros merge --format gguf`` as each
    type, and merged to safetensors."""
    from test_moe_export import expert_adapter, gguf_base

    folder = node_llama_cpp()
    family, variant = request.param
    tmp = tmp_path_factory.mktemp(f"llama-cpp-{family}")
    base = gguf_base(tmp / "base", family, variant)
    expert_adapter(base, tmp / "adapter")
    return family, folder, base, tmp, export_all(base, tmp, family)


def test_llama_cpp_runs_the_moe_gguf_as_transformers_runs_the_merged_model(moe_exported):
    """Qwen3.5 MoE (DeltaNet layers, stacked experts, shared expert; byte-level BPE) and Gemma 4 MoE (sliding and full
    layers, fused experts, router scales; a tokenizer of Gemma's kind, llama.cpp's gemma4 model) with LoRA merged
    into their experts: llama.cpp tokenizes the 400 conversations and the prompts as the HF tokenizer does, its
    first-token logits are transformers' within :data:`MOE_TOLERANCE`, and its greedy continuations (f32) are
    transformers' token for token up to a step where transformers' own two best logits are within that tolerance
    (a tie either may break: random tiny models have them)."""
    import transformers

    family, folder, base, tmp, files = moe_exported
    tokenizer = transformers.AutoTokenizer.from_pretrained(base)
    texts, prompts = conversations(tokenizer)
    prompts = prompts[:MOE_PROMPTS]
    vocab = transformers.AutoConfig.from_pretrained(base).vocab_size
    answers = llama_cpp(folder, tmp, files, texts, prompts, vocab)
    greedy, logits = transformers_answers(tmp / "merged", tokenizer, prompts)
    expected_tokens = [tokenizer.encode(text) for text in texts]
    for name in files:
        assert answers[name]["tokens"] == expected_tokens, name
        assert answers[name]["prompt_tokens"] == [tokenizer.encode(prompt) for prompt in prompts], name
    differences = {name: float(np.abs(answers[name]["logits"] - logits).max()) for name in files}
    assert all(differences[name] <= MOE_TOLERANCE[family][name] for name in files), \
        f"max |logit difference| {differences}, allowed {MOE_TOLERANCE[family]} (logits span {np.ptp(logits):.2f})"
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp / "merged", dtype=torch.float32).eval()
    for prompt, got, want in zip(prompts, answers["f32"]["greedy"], greedy):
        if got != want:  # where they part, transformers' two best logits must be a tie within the tolerance
            step = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
            with torch.no_grad():
                best = model(torch.tensor([tokenizer.encode(prompt) + want[:step]])).logits[0, -1].topk(2).values
            assert float(best[0] - best[1]) <= MOE_TOLERANCE[family]["f32"], (prompt, got, want)


def test_without_the_variable_the_module_says_how_to_install(monkeypatch):
    monkeypatch.delenv(VARIABLE, raising=False)
    with pytest.raises(pytest.skip.Exception, match="npm install --prefix DIR node-llama-cpp@3.22.1"):
        node_llama_cpp()


def test_a_variable_pointing_at_nothing_fails(monkeypatch, tmp_path):
    monkeypatch.setenv(VARIABLE, str(tmp_path / "nowhere"))
    with pytest.raises(AssertionError, match="does not exist"):
        node_llama_cpp()


def test_ci_installs_llama_cpp_and_points_the_test_at_it():
    """CI cannot skip this module: .ci/run installs the version named here and sets the variable before the suite."""
    script = (ROOT / ".ci" / "run").read_text()
    assert "LLAMA_CPP_NPM=3.22.1" in script and "3.22.1" in INSTALL
    assert '"node-llama-cpp@$LLAMA_CPP_NPM" "@node-llama-cpp/linux-x64@$LLAMA_CPP_NPM"' in script
    assert script.index(f"export {VARIABLE}=") < script.index('bash -euo pipefail -c "$tests"')
