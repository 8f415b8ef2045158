"""``moe-service bench fastload``: fastload with buffered and direct reads against a naive
loader, the parallel-read ceilings and llama.cpp, on the same file, warm page cache and cold.

::

    fastload_buffered  pipeline.fastload.fastload(catalog, plain_layout(catalog), io='buffered')
                  (reserve + THP + populate + N-thread preadv; interleaved when the file is
                  cached, pipelined when it is not), catalog already open; LoadStats.seconds:
                  from the arena reservation to the last byte
    fastload_direct    the same with io='direct' (O_DIRECT reads, pipelined, direct_threads)
    fastload      the mode fastload.io = auto picks for this file and this cache state (the
                  service's default): auto_io in the report
    single_thread WeightStore.load_simple: one thread, one readinto per tensor into a fresh
                  numpy buffer (page faults during the reads), as a naive loader does
    ceiling_buffered / ceiling_direct  pipeline.fastload.reread: the same reads (N preadv
                  threads / O_DIRECT readers) into an arena fastload already populated (no
                  faults, no allocation): what the reads alone cost; ``ceiling`` is the one of
                  auto's mode, ``best ceiling`` the faster of the two
    ceiling_1t    the buffered ceiling with one thread (warm): ceiling / ceiling_1t shows the
                  threads really run in parallel (preadv and ctypes madvise release the GIL)
    llamacpp      llama_model_load_from_file with load_mode NONE (use_mmap=False), CPU only,
                  through llama-cpp-python when installed; its time includes its own
                  metadata and vocabulary parsing (ours is reported separately: open_s)
    llamacpp_direct  the same with load_mode DIRECT_IO (llama.cpp's own O_DIRECT loader)
    page cache    Cached of /proc/meminfo right before and right after each fastload run:
                  page_cache_<io>_bytes is the median growth (cold runs: what the load left
                  in the page cache), page_cache_<io>_fraction that over the file's size;
                  on a shared machine other processes' reads land there too, so
                  file_cached_<io>_fraction also gives the model file's own pages in the
                  cache after the load (mincore; cold runs start from ~0)

GB/s are tensor bytes / seconds (10^9 bytes). ``runs_s.fastload_<io>_populate`` lists each run's
populate time (thread-seconds): on a VM whose host reclaims freed guest memory, runs
where it is high paid host page faults, not fastload's own work (see prefault_free_memory). Every measurement is repeated and the median
reported; the methods take turns within each repeat so none gets all the fresh memory.
Cold runs evict the file from the page cache first (posix_fadvise DONTNEED, checked with
mincore; /proc/sys/vm/drop_caches when that is not enough and we are root). On a VM, "cold"
is the guest's page cache: the host may still hold the file.

    python -m bench.fastload --model F [--json] [--repeats 5] [--cold-repeats 1]
    python -m bench.fastload --make-synthetic F --size-gib 4.5     # moe_service.synth qwen3-30b-a3b
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from bench.peer import _CpuWindow, llama_cpp_unavailable_reason
from moe_service import fileio, memory
from moe_service.config import FastloadConfig
from moe_service.gguf_model import GGUFModel
from moe_service.layout import plain_layout
from moe_service.sizes import GiB, MiB
from moe_service.weights import WeightStore
from pipeline.fastload import choose_io, fastload, reread

IO = ("buffered", "direct")

# fastload.direct_above_free_fraction's default: the "auto" column shows what a default config
# picks (choose_io's own default is for callers that pass nothing).
AUTO_DIRECT_ABOVE_FREE_FRACTION = FastloadConfig.model_fields["direct_above_free_fraction"].default

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


# --- page cache control ---------------------------------------------------------------------


def cached_fraction(path: Path) -> float:
    """Fraction of ``path``'s pages resident in the page cache (mincore(2))."""
    size = path.stat().st_size
    if size == 0:
        return 1.0
    pages = -(-size // mmap.PAGESIZE)
    vec = np.zeros(pages, dtype=np.uint8)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
        arr = np.frombuffer(mm, dtype=np.uint8)
        addr = memory.address_of(arr)
        rc = _libc.mincore(ctypes.c_void_p(addr), size, ctypes.c_void_p(vec.ctypes.data))
        del arr
        if rc != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mincore({path}): {os.strerror(err)}")
    return float(np.count_nonzero(vec & 1)) / pages


def evict(paths: list[Path]) -> str:
    """Drop ``paths`` from the page cache; returns the method that worked ('fadvise' or
    'drop_caches'), or raises RuntimeError when neither did (more than 2% still cached)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    if max(cached_fraction(p) for p in paths) <= 0.02:
        return "fadvise"
    if os.geteuid() == 0:
        os.sync()
        try:
            Path("/proc/sys/vm/drop_caches").write_text("1\n")
        except OSError as e:
            raise RuntimeError(f"cannot drop the page cache: {e}") from None
        if max(cached_fraction(p) for p in paths) <= 0.02:
            return "drop_caches"
    worst = max(cached_fraction(p) for p in paths)
    raise RuntimeError(f"could not evict the model from the page cache ({100 * worst:.0f}% still cached)")


def warm(paths: list[Path]) -> None:
    """Read every byte of ``paths`` once so the page cache holds them."""
    buf = bytearray(64 << 20)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def prefault_free_memory(nbytes: int) -> None:
    """Touch ``nbytes`` of fresh anonymous memory (THP) and free it at once.

    In a VM whose balloon device reports free pages to the host (virtio-balloon free page
    reporting, as on this machine), memory the guest freed some seconds ago is no longer
    backed by the host: touching it again costs a host fault (~0.3-0.5 GB/s measured here
    instead of ~15 GB/s). Run right before each timed load, this hands the loader
    host-backed free pages, as on bare metal. Every method gets the same treatment.
    """
    a = memory.reserve_arena(nbytes)
    try:
        memory.madvise(memory.address_of(a), nbytes, memory.MADV_HUGEPAGE)
        memory.madvise(memory.address_of(a), nbytes, memory.MADV_POPULATE_WRITE)
    finally:
        memory.free_arena(a)


# --- the loaders ----------------------------------------------------------------------------


def time_fastload(catalog, threads: int, io: str = "auto") -> tuple[float, dict]:
    layout = plain_layout(catalog)
    cached0 = fileio.meminfo().get("Cached", 0)
    arena, _, stats = fastload(catalog, layout, threads=threads, io=io, progress_interval_s=3600, progress_bar=False)
    cached1 = fileio.meminfo().get("Cached", 0)
    sizes = [s.size_bytes for s in catalog.shards]
    file_cached = sum(cached_fraction(s.path) * n for s, n in zip(catalog.shards, sizes, strict=True)) / sum(sizes)
    memory.free_arena(arena)
    dt = stats.seconds  # arena reservation to last byte (the validation before it is ~0.2 ms)
    return dt, {
        "io": stats.io,
        "pipelined": stats.pipelined,
        "threads": stats.threads,
        "populate_threads": stats.populate_threads,
        "populate": stats.populate,
        "populate_s": round(stats.populate_s, 4),
        "read_s": round(stats.read_s, 4),
        "wait_s": round(stats.wait_s, 4),
        "direct_bytes": stats.direct_bytes,
        "direct_fallback": stats.direct_fallback,
        "anon_huge_bytes": stats.anon_huge_bytes,
        "concurrency": round(stats.concurrency, 2),
        "page_cache_growth_bytes": cached1 - cached0,
        "file_cached_after_fraction": round(file_cached, 4),
    }


def time_single_thread(catalog) -> float:
    t0 = time.perf_counter()
    store = WeightStore.load_simple(catalog)
    dt = time.perf_counter() - t0
    del store
    return dt


class Ceiling:
    """An arena filled once by fastload, re-read on demand (no faults): the read ceiling."""

    def __init__(self, catalog, threads: int):
        self.catalog, self.layout = catalog, plain_layout(catalog)
        self.arena, _, _ = fastload(
            catalog, self.layout, threads=threads, io="direct", progress_interval_s=3600, progress_bar=False
        )

    def time(self, threads: int, io: str = "buffered"):
        """(seconds, concurrency: CPU seconds per wall second) of one re-read (``io``
        'buffered': ``threads`` preadv threads; 'direct': fastload's O_DIRECT readers)."""
        st = reread(self.catalog, self.layout, self.arena, threads=threads, io=io)
        return st.seconds, round(st.concurrency, 2)

    def close(self) -> None:
        memory.free_arena(self.arena)


class LlamaCpp:
    """llama.cpp's model load with load_mode NONE (use_mmap=False), CPU, logs silenced."""

    def __init__(self):
        import llama_cpp

        self.L = llama_cpp
        self.has_direct = hasattr(llama_cpp, "LLAMA_LOAD_MODE_DIRECT_IO")
        self._quiet = llama_cpp.llama_log_callback(lambda level, text, user: None)
        llama_cpp.llama_log_set(self._quiet, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
        llama_version = getattr(llama_cpp, "llama_version", None)
        self.version = f"llama-cpp-python {llama_cpp.__version__}" + (
            f", llama.cpp {llama_version().decode()}" if llama_version else ""
        )

    def time(self, path: Path, direct: bool = False) -> float:
        """Seconds of one llama_model_load_from_file: load_mode NONE (read(), no mmap), or
        DIRECT_IO (``direct``: its O_DIRECT loader, where this llama.cpp has it)."""
        p = self.L.llama_model_default_params()
        p.load_mode = self.L.LLAMA_LOAD_MODE_DIRECT_IO if direct else self.L.LLAMA_LOAD_MODE_NONE
        p.n_gpu_layers = 0
        t0 = time.perf_counter()
        model = self.L.llama_model_load_from_file(str(path).encode(), p)
        dt = time.perf_counter() - t0
        if not model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.L.llama_model_free(model)
        return dt


# --- the benchmark --------------------------------------------------------------------------


def _last(runs: dict) -> str:
    return ", ".join(f"{k} {v[-1]:.3f}s" for k, v in runs.items()
                     if isinstance(v, list) and v and not k.startswith(("page_cache", "file_cached")))


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _gbps(nbytes: int, seconds: float | None) -> float | None:
    return round(nbytes / seconds / 1e9, 3) if seconds else None


def run_bench(
    model: Path,
    *,
    threads: int = 16,
    repeats: int = 5,
    cold_repeats: int = 1,
    llamacpp: bool = True,
    prefault: bool = True,
    log=print,
) -> dict:
    """Measure every loader on ``model`` (see the module docstring); returns the result dict."""
    t_open = time.perf_counter()
    catalog = GGUFModel.open(model)
    open_s = time.perf_counter() - t_open
    paths = [s.path for s in catalog.shards]
    nbytes = catalog.total_bytes
    peer, peer_note = None, None
    if llamacpp:
        peer_note = llama_cpp_unavailable_reason()
        if peer_note is None:
            peer = LlamaCpp()
        else:
            log(f"note: {peer_note}: the llama.cpp column is skipped")
    result: dict = {
        "model": str(model),
        "tensor_bytes": nbytes,
        "file_bytes": sum(s.size_bytes for s in catalog.shards),
        "shards": len(paths),
        "threads_asked": threads,
        "cpus": memory.usable_cpus(),
        "thp": memory.thp_mode(),
        "open_s": round(open_s, 4),
        "repeats": repeats,
        "loadavg_start": os.getloadavg(),
        "llamacpp": peer.version if peer else peer_note,
        "prefault": prefault,
    }

    def one_round(runs: dict, cold: bool) -> None:
        def prep():
            if prefault:
                prefault_free_memory(nbytes)
            if cold:
                result["cold_method"] = evict(paths)

        prep()
        # what the service would do now, with its default config
        runs["auto_io"] = choose_io(catalog, "auto", direct_above_free_fraction=AUTO_DIRECT_ABOVE_FREE_FRACTION).io
        for io in IO:
            if io != IO[0]:
                prep()
            dt, info = time_fastload(catalog, threads, io)
            runs[f"fastload_{io}"].append(dt)
            runs[f"fastload_{io}_populate"].append(info["populate_s"])  # thread-seconds: host-fault noise
            runs[f"page_cache_{io}"].append(info["page_cache_growth_bytes"])
            runs[f"file_cached_{io}"].append(info["file_cached_after_fraction"])
            runs[f"info_{io}"] = info
        prep()
        runs["single_thread"].append(time_single_thread(catalog))
        ceiling = Ceiling(catalog, threads)
        try:
            for io in IO:
                prep()
                dt, conc = ceiling.time(threads, io)
                runs[f"ceiling_{io}"].append(dt)
                runs[f"ceiling_{io}_concurrency"] = conc
            if not cold:
                dt, conc = ceiling.time(1)
                runs["ceiling_1t"].append(dt)
                runs["ceiling_1t_concurrency"] = conc
        finally:
            ceiling.close()
        if peer is not None:
            prep()
            runs["llamacpp"].append(peer.time(model))
            if peer.has_direct:
                prep()
                runs["llamacpp_direct"].append(peer.time(model, direct=True))

    def summarise(runs: dict, cache: str) -> dict:
        med = {k: _median(v) for k, v in runs.items() if isinstance(v, list)}
        auto = runs.get("auto_io", "buffered")
        out = {"cache": cache, "auto_io": auto}
        for k in ("fastload_buffered", "fastload_direct", "single_thread", "ceiling_buffered", "ceiling_direct",
                  "ceiling_1t", "llamacpp", "llamacpp_direct"):
            out[f"{k}_s"] = round(med[k], 4) if med.get(k) else None
            out[f"{k}_gbps"] = _gbps(nbytes, med.get(k))
            out[f"{k}_best_gbps"] = _gbps(nbytes, min(runs[k])) if runs.get(k) else None
        for k in ("", "_gbps", "_best_gbps"):
            out[f"fastload{k or '_s'}"] = out[f"fastload_{auto}{k or '_s'}"]
            out[f"ceiling{k or '_s'}"] = out[f"ceiling_{auto}{k or '_s'}"]
        lc, c1 = out["llamacpp_gbps"], out["ceiling_1t_gbps"]
        ceilings = [x for x in (out["ceiling_buffered_gbps"], out["ceiling_direct_gbps"], c1) if x]
        best_c = max(ceilings) if ceilings else None
        out["best_ceiling_gbps"] = best_c
        for io in ("", "_buffered", "_direct"):
            f = out[f"fastload{io}_gbps"]
            c = out[f"ceiling{io}_gbps"]
            out[f"ratio{io}_vs_llamacpp"] = round(f / lc, 2) if f and lc else None
            lcd = out["llamacpp_direct_gbps"]
            out[f"ratio{io}_vs_llamacpp_direct"] = round(f / lcd, 2) if f and lcd else None
            out[f"ratio{io}_vs_ceiling"] = round(f / c, 3) if f and c else None
            out[f"ratio{io}_vs_best_ceiling"] = round(f / best_c, 3) if f and best_c else None
        f = out["fastload_gbps"]
        out["ratio_vs_single_thread"] = (
            round(f / out["single_thread_gbps"], 2) if f and out["single_thread_gbps"] else None
        )
        c = out["ceiling_buffered_gbps"]
        out["thread_speedup_ceiling"] = round(c / c1, 2) if c and c1 else None
        if out["llamacpp_s"]:
            out["ratio_vs_llamacpp_with_open"] = round(out["llamacpp_s"] / (out["fastload_s"] + open_s), 2)
        file_bytes = result["file_bytes"]
        for io in IO:
            grown = med.get(f"page_cache_{io}")
            out[f"page_cache_{io}_bytes"] = int(grown) if grown is not None else None
            out[f"page_cache_{io}_fraction"] = round(grown / file_bytes, 4) if grown is not None else None
            out[f"file_cached_{io}_fraction"] = med.get(f"file_cached_{io}")
            out[f"fastload_{io}_detail"] = runs.get(f"info_{io}")
            out[f"ceiling_{io}_concurrency"] = runs.get(f"ceiling_{io}_concurrency")
        out["fastload_detail"] = runs.get(f"info_{auto}")
        out["ceiling_concurrency"] = runs.get(f"ceiling_{auto}_concurrency")
        out["ceiling_1t_concurrency"] = runs.get("ceiling_1t_concurrency")
        out["runs_s"] = {k: [round(x, 4) for x in v] for k, v in runs.items()
                         if isinstance(v, list) and not k.startswith(("page_cache", "file_cached"))}
        out["page_cache_runs"] = {k: v for k, v in runs.items() if k.startswith(("page_cache", "file_cached"))}
        return out

    def new_runs() -> dict:
        runs: dict = {k: [] for k in ("single_thread", "ceiling_1t", "llamacpp", "llamacpp_direct")}
        for io in IO:
            runs.update({f"fastload_{io}": [], f"fastload_{io}_populate": [], f"page_cache_{io}": [],
                         f"file_cached_{io}": [], f"ceiling_{io}": []})
        return runs

    log(
        f"model {model}: {nbytes / GiB:.2f} GiB of tensors in {len(paths)} file(s); catalog opened in {open_s:.3f} s"
    )
    with _CpuWindow(threads) as window:
        warm(paths)
        one_round(new_runs(), cold=False)  # discarded: first touch of fresh memory, lazy imports
        runs = new_runs()
        for r in range(repeats):
            warm(paths)
            one_round(runs, cold=False)
            log(f"warm repeat {r + 1}/{repeats}: " + _last(runs))
        result.update(summarise(runs, "warm"))
        if cold_repeats > 0:
            try:
                evict(paths)
                runs = new_runs()
                for r in range(cold_repeats):
                    one_round(runs, cold=True)
                    log(f"cold repeat {r + 1}/{cold_repeats}: " + _last(runs))
                result["cold"] = summarise(runs, "cold")
                result["cold"]["method"] = result.pop("cold_method", None)
            except (RuntimeError, OSError) as e:
                result["cold"] = {"cache": "cold", "skipped": str(e)}
                log(f"cold runs skipped: {e}")
    result["loadavg_end"] = os.getloadavg()
    result["machine"] = window.report  # other_cores: cores other processes kept busy meanwhile
    return result


def format_table(r: dict) -> str:
    """The result as an aligned text table (one row per loader, warm and cold columns)."""
    cold = r.get("cold") or {}

    def label(io: str) -> str:
        d = r.get(f"fastload_{io}_detail") or {}
        return f"fastload {io} ({d.get('threads', '?')}+{d.get('populate_threads', 0)} threads)"

    rows = [("loader", "warm s", "warm GB/s", "cold s", "cold GB/s")]
    for k, name in (
        ("fastload_buffered", label("buffered")),
        ("fastload_direct", label("direct")),
        ("ceiling_buffered", "parallel pread ceiling"),
        ("ceiling_direct", "parallel O_DIRECT ceiling"),
        ("ceiling_1t", "pread ceiling, 1 thread"),
        ("single_thread", "single-thread naive"),
        ("llamacpp", "llama.cpp use_mmap=False"),
        ("llamacpp_direct", "llama.cpp load_mode DIRECT_IO"),
    ):
        rows.append((name, _fmt(r.get(f"{k}_s")), _fmt(r.get(f"{k}_gbps")), _fmt(cold.get(f"{k}_s")),
                     _fmt(cold.get(f"{k}_gbps"))))
    w = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = ["  ".join(c.ljust(w[i]) if i == 0 else c.rjust(w[i]) for i, c in enumerate(row)) for row in rows]
    lines.append("")
    lines.append(f"fastload.io = auto picks: warm {r.get('auto_io')}, cold {cold.get('auto_io', '-')}")
    for key in (
        "ratio_buffered_vs_ceiling",
        "ratio_direct_vs_ceiling",
        "ratio_buffered_vs_best_ceiling",
        "ratio_direct_vs_best_ceiling",
        "ratio_buffered_vs_llamacpp",
        "ratio_direct_vs_llamacpp",
        "ratio_direct_vs_llamacpp_direct",
        "ratio_vs_single_thread",
        "thread_speedup_ceiling",
        "ratio_vs_llamacpp_with_open",
    ):
        lines.append(
            f"{key}: warm {_fmt(r.get(key))}" + (f", cold {_fmt(cold.get(key))}" if cold.get(key) else "")
        )
    for io in IO:
        lines.append(
            f"page cache growth during a {io} load (Cached, /proc/meminfo): warm {_mib(r.get(f'page_cache_{io}_bytes'))}"
            f", cold {_mib(cold.get(f'page_cache_{io}_bytes'))} ({_pct(cold.get(f'page_cache_{io}_fraction'))} "
            f"of the file); the file itself cached after a cold load (mincore): "
            f"{_pct(cold.get(f'file_cached_{io}_fraction'))}"
        )
    lines.append(
        f"llama.cpp: {r.get('llamacpp')}; cold eviction: {cold.get('method') or cold.get('skipped', '-')}"
    )
    det = r.get("fastload_detail") or {}
    lines.append(
        f"concurrency (CPU s per wall s): fastload {_fmt(det.get('concurrency'))}, ceiling "
        f"{_fmt(r.get('ceiling_concurrency'))}, ceiling 1 thread {_fmt(r.get('ceiling_1t_concurrency'))}"
    )
    m = r.get("machine") or {}
    lines.append(
        f"other processes kept {_fmt(m.get('other_cores'))} cores busy during the run "
        f"(this process: {_fmt(m.get('self_cores'))})"
    )
    lines.append(
        f"load average start {r['loadavg_start']}, end {r['loadavg_end']}; usable CPUs {r['cpus']}; THP {r['thp']}"
    )
    return "\n".join(lines)


def _mib(v) -> str:
    return "-" if v is None else f"{v / MiB:+.0f} MiB"


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _fmt(v) -> str:
    return "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))


# --- a synthetic llama.cpp-loadable MoE model ---------------------------------------------


def make_synthetic(path: Path, size_gib: float, seed: int = 0) -> Path:
    """Write moe_service.synth's ``qwen3-30b-a3b`` preset (Qwen3-30B-A3B's real layer
    shapes: hidden 2048, 128 experts of 768, top-8, Q8_0 experts) with as many layers as
    bring it to about ``size_gib`` GiB. llama.cpp loads it."""
    from moe_service.synth import resolve_preset, tensor_plan, write_synthetic

    one, two = (
        sum(t.nbytes for t in tensor_plan(resolve_preset("qwen3-30b-a3b", n_layer=n))) for n in (1, 2)
    )
    per_layer, fixed = two - one, 2 * one - two
    n_layer = max(1, round((size_gib * GiB - fixed) / per_layer))
    return write_synthetic(path, "qwen3-30b-a3b", n_layer=n_layer, seed=seed)


# --- command line ---------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``moe-service bench fastload`` (the CLI adds them to its subparser)."""
    p.add_argument("--model", type=Path, help="GGUF file (any shard of a split set)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--threads", type=int, default=16, help="fastload threads (capped by usable CPUs) [16]")
    p.add_argument("--repeats", type=int, default=5, help="warm-cache repeats (median reported) [5]")
    p.add_argument("--cold-repeats", type=int, default=1, help="cold-cache repeats; 0 skips cold runs [1]")
    p.add_argument("--no-llamacpp", action="store_true", help="skip the llama.cpp column")
    p.add_argument(
        "--no-prefault",
        action="store_true",
        help="do not hand loaders host-backed memory (see prefault_free_memory)",
    )
    p.add_argument("--make-synthetic", type=Path, metavar="FILE", help="write a synthetic MoE GGUF and exit")
    p.add_argument("--size-gib", type=float, default=4.5, help="size of --make-synthetic [4.5]")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark (or write the synthetic model); prints the table or JSON. Returns 0."""
    from moe_service.log import configure_logging

    configure_logging("warning", "auto")  # on stderr: stdout is the report
    say = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
    if args.make_synthetic:
        t0 = time.perf_counter()
        make_synthetic(args.make_synthetic, args.size_gib)
        say(
            f"wrote {args.make_synthetic} ({args.make_synthetic.stat().st_size / GiB:.2f} GiB) "
            f"in {time.perf_counter() - t0:.1f} s"
        )
        return 0
    if not args.model:
        raise SystemExit("bench fastload: --model FILE is required")
    r = run_bench(
        args.model,
        threads=args.threads,
        repeats=args.repeats,
        cold_repeats=args.cold_repeats,
        llamacpp=not args.no_llamacpp,
        prefault=not args.no_prefault,
        log=say,
    )
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        print(format_table(r))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="moe-service bench fastload", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
