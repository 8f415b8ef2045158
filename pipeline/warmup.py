"""The warmup stage: compile every kernel, touch every expert, run a prompt, on the engine the
engine stage built (pipeline/engine.py).

::

    ctx.engine
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
from typing import TYPE_CHECKING

import numpy as np

from moe_service.errors import StageError
from moe_service.log import get_logger
from pipeline.context import PipelineContext
from pipeline.engine import release_dispatching_thread
from pipeline.spec import Stage, register_stage

if TYPE_CHECKING:
    from moe_service.engine.model import Model

log = get_logger(__name__)


def touch_experts(model: Model, seed: int = 0) -> dict[str, int]:
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
    """Touch every expert and run warmup.prompt on ctx.engine (see module doc)."""

    name = "warmup"
    reads = ("engine",)
    stall_limit_s = 900.0  # a first numba compile reports nothing for minutes
    summary = ("touches every expert once and runs warmup.prompt so the first request is as "
               "fast as the hundredth")

    def run(self, ctx: PipelineContext) -> None:
        cfg = ctx.config.warmup
        from moe_service.engine import kernel_cache_dir

        engine = ctx.engine
        if engine is None:
            raise StageError("warmup needs ctx.engine, which the engine stage builds")
        kernel_cache = str(kernel_cache_dir())
        t0 = time.monotonic()
        touched = {"layers": 0, "experts": 0}
        if cfg.touch_experts:
            ctx.status("warmup: touching every expert")
            touched = touch_experts(engine.model)
        t_touch = time.monotonic()
        ctx.check_shutdown()
        ctx.status("warmup: running the warmup prompt")
        gen = engine.generate(engine.encode_prompt(cfg.prompt), max_tokens=min(cfg.max_tokens, engine.n_ctx - 1))
        t_end = time.monotonic()
        # this (main) thread dispatched as worker 0: give it its CPU mask back before the serve
        # stage starts the event loop, the engine thread (worker 0 from now on) and the watchdog
        release_dispatching_thread(engine)
        log.info(
            "warmup_done", stage="warmup", model=engine.model_name,
            touch_experts_s=round(t_touch - t0, 3), expert_layers=touched["layers"],
            experts_touched=touched["experts"], prompt_tokens=gen.prompt_tokens, tokens=len(gen.token_ids),
            prefill_s=round(gen.prefill_s, 3), decode_s=round(gen.decode_s, 3), text=gen.text,
            seconds=round(t_end - t0, 3), numba_cache_dir=kernel_cache,
        )
