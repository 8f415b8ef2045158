"""The service's life: start (prepare + stages), serve until a signal, shut down cleanly.

uvicorn-style: signal handlers only set flags; the first SIGTERM/SIGINT asks for a graceful
stop (STOPPING=1, in-flight requests get ``serve.shutdown_grace_s``), a second SIGINT forces
an immediate exit. Exit codes are those of :mod:`moe_service.errors`.
"""

from __future__ import annotations

import os
import signal

import pipeline.stages  # noqa: F401  (registers every stage that exists)
from moe_service.config import Settings
from moe_service.errors import ConfigError, Interrupted, MoeServiceError
from moe_service.log import get_logger
from moe_service.notify import start_watchdog
from pipeline.context import PipelineContext
from pipeline.runner import PipelineRunner

log = get_logger(__name__)

def install_signal_handlers(ctx: PipelineContext) -> None:
    """SIGTERM/SIGINT request a graceful shutdown; a second SIGINT exits at once (130)."""
    count = {"SIGINT": 0}

    def handler(signum, frame):
        name = signal.Signals(signum).name
        if name == "SIGINT":
            count["SIGINT"] += 1
            if count["SIGINT"] > 1:
                os.write(2, b"second SIGINT: exiting now\n")
                os._exit(130)
        ctx.request_shutdown(name)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    # `systemctl reload` (SIGHUP) rereads the API key file once serving (pipeline/serve.py);
    # before that there is nothing to reload, and SIGHUP's default action would kill the load.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)


def wait_until_shutdown(ctx: PipelineContext) -> None:
    """Stay up with everything loaded when no stage serves (e.g. a load-only pipeline): READY=1,
    watchdog pings while this loop lives, return on shutdown."""
    ctx.notifier.ready(f"ready: {len(ctx.stage_durations_s)} stage(s) done, no serve stage")
    log.info("service_ready", serve=False)
    wd = start_watchdog(ctx.notifier, ctx.liveness)
    try:
        while not ctx.shutdown.wait(0.2):
            ctx.liveness.beat()
    finally:
        wd.stop()


def run_service(settings: Settings, *, handle_signals: bool = True, registry=None, prepare=None) -> int:
    """Run the whole service with ``settings``; returns the process exit code.

    Validates the stage list, runs prepare (catalog, topology, plan, preflight) and the stages,
    and when no stage serves, waits for a signal with the model loaded. Always closes the
    stages that ran, in reverse order, and tells systemd STOPPING=1 / ERRNO= as fits.
    ``registry`` and ``prepare`` replace the stage registry and the prepare step (tests).
    """
    if prepare is None:
        from pipeline.prepare import prepare

    ctx = PipelineContext(settings)
    try:
        runner = PipelineRunner(ctx, registry)
    except ConfigError as e:
        for line in e.errors:
            log.error("config_invalid", problem=line)
        ctx.notifier.failed(22, f"invalid pipeline: {e.errors[0]}"[:200])  # EINVAL
        return e.exit_code
    if handle_signals:
        install_signal_handlers(ctx)
    code = 0
    try:
        prepare(ctx)
        runner.run()
        if "serve" not in settings.pipeline.stages:
            wait_until_shutdown(ctx)
        ctx.notifier.stopping("stopping")
        log.info("service_stopping", signal=ctx.shutdown_signal if ctx.shutdown.is_set() else None)
    except Interrupted as e:
        ctx.notifier.stopping(f"stopping: {e}")
        log.warning("service_interrupted", reason=str(e))
        code = e.exit_code
    except MoeServiceError as e:
        log.error("service_failed", stage=ctx.current_stage, error=str(e), exit_code=e.exit_code)
        if ctx.current_stage in ("starting", "prepare"):  # the runner reports stage failures itself
            ctx.notifier.failed(getattr(e, "errno", None) or 1, f"{ctx.current_stage} failed: {e}"[:200])
        code = e.exit_code
    finally:
        runner.close()
    log.info("service_exit", exit_code=code)
    return code
