"""Per-operation comparison with llama.cpp: the first intermediate whose value differs from ours
beyond rounding, for one GGUF file, prompt and position.

llama.cpp side: llama-cpp-python's low-level API (llama_cpp.llama_cpp) with the context's
``cb_eval`` callback (ggml_backend_sched_eval_callback, as llama.cpp's examples/eval-callback
uses it): the scheduler asks ``cb(t, ask=True)`` for every graph node and, for the nodes we
want (those named by the model graph's ``cb(cur, name, il)``: "name-il", or "name" outside the
layers; llama-context.cpp graph_get_cb), computes up to that node and calls
``cb(t, ask=False)``; the tensor is then read on the host (CPU backend: ``t->data`` is host
memory) through its ne / nb strides (ggml.h struct ggml_tensor) into a numpy array in C order
of the reversed ne, i.e. [T, ...] for the usual [..., T] ggml layout. The prompt is evaluated as
one batch (n_batch = n_ubatch >= its length), so every intermediate holds all its positions.

Our side: an architecture adapter (:data:`ADAPTERS`) that recomputes the same intermediates
under the same names. deepseek4: tests/support/ds4_reference.py's hook (the whole-sequence
numpy forward the engine is tested against). With ``--force`` the adapter continues from
llama.cpp's values at each sub-block boundary (layer input, attn_norm, ffn_norm, the indexer's
top-k), so each row's difference is the local error of the ops since the last boundary, not
the accumulated one. Discrete outputs (the indexer's top-k, the routed experts) are compared
as sets per position, and a disagreement is shown with the two scores' gap (a near tie is
rounding, a wide gap is a semantic difference).

Usage::

    python tools/compare_ops.py FILE.gguf --prompt-ids 0,1,2,... | --prompt TEXT
        [--position P] [--force] [--tol 0.03] [--show all|diff] [--kv f32] [--threads 2]

Prints one row per compared intermediate in llama.cpp's graph order: name, layer, shape, the
difference relative to llama.cpp's values (max |ours - theirs| / max |theirs| over the
compared positions, and the same in RMS), and marks the first row whose RMS relative
difference exceeds ``--tol``. ``--position`` restricts the comparison to one position (default:
all positions). Exit status 0 always (it is a diagnostic); 2 for bad arguments.

llama-cpp-python 0.3.36 is needed (never by the tests).
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_MAX_DIMS, _MAX_SRC, _MAX_OP_PARAMS, _MAX_NAME = 4, 10, 64, 64


class GgmlTensor(ctypes.Structure):
    """struct ggml_tensor of ggml.h (llama-cpp-python 0.3.36's vendored ggml)."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * _MAX_DIMS),
        ("nb", ctypes.c_size_t * _MAX_DIMS),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * (_MAX_OP_PARAMS // 4)),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * _MAX_SRC),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * _MAX_NAME),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


_GGML_DTYPES = {0: np.float32, 1: np.float16, 26: np.int32, 27: np.int64, 28: np.float64}
"""ggml_type -> numpy dtype for the types an intermediate can have (F32, F16, I32, I64, F64)."""


@dataclass
class Capture:
    """One named intermediate of llama.cpp's graph: ``name`` without the layer suffix, ``il``
    (-1 outside the layers), ``occurrence`` (0 for the first node of that name and layer),
    ``ne`` (ggml order), ``value`` (numpy, reversed ne, trailing size-1 axes dropped)."""

    name: str
    il: int
    occurrence: int
    ne: tuple[int, ...]
    value: np.ndarray


def _split_name(full: str) -> tuple[str, int] | None:
    """"q-3" -> ("q", 3); "result_norm" -> ("result_norm", -1); None for unnamed / view nodes."""
    if not full or " " in full or full.startswith(("node_", "leaf_")):
        return None
    base, sep, tail = full.rpartition("-")
    if sep and tail.isdigit():
        return base, int(tail)
    return full, -1


def _read_tensor(t: GgmlTensor) -> np.ndarray | None:
    dt = _GGML_DTYPES.get(t.type)
    if dt is None or not t.data:
        return None
    ne = [int(t.ne[i]) for i in range(_MAX_DIMS)]
    nb = [int(t.nb[i]) for i in range(_MAX_DIMS)]
    span = sum((n - 1) * s for n, s in zip(ne, nb, strict=True)) + np.dtype(dt).itemsize
    buf = (ctypes.c_char * span).from_address(t.data)
    arr = np.ndarray(shape=tuple(reversed(ne)), dtype=dt, buffer=buf, offset=0, strides=tuple(reversed(nb)))
    out = np.array(arr, dtype=np.float32 if dt in (np.float16, np.float64) else dt)
    while out.ndim > 1 and out.shape[0] == 1:
        out = out[0]
    return out


def capture_llama(path: Path, tokens: list[int], *, n_threads: int = 2, kv_type: str = "f16",
                  flash_attn: bool | None = False, want: Callable[[str, int], bool] | None = None,
                  ) -> tuple[list[Capture], np.ndarray]:
    """Evaluate ``tokens`` with llama.cpp as one batch and return its named intermediates (graph
    order) and the logits of every position [T, V]. ``want(name, il)`` filters what is copied
    (default: every named node). ``kv_type`` "f16" (llama.cpp's default) or "f32";
    ``flash_attn`` False as llama-cpp-python's Llama (True: on; None: llama.cpp's automatic choice)."""
    import llama_cpp
    import llama_cpp.llama_cpp as ll

    caps: list[Capture] = []
    seen: dict[tuple[str, int], int] = {}

    def cb(tp, ask, _user):
        t = GgmlTensor.from_address(tp)
        parsed = _split_name(t.name.decode(errors="replace"))
        if parsed is None or (want is not None and not want(*parsed)):
            return False if ask else True
        if ask:
            return True
        v = _read_tensor(t)
        if v is not None:
            k = parsed
            occ = seen.get(k, 0)
            seen[k] = occ + 1
            caps.append(Capture(parsed[0], parsed[1], occ, tuple(int(x) for x in t.ne), v))
        return True

    cb_c = ll.ggml_backend_sched_eval_callback(cb)
    quiet = ll.llama_log_callback(lambda level, text, user: None)
    ll.llama_log_set(quiet, None)
    ll.llama_backend_init()
    mp = ll.llama_model_default_params()
    mp.use_mmap = False
    model = ll.llama_model_load_from_file(str(path).encode(), mp)
    if not model:
        raise SystemExit(f"{path}: llama.cpp could not load the file")
    n = len(tokens)
    cp = ll.llama_context_default_params()
    cp.n_ctx = max(256, n + 16)
    cp.n_batch = cp.n_ubatch = n
    cp.n_threads = cp.n_threads_batch = n_threads
    cp.cb_eval = cb_c
    cp.cb_eval_user_data = None
    if kv_type == "f32":
        cp.type_k = cp.type_v = 0
    if flash_attn is not None:
        cp.flash_attn_type = 1 if flash_attn else 0
    ctx = ll.llama_init_from_model(model, cp)
    if not ctx:
        raise SystemExit(f"{path}: llama.cpp could not make a context")
    batch = ll.llama_batch_init(n, 0, 1)
    for i, tok in enumerate(tokens):
        batch.token[i] = tok
        batch.pos[i] = i
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = 0
        batch.logits[i] = True
    batch.n_tokens = n
    rc = ll.llama_decode(ctx, batch)
    if rc != 0:
        raise SystemExit(f"llama_decode returned {rc}")
    n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))
    logits = np.ctypeslib.as_array(ll.llama_get_logits(ctx), shape=(n * n_vocab,)).reshape(n, n_vocab).copy()
    ll.llama_batch_free(batch)
    ll.llama_free(ctx)
    ll.llama_model_free(model)
    del cb_c, quiet, llama_cpp
    return caps, logits


