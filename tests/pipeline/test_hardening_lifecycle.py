"""Issue 15 (hardening) around the service's life: start-timeout extensions only while a stage
progresses, shutdown_grace_s bounded by TimeoutStopSec, a model file replaced during the load,
the main thread's CPU mask after the worker pool, a dead worker pool's reason."""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from moe_service.config import load_config
from moe_service.errors import ConfigError, StageError
from moe_service.gguf_model import GGUFModel
from moe_service.notify import TimeoutExtender
from pipeline.context import PipelineContext
from pipeline.runner import PipelineRunner
from pipeline.spec import Stage
from tests.support.gguf_factory import write_moe_gguf

REPO = Path(__file__).resolve().parents[2]


class _Notifier:
    enabled = True
    is_ready = False

    def __init__(self):
        self.sent: list[str] = []

    def extend_timeout(self, seconds):
        self.sent.append(f"EXTEND_TIMEOUT_USEC={int(seconds * 1e6)}")

    def status(self, text):
        self.sent.append(f"STATUS={text}")

    def send(self, *lines):
        self.sent.append("\n".join(lines))

    def failed(self, err_no, status):
        self.sent.append(f"ERRNO={err_no}")


def _extensions(n: _Notifier) -> int:
    return sum(m.startswith("EXTEND_TIMEOUT_USEC=") for m in n.sent)


def test_extensions_stop_when_the_stage_stops_progressing():
    n = _Notifier()
    progress = {"bytes": 0}
    with TimeoutExtender(n, 0.0, 0.05, 1.0, progress=lambda: progress["bytes"], stall_limit_s=0.3,
                         name="fastload") as ext:
        for _ in range(10):  # progressing: extensions keep coming
            progress["bytes"] += 1
            time.sleep(0.05)
        during = _extensions(n)
        deadline = time.monotonic() + 10
        while not ext.stalled and time.monotonic() < deadline:  # then a dead disk: no more bytes
            time.sleep(0.05)
        after_stall = _extensions(n)
        time.sleep(0.3)
    assert during >= 3
    assert ext.stalled and _extensions(n) == after_stall  # nothing sent once stalled
    assert any("no progress" in m and "fastload" in m for m in n.sent)


def test_extensions_go_on_while_progress_goes_on():
    n = _Notifier()
    progress = {"bytes": 0}
    with TimeoutExtender(n, 0.0, 0.05, 1.0, progress=lambda: progress["bytes"], stall_limit_s=0.3) as ext:
        t_end = time.monotonic() + 1.0
        while time.monotonic() < t_end:
            progress["bytes"] += 1
            time.sleep(0.05)
    assert not ext.stalled and _extensions(n) >= 8


class _Hung(Stage):
    """A stage that reports progress a few times, then hangs (until told to stop)."""

    name = "hung"
    stall_limit_s = 0.3
    release = threading.Event()

    def run(self, ctx):
        for i in range(3):
            ctx.report_progress(i)
            time.sleep(0.05)
        _Hung.release.wait(5)


def test_the_runner_uses_the_stages_progress_and_stall_limit(monkeypatch):
    settings = load_config(data={"pipeline": {"stages": ["hung"], "extend_after_s": 0, "extend_interval_s": 0.05,
                                              "extend_timeout_s": 1.0}})
    ctx = PipelineContext(settings)
    ctx.notifier = _Notifier()
    runner = PipelineRunner(ctx, {"hung": _Hung})
    t = threading.Thread(target=runner.run)
    t.start()
    deadline = time.monotonic() + 10
    while not any("no progress" in m for m in ctx.notifier.sent) and time.monotonic() < deadline:
        time.sleep(0.05)
    sent = _extensions(ctx.notifier)
    time.sleep(0.3)
    _Hung.release.set()
    t.join(10)
    assert any("hung: no progress" in m for m in ctx.notifier.sent)
    assert _extensions(ctx.notifier) == sent
    # the per-stage override from the config
    from pipeline.runner import stall_limit_s

    cfg = load_config(data={"pipeline": {"stall_limit_s": {"hung": 7}}}).pipeline
    assert stall_limit_s(_Hung(), cfg) == 7.0 and stall_limit_s(_Hung(), settings.pipeline) == 0.3


def test_fastload_reports_bytes_not_status_text():
    from pipeline.fastload import FastloadStage

    assert FastloadStage.progress_from_status is False and FastloadStage.stall_limit_s <= 120


# -- shutdown grace vs TimeoutStopSec --------------------------------------------------------------


def test_shutdown_grace_must_fit_the_stop_timeout():
    with pytest.raises(ConfigError) as e:
        load_config(data={"serve": {"shutdown_grace_s": 80}})
    assert "serve: shutdown_grace_s (80) + stop_margin_s (15) exceeds stop_timeout_s (90" in e.value.errors[0]
    ok = load_config(data={"serve": {"shutdown_grace_s": 80, "stop_timeout_s": 120}})
    assert ok.serve.shutdown_grace_s == 80
    defaults = load_config(data={}).serve
    assert defaults.shutdown_grace_s + defaults.stop_margin_s <= defaults.stop_timeout_s


