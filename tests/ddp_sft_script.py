"""A TRL SFT script as ``trl/scripts/sft.py`` writes one (NF4 base, ``peft_config``, packing, eval, saves,
TRL's bf16 and gradient-checkpointing defaults), run by ``tests/test_distributed.py`` under
``accelerate launch --multi_gpu --num_processes 2`` (gloo ranks on CPU: ``use_cpu=True``).

    python ddp_sft_script.py CHECKPOINT OUTPUT_DIR [none|prepare_trainer|callback]

The last argument is the one Poros line (none: the plain script). Each rank writes ``rank{r}.pt``:
the logged losses, its LoRA tensors and its AdamW state, and how many block fetches Poros made.
"""

from __future__ import annotations

import pathlib
import sys

import torch
import trl

import poros
from conformance_flows import load, lora_config, outcome, texts, word_tokenizer


def dataset(seed: int):
    from datasets import Dataset

    return Dataset.from_list([{"text": text} for text in texts(16, seed=seed)])


def main() -> None:
    checkpoint, output_dir, line = sys.argv[1], pathlib.Path(sys.argv[2]), sys.argv[3]
    model = load(checkpoint, peft_wrap=False)
    args = trl.SFTConfig(
        output_dir=str(output_dir), max_steps=2, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        per_device_eval_batch_size=2, learning_rate=1e-2, lr_scheduler_type="constant", logging_steps=1,
        eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2, report_to=[], use_cpu=True,
        seed=11, data_seed=11, disable_tqdm=True, max_length=24, packing=True, dataloader_num_workers=0,
    )
    trainer = trl.SFTTrainer(
        model=model, args=args, train_dataset=dataset(1), eval_dataset=dataset(2), processing_class=word_tokenizer(),
        peft_config=lora_config(model), callbacks=[poros.PorosCallback()] if line == "callback" else None)
    if line == "prepare_trainer":
        poros.prepare_trainer(trainer)  # the one line: after construction, before train()
    trainer.train()
    state = trainer.accelerator.state
    result = outcome(trainer)
    store = getattr(trainer.model, "store", None)
    torch.save({"loss": result["loss"], "eval_loss": result["eval_loss"], "params": result["params"],
                "optimizer": result["optimizer"], "world_size": state.num_processes,
                "distributed_type": str(state.distributed_type), "backend": state.backend,
                "fetches": sum(store.stats.fetches) if store is not None else 0},
               output_dir / f"rank{state.process_index}.pt")


if __name__ == "__main__":
    main()
