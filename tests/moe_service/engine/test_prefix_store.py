"""The prefix cache's disk store (moe_service.engine.prefix_store) on a real directory:
round trip of named arrays, the identity (another model file or KV type finds nothing),
corrupted, truncated, torn and foreign files skipped and logged, the size bound evicting the
least recently used first, a restart re-indexing the directory (recency kept), files 0600
whatever the umask, a save that stops at its deadline leaving no partial file; and the
PrefixCache in front of it (spill on eviction, read back on a miss, persist + a new process'
cache reusing the prefix) with a stand-in KV cache."""

from __future__ import annotations

import os
import stat
import time

import numpy as np
import pytest

from moe_service.engine import prefix_store as ps
from moe_service.engine.prefix import PrefixCache
from moe_service.engine.prefix_store import PrefixStore, block_key, store_identity

B = 8  # tokens per block in these tests


@pytest.fixture
def model_file(tmp_path):
    p = tmp_path / "model.gguf"
    p.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    return p


def ident(model_file, **kw):
    args = dict(model_path=model_file, kv_type="f16", n_ctx=512, block_tokens=B, token_bytes=16)
    args.update(kw)
    return store_identity(**args)


def blk(i: int, parent: bytes | None = None):
    tokens = tuple(range(i * B, (i + 1) * B))
    key = block_key(parent, tokens)
    rng = np.random.default_rng(i)
    arrays = {"kv": rng.integers(0, 255, B * 16, dtype=np.uint8),
              "state.3.compressed": rng.standard_normal((2, 5)).astype(np.float32)}
    return key, parent, tokens, arrays


def chain(n: int):
    out, parent = [], None
    for i in range(n):
        b = blk(i, parent)
        out.append(b)
        parent = b[0]
    return out


def files(store: PrefixStore) -> list:
    return sorted(p for p in store.dir.iterdir() if p.suffix == ".blk")


def test_round_trip_of_named_arrays(tmp_path, model_file):
    store = PrefixStore(tmp_path / "pc", ident(model_file), 1 << 20)
    blocks = chain(3)
    for key, parent, tokens, arrays in blocks:
        assert store.write(key, parent, tokens, arrays)
    for key, _parent, tokens, arrays in blocks:
        got = store.get(key, tokens)
        assert set(got) == set(arrays)
        for name in arrays:
            assert got[name].dtype == arrays[name].dtype and got[name].shape == arrays[name].shape
            np.testing.assert_array_equal(got[name], arrays[name])
    key, _, tokens, _ = blocks[0]
    assert store.get(key, tokens[::-1]) is None  # the key with other tokens: not this block
    assert store.get(b"\0" * 16, tokens) is None
    assert store.stats()["loaded"] == 3


def test_files_are_0600_and_dirs_0700_whatever_the_umask(tmp_path, model_file):
    old = os.umask(0o022)
    try:
        store = PrefixStore(tmp_path / "pc", ident(model_file), 1 << 20)
        key, parent, tokens, arrays = blk(0)
        store.write(key, parent, tokens, arrays)
    finally:
        os.umask(old)
    for p in [*files(store), store.dir / "identity.json"]:
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p
    for d in (store.root, store.dir):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    # The units' UMask=0077 changes nothing either.
    old = os.umask(0o077)
    try:
        key, parent, tokens, arrays = blk(1, key)
        store.write(key, parent, tokens, arrays)
    finally:
        os.umask(old)
    assert {stat.S_IMODE(p.stat().st_mode) for p in files(store)} == {0o600}


@pytest.mark.parametrize("change", [{"kv_type": "q8_0"}, {"n_ctx": 1024}, {"block_tokens": 16}, "model"])
def test_identity_rejects_another_model_or_setting(tmp_path, model_file, change):
    root = tmp_path / "pc"
    store = PrefixStore(root, ident(model_file), 1 << 20)
    for b in chain(2):
        store.write(*b)
    if change == "model":  # same name and size, other bytes and mtime: another model file
        data = bytearray(model_file.read_bytes())
        data[10] ^= 0xFF
        model_file.write_bytes(bytes(data))
        os.utime(model_file, ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))
        other = ident(model_file)
    else:
        other = ident(model_file, **change)
    again = PrefixStore(root, other, 1 << 20)
    assert len(again) == 0
    key, _, tokens, _ = chain(1)[0]
    assert again.get(key, tokens) is None
    assert not store.dir.exists()  # the old namespace was removed: its blocks can never be used


