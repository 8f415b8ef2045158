"""The public call, :func:`attend`: checks the arrays against each other (once per shape:
the op array's template), fills the op array, and runs the plan (planner) on the worker
pool or on the calling thread. The contract it implements is the package docstring.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

from moe_service.engine.attention.cache_rows import cache_format, cache_head_dim
from moe_service.engine.attention.layout import (
    _JIT,
    FMT_Q8_0,
    META_W,
    O_D,
    O_DV,
    O_GROUP,
    O_NH,
    O_NKV,
    O_NTOK,
    O_RMAX,
    O_WIDE,
    O_WINDOW,
    OP_LEN,
    Q8_0_BLOCK,
)
from moe_service.engine.attention.planner import (
    MIN_SPLIT_KEYS,
    QUERY_ROWS,
    SCORE_BUDGET,
    SERIAL_WORK,
    _build,
    _exact_prepare,
    _fill_addresses,
)
from moe_service.engine.attention.tasks import _run_serial, item_address


def _f32_bits(x: float) -> int:
    """The float32 bits of ``x`` as an int (stored in the op array, read back as float32)."""
    return int(np.float32(x).view(np.int32))


def key_tile(d: int, dv: int) -> int:
    """Keys per tile: K and V tiles of float32 together within ~32 KiB (L1d)."""
    return int(max(16, min(128, 8192 // max(1, d + dv) // 16 * 16)))


@njit(**_JIT)
def _first_bad_span(sp, n_tok, n_seq, n_ctx):
    """Index of the first span (seq, a, e, n0) outside q's rows or the cache, else -1."""
    for i in range(sp.shape[0]):
        seq, a, e, n0 = sp[i, 0], sp[i, 1], sp[i, 2], sp[i, 3]
        if seq < 0 or seq >= n_seq or a < 0 or e <= a or e > n_tok or n0 < 0 or n0 + e - a > n_ctx:
            return i
    return -1


_NO_SINKS = np.zeros(1, np.float32)
_NO_PML = np.zeros(1, np.float64)
_NO_PACC = np.zeros(1, np.float32)
_NO_META = np.zeros((1, META_W), np.int64)


_CACHE_MAX = 64
_OPS: dict[tuple, np.ndarray] = {}
"""(shapes, formats, scale, window, sinks?) -> the op array's fields that depend on them alone,
checked once: a decode step calls attend once per layer with the same shapes, and the Python
checks and op filling cost about as much as a short decode's attention kernels. Cleared
when it holds _CACHE_MAX entries; entries are never modified (attend copies one)."""
_SPANS: dict[tuple, np.ndarray] = {}
"""tuple(spans) -> the int64 [S, 4] array (the layers of one step share their spans)."""


