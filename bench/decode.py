"""`moe-service bench decode`: our decode and prefill tok/s beside llama.cpp's, plus the roofline.

In one run, on the same GGUF file and thread count:

- ours: decode tok/s (single-token steps after a short prompt, greedy, fed back) and prefill
  tok/s (one prompt of --prompt tokens in ubatch-sized steps), medians of --repeats runs;
- llama.cpp (llama-cpp-python, use_mmap=False, n_threads = n_threads_batch = --threads):
  the same measurements (bench/peer.py), said clearly when it is not installed;
- the roofline: bytes read per decoded token (dense matrices, the output head, and K of E
  experts' slabs per MoE layer: the routed share of the file) / measured memory read
  bandwidth (bench.kernels.memory_bandwidth_gbps: pinned threads streaming a 1 GiB THP array
  with vector loads, the slowest thread's time, best of 3), and the fraction of it our
  decode reaches (``bandwidth_fraction``); the MoE step alone at T=1 over every layer
  (``moe_bandwidth_fraction``).

Speed is compared as ratios, never asserted. Quote medians with the command line.
Examples::

    moe-service bench decode                           # the demo model, all usable CPUs
    moe-service bench decode --model qwen3-30b.gguf --threads 2 --json
    moe-service bench decode --depth 4096                 # prefill 4096 tokens, decode at depth 4096
    moe-service bench decode --depths 512,2048,8192,16384 --plot depth.png

Long context (``--depth D`` / ``--depths``): both engines are fed the same ids (ordinary
text in the model's vocabulary); ours prefills D tokens from an empty slot in ``--ubatch``
steps, llama.cpp in ``--n-batch`` batches, then each decodes ``--decode`` single tokens at
depth D. One round per depth by default (a prefill at depth takes long); ``--depth-repeats
R`` takes R rounds, each depth's engines back to back within a round, and reports each
engine's median and the median of the rounds' ratios (on a shared host the memory bandwidth
drifts between runs; a ratio taken within one round sees one load). The ratio is against
the faster llama.cpp configuration measured (``--flash-attn both`` measures both of its
paths).

Per layer (``--per-layer PRESET``, bench/layers.py): two synthetic files of the preset that
differ only in layer count (``--layers SMALL,BIG``; deepseek4: ``--pattern`` ratios repeated,
``--lead-layers`` hash-routed layers fixed), both engines on both at each depth; reports what
one more layer costs per decoded token and per prefill, (t_big - t_small) / (L_big - L_small),
each engine's and their ratio, beside the whole files' figures. ``--tensor-types RECIPE``
types both files per tensor (e.g. ``ud-iq1_s``: i-quant experts, as unsloth's files).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np


def active_bytes_per_token(catalog) -> dict[str, int]:
    """Bytes a decode step reads: every dense matrix once (q/k/v/o, dense FFN, the output
    head, deepseek2's per-head attn_k_b/attn_v_b), and per MoE layer K/E of its expert
    tensors (K experts' slabs); embeddings read one row (not counted), norms are negligible."""
    p = catalog.params
    expert_names = {et.tensor.name for kinds in catalog.expert_layers.values() for et in kinds.values()}
    dense = 0
    for t in catalog.tensors.values():
        if t.name in expert_names or t.name == "token_embd.weight" or len(t.shape) < 2:
            continue
        dense += t.nbytes
    if "output.weight" not in catalog.tensors:  # tied: the head reads the embedding matrix
        dense += catalog.tensors["token_embd.weight"].nbytes
    experts = 0
    for kinds in catalog.expert_layers.values():
        for et in kinds.values():
            experts += et.slab_bytes * min(p.n_expert_used, et.n_expert)
    return {"dense_bytes": dense, "expert_bytes": experts, "total_bytes": dense + experts}


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def measure_ours(path: Path, threads: int, n_prompt: int, n_decode: int, repeats: int, ubatch: int) -> dict:
    """Our engine on ``path``: decode and prefill tok/s (medians), and the MoE step's GB/s."""
    import torch

    torch.set_num_threads(1)
    from moe_service.engine.model import Model
    from moe_service.engine.ops import CpuOps
    from moe_service.gguf_model import GGUFModel
    from moe_service.weights import WeightStore

    catalog = GGUFModel.open(path)
    weights = WeightStore.load_simple(catalog)
    ops = CpuOps(threads=threads)
    try:
        model = Model(catalog, weights, ops, n_seq=1, n_ctx=n_prompt + n_decode + 8)
        vocab = catalog.params.n_vocab
        rng = np.random.default_rng(0)
        prompt = [int(t) for t in rng.integers(10, min(vocab, 30000), n_prompt)]
        # warm-up: compile every kernel for these shapes (prefill chunk and decode)
        s = model.kv.alloc()
        model.step([(s, prompt[: min(ubatch, n_prompt)])])
        model.step([(s, [prompt[0]])])
        model.kv.free(s)
        decode, prefill = [], []
        for _ in range(repeats):
            s = model.kv.alloc()
            t0 = time.perf_counter()
            for a in range(0, n_prompt, ubatch):  # logits for the prompt's last chunk only (as the server)
                logits = model.step([(s, prompt[a : a + ubatch])], want_logits=[a + ubatch >= n_prompt])
            prefill.append(n_prompt / (time.perf_counter() - t0))
            tok = int(np.argmax(logits[0].numpy()))
            t0 = time.perf_counter()
            for _ in range(n_decode):
                tok = int(np.argmax(model.step([(s, [tok])])[0].numpy()))
            decode.append(n_decode / (time.perf_counter() - t0))
            model.kv.free(s)
        moe = _moe_step_gbps(model, ops, repeats=max(20, repeats * 10))
    finally:
        ops.close()
    return {"decode_tok_s": _median(decode), "prefill_tok_s": _median(prefill), "decode_runs": decode,
            "prefill_runs": prefill, **moe}


def _moe_step_gbps(model, ops, repeats: int) -> dict:
    """The fused MoE step alone at T=1 over every MoE layer, with routing spread over the
    experts: GB/s of expert slab bytes read (K slabs of gate, up, down per layer)."""
    layers = [lw for lw in model.layers if lw.experts is not None]
    if not layers:
        return {"moe_gbps": None}
    p = model.p
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, p.n_embd)).astype(np.float32)
    w = np.full((1, p.n_expert_used), 1.0 / p.n_expert_used, np.float32)
    per_layer = sum(et.slab_bytes * p.n_expert_used for et in model.catalog.expert_layers[layers[0].index].values())
    times = []
    for _ in range(repeats):
        ids = rng.choice(p.n_expert, p.n_expert_used, replace=False).astype(np.int32).reshape(1, -1)
        t0 = time.perf_counter()
        for lw in layers:
            ops.moe(model.weights.arena, x, ids, w, lw.experts)
        times.append(time.perf_counter() - t0)
    return {"moe_gbps": per_layer * len(layers) / _median(times) / 1e9, "moe_bytes_per_step": per_layer * len(layers)}


