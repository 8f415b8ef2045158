"""A persistent pool of pinned worker threads that run numba kernels without the GIL.

::

    caller (engine thread)                      workers (one per CPU, pinned once, by node)
    ─────────────────────                       ───────────────────────────────────────────
    build Job: items [n, 8] sorted by            spin in numba (no GIL) on ctrl[SEQ] ...
      (phase, home node), op [*] buffers   ─┐
    publish: region r = seq & 1, SEQ += 1   ├──> claim items: own node's queue first, then
    take part as worker 0, then wait        │     steal from other nodes (atomic heads);
      for the last phase's done count      ─┘     barrier per phase (done counts)
    return (raise WorkerError on failure)        spin `spin_s`, then sleep on a Condition

The whole job (dispatch, claiming, barriers, kernels) runs in numba with the GIL released;
Python touches only the job arrays. An empty dispatch is one numba call that publishes,
takes part and waits (a second call only when a worker must be woken from sleep).

Memory protocol (x86-TSO plus sequentially consistent atomics, see quant.atomic_*): the
caller writes a job (header, queue bounds, zeroed counters) into region ``seq & 1`` of the
control array only after every worker that entered that region's previous job has left it
(``ACTIVE[r] == 0``), then publishes it with one atomic store of SEQ. A worker announces itself in ``ACTIVE[r]`` and re-checks
SEQ before touching the job, so a late worker never runs a stale job. Items are claimed with
an atomic fetch-add on the per (phase, node) head; a phase ends when its done count equals
its item count; the caller returns only after the last phase is done (and, after an error,
only after every worker has left the job). A worker that enters a finished job late reads
only the control array (the bounds are copied there), finds every queue claimed and leaves:
job buffers are never touched after the caller returns.

Pinning: every worker thread pins itself once, at start, to exactly one CPU with
``os.sched_setaffinity(0, {cpu})`` (pid 0 = the calling thread). The caller thread, which
takes part as worker 0, is pinned once on its first dispatch (``pin_caller``); when another
thread takes over as worker 0, the previous one gets its CPU mask back (``release_caller``
does it explicitly). Nothing is re-pinned per op.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from llvmlite import ir
from numba import cfunc, njit, types
from numba.extending import intrinsic

from moe_service.engine import moe as _moe
from moe_service.engine import quant as _q
from moe_service.engine.quant import (
    atomic_add,
    atomic_load,
    atomic_store,
    cpu_relax,
    cycle_counter,
    ld,
    st,
    view_f32,
    view_i8,
    view_i16,
    view_i64,
    view_u8,
)
from moe_service.log import get_logger
from moe_service.numa import node_cpus

log = get_logger(__name__)

__all__ = ["WorkerPool", "Job", "WorkerError", "TensorRef", "default_nodes", "ITEM_W",
           "K_NOP", "K_QUANT", "K_MATMUL", "K_RECORD", "K_CALL", "CALL_ITEM_SIG"]

# ---------------------------------------------------------------------------------------
# Control array layout (int64). Every field that more than one thread writes sits on its
# own 128-byte line (adjacent-line prefetch pairs 64-byte lines).
# ---------------------------------------------------------------------------------------

LINE = 16  # int64 per 128 bytes
MAX_PHASES = 8
MAX_NODES = 16

F_SEQ = 0 * LINE  # job sequence number (only the caller writes it)
F_STOP = 1 * LINE
F_ERR = 2 * LINE  # 0, or 1 + index of the failing item, or -1 for a worker-thread error
F_SLEEPERS = 3 * LINE
F_ACTIVE = 4 * LINE  # + r * LINE: workers inside region r's job
F_ERR_KIND = 6 * LINE  # kind of the failing item
F_RUN_JOB = 7 * LINE  # address of the compiled _run_job
REGION0 = 8 * LINE
# Per region: header line, done[phase] lines, head[phase][node] lines, then a copy of the
# job's bounds (a worker that enters a finished job late reads only the control array: it
# finds every queue claimed and never touches the caller's, possibly freed, job arrays).
R_HDR = 0  # + 0 n_phases, 1 n_nodes, 2 items addr, 3 (unused), 4 op addr
R_DONE = LINE
R_HEAD = R_DONE + MAX_PHASES * LINE
R_BOUNDS = R_HEAD + MAX_PHASES * MAX_NODES * LINE  # [phase][node][start, end]
REGION_LEN = R_BOUNDS + MAX_PHASES * MAX_NODES * 2
CTRL_LEN = REGION0 + 2 * REGION_LEN

ST_IDLE = 1
ST_STOP = 2
ST_ERROR = 3

# ---------------------------------------------------------------------------------------
# Items: int64 [8] = kind, then kind-specific fields. Kinds 10..19 belong to moe.py.
# ---------------------------------------------------------------------------------------

ITEM_W = 8
K_NOP = 0
K_QUANT = 1  # (K_QUANT, partner, row_lo, row_hi): encode activation rows for a matmul op
K_MATMUL = 2  # (K_MATMUL, tensor index, row_lo, row_hi)
K_RECORD = 3  # (K_RECORD, log addr, wait_for, spin_cycles_max): tests of claiming/stealing
K_CALL = 4  # (K_CALL, fn address, fields...): fn(items, i, op) compiled elsewhere (CALL_ITEM_SIG)

# Matmul op array layout (int64).
OP_ARENA = 0
OP_X = 1  # float32 [T, C] activations
OP_NTOK = 2
OP_NCOLS = 3
OP_ROWS = 4  # int64 [T] = arange(T): activation row = output row
OP_NTENS = 5
OP_OUT = 6  # float32 [T, OUT_STRIDE]: every tensor's outputs side by side
OP_OUT_STRIDE = 7
OP_ACT = 8  # + 5 * partner: xf, xq, xd, xs, xbs addresses
OP_KERNELS = OP_ACT + 5 * 6  # address of quant's kernel table
OP_TENS = OP_KERNELS + 2  # + 8 * tensor: w_off, type, n_cols, row_bytes, out column, partner, n_rows, 0
TENS_W = 8

class WorkerError(RuntimeError):
    """A worker thread or a work item failed; the message names the worker/CPU or item."""


# ---------------------------------------------------------------------------------------
# Numba: item execution, the job loop, the worker loop, the caller's dispatch
# ---------------------------------------------------------------------------------------


@njit(nogil=True, cache=True)
def _matmul_quant_item(op, partner, row_lo, row_hi):
    n = ld(op, OP_NCOLS)
    n_tok = ld(op, OP_NTOK)
    a = OP_ACT + 5 * partner
    x = view_f32(ld(op, OP_X), n_tok * n)
    big = n_tok * n
    _q.quantize_partner_rows_range(partner, x, row_lo, row_hi, n,
                                   view_f32(ld(op, a), big), view_i8(ld(op, a + 1), big),
                                   view_f32(ld(op, a + 2), big), view_f32(ld(op, a + 3), big),
                                   view_i16(ld(op, a + 4), big))


@njit(nogil=True, cache=True)
def _matmul_item(op, t, row_lo, row_hi):
    n_tok = ld(op, OP_NTOK)
    b = OP_TENS + TENS_W * t
    n_cols = ld(op, b + 2)
    partner = ld(op, b + 5)
    a = OP_ACT + 5 * partner
    big = n_tok * n_cols
    rows = view_i64(ld(op, OP_ROWS), n_tok)
    stride = ld(op, OP_OUT_STRIDE)
    _q.matmul_rows(view_u8(ld(op, OP_ARENA), 1), ld(op, b), ld(op, b + 1), n_cols, ld(op, b + 3), row_lo, row_hi,
                   view_f32(ld(op, a), big), view_i8(ld(op, a + 1), big), view_f32(ld(op, a + 2), big),
                   view_f32(ld(op, a + 3), big), view_i16(ld(op, a + 4), big), rows, rows,
                   view_f32(ld(op, OP_OUT), n_tok * stride), stride, ld(op, b + 4), view_i64(ld(op, OP_KERNELS), 64))


@njit(nogil=True, cache=True)
def _record_item(items, i, slot):
    """Test item (K_RECORD, log addr, n, wait_for, spin limit, first item index): log[i - first]
    = slot + 1, then wait (bounded by the spin limit, in cycles) until ``wait_for`` record
    items have started, so one worker cannot run them all: it proves several took part.
    log: int64 [n + 1], the last entry counts started items."""
    n = ld(items, i * ITEM_W + 2)
    logv = view_i64(ld(items, i * ITEM_W + 1), n + 1)
    wait_for = ld(items, i * ITEM_W + 3)
    limit = ld(items, i * ITEM_W + 4)
    atomic_store(logv, i - ld(items, i * ITEM_W + 5), slot + 1)
    started = atomic_add(logv, n, 1) + 1
    t0 = cycle_counter()
    while started < wait_for and cycle_counter() - t0 < limit:
        cpu_relax()
        started = atomic_load(logv, n)


CALL_ITEM_SIG = types.void(types.CPointer(types.int64), types.int64, types.CPointer(types.int64))
"""Signature of a K_CALL item's function: (items data, item index, op data). Kernels that live
outside this file (attention/tasks.py, mla.py) are compiled as numba cfuncs of this signature
and called through their address, so the pool's cached code never inlines them and editing them
never stales it."""

_CALL_ITEM_CFUNCS: dict = {}  # python function -> its cfunc (keeps the code alive)
_CALL_ITEM_LOCK = threading.Lock()


def call_item_address(fn) -> int:
    """Address of ``fn`` compiled (or loaded from numba's cache) once as a cfunc of
    CALL_ITEM_SIG: the function a K_CALL item names (attention/tasks.py, mla.py)."""
    with _CALL_ITEM_LOCK:
        cf = _CALL_ITEM_CFUNCS.get(fn)
        if cf is None:
            cf = _CALL_ITEM_CFUNCS[fn] = cfunc(CALL_ITEM_SIG, nopython=True, cache=True)(fn)
        return cf.address


@intrinsic
def _call_item_fn(typingctx, addr, items, i, op):
    """Call the C function at ``addr`` with (items data pointer, i, op data pointer)."""
    sig = types.void(types.int64, items, types.int64, op)

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        fnty = ir.FunctionType(ir.VoidType(), [i64.as_pointer(), i64, i64.as_pointer()])
        fptr = builder.inttoptr(args[0], fnty.as_pointer())
        items_data = context.make_array(signature.args[1])(context, builder, args[1]).data
        op_data = context.make_array(signature.args[3])(context, builder, args[3]).data
        builder.call(fptr, [items_data, args[2], op_data])
        return context.get_dummy_value()

    return sig, codegen


@njit(nogil=True, cache=True)
def _run_item(items, i, op, slot):
    """Execute item i; returns 0, or a nonzero code for an unknown kind."""
    kind = ld(items, i * ITEM_W)
    f1 = ld(items, i * ITEM_W + 1)
    f2 = ld(items, i * ITEM_W + 2)
    f3 = ld(items, i * ITEM_W + 3)
    if kind == K_MATMUL:
        _matmul_item(op, f1, f2, f3)
    elif kind == K_QUANT:
        _matmul_quant_item(op, f1, f2, f3)
    elif kind >= _moe.K_MOE_FIRST and kind <= _moe.K_MOE_LAST:
        _moe.run_moe_item(items, i, op)
    elif kind == K_RECORD:
        _record_item(items, i, slot)
    elif kind == K_CALL:
        _call_item_fn(f1, items, i, op)
    elif kind != K_NOP:
        return 1
    return 0


def _run_job(ctrl, r, slot, node):
    """Claim and run items of region r's job: own node first, then steal; phase barriers.

    Compiled once as a C-ABI function (see _run_job_address) and called through its address
    by the worker loop and the caller, so the kernels behind it are not re-optimized inside
    each of those (numba re-optimizes a callee's code in every jitted caller)."""
    base = REGION0 + r * REGION_LEN
    n_phases = ld(ctrl, base + R_HDR)
    n_nodes = ld(ctrl, base + R_HDR + 1)
    items = view_i64(ld(ctrl, base + R_HDR + 2), 1)
    op = view_i64(ld(ctrl, base + R_HDR + 4), 1)
    bnd = base + R_BOUNDS
    home = node % n_nodes
    for p in range(n_phases):
        total = ld(ctrl, bnd + (p * n_nodes + n_nodes - 1) * 2 + 1) - ld(ctrl, bnd + p * n_nodes * 2)
        for k in range(n_nodes):
            nd = (home + k) % n_nodes
            start = ld(ctrl, bnd + (p * n_nodes + nd) * 2)
            end = ld(ctrl, bnd + (p * n_nodes + nd) * 2 + 1)
            head = base + R_HEAD + (p * MAX_NODES + nd) * LINE
            while atomic_load(ctrl, F_ERR) == 0:
                i = start + atomic_add(ctrl, head, 1)
                if i >= end:
                    break
                if _run_item(items, i, op, slot) != 0:
                    atomic_store(ctrl, F_ERR_KIND, ld(items, i * ITEM_W))
                    atomic_store(ctrl, F_ERR, i + 1)
                    return
                atomic_add(ctrl, base + R_DONE + p * LINE, 1)
        while atomic_load(ctrl, base + R_DONE + p * LINE) < total:
            if atomic_load(ctrl, F_ERR) != 0:
                return
            cpu_relax()


_RUN_JOB_SIG = types.void(types.CPointer(types.int64), types.int64, types.int64, types.int64)
_RUN_JOB_CFUNC = None
_RUN_JOB_LOCK = threading.Lock()


def _run_job_address() -> int:
    """Address of the compiled _run_job (compiled, or loaded from numba's cache, once)."""
    global _RUN_JOB_CFUNC
    with _RUN_JOB_LOCK:
        if _RUN_JOB_CFUNC is None:
            _RUN_JOB_CFUNC = cfunc(_RUN_JOB_SIG, nopython=True, cache=True)(_run_job)
        return _RUN_JOB_CFUNC.address


@intrinsic
def _call_run_job(typingctx, addr, ctrl, r, slot, node):
    """Call the compiled _run_job at ``addr`` (read from ctrl[F_RUN_JOB] at run time)."""
    sig = types.void(types.int64, ctrl, types.int64, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        fnty = ir.FunctionType(ir.VoidType(), [i64.as_pointer(), i64, i64, i64])
        fptr = builder.inttoptr(args[0], fnty.as_pointer())
        data = context.make_array(signature.args[1])(context, builder, args[1]).data
        builder.call(fptr, [data, args[2], args[3], args[4]])
        return context.get_dummy_value()

    return sig, codegen


@njit(nogil=True, cache=True)
def _job(ctrl, r, slot, node):
    _call_run_job(ld(ctrl, F_RUN_JOB), ctrl, r, slot, node)


@njit(nogil=True, cache=True)
def _worker_loop(ctrl, slot, node, spin_cycles, last_seq):
    """A worker's life between sleeps: run every new job; return (status, last seen seq)
    after ``spin_cycles`` without work (ST_IDLE), on stop (ST_STOP) or error (ST_ERROR)."""
    t0 = cycle_counter()
    while True:
        s = atomic_load(ctrl, F_SEQ)
        if s != last_seq:
            r = s & 1
            atomic_add(ctrl, F_ACTIVE + r * LINE, 1)
            if atomic_load(ctrl, F_SEQ) == s:
                _job(ctrl, r, slot, node)
            atomic_add(ctrl, F_ACTIVE + r * LINE, -1)
            last_seq = s
            t0 = cycle_counter()
            continue
        if atomic_load(ctrl, F_STOP) != 0:
            return ST_STOP, last_seq
        if cycle_counter() - t0 > spin_cycles:
            return ST_IDLE, last_seq
        cpu_relax()


@njit(nogil=True, cache=True)
def _publish(ctrl, items_addr, bounds, op_addr, n_phases, n_nodes):
    """Write the next job into its region and publish it; returns (seq, sleeping workers)."""
    s = ld(ctrl, F_SEQ) + 1
    r = s & 1
    while atomic_load(ctrl, F_ACTIVE + r * LINE) != 0:  # stragglers of job s - 2
        cpu_relax()
    base = REGION0 + r * REGION_LEN
    for p in range(n_phases):
        st(ctrl, base + R_DONE + p * LINE, 0)
        for nd in range(n_nodes):
            st(ctrl, base + R_HEAD + (p * MAX_NODES + nd) * LINE, 0)
    for p in range(n_phases):
        for nd in range(n_nodes):
            st(ctrl, base + R_BOUNDS + (p * n_nodes + nd) * 2, bounds[p, nd, 0])
            st(ctrl, base + R_BOUNDS + (p * n_nodes + nd) * 2 + 1, bounds[p, nd, 1])
    st(ctrl, base + R_HDR, n_phases)
    st(ctrl, base + R_HDR + 1, n_nodes)
    st(ctrl, base + R_HDR + 2, items_addr)
    st(ctrl, base + R_HDR + 4, op_addr)
    atomic_store(ctrl, F_SEQ, s)
    return s, atomic_load(ctrl, F_SLEEPERS)


@njit(nogil=True, cache=True)
def _take_part_and_wait(ctrl, s, slot, node, participate):
    """Run job s as worker ``slot`` (when participate), then wait until it is complete.
    Returns 0, or the F_ERR code (after every worker has left the job)."""
    r = s & 1
    base = REGION0 + r * REGION_LEN
    if participate:
        atomic_add(ctrl, F_ACTIVE + r * LINE, 1)
        _job(ctrl, r, slot, node)
        atomic_add(ctrl, F_ACTIVE + r * LINE, -1)
    n_phases = ld(ctrl, base + R_HDR)
    n_nodes = ld(ctrl, base + R_HDR + 1)
    bounds = ctrl[base + R_BOUNDS: base + R_BOUNDS + n_phases * n_nodes * 2]
    last = n_phases - 1
    total = ld(bounds, (last * n_nodes + n_nodes - 1) * 2 + 1) - ld(bounds, last * n_nodes * 2)
    while atomic_load(ctrl, base + R_DONE + last * LINE) < total:
        if atomic_load(ctrl, F_ERR) != 0:
            break
        cpu_relax()
    err = atomic_load(ctrl, F_ERR)
    if err != 0:
        while atomic_load(ctrl, F_ACTIVE + r * LINE) != 0:  # nobody may touch the buffers after we return
            cpu_relax()
    return err


@njit(nogil=True, cache=True)
def _dispatch(ctrl, items, bounds, op, x, x_field, out, out_field, slot, node, participate):
    """The caller's whole dispatch in one call: store x's and out's addresses into op (at
    x_field / out_field, when >= 0), publish, take part, wait. Returns (seq, code): code is
    0 (done), the F_ERR code, or -2 when sleeping workers must be woken first (then call
    _take_part_and_wait)."""
    if x_field >= 0:
        st(op, x_field, x.ctypes.data)
    if out_field >= 0:
        st(op, out_field, out.ctypes.data)
    s, sleepers = _publish(ctrl, items.ctypes.data, bounds, op.ctypes.data, bounds.shape[0], bounds.shape[1])
    if sleepers > 0:
        return s, -2
    return s, _take_part_and_wait(ctrl, s, slot, node, participate)


@njit(nogil=True, cache=True)
def _atomic_add_py(ctrl, idx, v):
    return atomic_add(ctrl, idx, v)


@njit(nogil=True, cache=True)
def _atomic_load_py(ctrl, idx):
    return atomic_load(ctrl, idx)


@njit(nogil=True, cache=True)
def _atomic_store_py(ctrl, idx, v):
    atomic_store(ctrl, idx, v)


@njit(nogil=True, cache=True)
def _cycles():
    return cycle_counter()


# ---------------------------------------------------------------------------------------
# Python side
# ---------------------------------------------------------------------------------------


_PROCESS_CPUS = frozenset(os.sched_getaffinity(0))
"""The CPUs this process may use, read at import: a thread a pool has pinned to one CPU must
not shrink the next pool's default."""


def default_nodes() -> dict[int, list[int]]:
    """node -> sorted CPUs this process may run on, from sysfs (moe_service.numa.node_cpus;
    one node 0 holding every allowed CPU when sysfs is absent or does not cover them)."""
    allowed = set(_PROCESS_CPUS)
    nodes: dict[int, list[int]] = {}
    for node, cpus in node_cpus().items():
        mine = sorted(c for c in cpus if c in allowed)
        if mine:
            nodes[node] = mine
    covered = {c for cs in nodes.values() for c in cs}
    if not nodes or covered != allowed:
        return {0: sorted(allowed)}
    return nodes


@dataclass
class Job:
    """A unit of dispatch: items int64 [n, ITEM_W] sorted by (phase, home node) with
    bounds int64 [n_phases, n_nodes, 2] (start, end) into items, and the op array the items'
    kernels read their buffers from (addresses). ``keep`` holds every array whose address
    is in ``op`` or in an item, so none is freed while the job runs."""

    items: np.ndarray
    bounds: np.ndarray
    op: np.ndarray
    keep: list

    @staticmethod
    def build(phases: Sequence[Sequence[Sequence[Sequence[int]]]], op: np.ndarray, keep: list | None = None) -> Job:
        """phases[p][node] = list of items (each a sequence of up to ITEM_W ints)."""
        n_phases = len(phases)
        n_nodes = max(len(p) for p in phases)
        if not 1 <= n_phases <= MAX_PHASES or n_nodes > MAX_NODES:
            raise ValueError(f"a job has 1..{MAX_PHASES} phases and <= {MAX_NODES} nodes "
                             f"(got {n_phases} phases, {n_nodes} nodes)")
        rows: list[list[int]] = []
        bounds = np.zeros((n_phases, n_nodes, 2), np.int64)
        for p, per_node in enumerate(phases):
            for nd in range(n_nodes):
                bounds[p, nd, 0] = len(rows)
                for it in per_node[nd] if nd < len(per_node) else ():
                    rows.append(list(it) + [0] * (ITEM_W - len(it)))
                bounds[p, nd, 1] = len(rows)
        items = np.array(rows, dtype=np.int64).reshape(-1, ITEM_W) if rows else np.zeros((1, ITEM_W), np.int64)
        return Job(np.ascontiguousarray(items), bounds, np.ascontiguousarray(op, dtype=np.int64), list(keep or []))


@dataclass(frozen=True)
class TensorRef:
    """A weight tensor in the arena: n_rows rows of n_cols ``ggml_type`` at byte ``offset``."""

    offset: int
    ggml_type: int
    n_rows: int
    n_cols: int


class WorkerPool:
    """Persistent worker threads, one per CPU, pinned once, grouped by NUMA node.

    nodes: node -> CPUs (default: sysfs, restricted to this process's affinity; one group on
    a one-node host); n_threads: total workers including the caller (default: all CPUs,
    taken evenly across nodes); caller_participates: the dispatching thread works as
    worker 0 on the first CPU (pinned there once, on its first dispatch, when pin_caller);
    spin_s: how long an idle worker spins (no syscalls) before sleeping on a Condition.

    Errors: WorkerError when a worker thread or an item fails (the pool then refuses
    further work if a thread died); ValueError for a bad configuration.
    """

    def __init__(self, nodes: dict[int, list[int]] | None = None, n_threads: int | None = None, *,
                 caller_participates: bool = True, pin_caller: bool = True, spin_s: float = 0.005,
                 name: str = "moe-worker"):
        nodes = {int(k): list(v) for k, v in (nodes or default_nodes()).items() if v}
        if not nodes:
            raise ValueError("the worker pool needs at least one CPU")
        node_ids = sorted(nodes)
        if len(node_ids) > MAX_NODES:
            raise ValueError(f"at most {MAX_NODES} NUMA nodes are supported (got {len(node_ids)})")
        total = sum(len(v) for v in nodes.values())
        n = total if n_threads is None else int(n_threads)
        if not 1 <= n <= total:
            raise ValueError(f"n_threads must be in 1..{total} (the CPUs given), got {n_threads}")
        # Take CPUs evenly across nodes: round-robin over nodes until n are chosen.
        picked: list[tuple[int, int]] = []
        queues = {nd: list(nodes[nd]) for nd in node_ids}
        while len(picked) < n:
            for nd in node_ids:
                if queues[nd] and len(picked) < n:
                    picked.append((queues[nd].pop(0), node_ids.index(nd)))
        picked.sort(key=lambda cn: (cn[1], cn[0]))
        self.node_ids = node_ids  # dense node index -> node id
        self.n_nodes = len(node_ids)
        self.slots = picked  # slot -> (cpu, dense node index)
        self.caller_participates = caller_participates
        self.pin_caller = pin_caller
        self.spin_s = spin_s
        self.ctrl = np.zeros(CTRL_LEN, np.int64)
        self.ctrl[F_RUN_JOB] = _run_job_address()
        self._cond = threading.Condition()
        self._lock = threading.Lock()
        self._errors: list[tuple[int, int, BaseException]] = []
        self._broken: BaseException | None = None
        self._pinned_callers: dict[int, set[int]] = {}  # native thread id -> affinity before pinning
        self._cycles_per_s = _calibrate_cycles()
        self._spin_cycles = int(spin_s * self._cycles_per_s)
        first_worker = 1 if caller_participates else 0
        self._threads: list[threading.Thread] = []
        self._started = threading.Barrier(len(picked) - first_worker + 1)
        for slot in range(first_worker, len(picked)):
            t = threading.Thread(target=self._thread_main, args=(slot,), name=f"{name}-{slot}", daemon=True)
            self._threads.append(t)
            t.start()
        self._started.wait()
        self._closed = False
        self._caller_node = self.slots[0][1]
        self._mm_plans: dict[tuple, _MatmulPlan] = {}
        self._mm_by_id: dict[tuple, tuple] = {}  # (id(tensors tuple), T) -> (that tuple, plan)
        log.info("worker_pool_started", workers=len(picked), nodes=self.n_nodes,
                 cpus=[c for c, _ in picked], caller_participates=caller_participates, spin_s=spin_s)

    # -- threads ---------------------------------------------------------------------------

    def _thread_main(self, slot: int) -> None:
        cpu, node = self.slots[slot]
        try:
            os.sched_setaffinity(0, {cpu})
        except OSError as exc:
            self._record_error(slot, cpu, exc)
            self._started.wait()
            return
        self._started.wait()
        last = 0
        ctrl = self.ctrl
        try:
            while True:
                status, last = _worker_loop(ctrl, slot, node, self._spin_cycles, last)
                if status == ST_STOP:
                    return
                with self._cond:  # idle: sleep until a new job (see the module docstring)
                    _atomic_add_py(ctrl, F_SLEEPERS, 1)
                    while _atomic_load_py(ctrl, F_SEQ) == last and _atomic_load_py(ctrl, F_STOP) == 0:
                        self._cond.wait()
                    _atomic_add_py(ctrl, F_SLEEPERS, -1)
        except BaseException as exc:  # noqa: BLE001 - reported to the caller, which raises
            self._record_error(slot, cpu, exc)

    def _record_error(self, slot: int, cpu: int, exc: BaseException) -> None:
        self._errors.append((slot, cpu, exc))
        self._broken = exc
        _atomic_store_py(self.ctrl, F_ERR, -1)
        log.error("worker_failed", slot=slot, cpu=cpu, error=repr(exc))

    # -- dispatch --------------------------------------------------------------------------

    @property
    def n_workers(self) -> int:
        return len(self.slots)

    @property
    def broken(self) -> str | None:
        """Why the pool can no longer run work (a worker thread died: slot, CPU, error), else
        None. The batch loop's health check reads it (/health, the watchdog)."""
        if self._broken is None:
            return None
        slot, cpu, exc = self._errors[0]
        return f"worker {slot} on CPU {cpu} failed: {exc!r}"

    def _check_usable(self) -> None:
        if self._closed:
            raise WorkerError("the worker pool is shut down")
        if self._broken is not None:
            slot, cpu, exc = self._errors[0]
            raise WorkerError(f"worker {slot} on CPU {cpu} failed: {exc!r}; the pool is unusable") from exc

    def run(self, job: Job) -> None:
        """Run a job to completion (the calling thread takes part when configured).

        Raises WorkerError naming the failing item (index, kind) or worker (slot, CPU).
        """
        self.run_arrays(job.items, job.bounds, job.op)

    def run_arrays(self, items: np.ndarray, bounds: np.ndarray, op: np.ndarray, x: np.ndarray | None = None,
                   x_field: int = -1, out: np.ndarray | None = None, out_field: int = -1) -> None:
        """Run items int64 [n, ITEM_W] with bounds int64 [phases, nodes, 2] and op int64 [*]; when
        given, x's and out's data addresses are first stored at op[x_field] / op[out_field]
        (so the caller needs no Python-side address lookups). The caller keeps every array the
        job references alive until this returns."""
        if self._closed or self._broken is not None:
            self._check_usable()
        xa = _EMPTY_F32 if x is None else x
        oa = _EMPTY_F32 if out is None else out
        with self._lock:
            if self.caller_participates and self.pin_caller:
                tid = threading.get_native_id()
                if tid not in self._pinned_callers:
                    self._pin_caller(tid)
            s, err = _dispatch(self.ctrl, items, bounds, op, xa, x_field, oa, out_field, 0, self._caller_node,
                               self.caller_participates)
            if err == -2:  # some workers sleep: wake them, then take part
                with self._cond:
                    self._cond.notify_all()
                err = _take_part_and_wait(self.ctrl, s, 0, self._caller_node, self.caller_participates)
            if err != 0:
                self._raise_error(int(err), items)

    def _pin_caller(self, tid: int) -> None:
        """Pin the calling thread (``tid``) to worker 0's CPU, remembering its mask; a thread
        that was worker 0 before (warmup ran on the main thread, the engine thread takes over)
        gets its mask back, so it no longer competes with worker 0 for one CPU. Under _lock."""
        cpu = self.slots[0][0]
        mask = os.sched_getaffinity(0)
        if mask == {cpu} and _PROCESS_CPUS != {cpu}:
            mask = set(_PROCESS_CPUS)  # inherited from a pinned creator thread, not its own choice
        for other in [t for t in self._pinned_callers if t != tid]:
            self._restore(other)
        self._pinned_callers[tid] = mask
        os.sched_setaffinity(0, {cpu})

    def _restore(self, tid: int) -> None:
        cpus = self._pinned_callers.pop(tid)
        try:
            os.sched_setaffinity(tid, cpus)
            log.debug("worker_pool_caller_released", thread=tid, cpus=len(cpus))
        except OSError:  # that thread has ended
            pass

    def release_caller(self) -> None:
        """Give the calling thread back the CPU mask it had before it first dispatched (it then
        no longer runs as worker 0 on that worker's CPU). Call it when a thread stops
        dispatching for good, e.g. the main thread after warmup: otherwise the event loop, the
        watchdog and tokenization stay pinned to worker 0's CPU (and every thread they start
        inherits that one-CPU mask). A later dispatch from it pins it again."""
        with self._lock:
            tid = threading.get_native_id()
            if tid in self._pinned_callers:
                self._restore(tid)

    def _raise_error(self, err: int, items: np.ndarray) -> None:
        kind = int(self.ctrl[F_ERR_KIND])
        _atomic_store_py(self.ctrl, F_ERR, 0)
        if self._broken is not None:
            self._check_usable()
        i = err - 1
        raise WorkerError(f"work item {i} of {len(items)} (kind {kind}, fields {items[i, 1:].tolist()}) "
                          f"failed: unknown item kind")

    def close(self) -> None:
        """Stop and join every worker thread (idempotent)."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        _atomic_store_py(self.ctrl, F_STOP, 1)
        with self._cond:
            self._cond.notify_all()
        for t in self._threads:
            t.join()
        for tid in list(self._pinned_callers):  # give the calling threads their CPUs back
            self._restore(tid)
        log.info("worker_pool_stopped", workers=len(self.slots))

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- dense matmul ------------------------------------------------------------------------

    def matmul(self, arena: np.ndarray, tensors: Sequence, x: np.ndarray, *, min_chunk_rows: int = 16,
               chunks_per_worker: int = 4) -> list[np.ndarray]:
        """y_i = x @ W_i.T for each tensor, all in ONE dispatch (e.g. q, k and v together).

        arena: uint8 [*]; tensors: TensorRef or any objects with offset, ggml_type, n_rows,
        n_cols (the engine's QMat), or (offset, ggml_type, n_rows, n_cols) tuples; x: float32
        [T, C] (every tensor has n_cols == C). Returns float32 [T, n_rows] per tensor: column
        views of one [T, sum(n_rows)] buffer (contiguous when T == 1). The activation rows
        are quantized once per partner format (first phase, split by rows), then row chunks
        of every tensor are spread over the workers (second phase). The plan (items, scratch)
        is cached per (tensors, T, arena).
        """
        x2 = x if (x.dtype == np.float32 and x.ndim == 2 and x.flags.c_contiguous) else \
            np.ascontiguousarray(np.atleast_2d(x), dtype=np.float32)
        n_tok = x2.shape[0]
        # Fast path: a caller that passes the same tuple object each time (the engine keeps one
        # per layer and projection group) skips building the structural key.
        hit = self._mm_by_id.get((id(tensors), n_tok)) if isinstance(tensors, tuple) else None
        if hit is not None and hit[0] is tensors and hit[1].arena is arena:
            plan = hit[1]
        else:
            plan = self._mm_lookup(arena, tensors, n_tok, x2, min_chunk_rows, chunks_per_worker)
            if isinstance(tensors, tuple):
                if len(self._mm_by_id) > 4096:
                    self._mm_by_id.clear()
                self._mm_by_id[(id(tensors), n_tok)] = (tensors, plan)
        if x2.shape[1] != plan.n_cols:
            raise ValueError(f"x has {x2.shape[1]} columns, the tensors {plan.n_cols}")
        out = np.empty((n_tok, plan.total_rows), np.float32)
        self.run_arrays(plan.items, plan.bounds, plan.op, x2, OP_X, out, OP_OUT)
        if len(plan.cols) == 1:
            return [out]
        return [out[:, a:b] for a, b in plan.cols]

    def _mm_lookup(self, arena, tensors, n_tok, x2, min_chunk_rows, chunks_per_worker) -> _MatmulPlan:
        """The cached plan for these tensors (by value), building it on a miss."""
        key = (id(arena), n_tok, tuple((t.offset, t.ggml_type, t.n_rows, t.n_cols) if not isinstance(t, tuple | list)
                                       else tuple(t) for t in tensors))
        plan = self._mm_plans.get(key)
        if plan is None or plan.arena is not arena:
            plan = self._mm_plan(arena, [_tensor_ref(t) for t in tensors], n_tok, x2.shape[1],
                                 min_chunk_rows, chunks_per_worker)
            if len(self._mm_plans) > 4096:
                self._mm_plans.clear()
            self._mm_plans[key] = plan
        return plan

    def _mm_plan(self, arena, refs, n_tok, n_cols, min_chunk_rows, chunks_per_worker) -> _MatmulPlan:
        partners = []
        for t in refs:
            if t.n_cols != n_cols:
                raise ValueError(f"tensor at byte {t.offset} has {t.n_cols} columns, the activations {n_cols}")
            _q.check_tensor(arena, t.offset, t.ggml_type, t.n_rows, t.n_cols)
            p = _q.block_format(t.ggml_type).partner
            if p not in partners:
                partners.append(p)
        keep: list = [arena]
        op = np.zeros(OP_TENS + TENS_W * len(refs), np.int64)
        op[OP_ARENA] = arena.ctypes.data
        op[OP_NTOK] = n_tok
        op[OP_NCOLS] = n_cols
        rows = np.arange(n_tok, dtype=np.int64)
        keep.append(rows)
        op[OP_ROWS] = rows.ctypes.data
        op[OP_NTENS] = len(refs)
        kernels = _q.ensure_kernels({t.ggml_type for t in refs})
        op[OP_KERNELS] = kernels.ctypes.data
        quant_items = []
        step = max(1, -(-n_tok // self.n_workers))
        for p in partners:
            pa = _q._alloc_partner(p, n_tok, n_cols)
            keep.append(pa)
            op[OP_ACT + 5 * p: OP_ACT + 5 * p + 5] = [a.ctypes.data for a in (pa.xf, pa.xq, pa.xd, pa.xs, pa.xbs)]
            quant_items += [(K_QUANT, int(p), lo, min(n_tok, lo + step)) for lo in range(0, n_tok, step)]
        total_rows = sum(t.n_rows for t in refs)
        chunk = max(min_chunk_rows, -(-total_rows // (self.n_workers * chunks_per_worker)))
        mm_items = []
        cols = []
        col = 0
        for i, t in enumerate(refs):
            b = OP_TENS + TENS_W * i
            op[b: b + 7] = [t.offset, t.ggml_type, t.n_cols, _q.row_bytes(t.ggml_type, t.n_cols), col,
                            int(_q.block_format(t.ggml_type).partner), t.n_rows]
            cols.append((col, col + t.n_rows))
            col += t.n_rows
            mm_items += [(K_MATMUL, i, lo, min(t.n_rows, lo + chunk)) for lo in range(0, t.n_rows, chunk)]
        op[OP_OUT_STRIDE] = total_rows
        # Dense tensors have no NUMA home: spread items round-robin over the node queues.
        job = Job.build([_spread(quant_items, self.n_nodes), _spread(mm_items, self.n_nodes)], op, keep)
        return _MatmulPlan(arena, n_cols, total_rows, cols, job.items, job.bounds, job.op, keep)


@dataclass
class _MatmulPlan:
    arena: np.ndarray
    n_cols: int
    total_rows: int
    cols: list
    items: np.ndarray
    bounds: np.ndarray
    op: np.ndarray
    keep: list


_EMPTY_F32 = np.zeros(1, np.float32)


def _spread(items: list, n_nodes: int) -> list[list]:
    per: list[list] = [[] for _ in range(n_nodes)]
    for i, it in enumerate(items):
        per[i % n_nodes].append(it)
    return per


def _tensor_ref(t) -> TensorRef:
    if isinstance(t, TensorRef):
        return t
    if isinstance(t, tuple | list):
        return TensorRef(*(int(v) for v in t))
    return TensorRef(int(t.offset), int(t.ggml_type), int(t.n_rows), int(t.n_cols))


def _calibrate_cycles(duration_s: float = 0.02) -> float:
    """Cycle-counter ticks per second (the TSC), measured against perf_counter."""
    c0, t0 = _cycles(), time.perf_counter()
    time.sleep(duration_s)
    c1, t1 = _cycles(), time.perf_counter()
    return max(1.0, (c1 - c0) / (t1 - t0))
