"""Planning: how one attend call's work is cut into tasks and pool items. The default mode
plans in one compiled call (:func:`_exact_prepare`: :func:`_plan_exact`, the scratch buffers,
the op array's addresses, the items and phases, or the whole step on the calling thread when
it is small); the online mode in Python (:func:`plan_tasks`, :func:`_build`).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from moe_service.engine import pool as _pool
from moe_service.engine.attention.layout import (
    _JIT,
    META_W,
    O_DV,
    O_GROUP,
    O_KC,
    O_META,
    O_NKV,
    O_OUT,
    O_PACC,
    O_PML,
    O_Q,
    O_SC,
    O_SINKS,
    O_TASKS,
    O_VC,
    O_WINDOW,
    TASK_W,
)
from moe_service.engine.attention.tasks import item_address, run_task_exact

QUERY_ROWS = 64
"""Query rows (query tokens x heads of one KV head) per prefill task: the tile that shares
each K and V tile read (64 rows x 128 dims of float32 accumulators = 32 KiB)."""
MIN_SPLIT_KEYS = 256
"""Fewest keys per part when a decode task's key range is split over workers."""
SERIAL_WORK = 8192
"""Below this many (query row x key) products the step runs on the calling thread."""


SCORE_BUDGET = 1 << 18
"""Most float32 scores one exact task holds (1 MiB): long prefills get shorter query tiles."""


