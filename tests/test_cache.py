"""The NF4 block cache and the host tiers: same bytes, same training, bit for bit.

* every tier (``mapped``, ``disk``) trains bitwise equal to the resident reference -- and so to
  ``pinned``, which the parity suite holds to the same reference -- for every family;
* a second load hits the cache (no block weight read or quantized) and trains bitwise like the first;
* any damaged byte of an entry is found before training, reported in one line, and the entry rebuilt;
* a changed quantization or checkpoint file makes a new entry;
* two processes mapping one entry share its pages (PSS from ``/proc/<pid>/smaps``).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import poros
import poros.stream.store
from poros.loading import cache
from poros.errors import CacheEntryError
from poros.testing import TINY_VARIANTS, mapping_memory, save_tiny_checkpoint
from test_parity import BASE_SETUP, assert_bitwise, make_batch, parity_setups, run_parity, train

pytestmark = pytest.mark.usefixtures("one_torch_thread")
CASES = [(family, variant) for family, variants in TINY_VARIANTS.items() for variant in variants]


@pytest.mark.parametrize("tier", ["mapped", "disk"])
@pytest.mark.parametrize(("family", "variant"), CASES, ids=[f"{f}-{v}" for f, v in CASES])
def test_every_tier_trains_bitwise(family, variant, tier, tmp_path):
    streamed = run_parity(family, variant, BASE_SETUP, tmp_path, host_tier=tier, read_ahead=2,
                          cache_dir=str(tmp_path / "cache"))
    assert streamed.host_plan.tier == tier
    assert type(streamed.store.host_tier).__name__ == {"mapped": "MappedTier", "disk": "DiskTier"}[tier]
    if tier == "disk":
        assert streamed.store.host_tier.stats["reads"] > 0
    batch = make_batch(0, 1, 10, "none")
    with torch.no_grad():
        before = streamed(**batch).logits
        after = streamed.unpatch()(**batch, use_cache=False).logits  # every block back from its tier
    assert torch.equal(before, after)


@pytest.mark.parametrize(("family", "variant"), [("qwen3", "default"), ("gemma4", "e2b"), ("qwen3_5", "default")])
def test_tiers_keep_parity_on_drawn_configs(family, variant):
    """Hypothesis draws the model, batch and LoRA (as the parity suite does), the tier, the read-ahead
    depth and a resident block (the disk tier then reads around it)."""
    @settings(max_examples=3, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(setup=parity_setups(family, variant), tier=st.sampled_from(["mapped", "disk"]),
           read_ahead=st.integers(2, 4), resident=st.integers(0, 1))
    def check(setup, tier, read_ahead, resident):
        with tempfile.TemporaryDirectory() as directory:
            run_parity(family, variant, setup, pathlib.Path(directory), host_tier=tier, read_ahead=read_ahead,
                       resident_blocks=resident, cache_dir=str(pathlib.Path(directory) / "cache"))

    check()


# -- the cache ------------------------------------------------------------------------------------
def _batches(seed: int):
    return [make_batch(seed + s, 2, 16, "left") for s in range(2)]


def cached_run(path, cache_dir, *, tier: str | None = None, seed: int = 3, **load_options):
    """load_pretrained (through the cache when ``cache_dir``) + PEFT LoRA (random lora_B) + prepare + 2 AdamW steps."""
    from conformance_flows import lora_model
    from poros.loading.load import load_pretrained

    loaded = load_pretrained(path, device="cpu", load_tokenizer=False, cache_dir=cache_dir, **load_options)
    model = lora_model(loaded.model, seed=seed)
    streamed = poros.prepare(model, host_tier=tier, cache_dir=str(cache_dir) if cache_dir else None)
    # unset, the tier is the entry's mapping for a model loaded through the cache, else pinned copies
    assert streamed.host_plan.tier == tier or (tier is None and streamed.host_plan.tier == (
        "mapped" if cache_dir else "pinned"))
    losses, optimizer = train(streamed, streamed.trainable_parameters(), _batches(seed))
    return model, losses, optimizer


@pytest.fixture
def block_weights_loaded(monkeypatch):
    """The decoder-block tensors transformers read, converted (quantized) and set (a cached load sets none)."""
    from transformers import core_model_loading

    names = []
    original = core_model_loading.set_param_for_module

    def recording(model, target_name, *args, **kwargs):
        if ".layers." in target_name:
            names.append(target_name)
        return original(model, target_name, *args, **kwargs)

    monkeypatch.setattr(core_model_loading, "set_param_for_module", recording)
    return names


@pytest.mark.parametrize(("family", "variant"), CASES, ids=[f"{f}-{v}" for f, v in CASES])
def test_second_load_hits_the_cache_and_trains_bitwise(family, variant, tmp_path, block_weights_loaded):
    path = save_tiny_checkpoint(tmp_path / "ckpt", family, variant, seed=3)
    root = tmp_path / "cache"
    reference = cached_run(path, None, double_quant=True)  # no cache at all
    assert block_weights_loaded and not root.exists()
    block_weights_loaded.clear()
    first = cached_run(path, root, double_quant=True)  # cold: quantizes and writes the entry
    assert block_weights_loaded
    [entry] = cache.list_entries(root)
    block_weights_loaded.clear()
    second = cached_run(path, root, double_quant=True)  # warm: maps the entry
    assert not block_weights_loaded, f"a cached load read block weights, e.g. {block_weights_loaded[:2]}"
    assert [e.name for e in cache.list_entries(root)] == [entry.name]
    for run in (first, second):
        assert_bitwise(reference[0], run[0], reference[1], run[1], reference[2], run[2])


def test_a_chosen_mapped_tier_the_device_will_not_register_serves_pinned_copies(tmp_path, monkeypatch):
    """Where cudaHostRegister refuses the mapping, a mapped tier the planner chose (not one asked for) serves
    pinned copies of the blocks, as the pinned tier would, instead of copying from pageable memory."""
    import poros.stream.tiers as tiers
    from poros.loading.load import load_pretrained

    path = save_tiny_checkpoint(tmp_path / "ckpt", "qwen3", seed=2)
    loaded = load_pretrained(path, device="cpu", load_tokenizer=False, cache_dir=tmp_path / "cache")
    layers = list(loaded.model.model.layers)
    layouts = {i: layout for i, layout in enumerate(poros.stream.store.block_layouts(layers))}
    monkeypatch.setattr(tiers, "register_for_dma", lambda mapping, copy_if_refused=False: False)
    registered = []

    class Runtime:  # no CUDA here: the copies' own registration is recorded, the copy is the point
        def cudaHostRegister(self, pointer, nbytes, flags):
            registered.append((pointer, nbytes))
            return 0

        def cudaHostUnregister(self, pointer):
            registered.remove(next(r for r in registered if r[0] == pointer))
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", Runtime)
    for chosen in (True, False):
        tier = tiers.make_host_tier("mapped", loaded.model.poros_block_file, chosen=chosen)
        tier.attach(layouts, torch.device("cuda"))
        mapping = tier.file.shared_mapping()
        for index in layouts:
            buffer = tier.host_buffer(index)
            inside = mapping.data_ptr() <= buffer.data_ptr() < mapping.data_ptr() + mapping.numel()
            assert inside is not chosen  # chosen: its own copy; asked for: the mapping itself
            assert torch.equal(buffer, tier.file.block_view(index, shared=True))
        # one registered buffer of the copies' own size (not each rounded up to a power of two)
        assert len(registered) == int(chosen) and (not chosen or registered[0][1] < 2 * sum(tier.file.nbytes))
        tier.close()
        assert not registered


def test_cache_is_used_by_every_tier(tmp_path):
    path = save_tiny_checkpoint(tmp_path / "ckpt", "qwen3", seed=2)
    root = tmp_path / "cache"
    reference = cached_run(path, None)
    for tier in ("pinned", "mapped", "disk"):
        run = cached_run(path, root, tier=tier)
        assert_bitwise(reference[0], run[0], reference[1], run[1], reference[2], run[2])
    assert not list((root / "spill").glob("*")), "the cached blocks were spilled instead of served from the entry"


@pytest.mark.parametrize("family", ["gemma3", "qwen3_5"])
def test_multimodal_checkpoint_hits_the_cache(family, tmp_path, block_weights_loaded):
    """Text keys under model.language_model.* (renamed on load) are skipped and served from the entry too."""
    from poros.testing import tiny_vlm

    tiny_vlm(family, seed=4).save_pretrained(tmp_path / "vlm", max_shard_size="200KB")
    reference = cached_run(tmp_path / "vlm", None)
    cached_run(tmp_path / "vlm", tmp_path / "cache")
    block_weights_loaded.clear()
    second = cached_run(tmp_path / "vlm", tmp_path / "cache")
    assert not block_weights_loaded
    assert_bitwise(reference[0], second[0], reference[1], second[1], reference[2], second[2])


@pytest.fixture(scope="module")
def tiny_entry(tmp_path_factory):
    """A cache root holding one entry of a tiny qwen3 checkpoint: ``(checkpoint, root, entry directory)``."""
    from poros.loading.load import load_pretrained

    directory = tmp_path_factory.mktemp("entry")
    path = save_tiny_checkpoint(directory / "ckpt", "qwen3", seed=6)
    load_pretrained(path, device="cpu", load_tokenizer=False, cache_dir=directory / "cache", double_quant=True)
    [entry] = [d for d in (directory / "cache").iterdir() if d.is_dir()]
    return path, directory / "cache", entry


def _copy_entry(entry: pathlib.Path, root: pathlib.Path) -> pathlib.Path:
    import shutil

    shutil.copytree(entry, root / entry.name)
    return root / entry.name


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_damaged_byte_of_an_entry_is_found(tiny_entry, data):
    _, _, entry = tiny_entry
    with tempfile.TemporaryDirectory() as scratch:
        copy = _copy_entry(entry, pathlib.Path(scratch))
        name = data.draw(st.sampled_from([cache.BLOCKS, cache.MANIFEST]))
        raw = bytearray((copy / name).read_bytes())
        position = data.draw(st.integers(0, len(raw) - 1))
        raw[position] ^= data.draw(st.integers(1, 255))
        (copy / name).write_bytes(bytes(raw))
        with pytest.raises(CacheEntryError):
            cache.open_entry(pathlib.Path(scratch), copy.name)


def test_a_damaged_entry_is_reported_in_one_line_rebuilt_and_never_trained_on(tiny_entry, tmp_path, caplog):
    path, _, entry = tiny_entry
    root = tmp_path / "cache"
    copy = _copy_entry(entry, root)
    good = (entry / cache.BLOCKS).read_bytes()
    raw = bytearray(good)
    raw[len(raw) // 3] ^= 0x10
    (copy / cache.BLOCKS).write_bytes(bytes(raw))
    reference = cached_run(path, None, double_quant=True)
    with caplog.at_level("WARNING", logger="poros"):
        rebuilt = cached_run(path, root, double_quant=True)
    damaged = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
    assert len(damaged) == 1 and "\n" not in damaged[0] and "fails its checksum (xxh3_64)" in damaged[0]
    assert (copy / cache.BLOCKS).read_bytes() == good  # rebuilt from the checkpoint
    assert_bitwise(reference[0], rebuilt[0], reference[1], rebuilt[1], reference[2], rebuilt[2])
    import poros.stream.block_file as block_file

    inode = (copy / cache.BLOCKS).stat().st_ino  # the damaged file's mapping was let go before the rebuild
    assert all(key[1] == inode for key in block_file._MAPPINGS if key[0] == str(copy / cache.BLOCKS))


def test_the_checksum_pass_runs_beside_the_load_and_its_verdict_wins(tiny_entry, tmp_path):
    """The cached load reads the non-block weights while another thread checks the entry: the check is
    under way during the load, its verdict on a damaged entry is raised once the load is done (so the
    entry is rebuilt), and a load that fails or is interrupted (Ctrl-C) stops the check and raises its own."""
    import threading

    from poros.loading.cache_blocks import _load_while_verifying

    _, _, entry = tiny_entry
    sound = cache.CacheEntry(entry, cache.read_manifest(entry))

    def load():
        assert any(t.name.startswith("poros-cache-check") for t in threading.enumerate())
        return "model"

    assert _load_while_verifying(sound, load) == "model"
    copy = _copy_entry(entry, tmp_path)
    raw = bytearray((copy / cache.BLOCKS).read_bytes())
    raw[-5000] ^= 1
    (copy / cache.BLOCKS).write_bytes(bytes(raw))
    damaged = cache.CacheEntry(copy, cache.read_manifest(copy))
    with pytest.raises(CacheEntryError, match="checksum"):
        _load_while_verifying(damaged, lambda: "model")

    class Waiting(cache.CacheEntry):  # a check that runs until it is stopped
        stopped = None

        def verify(self, *, stop=None):
            Waiting.stopped = stop.wait(60)
            if Waiting.stopped:
                raise CacheEntryError("check stopped before it ended")

    for error in (ValueError("transformers failed"), KeyboardInterrupt()):
        def failing():
            raise error

        Waiting.stopped = None
        with pytest.raises(type(error)):
            _load_while_verifying(Waiting(entry, sound.manifest), failing)
        assert Waiting.stopped is True  # stopped, not waited for
    stop = threading.Event()
    stop.set()
    with pytest.raises(CacheEntryError, match="stopped"):
        sound.verify(stop=stop)


def test_an_entry_written_with_crc32s_still_opens_and_its_damage_is_still_found(tiny_entry, tmp_path, monkeypatch):
    """Entries record their checksum kind: xxh3_64, or crc32 where the xxhash package is missing; either
    opens and finds damage, and a kind this installation cannot compute counts as damage (rebuilt)."""
    import poros.stream.block_file as block_file
    from poros.loading.load import load_pretrained

    path, _, entry = tiny_entry
    assert cache.read_manifest(entry)["checksum"] == "xxh3_64"
    monkeypatch.setattr(block_file, "default_checksum", lambda: "crc32")  # as without xxhash
    load_pretrained(path, device="cpu", load_tokenizer=False, cache_dir=tmp_path, double_quant=True)
    [copy] = [d for d in tmp_path.iterdir() if d.is_dir()]
    manifest = cache.read_manifest(copy)
    assert manifest["checksum"] == "crc32"
    assert cache.open_entry(tmp_path, copy.name).block_file().algorithm == "crc32"
    damaged = bytearray((copy / cache.BLOCKS).read_bytes())
    damaged[7] ^= 4
    (copy / cache.BLOCKS).write_bytes(bytes(damaged))
    with pytest.raises(CacheEntryError, match=r"block 0 fails its checksum \(crc32\)"):
        cache.open_entry(tmp_path, copy.name)
    manifest["checksum"] = "md4"  # a kind this installation cannot compute: damaged, so rebuilt
    (copy / cache.MANIFEST).write_bytes(cache._manifest_bytes(manifest))
    with pytest.raises(CacheEntryError, match="cannot compute"):
        cache.open_entry(tmp_path, copy.name)


@pytest.mark.parametrize("algorithm", ["xxh3_64", "crc32"])
def test_the_check_reads_in_chunks_and_finds_damage_past_the_first(tiny_entry, tmp_path, monkeypatch, algorithm):
    """An entry's blocks span many of the check's reads (64 MiB each; 4 KiB here): the running checksum over
    the chunks is the one written, and a byte damaged in a later chunk is still found."""
    import poros.stream.block_file as block_file

    _, _, entry = tiny_entry
    copy = _copy_entry(entry, tmp_path)
    monkeypatch.setattr(block_file, "CHECK_CHUNK", 4096)
    file = cache.CacheEntry(copy, cache.read_manifest(copy)).block_file()
    assert max(file.nbytes) > 4 * 4096
    update, final = block_file.CHECKSUMS[algorithm]
    raw = (copy / cache.BLOCKS).read_bytes()
    file.algorithm = algorithm
    file.checksums = [final(update(raw[o: o + block_file.padded(n)], None)) for o, n in zip(file.offsets, file.nbytes)]
    assert block_file.checksum_file(file, workers=2) == file.checksums
    damaged = bytearray(raw)
    damaged[file.offsets[1] + 3 * 4096 + 17] ^= 0x40
    (copy / cache.BLOCKS).write_bytes(bytes(damaged))
    found = block_file.checksum_file(file, workers=2)
    assert found[1] != file.checksums[1] and found[0] == file.checksums[0]


def test_a_truncated_entry_is_found(tiny_entry, tmp_path):
    _, _, entry = tiny_entry
    copy = _copy_entry(entry, tmp_path)
    with open(copy / cache.BLOCKS, "r+b") as handle:
        handle.truncate(handle.seek(0, 2) - 4096)
    with pytest.raises(CacheEntryError, match="truncated"):
        cache.open_entry(tmp_path, copy.name)


def test_a_changed_quantization_or_checkpoint_file_makes_a_new_entry(tmp_path):
    from poros.loading.load import load_pretrained

    path = save_tiny_checkpoint(tmp_path / "ckpt", "qwen3", seed=7)
    root = tmp_path / "cache"

    def entries():
        return {e.name for e in cache.list_entries(root)}

    def load(**options):
        load_pretrained(path, device="cpu", load_tokenizer=False, cache_dir=root, **options)
        return entries()

    first = load()
    assert len(first) == 1 and load() == first  # same checkpoint and config: the same entry
    assert len(load(double_quant=True)) == 2
    assert len(load(quantization="fp4")) == 3
    assert len(load(compute_dtype="float16")) == 4
    shard = sorted(path.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes())  # same bytes, rewritten: a new mtime is a changed file
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
    assert len(load()) == 5


SHARING_CHILD = """
import sys
from poros.loading import cache
from poros.errors import CacheEntryError
entry = cache.open_entry(cache.cache_root(sys.argv[1]), sys.argv[2])
mapping = entry.block_file().mapping()
print(int(mapping.sum()), flush=True)  # touch every page
sys.stdin.read()
"""


@pytest.mark.skipif(not pathlib.Path("/proc/self/smaps").exists(), reason="needs Linux /proc/<pid>/smaps")
def test_two_processes_mapping_one_entry_share_its_pages(tiny_entry, child_env):
    _, root, entry = tiny_entry
    children = [subprocess.Popen([sys.executable, "-c", SHARING_CHILD, str(root), entry.name], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True, env=child_env()) for _ in range(2)]
    try:
        sums = [child.stdout.readline().strip() for child in children]
        assert sums[0] == sums[1] and sums[0]
        memory = [mapping_memory(child.pid, entry / cache.BLOCKS) for child in children]
    finally:
        for child in children:
            child.communicate("")
    size_kb = (entry / cache.BLOCKS).stat().st_size // 1024
    for rss, pss in memory:
        assert rss >= size_kb  # every page of the entry is resident in both
        assert pss <= rss // 2 + 8, f"Rss {rss} kB, Pss {pss} kB: the pages are not shared"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_shared_host_table_is_the_same_bytes_and_copy_on_write(tmp_path, dtype):
    """share_host_table (the node's ranks' embedding tables): the first call writes the file, read-only, and a
    second maps the same one; the result is a mapping of that file holding the table's values bit for bit
    (also from a non-contiguous table); a write reaches neither the file nor the other mapping; a file of
    other bytes or another size is never used (a warning, the caller keeps its copy) and is removed for the
    next run to write again; aside copies of a killed writer are swept."""
    from poros.stream.tiers import share_host_table

    table = torch.randn(24, 300).to(dtype).t()  # non-contiguous, as a transposed view would be
    expected = table.contiguous().view(torch.uint8)
    path = tmp_path / "host-table-embed_tokens.weight.bin"
    (tmp_path / f".{path.name}.4242.deadbeef.tmp").write_bytes(b"left by a killed writer")
    first, second = share_host_table(table, path), share_host_table(table.clone(), path)
    assert path.stat().st_size == table.numel() * table.element_size()
    assert not path.stat().st_mode & 0o222  # read-only: nothing writes it in place
    assert not list(tmp_path.glob(".*.tmp"))  # the aside copy is gone once linked, the stale one swept
    for shared in (first, second):
        assert shared.dtype == table.dtype and shared.shape == table.shape
        assert torch.equal(shared.view(torch.uint8), expected)
    if pathlib.Path("/proc/self/smaps").exists():
        assert mapping_memory("self", path, mode="rw-p")[0] > 0  # the values are the file's mapped pages
    first[0].fill_(7)  # copy-on-write: this process's page only
    assert torch.equal(second.view(torch.uint8), expected)
    assert path.read_bytes() == expected.numpy().tobytes()
    other = table.clone()
    other[5, 5] += 1
    with pytest.warns(UserWarning, match="stays a private copy"):
        assert share_host_table(other, path) is None
    assert not path.exists()  # removed: the next run writes it afresh
    path.write_bytes(b"\0" * 64)
    with pytest.warns(UserWarning, match="stays a private copy"):
        assert share_host_table(table, path) is None
    assert not path.exists()  # another size: removed too
    assert torch.equal(share_host_table(table, path).view(torch.uint8), expected)  # and written again


# -- the disk tier and the host plan ---------------------------------------------------------------
@pytest.mark.parametrize("held", [0, 1])
def test_disk_tier_reads_every_fetch_ahead_of_use_and_holds_only_its_ring(tmp_path, held):
    from poros.testing import load_qlora

    path = save_tiny_checkpoint(tmp_path / "ckpt", "qwen3", seed=1, num_layers=5)
    model = load_qlora(path)
    sizes = poros.stream.store.packed_block_bytes(list(model.get_base_model().model.layers))
    # held: what the budget holds beyond the ring keeps the first blocks in RAM, never read again
    streamed = poros.prepare(model, host_budget=3 * max(sizes) + sum(sizes[:held]) + 100,
                             cache_dir=str(tmp_path / "cache"))
    plan = streamed.host_plan
    assert (plan.tier, plan.read_ahead, plan.held_blocks) == ("disk", 3, held)
    assert plan.host_bytes == 3 * max(sizes) + sum(sizes[:held]) and (f"the first {held} blocks" in plan.reason) == bool(held)
    assert [block.buffer is not None for block in streamed.store.blocks] == [i < held for i in range(5)]
    tier = streamed.store.host_tier
    assert len(tier.ring) == 3 and tier.stats["held_blocks"] == held
    assert tier.stats["reads"] <= 2  # the held blocks' reads are not the ring's; at most the first read-ahead
    batches = _batches(1)
    streamed.forward_backward(batches)  # warm: the reader is now ahead of the passes
    def ring_fetches():  # fetches of the blocks the ring serves (a held block is never read again)
        return sum(f for i, f in enumerate(streamed.store.stats.fetches) if i >= held)

    before, fetches = dict(tier.stats), ring_fetches()
    for _ in range(2):
        streamed.forward_backward(batches)
        loss = streamed(**batches[0]).loss
        loss.backward()
    fetched = ring_fetches() - fetches
    assert all(f > 0 for f in streamed.store.stats.fetches[:held])  # the held blocks stream too, from RAM
    assert tier.stats["misses"] == before["misses"] == 0, "a block was read on demand instead of ahead"
    assert tier.stats["reads"] - before["reads"] == fetched  # each ring fetch read once, none for nothing


@pytest.mark.parametrize(("family", "variant"), CASES, ids=[f"{f}-{v}" for f, v in CASES])
def test_the_disk_tier_holding_blocks_in_ram_trains_bitwise(family, variant, tmp_path):
    """A host budget above the ring keeps the first blocks in pinned RAM and reads the rest: bitwise resident."""
    from poros import registry
    from poros.descriptor import resolve_path
    from test_parity import load_qlora, train, trainable

    path = save_tiny_checkpoint(tmp_path / "ckpt", family, variant, seed=5, num_layers=5)
    batches = _batches(5)
    reference = load_qlora(path, seed=5)
    ref_losses, ref_opt = train(reference, list(trainable(reference).values()), batches)
    model = load_qlora(path, seed=5)
    causal_lm = model.get_base_model()
    layers = list(resolve_path(causal_lm, registry.for_config(causal_lm.config).decoder_layers))
    sizes = poros.stream.store.packed_block_bytes(layers)
    streamed = poros.prepare(model, host_budget=2 * max(sizes) + sizes[0] + sizes[1], read_ahead=2,
                             cache_dir=str(tmp_path / "cache"))
    assert (streamed.host_plan.tier, streamed.host_plan.held_blocks) == ("disk", 2)
    losses, optimizer = train(streamed, streamed.trainable_parameters(), batches)
    assert streamed.store.host_tier.stats["reads"] > 0
    assert_bitwise(reference, model, ref_losses, losses, ref_opt, optimizer)


def test_host_plan_keeps_blocks_pinned_when_they_fit_and_streams_from_disk_when_not():
    from poros.errors import ConfigError
    from poros.plan.host_tiers import choose_host_tier

    blocks = [100 << 20] * 10
    assert choose_host_tier(blocks).tier == "pinned"
    assert choose_host_tier(blocks, 2 << 30).tier == "pinned"
    plan = choose_host_tier(blocks, 500 << 20)  # a ring of 3, the first 2 blocks held in RAM
    assert (plan.tier, plan.read_ahead, plan.held_blocks, plan.host_bytes) == ("disk", 3, 2, 500 << 20)
    plan = choose_host_tier(blocks, 500 << 20, read_ahead=5)  # the ring asked for takes it all
    assert (plan.tier, plan.read_ahead, plan.held_blocks, plan.host_bytes) == ("disk", 5, 0, 500 << 20)
    plan = choose_host_tier(blocks, 350 << 20)  # nothing more fits beside a ring of 3: the ring grows
    assert (plan.read_ahead, plan.held_blocks) == (3, 0)
    assert choose_host_tier(blocks, 999 << 20).held_blocks == 6  # one block less than all: at least one streams
    assert choose_host_tier(blocks, requested="mapped").tier == "mapped"
    with pytest.raises(ConfigError, match="at least"):
        choose_host_tier(blocks, 150 << 20)
    with pytest.raises(ConfigError, match="host_tier"):
        choose_host_tier(blocks, requested="swap")


def test_host_plan_shares_the_cache_entry_between_the_ranks_of_a_node():
    from poros.plan.host_tiers import choose_host_tier

    blocks = [100 << 20] * 10
    plan = choose_host_tier(blocks, ranks_per_node=4, shared_file=True)
    assert (plan.tier, plan.host_bytes_per_node) == ("mapped", 1000 << 20)  # once per node
    alone = choose_host_tier(blocks, ranks_per_node=4, shared_file=False)  # --no-cache: nothing to map
    assert (alone.tier, alone.host_bytes_per_node) == ("pinned", 4 * (1000 << 20))
    assert "each of the node's 4 ranks holds its own copy" in alone.reason and "--no-cache" in alone.reason
    one = choose_host_tier(blocks, shared_file=True)  # one process loaded through the cache: mapped too
    assert one.tier == "mapped" and "no copy into pinned memory" in one.reason
    assert choose_host_tier(blocks, 2 << 30, shared_file=True).tier == "mapped"  # the budget holds the blocks
    assert choose_host_tier(blocks, ranks_per_node=4, shared_file=True, requested="pinned").tier == "pinned"
    assert choose_host_tier(blocks, 500 << 20, ranks_per_node=4, shared_file=True).tier == "disk"  # the budget rules


def test_cache_command_lists_and_clears_without_torch(tiny_entry, tmp_path, child_env):
    _, root, entry = tiny_entry
    scratch = tmp_path / "cache"
    _copy_entry(entry, scratch)
    script = ("import sys\nfrom poros.cli.main import main\n"
              f"main(['cache', '--cache-dir', {str(scratch)!r}])\n"
              "assert 'torch' not in sys.modules, 'poros cache imported torch'\n")
    listing = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=child_env(),
                             check=True).stdout
    assert entry.name in listing and "nf4+dq bfloat16 cpu" in listing and "1 entry" in listing
    cleared = subprocess.run([sys.executable, "-m", "poros.cli.main", "cache", "clear", "--model", "other/model",
                              "--cache-dir", str(scratch)], capture_output=True, text=True, env=child_env(), check=True)
    assert "removed 0 entries" in cleared.stdout and (scratch / entry.name).is_dir()
    model = cache.read_manifest(scratch / entry.name)["model"]
    subprocess.run([sys.executable, "-m", "poros.cli.main", "cache", "clear", "--model", model, "--cache-dir",
                    str(scratch)], capture_output=True, text=True, env=child_env(), check=True)
    assert not (scratch / entry.name).exists()


def test_cache_bench_dry_run_reports_every_number_it_promises(tmp_path, child_env):
    """python -m tools.checks.cache_bench on the CPU (the GPU run's dry run): start times, per-tier steps, disk read rates."""
    report_path = tmp_path / "cache.json"
    subprocess.run([sys.executable, "-m", "tools.checks.cache_bench", "--model", "tiny", "--device", "cpu", "--steps", "1",
                    "--warmup", "0", "--grad-accum", "2", "--seq", "16", "--dir", str(tmp_path / "work"),
                    "--rounds", "2", "--start-tiers", "auto,pinned", "--json", str(report_path)],
                   cwd=pathlib.Path(__file__).resolve().parents[1], env=child_env(POROS_COMMIT="test"),
                   capture_output=True, text=True, check=True)
    report = json.loads(report_path.read_text())
    assert report["environment"]["commit"] == "test"
    assert set(report["start"]) == {"nocache", "cold", "cached", "cached_warm", "cached_pinned", "cached_pinned_warm"}
    for name, row in report["start"].items():  # each start in a fresh process: its launch counts too
        # the tier a user gets: pinned without an entry, the entry's mapping with one; or the one asked for
        assert row["tier"] == ("pinned" if name in ("nocache", "cached_pinned", "cached_pinned_warm") else "mapped")
        assert row["process_through_first_step_s"] > row["through_first_step_s"] > row["start_s"] > 0
        assert row["process_start_s"] > row["start_s"] >= row["load_s"] + row["lora_s"] + row["prepare_s"]
        assert 0 < row["imports_s"] < row["process_start_s"] and row["first_step_s"] > 0
    assert set(report["speedups"]) == {"cached", "cached_warm", "cached_pinned", "cached_pinned_warm"}
    assert all(v > 0 for row in report["speedups"].values() for v in row.values())
    assert set(report["tiers"]) == {"pinned", "mapped", "disk"}
    for row in report["tiers"].values():  # --rounds 2: each tier ran twice, its median over both rounds' steps
        assert len(row["rounds"]) == 2 and len(row["timed_s"]) == 2 and row["vs_pinned"] > 0
    assert len(report["tiers"]["disk"]["disk_rounds"]) == 2  # each round's read statistics
    assert report["tiers"]["disk"]["host_plan"]["tier"] == "disk"
    disk = report["tiers"]["disk"]["disk"]
    assert disk["bytes_read"] > 0 and disk["gb_per_s_while_reading"] > 0 and report["drive"]["gb_per_s"] > 0


def test_cache_bench_projects_two_depths_to_the_full_depth(tmp_path, child_env):
    """--project: a straight line per start and phase through two depths, read at the shape's full depth; the
    first step scaled from the deeper run, the launch measured, so the measures agree with one another
    (a noisy launch or first step cannot make a projection shorter than its own start)."""
    def report(layers: int, nocache: float, cached: float, launch: float, first: float) -> dict:
        rows = {}
        for name, seconds in (("nocache", nocache), ("cached", cached)):
            rows[name] = {"load_s": seconds - 1, "lora_s": 0.5, "prepare_s": 0.5, "start_s": seconds,
                          "first_step_s": first, "through_first_step_s": seconds + first,
                          "process_start_s": seconds + launch, "process_through_first_step_s": seconds + launch + first}
        return {"model": {"shape": "qwen2.5-32b", "num_hidden_layers": layers, "full_depth": 64},
                "environment": {"commit": "test"}, "start": rows}

    paths = [tmp_path / "a.json", tmp_path / "b.json"]  # given in either order; the shallow run's launch is slower
    paths[0].write_text(json.dumps(report(24, 4 + 2 * 24, 3 + 0.1 * 24, launch=14, first=1.2)))
    paths[1].write_text(json.dumps(report(8, 4 + 2 * 8, 3 + 0.1 * 8, launch=18, first=2.0)))
    out = tmp_path / "projected.json"
    subprocess.run([sys.executable, "-m", "tools.checks.cache_bench", "--project", *map(str, paths), "--json", str(out)],
                   cwd=pathlib.Path(__file__).resolve().parents[1], env=child_env(), capture_output=True, text=True,
                   check=True)
    projected = json.loads(out.read_text())
    assert projected["projection"] and projected["from_layers"] == [8, 24] and projected["full_depth"] == 64
    start = projected["start"]["nocache"]["start_s"]
    assert start["fixed_s"] == pytest.approx(4) and start["per_layer_s"] == pytest.approx(2)
    assert start["at_full_depth_s"] == pytest.approx(4 + 2 * 64)
    cached = 3 + 0.1 * 64
    row = projected["start"]["cached"]
    assert row["first_step_s"]["at_full_depth_s"] == pytest.approx(1.2 * 64 / 24)
    assert row["through_first_step_s"]["at_full_depth_s"] == pytest.approx(cached + 1.2 * 64 / 24)
    assert row["process_start_s"]["at_full_depth_s"] == pytest.approx(cached + 16)  # the launches' mean
    speedup = projected["speedups_at_full_depth"]["cached"]
    assert speedup["start_s"] == pytest.approx((4 + 2 * 64) / cached)
    assert speedup["process_start_s"] == pytest.approx((4 + 2 * 64 + 16) / (cached + 16))


def test_clear_with_a_model_removes_that_models_entries_only(tmp_path):
    names = {}
    for model in ("Qwen/Qwen2.5-7B", "Qwen/Qwen2.5-7B-Instruct"):
        names[model] = cache.entry_name(model, cache.entry_key({"model": model}))
        cache.write_entry(tmp_path, names[model], {"model": model, "blocks": []},
                          lambda path: path.write_bytes(b"") or [])
    assert cache.clear(tmp_path, "Qwen/Qwen2.5-7B") == [names["Qwen/Qwen2.5-7B"]]
    assert [e.name for e in cache.list_entries(tmp_path)] == [names["Qwen/Qwen2.5-7B-Instruct"]]


def test_clear_leaves_a_held_lock_and_a_running_build_alone(tmp_path):
    """`poros cache clear` during another process's build: the lock file it holds stays (a new file in its
    place would let a second build in), so does its temporary; a dead build's leftovers go."""
    name = cache.entry_name("m", cache.entry_key({"model": "m"}))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True).stdout.strip()
    running, finished = tmp_path / f".tmp-{name}-{os.getpid()}", tmp_path / f".tmp-{name}-{dead}"
    aside = tmp_path / f".removing-{name}-{dead}"
    for directory in (running, finished, aside):
        directory.mkdir(parents=True)
    with cache.build_lock(tmp_path, name):
        assert cache.clear(tmp_path) == []
        assert (tmp_path / f"{name}.lock").exists() and running.is_dir()
        assert not finished.exists() and not aside.exists()


