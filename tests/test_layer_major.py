"""Layer-major gradient accumulation is bit-for-bit ordinary (micro-major) accumulation, resident.

For every family and tiny variant, hypothesis draws a config, M micro-batches (padding, lengths) and
a number of optimizer steps. The reference is the resident HF + bitsandbytes + PEFT model doing
``for mb: model(**mb, num_items_in_batch=N).loss.backward()`` then ``AdamW.step()``; Poros runs
``PorosModel.forward_backward(micro_batches)`` -- each block fetched once per direction per step.
``torch.equal`` on every loss, LoRA tensor and AdamW state tensor.
"""

from __future__ import annotations

import pathlib
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings

import poros
from poros.errors import StreamingError
from poros.stream.stash import DiskStash, HostStash
from poros.testing import TINY_VARIANTS, load_qlora, save_tiny_checkpoint
from poros.testing.strategies import min_layers, tiny_setups
from test_parity import make_batch, trainable, assert_bitwise

CASES = [(family, variant) for family, variants in TINY_VARIANTS.items() for variant in variants]


def with_item_counts(micro_batches: list[dict]) -> list[dict]:
    """HF accumulation semantics: every micro-batch's loss is a sum over all the step's loss terms."""
    items = sum(int((mb["labels"][..., 1:] != -100).sum()) for mb in micro_batches)
    return [{**mb, "num_items_in_batch": torch.tensor(items)} for mb in micro_batches]