def run(path: Path, threads: int, n_prompt: int, n_decode: int, repeats: int, ubatch: int, peer: bool) -> dict:
    from bench.kernels import memory_bandwidth_gbps
    from bench.peer import measure_decode, measure_prefill
    from moe_service.gguf_model import GGUFModel

    catalog = GGUFModel.open(path)
    active = active_bytes_per_token(catalog)
    bandwidth = memory_bandwidth_gbps(threads)
    ours = measure_ours(path, threads, n_prompt, n_decode, repeats, ubatch)
    if peer:
        pd = measure_decode(path, threads=threads, n_decode=n_decode, n_prompt=16)
        pp = measure_prefill(path, threads=threads, n_prompt=n_prompt, repeats=repeats)
    else:
        pd = pp = None
    ll_decode = pd.value if pd else None
    ll_prefill = pp.value if pp else None
    reason = (pd.reason if pd and pd.value is None else None) if peer else "skipped (--no-peer)"
    decode_gbps = active["total_bytes"] * ours["decode_tok_s"] / 1e9
    return {
        "model": str(path),
        "file_bytes": path.stat().st_size,
        "threads": threads,
        "decode_tok_s": ours["decode_tok_s"],
        "llamacpp_decode_tok_s": ll_decode,
        "decode_ratio_vs_llamacpp": ours["decode_tok_s"] / ll_decode if ll_decode else None,
        "prefill_tok_s": ours["prefill_tok_s"],
        "llamacpp_prefill_tok_s": ll_prefill,
        "prefill_ratio_vs_llamacpp": ours["prefill_tok_s"] / ll_prefill if ll_prefill else None,
        "active_bytes_per_token": active["total_bytes"],
        "active_bytes": active,
        "memory_read_gbps": bandwidth,
        "decode_gbps": decode_gbps,
        "bandwidth_fraction": decode_gbps / bandwidth,
        "llamacpp_bandwidth_fraction": active["total_bytes"] * ll_decode / 1e9 / bandwidth if ll_decode else None,
        "moe_gbps": ours["moe_gbps"],
        "moe_bandwidth_fraction": ours["moe_gbps"] / bandwidth if ours["moe_gbps"] else None,
        "llamacpp": reason or "measured",
        "settings": {"n_prompt": n_prompt, "n_decode": n_decode, "repeats": repeats, "ubatch": ubatch},
        "runs": {"decode_tok_s": ours["decode_runs"], "prefill_tok_s": ours["prefill_runs"]},
        "peer_machine": {"decode": pd.machine if pd else None, "prefill": pp.machine if pp else None},
        "load_average": list(os.getloadavg()),
    }


