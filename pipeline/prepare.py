"""The prepare step, before any stage: catalog -> topology -> device -> plan -> preflight.

Allocates nothing: a bad model file, a plan that does not fit or a host that fails preflight
is refused here, in seconds, instead of after a long load. ``moe-service plan`` and
``moe-service check`` plan through :func:`plan_layout` too, so they show the layout the
service would load. Fills the context fields of pipeline.spec.PREPARE_WRITES.
"""

from __future__ import annotations

from moe_service.config import Settings
from moe_service.engine.device import resolve_device
from moe_service.gguf_model import GGUFModel
from moe_service.layout import Layout
from moe_service.log import get_logger
from moe_service.numa import Topology
from pipeline.context import PipelineContext
from pipeline.plan import plan, select_nodes

log = get_logger(__name__)


def plan_layout(catalog: GGUFModel, topology: Topology, config: Settings, gpu_node: int | None = None) -> Layout:
    """The layout the pipeline loads: :func:`pipeline.plan.plan` (not strict: preflight judges
    capacity) with the dense tensors bound to ``gpu_node`` (the DevicePlan's) when it is one of
    the plan's nodes, and without replica regions when the declared stages lack
    ``replication`` (nobody would fill them, so the engine must never read them). Raises
    ConfigError (bad node list or replica count)."""
    if gpu_node is not None and gpu_node not in select_nodes(topology, config.numa):
        log.warning("plan_gpu_node_outside_plan", gpu_node=gpu_node,
                    reason="the GPU's node is not among the plan's nodes: dense tensors are interleaved")
        gpu_node = None
    return plan(catalog, topology, config, gpu_node=gpu_node, strict=False,
                replicate="replication" in config.pipeline.stages)


def prepare(ctx: PipelineContext) -> None:
    """Fill ``ctx.catalog``, ``ctx.topology``, ``ctx.device``, ``ctx.layout`` and ``ctx.preflight``.

    Raises ModelFileError (bad GGUF, or a file its architecture refuses: unsupported,
    header/tensor disagreement), CapacityError/PreflightError (host cannot hold the plan,
    or engine.device = cuda without a GPU), ConfigError (a plan the host's nodes cannot take).
    """
    from moe_service.engine.arch import validate
    from pipeline.preflight import run_preflight

    ctx.current_stage = "prepare"
    cfg = ctx.config
    path = cfg.model_path()
    ctx.status(f"prepare: reading {path.name}")
    catalog = ctx.catalog = GGUFModel.open(path)
    validate(catalog)  # the architecture's check, before any allocation: ModelFileError, exit 3
    topology = ctx.topology = Topology.read(root=cfg.numa.sysfs_root)
    device = ctx.device = resolve_device(cfg.engine.device, topology.gpus)  # the one place it is decided
    layout = ctx.layout = plan_layout(catalog, topology, cfg, device.gpu_node)
    for warning in layout.warnings:
        log.warning("plan_warning", warning=warning)
    ctx.preflight = run_preflight(catalog, topology, layout, cfg, device=device)