def resident_steps(model, steps: list[list[dict]], *, max_grad_norm: float | None = None, **options):
    """The resident reference: micro-major accumulation, optional clipping, AdamW (lr 1e-2 unless ``options``)."""
    parameters = list(trainable(model).values())
    optimizer = torch.optim.AdamW(parameters, **{"lr": 1e-2, **options})
    losses = []
    for micro_batches in steps:
        for mb in micro_batches:
            loss = model(**mb, use_cache=False).loss
            loss.backward()
            losses.append(loss.detach())
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(parameters, max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses, optimizer


def layer_major_steps(streamed, steps: list[list[dict]]):
    optimizer = torch.optim.AdamW(streamed.trainable_parameters(), lr=1e-2)
    losses = []
    for micro_batches in steps:
        losses.extend(streamed.forward_backward(micro_batches))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses, optimizer


def setups(family: str, variant: str):
    """2 to 4 micro-batches a step, the variant's default widths."""
    return tiny_setups(family, variant, micro_batches=(2, 4), seq=(9, 20), lora_ranks=(2, 8))


def run(family: str, variant: str, setup: dict, directory: pathlib.Path, boundary_states: str = "device",
        **options):
    try:
        path = save_tiny_checkpoint(directory / "ckpt", family, variant, seed=setup["seed"], **setup["config"])
    except ValueError:
        assume(False)
    lora = {"lora_rank": setup["lora_rank"], "lora_alpha": 16, "seed": setup["seed"]}
    steps = [with_item_counts([make_batch(setup["seed"] + 10 * s + m, setup["batch"], setup["seq"], setup["padding"])
                               for m in range(setup["micro_batches"])])
             for s in range(setup["steps"])]
    reference = load_qlora(path, **lora)
    ref_losses, ref_opt = resident_steps(reference, steps)
    model = load_qlora(path, **lora)
    streamed = poros.prepare(model, boundary_states=boundary_states, **options)
    streamed.store.stats.reset()
    poros_losses, poros_opt = layer_major_steps(streamed, steps)
    assert_bitwise(reference, model, ref_losses, poros_losses, ref_opt, poros_opt)
    streamed.losses = poros_losses  # for tests comparing placements with each other
    # each block crosses the link at most twice per optimizer step, whatever M is
    assert max(streamed.store.stats.fetches) <= 2 * len(steps)
    return streamed


@pytest.mark.parametrize(("family", "variant"), CASES, ids=[f"{f}-{v}" for f, v in CASES])
def test_layer_major_accumulation_is_bitwise_resident_accumulation(family, variant):
    @settings(max_examples=3, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(setup=setups(family, variant))
    def check(setup):
        with tempfile.TemporaryDirectory() as directory:
            run(family, variant, setup, pathlib.Path(directory))

    check()


FIXED_SETUP = {"config": {"num_layers": 3, "num_heads": 4, "num_kv_heads": 2, "attn_implementation": "sdpa"},
               "seed": 7, "micro_batches": 3, "batch": 2, "seq": 14, "padding": "left", "lora_rank": 4, "steps": 2}


@pytest.mark.parametrize(("family", "variant"), CASES, ids=[f"{f}-{v}" for f, v in CASES])
def test_boundary_states_on_the_host_are_bitwise_too(family, variant, tmp_path, monkeypatch):
    """prepare(boundary_states="host"): every block input but the prelude's goes out to the stash
    and comes back for backward (on CPU through the same bookkeeping), and the run stays bitwise."""
    from poros.stream import executor

    taken = []
    original = HostStash.take
    monkeypatch.setattr(HostStash, "take", lambda self, key: taken.append(key) or original(self, key))
    setup = {**FIXED_SETUP, "config": {**FIXED_SETUP["config"],
                                       "num_layers": max(3, min_layers(family, variant))}}
    streamed = run(family, variant, setup, tmp_path, boundary_states="host")
    layers = len(streamed.executor.layers)
    assert streamed.executor.boundary_states == "host"
    assert len(taken) == setup["steps"] * setup["micro_batches"] * (layers - 1)
    assert sorted(set(taken)) == [(m, i) for m in range(setup["micro_batches"]) for i in range(1, layers)]


@pytest.mark.parametrize("placement", ["device", "host"])
def test_boundary_states_held_in_backward_are_what_the_planner_counts(placement, tmp_path, monkeypatch):
    """At the entry of every block's backward, the block-input-sized tensors alive (outside the host
    stash) are at most what the planner's peak model counts: M(L+1) on the device (all inputs + the
    gradients), 4M with the host stash (the prelude's, this block's, the next block's, the gradients).
    With the host stash the next block's states are asked for before this block's are used, and
    nothing is left in the stash at the end."""
    import gc

    from poros.stream import executor

    layers, micro, batch, seq = 6, 3, 2, 14
    path = save_tiny_checkpoint(tmp_path / "ckpt", "qwen3", seed=5, num_layers=layers)
    streamed = poros.prepare(load_qlora(path, seed=5), boundary_states=placement)
    hidden_size = streamed.config.hidden_size
    stashes, log, alive = [], [], []
    original_init, original_fetch, original_take = (HostStash.__init__, HostStash.fetch,
                                                     HostStash.take)
    monkeypatch.setattr(HostStash, "__init__",
                        lambda self, *a: (original_init(self, *a), stashes.append(self))[0])
    monkeypatch.setattr(HostStash, "fetch",
                        lambda self, key: (log.append(("fetch", key)), original_fetch(self, key))[1])
    monkeypatch.setattr(HostStash, "take",
                        lambda self, key: (log.append(("take", key)), original_take(self, key))[1])

    def count() -> int:
        stashed = {t.untyped_storage().data_ptr() for stash in stashes for t in stash.host.values()}
        return len({o.untyped_storage().data_ptr() for o in gc.get_objects()
                    if isinstance(o, torch.Tensor) and tuple(o.shape) == (batch, seq, hidden_size)} - stashed)

    original_backward = executor.StreamingExecutor._backward_block
    monkeypatch.setattr(executor.StreamingExecutor, "_backward_block",
                        lambda self, *a, **k: (alive.append(count()), original_backward(self, *a, **k))[1])
    streamed.forward_backward(with_item_counts([make_batch(s, batch, seq, "none") for s in range(micro)]))
    bound = micro * (layers + 1) if placement == "device" else 4 * micro
    assert len(alive) == layers * micro and max(alive) <= bound, alive
    if placement == "host":
        (stash,) = stashes
        assert not stash.host and not stash.back
        for index in range(2, layers):
            first_take = log.index(("take", (0, index)))
            assert log.index(("fetch", (0, index - 1))) < first_take  # the next block is on its way first


@pytest.mark.parametrize(("family", "variant"), CASES, ids=[f"{f}-{v}" for f, v in CASES])
def test_boundary_states_on_disk_are_bitwise_device_host_and_resident(family, variant, tmp_path, monkeypatch):
    """prepare(boundary_states="disk"): every block input but the prelude's is written to a file under the
    cache's spill/ directory and read back for backward; losses, LoRA tensors and AdamW states are bitwise
    the resident run's (``run`` checks) and the device and host placements'; the files are gone after
    each step."""
    written, listed = [], []
    original_put, original_close = DiskStash.put, DiskStash.close

    def put(self, key, tensor):
        original_put(self, key, tensor)
        written.append(key)
        assert self.files[key].is_file() and self.files[key].parent.parent == tmp_path / "cache" / "spill"

    def close(self):
        listed.append(sorted(p.name for p in self.directory.iterdir()))  # what is left when the step ends
        original_close(self)

    monkeypatch.setattr(DiskStash, "put", put)
    monkeypatch.setattr(DiskStash, "close", close)
    setup = {**FIXED_SETUP, "config": {**FIXED_SETUP["config"],
                                       "num_layers": max(3, min_layers(family, variant))}}
    results = {}
    for placement in ("device", "host", "disk"):
        streamed = run(family, variant, setup, tmp_path / placement, boundary_states=placement,
                       cache_dir=str(tmp_path / "cache"))
        assert streamed.executor.boundary_states == placement
        results[placement] = (streamed.losses, [p.detach().clone() for p in streamed.trainable_parameters()])
    layers = len(streamed.executor.layers)
    assert len(written) == setup["steps"] * setup["micro_batches"] * (layers - 1)
    assert listed == [[]] * setup["steps"]  # every state was read back: nothing left, nothing lost
    assert list((tmp_path / "cache" / "spill").iterdir()) == []  # each step's directory removed
    for placement in ("host", "disk"):
        losses, tensors = results[placement]
        assert all(torch.equal(a, b) for a, b in zip(losses, results["device"][0]))
        assert all(torch.equal(a, b) for a, b in zip(tensors, results["device"][1]))


def test_a_failing_step_leaves_no_boundary_state_file_behind(tmp_path, monkeypatch):
    """A step that fails in backward (after every state went to disk) removes its directory and the files
    still in it; the next step of the same model runs and is bitwise the resident one."""
    from poros.stream import executor

    path = save_tiny_checkpoint(tmp_path / "ckpt", "qwen3", seed=5, num_layers=4)
    streamed = poros.prepare(load_qlora(path, seed=5), boundary_states="disk", cache_dir=str(tmp_path / "cache"))
    spill = tmp_path / "cache" / "spill"
    original_backward = executor.StreamingExecutor._backward_block
    seen = []

    def failing(self, step, index, *args, **kwargs):
        seen.append(sorted(p.name for d in spill.iterdir() for p in d.iterdir()))
        raise RuntimeError("out of memory (simulated)")

    monkeypatch.setattr(executor.StreamingExecutor, "_backward_block", failing)
    micro_batches = with_item_counts([make_batch(s, 2, 12, "none") for s in range(2)])
    with pytest.raises(RuntimeError, match="simulated"):
        streamed.forward_backward(micro_batches)
    # M x (L - 1) states went to disk; when the first backward block fails, its own and the next block's are
    # read back already (one block ahead), the first block's still wait in their files
    assert seen[0] == ["0-1.pt", "1-1.pt"]
    assert list(spill.iterdir()) == []
    monkeypatch.setattr(executor.StreamingExecutor, "_backward_block", original_backward)
    for p in streamed.trainable_parameters():
        p.grad = None
    losses = streamed.forward_backward(micro_batches)
    reference = load_qlora(path, seed=5)
    ref_losses = [reference(**mb, use_cache=False).loss for mb in micro_batches]
    assert all(torch.equal(a, b.detach()) for a, b in zip(losses, ref_losses))
    assert list(spill.iterdir()) == []


def test_boundary_states_option_is_checked(tmp_path):
    path = save_tiny_checkpoint(tmp_path / "ckpt", "qwen3", seed=5, num_layers=2)
    with pytest.raises(poros.errors.ConfigError, match="boundary_states='swap'.*'device', 'host'.*'disk'"):
        poros.prepare(load_qlora(path, seed=5), boundary_states="swap")


def test_micro_batch_order_matters_so_the_test_can_fail(tmp_path):
    """Negative control: accumulating the same micro-batches in reverse order changes the bits."""
    path = save_tiny_checkpoint(tmp_path / "ckpt", "qwen3", seed=5, num_layers=2)
    micro_batches = with_item_counts([make_batch(5 + m, 2, 16, "left") for m in range(4)])
    forward_order, _ = resident_steps(load_qlora(path, seed=5), [micro_batches])
    grads = []
    for order in (micro_batches, micro_batches[::-1]):
        model = load_qlora(path, seed=5)
        for mb in order:
            model(**mb, use_cache=False).loss.backward()
        grads.append([p.grad.clone() for p in trainable(model).values()])
    assert any(not torch.equal(a, b) for a, b in zip(*grads))


def test_dropout_is_refused_with_the_fix(tmp_path):
    import peft

    path = save_tiny_checkpoint(tmp_path / "ckpt", "qwen3", num_layers=1)
    model = load_qlora(path)
    for module in model.modules():
        if isinstance(module, peft.tuners.lora.LoraLayer):
            module.lora_dropout["default"] = torch.nn.Dropout(0.1)
    streamed = poros.prepare(model)
    with pytest.raises(StreamingError, match="lora_dropout=0"):
        streamed.forward_backward(with_item_counts([make_batch(0, 1, 12, "none")] * 2))