# ---------------------------------------------------------------------------------------
# Long context: prefill of D tokens, then decode at depth D, for each depth


DEPTH_TEXT = ("The quick brown fox jumps over the lazy dog while the experts sit on their nodes. "
              "Agents send long prompts: system prompts, tool definitions and the conversation so far. ")


def depth_ids(catalog, n: int) -> list[int]:
    """n token ids of ordinary text (DEPTH_TEXT repeated) in the model's vocabulary; both
    engines are fed the same ids (the routing, hence the MoE work, depends on them)."""
    from moe_service.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(catalog.metadata, source="bench")
    base = tok.encode(DEPTH_TEXT * 8, add_special=False, parse_special=False)
    ids = list(base)
    while len(ids) < n:
        ids += base
    return ids[:n]


def measure_ours_depths(path: Path, threads: int, depths: list[int], n_decode: int, ubatch: int,
                        kv_type: str = "f16", after_each=None, repeats: int = 1) -> dict[int, dict]:
    """Our engine: per depth D, prefill tok/s of D tokens (ubatch-sized steps from an empty
    slot) and decode tok/s of n_decode single-token steps at depth D + 1 (after one untimed
    step, as bench.peer.measure_depth), in ``repeats`` rounds
    over the depths: medians, with each round's figures in ``prefill_runs`` / ``decode_runs``.
    Depths beyond the model's trained context are reported with a reason instead.
    ``after_each(D)`` runs after each depth of each round (the peer's run of the same depth:
    the two engines' numbers of one depth and round are taken back to back, under the same
    machine load)."""
    import torch

    torch.set_num_threads(1)
    from moe_service.engine.model import Model
    from moe_service.engine.ops import CpuOps
    from moe_service.gguf_model import GGUFModel
    from moe_service.weights import WeightStore

    catalog = GGUFModel.open(path)
    trained = catalog.params.n_ctx_train or max(depths) + n_decode + 16
    ok = [d for d in depths if d + n_decode + 2 <= trained]
    out: dict[int, dict] = {d: {"reason": f"beyond the trained context of {trained} tokens"} for d in depths
                            if d not in ok}
    if not ok:
        return out
    weights = WeightStore.load_simple(catalog)
    ops = CpuOps(threads=threads)
    try:
        model = Model(catalog, weights, ops, n_seq=1, n_ctx=max(ok) + n_decode + 2, kv_type=kv_type)
        ids = depth_ids(catalog, max(ok) + n_decode)
        s = model.kv.alloc()  # warm-up: compile every kernel for a prefill chunk and a decode step
        model.step([(s, ids[:ubatch])])
        model.step([(s, [ids[0]])])
        model.kv.free(s)
        runs: dict[int, list[tuple[float, float]]] = {d: [] for d in ok}
        for d in [d for _ in range(repeats) for d in ok]:
            s = model.kv.alloc()
            t0 = time.perf_counter()
            for a in range(0, d, ubatch):  # logits for the prompt's last chunk only (as the server)
                logits = model.step([(s, ids[a: min(d, a + ubatch)])], want_logits=[a + ubatch >= d])
            t_prefill = time.perf_counter() - t0
            tok = int(np.argmax(logits[0].numpy()))
            # one untimed step at this depth: its first use of a kernel specialization that the
            # depth-1 warm-up does not reach (V4's indexer selecting, at depth > top-k x ratio)
            # may compile; llama.cpp's side takes the same untimed step (bench.peer.measure_depth)
            tok = int(np.argmax(model.step([(s, [tok])])[0].numpy()))
            t0 = time.perf_counter()
            for _ in range(n_decode):
                tok = int(np.argmax(model.step([(s, [tok])])[0].numpy()))
            t_decode = time.perf_counter() - t0
            model.kv.free(s)
            runs[d].append((t_prefill, t_decode))
            pre, dec = [d / tp for tp, _ in runs[d]], [n_decode / td for _, td in runs[d]]
            out[d] = {"prefill_tok_s": _median(pre), "decode_tok_s": _median(dec),
                      "prefill_s": _median([tp for tp, _ in runs[d]]), "decode_s": _median([td for _, td in runs[d]]),
                      "prefill_runs": pre, "decode_runs": dec}
            print(f"  ours depth {d}: prefill {d / t_prefill:.1f} tok/s, decode {n_decode / t_decode:.1f} tok/s",
                  file=sys.stderr, flush=True)
            if after_each is not None:
                after_each(d)
    finally:
        ops.close()
    return out