def test_engine_version_is_part_of_the_identity(tmp_path, model_file, monkeypatch):
    a = ident(model_file)
    monkeypatch.setattr("moe_service.__version__", "99.0")
    assert ps.namespace_of(ident(model_file)) != ps.namespace_of(a)
    assert a["engine"] == ps.engine_fingerprint() and len(a["engine"]) == 32


def _corrupt_payload(p):
    data = bytearray(p.read_bytes())
    data[-3] ^= 0x55
    p.write_bytes(bytes(data))


def _truncate(p):
    data = p.read_bytes()
    p.write_bytes(data[: len(data) - 10])


def _tear_header(p):
    data = bytearray(p.read_bytes())
    data[ps.PREFIX_BYTES + 5] ^= 0x01
    p.write_bytes(bytes(data))


def _garbage(p):
    p.write_bytes(b"not a block at all" * 10)


@pytest.mark.parametrize("damage,when", [(_corrupt_payload, "read"), (_truncate, "scan"), (_tear_header, "scan"),
                                         (_garbage, "scan")])
def test_damaged_files_are_skipped_and_logged_never_loaded(tmp_path, model_file, damage, when, capsys):
    root = tmp_path / "pc"
    store = PrefixStore(root, ident(model_file), 1 << 20)
    blocks = chain(2)
    for b in blocks:
        store.write(*b)
    victim = store.dir / f"{blocks[1][0].hex()}.blk"
    damage(victim)
    again = PrefixStore(root, ident(model_file), 1 << 20)
    assert len(again) == (2 if when == "read" else 1)
    key, _, tokens, arrays = blocks[1]
    assert again.get(key, tokens) is None  # never loaded
    assert not victim.exists() and again.skipped == 1
    good = again.get(blocks[0][0], blocks[0][2])
    np.testing.assert_array_equal(good["kv"], blocks[0][3]["kv"])
    assert "prefix_store_skipped" in capsys.readouterr().out


def test_foreign_files_are_skipped(tmp_path, model_file, capsys):
    """A block copied in from another store (another namespace in its header), one renamed to
    another key, a leftover temporary file and an unrelated file."""
    other = PrefixStore(tmp_path / "other", ident(model_file, kv_type="q8_0"), 1 << 20)
    key, parent, tokens, arrays = blk(0)
    other.write(key, parent, tokens, arrays)
    store = PrefixStore(tmp_path / "pc", ident(model_file), 1 << 20)
    (store.dir / f"{key.hex()}.blk").write_bytes(files(other)[0].read_bytes())
    k2, p2, t2, a2 = blk(1)
    store.write(k2, p2, t2, a2)
    os.rename(store.dir / f"{k2.hex()}.blk", store.dir / f"{'ab' * 16}.blk")
    (store.dir / f".{'cd' * 16}.123.456.tmp").write_bytes(b"half")
    (store.dir / "README").write_text("hello")
    again = PrefixStore(tmp_path / "pc", ident(model_file), 1 << 20)
    assert len(again) == 0 and again.skipped == 2
    assert again.get(key, tokens) is None
    assert sorted(p.name for p in again.dir.iterdir()) == ["README", "identity.json"]
    out = capsys.readouterr().out
    assert "foreign" in out and "prefix_store_removed_partial" in out


def test_size_bound_evicts_least_recently_used_first(tmp_path, model_file):
    store = PrefixStore(tmp_path / "pc", ident(model_file), 1 << 20)
    blocks = [blk(i) for i in range(5)]
    store.write(*blocks[0])
    one = files(store)[0].stat().st_size
    store.capacity_bytes = 3 * one + one // 2  # room for three blocks
    for b in blocks[1:3]:
        store.write(*b)
    assert store.get(blocks[0][0], blocks[0][2]) is not None  # block 0 used again: now the newest
    store.write(*blocks[3])  # evicts block 1, the least recently used
    store.write(*blocks[4])  # then block 2
    have = {b[0] for b in blocks if store.has(b[0])}
    assert have == {blocks[0][0], blocks[3][0], blocks[4][0]}
    assert len(files(store)) == 3 and store.bytes_used == sum(p.stat().st_size for p in files(store))
    assert store.evicted == 2