def engine_logits(path: Path, tokens: list[int], chunk: int = 256) -> np.ndarray:
    """Our engine's logits [V] after ``tokens`` (CPU path, quantized dense matmuls, the prompt in
    chunks of ``chunk`` tokens), any architecture."""
    from moe_service.engine.model import Model
    from moe_service.engine.ops import CpuOps
    from moe_service.gguf_model import GGUFModel
    from moe_service.weights import WeightStore

    cat = GGUFModel.open(path)
    ops = CpuOps(threads=0)
    try:
        model = Model(cat, WeightStore.load_simple(cat), ops, n_seq=1, n_ctx=max(256, len(tokens) + 16), dense="quant")
        s = model.kv.alloc()
        for lo in range(0, len(tokens), chunk):
            out = model.step([(s, tokens[lo:lo + chunk])])
        return out[0].numpy()
    finally:
        ops.close()


def tokenize(path: Path, text: str) -> list[int]:
    """llama.cpp's tokens of ``text`` (BOS added as the file says)."""
    import llama_cpp

    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    ids = llm.tokenize(text.encode(), add_bos=True, special=False)
    del llm
    return [int(i) for i in ids]


# -- comparison ------------------------------------------------------------------------------


@dataclass
class Row:
    name: str
    il: int
    occurrence: int
    shape: tuple[int, ...]
    rel_max: float
    rel_rms: float
    note: str = ""