def test_an_unwritable_cache_root_loads_without_the_cache(tmp_path, caplog):
    from poros.loading.load import load_pretrained

    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with caplog.at_level("WARNING", logger="poros"):
        loaded = load_pretrained("poros-tiny-qwen3", device="cpu", load_tokenizer=False, cache_dir=blocker / "cache")
    assert any("cannot use the NF4 block cache" in r.getMessage() for r in caplog.records)
    assert getattr(loaded.model, "poros_block_file", None) is None


@pytest.mark.parametrize("tier", ["mapped", "disk"])
def test_a_tier_with_every_block_resident_serves_nothing(tier, tmp_path):
    streamed = run_parity("qwen3", "default", {**BASE_SETUP, "config": {"num_layers": 2}}, tmp_path, host_tier=tier,
                          resident_blocks=2, cache_dir=str(tmp_path / "cache"))
    assert streamed.store.resident_blocks == (0, 1)
    streamed.unpatch()


@pytest.mark.parametrize("tier", ["mapped", "disk"])
def test_a_tier_saves_and_loads_like_the_plain_model(tier, tmp_path):
    """An evicted block served by a tier (no pinned buffer of its own) still saves its real bytes, and a
    load_state_dict into it is what the next forward computes with (the tier's file is never written)."""
    from conformance_flows import load
    from test_conformance_save import assert_saves_and_loads_like

    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt", "qwen3", seed=7)
    plain = load(checkpoint, double_quant=True)
    streamed = poros.prepare(load(checkpoint, double_quant=True), host_tier=tier, cache_dir=str(tmp_path / "cache"))
    assert streamed.host_plan.tier == tier and streamed.store.host_tier.name == tier
    assert_saves_and_loads_like(plain, streamed, tmp_path)
    streamed.unpatch()


