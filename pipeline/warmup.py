"""The warmup stage: build the engine, compile every kernel, touch every expert, run a prompt.

::

    ctx.catalog + ctx.weights --> ops (CPU kernels) + Model (KV for serve.parallel sequences)
                                  + Tokenizer (GGUF metadata) --> ctx.engine
      --> touch experts: per MoE layer, one fused MoE call whose routing covers all E experts
          (ceil(E/K) tokens x K slots), so every expert slab is read once and the MoE kernels
          are compiled for every expert tensor type
      --> warmup.prompt, greedy, warmup.max_tokens tokens: prefill (multi-token) and decode
          (one token) paths compiled, attention and output head hot

numba keeps compiled kernels on disk (moe_service.engine.kernel_cache_dir(): under
``$NUMBA_CACHE_DIR`` or ``cache_dir()/numba``, one folder per kernel-source hash): a restart
loads them instead of compiling again.
"""

from __future__ import annotations

import math
import time

import numpy as np

from moe_service.errors import StageError
from moe_service.log import get_logger
from pipeline.context import PipelineContext
from pipeline.spec import Stage, register_stage

log = get_logger(__name__)


def make_ops(ctx: PipelineContext):
    """The CPU kernel backend for the model (moe_service.engine.ops.CpuOps): worker threads
    per ``engine.threads`` over ``ctx.topology``, fused MoE per ``engine.fused_moe``."""
    from moe_service.engine.ops import CpuOps

    cfg = ctx.config.engine
    return CpuOps(ctx.topology, threads=cfg.threads, fused_moe=cfg.fused_moe)


def build_engine(ctx: PipelineContext, ops=None):
    """The Engine over the loaded weights: Model (KV for ``serve.parallel`` sequences of the
    context engine/kv.py plans from ``model.context_tokens`` and ``engine.kv_cache_gib``, in
    ``engine.kv_type``, on ``engine.kv_node``; dense part on the device engine.device resolves to, with the
    prefill expert offload there when it is a GPU), Tokenizer from the GGUF metadata, the
    served model id.

    Raises ModelFileError (unsupported architecture, missing tensor or tokenizer key),
    PreflightError (engine.device = cuda without a usable GPU).
    """
    from moe_service.engine.device import resolve_device
    from moe_service.engine.engine import Engine, served_model_name
    from moe_service.engine.model import Model
    from moe_service.engine.tokenizer import Tokenizer

    cfg = ctx.config
    if ctx.catalog is None or ctx.weights is None:
        raise StageError("warmup needs the loaded model (ctx.catalog and ctx.weights): run fastload first")
    path = ctx.catalog.shards[0].path
    device, dense = resolve_device(cfg)
    if dense == "quant":
        # The kernel worker pool owns the cores (its workers spin between dispatches); torch's own
        # intra-op threads would fight them for every attention/norm op between two dispatches.
        # Measured on the demo model, 2 cores: 0.10 s per decode step with 1 torch thread, 0.65 s
        # with 2, and no gain from batching 4 sequences (1.9 s) instead of 3.6x.
        import torch

        torch.set_num_threads(1)
    from moe_service.engine.kv import plan_for_config
    from moe_service.errors import CapacityError

    kvp = plan_for_config(ctx.catalog, cfg)  # the context: model.context_tokens or the budget's (engine/kv.py)
    if not kvp.ok:
        raise CapacityError(kvp.sentence())
    ops = ops if ops is not None else make_ops(ctx)
    kv_node = kvp.node
    pool = getattr(ops, "pool", None)
    if kv_node is None and pool is not None and pool.n_nodes > 1:  # the first engine worker's node
        kv_node = pool.node_ids[pool.slots[0][1]]
    model = Model(ctx.catalog, ctx.weights, ops, device=device, dense=dense,
                  n_seq=cfg.serve.parallel, n_ctx=kvp.n_ctx, kv_type=cfg.engine.kv_type, kv_node=kv_node,
                  experts_per_token=cfg.engine.experts_per_token)
    if model.device.type == "cuda":  # big prefill batches stream their experts to the GPU
        from moe_service.engine.offload import ExpertOffload

        model.offload = ExpertOffload.for_model(model, min_batch_tokens=cfg.engine.offload_min_batch_tokens,
                                                pins=ctx.pins)
    tokenizer = Tokenizer.from_gguf(ctx.catalog.metadata, source=str(path))
    return Engine(model, tokenizer, model_name=served_model_name(cfg.model.name, path),
                  ubatch_tokens=cfg.engine.ubatch_tokens, max_tokens_default=cfg.serve.max_tokens_default)


