"""The KV cache as planned memory: how big it is, where it lives, what each token costs.

::

    per-layer needs (LayerKV: KV heads, key dim, value dim, latent, window)
        x engine.kv_type (f16: 2 bytes a value; q8_0: 34 bytes per 32 values, llama.cpp -ctk/-ctv q8_0)
        = bytes per token  (x context = bytes per sequence; x serve.parallel = the cache)
    context: model.context_tokens, or 0 = the model's trained context capped by
             engine.kv_cache_gib (rounded down to 256 tokens)         -> plan_context / KVPlan
    budget: engine.kv_cache_gib in GiB, or "auto" = what the plan leaves free on the KV node
             after the weights' share, numa.node_reserve_gib and serve.prefix_cache_gib
             (pipeline.plan.kv_budget; llama.cpp's --fit and vLLM's
             gpu_memory_utilization size their caches from free memory the same way)
    KVCache.allocate: ONE anonymous mapping for every layer's K and V, bound to a node
             (engine.kv_node; MPOL_BIND) and populated (MADV_POPULATE_WRITE) before serving,
             as the weights are; slots of [C, NKV, row] per layer, per sequence

``moe-service plan`` prints the KV plan (:func:`plan_for_config`), and preflight refuses a
start whose KV cache does not fit its budget or the chosen node's free memory beside the
weights, naming the numbers, before anything is loaded.

Element formats (engine/attention/ reads both): f16 caches are uint16 arrays [S, C, NKV, D]
of float16 bits; q8_0 caches are uint8 arrays [S, C, NKV, D/32*34] of ggml Q8_0 blocks. A
latent layer (MLA) keeps one row per token and passes ``v is k``.

Sliding-window layers are sized for the full context (a ring buffer of ``window`` rows
would save memory; not done: the prefix cache and the attention kernels address rows by
position).

Per-sequence state beside the rows (:class:`SeqState`, declared by an architecture's
``seq_state(n_ctx)``; deepseek4's compressed KV, indexer keys and compressor rings) is planned
and allocated from the same declaration: the plan counts ``n_seq x sum(state bytes)`` on top
of the rows, and :meth:`KVCache.allocate` places those arrays in the same bound, populated
mapping (``KVCache.state``).

Snapshot and restore at a block boundary (the prefix cache, engine/prefix.py): each
:class:`SeqState` says how its array evolves (``kind``), which fixes what a block of tokens
[a, b) must carry so that the state at any block boundary n can be rebuilt exactly:

- ``"rows"``: append-only rows, row j final once (j + 1) x ``group`` tokens are computed and
  never written again (deepseek4's compressed KV, ``group`` = the compression ratio). Block
  [a, b) carries rows a // group .. b // group - 1: the chain of blocks shares them by prefix
  length, nothing is copied twice.
- ``"ring"``: row ``p % shape[0]`` holds position p's values, written once when p is computed
  (deepseek4's raw window and compressor rings). At length n the rows of positions
  [live_start(n), n) are read later, live_start(n) = max(0, (n // group - groups + 1) x group);
  the others are stale. Block [a, b) carries the rows of positions [max(a, live_start(b)), b)
  in position order; since live_start only grows, the blocks up to n carry every live row at n.
  A step overwrites ring rows of its own positions, so the architecture reports every
  position's row as it computes it (:meth:`KVCache.note_ring`) and the prefix cache captures
  the ones its blocks need.
- ``"carry"``: a state every token rewrites as a whole (a state-space layer's recurrent
  state, shape [*shape] per sequence). Block [a, b) carries a copy of it after token b - 1.
  The architecture asks :meth:`KVCache.capture_points` which lengths inside its step are
  wanted and reports the state at each (:meth:`KVCache.note_carry`).
- ``""`` (undeclared): the prefix cache cannot restore it and stays off for the model.

A block's state snapshot is a plain dict ``{"blk.<layer>.<name>": numpy array}`` (
:meth:`KVCache.export_state` / :meth:`KVCache.import_state`), self-describing given the block's
token span and the declarations.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from moe_service.log import get_logger
from moe_service.sizes import GiB as GIB

log = get_logger(__name__)

KV_TYPES = ("f16", "q8_0")
Q8_0_BLOCK = 32
Q8_0_BYTES = 34
CONTEXT_ALIGN = 256
"""A context derived from the memory budget is rounded down to a multiple of this."""
MIN_CONTEXT = 256
"""The least context a budget-derived plan accepts."""


@dataclass(frozen=True)
class LayerKV:
    """What one layer keeps per token (an architecture's ``kv_layers()`` declares it; also
    exported by moe_service.engine.arch): ``n_head_kv`` heads of ``key_dim`` key values and
    ``value_dim`` value values; ``latent``: one shared row per token (MLA), V = its first
    value_dim dims, the cache passes ``vc is kc`` to engine/attention/ (``n_head_kv`` is 1;
    0: the layer keeps no rows here, its architecture's ``seq_state`` holds them, deepseek4);
    ``window``: sliding window in tokens (0: full attention; the cache keeps every row)."""

    n_head_kv: int
    key_dim: int
    value_dim: int
    latent: bool = False
    window: int = 0


STATE_KINDS = ("", "rows", "ring", "carry")
"""SeqState kinds (module docstring)."""


@dataclass(frozen=True)
class SeqState:
    """One array an architecture keeps per sequence beside the KV rows (its state for the
    layer ``layer``, e.g. deepseek4's compressed KV rows): ``shape`` per sequence (the cache
    holds [n_seq, *shape]) of numpy ``dtype`` (a dtype name: "float16", "float32"), named
    ``name`` (the architecture reads it back as ``KVCache.state[(layer, name)]``)."""

    layer: int
    name: str
    shape: tuple[int, ...]
    dtype: str
    kind: str = ""
    """How the array evolves (module docstring): "rows" (append-only rows, one per ``group``
    tokens), "ring" (position p at row p % shape[0], live positions per ``group``/``groups``),
    "carry" (rewritten whole by every token), "" (undeclared: no snapshot, the prefix cache
    stays off)."""
    group: int = 1
    groups: int = 1

    def __post_init__(self) -> None:
        if self.kind not in STATE_KINDS:
            raise ValueError(f"SeqState {self.key}: kind {self.kind!r} is not one of {STATE_KINDS}")
        if self.group < 1 or self.groups < 1:
            raise ValueError(f"SeqState {self.key}: group and groups must be >= 1")
        if self.kind == "ring" and self.shape[0] < self.group * self.groups - 1:
            raise ValueError(f"SeqState {self.key}: a ring of {self.shape[0]} rows cannot hold "
                             f"{self.groups} groups of {self.group} positions")

    @property
    def nbytes(self) -> int:
        """Bytes per sequence."""
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    @property
    def key(self) -> str:
        """The snapshot key, ``blk.<layer>.<name>``."""
        return f"blk.{self.layer}.{self.name}"

    @property
    def row_nbytes(self) -> int:
        """Bytes of one row (shape[1:])."""
        return int(np.prod(self.shape[1:], dtype=np.int64)) * np.dtype(self.dtype).itemsize

    def live_start(self, n: int) -> int:
        """A ring's first live position at length ``n`` (positions [live_start, n) are read by
        later steps)."""
        return max(0, (n // self.group - self.groups + 1) * self.group)

    def block_part(self, a: int, b: int) -> tuple[int, int]:
        """What block [a, b) carries: "rows": row indices [a // group, b // group); "ring":
        positions [max(a, live_start(b)), b); "carry": (0, 1), one copy of the whole state."""
        if self.kind == "carry":
            return 0, 1
        if self.kind == "rows":
            return a // self.group, b // self.group
        if self.kind == "ring":
            return min(b, max(a, self.live_start(b))), b
        raise ValueError(f"SeqState {self.key} declares no snapshot kind")


def state_block_tokens(states: Sequence[SeqState], base: int) -> int:
    """The prefix-cache block size for ``states``: ``base`` tokens, rounded up to a multiple
    of every one-group ring's group (at such a boundary that ring holds no live row: a
    deepseek4 ratio-128 compressor ring needs nothing, instead of up to 127 float32 rows)."""
    out = int(base)
    for a in states:
        if a.kind == "ring" and a.groups == 1 and a.group > 1:
            out = out * a.group // math.gcd(out, a.group)
    return out


StateFn = Callable[[int], Sequence[SeqState]]
"""``state(n_ctx)``: the per-sequence arrays for a context of n_ctx tokens (an
architecture's ``seq_state``)."""


def state_bytes_per_seq(state: StateFn | None, n_ctx: int) -> int:
    """Bytes of per-sequence state for a context of ``n_ctx`` tokens (0 without state)."""
    return 0 if state is None else sum(a.nbytes for a in state(n_ctx))


def layers_from_params(p) -> list[LayerKV]:
    """One LayerKV per layer from moe_service.gguf_model.ModelParams (n_layer, n_head_kv,
    head_dim, head_dim_v): the classic layout every layer shares."""
    return [LayerKV(p.n_head_kv, p.head_dim, p.head_dim_v)] * p.n_layer


def row_bytes(dim: int, kv_type: str) -> int:
    """Bytes of one head row of ``dim`` values. Raises ValueError for an unknown type or a
    q8_0 row that is not whole blocks."""
    if kv_type == "f16":
        return 2 * dim
    if kv_type == "q8_0":
        if dim % Q8_0_BLOCK:
            raise ValueError(f"engine.kv_type = q8_0 needs head dims that are multiples of 32 (got {dim})")
        return dim // Q8_0_BLOCK * Q8_0_BYTES
    raise ValueError(f"engine.kv_type must be one of {', '.join(KV_TYPES)} (got {kv_type!r})")


def layer_bytes_per_token(layer, kv_type: str) -> int:
    """K (and V unless latent) bytes one token adds to one layer."""
    b = layer.n_head_kv * row_bytes(layer.key_dim, kv_type)
    if not layer.latent:
        b += layer.n_head_kv * row_bytes(layer.value_dim, kv_type)
    return b


def bytes_per_token(layers, kv_type: str) -> int:
    """KV bytes one token adds over every layer."""
    return sum(layer_bytes_per_token(layer, kv_type) for layer in layers)


@dataclass
class KVPlan:
    """The KV cache a configuration asks for.

    ``n_ctx``: tokens per sequence (the context); ``n_seq``: sequence slots (serve.parallel);
    ``bytes_per_token`` over all layers' rows; ``state_bytes_per_seq``: the architecture's
    per-sequence state at this context (:class:`SeqState`; 0 for most); ``budget_bytes``:
    engine.kv_cache_gib, or what ``auto`` found free; ``budget_words``: how sentences name the
    budget; ``requested_ctx``: model.context_tokens (0: derived); ``problem``:
    why it cannot start (None when it can). ``total_bytes`` is the sum of the arrays
    :meth:`KVCache.allocate` makes for this plan (rows + state; the mapping adds at most 63
    bytes of alignment per array)."""

    kv_type: str
    n_seq: int
    n_ctx: int
    n_ctx_train: int
    requested_ctx: int
    bytes_per_token: int
    budget_bytes: int
    node: int | None = None
    problem: str | None = None
    state_bytes_per_seq: int = 0
    budget_words: str = ""

    def __post_init__(self) -> None:
        if not self.budget_words:
            self.budget_words = budget_words(self.budget_bytes)

    @property
    def bytes_per_seq(self) -> int:
        return self.bytes_per_token * self.n_ctx + self.state_bytes_per_seq

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_seq * self.n_seq

    @property
    def ok(self) -> bool:
        return self.problem is None

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(bytes_per_seq=self.bytes_per_seq, total_bytes=self.total_bytes)
        return d

    def sentence(self) -> str:
        per_seq = f"{self.n_ctx} tokens x {self.bytes_per_token / 1024:.1f} KiB/token"
        if self.state_bytes_per_seq:
            state = f"{self.state_bytes_per_seq / 2**20:.1f} MiB of KV state at {self.n_ctx} tokens"
            per_seq = f"({per_seq} + {state})" if self.bytes_per_token else state
        s = (f"KV cache {self.kv_type}: {self.n_seq} sequences x {per_seq} = {self.total_bytes / GIB:.2f} GiB "
             f"({self.bytes_per_seq / 2**20:.1f} MiB per sequence; budget {self.budget_words}; "
             f"trained context {self.n_ctx_train})")
        return s if self.ok else f"{s}: {self.problem}"


def _fit_tokens(bpt: int, state: StateFn | None, n_seq: int, budget_bytes: int) -> int:
    """The most tokens per sequence whose rows (``bpt`` bytes a token) and state fit
    ``budget_bytes`` for ``n_seq`` sequences (the state grows with the context: a bisection
    below the rows-only bound)."""
    hi = int(budget_bytes) // max(1, bpt * n_seq)
    if state is None:
        return hi
    if n_seq * state_bytes_per_seq(state, 0) > budget_bytes:
        return 0
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if n_seq * (bpt * mid + state_bytes_per_seq(state, mid)) <= budget_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _per_token_words(bpt: int, state_bytes: int, n_ctx: int) -> str:
    """'B bytes/token' (+ the state bytes per sequence at n_ctx) for the problem sentences."""
    if not state_bytes:
        return f"{bpt} bytes/token"
    state = f"{state_bytes} bytes of per-sequence KV state (window rows, compressed KV) at {n_ctx} tokens"
    return state if not bpt else f"{bpt} bytes/token + {state}"


def budget_words(budget_bytes: int, auto_detail: str | None = None) -> str:
    """How a problem sentence names the budget: ``engine.kv_cache_gib = 4.00 GiB``, or for
    ``auto`` ``engine.kv_cache_gib = auto (12.00 GiB: <auto_detail>)``."""
    if auto_detail is None:
        return f"engine.kv_cache_gib = {budget_bytes / GIB:.2f} GiB"
    return f"engine.kv_cache_gib = auto ({budget_bytes / GIB:.2f} GiB: {auto_detail})"


def plan_context(layers, n_ctx_train: int, n_seq: int, *, context_tokens: int = 0, budget_bytes: int,
                 kv_type: str = "f16", node: int | None = None, state: StateFn | None = None,
                 words: str = "") -> KVPlan:
    """The context and KV bytes for ``n_seq`` sequences.

    ``context_tokens`` > 0: that context (capped at the trained context), refused when its
    cache exceeds ``budget_bytes``; 0: the trained context, capped by what ``budget_bytes``
    holds for ``n_seq`` sequences (rounded down to CONTEXT_ALIGN tokens), refused below
    MIN_CONTEXT. ``state``: the architecture's per-sequence arrays (:class:`SeqState`),
    counted on top of the rows. The problem (if any) names the keys and the numbers;
    ``words``: how it names the budget (:func:`budget_words`).
    """
    bpt = bytes_per_token(layers, kv_type)
    trained = int(n_ctx_train or 0)
    plan = KVPlan(kv_type, n_seq, 0, trained, int(context_tokens), bpt, int(budget_bytes), node,
                  budget_words=words)
    words = plan.budget_words
    fit = _fit_tokens(bpt, state, n_seq, int(budget_bytes))
    if context_tokens > 0:
        plan.n_ctx = min(int(context_tokens), trained) if trained else int(context_tokens)
        plan.state_bytes_per_seq = state_bytes_per_seq(state, plan.n_ctx)
        if plan.total_bytes > budget_bytes:
            plan.problem = (f"model.context_tokens = {plan.n_ctx} needs {plan.total_bytes / GIB:.2f} GiB of KV cache for "
                            f"serve.parallel = {n_seq} sequences "
                            f"({_per_token_words(bpt, plan.state_bytes_per_seq, plan.n_ctx)}), more than "
                            f"{words} (which holds {fit} tokens per sequence)")
        return plan
    if not trained:
        plan.n_ctx = fit // CONTEXT_ALIGN * CONTEXT_ALIGN
    else:
        plan.n_ctx = trained if fit >= trained else fit // CONTEXT_ALIGN * CONTEXT_ALIGN
    plan.state_bytes_per_seq = state_bytes_per_seq(state, plan.n_ctx)
    if plan.n_ctx < MIN_CONTEXT:
        plan.problem = (f"{words} holds only {fit} tokens per sequence for "
                        f"serve.parallel = {n_seq} sequences "
                        f"({_per_token_words(bpt, state_bytes_per_seq(state, MIN_CONTEXT), MIN_CONTEXT)}); at least "
                        f"{MIN_CONTEXT} are needed (raise engine.kv_cache_gib, lower serve.parallel or use "
                        "engine.kv_type = q8_0)")
    return plan


def plan_for_config(catalog, config, layers: Sequence[LayerKV], state: StateFn | None = None, *,
                    auto_budget: tuple[int, str] | None = None) -> KVPlan:
    """:func:`plan_context` for ``catalog`` (its trained context) under ``config``
    (model.context_tokens, serve.parallel, engine.kv_cache_gib, engine.kv_type, engine.kv_node),
    with the per-layer needs ``layers`` and per-sequence ``state`` that the architecture
    declares (``moe_service.engine.arch.kv_needs(catalog)`` hands both over: this module
    consumes declarations and knows no architecture). ``auto_budget``: (bytes, how they were
    found) when engine.kv_cache_gib = "auto" (pipeline.plan.kv_budget computes it from the
    plan); without it an ``auto`` budget is a problem that says so."""
    p = catalog.params
    e = config.engine
    node = e.kv_node if e.kv_node >= 0 else None
    if e.kv_cache_gib == "auto":
        if auto_budget is None:
            plan = KVPlan(e.kv_type, config.serve.parallel, 0, int(p.n_ctx_train or 0), config.model.context_tokens,
                          bytes_per_token(layers, e.kv_type), 0, node, budget_words="engine.kv_cache_gib = auto")
            plan.problem = ("engine.kv_cache_gib = auto is sized from the placement plan's free memory, "
                            "which was not given (pipeline.plan.kv_budget)")
            return plan
        budget, words = auto_budget[0], budget_words(auto_budget[0], auto_budget[1])
    else:
        budget, words = int(e.kv_cache_gib * GIB), ""
    return plan_context(layers, p.n_ctx_train, config.serve.parallel, context_tokens=config.model.context_tokens,
                        budget_bytes=budget, kv_type=e.kv_type, node=node, state=state, words=words)


# ---------------------------------------------------------------------------------------
# The cache


class KVCache:
    """Sequence slots of the KV cache and each slot's length.

    ``k``/``v``: one array per layer: [S, C, NKV, D] (numpy uint16 float16 bits for f16,
    uint8 Q8_0 blocks for q8_0, or torch float16 tensors on a device); a latent layer has
    ``v[i] is k[i]``. Slots are taken with :meth:`alloc` and returned with :meth:`free`; rows
    beyond a slot's length are not read by attention, and a freed slot's rows stay as they
    were (the prefix cache reuses them, see :meth:`alloc`'s ``prefer``).

    ``state``: the architecture's per-sequence arrays (:class:`SeqState`), keyed
    ``(layer, name)``, each numpy [S, *shape] in host memory; empty for most architectures.
    """

    def __init__(self, n_seq: int, n_ctx: int, k: list, v: list, layers=None, *, kv_type: str = "f16",
                 arena: np.ndarray | None = None, node: int | None = None, state: dict | None = None,
                 state_decl: Sequence[SeqState] = ()):
        self.k, self.v = k, v
        self.state: dict[tuple[int, str], np.ndarray] = dict(state or {})
        self.state_decl: dict[tuple[int, str], SeqState] = {(a.layer, a.name): a for a in state_decl}
        # slot -> the prefix cache's capture: sink(decl, p0, rows), .points(n0, n1), .carry(decl, n, value)
        self.capture: dict[int, Any] = {}
        self.layers = list(layers) if layers is not None else None
        self.kv_type = kv_type
        self.length = [0] * n_seq
        self.n_seq = n_seq
        self.n_ctx = n_ctx
        self.node = node
        self._arena = arena
        self._free = list(range(n_seq - 1, -1, -1))
        self._lock = threading.Lock()

    @classmethod
    def allocate(cls, layers, n_seq: int, n_ctx: int, *, kv_type: str = "f16", node: int | None = None,
                 state: Sequence[SeqState] = ()) -> KVCache:
        """Every layer's K and V, and the per-sequence ``state`` arrays (zeroed), in one
        anonymous mapping (2 MiB aligned, THP advised), bound to NUMA ``node`` (MPOL_BIND;
        None: no binding, first touch) and populated now.

        Raises CapacityError when the address space is refused, ValueError for a bad kv_type,
        NumaError when the node cannot be bound; a populate that finds no memory raises
        OSError (ENOMEM)."""
        from moe_service import memory

        layers = list(layers)
        shapes = []
        total = 0
        dt = np.uint16 if kv_type == "f16" else np.uint8
        for layer in layers:
            kr = row_bytes(layer.key_dim, kv_type) // np.dtype(dt).itemsize
            vr = row_bytes(layer.value_dim, kv_type) // np.dtype(dt).itemsize
            ks = (n_seq, n_ctx, layer.n_head_kv, kr)
            vs = None if layer.latent else (n_seq, n_ctx, layer.n_head_kv, vr)
            shapes.append((ks, vs))
            for s in (ks, vs):
                if s is not None:
                    total += _align64(int(np.prod(s)) * np.dtype(dt).itemsize)
        state = list(state)
        for a in state:
            total += _align64(n_seq * a.nbytes)
        arena = memory.reserve_thp_arena(max(total, 4096))
        if node is not None:
            from moe_service import numa

            numa.mbind(memory.address_of(arena), memory.align_up(arena.nbytes, 4096), numa.MPOL_BIND, [node])
        _populate(arena, total)
        k, v = [], []
        off = 0
        for ks, vs in shapes:
            n = int(np.prod(ks)) * np.dtype(dt).itemsize
            kk = arena[off: off + n].view(dt).reshape(ks)
            off += _align64(n)
            if vs is None:
                vv = kk
            else:
                n = int(np.prod(vs)) * np.dtype(dt).itemsize
                vv = arena[off: off + n].view(dt).reshape(vs)
                off += _align64(n)
            k.append(kk)
            v.append(vv)
        arrays = {}
        for a in state:
            n = n_seq * a.nbytes
            arrays[(a.layer, a.name)] = arena[off: off + n].view(a.dtype).reshape((n_seq,) + tuple(a.shape))
            off += _align64(n)
        log.info("kv_cache_allocated", kv_type=kv_type, n_seq=n_seq, n_ctx=n_ctx, layers=len(layers), bytes=total,
                 state_arrays=len(arrays), state_bytes=n_seq * sum(a.nbytes for a in state), node=node)
        return cls(n_seq, n_ctx, k, v, layers, kv_type=kv_type, arena=arena, node=node, state=arrays,
                   state_decl=state)

    @staticmethod
    def state_arrays(state: Sequence[SeqState], n_seq: int) -> dict:
        """Plain zeroed numpy arrays for ``state`` (a cache whose rows are not in an arena of
        ours, e.g. the torch path's): {(layer, name): [n_seq, *shape]}."""
        return {(a.layer, a.name): np.zeros((n_seq,) + tuple(a.shape), a.dtype) for a in state}

    def alloc(self, prefer=None) -> int:
        """A free sequence slot, its length 0. ``prefer(slot) -> score``: among free slots take
        the highest score (the prefix cache: the slot whose rows hold the longest prefix of
        the new prompt); ties and no ``prefer``: the lowest free slot. Raises RuntimeError
        when all are in use."""
        with self._lock:
            if not self._free:
                raise RuntimeError("no free sequence slot in the KV cache")
            i = len(self._free) - 1
            if prefer is not None and len(self._free) > 1:
                i = max(range(len(self._free)), key=lambda j: (prefer(self._free[j]), -self._free[j]))
            s = self._free.pop(i)
        self.length[s] = 0
        return s

    def free(self, s: int) -> None:
        with self._lock:
            if s not in self._free:
                self._free.append(s)
        self.length[s] = 0

    @property
    def n_free(self) -> int:
        return len(self._free)

    def bytes(self) -> int:
        """Bytes of every layer's K and V (a latent layer counted once) and of the per-sequence
        state arrays."""
        seen: set[int] = set()
        total = 0
        for t in self.k + self.v + list(self.state.values()):
            if id(t) in seen:
                continue
            seen.add(id(t))
            total += int(t.numel() * t.element_size()) if hasattr(t, "numel") else t.nbytes
        return total

    # -- rows, for the prefix cache ----------------------------------------------------------

    @property
    def host_rows(self) -> bool:
        """True when the caches are numpy arrays (rows can be exported to host memory)."""
        return bool(self.k) and isinstance(self.k[0], np.ndarray)

    def token_bytes(self) -> int:
        """Bytes of one token's rows over all layers (K, and V unless latent)."""
        total = 0
        for kk, vv in zip(self.k, self.v, strict=True):
            total += kk[0, 0].nbytes + (0 if vv is kk else vv[0, 0].nbytes)
        return total

    def export_rows(self, slot: int, a: int, b: int, out: np.ndarray) -> None:
        """Copy rows a..b-1 of ``slot`` (every layer, K then V) into ``out`` uint8
        [(b - a) * token_bytes()], layer by layer. Raises ValueError for a bad range."""
        self._check(slot, a, b, out)
        off = 0
        for kk, vv in zip(self.k, self.v, strict=True):
            for c in (kk,) if vv is kk else (kk, vv):
                src = c[slot, a:b].reshape(-1).view(np.uint8)
                out[off: off + src.size] = src
                off += src.size

    def import_rows(self, slot: int, a: int, b: int, data: np.ndarray) -> None:
        """The inverse of :meth:`export_rows`: rows a..b-1 of ``slot`` from ``data``."""
        self._check(slot, a, b, data)
        off = 0
        for kk, vv in zip(self.k, self.v, strict=True):
            for c in (kk,) if vv is kk else (kk, vv):
                dst = c[slot, a:b].reshape(-1).view(np.uint8)
                dst[:] = data[off: off + dst.size]
                off += dst.size

    def copy_rows(self, src: int, dst: int, a: int, b: int) -> None:
        """Rows a..b-1 of slot ``src`` into slot ``dst`` (every layer)."""
        if not (0 <= a <= b <= self.n_ctx):
            raise ValueError(f"KV rows {a}..{b} outside the context {self.n_ctx}")
        for kk, vv in zip(self.k, self.v, strict=True):
            for c in (kk,) if vv is kk else (kk, vv):
                c[dst, a:b] = c[src, a:b]

    # -- per-sequence state, for the prefix cache (module docstring) -----------------------------

    @property
    def state_restorable(self) -> str | None:
        """None when every per-sequence state array declares a snapshot kind (the prefix cache
        can restore a sequence), else a sentence naming the first that does not."""
        for key in self.state:
            decl = self.state_decl.get(key)
            if decl is None or not decl.kind:
                return (f"the per-sequence state {key[1]!r} of layer {key[0]} declares no snapshot kind "
                        "(kv.SeqState.kind), so reused rows alone would give wrong output")
        return None

    def note_ring(self, slot: int, layer: int, name: str, p0: int, rows: np.ndarray) -> None:
        """An architecture computed ring state ``(layer, name)``'s rows for positions p0 ..
        p0 + len(rows) - 1 of ``slot`` (every position of its span, also those its ring does
        not keep): handed to the capture registered for the slot (the prefix cache), if any.
        Costs one dict lookup otherwise."""
        sink = self.capture.get(slot)
        if sink is not None:
            sink(self.state_decl[(layer, name)], int(p0), rows)

    def capture_points(self, slot: int, n0: int, n1: int) -> list[int]:
        """The lengths n0 < n <= n1 at which the prefix cache wants ``slot``'s "carry" states
        (:meth:`note_carry`): block ends it captures; [] when nothing is captured."""
        sink = self.capture.get(slot)
        return sink.points(n0, n1) if sink is not None else []

    def note_carry(self, slot: int, layer: int, name: str, n: int, value: np.ndarray) -> None:
        """An architecture's "carry" state ``(layer, name)`` of ``slot`` after its first ``n``
        tokens (n from :meth:`capture_points`), handed to the slot's capture."""
        sink = self.capture.get(slot)
        if sink is not None:
            sink.carry(self.state_decl[(layer, name)], int(n), value)

    def state_block_bytes(self, a: int, b: int) -> int:
        """Bytes of the state snapshot of block [a, b) (:meth:`export_state`)."""
        total = 0
        for decl in self.state_decl.values():
            lo, hi = decl.block_part(a, b)
            total += decl.nbytes if decl.kind == "carry" else (hi - lo) * decl.row_nbytes
        return total

    def export_state(self, slot: int, a: int, b: int, rings: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The state snapshot of block [a, b) of ``slot``: {"blk.<layer>.<name>": array}, for
        "rows" states a copy of rows block_part(a, b) of the slot's array, for "ring" states
        ``rings[key]`` (the captured rows of positions block_part(a, b), in position order), for
        "carry" states ``rings[key]`` (the captured state after token b - 1, [*shape]).
        Raises KeyError when a captured array is missing, ValueError when its shape is wrong."""
        out: dict[str, np.ndarray] = {}
        for (layer, name), decl in self.state_decl.items():
            lo, hi = decl.block_part(a, b)
            if decl.kind == "rows":
                out[decl.key] = self.state[(layer, name)][slot, lo:hi].copy()
                continue
            r = rings[decl.key]
            want = tuple(decl.shape) if decl.kind == "carry" else (hi - lo,) + tuple(decl.shape[1:])
            if r.shape != want or r.dtype != np.dtype(decl.dtype):
                raise ValueError(f"captured {decl.key} for block {a}..{b}: {r.shape} {r.dtype}, expected "
                                 f"{want} {decl.dtype}")
            out[decl.key] = r
        return out

    def import_state(self, slot: int, blocks: Sequence[tuple[int, int, dict]], first: int = 0) -> None:
        """Restore ``slot``'s state at the end n of ``blocks`` ((a, b, snapshot) in order, from
        token 0, contiguous): "rows" states get the rows of blocks[first:] (the slot already
        holds those of the earlier ones), "ring" states the rows of positions
        [live_start(n), n), each at row p % ring rows, "carry" states the last block's copy.
        Raises ValueError for a gap or a snapshot that does not cover the live positions."""
        if not blocks:
            return
        n = blocks[-1][1]
        for i, (a, b, _) in enumerate(blocks):
            if a != (blocks[i - 1][1] if i else 0) or b < a:
                raise ValueError(f"state blocks are not contiguous from 0 at block {i} ({a}..{b})")
        for (layer, name), decl in self.state_decl.items():
            arr = self.state[(layer, name)]
            if decl.kind == "rows":
                for a, b, snap in blocks[first:]:
                    lo, hi = decl.block_part(a, b)
                    arr[slot, lo:hi] = snap[decl.key]
                continue
            if decl.kind == "carry":
                arr[slot] = blocks[-1][2][decl.key]
                continue
            need = decl.live_start(n)
            p = n
            for a, b, snap in reversed(blocks):  # b == p: contiguous
                if p <= need:
                    break
                lo, hi = decl.block_part(a, b)
                take = max(lo, need)
                arr[slot, np.arange(take, hi) % decl.shape[0]] = snap[decl.key][take - lo:]
                p = take
                if lo > a:  # the block carries only its live tail: nothing before it is needed
                    break
            if p > need:
                raise ValueError(f"the blocks up to {n} do not carry {decl.key}'s live positions {need}..{p}")

    def _check(self, slot, a, b, buf) -> None:
        if not (0 <= slot < self.n_seq and 0 <= a <= b <= self.n_ctx):
            raise ValueError(f"KV rows {a}..{b} of slot {slot} outside {self.n_seq} slots x {self.n_ctx} tokens")
        if buf.dtype != np.uint8 or buf.size < (b - a) * self.token_bytes():
            raise ValueError(f"KV row buffer of {buf.size} bytes ({buf.dtype}) is too small for {b - a} tokens")


def _align64(n: int) -> int:
    return (n + 63) // 64 * 64


def _populate(arena: np.ndarray, nbytes: int) -> None:
    """Fault every page in now, under the range's policy (MADV_POPULATE_WRITE; a kernel
    without it: write zeros)."""
    from moe_service import memory

    n = memory.align_up(max(nbytes, 1), 4096)
    try:
        memory.populate_write(memory.address_of(arena), min(n, memory.align_up(arena.nbytes, 4096)))
    except OSError as e:
        import errno

        if e.errno != errno.EINVAL:
            raise
        arena[:nbytes] = 0