def test_restart_reindexes_the_directory_with_its_recency(tmp_path, model_file):
    root = tmp_path / "pc"
    store = PrefixStore(root, ident(model_file), 1 << 20)
    blocks = [blk(i) for i in range(4)]
    for i, b in enumerate(blocks):
        store.write(*b)
        os.utime(store.dir / f"{b[0].hex()}.blk", ns=(10**18 + i * 10**9, 10**18 + i * 10**9))
    one = files(store)[0].stat().st_size
    assert store.get(blocks[0][0], blocks[0][2]) is not None  # refreshes its mtime: now the newest
    again = PrefixStore(root, ident(model_file), 3 * one)  # a smaller bound at start: the oldest go
    assert len(again) == 3 and not again.has(blocks[1][0])
    for b in (blocks[0], blocks[2], blocks[3]):
        np.testing.assert_array_equal(again.get(b[0], b[2])["state.3.compressed"], b[3]["state.3.compressed"])


def test_spill_is_written_by_the_writer_thread(tmp_path, model_file):
    store = PrefixStore(tmp_path / "pc", ident(model_file), 1 << 20)
    key, parent, tokens, arrays = blk(0)
    assert store.spill(key, parent, tokens, arrays)
    assert store.has(key) and store.get(key, tokens) is not None  # readable while queued
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not files(store):
        time.sleep(0.01)
    assert files(store) and not store.spill(key, parent, tokens, arrays)  # stored: not again
    store.close()


def test_spill_drops_beyond_the_queue_bound(tmp_path, model_file):
    store = PrefixStore(tmp_path / "pc", ident(model_file), 1 << 20, max_pending_bytes=1)
    assert not store.spill(*blk(0)) and store.dropped == 1


def test_save_writes_in_order_until_the_deadline(tmp_path, model_file):
    root = tmp_path / "pc"
    store = PrefixStore(root, ident(model_file), 1 << 20)
    blocks = chain(4)
    store.write(*blocks[0])
    out = store.save(blocks, time.monotonic() + 30)
    assert out["written"] == 3 and out["already"] == 1 and out["left_out"] == 0
    # Written first = most recently used at the next start: the last to be evicted.
    again = PrefixStore(root, ident(model_file), 1 << 20)
    order = list(again._index)
    assert order.index(blocks[1][0]) > order.index(blocks[2][0]) > order.index(blocks[3][0])
    # No time left: nothing written, nothing half-written.
    late = PrefixStore(tmp_path / "late", ident(model_file), 1 << 20)
    out = late.save(chain(3), time.monotonic() - 1)
    assert out["written"] == 0 and out["left_out"] == 3
    assert [p.name for p in late.dir.iterdir()] == ["identity.json"]


# --- PrefixCache in front of the store -----------------------------------------------------


class _KV:
    """Stand-in KV cache: rows of ``tb`` bytes per token per slot, in host memory."""

    host_rows = True
    state = None

    def __init__(self, n_seq=2, n_ctx=256, tb=16):
        self.n_seq, self.n_ctx, self.tb = n_seq, n_ctx, tb
        self.rows = np.zeros((n_seq, n_ctx, tb), np.uint8)
        self.length = [0] * n_seq
        self.free = set(range(n_seq))

    def token_bytes(self):
        return self.tb

    def alloc(self, prefer=None):
        slot = max(self.free, key=prefer) if prefer else min(self.free)
        self.free.discard(slot)
        return slot

    def release(self, slot):
        self.free.add(slot)

    def export_rows(self, slot, a, b, out):
        out[:] = self.rows[slot, a:b].reshape(-1)

    def import_rows(self, slot, a, b, data):
        self.rows[slot, a:b] = np.asarray(data).reshape(b - a, self.tb)

    def compute(self, slot, tokens, start):
        """'Prefill': each token's row is a function of its position and id."""
        for i in range(start, len(tokens)):
            self.rows[slot, i] = (np.arange(self.tb) + tokens[i] * 7 + i) % 251


