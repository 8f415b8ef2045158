"""Where a DeepSeek V4 (``deepseek4``) decode step or prefill spends its time, per part of the layer.

Decode (the default): prefills ``--depth`` tokens of ordinary text (bench.decode.depth_ids),
then times ``--decode`` single-token steps with each part of the layer wrapped by a timer
(exclusive times: a part called inside another is subtracted from it; a part's own helpers,
e.g. the rms inside hc_pre, stay in it). Reports milliseconds per layer per decoded token,
per compress ratio and the mean over the trunk layers.

Prefill (``--prefill``): times the ``--depth``-token prefill itself (``--ubatch``-token steps
from an empty slot, after an untimed warm-up prefill of one step on another slot), with the
same parts: milliseconds per layer for the whole prefill, and microseconds per layer per
prompt token. Parts:

    attn proj        q_a/kv, q_b, output a/b matmuls (be.linear, be.head_linear; where one
                     dispatch computes every projection of h, the compressor's and the
                     indexer's projections are in it)
    compressor proj  attn_compressor_kv/gate matmuls (when a dispatch of their own)
    indexer proj     indexer_compressor_kv/gate, indexer.attn_q_b, indexer.proj matmuls (idem)
    compressor       Deepseek4._compress (ring, softmax pooling, norm, rope of completed
                     blocks), attention's and the indexer's
    indexer top-k    the indexer's scores over the compressed keys and the top-k
    attention        softmax attention over the window and the selected compressed rows
    hc pre / post    the hyper-connection mixes (pre: rms + mix + h; post: stream update)
    sinkhorn         the mixing matrix's normalisations (inside hc pre)
    norms            rmsnorms outside the above (attn/ffn/q_a/kv norms, per-head q; in a
                     multi-token step q's rope and float16 rounding too: one fused pass)
    rope             q / kv rope, inverse rope of the output
    router           router logits, sqrt-softplus, top-k routing
    moe              the routed experts (fused MoE step)
    shared expert    the shared expert's gate/up/down
    glue             the rest of the layer (numpy in the attention: rings, masks, concatenates)

Command (the numbers depend on the machine's load: compare runs made back to back)::

    PYTHONPATH=. python -m bench.ds4_parts --model V4.gguf --depth 512 --decode 16 --threads 2 [--json OUT]
    PYTHONPATH=. python -m bench.ds4_parts --model V4.gguf --prefill --depth 2048 --threads 2 [--ubatch 128]
    PYTHONPATH=. python -m bench.ds4_parts --model V4.gguf --depth 512 --threads 1 --clock cpu

``--clock cpu`` (with ``--threads 1``: every kernel then runs on the calling thread) times that
thread's CPU seconds (time.thread_time), which a shared host's preemption does not inflate.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

PARTS = (
    "attn proj",
    "compressor proj",
    "indexer proj",
    "compressor",
    "indexer top-k",
    "attention",
    "hc pre",
    "sinkhorn",
    "hc post",
    "norms",
    "rope",
    "router",
    "moe",
    "shared expert",
    "glue",
)


class PartTimer:
    """Exclusive time per (compress ratio, part) of wrapped calls made inside a layer, by
    ``clock()`` (seconds; wall time by default, bench.layer_parts offers the thread's CPU time).

    ``wrap(fn, label)``: ``label(args)`` names the part (None: not timed here, its time
    stays in the caller's part); a wrapped call inside another wrapped call is subtracted
    from the outer one. ``layer`` wraps the architecture's block: its inclusive time minus
    the parts' is ``glue``."""

    def __init__(self, ratios: list[int], clock: Callable[[], float] = time.perf_counter):
        self.ratios = ratios
        self.clock = clock
        self.on = False
        self.ratio = 0
        self.stack: list[float] = []
        self.excl: dict[tuple[int, str], float] = defaultdict(float)
        self.layer_s: dict[int, float] = defaultdict(float)
        self.layer_calls: dict[int, int] = defaultdict(int)

    def wrap(self, fn: Callable, label: Callable[[tuple], str | None]) -> Callable:
        def timed(*a: Any, **k: Any) -> Any:
            part = label(a) if self.on and self.stack else None
            if part is None:
                return fn(*a, **k)
            self.stack.append(0.0)
            t0 = self.clock()
            try:
                return fn(*a, **k)
            finally:
                dt = self.clock() - t0
                child = self.stack.pop()
                self.excl[(self.ratio, part)] += dt - child
                self.stack[-1] += dt

        return timed

    def wrap_layer(self, fn: Callable) -> Callable:
        def timed(arch: Any, be: Any, lw: Any, x: Any, st: Any) -> Any:
            if not self.on:
                return fn(arch, be, lw, x, st)
            self.ratio = self.ratios[lw.index]
            self.stack = [0.0]
            t0 = self.clock()
            out = fn(arch, be, lw, x, st)
            dt = self.clock() - t0
            self.layer_s[self.ratio] += dt
            self.layer_calls[self.ratio] += 1
            self.excl[(self.ratio, "glue")] += dt - self.stack.pop()
            return out

        return timed


_LINEAR_PARTS = {
    "attn_q_a": "attn proj",
    "attn_q_b": "attn proj",
    "attn_output_b": "attn proj",
    "attn_compressor_kv": "compressor proj",
    "indexer_compressor_kv": "indexer proj",
    "indexer.attn_q_b": "indexer proj",
    "indexer.proj": "indexer proj",
}


def instrument(timer: PartTimer) -> Callable[[], None]:
    """Wrap deepseek4's parts (module attributes, so calls made through them are timed);
    returns the function that puts the originals back."""
    from moe_service.engine import ds4_ops
    from moe_service.engine.arch import deepseek4
    from moe_service.engine.model import CpuPath

    saved: list[tuple[Any, str, Any]] = []

    def patch(obj: Any, name: str, label: Callable[[tuple], str | None]) -> None:
        if not hasattr(obj, name):
            return
        orig = getattr(obj, name)
        saved.append((obj, name, orig))
        setattr(obj, name, timer.wrap(orig, label))

    def outer(part: str) -> Callable[[tuple], str | None]:
        """Timed as ``part`` unless called inside another timed part (then it stays there)."""
        return lambda a: part if len(timer.stack) == 1 else None

    def linear_label(a: tuple) -> str | None:
        if len(timer.stack) != 1:
            return None
        first = a[2][0]
        return "attn proj" if first.startswith("attn_output_a") else _LINEAR_PARTS.get(first, "attn proj")

    patch(CpuPath, "linear", linear_label)
    patch(CpuPath, "head_linear", outer("attn proj"))  # attn_output_a's groups (one pooled head_matmul)
    patch(CpuPath, "rmsnorm", outer("norms"))
    patch(CpuPath, "router_logits", outer("router"))
    patch(CpuPath, "moe", outer("moe"))
    patch(CpuPath, "glu_ffn", outer("shared expert"))
    patch(ds4_ops, "rms", outer("norms"))
    patch(ds4_ops, "rope_last", outer("rope"))
    patch(ds4_ops, "hc_pre", outer("hc pre"))
    patch(ds4_ops, "sinkhorn", lambda a: "sinkhorn")
    patch(ds4_ops, "hc_post", outer("hc post"))
    patch(ds4_ops, "attend_sinks", outer("attention"))
    patch(ds4_ops, "sqrt_softplus", outer("router"))
    patch(ds4_ops, "route", outer("router"))
    try:  # the compiled forms (moe_service.engine.ds4_compiled), where this tree has them
        from moe_service.engine import ds4_compiled
    except ImportError:
        ds4_compiled = None
    if ds4_compiled is not None:
        for name, part in (
            ("attend_rows", "attention"),
            ("attend_one", "attention"),
            ("hc_pre", "hc pre"),
            ("hc_post", "hc post"),
            ("inverse_rope_groups", "rope"),  # the output's inverse rope + its group-major copy
        ):
            patch(ds4_compiled, name, outer(part))
        # multi-token steps: q's per-head rms + rope + float16 rounding in one pass (norms),
        # the output's inverse rope (rope)
        patch(
            ds4_compiled,
            "heads_inplace",
            lambda a: None if len(timer.stack) != 1 else "norms" if a[5] else "rope",
        )
    try:  # one token's pooled forms (moe_service.engine.ds4_decode), where this tree has them
        from moe_service.engine import ds4_decode
    except ImportError:
        ds4_decode = None
    if ds4_decode is not None:  # its attention prepares q and inverse-ropes the output (norms, rope)
        patch(ds4_decode, "attend_one", outer("attention"))
        patch(ds4_decode, "route_one", outer("router"))
    try:  # the compiled indexer (moe_service.engine.ds4_indexer), where this tree has it
        from moe_service.engine import ds4_indexer
    except ImportError:
        ds4_indexer = None
    if ds4_indexer is not None:
        for name in ("index_one", "lid_top_k"):
            patch(ds4_indexer, name, outer("indexer top-k"))
    patch(deepseek4, "_top_k", outer("indexer top-k"))
    patch(deepseek4.Deepseek4, "_hc_pre", outer("hc pre"))  # where this tree has it (ds4_decode)
    patch(deepseek4.Deepseek4, "_compress", outer("compressor"))
    orig_block = deepseek4.Deepseek4._block
    saved.append((deepseek4.Deepseek4, "_block", orig_block))
    deepseek4.Deepseek4._block = timer.wrap_layer(orig_block)

    def restore() -> None:
        for obj, name, orig in reversed(saved):
            setattr(obj, name, orig)

    return restore


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


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
    layer of the ``depth``-token prefill (see the module docstring), on ``clock``
    (:data:`CLOCKS`: "cpu" is the calling thread's CPU time and needs ``threads`` 1).
    SystemExit naming the clock when it does not fit."""
    if clock not in CLOCKS:
        raise SystemExit(f"bench.ds4_parts: --clock {clock}: expected one of {', '.join(CLOCKS)}")
    if clock == "cpu" and threads != 1:
        raise SystemExit(
            f"bench.ds4_parts: --clock cpu times the calling thread: it needs --threads 1 (got {threads})"
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
    if catalog.params.arch != "deepseek4":
        raise SystemExit(f"bench.ds4_parts: {path} is a {catalog.params.arch} file, not deepseek4")
    weights = WeightStore.load_simple(catalog)
    ops = CpuOps(threads=threads)
    try:
        model = Model(catalog, weights, ops, n_seq=2 if prefill else 1, n_ctx=depth + n_decode + 8)
        ratios = list(model.arch.hp.compress_ratios[: model.arch.hp.n_layer])
        timer = PartTimer(ratios, tick)
        restore = instrument(timer)
        try:
            ids = depth_ids(catalog, depth + 1)
            if prefill:  # warm-up: one step's shapes compiled and the weights touched, untimed
                w = model.kv.alloc()
                model.step([(w, ids[: min(depth, ubatch)])], want_logits=[True])
                model.kv.free(w)
                timer.on = True
            s = model.kv.alloc()
            t0 = tick()
            for a in range(0, depth, ubatch):
                model.step([(s, ids[a : min(depth, a + ubatch)])], want_logits=[a + ubatch >= depth])
            prefill_s = tick() - t0
            timer.on = False
            step_s = prefill_s
            if not prefill:
                tok = ids[depth]
                for _ in range(2):  # warm-up: the decode shapes compiled, the caches touched
                    tok = int(np.argmax(model.step([(s, [tok])])[0].numpy()))
                timer.on = True
                t0 = tick()
                for _ in range(n_decode):
                    tok = int(np.argmax(model.step([(s, [tok])])[0].numpy()))
                step_s = (tick() - t0) / n_decode
                timer.on = False
        finally:
            restore()
    finally:
        ops.close()
    kinds = sorted(set(ratios))
    n_steps = sum(timer.layer_calls.values()) // max(1, len(ratios))  # steps timed (per layer)
    per = {r: (timer.layer_calls[r] / max(1, n_steps) if prefill else timer.layer_calls[r]) for r in kinds}
    n_all = sum(per.values())  # decode: layer calls; prefill: layers (each over the whole prefill)
    table: dict[str, dict[str, float]] = {}
    for part in PARTS:
        row = {}
        for r in kinds:
            row[f"ratio_{r}"] = timer.excl[(r, part)] / per[r] * 1e3 if per[r] else 0.0
        row["mean"] = sum(timer.excl[(r, part)] for r in kinds) / max(1, n_all) * 1e3
        table[part] = row
    total = {f"ratio_{r}": timer.layer_s[r] / max(1, per[r]) * 1e3 for r in kinds}
    total["mean"] = sum(timer.layer_s.values()) / max(1, n_all) * 1e3
    return {
        "model": str(path),
        "mode": "prefill" if prefill else "decode",
        "threads": threads,
        "clock": clock,
        "depth": depth,
        "ubatch": ubatch,
        "n_decode": 0 if prefill else n_decode,
        "ratios": ratios,
        "step_ms": step_s * 1e3,
        "parts_ms_per_layer": table,
        "layer_ms": total,
        "load_average": list(os.getloadavg()),
    }


def format_table(r: dict) -> str:
    cols = [k for k in next(iter(r["parts_ms_per_layer"].values()))]
    prefill = r.get("mode") == "prefill"
    if prefill:
        d = max(1, r["depth"])
        head = [
            f"deepseek4 prefill by part: {Path(r['model']).name}, {r['depth']} tokens in {r['ubatch']}-token steps, "
            f"{r['threads']} thread(s), {r.get('clock', 'wall')} clock, prefill {r['step_ms'] / 1e3:.2f} s, load average {r['load_average'][0]:.2f}",
            "ms per layer for the whole prefill (and the mean in us per layer per token)",
            f"{'part':18s}" + "".join(f"{c:>10s}" for c in cols) + f"{'us/token':>10s}",
        ]
    else:
        head = [
            f"deepseek4 decode step by part: {Path(r['model']).name}, depth {r['depth']}, {r['n_decode']} steps, "
            f"{r['threads']} thread(s), {r.get('clock', 'wall')} clock, step {r['step_ms']:.1f} ms, load average {r['load_average'][0]:.2f}",
            "ms per layer per decoded token",
            f"{'part':18s}" + "".join(f"{c:>10s}" for c in cols),
        ]
    lines = head
    for part, row in list(r["parts_ms_per_layer"].items()) + [("layer total", r["layer_ms"])]:
        line = f"{part:18s}" + "".join(f"{row[c]:10.3f}" for c in cols)
        if prefill:
            line += f"{row['mean'] * 1e3 / d:10.1f}"
        lines.append(line)
    return "\n".join(lines)


def add_profile_args(ap: argparse.ArgumentParser, model_help: str) -> None:
    """The options bench.ds4_parts and bench.layer_parts share: --model, --threads, --depth,
    --decode, --prefill, --ubatch, --clock, --json."""
    ap.add_argument("--model", type=Path, required=True, help=model_help)
    ap.add_argument("--threads", type=int, default=0, help="worker threads (default: usable CPUs)")
    ap.add_argument("--depth", type=int, default=512, help="tokens prefilled before the timed steps")
    ap.add_argument("--decode", type=int, default=16, help="decode steps timed")
    ap.add_argument(
        "--prefill", action="store_true", help="time the --depth-token prefill instead of decode steps"
    )
    ap.add_argument("--ubatch", type=int, default=128, help="prefill step size in tokens (default 128)")
    ap.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="wall seconds (default), or the calling thread's CPU seconds (cpu: needs --threads 1)",
    )
    ap.add_argument("--json", type=Path, default=None, help="also write the result as JSON here")


def profile_main(prog: str, a: argparse.Namespace, profile_fn: Callable[..., dict],
                 format_fn: Callable[[dict], str]) -> int:
    """The part profilers' main after parsing :func:`add_profile_args`' options: exit 2 with
    one line for a missing --model, else ``profile_fn``'s table printed (and --json written)."""
    if not a.model.is_file():
        print(f"{prog}: {a.model} does not exist", file=sys.stderr)
        return 2
    r = profile_fn(a.model, a.threads or len(os.sched_getaffinity(0)), a.depth, a.decode, a.ubatch, a.prefill,
                   a.clock)
    print(format_fn(r))
    if a.json:
        a.json.write_text(json.dumps(r, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.ds4_parts", description=__doc__.split("\n\n")[0])
    add_profile_args(ap, "a deepseek4 GGUF file")
    return profile_main("bench.ds4_parts", ap.parse_args(argv), profile, format_table)


if __name__ == "__main__":
    sys.exit(main())
