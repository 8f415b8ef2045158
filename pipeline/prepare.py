"""The prepare step, before any stage: catalog -> topology -> plan -> preflight.

Allocates nothing: a bad model file, a plan that does not fit or a host that fails preflight
is refused here, in seconds, instead of after a long load. ``moe-service plan`` and
``moe-service check`` plan through :func:`plan_layout` too, so they show the layout the
service would load.
"""

from __future__ import annotations

from moe_service.config import Settings
from moe_service.engine.device import resolve_device
from moe_service.layout import Layout
from moe_service.log import get_logger
from moe_service.numa import Topology
from pipeline.context import PipelineContext
from pipeline.plan import plan, select_nodes
from pipeline.replication import drop_replicas

log = get_logger(__name__)


def dense_gpu_node(config: Settings, topology: Topology) -> int | None:
    """The NUMA node of the GPU that runs the dense part, or None: when ``engine.device``
    resolves to the CPU (moe_service.engine.device.resolve_device), when the host has no
    NVIDIA GPU in sysfs, or when the first one's numa_node is unknown (-1). Raises
    PreflightError for engine.device = cuda without a usable GPU."""
    device, _dense = resolve_device(config)
    if not device.startswith("cuda") or not topology.gpus:
        return None
    node = topology.gpus[0].numa_node
    return node if node >= 0 else None


def plan_layout(catalog, topology: Topology, config: Settings, gpu_node: int | None = None) -> Layout:
    """The layout the pipeline loads: :func:`pipeline.plan.plan` (not strict: preflight judges
    capacity) with the dense tensors bound to ``gpu_node`` when it is one of the plan's nodes,
    and without replica regions when the declared stages lack ``replication`` (nobody would
    fill them, so the engine must never read them). Raises ConfigError (bad node list or
    replica count)."""
    if gpu_node is not None and gpu_node not in select_nodes(topology, config.numa):
        log.warning("plan_gpu_node_outside_plan", gpu_node=gpu_node,
                    reason="the GPU's node is not among the plan's nodes: dense tensors are interleaved")
        gpu_node = None
    layout = plan(catalog, topology, config, gpu_node=gpu_node, strict=False)
    if "replication" not in config.pipeline.stages and layout.replica_regions():
        n = len(layout.replica_regions())
        drop_replicas(layout)
        layout.warnings.append(f"the plan's {n} replica region(s) were dropped: the declared stages lack "
                               "replication, which fills them")
    return layout


def prepare(ctx: PipelineContext) -> None:
    """Fill ``ctx.catalog``, ``ctx.topology``, ``ctx.layout`` and ``ctx.preflight``.

    Raises ModelFileError (bad GGUF, or a file its architecture refuses: unsupported,
    header/tensor disagreement), CapacityError/PreflightError (host cannot hold the plan,
    or engine.device = cuda without a GPU), ConfigError (a plan the host's nodes cannot take).
    """
    from moe_service.gguf_model import GGUFModel
    from pipeline.preflight import run_preflight

    ctx.current_stage = "prepare"
    cfg = ctx.config
    path = cfg.model_path()
    ctx.status(f"prepare: reading {path.name}")
    ctx.catalog = GGUFModel.open(path)
    from moe_service.engine.arch import validate

    validate(ctx.catalog)  # the architecture's check, before any allocation: ModelFileError, exit 3
    ctx.topology = Topology.read(root=cfg.numa.sysfs_root)
    ctx.layout = plan_layout(ctx.catalog, ctx.topology, cfg, dense_gpu_node(cfg, ctx.topology))
    for warning in ctx.layout.warnings:
        log.warning("plan_warning", warning=warning)
    ctx.preflight = run_preflight(ctx.catalog, ctx.topology, ctx.layout, cfg)