def _rel(ours: np.ndarray, theirs: np.ndarray) -> tuple[float, float]:
    a = np.asarray(ours, dtype=np.float64)
    b = np.asarray(theirs, dtype=np.float64)
    fin = np.isfinite(b) & np.isfinite(a)
    if (np.isfinite(a) != np.isfinite(b)).any():
        return float("inf"), float("inf")
    if not fin.any():
        return 0.0, 0.0
    d = np.abs(a[fin] - b[fin])
    scale_max = max(float(np.abs(b[fin]).max()), 1e-30)
    scale_rms = max(float(np.sqrt((b[fin] ** 2).mean())), 1e-30)
    return float(d.max()) / scale_max, float(np.sqrt((d ** 2).mean())) / scale_rms


def compare(caps: list[Capture], ours: dict[tuple[str, int, int], np.ndarray],
            convert: Callable[[Capture, np.ndarray], tuple[np.ndarray, np.ndarray, str] | None],
            position: int | None) -> list[Row]:
    """Rows for each capture that ``ours`` has under (name, il, occurrence); ``convert(cap,
    ours_value)`` brings both to one comparable form (or None to skip): (ours, theirs, note) or
    (ours, theirs, note, metric), metric replacing the relative difference (a selection's: see
    Deepseek4Adapter._topk_note)."""
    rows = []
    for c in caps:
        v = ours.get((c.name, c.il, c.occurrence))
        if v is None:
            continue
        conv = convert(c, v)
        if conv is None:
            continue
        a, b, note = conv[:3]
        metric = conv[3] if len(conv) > 3 else None
        if position is not None and a.ndim >= 1 and a.shape[0] > position and c.name not in _NOT_PER_TOKEN:
            a, b = a[position:position + 1], b[position:position + 1]
        if a.shape != b.shape:
            rows.append(Row(c.name, c.il, c.occurrence, c.ne, float("nan"), float("nan"),
                            f"shape ours {a.shape} vs llama.cpp {b.shape}"))
            continue
        if a.dtype == bool:
            bad = (a != b).any(axis=tuple(range(1, a.ndim)))
            m = float(bad.mean()) if metric is None else metric
            rows.append(Row(c.name, c.il, c.occurrence, c.ne, m, m,
                            note or f"{int(bad.sum())} of {len(bad)} positions select differently"))
            continue
        rm, rr = _rel(a, b)
        rows.append(Row(c.name, c.il, c.occurrence, c.ne, rm, rr, note))
    return rows


_NOT_PER_TOKEN = {"csa_state_compress", "hca_state_compress", "lid_state_compress"}


