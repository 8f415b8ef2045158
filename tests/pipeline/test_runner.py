"""The declared pipeline: validation rules, running in order, skips, failures, notifications."""

from __future__ import annotations

import threading
import time

import pytest

from moe_service.config import load_config
from moe_service.errors import ConfigError, StageError
from pipeline.context import PipelineContext
from pipeline.lifecycle import run_service
from pipeline.runner import PipelineRunner
from pipeline.spec import ORDER_RULES, Stage, validate_stages

CALLS: list[str] = []


def make_stage(stage_name, requires=(), skip=None, fail=None, sleep_s=0.0, then=None):
    class _S(Stage):
        name = stage_name

        def skip_reason(self, ctx):
            return skip

        def run(self, ctx):
            CALLS.append(f"run:{self.name}")
            if sleep_s:
                time.sleep(sleep_s)
            if fail:
                raise fail
            if then:
                then(ctx)

        def close(self, ctx):
            CALLS.append(f"close:{self.name}")

    _S.requires = tuple(requires)
    return _S


REAL_NAMES = ["fastload", "placement", "replication", "pin", "engine", "warmup", "serve"]
REQUIRES = {"placement": ("fastload",), "replication": ("placement",), "pin": ("placement",), "engine": ("fastload",),
            "warmup": ("fastload",), "serve": ("warmup",)}
REGISTRY = {n: make_stage(n, REQUIRES.get(n, ())) for n in REAL_NAMES}


@pytest.fixture(autouse=True)
def _reset():
    CALLS.clear()


def ctx_for(stages, **tables):
    return PipelineContext(load_config(data={"pipeline": {"stages": stages}, **tables}))


def test_the_full_declared_order_is_valid():
    assert validate_stages(REAL_NAMES, REGISTRY) == []


@pytest.mark.parametrize("rule", ORDER_RULES, ids=lambda r: f"{r.then}-after-{r.first}")
def test_each_broken_order_is_refused_naming_the_rule(rule):
    stages = list(REAL_NAMES)
    i, j = stages.index(rule.first), stages.index(rule.then)
    stages[i], stages[j] = stages[j], stages[i]
    problems = validate_stages(stages, REGISTRY)
    assert f"pipeline.stages: {rule.then} must come after {rule.first}: {rule.reason}" in problems


def test_pin_before_placement_names_the_reason():
    problems = validate_stages(["fastload", "pin", "placement"], REGISTRY)
    assert (
        "pipeline.stages: pin must come after placement: pinned pages cannot be migrated, "
        "so placement would be silently lost" in problems
    )


def test_unknown_duplicate_and_missing_prerequisite():
    problems = validate_stages(["fastload", "fastload", "warmup", "serve", "frobnicate"], REGISTRY)
    assert any("unknown stage 'frobnicate'" in p and "known stages: engine, fastload" in p for p in problems)
    assert any("stage 'fastload' is declared twice (positions 1 and 2)" in p for p in problems)
    problems = validate_stages(["warmup", "serve"], REGISTRY)
    assert "pipeline.stages: stage 'warmup' requires 'fastload', which is not declared" in problems


def test_runner_refuses_before_running_anything():
    with pytest.raises(ConfigError):
        PipelineRunner(ctx_for(["engine", "fastload"]), REGISTRY)
    assert CALLS == []


def test_valid_pipeline_runs_in_order_and_closes_in_reverse(notify_socket):
    ctx = ctx_for(["fastload", "placement", "warmup"])
    runner = PipelineRunner(ctx, REGISTRY)
    runner.run()
    runner.close()
    assert CALLS == ["run:fastload", "run:placement", "run:warmup", "close:warmup", "close:placement", "close:fastload"]
    assert set(ctx.stage_durations_s) == {"fastload", "placement", "warmup"}
    assert notify_socket.wait_for("STATUS=warmup (3/3)")


