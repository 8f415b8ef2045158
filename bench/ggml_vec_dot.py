"""One-token kernels beside ggml's own: ggml's ``vec_dot`` of a block format (the function
llama.cpp's CPU backend calls per weight row and token) against this engine's one-item matmul
(``bench.kernels.hot_ns_per_block_token``), on random valid rows of the same format and shape
(``bench.kernels.make_rows``), one thread, hot in the caches, in ns per 32 weights.

ggml's side comes from llama-cpp-python's ``libggml-cpu.so`` through ctypes:
``ggml_get_type_traits_cpu(type)`` gives ``vec_dot`` and its partner type (Q8_K for the
K-quants and i-quants, Q8_0 for the 32-element formats), whose ``from_float`` quantizes the
activation. One ``vec_dot`` call covers all ``rows x cols`` weights as one long row (a
weight row is a run of whole blocks, so the rows' blocks back to back are one row of their
summed length): the call overhead of ctypes stays out of the figure. Best of ``--calls``
calls per round, ``--rounds`` rounds per format.

Needs llama-cpp-python (the ``peer`` extra); the ISA is the one each library was built or
compiled for on this host (ours: ``MOE_SERVICE_KERNEL_ISA`` may force avx2).

    PYTHONPATH=. python -m bench.ggml_vec_dot --formats IQ1_S,IQ2_XXS,Q2_K,Q6_K
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time

import numpy as np

from bench.kernels import hot_ns_per_block_token, make_rows
from moe_service.engine import quant as q
from moe_service.formats import BY_NAME

_VEC_DOT = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                            ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_FROM_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


_PARTNER_BLOCKS = {15: (256, 292), 8: (32, 34), 9: (32, 36)}
"""GGML partner type -> (elements, bytes) of its block: Q8_K (f32 d, 256 int8, 16 int16 sums),
Q8_0 (f16 d, 32 int8), Q8_1 (f16 d, f16 s, 32 int8)."""


class _TraitsCpu(ctypes.Structure):
    """ggml-cpu.h ``struct ggml_type_traits_cpu``."""

    _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p), ("vec_dot_type", ctypes.c_int),
                ("nrows", ctypes.c_int64)]


def load_ggml_cpu() -> ctypes.CDLL:
    """llama-cpp-python's ggml CPU backend, initialized (``ggml_cpu_init``). Raises
    ImportError naming the package when it is not installed."""
    import llama_cpp  # the peer extra

    lib_dir = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
    ctypes.CDLL(os.path.join(lib_dir, "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    cpu = ctypes.CDLL(os.path.join(lib_dir, "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
    cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(_TraitsCpu)
    cpu.ggml_cpu_init()
    return cpu


def ggml_ns(cpu: ctypes.CDLL, type_id: int, arena: np.ndarray, n_weights: int, calls: int, rng) -> float:
    """ns per 32 weights of ggml's vec_dot over ``n_weights`` weights of GGML type ``type_id``
    in ``arena`` (whole blocks), best of ``calls`` calls; the activation is a random float32
    row quantized by ggml's own partner ``from_float``."""
    traits = cpu.ggml_get_type_traits_cpu(type_id).contents
    partner = cpu.ggml_get_type_traits_cpu(traits.vec_dot_type).contents
    elems, nbytes = _PARTNER_BLOCKS[traits.vec_dot_type]
    y = np.zeros(n_weights // elems * nbytes, np.uint8)
    x = rng.standard_normal(n_weights).astype(np.float32)
    _FROM_FLOAT(partner.from_float)(x.ctypes.data, y.ctypes.data, n_weights)
    dot = _VEC_DOT(traits.vec_dot)
    s = np.zeros(1, np.float32)
    best = float("inf")
    for _ in range(calls):
        t0 = time.perf_counter_ns()
        dot(n_weights, s.ctypes.data, 0, arena.ctypes.data, 0, y.ctypes.data, 0, 1)
        best = min(best, time.perf_counter_ns() - t0)
    return best / (n_weights / 32)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default="IQ1_S,IQ2_XXS,Q2_K,Q6_K", help="comma-separated block formats")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--cols", type=int, default=7168, help="a multiple of the formats' block sizes")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    try:
        cpu = load_ggml_cpu()
    except ImportError:
        print("bench.ggml_vec_dot needs llama-cpp-python (pip install -e '.[peer]')", file=sys.stderr)
        return 2
    names = [n.strip() for n in a.formats.split(",") if n.strip()]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        print(f"--formats: unknown format(s) {', '.join(unknown)}", file=sys.stderr)
        return 2
    rng = np.random.default_rng(0)
    kernels = "avx512-vnni" if q._VNNI else "avx2"  # q._VNNI honours MOE_SERVICE_KERNEL_ISA
    print(f"ns per 32 weights, {a.rows} x {a.cols} hot, one thread, best of {a.calls} calls; our kernels: {kernels}")
    print(f"{'format':8s} {'ggml':>8s} {'ours':>8s} {'ggml/ours':>10s}")
    for name in names:
        tid = BY_NAME[name].type_id
        for _ in range(a.rounds):
            arena = make_rows(tid, a.rows, a.cols, rng)
            g = ggml_ns(cpu, tid, arena, a.rows * a.cols, a.calls, rng)
            o = hot_ns_per_block_token(tid, a.rows, a.cols, 1, rng, a.calls)
            print(f"{name:8s} {g:8.3f} {o:8.3f} {g / o:9.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
