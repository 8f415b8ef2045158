"""Prefix cache for models with per-sequence state (deepseek4) and sliding windows (gpt-oss):
the reused prefix gives the logits of recomputation bit for bit.

Files: tiny-deepseek4 cut to 3 layers (compress ratios 4, 128, 0; window 8, indexer top-k 4,
so prompts of a few hundred tokens cross the window many times, fill the indexer beyond its
top-k and complete ratio-128 groups) and tiny-gpt-oss (window 16). Block sizes put the cut
points at the edges of the ratio-128 groups (128, deepseek4's default), inside them (64),
inside ratio-4 groups and windows (6, 7), at window edges (8, 16, 17). Chunked prefill on this
engine is bit-exact with one-shot prefill, so equality is exact (np.array_equal), not a
tolerance.
"""

from __future__ import annotations

import queue
import time

import numpy as np
import pytest

from moe_service.engine import kv as kvm
from moe_service.engine.batch import BatchLoop
from moe_service.engine.engine import Engine, GenerationRequest
from moe_service.engine.model import Model
from moe_service.engine.prefix import PrefixCache
from moe_service.engine.sampler import SamplingParams
from moe_service.gguf_model import GGUFModel
from moe_service.weights import WeightStore
from tests.support.smollm2 import needs_smollm2

pytestmark = needs_smollm2

N_CTX = 640


def _prompt(seed: int, n: int, vocab: int = 8000) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(2, vocab, n)]


class _Pair:
    """The model under the cache (3 slots) and a separate reference model (recomputation)."""

    def __init__(self, path, ops):
        cat = GGUFModel.open(path)
        self.m = Model(cat, WeightStore.load_simple(cat), ops, n_seq=3, n_ctx=N_CTX)
        self.ref = Model(cat, WeightStore.load_simple(cat), ops, n_seq=1, n_ctx=N_CTX)
        self._fresh: dict[tuple, np.ndarray] = {}

    def fresh(self, prompt: list[int], decode: int = 2) -> np.ndarray:
        """Recomputed logits [1 + decode, V]: the prompt's last token, then greedy decode steps."""
        key = (tuple(prompt), decode)
        if key not in self._fresh:
            s = self.ref.kv.alloc()
            out = [self.ref.step([(s, prompt)])[0].numpy()]
            for _ in range(decode):
                out.append(self.ref.step([(s, [int(np.argmax(out[-1]))])])[0].numpy())
            self.ref.kv.free(s)
            self._fresh[key] = np.stack(out)
        return self._fresh[key]

    def cached(self, pc: PrefixCache, prompt: list[int], decode: int = 2, ubatch: int = 128):
        """As the batch loop runs a request: acquire, prefill in ubatch chunks, publish the
        prompt, greedy decode, publish prompt + generated[:-1], release. Returns (reused
        tokens, logits [1 + decode, V])."""
        m = self.m
        slot, n = pc.acquire(prompt)
        for a in range(n, len(prompt), ubatch):
            last = m.step([(slot, prompt[a : a + ubatch])])
        pc.publish(slot, prompt)
        out = [last[0].numpy()]
        gen = [int(np.argmax(out[-1]))]
        for _ in range(decode):
            out.append(m.step([(slot, [gen[-1]])])[0].numpy())
            gen.append(int(np.argmax(out[-1])))
        pc.publish(slot, prompt + gen[:-1])
        pc.release(slot)
        m.kv.free(slot)
        return n, np.stack(out)


@pytest.fixture(scope="module")
def ds4(tmp_path_factory, ops):
    from moe_service.synth_deepseek4 import write_deepseek4

    path = write_deepseek4(
        tmp_path_factory.mktemp("pfx-ds4") / "ds4.gguf",
        "tiny-deepseek4",
        seed=3,
        window=8,
        indexer_top_k=4,
        compress_ratios=(4, 128, 0),
        hash_layers=1,
        n_mtp=0,
    )
    return _Pair(path, ops)


@pytest.fixture(scope="module")
def oss(tmp_path_factory, ops):
    from moe_service.synth_gpt_oss import write_gpt_oss

    return _Pair(write_gpt_oss(tmp_path_factory.mktemp("pfx-oss") / "oss.gguf", "tiny-gpt-oss"), ops)


# -- the declaration ----------------------------------------------------------------------------


