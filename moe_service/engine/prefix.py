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
step wrote, with state only when every ring row of it was captured (a cancelled or failed
request publishes nothing, so no half-written entry can exist); a slot's resident prefix
(``held``) only ever names rows that were written and not overwritten since (set at acquire
to the reused prefix, at publish to the computed tokens).
Only the engine thread calls these methods.

Per-sequence state beside the rows (kv.SeqState, deepseek4's window ring, compressed rows,
indexer keys and compressor rings): each state declares a snapshot kind, and a block carries
what that state needs (KVCache.export_state): the append-only rows completed inside it, and the
ring rows of its own positions that are still live at its end. Ring rows are overwritten within
a step, so they are captured as they are computed: acquire registers a :class:`_Capture` for
the slot (KVCache.capture), the architecture hands it every position's ring row
(KVCache.note_ring), and publish moves the captured rows into the block. Restoring a chain of
blocks (KVCache.import_state) rebuilds the state at its end exactly as recomputation leaves it
(the rows later steps read), so the logits are the same bit for bit. A slot's own state is
reused only when it is exactly that of held[slot] (``exact``: the request that left it
published everything it computed; rings cannot be rewound to a shorter prefix), otherwise the
chain of blocks is. The blocks are 64 tokens rounded up to the state's groups
(kv.state_block_tokens: 128 on deepseek4 with ratio-128 layers).

A block (:class:`_Block`) is plain data for whoever stores it elsewhere (a spill to disk):
``tokens``, ``parent``, ``data`` (uint8 rows) and ``state`` (None or {"blk.<layer>.<name>":
numpy array}, shapes and dtypes from the declarations and the block's span,
kv.SeqState.block_part), ``nbytes``.

With a disk store (engine/prefix_store.py, serve.prefix_cache_dir): a block evicted from
memory is spilled to disk (its rows and state as named arrays), a block missing from memory is
read back from disk (into memory: it is a block like the others), and :meth:`PrefixCache.persist`
writes the blocks still in memory at shutdown, so a restart finds them. Block keys are
prefix_store.block_key digests, the same in memory and on disk and across processes.

