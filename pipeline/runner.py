"""Runs a declared stage list: validate, then each stage with STATUS, timing and timeout
extensions; on failure or shutdown close what ran, in reverse order."""

from __future__ import annotations

import time
from collections.abc import Callable

from moe_service.config import PipelineConfig
from moe_service.errors import Interrupted, MoeServiceError, StageError
from moe_service.log import get_logger
from moe_service.notify import TimeoutExtender
from pipeline.context import PipelineContext
from pipeline.spec import STAGES, Stage, check_stages

log = get_logger(__name__)


def stall_limit_s(stage: Stage, cfg: PipelineConfig) -> float:
    """The stage's stall limit: ``pipeline.stall_limit_s[name]`` when set, else its class's."""
    overrides = getattr(cfg, "stall_limit_s", None) or {}
    return float(overrides.get(stage.name, stage.stall_limit_s))


def _progress_marker(ctx: PipelineContext, stage: Stage) -> Callable[[], object]:
    """What changes when ``stage`` progresses: its progress reports (and, for stages that
    allow it, its STATUS text)."""
    if stage.progress_from_status:
        return lambda: (ctx.progress_reports, ctx.progress_marker, ctx.status_text)
    return lambda: (ctx.progress_reports, ctx.progress_marker)


class PipelineRunner:
    """Executes ``ctx.config.pipeline.stages`` in order.

    ``registry`` maps stage names to classes (default: every registered stage). Construction
    validates the list (ConfigError naming the rule on a bad one) and instantiates the stages;
    nothing runs until :meth:`run`.
    """

    def __init__(self, ctx: PipelineContext, registry: dict[str, type[Stage]] | None = None):
        self.ctx = ctx
        registry = STAGES if registry is None else registry
        names = list(ctx.config.pipeline.stages)
        check_stages(names, registry)
        self.stages: list[Stage] = [registry[n]() for n in names]
        self.started: list[Stage] = []

    def run(self) -> None:
        """Run every stage. A stage failure is logged, reported to systemd (STATUS + ERRNO) and
        re-raised as StageError (MoeServiceError subclasses pass through unchanged);
        a shutdown request raises Interrupted. In both cases nothing is closed here: the
        caller calls :meth:`close` (always, in a ``finally``)."""
        ctx, cfg = self.ctx, self.ctx.config.pipeline
        total = len(self.stages)
        for i, stage in enumerate(self.stages, 1):
            ctx.check_shutdown()
            ctx.current_stage = stage.name
            reason = stage.skip_reason(ctx)
            if reason:
                ctx.skipped[stage.name] = reason
                log.info("stage_skipped", stage=stage.name, reason=reason)
                ctx.status(f"{stage.name} skipped: {reason}")
                continue
            missing = [f"ctx.{f}" for f in stage.reads if getattr(ctx, f) is None]
            if missing:
                err = StageError(f"stage {stage.name} reads {', '.join(missing)}, which no earlier stage "
                                 f"filled (skipped: {', '.join(ctx.skipped) or 'none'})")
                self._failed(stage, err, 0.0)
                raise err
            log.info("stage_start", stage=stage.name, index=i, stages=total)
            ctx.status(f"{stage.name} ({i}/{total})")
            t0 = time.monotonic()
            self.started.append(stage)
            try:
                with TimeoutExtender(ctx.notifier, cfg.extend_after_s, cfg.extend_interval_s, cfg.extend_timeout_s,
                                     progress=_progress_marker(ctx, stage), stall_limit_s=stall_limit_s(stage, cfg),
                                     name=stage.name):
                    stage.run(ctx)
            except Interrupted:
                log.warning("stage_interrupted", stage=stage.name, seconds=round(time.monotonic() - t0, 3))
                raise
            except MoeServiceError as e:
                self._failed(stage, e, time.monotonic() - t0)
                raise
            except Exception as e:
                self._failed(stage, e, time.monotonic() - t0)
                raise StageError(f"stage {stage.name} failed: {type(e).__name__}: {e}") from e
            dt = time.monotonic() - t0
            ctx.stage_durations_s[stage.name] = dt
            log.info("stage_done", stage=stage.name, seconds=round(dt, 3))

    def _failed(self, stage: Stage, err: BaseException, seconds: float) -> None:
        log.error("stage_failed", stage=stage.name, seconds=round(seconds, 3), error=str(err), exc_info=err)
        errno_value = getattr(err, "errno", None) or 1
        self.ctx.notifier.failed(errno_value, f"{stage.name} failed: {err}"[:200])

    def close(self) -> None:
        """Close every stage whose run started, in reverse order; errors are logged, not raised."""
        while self.started:
            stage = self.started.pop()
            try:
                stage.close(self.ctx)
                log.debug("stage_closed", stage=stage.name)
            except Exception as e:  # closing must go on for the other stages
                log.error("stage_close_failed", stage=stage.name, error=str(e), exc_info=e)
