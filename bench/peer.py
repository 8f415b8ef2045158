"""The peer we measure against: llama.cpp, timed through llama-cpp-python.

Each function returns a :class:`PeerResult`: ``value`` in its ``unit`` (``None`` with a
``reason`` when llama.cpp cannot be measured: llama_cpp is not installed, the file is
missing, the load failed), plus the settings used and how many cores other processes used during
the timed part, so a number measured while other work was running says so.

    load_gbps        Llama(path, use_mmap=False): file bytes / wall seconds of the load
    prefill_tok_s    one n_prompt-token batch through the model / wall seconds
    decode_tok_s     n_decode single-token evals after a short prompt / wall seconds

Thread counts are llama.cpp's ``n_threads`` (decode) and ``n_threads_batch`` (prefill);
compare with our engine at the same count. Command line:

    python -m bench.peer MODEL.gguf [--threads 2] [--decode 64] [--prompt 128] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class PeerResult:
    """One llama.cpp measurement.

    Attributes:
        metric: ``load_gbps``, ``prefill_tok_s`` or ``decode_tok_s``.
        value: the measurement, or ``None`` when it could not be taken.
        unit: ``GB/s`` or ``tok/s``.
        reason: why ``value`` is ``None`` (``None`` when measured).
        settings: model path, threads, token counts, llama.cpp version.
        machine: CPU use during the timed part: ``self_cores`` (llama.cpp), ``other_cores``
            (every other process, from /proc/stat) and ``busy`` (other_cores > 0.25: the
            number was measured while other work was running).
        seconds: wall time of the timed part.
    """

    metric: str
    value: float | None
    unit: str
    reason: str | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    machine: dict[str, Any] = field(default_factory=dict)
    seconds: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def llama_cpp_unavailable_reason() -> str | None:
    """``None`` when llama_cpp imports, else one sentence saying why and how to install it."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as exc:
        return (f"llama-cpp-python is not installed ({exc}); install the 'peer' extra: "
                "pip install 'llama-cpp-python>=0.3.10' (builds llama.cpp, ~10 min on 2 cores)")
    except OSError as exc:  # the shared library failed to load
        return f"llama-cpp-python is installed but its llama.cpp library failed to load: {exc}"
    return None


def _version() -> dict[str, str]:
    import llama_cpp

    return {"llama_cpp_python": llama_cpp.__version__, "llama_cpp": llama_cpp.llama_version().decode()}


def _system_busy_s() -> float | None:
    """Seconds of CPU time all processes have used since boot (/proc/stat's cpu line)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class _CpuWindow:
    """Measures, over a timed window, how many cores other processes kept busy.

    System-wide busy CPU time (/proc/stat) minus this process's own CPU time (all its
    threads, os.times), divided by wall time: ~0 on a quiet machine; 1.0 means another
    process used a whole core the entire time.
    """

    def __init__(self, threads: int):
        self.threads = threads

    def __enter__(self) -> _CpuWindow:
        t = os.times()
        self._self0 = t.user + t.system
        self._sys0 = _system_busy_s()
        self._wall0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        t = os.times()
        wall = time.perf_counter() - self._wall0
        sys1 = _system_busy_s()
        self_cpu = t.user + t.system - self._self0
        load1, load5, _ = os.getloadavg()
        self.report: dict[str, Any] = {
            "cpu_count": os.cpu_count(), "threads": self.threads, "load_avg_1m": round(load1, 2),
            "load_avg_5m": round(load5, 2), "self_cores": round(self_cpu / wall, 2) if wall > 0 else None,
        }
        if sys1 is not None and self._sys0 is not None and wall > 0:
            other = max(0.0, (sys1 - self._sys0 - self_cpu) / wall)
            self.report["other_cores"] = round(other, 2)
            self.report["busy"] = other > 0.25
        else:
            self.report["other_cores"] = None
            self.report["busy"] = None


def _check(path: Path, metric: str, unit: str, settings: dict[str, Any]) -> PeerResult | None:
    """The result to return at once when llama.cpp or the model file is missing; else None,
    after adding llama.cpp's version to ``settings``."""
    reason = llama_cpp_unavailable_reason()
    if reason is None and not path.is_file():
        reason = f"model file {path} does not exist"
    if reason is not None:
        return PeerResult(metric, None, unit, reason=reason, settings=settings)
    settings.update(_version())
    return None