def test_state_kinds_say_what_a_block_carries():
    raw = kvm.SeqState(0, "raw", (8, 4), "float16", "ring", 1, 8)  # the last 7 positions are read
    ring4 = kvm.SeqState(0, "ring", (8, 4), "float32", "ring", 4, 2)  # unfinished group + the one before
    ring128 = kvm.SeqState(0, "ring128", (256, 4), "float32", "ring", 128, 1)
    comp = kvm.SeqState(0, "comp", (100, 4), "float16", "rows", 4)
    assert raw.live_start(20) == 13 and raw.live_start(3) == 0
    assert ring4.live_start(13) == 8 and ring4.live_start(16) == 12 and ring4.live_start(5) == 0
    assert ring128.live_start(192) == 128 and ring128.live_start(256) == 256
    assert raw.block_part(64, 128) == (121, 128) and raw.block_part(0, 6) == (0, 6)
    assert ring128.block_part(128, 256) == (256, 256)  # a whole group: nothing to carry
    assert ring128.block_part(0, 64) == (0, 64)
    assert comp.block_part(6, 12) == (1, 3)  # rows 1 and 2 complete inside tokens 6..11
    assert kvm.state_block_tokens([raw, ring4, ring128, comp], 64) == 128
    assert kvm.state_block_tokens([raw, ring4, comp], 64) == 64
    with pytest.raises(ValueError, match="kind"):
        kvm.SeqState(0, "x", (4,), "float32", "whole")
    with pytest.raises(ValueError, match="cannot hold"):
        kvm.SeqState(0, "x", (2, 4), "float32", "ring", 4, 1)  # up to 3 live positions


