"""Where a decode step or a prefill of the llama-family architectures (llama, qwen2, qwen3,
qwen3moe: moe_service/engine/arch/llama.py's block) or of deepseek2 (DeepSeek V2/V3, Kimi K2:
moe_service/engine/arch/deepseek2.py's MLA block) spends its time, per part of the layer,
and outside the layers (embedding, output norm and head).

The companion of bench/ds4_parts.py (DeepSeek V4), with its timer (:class:`bench.ds4_parts.PartTimer`:
exclusive times, a part called inside another is subtracted from it). Decode (the default):
prefills ``--depth`` tokens of ordinary text (bench.decode.depth_ids), then times ``--decode``
single-token steps: milliseconds per layer per decoded token. Prefill (``--prefill``): times
the ``--depth``-token prefill itself (``--ubatch``-token steps from an empty slot, after an
untimed warm-up prefill of one step on another slot): milliseconds per layer for the whole
prefill, and microseconds per layer per prompt token. Parts:

    attn proj      attn_q/k/v (one dispatch) and attn_output matmuls (be.linear; biases in it;
                   deepseek2: attn_q_a + attn_kv_a_mqa, attn_q_b, attn_output)
    mla heads      deepseek2's per-head matmuls (be.head_linear: q_nope through W_kb, the
                   latent output through W_vb) and the prefill's per-head K/V decompression
    qk norm        the per-head RMSNorm of q and k (qwen3, qwen3moe), in steps of several tokens
    rope           q and k rope; a one-token CPU step runs the q/k norms and the rope in one
                   compiled call (CpuPath.qk_norm_rope_one), timed here
    kv write       the step's keys and values into the cache (attention.store)
    attention      scores, softmax and P.V over the cache (attention.attend)
    norms          attn_norm and ffn_norm (a one-token CPU step: ffn_norm with the residual add
                   before it, one compiled call: CpuPath.add_rms_norm)
    router         router logits and the top-k routing
    experts        the routed experts (fused MoE step)
    dense ffn      a dense layer's gate/up/down
    shared expert  deepseek2's shared experts' gate/up/down
    glue           the rest of the layer (head reshapes, residual adds, the output buffer)

and per step, outside the layers (milliseconds per step, decode; per prefill, prefill):

    embed          token_embd rows
    head           output norm, the output matmul (n_vocab x n_embd), logits to torch
    step glue      the rest of Model.step (spans, positions, the lock, bookkeeping)

Clocks: ``--clock wall`` (default) times wall seconds; ``--clock cpu`` (with ``--threads 1``:
every kernel then runs on the calling thread) times that thread's CPU seconds
(time.thread_time), which a shared host's preemption does not inflate (its caches and memory
bandwidth still do): the way to compare parts, or two trees, while other work runs.

Command (the numbers depend on the machine's load: compare runs made back to back)::

    PYTHONPATH=. python -m bench.layer_parts --model Q.gguf --depth 2048 --decode 16 --threads 2 [--json OUT]
    PYTHONPATH=. python -m bench.layer_parts --model Q.gguf --prefill --depth 2048 --threads 2 [--ubatch 128]
    PYTHONPATH=. python -m bench.layer_parts --model Q.gguf --depth 2048 --threads 1 --clock cpu
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench.ds4_parts import CLOCKS, PartTimer, add_profile_args, profile_main

ARCHS = ("llama", "qwen2", "qwen3", "qwen3moe", "deepseek2")
PARTS = (
    "attn proj",
    "mla heads",
    "qk norm",
    "rope",
    "kv write",
    "attention",
    "norms",
    "router",
    "experts",
    "dense ffn",
    "shared expert",
    "glue",
)
OUTSIDE = ("embed", "head", "step glue")


class StepTimer:
    """Wall time of Model.step and of the wrapped calls made in it outside the layers
    (``outside`` part -> seconds); ``layers_s`` the layers' inclusive time."""

    def __init__(self, timer: PartTimer, clock: Callable[[], float] = time.perf_counter):
        self.timer = timer
        self.clock = clock
        self.on = False
        self.depth = 0  # > 0 while a step runs
        self.in_layer = False
        self.step_s = 0.0
        self.steps = 0
        self.outside: dict[str, float] = dict.fromkeys(OUTSIDE, 0.0)

    def wrap(self, fn: Callable, part: str) -> Callable:
        def timed(*a: Any, **k: Any) -> Any:
            if not (self.on and self.depth and not self.timer.stack):
                return fn(*a, **k)
            t0 = self.clock()
            try:
                return fn(*a, **k)
            finally:
                self.outside[part] += self.clock() - t0

        return timed

    def wrap_step(self, fn: Callable) -> Callable:
        def timed(*a: Any, **k: Any) -> Any:
            if not self.on:
                return fn(*a, **k)
            self.depth += 1
            t0 = self.clock()
            try:
                return fn(*a, **k)
            finally:
                self.step_s += self.clock() - t0
                self.steps += 1
                self.depth -= 1

        return timed