def _open(path: Path, threads: int, n_ctx: int, n_batch: int):
    import llama_cpp

    return llama_cpp.Llama(str(path), n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, n_threads=threads,
                           n_threads_batch=threads, use_mmap=False, logits_all=False, seed=0, verbose=False)


def _prompt_ids(llm, n: int) -> list[int]:
    """n token ids of ordinary text (the same for every model with this vocabulary)."""
    text = ("The quick brown fox jumps over the lazy dog while the experts sit on their nodes. " * 64)
    ids = llm.tokenize(text.encode(), add_bos=False, special=False)
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def measure_load(path: str | Path, threads: int = 2) -> PeerResult:
    """Load time of ``path`` with use_mmap=False (the whole file read into memory), as GB/s.

    The page cache state is not controlled: a file read recently loads from memory. The
    result's settings record the file size; compare with our fastload on the same file state.
    """
    path = Path(path)
    settings: dict[str, Any] = {"model": str(path), "threads": threads, "use_mmap": False}
    early = _check(path, "load_gbps", "GB/s", settings)
    if early:
        return early
    settings.update(file_bytes=path.stat().st_size)
    try:
        with _CpuWindow(threads) as win:
            t0 = time.perf_counter()
            llm = _open(path, threads, n_ctx=256, n_batch=256)
            dt = time.perf_counter() - t0
    except Exception as exc:  # llama_cpp raises ValueError/RuntimeError on a bad file
        return PeerResult("load_gbps", None, "GB/s", reason=f"llama.cpp failed to load {path}: {exc}",
                          settings=settings)
    del llm
    return PeerResult("load_gbps", settings["file_bytes"] / dt / 1e9, "GB/s", settings=settings,
                      machine=win.report, seconds=dt)


def measure_prefill(path: str | Path, threads: int = 2, n_prompt: int = 128, repeats: int = 3) -> PeerResult:
    """Prefill speed: one ``n_prompt``-token batch (n_batch = n_prompt), best of ``repeats``, tok/s."""
    path = Path(path)
    settings: dict[str, Any] = {"model": str(path), "n_threads_batch": threads, "n_prompt": n_prompt,
                                "repeats": repeats}
    early = _check(path, "prefill_tok_s", "tok/s", settings)
    if early:
        return early
    llm = _open(path, threads, n_ctx=max(512, n_prompt + 16), n_batch=n_prompt)
    ids = _prompt_ids(llm, n_prompt)
    llm.eval(ids[:8])  # warm-up: first-call allocations
    best = float("inf")
    with _CpuWindow(threads) as win:
        for _ in range(repeats):
            llm.reset()
            t0 = time.perf_counter()
            llm.eval(ids)
            best = min(best, time.perf_counter() - t0)
    del llm
    return PeerResult("prefill_tok_s", n_prompt / best, "tok/s", settings=settings, machine=win.report,
                      seconds=best)


def measure_decode(path: str | Path, threads: int = 2, n_decode: int = 64, n_prompt: int = 16) -> PeerResult:
    """Decode speed: after an ``n_prompt``-token prompt, ``n_decode`` single-token evals, tok/s.

    The fed tokens are fixed prompt ids (no sampling), so the time is llama.cpp's forward
    pass plus llama-cpp-python's per-call overhead (copying one logits row).
    """
    path = Path(path)
    settings: dict[str, Any] = {"model": str(path), "n_threads": threads, "n_decode": n_decode,
                                "n_prompt": n_prompt}
    early = _check(path, "decode_tok_s", "tok/s", settings)
    if early:
        return early
    llm = _open(path, threads, n_ctx=max(256, n_prompt + n_decode + 16), n_batch=max(n_prompt, 32))
    ids = _prompt_ids(llm, n_prompt + n_decode)
    llm.eval(ids[:n_prompt])
    llm.eval([ids[n_prompt]])  # warm-up decode step
    steps = ids[n_prompt + 1:n_prompt + 1 + n_decode]
    with _CpuWindow(threads) as win:
        t0 = time.perf_counter()
        for t in steps:
            llm.eval([t])
        dt = time.perf_counter() - t0
    del llm
    return PeerResult("decode_tok_s", len(steps) / dt, "tok/s", settings=settings, machine=win.report, seconds=dt)