def run_depths(path: Path, threads: int, depths: list[int], n_decode: int, ubatch: int, peer: bool,
               flash_attn: str = "off", n_batch: int = 512, kv_type: str = "f16", repeats: int = 1) -> dict:
    """Both engines at every depth, back to back per depth (ours, then llama.cpp's
    configurations), so each depth's ratio is taken under one machine load; ``repeats``
    rounds of that (:func:`depth_row` combines them)."""
    from bench.peer import measure_depth
    from moe_service.gguf_model import GGUFModel

    catalog = GGUFModel.open(path)
    fa_modes = {"off": [False], "on": [True], "both": [False, True]}[flash_attn] if peer else []
    peer_runs: dict[int, list[dict]] = {}

    all_cpus = os.sched_getaffinity(0)  # before our pool pins this thread to its first CPU

    def run_peer(d: int) -> None:
        # llama.cpp runs on this thread and its workers inherit this thread's affinity: give it
        # every CPU while it runs (our pool pinned the caller to one), then pin back
        pinned = os.sched_getaffinity(0)
        os.sched_setaffinity(0, all_cpus)
        try:
            _run_peer(d)
        finally:
            os.sched_setaffinity(0, pinned)

    def _run_peer(d: int) -> None:
        row: dict = {}
        peer_runs.setdefault(d, []).append(row)
        for fa in fa_modes:
            r = measure_depth(path, depth_ids(catalog, d + n_decode)[:d], threads=threads, n_decode=n_decode,
                              n_batch=n_batch, flash_attn=fa)
            tag = "llamacpp_fa" if fa else "llamacpp"
            row[f"{tag}_prefill_tok_s"] = r["prefill"].value
            row[f"{tag}_decode_tok_s"] = r["decode"].value
            if r["prefill"].value is None:
                row["llamacpp"] = r["prefill"].reason
                continue
            print(f"  llama.cpp{' (flash attn)' if fa else ''} depth {d}: prefill {r['prefill'].value:.1f} tok/s, "
                  f"decode {r['decode'].value:.1f} tok/s", file=sys.stderr, flush=True)

    ours = measure_ours_depths(path, threads, depths, n_decode, ubatch, kv_type, after_each=run_peer,
                               repeats=repeats)
    rows = [depth_row(d, ours[d], peer_runs.get(d, [])) for d in depths]
    return {"model": str(path), "threads": threads, "n_decode": n_decode, "ubatch": ubatch, "n_batch": n_batch,
            "kv_type": kv_type, "flash_attn": flash_attn, "repeats": repeats, "rows": rows,
            "load_average": list(os.getloadavg())}


