"""The prepare step, before any stage: catalog -> topology -> plan -> preflight.

Allocates nothing: a bad model file, a plan that does not fit or a host that fails preflight
is refused here, in seconds, instead of after a long load.
"""

from __future__ import annotations

from moe_service.log import get_logger
from pipeline.context import PipelineContext

log = get_logger(__name__)


def prepare(ctx: PipelineContext) -> None:
    """Fill ``ctx.catalog``, ``ctx.topology``, ``ctx.layout`` and ``ctx.preflight``.

    Raises ModelFileError (bad GGUF), CapacityError/PreflightError (host cannot hold the plan).
    """
    from moe_service.gguf_model import GGUFModel
    from moe_service.numa import Topology
    from pipeline.plan import plan
    from pipeline.preflight import run_preflight

    ctx.current_stage = "prepare"
    cfg = ctx.config
    path = cfg.model_path()
    ctx.status(f"prepare: reading {path.name}")
    ctx.catalog = GGUFModel.open(path)
    ctx.topology = Topology.read(root=cfg.numa.sysfs_root)
    ctx.layout = plan(ctx.catalog, ctx.topology, cfg)
    for warning in ctx.layout.warnings:
        log.warning("plan_warning", warning=warning)
    ctx.preflight = run_preflight(ctx.catalog, ctx.topology, ctx.layout, cfg)
