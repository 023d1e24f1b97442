#!/usr/bin/env python3
"""PorosTrainer on CUDA against a resident HF+bnb+PEFT loop on CUDA (same batches), plus resume and save.

    python -m tools.checks.trainer_check qwen2 qwen3 qwen3_5 gemma3 gemma4     # report.json in $OUT
    DEVICE=cpu python -m tools.checks.trainer_check qwen2 qwen3 qwen3_5 gemma3 gemma4   # the same on the CPU
    KERNELS=liger python -m tools.checks.trainer_check qwen3 gemma3   # kernels: liger, the reference Liger-patched

Per family: a tiny sharded checkpoint with the bundled tokenizer, PorosTrainer.from_pretrained
(streamed loader, blocks on the host) trained 4 steps (batch 2, grad_accum 2 -> layer-major) on the
bundled chat data; the reference trains the same batches resident. Reports torch.equal of losses,
LoRA tensors and AdamW state, and that resuming from checkpoint-2 reproduces the run.
"""
import json, os, pathlib, sys, tempfile, time
import torch, transformers, peft
from poros.assets import asset_path
from poros.data import BatchIterator, load_dataset
from poros.testing import all_linear_targets, save_tiny_checkpoint
from poros.training.trainer import PorosTrainer

from tools.bench.provenance import environment

out = pathlib.Path(os.environ.get("OUT", "/tmp/out"))
out.mkdir(parents=True, exist_ok=True)
device = torch.device(os.environ.get("DEVICE", "cuda:0" if torch.cuda.is_available() else "cpu"))
work = pathlib.Path(tempfile.mkdtemp())
tok = transformers.AutoTokenizer.from_pretrained(asset_path("poros-tiny-qwen3"))
kernels = os.environ.get("KERNELS", "default")  # liger: PorosTrainer(kernels="liger"), the reference patched alike
report = {"environment": environment(device, os.environ.get("POROS_COMMIT")), "kernels": kernels}
for family in sys.argv[1:]:
    ckpt = save_tiny_checkpoint(work / family, family, seed=5, vocab_size=len(tok)); tok.save_pretrained(ckpt)
    chat = str(asset_path("poros-tiny-chat"))
    S = dict(steps=4, seq_len=64, batch_size=int(os.environ.get("BATCH", 2)), grad_accum=int(os.environ.get("ACCUM", 2)), lr=2e-2, schedule="linear", warmup=1,
             weight_decay=0.01, max_grad_norm=0.5, seed=11, logging_steps=1, save_steps=2)
    t = PorosTrainer.from_pretrained(ckpt, lora_rank=4, lora_alpha=8, seed=11, device=str(device), output_dir=str(work / f"o{family}"), kernels=kernels)
    r = t.train(chat, **S)
    # resident reference on CUDA
    q = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    base = transformers.AutoModelForCausalLM.from_pretrained(ckpt, quantization_config=q, device_map={"": str(device)}, dtype=torch.bfloat16)
    torch.manual_seed(11)
    ref = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=all_linear_targets(base), task_type="CAUSAL_LM"))
    if kernels == "liger":
        from poros.dropin.kernels import apply_liger
        apply_liger(ref)
    ref.train()
    params = [p for p in ref.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=2e-2, weight_decay=0.01)
    sch = transformers.get_scheduler("linear", opt, num_warmup_steps=1, num_training_steps=4)
    # the tokenizer as PorosTrainer loads it from the checkpoint: for a qwen2 config.json AutoTokenizer
    # picks Qwen2Tokenizer, which splits digits differently from the bundled tokenizer object `tok`
    it = BatchIterator(load_dataset(chat, t.tokenizer, seq_len=64, seed=11), batch_size=S["batch_size"], pad_token_id=t.tokenizer.pad_token_id, seed=11)
    losses = []
    for _ in range(4):
        mb = [{k: v.to(device) for k, v in it.next_batch().items()} for _ in range(S["grad_accum"])]
        n = sum((b["labels"][..., 1:] != -100).sum() for b in mb)
        sl = 0
        for b in mb:
            l = ref(**b, num_items_in_batch=n, use_cache=False).loss; l.backward(); sl = sl + l.detach()
        torch.nn.utils.clip_grad_norm_(params, 0.5); opt.step(); sch.step(); opt.zero_grad(set_to_none=True)
        losses.append(float(sl))
    mine = {n: p for n, p in t.model.named_parameters() if p.requires_grad}
    theirs = {n: p for n, p in ref.named_parameters() if p.requires_grad}
    lora_equal = all(torch.equal(mine[n], theirs[n]) for n in theirs)
    state_equal = all(torch.equal(t.optimizer.state[mine[n]][k], opt.state[theirs[n]][k]) for n in theirs for k in opt.state[theirs[n]])
    # resume from checkpoint-2 in a fresh trainer
    t2 = PorosTrainer.from_pretrained(ckpt, lora_rank=4, lora_alpha=8, seed=11, device=str(device), output_dir=str(work / f"r{family}"), kernels=kernels)
    r2 = t2.train(chat, resume_from=str(work / f"o{family}" / "checkpoint-2"), **S)
    mine2 = {n: p for n, p in t2.model.named_parameters() if p.requires_grad}
    saved = t2.save(work / f"a{family}")
    report[family] = dict(losses_equal=r.losses == losses, poros=r.losses, ref=losses, lora_equal=lora_equal,
        adam_equal=state_equal, resume_equal=r2.losses == r.losses and all(torch.equal(mine2[n], mine[n]) for n in mine),
        guarantee=t.model.guarantee, liger=t.model.kernel_report and t.model.kernel_report.summary(), deterministic=torch.are_deterministic_algorithms_enabled(),
        cublas=os.environ.get("CUBLAS_WORKSPACE_CONFIG"), metrics=r.log_history[-1], fetches=t.model.store.stats.fetches,
        adapter_device=str(next(iter(mine.values())).device), saved=sorted(p.name for p in saved.iterdir()))
    print(family, json.dumps(report[family], indent=1), flush=True)
(out / "report.json").write_text(json.dumps(report, indent=1))
