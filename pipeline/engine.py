"""The engine stage: build the inference engine over the loaded weights.

::

    ctx.catalog + ctx.weights + ctx.device (+ ctx.pins when the pin stage ran)
      --> ops (CPU kernels: the worker pool over ctx.topology's nodes)
      --> Model (KV cache for serve.parallel sequences; dense part on ctx.device, with the
          prefill expert offload there when it is a GPU)
      --> Tokenizer (GGUF metadata) --> ctx.engine

The warmup stage (pipeline/warmup.py) then compiles and touches it; serve serves it. A stage
list written before this stage existed (``warmup`` building the engine) is refused by the
validation with the sentence that says to declare ``engine`` before ``warmup``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from moe_service.errors import CapacityError, StageError
from moe_service.log import get_logger
from pipeline.context import PipelineContext
from pipeline.spec import Stage, register_stage

if TYPE_CHECKING:
    from moe_service.engine.engine import Engine
    from moe_service.engine.ops import CpuOps

log = get_logger(__name__)


def make_ops(ctx: PipelineContext) -> CpuOps:
    """The CPU kernel backend for the model (moe_service.engine.ops.CpuOps): worker threads
    per ``engine.threads`` over ``ctx.topology``, fused MoE per ``engine.fused_moe``."""
    from moe_service.engine.ops import CpuOps

    cfg = ctx.config.engine
    return CpuOps(ctx.topology, threads=cfg.threads, fused_moe=cfg.fused_moe)


def build_engine(ctx: PipelineContext, ops: CpuOps | None = None) -> Engine:
    """The Engine over the loaded weights: Model (KV for ``serve.parallel`` sequences of the
    context engine/kv.py plans from ``model.context_tokens`` and ``engine.kv_cache_gib`` (``auto``:
    pipeline.plan.kv_budget over ``ctx.layout`` and ``ctx.topology``, the prepare step's), in
    ``engine.kv_type``, on ``engine.kv_node``; dense part on ``ctx.device``, with the prefill
    expert offload there when it is a GPU, reading ``ctx.pins``), Tokenizer from the GGUF
    metadata, the served model id.

    Raises StageError (no loaded model or device in the context), CapacityError (the KV cache
    does not fit its budget), ModelFileError (unsupported architecture, missing tensor or
    tokenizer key).
    """
    from moe_service.engine import arch
    from moe_service.engine.engine import Engine, served_model_name
    from moe_service.engine.kv import plan_for_config
    from moe_service.engine.model import Model
    from moe_service.engine.tokenizer import Tokenizer

    cfg = ctx.config
    catalog, weights, device = ctx.catalog, ctx.weights, ctx.device
    if catalog is None or weights is None or device is None:
        raise StageError("engine needs the loaded model and its device (ctx.catalog, ctx.weights, ctx.device): "
                         "run the prepare step and fastload first")
    path = catalog.shards[0].path
    if device.dense == "quant":
        # The kernel worker pool owns the cores (its workers spin between dispatches); torch's own
        # intra-op threads would fight them for every attention/norm op between two dispatches.
        # Measured on the demo model, 2 cores: 0.10 s per decode step with 1 torch thread, 0.65 s
        # with 2, and no gain from batching 4 sequences (1.9 s) instead of 3.6x.
        import torch

        torch.set_num_threads(1)
    auto = None
    if cfg.engine.kv_cache_gib == "auto":  # sized from the plan's free memory, as preflight checked it
        from pipeline.plan import kv_budget

        if ctx.layout is None or ctx.topology is None:
            raise StageError("engine.kv_cache_gib = auto needs the placement plan (ctx.layout, ctx.topology): "
                             "run the prepare step first")
        auto = kv_budget(ctx.layout, ctx.topology, cfg)
    kvp = plan_for_config(catalog, cfg, *arch.kv_needs(catalog), auto_budget=auto)  # the context: model.context_tokens or the budget's
    if not kvp.ok:
        raise CapacityError(kvp.sentence())
    ops = ops if ops is not None else make_ops(ctx)
    kv_node = kvp.node
    pool = getattr(ops, "pool", None)
    if kv_node is None and pool is not None and pool.n_nodes > 1:  # the first engine worker's node
        kv_node = pool.node_ids[pool.slots[0][1]]
    model = Model(catalog, weights, ops, device=device.device, dense=device.dense,
                  n_seq=cfg.serve.parallel, n_ctx=kvp.n_ctx, kv_type=cfg.engine.kv_type, kv_node=kv_node,
                  experts_per_token=cfg.engine.experts_per_token)
    if model.device.type == "cuda":  # big prefill batches stream their experts to the GPU
        from moe_service.engine.offload import ExpertOffload

        model.offload = ExpertOffload.for_model(model, min_batch_tokens=cfg.engine.offload_min_batch_tokens,
                                                pins=ctx.pins)
    tokenizer = Tokenizer.from_gguf(catalog.metadata, source=str(path))
    return Engine(model, tokenizer, model_name=served_model_name(cfg.model.name, path),
                  ubatch_tokens=cfg.engine.ubatch_tokens, max_tokens_default=cfg.serve.max_tokens_default)


def release_dispatching_thread(engine: Engine) -> None:
    """Give this (main) thread its CPU mask back after it dispatched kernels as worker 0 of the
    engine's pool (building or warming the engine), before serve starts the event loop, the
    engine thread (worker 0 from then on) and the watchdog. Idempotent."""
    pool = getattr(getattr(engine.model, "ops", None), "pool", None)
    if pool is not None and hasattr(pool, "release_caller"):
        pool.release_caller()


@register_stage
class EngineStage(Stage):
    """Build ctx.engine over the loaded weights (see module doc)."""

    name = "engine"
    reads = ("catalog", "weights", "device")
    reads_if_present = ("topology", "pins")
    writes = ("engine",)
    stall_limit_s = 900.0  # building the model may compile kernels (numba), which reports nothing for minutes
    summary = "builds the model (KV cache, dense part on the resolved device) and the tokenizer"

    def run(self, ctx: PipelineContext) -> None:
        import time

        t0 = time.monotonic()
        ctx.status("engine: building the model")
        engine = ctx.engine = build_engine(ctx)
        release_dispatching_thread(engine)
        log.info("engine_built", stage=self.name, model=engine.model_name, device=str(engine.model.device),
                 n_ctx=engine.n_ctx, parallel=ctx.config.serve.parallel, seconds=round(time.monotonic() - t0, 3))

    def close(self, ctx: PipelineContext) -> None:
        if ctx.engine is not None:
            ctx.engine.close()
            ctx.engine = None