def plan_tasks(spans, group: int, n_workers: int, window: int = 0, *, n_kv: int = 1):
    """The online mode's tiles, largest first: (cost, seq, t0, t1, p0, k_lo, k_hi, split).

    A span's queries are cut into tiles of QUERY_ROWS // group tokens; when the step has
    fewer than 2 x workers tiles over the ``n_kv`` KV heads, ``split`` > 1 says how many key
    ranges (at least MIN_SPLIT_KEYS keys each) to cut each tile into. (The default mode plans
    in compiled code: :func:`_plan_exact`.)"""
    base = []
    for seq, a, e, n0 in spans:
        tq = max(1, QUERY_ROWS // group)
        for t0 in range(a, e, tq):
            t1 = min(e, t0 + tq)
            p0 = n0 + t0 - a
            k_hi = p0 + (t1 - t0)
            k_lo = max(0, p0 - window + 1) if window > 0 else 0
            base.append((seq, t0, t1, p0, k_lo, k_hi))
    tasks = []
    for seq, t0, t1, p0, k_lo, k_hi in base:
        cost = (t1 - t0) * (k_hi - k_lo)
        split = 1
        if n_workers > 1 and len(base) * n_kv < 2 * n_workers:
            split = max(1, min((k_hi - k_lo) // MIN_SPLIT_KEYS, -(-2 * n_workers // (len(base) * n_kv))))
        tasks.append((cost, seq, t0, t1, p0, k_lo, k_hi, split))
    tasks.sort(key=lambda x: -x[0])
    return tasks


class _Plan:
    __slots__ = ("items", "bounds", "tasks", "pml", "pacc", "n_tasks", "serial")
    items: np.ndarray | None  # None when serial
    bounds: np.ndarray | None
    tasks: np.ndarray
    pml: np.ndarray
    pacc: np.ndarray
    n_tasks: int
    serial: bool


def _build(spans, nkv: int, group: int, dv: int, n_workers: int, window: int, rmax: int) -> _Plan:
    """The online mode's tasks, partial slots and job (whole tiles, then key parts and merges)."""
    base = plan_tasks(spans, group, n_workers, window, n_kv=nkv)
    rows: list[tuple] = []
    merges: list[tuple[int, int]] = []
    split_rows: list[tuple] = []
    n_parts = 0
    work = 0
    for cost, seq, t0, t1, p0, k_lo, k_hi, split in base:
        work += cost * group * nkv
        for g in range(nkv):
            if split <= 1:
                rows.append((seq, t0, t1, p0, g, k_lo, k_hi, -1))
            else:
                first = len(split_rows)
                n = k_hi - k_lo
                for c in range(split):
                    a = k_lo + n * c // split
                    b = k_lo + n * (c + 1) // split
                    split_rows.append((seq, t0, t1, p0, g, a, b, n_parts))
                    n_parts += 1
                merges.append((first, split))
    pl = _Plan()
    n_direct = len(rows)
    all_rows = rows + split_rows
    pl.tasks = np.ascontiguousarray(np.array(all_rows, dtype=np.int64).reshape(-1, TASK_W))
    pl.n_tasks = len(all_rows)
    pl.serial = not split_rows and (n_workers <= 1 or work < SERIAL_WORK)
    pl.pml = np.zeros(max(1, n_parts * rmax * 2), np.float64)
    pl.pacc = np.zeros(max(1, n_parts * rmax * dv), np.float32)
    if pl.serial:
        pl.items = pl.bounds = None
        return pl
    fn = item_address()
    it0 = [(_pool.K_CALL, fn, 0, i) for i in range(pl.n_tasks)]
    # split parts first (they gate the merge phase), then whole tasks largest first
    phase0 = it0[n_direct:] + it0[:n_direct]
    phase1 = [(_pool.K_CALL, fn, 1, n_direct + first, n) for first, n in merges]
    job = _pool.Job.build([[phase0], [phase1]] if phase1 else [[phase0]], np.zeros(1, np.int64))
    pl.items, pl.bounds = job.items, job.bounds
    return pl


@njit(**_JIT)
def _plan_exact(spans, group, nkv, n_workers, window, qrows, budget, min_keys):
    """The default mode's plan in one compiled call (the per-layer Python cost of a decode
    step matters). Tiles of (sequence, KV head, query tokens); when the step has fewer tiles
    than 2 x workers, a tile with at least 2 x ``min_keys`` keys is split by key range into
    parts (phases: K parts, normalise, V parts, combine).

    Returns (tasks int64 [m, TASK_W]: the whole tiles (largest first), then the parts;
    meta int64 [groups, META_W]; n_direct; work (query row x key products); scores floats;
    partial-accumulator rows x 1 (times Dv by the caller))."""
    n_sp = spans.shape[0]
    tqs = np.empty(n_sp, np.int64)
    ntile = 0
    for i in range(n_sp):
        a, e, n0 = spans[i, 1], spans[i, 2], spans[i, 3]
        k_lo0 = max(0, n0 - window + 1) if window > 0 else 0
        tq = max(1, qrows // group)
        tq = max(1, min(tq, budget // (group * max(1, n0 + e - a - k_lo0))))
        tqs[i] = tq
        ntile += (e - a + tq - 1) // tq
    want = 0
    if n_workers > 1 and ntile * nkv < 2 * n_workers:
        want = (2 * n_workers + ntile * nkv - 1) // (ntile * nkv)
    cap = ntile * nkv * max(1, want)
    tasks = np.empty((cap, TASK_W), np.int64)
    parts = np.empty((cap, TASK_W), np.int64)
    meta = np.empty((ntile * nkv, META_W), np.int64)
    cost = np.empty(cap, np.int64)
    n_direct = 0
    n_parts = 0
    n_groups = 0
    sc_size = 0
    acc_rows = 0
    work = 0
    for i in range(n_sp):
        seq, a, e, n0 = spans[i, 0], spans[i, 1], spans[i, 2], spans[i, 3]
        tq = tqs[i]
        for t0 in range(a, e, tq):
            t1 = min(e, t0 + tq)
            p0 = n0 + t0 - a
            k_hi = p0 + (t1 - t0)
            k_lo = max(0, p0 - window + 1) if window > 0 else 0
            L = k_hi - k_lo
            c = (t1 - t0) * L
            work += c * group * nkv
            split = min(want, L // min_keys) if want > 1 else 1
            for g in range(nkv):
                if split < 2:
                    tasks[n_direct, 0] = seq
                    tasks[n_direct, 1] = t0
                    tasks[n_direct, 2] = t1
                    tasks[n_direct, 3] = p0
                    tasks[n_direct, 4] = g
                    tasks[n_direct, 5] = 0
                    tasks[n_direct, 6] = group
                    tasks[n_direct, 7] = 0
                    cost[n_direct] = c * group
                    n_direct += 1
                    continue
                R = (t1 - t0) * group
                mi = n_groups
                meta[mi, 0] = sc_size
                meta[mi, 1] = L
                meta[mi, 2] = k_lo
                meta[mi, 3] = 0
                meta[mi, 4] = group
                meta[mi, 5] = n_parts  # relative to the parts block; fixed up by the caller
                meta[mi, 6] = split
                meta[mi, 7] = acc_rows
                sc_size += R * L
                acc_rows += split * R
                for cc in range(split):
                    parts[n_parts, 0] = seq
                    parts[n_parts, 1] = t0
                    parts[n_parts, 2] = t1
                    parts[n_parts, 3] = p0
                    parts[n_parts, 4] = g
                    parts[n_parts, 5] = k_lo + L * cc // split
                    parts[n_parts, 6] = k_lo + L * (cc + 1) // split
                    parts[n_parts, 7] = mi
                    n_parts += 1
                n_groups += 1
    order = np.argsort(-cost[:n_direct], kind="mergesort")
    out = np.empty((n_direct + n_parts, TASK_W), np.int64)
    for k in range(n_direct):
        out[k] = tasks[order[k]]
    for k in range(n_parts):
        out[n_direct + k] = parts[k]
    for mi in range(n_groups):
        meta[mi, 5] += n_direct
    return out, meta[:n_groups].copy(), n_direct, work, sc_size, acc_rows


@njit(**_JIT)
def _fill_addresses(op, q, kc, vc, out, tasks, pml, pacc, sinks, sc, meta):
    op[O_SC] = sc.ctypes.data
    op[O_META] = meta.ctypes.data
    op[O_Q] = q.ctypes.data
    op[O_KC] = kc.ctypes.data
    op[O_VC] = vc.ctypes.data
    op[O_OUT] = out.ctypes.data
    op[O_TASKS] = tasks.ctypes.data
    op[O_PML] = pml.ctypes.data
    op[O_PACC] = pacc.ctypes.data
    op[O_SINKS] = sinks.ctypes.data


@njit(**_JIT)
def _exact_prepare(op, sp, q, kc, vc, out, sinks, n_workers, fn, qrows, budget, min_keys, serial_work):
    """The default mode's whole setup in one compiled call (a decode step calls attend once per
    layer; separate Python and numba calls cost more than a short decode's attention): plan
    (_plan_exact), scratch buffers, addresses into ``op``; a small step (or one worker) runs
    right here on the calling thread. Returns (tasks, meta, scores, partial accumulators,
    items, bounds) for pool.run_arrays, items empty when the step already ran. The returned
    buffers must stay alive while the pool runs (op holds their addresses)."""
    group, nkv, window, dv, nt = op[O_GROUP], op[O_NKV], op[O_WINDOW], op[O_DV], 1 if n_workers <= 1 else n_workers
    tasks, meta, n_direct, work, sc_size, acc_rows = _plan_exact(sp, group, nkv, nt, window, qrows, budget, min_keys)
    n_tasks = tasks.shape[0]
    serial = n_workers <= 1 or (work < serial_work and n_direct == n_tasks)
    if serial and n_direct != n_tasks:  # (planned with splits: plan again without)
        tasks, meta, n_direct, work, sc_size, acc_rows = _plan_exact(sp, group, nkv, 1, window, qrows, budget, min_keys)
        n_tasks = tasks.shape[0]
    pacc = np.empty(max(1, acc_rows * dv), np.float32)
    sc = np.empty(max(1, sc_size), np.float32)
    meta1 = meta if meta.shape[0] else np.zeros((1, META_W), np.int64)
    _fill_addresses(op, q, kc, vc, out, tasks, pacc, pacc, sinks, sc, meta1)
    flat = tasks.reshape(-1)
    if serial:
        for ti in range(n_tasks):
            run_task_exact(op, flat, ti)
        return tasks, meta1, sc, pacc, np.zeros((0, _pool.ITEM_W), np.int64), np.zeros((0, 1, 2), np.int64)
    n_groups = meta.shape[0]
    n_parts = n_tasks - n_direct
    n_items = n_tasks + n_groups + n_parts + n_groups if n_groups else n_tasks
    items = np.zeros((n_items, _pool.ITEM_W), np.int64)
    for i in range(n_items):
        items[i, 0] = _pool.K_CALL
        items[i, 1] = fn
    if not n_groups:
        for i in range(n_tasks):
            items[i, 2] = 2
            items[i, 3] = i
        bounds = np.zeros((1, 1, 2), np.int64)
        bounds[0, 0, 1] = n_tasks
        return tasks, meta1, sc, pacc, items, bounds
    # phase 0: K parts, then whole tiles; 1: normalise; 2: V parts; 3: combine
    k = 0
    for i in range(n_direct, n_tasks):
        items[k, 2], items[k, 3] = 3, i
        k += 1
    for i in range(n_direct):
        items[k, 2], items[k, 3] = 2, i
        k += 1
    for i in range(n_groups):
        items[k, 2], items[k, 3] = 4, i
        k += 1
    for i in range(n_direct, n_tasks):
        items[k, 2], items[k, 3] = 5, i
        k += 1
    for i in range(n_groups):
        items[k, 2], items[k, 3] = 6, i
        k += 1
    bounds = np.zeros((4, 1, 2), np.int64)
    e0, e1, e2 = n_tasks, n_tasks + n_groups, n_tasks + n_groups + n_parts
    bounds[0, 0, 1] = e0
    bounds[1, 0, 0], bounds[1, 0, 1] = e0, e1
    bounds[2, 0, 0], bounds[2, 0, 1] = e1, e2
    bounds[3, 0, 0], bounds[3, 0, 1] = e2, n_items
    return tasks, meta1, sc, pacc, items, bounds