def measure_depth(path: str | Path, ids: list[int], threads: int = 2, n_decode: int = 32, n_batch: int = 512,
                  flash_attn: bool = False) -> dict[str, PeerResult]:
    """Long-context speed: prefill of ``ids`` (the depth D = len(ids), in n_batch-token
    batches), one untimed single-token eval, then ``n_decode`` timed ones at depth D+1..D+n_decode. Returns
    {"prefill": PeerResult tok/s, "decode": PeerResult tok/s}; ``flash_attn``: llama.cpp's
    flash-attention path (llama-cpp-python's default is off)."""
    path = Path(path)
    depth = len(ids)
    settings: dict[str, Any] = {"model": str(path), "n_threads": threads, "depth": depth, "n_decode": n_decode,
                                "n_batch": n_batch, "flash_attn": flash_attn}
    early = _check(path, "depth_tok_s", "tok/s", settings)
    if early:
        return {"prefill": early, "decode": early}
    import llama_cpp

    llm = llama_cpp.Llama(str(path), n_ctx=depth + n_decode + 16, n_batch=n_batch, n_ubatch=n_batch,
                          n_threads=threads, n_threads_batch=threads, use_mmap=False, logits_all=False, seed=0,
                          verbose=False, flash_attn=flash_attn)
    llm.eval(ids[:8])  # warm-up: first-call allocations
    llm.reset()
    with _CpuWindow(threads) as win:
        t0 = time.perf_counter()
        llm.eval(list(ids))
        t_prefill = time.perf_counter() - t0
        steps = [ids[i % depth] for i in range(n_decode)]
        llm.eval([ids[-1]])  # one untimed step at this depth, as bench.decode's side takes
        t0 = time.perf_counter()
        for t in steps:
            llm.eval([t])
        t_decode = time.perf_counter() - t0
    del llm
    return {"prefill": PeerResult("prefill_tok_s", depth / t_prefill, "tok/s", settings=settings, machine=win.report,
                                  seconds=t_prefill),
            "decode": PeerResult("decode_tok_s", n_decode / t_decode, "tok/s", settings=settings, machine=win.report,
                                 seconds=t_decode)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.peer", description="Time llama.cpp on a GGUF file.")
    ap.add_argument("model", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode", type=int, default=64, help="decode steps to time")
    ap.add_argument("--prompt", type=int, default=128, help="prefill batch size in tokens")
    ap.add_argument("--skip", nargs="*", default=[], choices=["load", "prefill", "decode"])
    ap.add_argument("--json", type=Path, default=None, help="append results as JSON lines to this file")
    args = ap.parse_args(argv)
    results = []
    if "load" not in args.skip:
        results.append(measure_load(args.model, args.threads))
    if "prefill" not in args.skip:
        results.append(measure_prefill(args.model, args.threads, n_prompt=args.prompt))
    if "decode" not in args.skip:
        results.append(measure_decode(args.model, args.threads, n_decode=args.decode))
    for r in results:
        if r.value is None:
            print(f"{r.metric}: not measured: {r.reason}")
        else:
            m = r.machine
            busy = " (other work was running)" if m.get("busy") else ""
            print(f"{r.metric}: {r.value:.2f} {r.unit}{busy}  other processes used {m.get('other_cores')} cores, "
                  f"llama.cpp {m.get('self_cores')} cores")
    if args.json:
        with open(args.json, "a") as f:
            for r in results:
                f.write(json.dumps(r.to_dict()) + "\n")
    return 0 if all(r.value is not None for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