@pytest.mark.parametrize("unit", ["moe-service.service", "moe-service@.service"])
def test_the_units_timeout_stop_sec_is_the_configs_stop_timeout(unit):
    text = (REPO / "units" / unit).read_text()
    (value,) = re.findall(r"^TimeoutStopSec=(\d+)s$", text, re.M)
    assert float(value) == load_config(data={}).serve.stop_timeout_s


# -- a model file replaced during the load ---------------------------------------------------------


def _fastload_ctx(path: Path) -> PipelineContext:
    settings = load_config(data={"fastload": {"threads": 1, "pages": "4k"}, "model": {"path": str(path)}})
    ctx = PipelineContext(settings)
    ctx.catalog = GGUFModel.open(path)
    return ctx


def test_a_model_file_replaced_before_the_load_is_refused(tmp_path):
    from pipeline.fastload import FastloadStage

    (path,) = write_moe_gguf(tmp_path / "m.gguf")
    ctx = _fastload_ctx(path)
    other = tmp_path / "other.gguf"
    write_moe_gguf(other, seed=1)
    os.replace(other, path)  # a new download moved into place after the catalog read it
    with pytest.raises(StageError, match=r"changed before the load: .*m\.gguf was replaced"):
        FastloadStage().run(ctx)
    assert ctx.arena is None


def test_a_model_file_rewritten_during_the_load_is_refused(tmp_path, monkeypatch):
    import pipeline.fastload as fl

    (path,) = write_moe_gguf(tmp_path / "m.gguf")
    ctx = _fastload_ctx(path)
    real = fl.fastload

    def load_then_rewrite(*a, **k):
        out = real(*a, **k)
        with open(path, "r+b") as f:  # rewritten in place (same inode), e.g. by a copy tool
            f.seek(0, os.SEEK_END)
            f.write(b"\0" * 4096)
        return out

    monkeypatch.setattr(fl, "fastload", load_then_rewrite)
    with pytest.raises(StageError, match=r"changed during the load: .*m\.gguf was rewritten \(size"):
        fl.FastloadStage().run(ctx)
    assert ctx.arena is None


# -- the CPU mask of the thread that ran warmup ---------------------------------------------------


def test_the_main_thread_gets_its_cpu_mask_back_after_the_pool_dispatched():
    from moe_service.engine import pool as P

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    before = os.sched_getaffinity(0)
    job = P.Job.build([[[(P.K_NOP,)]]], np.zeros(1, np.int64))
    with P.WorkerPool({0: cpus[:2]}, spin_s=0.002) as pool:
        pool.run(job)  # "warmup" on this thread: pinned as worker 0
        assert os.sched_getaffinity(0) == {pool.slots[0][0]}
        pool.release_caller()
        assert os.sched_getaffinity(0) == before

        pool.run(job)  # pinned again, then another thread takes over as worker 0 (the engine thread)
        assert os.sched_getaffinity(0) == {pool.slots[0][0]}
        seen = {}

        def engine():
            seen["start"] = os.sched_getaffinity(0)
            pool.run(job)
            seen["after"] = os.sched_getaffinity(0)

        th = threading.Thread(target=engine)
        th.start()
        th.join()
        assert seen["after"] == {pool.slots[0][0]}
        assert os.sched_getaffinity(0) == before  # the previous worker 0 got its mask back
    assert os.sched_getaffinity(0) == before


def test_a_thread_started_by_a_pinned_thread_gets_the_process_mask_back():
    from moe_service.engine import pool as P

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    before = os.sched_getaffinity(0)
    job = P.Job.build([[[(P.K_NOP,)]]], np.zeros(1, np.int64))
    with P.WorkerPool({0: cpus[:2]}, spin_s=0.002) as pool:
        out = {}

        def pinned_parent():
            pool.run(job)  # pinned to worker 0's CPU

            def child():  # inherits the one-CPU mask; dispatches, then releases
                pool.run(job)
                pool.release_caller()
                out["child"] = os.sched_getaffinity(0)

            c = threading.Thread(target=child)
            c.start()
            c.join()

        t = threading.Thread(target=pinned_parent)
        t.start()
        t.join()
        assert out["child"] == before  # the process mask, not the inherited single CPU


def test_a_dead_pool_names_the_worker():
    from moe_service.engine import pool as P

    cpus = sorted(os.sched_getaffinity(0))
    bad_cpu = max(cpus) + 4096
    with P.WorkerPool({0: [cpus[0], bad_cpu]}, pin_caller=False) as pool:
        assert pool.broken is not None and f"worker 1 on CPU {bad_cpu} failed" in pool.broken
    with P.WorkerPool({0: cpus[:1]}, pin_caller=False) as pool:
        assert pool.broken is None
