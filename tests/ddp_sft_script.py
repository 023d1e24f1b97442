"""The TRL SFT flow of the conformance suite (``conformance_flows.run_sft``: ``trl/scripts/sft.py``'s shape,
NF4 base + ``peft_config``, packing, eval, saves, TRL's bf16 and gradient-checkpointing defaults) as a
script, run by ``tests/test_distributed.py`` under ``accelerate launch --multi_gpu --num_processes 2``
(gloo ranks on CPU: ``use_cpu=True``).

    python ddp_sft_script.py CHECKPOINT OUTPUT_DIR [none|prepare_trainer|callback]

The last argument is the one Poros line (none: the plain script). Each rank writes ``rank{r}.pt``:
the logged losses, its LoRA tensors and its AdamW state, and how many block fetches Poros made.
"""

from __future__ import annotations

import pathlib
import sys

import torch

from conformance_flows import run_sft
from poros.distributed import leave_process_group


def main() -> None:
    checkpoint, output_dir, line = sys.argv[1], pathlib.Path(sys.argv[2]), sys.argv[3]
    result = run_sft(checkpoint, output_dir, None if line == "none" else line)
    trainer = result.pop("trainer")
    state, store = trainer.accelerator.state, getattr(trainer.model, "store", None)
    torch.save({**result, "world_size": state.num_processes, "backend": state.backend,
                "fetches": sum(store.stats.fetches) if store is not None else 0},
               output_dir / f"rank{state.process_index}.pt")
    # trl/scripts/sft.py ends with trainer.end() (trackers finish, the group is destroyed). Before it every
    # rank leaves the job letting gloo's workers drain first (poros.distributed.leave_process_group): with
    # trainer.end() alone 5 of 24 jobs hung here, the DDP wrapper's last reference joining a gloo worker
    leave_process_group()
    trainer.end()


if __name__ == "__main__":
    main()