def instrument(timer: PartTimer, steps: StepTimer | None = None) -> Callable[[], None]:
    """Wrap the llama family's and deepseek2's parts (class and module attributes, so calls
    made through them are timed); returns the function that puts the originals back."""
    from moe_service.engine import attention
    from moe_service.engine.arch import deepseek2, llama
    from moe_service.engine.model import CpuPath, Model

    saved: list[tuple[Any, str, Any]] = []

    def patch(obj: Any, name: str, wrapped: Callable[[Any], Callable]) -> None:
        orig = obj.__dict__[name] if isinstance(obj, type) else getattr(obj, name)
        saved.append((obj, name, orig))
        setattr(obj, name, wrapped(orig))

    def outer(part: str) -> Callable[[tuple], str | None]:
        """Timed as ``part`` unless called inside another timed part (then it stays there)."""
        return lambda a: part if len(timer.stack) == 1 else None

    def linear_label(a: tuple) -> str | None:
        if len(timer.stack) != 1:
            return None
        return "dense ffn" if a[2][0].startswith("ffn_") else "attn proj"

    def ffn_label(a: tuple) -> str | None:
        if len(timer.stack) != 1:
            return None
        names = a[3] if len(a) > 3 else ("ffn_gate",)
        return "shared expert" if names[0].endswith("_shexp") else "dense ffn"

    def part(label: Callable[[tuple], str | None]) -> Callable[[Any], Callable]:
        return lambda f: timer.wrap(f, label)

    patch(CpuPath, "linear", part(linear_label))
    patch(CpuPath, "rmsnorm", part(outer("norms")))
    patch(CpuPath, "rmsnorm_heads", part(outer("qk norm")))
    patch(CpuPath, "rope", part(outer("rope")))
    patch(CpuPath, "qk_norm_rope_one", part(outer("rope")))  # a one-token step's fused q/k norms + rope
    patch(CpuPath, "add_rms_norm", part(outer("norms")))  # a one-token step's residual add + ffn_norm
    patch(CpuPath, "route", part(outer("router")))
    patch(CpuPath, "moe", part(outer("experts")))
    patch(CpuPath, "glu_ffn", part(ffn_label))
    patch(CpuPath, "head_linear", part(outer("mla heads")))
    patch(attention, "store", part(lambda a: "kv write"))
    patch(attention, "attend", part(lambda a: "attention"))
    patch(llama.Llama, "block", timer.wrap_layer)
    patch(deepseek2.Deepseek2, "block", timer.wrap_layer)
    if steps is not None:
        patch(Model, "step", steps.wrap_step)
        patch(CpuPath, "embed", lambda f: steps.wrap(f, "embed"))
        patch(CpuPath, "head", lambda f: steps.wrap(f, "head"))
        patch(CpuPath, "logits_out", lambda f: steps.wrap(f, "head"))
        patch(CpuPath, "gather_rows", lambda f: steps.wrap(f, "head"))
        patch(CpuPath, "rmsnorm", lambda f: steps.wrap(f, "head"))  # the output norm (outside the layers)

    def restore() -> None:
        for obj, name, orig in reversed(saved):
            setattr(obj, name, orig)

    return restore