def test_disabled_stage_is_skipped_with_its_reason(notify_socket):
    reg = dict(REGISTRY, replication=make_stage("replication", ("placement",), skip="replication.replicas = 0"))
    ctx = ctx_for(["fastload", "placement", "replication"])
    runner = PipelineRunner(ctx, reg)
    runner.run()
    assert "run:replication" not in CALLS
    assert ctx.skipped == {"replication": "replication.replicas = 0"}
    assert notify_socket.wait_for("STATUS=replication skipped: replication.replicas = 0")


def test_failure_closes_what_ran_and_reports_errno(notify_socket):
    reg = dict(REGISTRY, placement=make_stage("placement", ("fastload",), fail=OSError(12, "Cannot allocate memory")))
    ctx = ctx_for(["fastload", "placement", "warmup"])
    runner = PipelineRunner(ctx, reg)
    with pytest.raises(StageError, match="stage placement failed: OSError"):
        runner.run()
    runner.close()
    assert CALLS == ["run:fastload", "run:placement", "close:placement", "close:fastload"]
    assert notify_socket.wait_for("ERRNO=12")


def test_service_long_stage_extends_timeout_and_ready_comes_last(notify_socket, clean_env):
    """A 3 s stage with a 1 s extend interval: >= 2 EXTEND_TIMEOUT_USEC=n spaced < n apart,
    then READY=1 after them; SIGTERM-like shutdown then STOPPING=1 and exit 0."""
    def stop_soon(ctx):
        threading.Timer(0.5, ctx.request_shutdown).start()

    reg = {
        "fastload": make_stage("fastload", sleep_s=3.0),
        "warmup": make_stage("warmup", ("fastload",), then=stop_soon),
    }
    settings = load_config(
        data={"pipeline": {"stages": ["fastload", "warmup"], "extend_after_s": 0, "extend_interval_s": 1.0, "extend_timeout_s": 2.5}}
    )
    code = run_service(settings, handle_signals=False, registry=reg, prepare=lambda ctx: None)
    assert code == 0
    assert notify_socket.wait_for("STOPPING=1")
    msgs = notify_socket.messages
    ext = [(t, m) for t, m in msgs if m.startswith(b"EXTEND_TIMEOUT_USEC=")]
    assert len(ext) >= 2
    n_s = int(ext[0][1].split(b"=")[1]) / 1e6
    assert n_s == 2.5
    gaps = [b[0] - a[0] for a, b in zip(ext, ext[1:], strict=False)]
    assert max(gaps) < n_s
    texts = [m for _, m in msgs]
    ready = next(i for i, m in enumerate(texts) if m.startswith(b"READY=1"))
    assert all(i < ready for i, m in enumerate(texts) if m.startswith(b"EXTEND_TIMEOUT_USEC="))
    assert ready < next(i for i, m in enumerate(texts) if m.startswith(b"STOPPING=1"))
    assert CALLS == ["run:fastload", "run:warmup", "close:warmup", "close:fastload"]


def test_service_invalid_pipeline_exits_2_with_errno(notify_socket, clean_env):
    settings = load_config(data={"pipeline": {"stages": ["serve", "warmup", "fastload"]}})
    assert run_service(settings, handle_signals=False, registry=REGISTRY, prepare=lambda ctx: None) == 2
    assert notify_socket.wait_for("ERRNO=22")
    assert CALLS == []


def test_shutdown_during_a_stage_stops_cleanly(notify_socket, clean_env):
    def long_stage_then_check(ctx):
        ctx.request_shutdown("SIGTERM")
        ctx.check_shutdown()

    reg = {"fastload": make_stage("fastload", then=long_stage_then_check), "warmup": make_stage("warmup", ("fastload",))}
    settings = load_config(data={"pipeline": {"stages": ["fastload", "warmup"]}})
    assert run_service(settings, handle_signals=False, registry=reg, prepare=lambda ctx: None) == 0
    assert "run:warmup" not in CALLS and CALLS[-1] == "close:fastload"
    assert notify_socket.wait_for("STOPPING=1")