def touch_experts(model, seed: int = 0) -> dict[str, int]:
    """Run every routed expert of every MoE layer once through the model's fused MoE op.

    Per layer: T = ceil(E / K) tokens, token t routed to experts (t*K + k) mod E for slots
    k < K with equal weights 1/K, inputs x [T, H] float32 ~ N(0, 1) * 0.1 (seeded). Reads
    each expert slab (gate, up, down) once and compiles the kernels for its types.
    Returns {"layers": n, "experts": total (layer, expert) pairs}. Raises StageError when an
    output is not finite.
    """
    rng = np.random.default_rng(seed)
    n_layers = n_experts = 0
    for lw in model.layers:
        ex = lw.experts
        if ex is None:
            continue
        E, K, H = ex.n_expert, model.p.n_expert_used, ex.n_embd
        T = math.ceil(E / K)
        ids = (np.arange(T * K, dtype=np.int32) % E).reshape(T, K)  # [T, K]
        w = np.full((T, K), 1.0 / K, dtype=np.float32)  # [T, K]
        x = (rng.standard_normal((T, H)) * 0.1).astype(np.float32)  # [T, H]
        y = model.ops.moe(model.weights.arena, x, ids, w, ex)  # [T, H]
        if not np.all(np.isfinite(y)):
            raise StageError(f"warmup: layer {lw.index} MoE output is not finite for the expert touch")
        n_layers += 1
        n_experts += E
    return {"layers": n_layers, "experts": n_experts}


@register_stage
class WarmupStage(Stage):
    """Build ctx.engine, compile kernels, touch every expert, run warmup.prompt (see module doc)."""

    name = "warmup"
    requires = ("fastload",)
    stall_limit_s = 900.0  # a first numba compile reports nothing for minutes
    summary = ("needs ctx.catalog and ctx.weights; builds ctx.engine (model, tokenizer, sampler), touches "
               "every expert once and runs warmup.prompt so the first request is as fast as the hundredth")

    def run(self, ctx: PipelineContext) -> None:
        cfg = ctx.config.warmup
        from moe_service.engine import kernel_cache_dir

        kernel_cache = str(kernel_cache_dir())
        t0 = time.monotonic()
        ctx.status("warmup: building the engine")
        ctx.engine = build_engine(ctx)
        t_build = time.monotonic()
        ctx.check_shutdown()
        touched = {"layers": 0, "experts": 0}
        if cfg.touch_experts:
            ctx.status("warmup: touching every expert")
            touched = touch_experts(ctx.engine.model)
        t_touch = time.monotonic()
        ctx.check_shutdown()
        ctx.status("warmup: running the warmup prompt")
        engine = ctx.engine
        gen = engine.generate(engine.encode_prompt(cfg.prompt), max_tokens=min(cfg.max_tokens, engine.n_ctx - 1))
        t_end = time.monotonic()
        # this (main) thread dispatched as worker 0: give it its CPU mask back before the serve
        # stage starts the event loop, the engine thread (worker 0 from now on) and the watchdog
        pool = getattr(getattr(engine.model, "ops", None), "pool", None)
        if pool is not None and hasattr(pool, "release_caller"):
            pool.release_caller()
        log.info(
            "warmup_done", stage="warmup", model=engine.model_name, build_s=round(t_build - t0, 3),
            touch_experts_s=round(t_touch - t_build, 3), expert_layers=touched["layers"],
            experts_touched=touched["experts"], prompt_tokens=gen.prompt_tokens, tokens=len(gen.token_ids),
            prefill_s=round(gen.prefill_s, 3), decode_s=round(gen.decode_s, 3), text=gen.text,
            seconds=round(t_end - t0, 3), numba_cache_dir=kernel_cache,
        )

    def close(self, ctx: PipelineContext) -> None:
        if ctx.engine is not None:
            ctx.engine.close()
            ctx.engine = None