Memory: blocks and in-flight captures count against ``budget_bytes`` together (a capture that
does not fit stops capturing that slot's later blocks; eviction makes room first).

Counted in /metrics (moe_service.metrics.Metrics.observe_prefix_cache): hits (requests that
reused > 0 tokens), reused tokens, evictions, bytes held (blocks and captures).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from moe_service.engine.prefix_store import block_key
from moe_service.log import get_logger

log = get_logger(__name__)

BLOCK_TOKENS = 64


class _Block:
    """One block of the store: ``tokens`` (its B token ids), ``parent`` (the block before it in
    the chain, None for the first), ``data`` (uint8 [B x KVCache.token_bytes()]: the rows of
    every layer, KVCache.export_rows; size 0 when the model keeps no rows), ``state`` (None, or
    the per-sequence state snapshot {"blk.<layer>.<name>": numpy array}, KVCache.export_state),
    ``nbytes`` (data + state bytes, counted in the budget)."""

    __slots__ = ("key", "tokens", "parent", "data", "state", "nbytes")

    def __init__(self, key, tokens, parent, data, state=None):
        self.key, self.tokens, self.parent, self.data, self.state = key, tokens, parent, data, state
        self.nbytes = int(data.nbytes) + sum(int(a.nbytes) for a in (state or {}).values())


class _Capture:
    """The ring rows one slot's blocks need (kv.SeqState "ring"), captured as the architecture
    computes them (KVCache.note_ring calls this object): for block i >= ``first`` and ring
    state ``key``, an array of the positions block_part(i B, (i + 1) B) and which of them
    arrived. Each new array is reserved against the budget (PrefixCache._reserve); when that
    fails, blocks from there on are not captured (``stop``)."""

    def __init__(self, pc: PrefixCache, first: int):
        self.pc = pc
        self.first = first
        self.stop = 1 << 62
        self.bufs: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = {}

    def __call__(self, decl, p0: int, rows: np.ndarray) -> None:
        B = self.pc.block_tokens
        n = len(rows)
        if n == 0:
            return
        for i in range(max(self.first, p0 // B), min(self.stop, (p0 + n - 1) // B + 1)):
            lo, hi = decl.block_part(i * B, (i + 1) * B)
            x, y = max(lo, p0), min(hi, p0 + n)
            if x >= y:
                continue
            ent = self.bufs.get((i, decl.key))
            if ent is None:
                if not self.pc._reserve((hi - lo) * decl.row_nbytes):
                    self.drop(lambda j, i=i: j >= i)
                    self.stop = i
                    return
                ent = self.bufs[(i, decl.key)] = (np.empty((hi - lo,) + tuple(decl.shape[1:]), decl.dtype),
                                                  np.zeros(hi - lo, bool))
            ent[0][x - lo:y - lo] = rows[x - p0:y - p0]
            ent[1][x - lo:y - lo] = True

    def points(self, n0: int, n1: int) -> list[int]:
        """Block ends n0 < b <= n1 of the blocks this capture takes ("carry" states)."""
        B = self.pc.block_tokens
        return [b for b in range((n0 // B + 1) * B, n1 + 1, B) if self.first <= b // B - 1 < self.stop]

    def carry(self, decl, n: int, value: np.ndarray) -> None:
        """A "carry" state after ``n`` tokens: the snapshot of the block that ends at n."""
        B = self.pc.block_tokens
        i = n // B - 1
        if n % B or not self.first <= i < self.stop:
            return
        if (i, decl.key) not in self.bufs:
            if not self.pc._reserve(decl.nbytes):
                self.drop(lambda j: j >= i)
                self.stop = i
                return
        self.bufs[(i, decl.key)] = (np.array(value, dtype=decl.dtype).reshape(decl.shape), np.ones(1, bool))

    def rings(self, i: int) -> dict | None:
        """Block i's ring rows {key: array}, taken out of the capture (their bytes leave the
        capture's count), or None when a ring's positions did not all arrive."""
        B = self.pc.block_tokens
        out = {}
        for decl in self.pc.rings:
            ent = self.bufs.get((i, decl.key))
            if ent is None:
                lo, hi = decl.block_part(i * B, (i + 1) * B)
                if hi > lo or decl.kind == "carry":
                    return None
                ent = (np.empty((0,) + tuple(decl.shape[1:]), decl.dtype), np.ones(0, bool))
            if not ent[1].all():
                return None
            out[decl.key] = ent[0]
        for decl in self.pc.rings:
            ent = self.bufs.pop((i, decl.key), None)
            if ent is not None:
                self.pc.capture_bytes -= ent[0].nbytes
        return out

    def drop(self, which=lambda i: True) -> None:
        """Forget the captured blocks i with ``which(i)``."""
        for key in [k for k in self.bufs if which(k[0])]:
            self.pc.capture_bytes -= self.bufs.pop(key)[0].nbytes


def _common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x = np.asarray(a[:n], dtype=np.int64)
    y = np.asarray(b[:n], dtype=np.int64)
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else n


class PrefixCache:
    """Reuse of earlier requests' KV rows and per-sequence state for the model's KVCache ``kv``
    (numpy rows).

    ``budget_bytes``: host memory for blocks and in-flight ring captures
    (serve.prefix_cache_gib); ``block_tokens``: tokens per block (None: BLOCK_TOKENS, rounded
    up for the model's state, kv.state_block_tokens); ``metrics``: an object with
    ``observe_prefix_cache(hit, reused_tokens, evictions, bytes_held)`` or None. Raises
    ValueError when the cache's rows are not in host memory (a torch device cache) or the cache
    holds per-sequence state that declares no snapshot kind (kv.SeqState.kind).
    """

    def __init__(self, kv, budget_bytes: int, *, block_tokens: int | None = None, metrics=None, store=None):
        from moe_service.engine.kv import state_block_tokens

        if not getattr(kv, "host_rows", False):
            raise ValueError("the prefix cache needs the KV cache in host memory (the CPU path)")
        self.stateful = bool(getattr(kv, "state", None))
        if self.stateful:
            why = kv.state_restorable
            if why:
                raise ValueError(f"the prefix cache cannot restore this model's per-sequence state: {why}")
        decls = list(getattr(kv, "state_decl", {}).values()) if self.stateful else []
        self.rings = [d for d in decls if d.kind in ("ring", "carry")]  # captured during steps
        self.kv = kv
        self.budget_bytes = int(budget_bytes)
        self.block_tokens = int(block_tokens or state_block_tokens(decls, BLOCK_TOKENS))
        B = self.block_tokens
        self.row_bytes = kv.token_bytes() * B
        # the largest block (ring snapshots differ with the block's place in a ring's groups;
        # the pattern repeats after the longest group)
        period = max([d.group * d.groups for d in self.rings if d.kind == "ring"] + [1]) // B + 2
        self.block_bytes = self.row_bytes + max(
            [kv.state_block_bytes(i * B, (i + 1) * B) for i in range(period)] if self.stateful else [0])
        self.metrics = metrics
        self.held: list[list[int]] = [[] for _ in range(kv.n_seq)]
        # stateful: the slot's state is that of exactly held[slot] (its rings were not advanced past it)
        self.exact: list[bool] = [False] * kv.n_seq
        self._captures: dict[int, _Capture] = {}
        self._blocks: OrderedDict = OrderedDict()  # key -> _Block, least recently used first
        self.bytes_held = 0
        self.capture_bytes = 0
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

    def _slot_tokens(self, slot: int, prompt, limit: int) -> int:
        """Tokens of ``prompt`` (at most ``limit``) the slot's resident rows and state serve: the
        common prefix with held[slot]; with per-sequence state only all of held[slot], and
        only when the state is exactly that (rings cannot be rewound)."""
        n = _common_prefix(self.held[slot], prompt)
        if not self.stateful:
            return min(n, limit)
        return n if self.exact[slot] and n == len(self.held[slot]) and n <= limit else 0

    def acquire(self, prompt: list[int]) -> tuple[int, int]:
        """A KV slot for ``prompt`` with as many leading rows (and the state) as possible already
        in place.

        Returns (slot, reused tokens n, 0 <= n <= len(prompt) - 1); the slot's length is set
        to n. Raises RuntimeError when no slot is free (KVCache.alloc).
        """
        limit = max(0, len(prompt) - 1)
        B = self.block_tokens
        slot = self.kv.alloc(prefer=lambda s: self._slot_tokens(s, prompt, limit))
        n_slot = self._slot_tokens(slot, prompt, limit)
        chain = self._chain(prompt, limit, from_store=True)
        n_host = len(chain) * B
        n = max(n_slot, n_host)
        if n_host > n_slot:
            # rows (and append-only state rows) of the common prefix are in the slot already
            first = min(_common_prefix(self.held[slot], prompt), limit) // B
            try:
                if self.row_bytes:
                    for i in range(first, len(chain)):
                        self.kv.import_rows(slot, i * B, (i + 1) * B, chain[i].data)
                if self.stateful:
                    self.kv.import_state(slot, [(i * B, (i + 1) * B, b.state) for i, b in enumerate(chain)], first)
            except (ValueError, KeyError) as e:  # a block that does not fit this cache: compute it all
                log.warning("prefix_cache_restore_failed", slot=slot, blocks=len(chain), error=str(e))
                chain, n_slot, n = [], 0, 0
                self.held[slot] = []
        if chain:
            self._touch(chain)
            if self.bytes_held + self.capture_bytes > self.budget_bytes:
                self._evict()  # blocks read back from disk made room for themselves
        if self.stateful:
            self._arm(slot, n, continuing=n == n_slot > 0)
        self.held[slot] = list(prompt[:n])
        self.exact[slot] = False
        self.kv.length[slot] = n
        if n:
            self.hits += 1
            self.reused_tokens += n
        if self.metrics is not None:
            self.metrics.observe_prefix_cache(hit=n > 0, reused_tokens=n, evictions=0,
                                              bytes_held=self.bytes_held + self.capture_bytes)
        log.debug("prefix_cache_acquire", slot=slot, prompt_tokens=len(prompt), reused=n, from_slot=n_slot,
                  from_host=n_host)
        return slot, n

    def _arm(self, slot: int, n: int, *, continuing: bool) -> None:
        """Capture the slot's ring rows from length ``n`` on (kv.capture). ``continuing``: the
        slot goes on from its own state, so the rows its unfinished block captured before stay."""
        B = self.block_tokens
        cap = self._captures.get(slot)
        if continuing and cap is not None:
            cap.drop(lambda i: i < n // B)
            cap.stop = 1 << 62
        else:
            if cap is not None:
                cap.drop()
            cap = self._captures[slot] = _Capture(self, -(-n // B))  # a partial first block cannot be whole
        self.kv.capture[slot] = cap

    def release(self, slot: int) -> None:
        """The batch loop frees ``slot`` (call before KVCache.free): note whether its state is
        exactly held[slot] (a finish that published everything) and forget the ring rows no
        later publish can use, keeping the unfinished block's when the state is exact."""
        if not self.stateful:
            return
        self.kv.capture.pop(slot, None)
        self.exact[slot] = self.kv.length[slot] == len(self.held[slot])
        cap = self._captures.get(slot)
        if cap is None:
            return
        if self.exact[slot]:
            cap.drop(lambda i: i < len(self.held[slot]) // self.block_tokens)
        else:
            cap.drop()
            del self._captures[slot]

    # -- publishing ----------------------------------------------------------------------------

    def publish(self, slot: int, tokens: list[int]) -> int:
        """The slot's rows (and state) 0..len(tokens)-1 hold ``tokens`` (a completed step wrote
        them): note that, and copy every full block not yet held to host memory, evicting the
        least recently used blocks beyond the budget. With per-sequence state a block enters
        only with its captured ring rows complete (else it and the later ones are left out).
        Returns the blocks added. Raises ValueError when ``tokens`` exceed the context, or (with
        state) differ in length from what the slot has computed."""
        n = len(tokens)
        if n > self.kv.n_ctx:
            raise ValueError(f"prefix cache: {n} tokens exceed the context {self.kv.n_ctx}")
        if self.stateful and self.kv.length[slot] != n:
            raise ValueError(f"prefix cache: slot {slot} has computed {self.kv.length[slot]} tokens, "
                             f"not the {n} published")
        self.held[slot] = list(tokens)
        self.exact[slot] = self.stateful
        B = self.block_tokens
        cap = self._captures.get(slot)
        if self.budget_bytes < self.block_bytes:
            if cap is not None:
                cap.drop(lambda i: i < n // B)
            return 0
        chain = self._chain(tokens, n)
        parent = chain[-1] if chain else None
        key = parent.key if parent else None
        added = []
        for i in range(len(chain), n // B):
            state = None
            if self.stateful:
                rings = cap.rings(i) if cap is not None else None
                if rings is None:
                    break
                state = self.kv.export_state(slot, i * B, (i + 1) * B, rings)
            blk_tokens = tuple(tokens[i * B:(i + 1) * B])
            key = block_key(key, blk_tokens)
            stale = self._blocks.pop(key, None)  # another chain's block under this key (digest collision)
            if stale is not None:
                self.bytes_held -= stale.nbytes
            data = np.empty(self.row_bytes, np.uint8)
            if self.row_bytes:
                self.kv.export_rows(slot, i * B, (i + 1) * B, data)
            b = _Block(key, blk_tokens, parent, data, state)  # whole before it is visible
            self._blocks[key] = b
            self.bytes_held += b.nbytes
            added.append(b)
            parent = b
        if cap is not None:
            cap.drop(lambda i: i < n // B)
        self._touch(chain + added)
        evicted = self._evict()
        if self.metrics is not None and (added or evicted):
            self.metrics.observe_prefix_cache(hit=False, reused_tokens=0, evictions=evicted,
                                              bytes_held=self.bytes_held + self.capture_bytes)
        return len(added)

    def _evict(self, extra: int = 0) -> int:
        """Drop least recently used blocks until the blocks, the captures and ``extra`` bytes
        fit the budget. Returns the blocks dropped."""
        n = 0
        while self.bytes_held + self.capture_bytes + extra > self.budget_bytes and self._blocks:
            _, b = self._blocks.popitem(last=False)
            if self.store is not None and b.data is not None and not self.store.has(b.key):
                self.store.spill(b.key, b.parent.key if b.parent else None, b.tokens, _arrays(b))
            b.data = b.state = None
            self.bytes_held -= b.nbytes
            n += 1
        self.evictions += n
        return n

    def _reserve(self, nbytes: int) -> bool:
        """Room for ``nbytes`` of captured ring rows within the budget (evicting blocks);
        False when even an empty store leaves no room."""
        evicted = self._evict(nbytes)
        if evicted and self.metrics is not None:
            self.metrics.observe_prefix_cache(hit=False, reused_tokens=0, evictions=evicted,
                                              bytes_held=self.bytes_held + self.capture_bytes)
        if self.bytes_held + self.capture_bytes + nbytes > self.budget_bytes:
            return False
        self.capture_bytes += nbytes
        return True

    # -- disk store ------------------------------------------------------------------------------

    def _load(self, key, blk_tokens, parent):
        """Block ``key`` read back from the disk store into memory, or None (not stored, or a
        stored block whose rows or state do not fit this cache: logged, computed instead)."""
        arrays = self.store.get(key, blk_tokens)
        if arrays is None:
            return None
        data, state = _from_arrays(arrays)
        if data.nbytes != self.row_bytes or bool(state) != self.stateful:
            log.warning("prefix_store_block_mismatch", key=key.hex(), bytes=int(data.nbytes),
                        expected=self.row_bytes, state=bool(state))
            return None
        b = _Block(key, blk_tokens, parent, data, state)
        self._blocks[key] = b
        self.bytes_held += b.nbytes
        return b

    def persist(self, deadline_s: float) -> dict:
        """Write the blocks held in memory that the store lacks, most recently used first (a
        chain's parents are more recent than its children), while they fit before
        ``deadline_s`` (time.monotonic()); PrefixStore.save. Call it once the engine thread
        stopped. {} without a store."""
        if self.store is None:
            return {}
        blocks = [(b.key, b.parent.key if b.parent else None, b.tokens, _arrays(b))
                  for b in reversed(self._blocks.values()) if b.data is not None]
        return self.store.save(blocks, deadline_s)

    @property
    def n_blocks(self) -> int:
        return len(self._blocks)

    def stats(self) -> dict:
        out = {"blocks": len(self._blocks), "bytes_held": self.bytes_held, "budget_bytes": self.budget_bytes,
               "capture_bytes": self.capture_bytes, "hits": self.hits, "reused_tokens": self.reused_tokens,
               "evictions": self.evictions}
        if self.store is not None:
            out["disk"] = self.store.stats()
        return out


_STATE_PREFIX = "state."


def _arrays(b: _Block) -> dict:
    """A block's payload as named arrays for the disk store: its rows as ``kv`` and each
    per-sequence state snapshot as ``state.<key>`` (``state.blk.3.raw``)."""
    out = {"kv": b.data}
    for k, v in (b.state or {}).items():
        out[_STATE_PREFIX + k] = v
    return out


def _from_arrays(arrays: dict) -> tuple[np.ndarray, dict | None]:
    """The inverse of :func:`_arrays`: (rows uint8, state dict or None)."""
    state = {k[len(_STATE_PREFIX):]: v for k, v in arrays.items() if k.startswith(_STATE_PREFIX)}
    data = np.asarray(arrays.get("kv", np.empty(0, np.uint8)), dtype=np.uint8).reshape(-1)
    return data, (state or None)
