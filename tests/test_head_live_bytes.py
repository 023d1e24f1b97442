"""What the head and the chunked loss keep alive, counted on the CPU, against what the planner prices (issue 43).

The H200's 72B run at 128K tokens under an 80 GB cap died in its head phase, allocating one fp32 chunk of the
logits, with far more alive than the plan's turn (``tools/checks/long_context_run.py``'s record). Counted
here tensor by tensor (``poros.testing.live_bytes``) on a real transformers Qwen2 with Qwen2.5's vocabulary:

* the head and the chunked loss hold one chunk's working set and nothing across chunks: at the head phase's
  peak the only vocabulary-wide tensors alive are one chunk's three fp32 ones (the log-softmax output, the
  gradient ``nll_loss`` gives it, the gradient it gives), within the planner's head and loss parts;
* the extra bytes were the boundary states: ``PorosTrainer`` ran a step of one micro-batch micro-major
  (only gradient accumulation, host-kept LoRA tensors or CUDA graphs turned layer-major on), and a
  micro-major step keeps its kept block inputs on the device (autograd saves them), so every state the
  plan put in pinned memory (``boundary_states="host"``) was on the card. A step of one micro-batch now
  runs layer-major when the states are to wait off the device.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import poros
from poros.stream import executor as executor_module
from poros.stream.stash import HostStash
from poros.testing import load_qlora, save_tiny_checkpoint
from poros.testing.live_bytes import LiveBytes

VOCAB = 152064  # Qwen2.5's: the head's logits are what the loss chunks divide
HIDDEN = 64
TINY = dict(hidden_size=HIDDEN, intermediate_size=224, num_attention_heads=4, num_key_value_heads=1,
            max_shard_size="2GB")


class Phases:
    """A :class:`LiveBytes` count of a layer-major step with its head phase marked: the live bytes when the
    head starts and their peak from then to the first block's backward (the head, the loss and their backward)."""

    def __init__(self, monkeypatch) -> None:
        self.count, self.at_start, self.peak, self.at_peak = LiveBytes(), None, None, None
        switched, backward_block = executor_module.StreamingExecutor._switched, \
            executor_module.StreamingExecutor._backward_block

        @contextlib.contextmanager
        def marking(executor, state):
            if state.phase.name == "HEAD" and self.at_start is None:
                self.at_start = self.count.live
                self.count.peak = self.count.live  # the head phase's own peak from here
            with switched(executor, state):
                yield

        def ending(executor, *args, **kwargs):
            if self.peak is None:
                self.peak, self.at_peak = self.count.peak, list(self.count.at_peak)
            return backward_block(executor, *args, **kwargs)

        monkeypatch.setattr(executor_module.StreamingExecutor, "_switched", marking)
        monkeypatch.setattr(executor_module.StreamingExecutor, "_backward_block", ending)