def _keep_last(caps: list[Capture], names: set[str]) -> list[Capture]:
    """For ``names`` (one name given to several nodes of a step, the last being the result),
    only the last capture per layer, as occurrence 0."""
    last: dict[tuple[str, int], Capture] = {}
    for c in caps:
        if c.name in names:
            last[(c.name, c.il)] = c
    out = []
    for c in caps:
        if c.name not in names:
            out.append(c)
        elif last[(c.name, c.il)] is c:
            c.occurrence = 0
            out.append(c)
    return out


# -- the deepseek4 adapter ---------------------------------------------------------------------


class Deepseek4Adapter:
    """Ours for deepseek4: tests/support/ds4_reference.py with its hook (names as llama.cpp's
    src/models/deepseek4.cpp). Forcing points (``force``): the layer input (hc_init, l_last),
    hc_attn_post, attn_norm, ffn_norm and the indexer's selection (lid_top_k)."""

    FORCE = {"hc_init", "l_last", "hc_attn_post", "attn_norm", "ffn_norm", "lid_top_k"}
    LAST = {"csa_state_compress", "hca_state_compress", "lid_state_compress"}
    """Compressor steps all named alike (kv / score gathers, softmax sum, norm, rope): the
    last is the roped rows."""

    def __init__(self, path: Path):
        self.path = path

    def want(self, name: str, il: int) -> bool:
        return name in {"hc_init", "hc_post", "hc_comb", "hc_attn_pre", "attn_norm", "qr_norm", "q_norm", "q",
                        "kv_norm", "kv", "csa_state_kv", "csa_state_score_ape", "hca_state_kv",
                        "hca_state_score_ape", "csa_state_compress", "hca_state_compress", "lid_state_compress",
                        "lid_q_rope", "lid_weights", "lid_score_masked", "lid_top_k", "attn_csa_lid", "attn_hca",
                        "attn_raw", "attn_derope", "attn_out", "hc_attn_post", "hc_ffn_pre", "ffn_norm",
                        "ffn_moe_probs", "ffn_moe_topk", "ffn_moe_out", "ffn_shexp", "ffn_out", "l_last",
                        "hc_head", "result_norm", "result_output"}

    # llama.cpp name -> our hook name where they differ
    _THEIRS_TO_OURS = {"csa_state_compress": "csa_comp", "hca_state_compress": "hca_comp",
                       "lid_state_compress": "lid_comp", "lid_score_masked": "lid_score"}

    def run(self, tokens: list[int], caps: list[Capture], force: bool) -> dict[tuple[str, int, int], np.ndarray]:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests.support.ds4_reference import Ds4Reference

        theirs: dict[tuple[str, int], list[Capture]] = {}
        for c in caps:
            theirs.setdefault((self._THEIRS_TO_OURS.get(c.name, c.name), c.il), []).append(c)
        got: dict[tuple[str, int, int], np.ndarray] = {}
        counts: dict[tuple[str, int], int] = {}
        ref_box: list = []

        def hook(name, il, value):
            occ = counts.get((name, il), 0)
            counts[(name, il)] = occ + 1
            their_name = next((k for k, v in self._THEIRS_TO_OURS.items() if v == name), name)
            got[(their_name, il, occ)] = np.array(value, copy=True)
            if not force or name not in self.FORCE:
                return value
            cl = theirs.get((name, il))
            if not cl:
                return value
            c = cl[min(occ, len(cl) - 1)]
            if name == "lid_top_k":
                return _topk_to_bool(c.value, value.shape)
            return c.value.reshape(np.shape(value)).astype(np.float32)

        ref = Ds4Reference(self.path, n_ctx=max(2048, len(tokens) + 8), hook=hook)
        ref_box.append(ref)
        ref.forward(tokens)
        self.ref = ref
        return got

    def convert(self, c: Capture, ours: np.ndarray):
        """(ours, theirs, note) in one layout, or None."""
        t = c.value
        if c.name in ("csa_state_compress", "hca_state_compress", "lid_state_compress"):
            # the last node of that name is the roped rows of the blocks completed in this batch
            # (plus padding blocks): [n_written, D]; ours [nb, D] of the whole sequence
            t2 = t.reshape(-1, ours.shape[-1]) if t.size % ours.shape[-1] == 0 else None
            if t2 is None or t2.shape[0] < ours.shape[0]:
                return None
            return ours, t2[:ours.shape[0]], ""
        if c.name == "lid_score_masked":
            th = t.reshape(ours.shape[0], -1)[:, :ours.shape[1]]
            th = np.where(np.isfinite(ours), th, -np.inf)
            return ours, th, ""
        if c.name == "lid_top_k":
            sel = _topk_to_bool(t, ours.shape) & np.isfinite(self._lid_scores(c.il, ours.shape))
            return (ours, sel, *self._topk_note(c.il, ours, sel))
        if c.name == "ffn_moe_topk":
            k = ours.shape[1]
            th = np.sort(t.reshape(ours.shape[0], -1)[:, :k], axis=1)
            return np.sort(ours, axis=1) != th, np.zeros(th.shape, bool), ""
        if ours.size != t.size:
            if c.occurrence > 0:
                return None
            return ours, t, ""
        return np.asarray(ours, np.float32).reshape(t.shape), t, ""

    def _lid_scores(self, il, shape):
        s = self._scores.get(il) if hasattr(self, "_scores") else None
        return s if s is not None else np.zeros(shape)

    def _topk_note(self, il, ours, theirs) -> tuple[str, float]:
        """(note, metric) for the indexer's selection: at each position where the sets differ,
        our score gap between the rows only we chose and the rows only llama.cpp chose, relative
        to the spread of that position's visible scores; the metric is the largest (a near tie,
        far below the scores' own relative difference, is rounding; 0 when all agree)."""
        s = self._scores.get(il) if hasattr(self, "_scores") else None
        bad = np.flatnonzero((ours != theirs).any(axis=1))
        if s is None or not len(bad):
            return "", 0.0
        worst, where = 0.0, ""
        for t in bad:
            a = np.flatnonzero(ours[t] & ~theirs[t])
            b = np.flatnonzero(theirs[t] & ~ours[t])
            fin = s[t][np.isfinite(s[t])]
            spread = float(fin.max() - fin.min()) if len(fin) else 0.0
            if not (len(a) and len(b)):
                return f"position {t}: the sets differ in size", float("inf")
            gap = float(s[t, a].min() - s[t, b].max())
            rel = abs(gap) / max(spread, 1e-30)
            if rel >= worst:
                worst = rel
                where = (f"worst at {t}: ours picks {a.tolist()}, llama.cpp {b.tolist()}, our score gap {gap:.3g} "
                         f"of a spread {spread:.3g}")
        return f"{len(bad)} of {len(ours)} positions differ (near ties: gap / spread <= {worst:.2e}); {where}", worst


