"""The worker pool: pinning once per thread, dispatch, node queues and stealing, errors,
sleep/wake and shutdown. Real threads and real numba kernels throughout."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from moe_service.engine import pool as P
from moe_service.engine import quant as q
from moe_service.numa import parse_cpulist

CPUS = sorted(os.sched_getaffinity(0))


def _allowed_cpus(native_id: int) -> set[int]:
    with open(f"/proc/self/task/{native_id}/status") as fh:
        for line in fh:
            if line.startswith("Cpus_allowed_list:"):
                return set(parse_cpulist(line.split(":", 1)[1]))
    raise AssertionError("no Cpus_allowed_list")


@pytest.fixture
def pool():
    p = P.WorkerPool(pin_caller=False, spin_s=0.002)
    yield p
    p.close()


def test_default_nodes_cover_this_process_cpus():
    nodes = P.default_nodes()
    assert sorted(c for cs in nodes.values() for c in cs) == CPUS


def test_parse_cpulist():
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]


def test_workers_pinned_once_each_and_never_per_op(monkeypatch):
    calls: list[tuple[str, int, frozenset]] = []
    real = os.sched_setaffinity

    def recording(pid, cpus):
        calls.append((threading.current_thread().name, pid, frozenset(cpus)))
        return real(pid, cpus)

    monkeypatch.setattr(os, "sched_setaffinity", recording)
    rng = np.random.default_rng(0)
    arena = q.random_blocks(rng, q.GGML_Q8_0, 64, 256)
    x = rng.standard_normal((1, 256)).astype(np.float32)
    with P.WorkerPool(spin_s=0.002) as pool:
        n_bg = pool.n_workers - 1
        assert len(calls) == n_bg  # every background worker pinned itself at start
        for _name, pid, cpus in calls:
            assert pid == 0 and len(cpus) == 1  # the calling thread, exactly one CPU
        assert sorted(next(iter(c)) for _, _, c in calls) == sorted(c for c, _ in pool.slots[1:])
        for t in pool._threads:  # and the kernel agrees
            cpu = pool.slots[int(t.name.rsplit("-", 1)[1])][0]
            assert _allowed_cpus(t.native_id) == {cpu}

        # Dispatch from a dedicated thread: it is pinned once (as worker 0), then never again.
        def engine():
            for _ in range(30):
                pool.matmul(arena, [(0, q.GGML_Q8_0, 64, 256)], x)
            assert os.sched_getaffinity(0) == {pool.slots[0][0]}

        th = threading.Thread(target=engine, name="engine")
        th.start()
        th.join()
        assert [c for c in calls if c[0] == "engine"] == [("engine", 0, frozenset({pool.slots[0][0]}))]
        assert len(calls) == n_bg + 1


@pytest.mark.parametrize("n_tok", [1, 5])
def test_pool_matmul_equals_single_thread_kernel(pool, n_tok):
    rng = np.random.default_rng(n_tok)
    specs = [(q.GGML_Q4_1, 96), (q.GGML_Q8_0, 40), (q.GGML_Q4_K, 33), (q.GGML_F16, 8)]
    parts, tens, off = [], [], 0
    for t, rows in specs:
        b = q.random_blocks(rng, t, rows, 512)
        parts.append(b)
        tens.append(P.TensorRef(off, t, rows, 512))
        off += b.size
    arena = np.concatenate(parts)
    x = rng.standard_normal((n_tok, 512)).astype(np.float32)
    outs = pool.matmul(arena, tens, x)
    for t, y in zip(tens, outs, strict=True):
        ref = q.matmul(arena, t.offset, t.ggml_type, t.n_rows, t.n_cols, x)
        assert y.shape == (n_tok, t.n_rows)
        assert np.array_equal(y, ref)
    again = pool.matmul(arena, tens, x)  # cached plan, fresh outputs
    assert all(np.array_equal(a, b) and a is not b for a, b in zip(again, outs, strict=True))


def _record_job(homes, n_nodes, wait_for, limit_cycles):
    """One K_RECORD item per entry of ``homes`` (its home node; sorted, so an item's index in
    the job equals its position in ``homes``). log[i] = worker slot + 1 that ran item i."""
    n_items = len(homes)
    log = np.zeros(n_items + 1, np.int64)
    phases = [[[(P.K_RECORD, log.ctypes.data, n_items, wait_for, limit_cycles, 0)
                for h in homes if h == nd] for nd in range(n_nodes)]]
    return P.Job.build(phases, np.zeros(1, np.int64), [log]), log


@pytest.mark.skipif(len(CPUS) < 2, reason="needs two CPUs")
def test_idle_node_steals_from_busy_node():
    """All items are homed on node 0; the node-1 worker must steal one. Each record item waits
    until two have started, so the run can only finish quickly if the node-1 worker stole."""
    with P.WorkerPool({0: [CPUS[0]], 1: [CPUS[1]]}, pin_caller=False, spin_s=0.05) as pool:
        limit = int(20 * pool._cycles_per_s)
        job, log = _record_job([0, 0], 2, 2, limit)
        t0 = time.perf_counter()
        pool.run(job)
        assert time.perf_counter() - t0 < 10
        assert sorted(log[:2]) == [1, 2]  # slot 0 (node 0) and slot 1 (node 1) each ran one


@pytest.mark.skipif(len(CPUS) < 2, reason="needs two CPUs")
def test_each_node_takes_its_own_items_first():
    with P.WorkerPool({0: [CPUS[0]], 1: [CPUS[1]]}, pin_caller=False, spin_s=0.05) as pool:
        limit = int(20 * pool._cycles_per_s)
        job, log = _record_job([0, 1], 2, 2, limit)
        pool.run(job)
        # item 0 is in node 0's queue, item 1 in node 1's: each worker ran its own node's item
        assert list(log[:2]) == [1, 2]


def test_unknown_item_kind_raises_and_pool_recovers(pool):
    job = P.Job.build([[[(P.K_NOP,), (99, 7, 8)]]], np.zeros(1, np.int64))
    with pytest.raises(P.WorkerError, match=r"work item 1 of 2 \(kind 99, fields \[7, 8"):
        pool.run(job)
    pool.run(P.Job.build([[[(P.K_NOP,)]]], np.zeros(1, np.int64)))  # still usable


def test_worker_thread_failure_is_reraised_with_context():
    bad_cpu = max(CPUS) + 4096  # sched_setaffinity fails with EINVAL
    with P.WorkerPool({0: [CPUS[0], bad_cpu]}, pin_caller=False) as pool:
        with pytest.raises(P.WorkerError, match=f"worker 1 on CPU {bad_cpu} failed"):
            pool.run(P.Job.build([[[(P.K_NOP,)]]], np.zeros(1, np.int64)))


def test_idle_workers_sleep_and_wake(pool):
    job = P.Job.build([[[(P.K_NOP,)] * 4]], np.zeros(1, np.int64))
    pool.run(job)
    deadline = time.monotonic() + 5
    while pool.ctrl[P.F_SLEEPERS] < pool.n_workers - 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.ctrl[P.F_SLEEPERS] == pool.n_workers - 1  # spun 2 ms, then went to sleep
    rng = np.random.default_rng(3)
    arena = q.random_blocks(rng, q.GGML_Q6_K, 40, 256)
    x = rng.standard_normal((2, 256)).astype(np.float32)
    (y,) = pool.matmul(arena, [(0, q.GGML_Q6_K, 40, 256)], x)
    assert np.array_equal(y, q.matmul(arena, 0, q.GGML_Q6_K, 40, 256, x))


def test_close_joins_threads_and_refuses_work():
    pool = P.WorkerPool(pin_caller=False)
    threads = list(pool._threads)
    pool.close()
    assert not any(t.is_alive() for t in threads)
    with pytest.raises(P.WorkerError, match="shut down"):
        pool.run(P.Job.build([[[(P.K_NOP,)]]], np.zeros(1, np.int64)))
    pool.close()  # idempotent


def test_bad_configuration():
    with pytest.raises(ValueError, match="n_threads must be in 1"):
        P.WorkerPool({0: CPUS}, n_threads=len(CPUS) + 1)
    with pytest.raises(ValueError, match="at least one CPU"):
        P.WorkerPool({0: []})