def _serve(pc: PrefixCache, kv: _KV, prompt):
    slot, n = pc.acquire(prompt)
    expect = _KV(1, kv.n_ctx, kv.tb)
    expect.compute(0, prompt, 0)
    np.testing.assert_array_equal(kv.rows[slot, :n], expect.rows[0, :n])  # reused rows are right
    kv.compute(slot, prompt, n)
    pc.publish(slot, prompt)
    kv.release(slot)
    return n


def test_prefix_cache_spills_reads_back_and_survives_a_restart(tmp_path, model_file):
    kv = _KV()
    block_bytes = B * kv.tb
    root = tmp_path / "pc"
    store = PrefixStore(root, ident(model_file), 1 << 20)
    pc = PrefixCache(kv, 4 * block_bytes, block_tokens=B, store=store)  # 4 blocks in memory
    a = list(range(1000, 1000 + 5 * B + 3))
    b = list(range(2000, 2000 + 5 * B + 3))
    assert _serve(pc, kv, a) == 0
    assert _serve(pc, kv, b) == 0  # evicts a's blocks: spilled to disk
    store.close(timeout_s=10)
    store._stopping.clear()
    store._writer = None
    assert store.written >= 4
    for held in pc.held:
        held.clear()  # the slots forget: only the blocks remain
    assert _serve(pc, kv, a + [7, 8]) == 5 * B  # read back from disk
    assert store.loaded >= 1
    # Shutdown: the blocks in memory are saved; a new process finds the whole prefix on disk.
    saved = pc.persist(time.monotonic() + 30)
    assert saved["left_out"] == 0
    kv2 = _KV()
    pc2 = PrefixCache(kv2, 4 * block_bytes, block_tokens=B, store=PrefixStore(root, ident(model_file), 1 << 20))
    assert _serve(pc2, kv2, b + [9]) == 5 * B
    assert _serve(pc2, kv2, a + [7, 8, 9]) == 5 * B


# --- plan and preflight: the directory's size ------------------------------------------------


def test_plan_counts_the_directory_and_refuses_a_disk_too_small(tmp_path, model_file, monkeypatch):
    from moe_service.config import load_config
    from pipeline.plan import prefix_disk_capacity

    monkeypatch.setenv("CACHE_DIRECTORY", str(tmp_path / "cache"))
    assert prefix_disk_capacity(load_config(data={})) is None  # off by default
    cfg = load_config(data={"serve": {"prefix_cache_dir": "prefix", "prefix_cache_disk_gib": 0.001}})
    out = prefix_disk_capacity(cfg)
    assert out["fits"] and out["dir"] == str(tmp_path / "cache/prefix") and out["stored_bytes"] == 0
    store = PrefixStore(tmp_path / "cache/prefix", ident(model_file), 1 << 20)
    store.write(*blk(0))
    out = prefix_disk_capacity(cfg)
    assert out["stored_bytes"] == ps.dir_bytes(tmp_path / "cache/prefix") > 0
    huge = load_config(data={"serve": {"prefix_cache_dir": str(tmp_path / "abs"), "prefix_cache_disk_gib": 1e9}})
    out = prefix_disk_capacity(huge)
    assert not out["fits"] and "serve.prefix_cache_disk_gib = 1e+09 GiB does not fit in" in out["reasons"][0]
    assert prefix_disk_capacity(load_config(data={"serve": {"prefix_cache_dir": "p", "prefix_cache_gib": 0}})) is None


def test_serve_saves_within_the_stop_timeout(tmp_path, model_file):
    """pipeline.serve.save_prefix_cache: the save ends by stop_timeout_s - stop_margin_s after
    the stop began; a stop that already used that time writes nothing."""
    from types import SimpleNamespace

    from pipeline.serve import save_prefix_cache

    cfg = SimpleNamespace(stop_timeout_s=90.0, stop_margin_s=15.0)
    kv = _KV()
    for name, stop_t0, written in (("late", time.monotonic() - 76, 0), ("early", time.monotonic(), 5)):
        pc = PrefixCache(kv, 1 << 20, block_tokens=B,
                         store=PrefixStore(tmp_path / name, ident(model_file), 1 << 20))
        _serve(pc, kv, list(range(5 * B + 1)))
        save_prefix_cache(pc, cfg, stop_t0)
        assert len(pc.store) == written
    save_prefix_cache(None, cfg, time.monotonic())  # no cache: nothing to do