def _topk_to_bool(top: np.ndarray, shape) -> np.ndarray:
    T, nb = shape
    top = np.asarray(top).reshape(T, -1)
    sel = np.zeros((T, nb), bool)
    for t in range(T):
        idx = top[t][(top[t] >= 0) & (top[t] < nb)]
        sel[t, idx] = True
    return sel


ADAPTERS = {"deepseek4": Deepseek4Adapter}
"""general.architecture -> adapter class (``want``, ``run``, ``convert``)."""


def _arch_of(path: Path) -> str:
    from gguf import GGUFReader

    f = GGUFReader(str(path)).fields.get("general.architecture")
    if f is None:
        raise SystemExit(f"{path}: no general.architecture key")
    return str(f.contents())


def run(path: Path, tokens: list[int], *, position: int | None, force: bool, tol: float, kv_type: str,
        n_threads: int, show: str, out=sys.stdout) -> tuple[list[Row], np.ndarray, np.ndarray]:
    arch = _arch_of(path)
    if arch not in ADAPTERS:
        raise SystemExit(f"{path}: no comparison adapter for architecture {arch!r} (have {', '.join(ADAPTERS)})")
    ad = ADAPTERS[arch](path)
    caps, logits = capture_llama(path, tokens, n_threads=n_threads, kv_type=kv_type, want=ad.want)
    caps = _keep_last(caps, getattr(ad, "LAST", set()))
    got = ad.run(tokens, caps, force)
    ad._scores = {il: v for (n, il, _o), v in got.items() if n == "lid_score_masked"}
    rows = compare(caps, got, ad.convert, position)
    first = next((r for r in rows if not (r.rel_rms <= tol)), None)
    print(f"{path.name}: {len(tokens)} tokens, {len(caps)} llama.cpp intermediates, {len(rows)} compared, "
          f"{'forced at sub-block boundaries' if force else 'free-running'}, tol (RMS relative) {tol}", file=out)
    print(f"{'name':24} {'il':>3} {'#':>2} {'ne':>22} {'rel max':>9} {'rel rms':>9}", file=out)
    for r in rows:
        flag = "  <== first beyond tol" if r is first else ("  *" if not (r.rel_rms <= tol) else "")
        if show == "diff" and not flag:
            continue
        print(f"{r.name:24} {r.il:>3} {r.occurrence:>2} {str(r.shape):>22} {r.rel_max:9.2e} {r.rel_rms:9.2e}{flag}"
              + (f"  {r.note}" if r.note else ""), file=out)
    ours_logits = got.get(("result_output", -1, 0))
    return rows, logits, ours_logits


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python tools/compare_ops.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("file", type=Path)
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt-ids", help="comma-separated token ids")
    g.add_argument("--prompt", help="text, tokenized by llama.cpp")
    ap.add_argument("--position", type=int, default=None, help="compare this position only (default: all)")
    ap.add_argument("--force", action="store_true", help="continue from llama.cpp's values at sub-block boundaries")
    ap.add_argument("--tol", type=float, default=0.03, help="RMS relative difference called beyond rounding")
    ap.add_argument("--kv", choices=("f16", "f32"), default="f16", help="llama.cpp's KV cache type")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--show", choices=("all", "diff"), default="all")
    ap.add_argument("--engine", action="store_true",
                    help="also run our engine (moe_service.engine) and compare its last-position logits")
    a = ap.parse_args(argv)
    if not a.file.is_file():
        ap.error(f"{a.file}: no such file")
    try:
        tokens = [int(x) for x in a.prompt_ids.split(",")] if a.prompt_ids else tokenize(a.file, a.prompt)
    except ValueError:
        ap.error(f"--prompt-ids {a.prompt_ids!r}: expected comma-separated integers")
    rows, theirs, ours = run(a.file, tokens, position=a.position, force=a.force, tol=a.tol, kv_type=a.kv,
                             n_threads=a.threads, show=a.show)
    p = len(tokens) - 1 if a.position is None else a.position
    if ours is not None:
        lt = theirs[p] - np.logaddexp.reduce(theirs[p])
        lo = ours[p] - np.logaddexp.reduce(ours[p])
        top = np.argsort(-lt)[:5]
        print(f"position {p}: llama.cpp top-5 {top.tolist()} log-probs {np.round(lt[top], 3).tolist()}; ours "
              f"{np.round(lo[top], 3).tolist()}; our top-5 {np.argsort(-lo)[:5].tolist()}")
    if a.engine:
        if a.position is not None and a.position != len(tokens) - 1:
            tokens = tokens[:a.position + 1]
        eng = engine_logits(a.file, tokens)
        p = len(tokens) - 1
        print(f"engine at position {p}: max |engine - llama.cpp| {np.abs(eng - theirs[p]).max():.4f}"
              + (f", max |engine - reference| {np.abs(eng - ours[p]).max():.4f} (reference "
                 f"{'forced' if a.force else 'free-running'})" if ours is not None else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
