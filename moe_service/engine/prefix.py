"""Prefix cache across requests: reuse the KV rows of the longest token prefix already computed.

::

    request prompt [P] --acquire--> slot: the free slot whose resident rows share the longest
        |                            prefix with the prompt (KVCache.alloc(prefer=...))
        |                          + host blocks: chained 64-token blocks of earlier prompts
        |                            (block i's key = hash(block i-1's key, its 64 tokens),
        |                            verified token by token) copied into the slot's rows
        |                          = n reused tokens (at most P - 1: the last prompt token is
        |                            always computed, its logits sample the first token)
        v
    prefill P - n tokens --publish(slot, prompt)--> every full block not yet held is copied
                           to host memory (after the step that completed the prompt; again
                           at a normal finish with the generated tokens)
    LRU over blocks, bounded by serve.prefix_cache_gib; a walk touches deeper blocks first,
    so a chain's parents are always more recent than its children and eviction takes leaves.

Correctness rules: a block enters the store only whole, copied from rows that a completed
step wrote (a cancelled or failed request publishes nothing, so no half-written entry can
exist); a slot's resident prefix (``held``) only ever names rows that were written and not
overwritten since (set at acquire to the reused prefix, at publish to the computed tokens).
Only the engine thread calls these methods.

With a disk store (engine/prefix_store.py, serve.prefix_cache_dir): a block evicted from
memory is spilled to disk, a block missing from memory is read back from disk (into memory:
it is a block like the others), and :meth:`PrefixCache.persist` writes the blocks still in
memory at shutdown, so a restart finds them. Block keys are prefix_store.block_key digests,
the same in memory and on disk and across processes.

Counted in /metrics (moe_service.metrics.Metrics.observe_prefix_cache): hits (requests that
reused > 0 tokens), reused tokens, evictions, bytes held.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from moe_service.engine.prefix_store import block_key
from moe_service.log import get_logger

log = get_logger(__name__)

BLOCK_TOKENS = 64


class _Block:
    __slots__ = ("key", "tokens", "parent", "data")

    def __init__(self, key, tokens, parent, data):
        self.key, self.tokens, self.parent, self.data = key, tokens, parent, data


def _common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x = np.asarray(a[:n], dtype=np.int64)
    y = np.asarray(b[:n], dtype=np.int64)
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else n


class PrefixCache:
    """Reuse of earlier requests' KV rows for the model's KVCache ``kv`` (numpy rows).

    ``budget_bytes``: host memory for blocks (serve.prefix_cache_gib); ``block_tokens``: tokens
    per block; ``metrics``: an object with ``observe_prefix_cache(hit, reused_tokens,
    evictions, bytes_held)`` or None. Raises ValueError when the cache's rows are not in host
    memory (a torch device cache) or the cache holds per-sequence state beside its rows
    (``KVCache.state``: deepseek4), which blocks of rows cannot restore.
    """

    def __init__(self, kv, budget_bytes: int, *, block_tokens: int = BLOCK_TOKENS, metrics=None, store=None):
        if not getattr(kv, "host_rows", False):
            raise ValueError("the prefix cache needs the KV cache in host memory (the CPU path)")
        if getattr(kv, "state", None):
            raise ValueError("the prefix cache cannot restore this model's per-sequence state beside the KV rows "
                             "(deepseek4's compressed KV): reused rows alone would give wrong output")
        self.kv = kv
        self.budget_bytes = int(budget_bytes)
        self.block_tokens = int(block_tokens)
        self.block_bytes = kv.token_bytes() * self.block_tokens
        self.metrics = metrics
        self.held: list[list[int]] = [[] for _ in range(kv.n_seq)]
        self._blocks: OrderedDict = OrderedDict()  # key -> _Block, least recently used first
        self.bytes_held = 0
        self.hits = self.reused_tokens = self.evictions = 0
        self.store = store  # engine/prefix_store.PrefixStore, or None (memory only)

    # -- lookups -------------------------------------------------------------------------------

    def _chain(self, tokens, n_tokens: int, from_store: bool = False) -> list[_Block]:
        """The held blocks that cover tokens[0 : k * B] for the largest k (k*B <= n_tokens);
        ``from_store``: a block missing from memory is read back from the disk store."""
        B = self.block_tokens
        out: list[_Block] = []
        parent = None
        key = None
        for i in range(n_tokens // B):
            blk_tokens = tuple(tokens[i * B:(i + 1) * B])
            key = block_key(key, blk_tokens)
            b = self._blocks.get(key)
            if b is None and from_store and self.store is not None:
                b = self._load(key, blk_tokens, parent)
            if b is None or b.parent is not parent or b.tokens != blk_tokens:
                break
            out.append(b)
            parent = b
        return out

    def _touch(self, chain: list[_Block]) -> None:
        for b in reversed(chain):  # leaves first: parents end up more recent
            self._blocks.move_to_end(b.key)

    def acquire(self, prompt: list[int]) -> tuple[int, int]:
        """A KV slot for ``prompt`` with as many leading rows as possible already in place.

        Returns (slot, reused tokens n, 0 <= n <= len(prompt) - 1); the slot's length is set
        to n. Raises RuntimeError when no slot is free (KVCache.alloc).
        """
        limit = max(0, len(prompt) - 1)
        slot = self.kv.alloc(prefer=lambda s: _common_prefix(self.held[s], prompt))
        n_slot = min(_common_prefix(self.held[slot], prompt), limit)
        chain = self._chain(prompt, limit, from_store=True)
        n_host = len(chain) * self.block_tokens
        n = max(n_slot, n_host)
        if n_host > n_slot:
            B = self.block_tokens
            for i in range(n_slot // B, len(chain)):
                self.kv.import_rows(slot, i * B, (i + 1) * B, chain[i].data)
        if chain:
            self._touch(chain)
            if self.bytes_held > self.budget_bytes:
                self._evict()  # blocks read back from disk made room for themselves
        self.held[slot] = list(prompt[:n])
        self.kv.length[slot] = n
        if n:
            self.hits += 1
            self.reused_tokens += n
        if self.metrics is not None:
            self.metrics.observe_prefix_cache(hit=n > 0, reused_tokens=n, evictions=0, bytes_held=self.bytes_held)
        log.debug("prefix_cache_acquire", slot=slot, prompt_tokens=len(prompt), reused=n, from_slot=n_slot,
                  from_host=n_host)
        return slot, n

    # -- publishing ----------------------------------------------------------------------------

    def publish(self, slot: int, tokens: list[int]) -> int:
        """The slot's rows 0..len(tokens)-1 hold ``tokens`` (a completed step wrote them): note
        that, and copy every full block not yet held to host memory, evicting the least
        recently used blocks beyond the budget. Returns the blocks added."""
        n = len(tokens)
        if n > self.kv.n_ctx:
            raise ValueError(f"prefix cache: {n} tokens exceed the context {self.kv.n_ctx}")
        self.held[slot] = list(tokens)
        if self.budget_bytes < self.block_bytes:
            return 0
        B = self.block_tokens
        chain = self._chain(tokens, n)
        parent = chain[-1] if chain else None
        key = parent.key if parent else None
        added = []
        for i in range(len(chain), n // B):
            blk_tokens = tuple(tokens[i * B:(i + 1) * B])
            key = block_key(key, blk_tokens)
            stale = self._blocks.pop(key, None)  # another chain's block under this key (hash collision)
            if stale is not None:
                self.bytes_held -= self.block_bytes
            data = np.empty(self.block_bytes, np.uint8)
            self.kv.export_rows(slot, i * B, (i + 1) * B, data)
            b = _Block(key, blk_tokens, parent, data)  # whole before it is visible
            self._blocks[key] = b
            self.bytes_held += self.block_bytes
            added.append(b)
            parent = b
        self._touch(chain + added)
        evicted = self._evict()
        if self.metrics is not None and (added or evicted):
            self.metrics.observe_prefix_cache(hit=False, reused_tokens=0, evictions=evicted,
                                              bytes_held=self.bytes_held)
        return len(added)

    def _evict(self) -> int:
        n = 0
        while self.bytes_held > self.budget_bytes and self._blocks:
            _, b = self._blocks.popitem(last=False)
            if self.store is not None and b.data is not None and not self.store.has(b.key):
                self.store.spill(b.key, b.parent.key if b.parent else None, b.tokens, _arrays(b.data))
            b.data = None
            self.bytes_held -= self.block_bytes
            n += 1
        self.evictions += n
        return n

    # -- disk store ------------------------------------------------------------------------------

    def _load(self, key, blk_tokens, parent):
        """Block ``key`` read back from the disk store into memory, or None."""
        arrays = self.store.get(key, blk_tokens)
        if arrays is None:
            return None
        data = _from_arrays(arrays)
        if isinstance(data, np.ndarray) and data.nbytes != self.block_bytes:
            log.warning("prefix_store_block_size", key=key.hex(), bytes=data.nbytes, expected=self.block_bytes)
            return None
        b = _Block(key, blk_tokens, parent, data)
        self._blocks[key] = b
        self.bytes_held += self.block_bytes
        return b

    def persist(self, deadline_s: float) -> dict:
        """Write the blocks held in memory that the store lacks, most recently used first (a
        chain's parents are more recent than its children), while they fit before
        ``deadline_s`` (time.monotonic()); PrefixStore.save. Call it once the engine thread
        stopped. {} without a store."""
        if self.store is None:
            return {}
        blocks = [(b.key, b.parent.key if b.parent else None, b.tokens, _arrays(b.data))
                  for b in reversed(self._blocks.values()) if b.data is not None]
        return self.store.save(blocks, deadline_s)

    @property
    def n_blocks(self) -> int:
        return len(self._blocks)

    def stats(self) -> dict:
        out = {"blocks": len(self._blocks), "bytes_held": self.bytes_held, "budget_bytes": self.budget_bytes,
               "hits": self.hits, "reused_tokens": self.reused_tokens, "evictions": self.evictions}
        if self.store is not None:
            out["disk"] = self.store.stats()
        return out


def _arrays(data) -> dict:
    """A block's payload as named arrays for the disk store: KV rows alone are ``{"kv": rows}``;
    a payload that is already a dict of arrays (rows plus per-sequence state) goes as it is."""
    return dict(data) if isinstance(data, dict) else {"kv": data}


def _from_arrays(arrays: dict):
    """The inverse of :func:`_arrays`."""
    return arrays["kv"] if list(arrays) == ["kv"] else arrays
