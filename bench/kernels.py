"""Block-kernel throughput against the machine's memory read bandwidth.

Reports, per weight format: GB/s of weight bytes streamed by the matmul kernels for T=1
(decode matvec), T=4 (batched decode) and T=16/64/128 (prefill ubatches), on 1 thread
(the kernel called directly) and on N threads (the WorkerPool splitting rows), with the
cost per 32 weights per token (``ns/blk-tok``: flat across T once the kernels are
compute-bound); the memory read bandwidth of this machine on 1 and N threads (a numba
reduction over 1 GiB); the round-trip cost of an empty pool dispatch; and the cold compile
time of the engine's numba code (fresh NUMBA_CACHE_DIR, in a subprocess) next to the warm
(cached) start. Decode-step scenarios time the kernels and the pool on real layer shapes
at T tokens per step; ``--model`` times whole Model.step calls on a GGUF file (single
sequence decode, 4 sequences decoded together, one 128-token prefill).

    PYTHONPATH=. python bench/kernels.py                    # everything, default formats
    PYTHONPATH=. python bench/kernels.py --formats Q8_0,Q4_K --tokens 1 --threads 1,2
    PYTHONPATH=. python bench/kernels.py --no-formats --scenario smollm2-moe --scenario-tokens 1,4
    PYTHONPATH=. python bench/kernels.py --no-formats --no-compile --model ~/.cache/moe-service/models/smollm2-135m-instruct-moe8.gguf
    PYTHONPATH=. python bench/kernels.py --json out.json    # also write the numbers
    PYTHONPATH=. python bench/kernels.py --formats IQ2_XXS,Q4_K --tokens 1,16 --threads 1 --hot-rows 256
                                                            # + compute cost, tensor hot in L2

At T=1 tensors are ~256 MiB (well past the L3 cache) of random valid blocks, rows of 2048
columns; at larger T (compute-bound) the tensor shrinks to max(32 MiB, 256 MiB * 4 / T)
so a run stays short. Speed numbers are only meaningful on an otherwise idle machine: the
report prints the load average at start and end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from numba import njit

from moe_service.engine import quant as q
from moe_service.engine.pool import Job, WorkerPool
from moe_service.engine.quant import ld
from moe_service.memory import reserve_thp_arena
from moe_service.sizes import GiB

DEFAULT_FORMATS = ("Q8_0,Q4_K,Q4_1,Q6_K,Q4_0,Q5_K,Q5_0,Q5_1,MXFP4,F16,BF16,F32,Q2_K,Q3_K,IQ4_XS,IQ4_NL,IQ2_XXS,IQ2_XS,IQ2_S,"
                   "IQ3_XXS,IQ3_S,IQ1_S,IQ1_M")
BY_NAME = {f.name: t for t, f in q.FORMATS.items()}


@njit(nogil=True, cache=True, fastmath={"reassoc", "nsz"})
def _stream_f32(a, lo, hi, passes):
    """Sum a[lo:hi] ``passes`` times. ld (no wraparound checks) plus reassociation let LLVM
    vectorise the loop into full-width vector loads with several independent accumulators,
    so the loop is bound by memory, not by one add chain."""
    s = np.float32(0.0)
    for _ in range(passes):
        for i in range(lo, hi):
            s += ld(a, i)
    return s


def memory_bandwidth_gbps(n_threads: int, gib: float = 1.0, repeats: int = 3, passes: int = 3) -> float:
    """Streaming read bandwidth of the machine, GB/s: ``n_threads`` threads, each pinned to its
    own CPU (this process's allowed CPUs in order), sum disjoint slices of a ``gib`` GiB float32
    array (THP-backed like the engine's weights, far larger than the caches) ``passes`` times
    with vector loads (:func:`_stream_f32`); they start together at a barrier and each times
    its own run. Bandwidth = bytes read by all / the slowest thread's time; best of
    ``repeats``. (The former probe, one scalar-chain integer reduction per unpinned thread
    timed with thread start-up included, read 1.07-1.25x below what our decode streams.)"""
    a = reserve_thp_arena(int(gib * GiB) // 4 * 4).view(np.float32)
    a[:] = 1.0
    _stream_f32(a, 0, 4096, 1)  # compile
    cpus = sorted(os.sched_getaffinity(0))
    n = max(1, min(n_threads, len(cpus)))
    bounds = np.linspace(0, a.size, n + 1).astype(np.int64) // 16 * 16
    best = 0.0
    for _ in range(repeats):
        barrier = threading.Barrier(n)
        times = [0.0] * n

        def work(i: int, barrier=barrier, times=times) -> None:
            try:
                os.sched_setaffinity(0, {cpus[i]})
            except OSError:
                pass
            _stream_f32(a, int(bounds[i]), int(bounds[i]) + 4096, 1)  # touch the slice's start
            barrier.wait()
            t0 = time.perf_counter()
            _stream_f32(a, int(bounds[i]), int(bounds[i + 1]), passes)
            times[i] = time.perf_counter() - t0

        ts = [threading.Thread(target=work, args=(i,)) for i in range(n)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        best = max(best, passes * int(bounds[-1]) * 4 / max(times) / 1e9)
    return best


def numpy_sum_gbps(gib: float = 1.0) -> float:
    a = np.ones(int(gib * GiB) // 8, np.float64)
    a.sum()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t0)
    return a.nbytes / best / 1e9


def make_rows(tid: int, n_rows: int, n_cols: int, rng) -> np.ndarray:
    """n_rows random valid ``tid`` rows (64 distinct rows tiled: building is cheap)."""
    rb = q.row_bytes(tid, n_cols)
    tile = q.random_blocks(rng, tid, 64, n_cols)
    arena = np.empty(n_rows * rb, np.uint8)
    for r in range(0, n_rows, 64):
        m = min(64, n_rows - r)
        arena[r * rb: (r + m) * rb] = tile[: m * rb]
    return arena


def make_tensor(tid: int, n_cols: int, mib: int, rng) -> tuple[np.ndarray, int]:
    """~mib MiB of random valid ``tid`` rows; returns (bytes, n_rows)."""
    n_rows = max(64, (mib << 20) // q.row_bytes(tid, n_cols))
    return make_rows(tid, n_rows, n_cols, rng), n_rows


def _matmul_args(tid: int, arena: np.ndarray, n_rows: int, n_cols: int, n_tok: int, rng) -> tuple:
    """quant.matmul_rows's arguments for ``n_tok`` random activation rows against the ``n_rows``
    rows of ``arena`` (one thread, no pool)."""
    rb = q.row_bytes(tid, n_cols)
    pa = q.quantize_activations(rng.standard_normal((n_tok, n_cols)).astype(np.float32), q.FORMATS[tid].partner)
    rows = np.arange(n_tok, dtype=np.int64)
    out = np.empty(n_tok * n_rows, np.float32)
    return (arena, 0, tid, n_cols, rb, 0, n_rows, pa.xf, pa.xq, pa.xd, pa.xs, pa.xbs, rows, rows, out, n_rows, 0,
            q.ensure_kernels([tid]))


def kernel_gbps(tid: int, arena: np.ndarray, n_rows: int, n_cols: int, n_tok: int, rng, repeats: int) -> float:
    """Single thread: quant.matmul_rows over the whole tensor (no pool); best of ``repeats``."""
    args = _matmul_args(tid, arena, n_rows, n_cols, n_tok, rng)
    q.matmul_rows(*args)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        q.matmul_rows(*args)
        best = min(best, time.perf_counter() - t0)
    return arena.nbytes / best / 1e9


def ns_per_block_token(gbps: float, tid: int, n_tok: int) -> float:
    """Seconds per 32 weights per token, in ns, from GB/s of weight bytes at n_tok tokens."""
    bytes_per_32 = q.FORMATS[tid].block_bytes * 32 / q.FORMATS[tid].block_elems
    return bytes_per_32 / gbps / n_tok


def hot_ns_per_block_token(tid: int, n_rows: int, n_cols: int, n_tok: int, rng, calls: int) -> float:
    """One thread, ns per 32 weights per token with the tensor hot in the caches: ``n_rows``
    random rows (keep n_rows x row bytes within L2), best of ``calls`` quant.matmul_rows calls.
    This is the kernels' compute cost, which the memory traffic and preemption of a busy host
    blur least (the best of many short calls): on a quiet host it is the T = 1 time of a
    compute-bound format (the i-quants) from memory too."""
    arena = make_rows(tid, n_rows, n_cols, rng)
    args = _matmul_args(tid, arena, n_rows, n_cols, n_tok, rng)
    q.matmul_rows(*args)
    best = float("inf")
    for _ in range(calls):
        t0 = time.perf_counter_ns()
        q.matmul_rows(*args)
        best = min(best, time.perf_counter_ns() - t0)
    return best / (n_rows * n_cols / 32) / n_tok


def pool_gbps(pool: WorkerPool, tid: int, arena: np.ndarray, n_rows: int, n_cols: int, n_tok: int, rng,
              repeats: int) -> float:
    x = rng.standard_normal((n_tok, n_cols)).astype(np.float32)
    tens = [(0, tid, n_rows, n_cols)]
    pool.matmul(arena, tens, x)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        pool.matmul(arena, tens, x)
        best = min(best, time.perf_counter() - t0)
    return arena.nbytes / best / 1e9


def dispatch_us(pool: WorkerPool, n: int = 20000) -> float:
    """Round trip of an empty job (one no-op item): publish, take part, wait."""
    job = Job.build([[[(0,)]]], np.zeros(1, np.int64))
    for _ in range(100):
        pool.run(job)
    t0 = time.perf_counter()
    for _ in range(n):
        pool.run(job)
    return (time.perf_counter() - t0) / n * 1e6


# ---------------------------------------------------------------------------------------
# Decode-step scenarios: the kernels and the pool on real layer shapes (no attention math,
# norms or sampling: those are the engine's). Weights are random valid blocks in one arena.

SCENARIOS = {
    # SmolLM2-135M cut into 8 experts of 192 (all Q4_1), tied Q8_0 output head; all 8 chosen.
    "smollm2-moe": dict(hidden=576, q_rows=576, kv_rows=192, o_cols=576, n_expert=8, width=192, top_k=8,
                        attn_type="Q4_1", expert_type="Q4_1", head_type="Q8_0", vocab=49152, layers=30),
    # Qwen3-30B-A3B shapes: 32 q heads x 128, 4 kv heads x 128, 128 experts of 768, top-8.
    "qwen3-30b-a3b": dict(hidden=2048, q_rows=4096, kv_rows=512, o_cols=4096, n_expert=128, width=768, top_k=8,
                          attn_type="Q8_0", expert_type="Q8_0", head_type="Q8_0", vocab=151936, layers=48),
    # gpt-oss-120b shapes: 64 q heads x 64, 8 kv heads x 64, 128 MXFP4 experts of 2880, top-4,
    # the clamped SwiGLU and per-expert gate/up/down biases (float32).
    "gpt-oss-120b": dict(hidden=2880, q_rows=4096, kv_rows=512, o_cols=4096, n_expert=128, width=2880, top_k=4,
                         attn_type="Q8_0", expert_type="MXFP4", head_type="Q8_0", vocab=201088, layers=36,
                         gpt_oss=True),
}


def decode_step_scenario(name: str, pool: WorkerPool, *, layers: int | None = None, expert_type: str | None = None,
                         steps: int = 20, rng=None, n_tok: int = 1) -> dict:
    """Time decode steps of ``n_tok`` tokens (one per sequence: T=1 single stream, T=4 four
    streams decoded together): per layer one q/k/v dispatch, one o dispatch, one MoE step;
    then the output head for the T tokens. Builds ``layers`` layers (default: all) and
    scales the per-layer time to the model's layer count. Returns ms per layer, head ms,
    aggregate tok/s (n_tok tokens per step) and GB/s of the weight bytes a step reads (at
    T=1: the token's routed experts; at T>1 the union is not modelled: the T=1 bytes)."""
    from moe_service.engine.moe import ACT_SWIGLU_OAI, ExpertWeights, MoE

    c = dict(SCENARIOS[name])
    if expert_type:
        c["expert_type"] = expert_type
    rng = rng or np.random.default_rng(0)
    n_layers = layers or c["layers"]
    h, w_, e_n = c["hidden"], c["width"], c["n_expert"]
    ta, te, th = (BY_NAME[c[k]] for k in ("attn_type", "expert_type", "head_type"))
    rb = {t: q.row_bytes(t, h) for t in (ta, te, th)}
    rb_down = q.row_bytes(te, w_)
    rb_o = q.row_bytes(ta, c["o_cols"])
    parts, off = [], 0

    def add(t, rows, cols):
        nonlocal off
        o = off
        parts.append(make_rows(t, rows, cols, rng))
        off += rows * q.row_bytes(t, cols)
        return o

    layer_specs = []
    for _ in range(n_layers):
        qkv = [(add(ta, c["q_rows"], h), ta, c["q_rows"], h), (add(ta, c["kv_rows"], h), ta, c["kv_rows"], h),
               (add(ta, c["kv_rows"], h), ta, c["kv_rows"], h)]
        o_t = [(add(ta, h, c["o_cols"]), ta, h, c["o_cols"])]
        g = np.array([add(te, w_, h) for _ in range(e_n)], np.int64).reshape(e_n, 1)
        u = np.array([add(te, w_, h) for _ in range(e_n)], np.int64).reshape(e_n, 1)
        d = np.array([add(te, h, w_) for _ in range(e_n)], np.int64).reshape(e_n, 1)
        z = np.zeros((e_n, 1), np.int32)
        biases, act = {}, {}
        if c.get("gpt_oss"):
            for kind, n in (("gate", w_), ("up", w_), ("down", h)):
                b = (rng.standard_normal(e_n * n).astype(np.float32) * 0.1).view(np.uint8)
                biases[kind] = off
                parts.append(b)
                off += b.size
            act = {"act": ACT_SWIGLU_OAI, "alpha": 1.702, "limit": 7.0}
        ex = ExpertWeights(e_n, h, w_, {"gate": te, "up": te, "down": te}, {"gate": (g, z), "up": (u, z), "down": (d, z)},
                           biases, **act)
        layer_specs.append((qkv, o_t, ex))
    head = [(add(th, c["vocab"], h), th, c["vocab"], h)]
    arena = np.concatenate(parts)
    parts.clear()
    moe = MoE(pool)
    x = rng.standard_normal((n_tok, h)).astype(np.float32)
    xo = rng.standard_normal((n_tok, c["o_cols"])).astype(np.float32)
    wts = np.full((n_tok, c["top_k"]), 1.0 / c["top_k"], np.float32)

    def step():
        for qkv, o_t, ex in layer_specs:
            pool.matmul(arena, qkv, x)
            pool.matmul(arena, o_t, xo)
            ids = np.stack([rng.choice(e_n, c["top_k"], replace=False) for _ in range(n_tok)]).astype(np.int32)
            moe.forward(arena, x, ids, wts, ex)

    step()
    t_layers = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        t_layers.append((time.perf_counter() - t0) / n_layers)
    pool.matmul(arena, head, x)
    t_head = []
    for _ in range(max(3, steps // 4)):
        t0 = time.perf_counter()
        pool.matmul(arena, head, x)
        t_head.append(time.perf_counter() - t0)
    per_layer = float(np.median(t_layers))
    head_s = float(np.median(t_head))
    token_s = per_layer * c["layers"] + head_s
    layer_bytes = (sum(r * rb[ta] for _, _, r, _ in layer_specs[0][0]) + h * rb_o
                   + c["top_k"] * (2 * w_ * rb[te] + h * rb_down))
    token_bytes = layer_bytes * c["layers"] + c["vocab"] * rb[th]
    return {"scenario": name, "expert_type": c["expert_type"], "n_tok": n_tok, "layers_built": n_layers,
            "layers_model": c["layers"], "ms_per_layer": per_layer * 1e3, "head_ms": head_s * 1e3,
            "tok_s": n_tok / token_s, "token_mb": token_bytes / 1e6, "gbps": token_bytes / token_s / 1e9}


def model_steps(path: str, threads: int, *, repeats: int = 5, n_prompt: int = 128, n_decode: int = 32,
                n_streams: int = 4) -> dict:
    """Whole Model.step timings on a GGUF file (CPU path, ``threads`` pool threads): decode
    tok/s of one sequence, aggregate tok/s of ``n_streams`` sequences decoded together (one
    step computes a token for each), and prefill tok/s of one ``n_prompt``-token step (the
    engine's ubatch). Medians and bests over ``repeats``; decode runs start from a 16-token
    prompt and take ``n_decode`` steps."""
    import statistics

    import torch

    from moe_service.engine.model import Model
    from moe_service.engine.ops import CpuOps
    from moe_service.gguf_model import GGUFModel
    from moe_service.weights import WeightStore

    torch.set_num_threads(1)
    catalog = GGUFModel.open(Path(path).expanduser())
    weights = WeightStore.load_simple(catalog)
    ops = CpuOps(threads=threads)
    try:
        model = Model(catalog, weights, ops, n_seq=n_streams, n_ctx=n_prompt + n_decode + 32)
        rng = np.random.default_rng(0)
        prompt = [int(t) for t in rng.integers(10, min(catalog.params.n_vocab, 30000), n_prompt)]

        def prefill() -> float:
            s = model.kv.alloc()
            t0 = time.perf_counter()
            model.step([(s, prompt)])
            dt = time.perf_counter() - t0
            model.kv.free(s)
            return n_prompt / dt

        def decode(n_seq: int, steps: int) -> float:
            slots = [model.kv.alloc() for _ in range(n_seq)]
            model.step([(s, prompt[:16]) for s in slots])
            t0 = time.perf_counter()
            for i in range(steps):
                model.step([(s, [prompt[(i + j) % n_prompt]]) for j, s in enumerate(slots)])
            dt = time.perf_counter() - t0
            for s in slots:
                model.kv.free(s)
            return n_seq * steps / dt

        prefill(), decode(1, 4), decode(n_streams, 4)  # compile / warm every shape
        runs: dict[str, list[float]] = {"decode_1": [], f"decode_{n_streams}": [], "prefill": []}
        for _ in range(repeats):
            runs["decode_1"].append(decode(1, n_decode))
            runs[f"decode_{n_streams}"].append(decode(n_streams, n_decode))
            runs["prefill"].append(prefill())
    finally:
        ops.close()
    res = {"model": str(path), "threads": threads, "n_prompt": n_prompt, "n_streams": n_streams}
    for k, v in runs.items():
        res[f"{k}_tok_s"] = float(statistics.median(v))
        res[f"{k}_best_tok_s"] = float(max(v))
    res["streams_speedup"] = res[f"decode_{n_streams}_tok_s"] / res["decode_1_tok_s"]
    return res


_COMPILE_SNIPPET = r"""
import time, numpy as np
t0 = time.perf_counter()
from moe_service.engine import quant as q, moe as M
from moe_service.engine.pool import WorkerPool
t_import = time.perf_counter() - t0
rng = np.random.default_rng(0)
with WorkerPool(pin_caller=False) as pool:
    for t in q.FORMATS:                                   # every format, both kernel shapes
        a = q.random_blocks(rng, t, 8, 256)
        for n_tok in (1, 5):
            pool.matmul(a, [(0, t, 8, 256)], rng.standard_normal((n_tok, 256)).astype(np.float32))
    parts = [q.random_blocks(rng, q.GGML_Q8_0, 256, 256) for _ in range(12)]
    arena = np.concatenate(parts)
    rb = q.row_bytes(q.GGML_Q8_0, 256) * 256
    cp = lambda k: (np.arange(4 * k, 4 * k + 4, dtype=np.int64).reshape(4, 1) * rb, np.zeros((4, 1), np.int32))
    ex = M.ExpertWeights(4, 256, 256, {"gate": 8, "up": 8, "down": 8}, {"gate": cp(0), "up": cp(1), "down": cp(2)})
    M.MoE(pool).forward(arena, rng.standard_normal((2, 256)).astype(np.float32), np.array([[0, 1], [2, 3]], np.int32),
                        np.full((2, 2), 0.5, np.float32), ex)
print(f"{t_import:.2f} {time.perf_counter() - t0:.2f}")
"""


_ASM_SNIPPET = r"""
import re, json
from moe_service.engine import quant as q
q.ensure_kernels(list(q.FORMATS))
out = {}
for t, f in q.FORMATS.items():
    asm = q._KERNEL_CFUNCS[q._KERNEL_PY[t]]._library.get_asm_str()
    ops = re.findall(r"^\s+(v[a-z0-9]+)", asm, re.M)
    out[f.name] = {k: sum(1 for o in ops if o == k) for k in
                   ("vpmaddubsw", "vpmaddwd", "vpdpbusd", "vpdpwssd", "vfmadd231ps", "vcvtph2ps", "vpinsrw")}
print(json.dumps(out))
"""


def kernel_instruction_counts() -> dict:
    """Vector instructions in each compiled format kernel (fresh cache: numba does not keep
    assembly for cached code)."""
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="numba-asm-") as d:
        env["NUMBA_CACHE_DIR"] = d
        out = subprocess.run([sys.executable, "-c", _ASM_SNIPPET], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def compile_seconds() -> dict[str, float]:
    """Cold (empty cache) and warm (cached) time to import and run every engine kernel once."""
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="numba-cold-") as d:
        env["NUMBA_CACHE_DIR"] = d
        res = {}
        for label in ("cold", "warm"):
            out = subprocess.run([sys.executable, "-c", _COMPILE_SNIPPET], env=env, capture_output=True, text=True,
                                 check=True)
            t_import, total = (float(v) for v in out.stdout.strip().splitlines()[-1].split())
            res[f"{label}_s"] = total
            res[f"{label}_import_s"] = t_import
    return res


def scaled_mib(mib: int, n_tok: int) -> int:
    """Tensor size for n_tok tokens: ``mib`` at T <= 4, then max(32, mib * 4 / T) (compute-bound)."""
    return mib if n_tok <= 4 else max(32, mib * 4 // n_tok)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default=DEFAULT_FORMATS)
    ap.add_argument("--tokens", default="1,4,16,64,128")
    ap.add_argument("--threads", default=f"1,{len(os.sched_getaffinity(0))}")
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--mib", type=int, default=256, help="tensor MiB at T <= 4 (scaled down above)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-compile", action="store_true", help="skip the cold compile measurement")
    ap.add_argument("--no-formats", action="store_true", help="skip the per-format GB/s table")
    ap.add_argument("--scenario", action="append", default=[], choices=sorted(SCENARIOS),
                    help="also time decode steps on these model shapes (repeatable)")
    ap.add_argument("--scenario-layers", type=int, default=0, help="layers to build (0: all; time scales)")
    ap.add_argument("--scenario-expert-type", default=None, help="override the scenario's expert type")
    ap.add_argument("--scenario-tokens", default="1,4", help="tokens per decode step (one per stream)")
    ap.add_argument("--model", default=None, help="also time Model.step on this GGUF (decode 1 / 4 streams, prefill)")
    ap.add_argument("--hot-rows", type=int, default=0,
                    help="also time each format on this many rows hot in L2 (1 thread, ns per 32 weights per "
                         "token, best of --hot-calls calls; 256 fits a 512 KiB L2 at 2048 columns)")
    ap.add_argument("--hot-calls", type=int, default=300, help="calls per hot measurement at T=1 (fewer above)")
    ap.add_argument("--asm", action="store_true", help="count vector instructions in each compiled kernel")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args(argv)
    formats = [BY_NAME[n.strip().upper()] for n in args.formats.split(",") if n.strip()]
    tokens = [int(v) for v in args.tokens.split(",")]
    threads = [int(v) for v in args.threads.split(",")]
    rng = np.random.default_rng(0)
    res: dict = {"load_avg_start": os.getloadavg(), "cpus": sorted(os.sched_getaffinity(0)),
                 "kernel_isa": "avx512-vnni" if q._AVX512 else "avx2"}

    print(f"load average at start: {res['load_avg_start']}; kernels: {res['kernel_isa']}")
    res["memory_gbps"] = {n: memory_bandwidth_gbps(n) for n in threads}
    res["numpy_sum_gbps"] = numpy_sum_gbps()
    for n, v in res["memory_gbps"].items():
        print(f"memory read bandwidth, {n} thread(s): {v:6.1f} GB/s")
    print(f"numpy sum over 1 GiB (1 thread):      {res['numpy_sum_gbps']:6.1f} GB/s")

    pools = {n: WorkerPool(n_threads=n, pin_caller=False) for n in threads if n > 1}
    try:
        res["dispatch_us"] = {1: dispatch_us(WorkerPool(n_threads=1, pin_caller=False))}
        for n, p in pools.items():
            res["dispatch_us"][n] = dispatch_us(p)
        for n, v in res["dispatch_us"].items():
            print(f"empty dispatch round trip, {n} worker(s): {v:6.2f} us")

        res["kernels_gbps"] = {}
        res["kernels_ns_per_block_token"] = {}
        if args.no_formats:
            formats = []
        else:
            print(f"\nGB/s of weight bytes (rows of {args.cols} columns; {args.mib} MiB tensors at T<=4, "
                  f"max(32, {args.mib}*4/T) MiB above) | ns per 32 weights per token")
            print("format " + "".join(f"{f'T={t} {n}thr':>17s}" for t in tokens for n in threads))
        for tid in formats:
            name = q.FORMATS[tid].name
            row, ns_row = {}, {}
            line = f"{name:6s} "
            cache: dict[int, tuple[np.ndarray, int]] = {}
            for t in tokens:
                mib = scaled_mib(args.mib, t)
                if mib not in cache:
                    cache.clear()
                    cache[mib] = make_tensor(tid, args.cols, mib, rng)
                arena, n_rows = cache[mib]
                reps = max(2, args.repeats if t <= 4 else args.repeats * 4 // t + 1)
                for n in threads:
                    if n == 1:
                        v = kernel_gbps(tid, arena, n_rows, args.cols, t, rng, reps)
                    else:
                        v = pool_gbps(pools[n], tid, arena, n_rows, args.cols, t, rng, reps)
                    row[f"T{t}_{n}thr"] = v
                    ns_row[f"T{t}_{n}thr"] = ns_per_block_token(v, tid, t)
                    line += f" {v:8.2f}|{ns_row[f'T{t}_{n}thr']:6.3f}"
            cache.clear()
            res["kernels_gbps"][name] = row
            res["kernels_ns_per_block_token"][name] = ns_row
            print(line, flush=True)
        if args.hot_rows and formats:
            res["kernels_hot_ns_per_block_token"] = {}
            print(f"\nns per 32 weights per token, {args.hot_rows} rows of {args.cols} columns hot in L2, 1 thread, "
                  f"best of {args.hot_calls} calls (fewer above T=1)")
            print("format " + "".join(f"{f'T={t}':>9s}" for t in tokens))
            for tid in formats:
                name = q.FORMATS[tid].name
                hot = {f"T{t}": hot_ns_per_block_token(tid, args.hot_rows, args.cols, t, rng,
                                                       max(10, args.hot_calls // t * 4) if t > 4 else args.hot_calls)
                       for t in tokens}
                res["kernels_hot_ns_per_block_token"][name] = hot
                print(f"{name:6s} " + "".join(f"{v:9.3f}" for v in hot.values()), flush=True)
        res["scenarios"] = []
        for sc_name in args.scenario:
            for n in threads:
                pool = pools[n] if n > 1 else WorkerPool(n_threads=1, pin_caller=False)
                for n_tok in (int(v) for v in args.scenario_tokens.split(",")):
                    r = decode_step_scenario(sc_name, pool, layers=args.scenario_layers or None,
                                             expert_type=args.scenario_expert_type, rng=rng, n_tok=n_tok)
                    r["threads"] = n
                    res["scenarios"].append(r)
                    print(f"\n{sc_name} ({r['expert_type']} experts), {n} thread(s), T={n_tok}: "
                          f"{r['ms_per_layer']:.3f} ms/layer, head {r['head_ms']:.2f} ms -> {r['tok_s']:.1f} tok/s "
                          f"(kernels only; {r['token_mb']:.0f} MB per T=1 token)", flush=True)
    finally:
        for p in pools.values():
            p.close()
    if args.model:
        res["model_steps"] = []
        for n in threads:
            r = model_steps(args.model, n, repeats=args.repeats)
            res["model_steps"].append(r)
            streams_tok_s = r[f"decode_{r['n_streams']}_tok_s"]
            print(f"\nModel.step on {Path(args.model).name}, {n} thread(s): decode 1 stream "
                  f"{r['decode_1_tok_s']:.1f} tok/s (best {r['decode_1_best_tok_s']:.1f}); "
                  f"{r['n_streams']} streams {streams_tok_s:.1f} tok/s aggregate "
                  f"(x{r['streams_speedup']:.2f}); prefill {r['n_prompt']} tokens {r['prefill_tok_s']:.1f} tok/s "
                  f"(best {r['prefill_best_tok_s']:.1f})", flush=True)
    if not args.no_compile:
        res["compile"] = compile_seconds()
        c = res["compile"]
        print(f"\nengine numba code, import + first run of every kernel: cold {c['cold_s']:.1f} s "
              f"(import {c['cold_import_s']:.1f} s), warm from cache {c['warm_s']:.1f} s")
    if args.asm:
        res["asm"] = kernel_instruction_counts()
        print("\nvector instructions per compiled format kernel:")
        for name, c in res["asm"].items():
            print(f"  {name:6s} " + " ".join(f"{k}={v}" for k, v in c.items()))
    res["load_avg_end"] = os.getloadavg()
    print(f"load average at end: {res['load_avg_end']}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