def test_the_mapped_tier_streams_from_a_shared_read_only_mapping_of_the_entry(tmp_path):
    """The DMA source is the page cache's own pages, mapped shared and read-only in every process (the
    H200 registered such a mapping in 0.16 s per GiB and copied it at 53.5 GB/s, against 0.87 s and 45.6
    GB/s for the copy-on-write one: registry/results/h200-2026-12-01/host-register.json); a load into an
    evicted block goes to the copy-on-write mapping instead (test_a_tier_saves_and_loads_like_the_plain_model)."""
    from conformance_flows import load

    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt", "qwen3", seed=7)
    streamed = poros.prepare(load(checkpoint), host_tier="mapped", cache_dir=str(tmp_path / "cache"))
    tier = streamed.store.host_tier
    path = str(tier.file.path)
    modes = {line.split()[1] for line in pathlib.Path("/proc/self/maps").read_text().splitlines()
             if path in line}  # a spill file's name ends in " (deleted)"
    assert "r--s" in modes  # shared, read-only
    shared = tier.file.shared_mapping()
    start, end = shared.data_ptr(), shared.data_ptr() + shared.numel()
    for block in streamed.store.blocks:
        assert start <= tier.host_buffer(block.index).data_ptr() < end
        assert start <= block.buffer.data_ptr() < end  # what fetch copies from
        assert not start <= tier.lend(block.index).data_ptr() < end  # the writable copy-on-write one
    streamed.unpatch()
