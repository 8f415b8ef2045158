"""Attention over the KV cache on the CPU: the one interface every architecture calls.

This package is the contract between the per-architecture blocks (they compute q, k, v and
call :func:`store` then :func:`attend` once per layer with every sequence of the step) and
the attention kernels (how the work is split over cores, tiled and vectorised). Its
callers never see the cache's element format or the work split.

Shapes: T tokens of this step (all sequences together), S sequence slots, C cache length,
NH query heads, NKV KV heads, D key dim, Dv value dim, G = NH / NKV query heads per KV head.

``spans``: a list of (seq, a, e, n0): the step's tokens a..e-1 belong to sequence slot
``seq`` and sit at positions n0..n0+(e-a)-1 of its cache.

Caches (one pair per layer, as the KV cache holds them, see moe_service.engine.kv):

- float16 (``kv_type = f16``): ``kc`` uint16 [S, C, NKV, D] and ``vc`` uint16 [S, C, NKV, Dv],
  float16 values held as their bits (numba has no float16 type);
- q8_0 (``kv_type = q8_0``, llama.cpp's ``-ctk/-ctv q8_0``): ``kc`` uint8 [S, C, NKV, D/32*34],
  each head row D/32 ggml Q8_0 blocks (float16 scale d, 32 int8 q; value = d * q);
  ``vc`` likewise with Dv.

A latent (MLA) cache passes ``vc is kc``: V is then the first Dv dims of each K row, and
:func:`store` writes K only.

How the work runs (:func:`attend`): tasks of (sequence, KV head, query tile[, part]) on the
engine's persistent worker pool (pool.K_CALL items calling the package's compiled item
function, ``tasks._item``, through its address: the pool's compiled code does not inline it).
A task gathers its tile's query rows of the heads of one KV head's group (R = tokens x
heads), rounds them to float16, and walks the cache in key tiles of ``BK`` rows (a tile
serves all R query rows). Default mode: K.Q as vector dot products in ggml's lane order and
P.V as fused multiply-adds (each value row loaded once for up to four heads, whose
accumulators stay in registers: :func:`_pv_heads16`). A decode reads a float16 cache in
place (each key once for two to four heads of the group: :func:`_dot64_heads_keys8`),
prefetching the rows ``_KV_PREFETCH_KEYS`` keys ahead. A
prefill widens each key and value tile once into a contiguous float32 tile that all the
task's rows read, and scores 16 keys x two to four heads of a token per call, up to six
for a latent cache's 576 dims (:func:`_dot16_heads_keys`; its P.V then takes six heads per
value row). A Q8_0 cache is always widened to a float32 tile. These
kernels hold 16 float32 lanes per vector where the 512-bit kernels run (``_SCORE_LANES``),
else 8; each lane's sum is the same either way. Online mode
widens K and V tiles (float32, about one L1d) once each. Small steps run on the calling
thread (no dispatch). When a step has fewer than 2 x workers tasks (decode:
one query row per sequence), a task with at least 2 x MIN_SPLIT_KEYS keys is split by key
range. Default mode, four phases: K parts write their rows' scores into one buffer per task,
one item per task normalises each row over all its keys (the contract below, unchanged),
V parts accumulate P.V over their keys, and one item per task sums the parts in key order.
Online mode: parts keep (m, l, acc) and a merge phase combines them (flash-decoding).

Numerics, default (``online=False``; ggml's CPU non-flash path, which llama.cpp takes on
these files; the former single-threaded kernel, kept as cpu_layers.attention, states it in
scalar code): Q rounded to float16, K.Q in float32 in ggml's summation order (below),
scores = K.Q * scale, masked (causal, and the sliding window when ``window`` > 0), softmax
with the maximum taken over the scores (and the head's sink logit when ``sinks`` is given),
exponentials (Cephes' expf polynomial, ~1 ulp) summed in float64 (four partial sums, the
row's k-th key into sum k % 4, added as (s0 + s1) + (s2 + s3), then the last keys in order;
twice as fast as one chain, and float32(1 / sum) is the same as after a key-order sum unless
the two float64 sums straddle a float32 rounding boundary), scaled by
float32(1/sum), probabilities rounded to float16, then P.V in float32 in key order (fused
multiply-adds change nothing there: the product of two float16 values is exact in float32).
A task keeps its rows' scores (at most SCORE_BUDGET floats; long prefills get shorter query
tiles) between the pass over K and the pass over V.

K.Q summation order: as ggml on AVX-512, which llama.cpp's KQ matrix product takes: a step
of one token (decode; llama.cpp's mul_mat with n = 1 calls ggml_vec_dot_f16) sums element i
into lane i % 64 (four 16-lane accumulators), folds the lanes in halves (64 -> 32 -> ... -> 1)
and adds the dims past the last multiple of 64 in float64; a step of several tokens (prefill;
llamafile's tinyBLAS, used by ggml for n >= 2 when D % 16 == 0) sums into lane i % 16 and
folds those. Written in LLVM vector IR (:func:`_lane_dot`), so the dot products run in
vector lanes and still round exactly as ggml's do (the former strict key order could not
be vectorised; LLVM's own reassociation lost a decisive greedy step of the gpt-oss l3
golden). Against the scalar kernel: a score differs in its last bits now and then, which
moves a probability across a float16 rounding boundary (tests/moe_service/engine/test_attention.py
bounds it), plus, for a split decode, the order of the float32 additions of the parts' P.V,
plus the four float64 partial sums of the exponentials.
The goldens are unchanged and pass.

Online mode (``online=True``; flash attention, as ggml's CPU flash-attention path): one pass,
per row a running maximum m (float32), a running float64 sum l of exp(score - m) and a
float32 accumulator of exp(score - m) * V, both rescaled by exp(m_old - m_new) when a key
tile raises m; the sink joins m and l at the end; out = acc * float32(1 / l); probabilities
are not rounded to float16. Kept as an option, not the default: on the goldens it moved
tiny-llama-mxfp4 (a routing near-tie) to 4.24 against its bound of 4.0. It was ~20% faster
per (query row, key) on one thread (demo shapes, depth 4096: 11.5 vs 14.1 ns, loaded
machine), and its key-range split keeps every worker busy for one latent KV head.

Sliding window (llama.cpp ``LLAMA_SWA_TYPE_STANDARD``): a query at position p sees keys
at positions j with p - window < j <= p. Sinks (gpt-oss ``attn_sinks``): one logit per
query head that joins the softmax's denominator and contributes no value.

Modules (one concern each; each imports only modules listed above it, never this package's
``__init__``):

- ``layout``: what they all share: the op array's offsets (``O_*``), the task and group table
  rows (``TASK_W``, ``META_W``), the cache formats (``FMT_*``), the compile options
  (``_JIT*``), the vector width ``_SCORE_LANES`` and ``_KV_PREFETCH_KEYS``;
- ``cache_rows``: :func:`store` (the step's keys and values into the cache, Q8_0 rows as
  ggml's quantize_row_q8_0) and ``_load_rows`` (stored rows widened to float32);
- ``intrinsics``: the vector dot products in LLVM IR (ggml's lane orders, below) and their
  codegen helpers;
- ``scores``: K.Q of a task's query rows (one row, or several rows per key read);
- ``softmax``: the mask (causal, window), the exponentials and their sum, the float16
  probabilities, the sinks;
- ``values``: P.V;
- ``tasks``: the task kernels (default mode, the split decode's four phases, online mode)
  and ``_item``, the one function the worker pool calls for them;
- ``planner``: one call's tasks, key-range parts and pool items;
- ``api``: :func:`attend`, re-exported here with :func:`store` and the planner's settings.
"""

from __future__ import annotations

from moe_service.engine.attention.api import attend, key_tile
from moe_service.engine.attention.cache_rows import cache_format, cache_head_dim, quantize_row_q8_0, store
from moe_service.engine.attention.planner import (
    MIN_SPLIT_KEYS,
    QUERY_ROWS,
    SCORE_BUDGET,
    SERIAL_WORK,
    plan_tasks,
)
from moe_service.engine.attention.tasks import item_address

__all__ = [
    "MIN_SPLIT_KEYS",
    "QUERY_ROWS",
    "SCORE_BUDGET",
    "SERIAL_WORK",
    "attend",
    "cache_format",
    "cache_head_dim",
    "item_address",
    "key_tile",
    "plan_tasks",
    "quantize_row_q8_0",
    "store",
]