def depth_row(d: int, ours: dict, peer_runs: list[dict]) -> dict:
    """One depth's row from our figures (:func:`measure_ours_depths`: medians and per-round
    ``prefill_runs`` / ``decode_runs``) and the peer's rounds (per round, tok/s under
    ``llamacpp_*`` and ``llamacpp_fa_*``, None where a configuration did not run): each
    llama.cpp figure is the median of its rounds; ``decode_ratio`` / ``prefill_ratio`` are
    the medians of the rounds' ratios, each ours over the faster llama.cpp configuration of
    the same round (``*_ratio_runs``)."""
    row = {"depth": d, **ours}
    keys = [f"{t}_{w}_tok_s" for t in ("llamacpp", "llamacpp_fa") for w in ("prefill", "decode")]
    for k in keys:
        vals = [r[k] for r in peer_runs if r.get(k)]
        if vals:
            row[k] = _median(vals)
    for r in peer_runs:
        if "llamacpp" in r:  # why llama.cpp did not run
            row["llamacpp"] = r["llamacpp"]
    if "decode_tok_s" not in ours:
        return row
    for w in ("prefill", "decode"):
        ratios = []
        for ours_v, r in zip(ours[f"{w}_runs"], peer_runs, strict=False):
            best = max((x for x in (r.get(f"llamacpp_{w}_tok_s"), r.get(f"llamacpp_fa_{w}_tok_s")) if x), default=None)
            if best:
                ratios.append(ours_v / best)
        if ratios:
            row[f"{w}_ratio"] = _median(ratios)
            row[f"{w}_ratio_runs"] = ratios
    return row


def format_depths(r: dict) -> str:
    fa = r["flash_attn"] in ("on", "both")
    lines = [f"bench decode --depths: {r['model']}, {r['threads']} thread(s), decode {r['n_decode']} tokens, "
             f"our ubatch {r['ubatch']}, llama.cpp n_batch {r['n_batch']}, KV {r['kv_type']}, "
             f"{r.get('repeats', 1)} round(s), load average {r['load_average'][0]:.2f}", "",
             f"{'depth':>6}  {'decode ours':>11}  {'llama.cpp':>9}" + (f"  {'llama FA':>8}" if fa else "")
             + f"  {'ratio':>5}  {'prefill ours':>12}  {'llama.cpp':>9}" + (f"  {'llama FA':>8}" if fa else "")
             + f"  {'ratio':>5}"]
    for row in r["rows"]:
        if "decode_tok_s" not in row:
            lines.append(f"{row['depth']:>6}  {row.get('reason', 'n/a')}")
            continue
        lines.append(
            f"{row['depth']:>6}  {_fmt(row['decode_tok_s']):>11}  {_fmt(row.get('llamacpp_decode_tok_s')):>9}"
            + (f"  {_fmt(row.get('llamacpp_fa_decode_tok_s')):>8}" if fa else "")
            + f"  {_fmt(row.get('decode_ratio'), '.2f'):>5}  {_fmt(row['prefill_tok_s']):>12}"
            f"  {_fmt(row.get('llamacpp_prefill_tok_s')):>9}"
            + (f"  {_fmt(row.get('llamacpp_fa_prefill_tok_s')):>8}" if fa else "")
            + f"  {_fmt(row.get('prefill_ratio'), '.2f'):>5}")
    lines.append("")
    lines.append("ratio: ours / the faster llama.cpp configuration measured"
                 + (" (tok/s: medians of the rounds; ratio: the median of the rounds' ratios)"
                    if r.get("repeats", 1) > 1 else ""))
    return "\n".join(lines)