def test_export_import_restores_the_live_state():
    """A synthetic ring (window 5) and append-only rows (one per 3 tokens), written by position:
    blocks of 4 tokens carry what is needed, and restoring at any block boundary gives the
    live rows and the rows of the state that recomputation holds."""
    decl = [
        kvm.SeqState(0, "ring", (5, 2), "float32", "ring", 1, 5),
        kvm.SeqState(0, "rows", (10, 2), "float32", "rows", 3),
    ]
    c = kvm.KVCache(2, 30, [], [], state=kvm.KVCache.state_arrays(decl, 2), state_decl=decl)
    ring, rows = c.state[(0, "ring")], c.state[(0, "rows")]
    vals = np.arange(30 * 2, dtype=np.float32).reshape(30, 2)
    B, blocks, got = 4, [], {}

    def sink(d, p0, r):
        for j in range(len(r)):
            got[(d.key, p0 + j)] = r[j].copy()

    c.capture[0] = sink
    for p in range(24):  # slot 0 computes 24 tokens
        ring[0, p % 5] = vals[p]
        c.note_ring(0, 0, "ring", p, vals[p : p + 1])
        if (p + 1) % 3 == 0:
            rows[0, (p + 1) // 3 - 1] = vals[p] * 10
    for i in range(24 // B):
        lo, hi = decl[0].block_part(i * B, (i + 1) * B)
        rings = {"blk.0.ring": np.stack([got[("blk.0.ring", q)] for q in range(lo, hi)]).reshape(hi - lo, 2)}
        blocks.append((i * B, (i + 1) * B, c.export_state(0, i * B, (i + 1) * B, rings)))
    assert blocks[1][2]["blk.0.ring"].shape == (4, 2) and blocks[1][2]["blk.0.rows"].shape == (1, 2)
    for k in range(1, len(blocks) + 1):
        ring[1], rows[1] = -1, -1
        c.import_state(1, blocks[:k])
        n = k * B
        for p in range(max(0, n - 4), n):
            assert np.array_equal(ring[1, p % 5], vals[p])
        assert np.array_equal(rows[1, : n // 3], rows[0, : n // 3])
    with pytest.raises(ValueError, match="contiguous"):
        c.import_state(1, blocks[1:])


class _ToySsm:
    """A state-space-like layer on a real KVCache: ``h`` (carry, [4] float32) rewritten by every
    token, h = 0.9 h + conv, where conv sums the last 3 inputs (``conv``: a ring of 3 rows, the
    architecture reads positions p - 2 .. p - 1 and the token itself). Steps report the ring
    rows and the carry at the points the capture asks for, as an architecture does."""

    decl = [
        kvm.SeqState(0, "h", (4,), "float32", "carry"),
        kvm.SeqState(0, "conv", (3, 4), "float32", "ring", 1, 3),
    ]

    def __init__(self):
        self.kv = kvm.KVCache.allocate([kvm.LayerKV(1, 32, 32, latent=True)], 2, 96, state=self.decl)

    def step(self, slot: int, tokens: list[int]) -> np.ndarray:
        kv = self.kv
        h, conv = kv.state[(0, "h")], kv.state[(0, "conv")]
        n0 = kv.length[slot]
        if n0 == 0:
            h[slot] = 0  # a new sequence starts from a zero state
        want = set(kv.capture_points(slot, n0, n0 + len(tokens)))
        x = np.stack([np.sin(np.arange(4, dtype=np.float32) * t + 0.1) for t in tokens]).astype(np.float32)
        for j, p in enumerate(range(n0, n0 + len(tokens))):
            c = x[j] + sum(conv[slot, q % 3] for q in range(max(0, p - 2), p))
            conv[slot, p % 3] = x[j]
            h[slot] = np.float32(0.9) * h[slot] + c
            if p + 1 in want:
                kv.note_carry(slot, 0, "h", p + 1, h[slot])
        kv.note_ring(slot, 0, "conv", n0, x)
        kv.length[slot] = n0 + len(tokens)
        return h[slot].copy()


def test_carry_state_restores_exactly():
    """The "carry" kind (a recurrent state) with a ring beside it: a prompt computed after a
    prefix restored from blocks of 8 gives the recomputed state bit for bit, at every cut."""
    toy = _ToySsm()
    pc = PrefixCache(toy.kv, 1 << 20, block_tokens=8)
    base = _prompt(90, 60)

    def run(prompt, cached=True):
        if cached:
            slot, n = pc.acquire(prompt)
        else:
            slot, n = toy.kv.alloc(), 0
        for a in range(n, len(prompt), 7):
            out = toy.step(slot, prompt[a : a + 7])
        if cached:
            pc.publish(slot, prompt)
            pc.release(slot)
        toy.kv.free(slot)
        return n, out

    run(base)
    assert pc.n_blocks == 7 and all(b.state["blk.0.h"].shape == (4,) for b in pc._blocks.values())
    for cut in (8, 21, 59):
        p = base[:cut] + _prompt(cut, 5)
        n, got = run(p)
        _, want = run(p, cached=False)
        pc.held = [[] for _ in pc.held]  # the uncached run overwrote a slot
        assert n == cut // 8 * 8 and np.array_equal(got, want), cut


# -- deepseek4 --------------------------------------------------------------------------------


BASE = _prompt(1, 400)


@pytest.mark.parametrize("block_tokens", [None, 64, 6, 8])
def test_ds4_reused_prefix_gives_recomputed_logits(ds4, block_tokens):
    """Cut points: 128-token blocks (the ratio-128 group edges; the default), 64 (inside
    them), 6 (inside ratio-4 groups; the window of 8 spans two blocks), 8 (window edges)."""
    pc = PrefixCache(ds4.m.kv, 64 << 20, block_tokens=block_tokens)
    assert pc.block_tokens == (block_tokens or 128)
    n0, _ = ds4.cached(pc, BASE)
    assert n0 == 0 and pc.n_blocks == (len(BASE) + 2) // pc.block_tokens  # prompt + generated[:-1]
    for cut, seed in ((130, 2), (257, 3), (399, 4)):
        p = BASE[:cut] + _prompt(seed, 13)
        n, got = ds4.cached(pc, p)
        assert n == cut // pc.block_tokens * pc.block_tokens
        assert np.array_equal(got, ds4.fresh(p)), (block_tokens, cut)
    assert pc.bytes_held + pc.capture_bytes <= pc.budget_bytes


def test_ds4_slot_continues_its_own_state(ds4):
    """A conversation's next turn extends exactly what the slot holds (prompt + answer): it
    reuses all of it from the slot (not a block multiple), and the blocks it then publishes,
    one of them begun by the previous turn, restore exactly in another slot."""
    pc = PrefixCache(ds4.m.kv, 64 << 20, block_tokens=64)
    t1 = _prompt(20, 150)
    _, out1 = ds4.cached(pc, t1)
    held = t1 + [int(np.argmax(out1[0])), int(np.argmax(out1[1]))]  # prompt + generated[:-1]
    t2 = held + _prompt(21, 40)
    n, got = ds4.cached(pc, t2)
    assert n == len(held) == 152
    assert np.array_equal(got, ds4.fresh(t2))
    assert pc.n_blocks == (len(t2) + 2) // 64  # 128..191 was begun by turn 1: its ring rows were kept
    # from the blocks only (the slot holds more than t3's prefix: its rings cannot rewind)
    t3 = t2[:192] + _prompt(22, 9)
    s3, n3 = pc.acquire(t3)
    assert n3 == 192
    got3 = ds4.m.step([(s3, t3[n3:])])[0].numpy()
    pc.release(s3)
    ds4.m.kv.free(s3)
    assert np.array_equal(got3, ds4.fresh(t3, decode=0)[0])


def test_ds4_serve_turns_the_cache_on_and_a_bad_block_is_not_restored(ds4):
    """make_prefix_cache (the serve stage) gives deepseek4 a prefix cache of 128-token blocks;
    a stored block that does not fit the cache (a spill store's mistake) is not restored: the
    request computes its whole prompt."""
    from types import SimpleNamespace

    from pipeline.serve import make_prefix_cache

    pc = make_prefix_cache(SimpleNamespace(model=ds4.m), SimpleNamespace(prefix_cache_gib=0.01), None)
    assert isinstance(pc, PrefixCache) and pc.stateful and pc.block_tokens == 128
    p = _prompt(35, 300)
    ds4.cached(pc, p, decode=0)
    blk = pc._chain(p, 256)[1]
    key = next(k for k in blk.state if k.endswith(".raw"))
    blk.state[key] = blk.state[key][:3]
    slot, n = pc.acquire(p[:290])
    assert n == 0 and pc.kv.length[slot] == 0
    pc.release(slot)
    pc.kv.free(slot)


def test_ds4_a_slot_advanced_past_its_prefix_is_not_reused(ds4):
    """A request that stopped before its publish (cancelled) leaves its slot's rings past the
    reused prefix: the next request does not continue that slot's state."""
    pc = PrefixCache(ds4.m.kv, 64 << 20)
    p = _prompt(30, 200)
    slot, n = pc.acquire(p)
    ds4.m.step([(slot, p[:150])])  # then cancelled: no publish
    pc.release(slot)
    ds4.m.kv.free(slot)
    assert not pc.exact[slot] and pc.capture_bytes == 0 and pc.n_blocks == 0
    n2, got = ds4.cached(pc, p)
    assert n2 == 0 and np.array_equal(got, ds4.fresh(p))


def test_ds4_eviction_under_memory_pressure_keeps_results_right(ds4):
    """A budget of about three of the largest blocks (those that end inside a ratio-128 group
    carry its ring): every publish and capture stays within it (LRU blocks go), and what is
    reused is still exact."""
    probe = PrefixCache(ds4.m.kv, 1 << 30, block_tokens=64)
    budget = 3 * probe.block_bytes + probe.block_bytes // 2
    pc = PrefixCache(ds4.m.kv, budget, block_tokens=64)
    seen = []
    for seed in (40, 41, 42):
        p = _prompt(seed, 300)
        ds4.cached(pc, p)
        seen.append(p)
        assert pc.bytes_held + pc.capture_bytes <= budget
    assert pc.evictions > 0 and pc.n_blocks > 0
    for p in seen[::-1]:
        q = p[:200] + _prompt(43, 7)
        n, got = ds4.cached(pc, q)
        assert np.array_equal(got, ds4.fresh(q)), n
        assert pc.bytes_held + pc.capture_bytes <= budget


class _Tok:
    """Token ids as text pieces: enough tokenizer for the engine's detokenizer."""

    bos_id = eos_id = None
    add_bos = False
    eog_ids = frozenset()
    n_vocab = 8192

    def token_to_piece(self, token_id: int, *, special: bool = False) -> bytes:
        return f"<{token_id}>".encode()

    def decode(self, ids, *, special: bool = False) -> str:
        return "".join(f"<{i}>" for i in ids)

    def is_eog(self, token_id: int) -> bool:
        return False


def _serve(loop: BatchLoop, prompt: list[int], n: int = 4):
    q: queue.Queue = queue.Queue()
    texts = []
    req = GenerationRequest(list(prompt), n, SamplingParams(temperature=0.0), emit=q.put, ignore_eos=True)
    loop.submit(req)
    while True:
        ev = q.get(timeout=300)
        texts.append(ev.text)
        if ev.final:
            assert ev.error is None, ev.error
            return ev, [int(t) for t in "".join(texts).strip("<>").split("><")]


def test_ds4_through_the_batch_loop_reports_cached_tokens(ds4):
    """Requests through the batch loop: the second shares the first's prefix, reports the
    reused tokens (usage.prompt_tokens_details.cached_tokens) and generates what a fresh
    model generates; a cancelled request publishes nothing."""
    pc = PrefixCache(ds4.m.kv, 64 << 20)
    loop = BatchLoop(
        Engine(ds4.m, _Tok(), model_name="t", ubatch_tokens=100), parallel=2, queue_size=4, prefix_cache=pc
    ).start()
    try:
        shared = _prompt(50, 300)
        ev1, _ = _serve(loop, shared + _prompt(51, 10))
        assert ev1.cached_tokens == 0
        p2 = shared + _prompt(52, 20)
        ev2, toks = _serve(loop, p2)
        assert ev2.cached_tokens == 256
        want = ds4.fresh(p2, decode=3)
        assert toks == [int(np.argmax(r)) for r in want]
        blocks = pc.n_blocks
        q: queue.Queue = queue.Queue()
        req = GenerationRequest(
            _prompt(53, 450), 4, SamplingParams(temperature=0.0), emit=q.put, ignore_eos=True
        )
        steps = loop.steps
        loop.submit(req)
        end = time.monotonic() + 120
        while loop.steps < steps + 2 and time.monotonic() < end:
            time.sleep(0.005)
        loop.cancel(req)
        end = time.monotonic() + 60
        while loop.active and time.monotonic() < end:
            time.sleep(0.01)
        assert pc.n_blocks == blocks  # the cancelled prompt's blocks never entered
        assert pc.capture_bytes <= 2 * pc.block_bytes  # the finished slots' unfinished blocks at most
    finally:
        loop.stop()


# -- gpt-oss (sliding window 16 on alternating layers, every row kept) --------------------------


@pytest.mark.parametrize("block_tokens", [64, 16, 17, 8])
def test_gpt_oss_reused_prefix_gives_recomputed_logits(oss, block_tokens):
    """Rows reused from host blocks (cuts at block multiples: window edges for 16, inside
    windows for 17 and 8) and from the slot's own rows (the common prefix, any cut)."""
    pc = PrefixCache(oss.m.kv, 64 << 20, block_tokens=block_tokens)
    base = _prompt(60, 260, vocab=8000)
    oss.cached(pc, base)
    for cut, seed in ((33, 61), (130, 62), (259, 63)):
        p = base[:cut] + _prompt(seed, 11)
        n, got = oss.cached(pc, p)
        assert cut // block_tokens * block_tokens <= n <= cut  # blocks, or the slot's rows (any cut)
        assert np.array_equal(got, oss.fresh(p)), (block_tokens, cut)


def test_gpt_oss_eviction_keeps_results_right(oss):
    probe = PrefixCache(oss.m.kv, 1 << 30)
    budget = 2 * probe.block_bytes
    pc = PrefixCache(oss.m.kv, budget)
    prompts = [_prompt(70 + i, 200) for i in range(3)]
    for p in prompts:
        oss.cached(pc, p)
        assert pc.bytes_held <= budget
    assert pc.evictions > 0
    for p in prompts:
        q = p[:150] + _prompt(80, 5)
        _, got = oss.cached(pc, q)
        assert np.array_equal(got, oss.fresh(q))


def test_ds4_blocks_survive_a_restart_through_the_disk_store(ds4, tmp_path):
    """DeepSeek V4's blocks (no KV rows, only per-sequence state) go to the disk store
    (engine/prefix_store.py) as named arrays at shutdown; a new prefix cache over an empty KV
    cache and a new store over the same folder (a restarted process) finds them, and the
    reused prefix gives the recomputed logits bit for bit."""
    from moe_service.engine.prefix_store import PrefixStore, store_identity

    model_path = tmp_path / "model-identity.gguf"
    model_path.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    ident = store_identity(model_path=model_path, kv_type="f16", n_ctx=N_CTX, block_tokens=128,
                           token_bytes=ds4.m.kv.token_bytes())
    root = tmp_path / "prefix"
    pc = PrefixCache(ds4.m.kv, 64 << 20, store=PrefixStore(root, ident, 64 << 20))
    ds4.cached(pc, BASE)
    saved = pc.persist(time.monotonic() + 60)
    assert saved["left_out"] == 0 and pc.store.stats()["blocks"] >= 3
    pc.store.close(timeout_s=10)
    # a restarted process: the slots and the memory blocks are gone, the folder stays
    pc2 = PrefixCache(ds4.m.kv, 64 << 20, store=PrefixStore(root, ident, 64 << 20))
    pc2.held = [[] for _ in pc2.held]
    assert pc2.n_blocks == 0
    p = BASE[:300] + _prompt(40, 11)
    n, got = ds4.cached(pc2, p)
    assert n == 256 and pc2.store.stats()["loaded"] >= 2
    assert np.array_equal(got, ds4.fresh(p))
    pc2.store.close(timeout_s=10)