def _op_template(q: np.ndarray, kc: np.ndarray, vc: np.ndarray, out: np.ndarray, scale: float, window: int,
                 has_sinks: bool) -> np.ndarray:
    """The op array for these shapes, formats and settings, O_NTOK and O_WIDE left to the
    call. Raises ValueError for caches of another dtype or shapes that do not agree."""
    key = (q.shape[1:], kc.shape, vc.shape, kc.dtype.char, vc.dtype.char, out.shape[1:], scale, window, has_sinks)
    op = _OPS.get(key)
    if op is not None:
        return op
    nh, d = q.shape[1], q.shape[2]
    kfmt, vfmt = cache_format(kc), cache_format(vc)
    nkv = kc.shape[2]
    dk, dvc = cache_head_dim(kc), cache_head_dim(vc)
    dv = out.shape[2]
    if (nkv == 0 or nh % nkv or dk != d or vc.shape[2] != nkv or dv > dvc or out.shape[1] != nh
            or vc.shape[:2] != kc.shape[:2]
            or (kfmt == FMT_Q8_0 and d % Q8_0_BLOCK) or (vfmt == FMT_Q8_0 and dv % Q8_0_BLOCK)):
        raise ValueError(f"attention: q {q.shape}, k cache {kc.shape}, v cache {vc.shape}, out {out.shape} do not agree")
    group = nh // nkv
    rmax = max(1, QUERY_ROWS // group) * group
    op = np.zeros(OP_LEN, np.int64)
    krow, vrow = kc.shape[3], vc.shape[3]
    op[O_NH:O_NTOK + 1] = (nh, d, nkv, dv, group, key_tile(d, dv),
                           kfmt, kc.shape[1] * nkv * krow, nkv * krow, krow,
                           vfmt, vc.shape[1] * nkv * vrow, nkv * vrow, vrow,
                           _f32_bits(scale), window, int(has_sinks), rmax, 0)
    if len(_OPS) >= _CACHE_MAX:
        _OPS.clear()
    _OPS[key] = op
    return op


def _spans_array(spans) -> np.ndarray:
    """spans as int64 [S, 4], from _SPANS when a list of tuples of ints was seen before (never
    modified: the kernels only read it)."""
    try:
        key = tuple(spans) if isinstance(spans, list) else None
        sp = _SPANS.get(key) if key is not None else None
    except TypeError:  # unhashable rows (lists): converted every time
        key = sp = None
    if sp is None:
        sp = np.asarray(spans, dtype=np.int64).reshape(-1, 4)
        if key is not None:
            if len(_SPANS) >= _CACHE_MAX:
                _SPANS.clear()
            _SPANS[key] = sp
    return sp


def attend(ops, q: np.ndarray, kc: np.ndarray, vc: np.ndarray, spans, scale: float, out: np.ndarray, *,
           window: int = 0, sinks: np.ndarray | None = None, online: bool = False) -> None:
    """Causal attention of every span's new queries over its sequence's cache (already
    holding the new keys), written to ``out``.

    ops: the CPU kernel backend (moe_service.engine.ops.CpuOps, whose worker ``pool`` runs the
    tasks; None or an object without a pool: the calling thread runs them); q: float32
    [T, NH, D]; out: float32 [T, NH, Dv]; NH a multiple of NKV (query head h reads KV head
    h // (NH / NKV)); scale: float (usually 1/sqrt(D)); window: 0 for full causal attention,
    else the sliding window in tokens; sinks: float32 [NH] or None; online: the one-pass
    online softmax (flash attention; decode splits key ranges over the workers) instead of the
    default two-pass contract (package docstring). Caches in either format. Raises ValueError
    for inconsistent shapes or a span outside the cache (never reads outside the caches).
    """
    T = q.shape[0]
    op = _op_template(q, kc, vc, out, float(scale), int(window), sinks is not None).copy()
    if out.shape[0] != T:
        raise ValueError(f"attention: q {q.shape}, k cache {kc.shape}, v cache {vc.shape}, out {out.shape} do not agree")
    if sinks is not None and sinks.shape[0] != op[O_NH]:
        raise ValueError(f"attention: {sinks.shape[0]} sinks for {op[O_NH]} heads")
    sp = _spans_array(spans)
    i = _first_bad_span(sp, T, kc.shape[0], kc.shape[1])
    if i >= 0:
        raise ValueError(f"attention: span {tuple(int(x) for x in sp[i])} is outside q ({T} rows) or the cache "
                         f"{kc.shape}")
    if not (kc.flags.c_contiguous and vc.flags.c_contiguous):
        raise ValueError("attention: the caches must be C-contiguous")
    q32 = np.ascontiguousarray(q, dtype=np.float32)
    o32 = out if (out.dtype == np.float32 and out.flags.c_contiguous) else np.empty(out.shape, np.float32)
    s = np.ascontiguousarray(sinks, dtype=np.float32) if sinks is not None else _NO_SINKS
    pool: Any = getattr(ops, "pool", None)  # a WorkerPool, or None (one thread: every plan is serial)
    n_workers = pool.n_workers if pool is not None else 1
    op[O_NTOK] = T
    op[O_WIDE] = int(T == 1 or op[O_D] % 16 != 0)
    if not online:
        keep = _exact_prepare(op, sp, q32, kc, vc, o32, s, n_workers, item_address(), QUERY_ROWS, SCORE_BUDGET,
                              MIN_SPLIT_KEYS, SERIAL_WORK)
        if keep[4].shape[0]:
            pool.run_arrays(keep[4], keep[5], op)
    else:
        pl = _build(spans, int(op[O_NKV]), int(op[O_GROUP]), int(op[O_DV]), n_workers, int(op[O_WINDOW]),
                    int(op[O_RMAX]))
        _fill_addresses(op, q32, kc, vc, o32, pl.tasks, pl.pml, pl.pacc, s, _NO_PACC, _NO_META)
        if pl.serial:
            _run_serial(op, pl.tasks.reshape(-1), pl.n_tasks, pl.pml, pl.pacc, False)
        else:
            pool.run_arrays(pl.items, pl.bounds, op)
    if o32 is not out:
        out[...] = o32