def plot_depths(r: dict, out: Path) -> None:
    """tok/s against depth for both engines (decode left, prefill right), as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [row for row in r["rows"] if "decode_tok_s" in row]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, what in zip(axes, ("decode", "prefill"), strict=True):
        xs = [row["depth"] for row in rows]
        ax.plot(xs, [row[f"{what}_tok_s"] for row in rows], "o-", label="moe-service")
        for tag, label in (("llamacpp", "llama.cpp"), ("llamacpp_fa", "llama.cpp, flash attn")):
            ys = [row.get(f"{tag}_{what}_tok_s") for row in rows]
            if any(y is not None for y in ys):
                ax.plot([x for x, y in zip(xs, ys, strict=True) if y is not None], [y for y in ys if y is not None],
                        "s--", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context depth (tokens)")
        ax.set_ylabel(f"{what} tok/s")
        ax.set_title(f"{what} at depth")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(f"{Path(r['model']).name}, {r['threads']} threads (shared machine, load {r['load_average'][0]:.1f})")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _fmt(v, spec=".1f") -> str:
    return "n/a" if v is None else format(v, spec)


def format_report(r: dict) -> str:
    lines = [
        f"bench decode: {r['model']} ({r['file_bytes'] / 1e9:.2f} GB), {r['threads']} thread(s), "
        f"load average {r['load_average'][0]:.2f}",
        "",
        f"{'':22s}{'moe-service':>14s}{'llama.cpp':>14s}{'ratio':>10s}",
        f"{'decode tok/s':22s}{_fmt(r['decode_tok_s']):>14s}{_fmt(r['llamacpp_decode_tok_s']):>14s}"
        f"{_fmt(r['decode_ratio_vs_llamacpp'], '.2f'):>10s}",
        f"{'prefill tok/s':22s}{_fmt(r['prefill_tok_s']):>14s}{_fmt(r['llamacpp_prefill_tok_s']):>14s}"
        f"{_fmt(r['prefill_ratio_vs_llamacpp'], '.2f'):>10s}",
        "",
        f"roofline: {r['active_bytes_per_token'] / 1e6:.1f} MB read per token, memory read bandwidth "
        f"{r['memory_read_gbps']:.1f} GB/s",
        f"  decode reads {r['decode_gbps']:.1f} GB/s = {r['bandwidth_fraction']:.2f} of bandwidth "
        f"(llama.cpp {_fmt(r['llamacpp_bandwidth_fraction'], '.2f')})",
        f"  MoE step alone (T=1): {_fmt(r['moe_gbps'])} GB/s = {_fmt(r['moe_bandwidth_fraction'], '.2f')} of bandwidth",
    ]
    if r["llamacpp"] != "measured":
        lines.append(f"llama.cpp: {r['llamacpp']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="moe-service bench decode", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="GGUF file (default: the demo model)")
    ap.add_argument("--threads", type=int, default=0, help="threads for both engines (default: usable CPUs)")
    ap.add_argument("--prompt", type=int, default=128, help="prefill prompt tokens (default 128)")
    ap.add_argument("--decode", type=int, default=64, help="decode steps timed (default 64)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per measurement (medians; default 3)")
    ap.add_argument("--ubatch", type=int, default=128, help="our prefill step size in tokens (default 128)")
    ap.add_argument("--no-peer", action="store_true", help="do not run llama.cpp")
    ap.add_argument("--depth", type=int, default=0,
                    help="long context: prefill of DEPTH tokens, then --decode tokens at that depth, both engines")
    ap.add_argument("--depths", default="", help="comma-separated depths to sweep (e.g. 512,2048,8192,16384)")
    ap.add_argument("--plot", type=Path, default=None, help="with --depth(s): draw tok/s against depth to this PNG")
    ap.add_argument("--flash-attn", choices=["off", "on", "both"], default="off",
                    help="llama.cpp's flash-attention path for the depth runs (llama-cpp-python default: off)")
    ap.add_argument("--n-batch", type=int, default=512, help="llama.cpp's n_batch for the depth runs (default 512)")
    ap.add_argument("--kv-type", choices=["f16", "q8_0"], default="f16", help="our KV cache format (depth runs)")
    ap.add_argument("--depth-repeats", type=int, default=1,
                    help="rounds over the depths, both engines back to back per depth (medians; default 1)")
    ap.add_argument("--per-layer", metavar="PRESET", default=None,
                    help="per-layer mode: two synthetic files of this preset differing only in layer count "
                         "(bench/layers.py); depths from --depth(s), default 512")
    ap.add_argument("--layers", default="", help="per-layer mode: SMALL,BIG layer counts (default: the pattern "
                                                  "length and twice it; synth/deepseek2: 2,4)")
    ap.add_argument("--pattern", default="", help="per-layer mode, deepseek4: compress ratios repeated per layer")
    ap.add_argument("--lead-layers", type=int, default=None,
                    help="per-layer mode: leading hash-routed (deepseek4) or dense (deepseek2) layers in both files")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="per-layer mode: replace a preset field in both files (repeatable), e.g. n_expert=32")
    ap.add_argument("--tensor-types", default="", metavar="RECIPE",
                    help="per-layer mode: per-tensor types of both files (moe_service/synth/recipe.py), rules "
                         "ROLE[@N[-M]]=TYPE or a named recipe, e.g. ud-iq1_s or "
                         "gate=IQ1_S,up=IQ1_S,down=IQ2_XXS,attn=Q8_0")
    ap.add_argument("--pair-dir", type=Path, default=None,
                    help="per-layer mode: where the files are written and reused (default cache_dir()/bench-layers)")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    a = ap.parse_args(argv)
    if a.per_layer:
        return _main_per_layer(a)
    if a.model is None:
        from moe_service.paths import demo_model_path

        a.model = demo_model_path()
    if not a.model.is_file():
        print(f"moe-service bench decode: {a.model} does not exist (run `moe-service demo-model`)", file=sys.stderr)
        return 2
    threads = a.threads or len(os.sched_getaffinity(0))
    depths = [int(x) for x in a.depths.split(",") if x.strip()] if a.depths else ([a.depth] if a.depth else [])
    if depths:
        if a.depth_repeats < 1:
            print(f"moe-service bench decode: --depth-repeats {a.depth_repeats}: at least 1", file=sys.stderr)
            return 2
        r = run_depths(a.model, threads, depths, a.decode, a.ubatch, not a.no_peer, a.flash_attn, a.n_batch,
                       a.kv_type, a.depth_repeats)
        print(json.dumps(r, indent=1) if a.json else format_depths(r))
        if a.plot:
            plot_depths(r, a.plot)
            print(f"plot: {a.plot}", file=sys.stderr)
        return 0
    r = run(a.model, threads, a.prompt, a.decode, a.repeats, a.ubatch, not a.no_peer)
    print(json.dumps(r, indent=1) if a.json else format_report(r))
    return 0


def _main_per_layer(a: argparse.Namespace) -> int:
    """``--per-layer PRESET``: bench.layers on a pair of synthetic files; exit 2 with one line
    for a pair that does not fit."""
    from bench.layers import LayerPair, family_module, family_of, format_per_layer, parse_sets, run_per_layer
    from moe_service.errors import ConfigError
    from moe_service.paths import cache_dir

    prog = "moe-service bench decode"
    try:
        fam = family_of(a.per_layer)
        base = family_module(fam).PRESETS[a.per_layer]
        sets = parse_sets(a.set, type(base))
        if a.tensor_types:
            if "tensor_types" in sets:
                raise ConfigError("--tensor-types and --set tensor_types=...: give the recipe once.")
            sets["tensor_types"] = a.tensor_types
        pattern = tuple(int(x) for x in a.pattern.split(",") if x.strip()) if a.pattern else None
        if a.layers:
            small, big = (int(x) for x in a.layers.split(","))
        elif fam == "deepseek4":
            n = len(pattern or sets.get("compress_ratios") or base.compress_ratios)
            small, big = n, 2 * n
        else:
            small, big = 2, 4
        pair = LayerPair(a.per_layer, small, big, a.lead_layers, pattern, tuple(sorted(sets.items())))
        pair.resolved(small), pair.resolved(big)
        pair.check_recipe()
    except ValueError as e:
        print(f"{prog}: --layers {a.layers!r} / --pattern {a.pattern!r}: expected comma-separated integers ({e})",
              file=sys.stderr)
        return 2
    except ConfigError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    if a.depth_repeats < 1:
        print(f"{prog}: --depth-repeats {a.depth_repeats}: at least 1", file=sys.stderr)
        return 2
    threads = a.threads or len(os.sched_getaffinity(0))
    depths = [int(x) for x in a.depths.split(",") if x.strip()] if a.depths else [a.depth or 512]
    r = run_per_layer(pair, a.pair_dir or cache_dir() / "bench-layers", threads, depths, a.decode, a.ubatch,
                      not a.no_peer, a.flash_attn, a.n_batch, a.kv_type, a.depth_repeats)
    print(json.dumps(r, indent=1) if a.json else format_per_layer(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