def test_the_chunked_head_holds_one_chunk_within_the_planners_head_parts(tmp_path, monkeypatch):
    from poros.plan.footprint import activation_parts, model_shapes

    seq, chunks = 1024, 8
    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt", "qwen2", vocab_size=VOCAB, num_hidden_layers=2, **TINY)
    model = poros.prepare(load_qlora(checkpoint, attn_implementation="sdpa"), loss_chunks=chunks)
    ids = torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(0))
    phases = Phases(monkeypatch)
    with phases.count:
        model.forward_backward([{"input_ids": ids, "labels": ids.clone(), "use_cache": False}])
    # what the head phase made and held at once, less the head's weight: a transposed view of it is the first
    # op output that names its storage (persistent, priced with the modules outside the blocks)
    weight = [nbytes for op, shape, _, nbytes in phases.at_peak if shape == (HIDDEN, VOCAB)]
    held = phases.peak - phases.at_start - sum(weight)

    inner = model.get_base_model()
    shapes, value_bytes, attention = model_shapes(inner, list(inner.model.layers), torch.bfloat16)
    estimate = activation_parts(shapes, batch_size=1, seq_len=seq, value_bytes=value_bytes,
                                attn_implementation=attention, loss_chunks=chunks)
    parts, head = dict(estimate.named()), estimate.head  # head: the head and loss parts, what the turn adds
    one_chunk = seq // chunks * VOCAB * 4  # one chunk's fp32 logits
    assert parts[f"loss: fp32 working set, one of {chunks} chunks"] == 3 * one_chunk
    # vocabulary-wide tensors alive at the peak: one chunk's three fp32 ones, no other chunk's, nothing whole
    wide = [(op, shape, dtype) for op, shape, dtype, _ in phases.at_peak
            if shape and shape[-1] == VOCAB and shape != (HIDDEN, VOCAB)]
    assert sorted(dtype for _, _, dtype in wide) == ["float32"] * 3, wide
    assert all(shape[0] == seq // chunks for _, shape, _ in wide), wide
    # the planner's head and loss parts hold it (the rest of the turn -- the final norm's input and output,
    # the trunk output's gradient -- is a few [seq, hidden] tensors, well inside its one-chunk margin)
    assert 3 * one_chunk <= held <= head, (held, head, phases.at_peak)


def hidden_sized_on_device(count: LiveBytes, stash_copies: set[int], seq: int) -> int:
    """The ``[1, seq, hidden]`` bf16 storages alive now, less the host stash's copies (the "host" is the
    device on a CPU)."""
    return sum(1 for pointer, (ref, nbytes, what) in count._storages.items()
               if not torch.UntypedStorage._expired(ref) and pointer not in stash_copies
               and what[1] == (1, seq, HIDDEN) and what[2] == "bfloat16")


@pytest.mark.parametrize("boundary_states", ["host", "device"])
def test_a_trainer_step_of_one_micro_batch_keeps_the_boundary_states_where_the_plan_put_them(
        boundary_states, tmp_path, monkeypatch):
    """The H200's 128K failure, scaled down: one micro-batch, LoRA on the device, no graphs, the boundary
    states planned off the device. At the head the device holds the prelude's output and the last block's
    (the plan's turn: 3 x M states with the output's gradient); before the fix the trainer's micro-major step
    held every kept block input there as well."""
    from poros.config import PorosConfig
    from poros.training.trainer import PorosTrainer

    seq, every, layers = 256, 2, 8
    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt", "qwen2", vocab_size=512, num_hidden_layers=layers, **TINY)
    # boundary_states is the planner's choice (prepare's option; the 128K plan put them on the host)
    model = poros.prepare(load_qlora(checkpoint, lora_rank=4, lora_alpha=8), boundary_states=boundary_states,
                          boundary_every=every, loss_chunks=2)
    config = PorosConfig(model=str(checkpoint), dataset="synthetic", device="cpu", steps=1, seq_len=seq,
                         batch_size=1, grad_accum=1, output_dir=str(tmp_path / "run"), save_steps=0,
                         logging_steps=1)
    trainer = PorosTrainer(model, None, config)
    count, stash_copies, seen = LiveBytes(), set(), []
    put = HostStash.put

    def noting(stash, key, tensor):
        put(stash, key, tensor)
        stash_copies.add(stash.host[key].untyped_storage().data_ptr())

    monkeypatch.setattr(HostStash, "put", noting)
    trainer.model.executor.final_norm.register_forward_pre_hook(
        lambda module, args: seen.append(hidden_sized_on_device(count, stash_copies, seq)))
    with count:
        trainer.train()
    kept_inputs = len(range(0, layers, every))  # blocks 0, k, 2k...: block 0's is the prelude's output
    if boundary_states == "host":
        # the prelude's output and the last block's: no kept state on the device (micro-major held all 4 there)
        assert seen[0] <= 2, seen
        assert len(stash_copies) == kept_inputs - 1  # ran layer-major: the kept states went to the "host"
    else:
        assert not stash_copies and seen[0] >= kept_inputs  # on the device, as planned


def test_a_plain_loop_with_the_states_planned_off_the_device_is_told_once(tmp_path, caplog):
    """``model(**batch).loss.backward()`` is micro-major: the kept block inputs stay on the device whatever
    ``boundary_states`` says, and the run is told where the plan is honoured."""
    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt", "qwen2", vocab_size=512, num_hidden_layers=4, **TINY)
    model = poros.prepare(load_qlora(checkpoint, lora_rank=4, lora_alpha=8), boundary_states="disk",
                          boundary_every=2)
    ids = torch.randint(0, 512, (1, 64), generator=torch.Generator().manual_seed(0))
    with caplog.at_level("WARNING", logger="poros"):
        for _ in range(2):
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        model.forward_backward([{"input_ids": ids, "labels": ids}])  # layer-major: nothing to say
    said = [r.getMessage() for r in caplog.records if "honoured by layer-major steps only" in r.getMessage()]
    assert len(said) == 1 and "keeps its 2 kept block inputs on the device" in said[0], said