def profile(
    path: Path,
    threads: int,
    depth: int,
    n_decode: int,
    ubatch: int = 128,
    prefill: bool = False,
    clock: str = "wall",
) -> dict:
    """Per-part ms per layer per decoded token at ``depth``, or (``prefill``) per-part ms per
    layer of the ``depth``-token prefill, and the parts outside the layers (module docstring),
    on ``clock`` (:data:`CLOCKS`; "cpu" needs ``threads`` 1). SystemExit naming the file when
    it is not one of :data:`ARCHS`, or the clock when it does not fit."""
    if clock not in CLOCKS:
        raise SystemExit(f"bench.layer_parts: --clock {clock}: expected one of {', '.join(CLOCKS)}")
    if clock == "cpu" and threads != 1:
        raise SystemExit(
            f"bench.layer_parts: --clock cpu times the calling thread: it needs --threads 1 (got {threads})"
        )
    tick = CLOCKS[clock]
    import torch

    torch.set_num_threads(1)
    from bench.decode import depth_ids
    from moe_service.engine.model import Model
    from moe_service.engine.ops import CpuOps
    from moe_service.gguf_model import GGUFModel
    from moe_service.weights import WeightStore

    catalog = GGUFModel.open(path)
    if catalog.params.arch not in ARCHS:
        raise SystemExit(
            f"bench.layer_parts: {path} is a {catalog.params.arch} file, not one of {', '.join(ARCHS)}"
        )
    weights = WeightStore.load_simple(catalog)
    ops = CpuOps(threads=threads)
    try:
        model = Model(catalog, weights, ops, n_seq=2 if prefill else 1, n_ctx=depth + n_decode + 8)
        n_layer = len(model.layers)
        timer = PartTimer([0] * n_layer, tick)
        steps = StepTimer(timer, tick)
        restore = instrument(timer, steps)
        try:
            ids = depth_ids(catalog, depth + 1)
            if prefill:  # warm-up: one step's shapes compiled and the weights touched, untimed
                w = model.kv.alloc()
                model.step([(w, ids[: min(depth, ubatch)])], want_logits=[True])
                model.kv.free(w)
                timer.on = steps.on = True
            s = model.kv.alloc()
            t0 = tick()
            for a in range(0, depth, ubatch):
                model.step([(s, ids[a : min(depth, a + ubatch)])], want_logits=[a + ubatch >= depth])
            prefill_s = tick() - t0
            timer.on = steps.on = False
            step_s = prefill_s
            if not prefill:
                tok = ids[depth]
                for _ in range(2):  # warm-up: the decode shapes compiled, the caches touched
                    tok = int(np.argmax(model.step([(s, [tok])])[0].numpy()))
                timer.on = steps.on = True
                t0 = tick()
                for _ in range(n_decode):
                    tok = int(np.argmax(model.step([(s, [tok])])[0].numpy()))
                step_s = (tick() - t0) / n_decode
                timer.on = steps.on = False
        finally:
            restore()
    finally:
        ops.close()
    n_calls = timer.layer_calls[0]
    per = n_layer if prefill else max(1, n_calls)  # prefill: per layer over the whole prefill
    table = {p: timer.excl[(0, p)] / per * 1e3 for p in PARTS}
    n_steps = 1 if prefill else max(1, steps.steps)
    outside = {p: steps.outside[p] / n_steps * 1e3 for p in OUTSIDE if p != "step glue"}
    outside["step glue"] = (steps.step_s - timer.layer_s[0] - sum(steps.outside.values())) / n_steps * 1e3
    return {
        "model": str(path),
        "arch": catalog.params.arch,
        "mode": "prefill" if prefill else "decode",
        "threads": threads,
        "clock": clock,
        "depth": depth,
        "ubatch": ubatch,
        "n_decode": 0 if prefill else n_decode,
        "n_layer": n_layer,
        "step_ms": step_s * 1e3,
        "parts_ms_per_layer": table,
        "layer_ms": timer.layer_s[0] / per * 1e3,
        "outside_ms": outside,
        "load_average": list(os.getloadavg()),
    }


def format_table(r: dict) -> str:
    prefill = r["mode"] == "prefill"
    d = max(1, r["depth"])
    if prefill:
        lines = [
            f"{r['arch']} prefill by part: {Path(r['model']).name}, {r['depth']} tokens in {r['ubatch']}-token steps, "
            f"{r['threads']} thread(s), {r['clock']} clock, prefill {r['step_ms'] / 1e3:.2f} s, load average {r['load_average'][0]:.2f}",
            f"{'part':18s}{'ms/layer':>10s}{'us/token':>10s}",
        ]
    else:
        lines = [
            f"{r['arch']} decode step by part: {Path(r['model']).name}, depth {r['depth']}, {r['n_decode']} steps, "
            f"{r['threads']} thread(s), {r['clock']} clock, step {r['step_ms']:.2f} ms, load average {r['load_average'][0]:.2f}",
            f"{'part':18s}{'ms/layer':>10s}",
        ]
    rows = list(r["parts_ms_per_layer"].items()) + [("layer total", r["layer_ms"])]
    rows += [(f"(step) {k}", v) for k, v in r["outside_ms"].items()]
    for part, v in rows:
        lines.append(f"{part:18s}{v:10.3f}" + (f"{v * 1e3 / d:10.1f}" if prefill else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.layer_parts", description=__doc__.split("\n\n")[0])
    add_profile_args(ap, "a llama / qwen2 / qwen3 / qwen3moe / deepseek2 GGUF file")
    return profile_main("bench.layer_parts", ap.parse_args(argv), profile, format_table)


if __name__ == "__main__":
    sys.exit(main())
