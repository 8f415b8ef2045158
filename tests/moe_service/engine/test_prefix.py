"""Prefix cache (moe_service.engine.prefix) on a real 2-layer model through the batch loop:
a reused request gives the same greedy tokens as a fresh one (reuse from its own slot and
from host blocks into another slot), concurrent requests sharing a prefix, LRU eviction
within the budget, and a cancelled request leaves nothing behind."""

from __future__ import annotations

import queue
import time

import numpy as np
import pytest
import torch

from moe_service.engine.batch import BatchLoop
from moe_service.engine.engine import Engine, GenerationRequest
from moe_service.engine.model import Model
from moe_service.engine.ops import CpuOps
from moe_service.engine.prefix import PrefixCache
from moe_service.engine.sampler import SamplingParams
from moe_service.gguf_model import GGUFModel
from moe_service.synth import write_synthetic
from moe_service.weights import WeightStore


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


class _Metrics:
    def __init__(self):
        self.hits = self.reused = self.evictions = 0

    def observe_prefix_cache(self, *, hit, reused_tokens, evictions, bytes_held):
        self.hits += int(hit)
        self.reused += reused_tokens
        self.evictions += evictions

    def __getattr__(self, name):  # the loop's other observers
        return lambda *a, **k: None


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    torch.set_num_threads(1)
    d = tmp_path_factory.mktemp("prefix")
    cat = GGUFModel.open(write_synthetic(d / "tiny-llama.gguf", "tiny-llama", expert_type="Q8_0", seed=5))
    ops = CpuOps(threads=0)
    m = Model(cat, WeightStore.load_simple(cat), ops, n_seq=3, n_ctx=520)
    yield m
    ops.close()


def _prompt(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(2, 8000, n)]


SHARED = _prompt(1, 300)


def _run(loop: BatchLoop, prompts: list[list[int]], max_tokens: int = 6, cancel_after_steps: int | None = None):
    """Submit every prompt at once; returns [(token ids, final event)] in order."""
    outs = []
    for i, p in enumerate(prompts):
        q: queue.Queue = queue.Queue()
        req = GenerationRequest(list(p), max_tokens, SamplingParams(temperature=0.0), emit=q.put, request_id=str(i),
                                ignore_eos=True)
        loop.submit(req)
        outs.append((req, q))
    if cancel_after_steps is not None:
        end = time.monotonic() + 60
        while loop.steps < cancel_after_steps and time.monotonic() < end:
            time.sleep(0.005)
        for req, _ in outs:
            loop.cancel(req)
        time.sleep(0.3)
        return []
    res = []
    for _req, q in outs:
        last = None
        while last is None or not last.final:
            last = q.get(timeout=120)
        res.append(last)
    return res


def _loop(model, prefix, parallel=3, ubatch=64):
    eng = Engine(model, _Tok(), model_name="t", ubatch_tokens=ubatch)
    return BatchLoop(eng, parallel=parallel, queue_size=8, metrics=prefix.metrics if prefix else None,
                     prefix_cache=prefix).start()


def _fresh(model, prompt, n=6) -> list[int]:
    eng = Engine(model, _Tok(), model_name="t", ubatch_tokens=64)
    return eng.generate(prompt, max_tokens=n).token_ids


def test_reuse_gives_the_same_greedy_tokens(model):
    a, b, c = SHARED + _prompt(2, 20), SHARED + _prompt(3, 25), _prompt(4, 200)
    want_b = _fresh(model, b)
    want_a = _fresh(model, a)
    metrics = _Metrics()
    pc = PrefixCache(model.kv, 64 << 20, metrics=metrics)
    gen: dict[str, list[int]] = {}

    def run_one(loop, prompt, key):
        q: queue.Queue = queue.Queue()
        texts = []
        req = GenerationRequest(list(prompt), 6, SamplingParams(temperature=0.0), emit=q.put, ignore_eos=True)
        loop.submit(req)
        while True:
            ev = q.get(timeout=120)
            texts.append(ev.text)
            if ev.final:
                gen[key] = [int(t) for t in "".join(texts).strip("<>").split("><")]
                return ev

    loop = _loop(model, pc, parallel=1)
    try:
        ev_a = run_one(loop, a, "a")
        assert ev_a.cached_tokens == 0 and gen["a"] == want_a
        ev_b = run_one(loop, b, "b")  # same slot: its resident rows hold the shared 300 tokens
        assert ev_b.cached_tokens == 300 and gen["b"] == want_b
        run_one(loop, c, "c")  # overwrites the slot's rows from position 0
        ev_b2 = run_one(loop, b, "b2")  # now from host blocks: b's 5 whole blocks of 64 (320 of 325)
        assert ev_b2.cached_tokens == 320
        assert gen["b2"] == want_b
    finally:
        loop.stop()
    assert metrics.hits == 2 and metrics.reused == 300 + 320
    assert pc.bytes_held == pc.n_blocks * pc.block_bytes <= pc.budget_bytes


def test_concurrent_requests_sharing_a_prefix(model):
    prompts = [SHARED + _prompt(10 + i, 10 + i) for i in range(3)]
    want = [_fresh(model, p) for p in prompts]
    pc = PrefixCache(model.kv, 64 << 20, metrics=_Metrics())
    pc.publish(0, [])  # nothing held yet
    loop = _loop(model, pc, parallel=3)
    try:
        evs = _run(loop, prompts)
        again = _run(loop, prompts)  # now every one reuses the shared blocks
    finally:
        loop.stop()
    for ev in evs + again:
        assert ev.finish_reason == "length" and ev.completion_tokens == 6
    assert all(ev.cached_tokens >= 256 for ev in again)
    got = [_fresh(model, p) for p in prompts]  # the model itself is unchanged by the cache
    assert got == want


def test_eviction_keeps_the_budget(model):
    metrics = _Metrics()
    block = model.kv.token_bytes() * 64
    pc = PrefixCache(model.kv, 3 * block, metrics=metrics)
    s = model.kv.alloc()
    try:
        for seed in range(4):  # 4 prompts x 2 blocks each, 3 blocks of budget
            pc.publish(s, _prompt(100 + seed, 130))
            assert pc.bytes_held <= 3 * block
        assert pc.n_blocks == 3 and metrics.evictions == 5 and pc.evictions == 5
        # the most recent prompt's chain survives whole (leaves were evicted before parents)
        assert len(pc._chain(_prompt(103, 130), 130)) == 2
    finally:
        model.kv.free(s)


def test_cancelled_request_leaves_no_entry(model):
    pc = PrefixCache(model.kv, 64 << 20, metrics=_Metrics())
    loop = _loop(model, pc, parallel=1, ubatch=32)
    try:
        _run(loop, [_prompt(7, 480)], cancel_after_steps=2)
        assert pc.n_blocks == 0  # prefill never completed: nothing published
    finally:
        loop.stop()
