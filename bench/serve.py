"""`moe-service bench serve`: start-up and decode throughput of the whole service, over HTTP.

::

    spawn `moe-service serve` (fresh kernel cache)  -> READY=1 time, cold      -> SIGTERM
    spawn again (same kernel cache)                 -> READY=1 time, warm
      one stream,  N tokens (greedy, ignore_eos)    -> tok/s single
      K streams at once, N tokens each              -> tok/s aggregate, ratio to single (goal >= 2x:
                                                       the K sequences share every expert read)
    SIGTERM -> exit code

Token timings come from the SSE chunks as the client sees them: ``decode_tok_s`` =
(n - 1) / (last token time - first token time) per stream; ``e2e_tok_s`` = n / request wall
time (prefill included). The aggregate uses the union window of the K streams. The machine's
load average and its busiest other processes are recorded with the numbers, since the
throughput of a 2-core box depends on what else runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def _service_proc():
    spec = importlib.util.spec_from_file_location("moe_bench_service_proc", REPO / "tests" / "e2e" / "service_proc.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["moe_bench_service_proc"] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


def busy_processes(limit: int = 6) -> list[str]:
    """The busiest processes right now (``ps``), excluding this one: what else is running."""
    try:
        out = subprocess.run(["ps", "-eo", "pid,pcpu,comm", "--sort=-pcpu"], capture_output=True, text=True,
                             timeout=5).stdout.splitlines()[1:]
    except (OSError, subprocess.SubprocessError):
        return []
    rows = []
    for line in out:
        pid, pcpu, comm = line.split(None, 2)
        if int(pid) != os.getpid() and float(pcpu) >= 5.0:
            rows.append(f"{comm.strip()} {pcpu}%")
    return rows[:limit]


def stream_one(url: str, model: str, max_tokens: int, prompt: str = PROMPT) -> dict:
    """One streamed completion; returns token count and client-side timings (s)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.monotonic()
    stamps: list[float] = []
    usage = None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if obj.get("error"):
                raise RuntimeError(obj["error"]["message"])
            if obj.get("usage"):
                usage = obj["usage"]
            elif obj["choices"] and obj["choices"][0]["text"]:
                stamps.append(time.monotonic())
    t1 = time.monotonic()
    n = usage["completion_tokens"] if usage else len(stamps)
    return {"tokens": n, "t_start": t0, "t_first": stamps[0] if stamps else t1,
            "t_last": stamps[-1] if stamps else t1, "t_end": t1}


def measure_streams(url: str, model: str, streams: int, max_tokens: int) -> dict:
    """``streams`` concurrent streams started together; aggregate and per-stream rates."""
    results: list[dict] = [None] * streams  # type: ignore[list-item]
    barrier = threading.Barrier(streams)

    def run(i: int) -> None:
        barrier.wait()
        results[i] = stream_one(url, model, max_tokens, f"{PROMPT} ({i + 1})")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    total = sum(r["tokens"] for r in results)
    wall = max(r["t_end"] for r in results) - min(r["t_start"] for r in results)
    decode_window = max(r["t_last"] for r in results) - min(r["t_first"] for r in results)
    return {
        "streams": streams,
        "tokens": total,
        "wall_s": round(wall, 3),
        "e2e_tok_s": round(total / wall, 3),
        "decode_tok_s": round(sum(r["tokens"] - 1 for r in results) / decode_window, 3) if decode_window > 0 else None,
        "ttft_s": round(max(r["t_first"] - r["t_start"] for r in results), 3),
    }


def run_bench(model_path: Path, *, max_tokens: int = 64, streams: int = 4, cache_root: Path | None = None) -> dict:
    """The whole benchmark (module docstring); returns the report as a dict."""
    sp_mod = _service_proc()
    cache_root = cache_root or Path(tempfile.mkdtemp(prefix="moe-bench-cache-"))
    kernel_cache = Path(tempfile.mkdtemp(prefix="moe-bench-numba-"))
    report: dict = {
        "model": str(model_path),
        "cpu_count": os.cpu_count(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "busy_processes_at_start": busy_processes(),
        "max_tokens": max_tokens,
    }
    cold = sp_mod.start_service(model_path, cache_root, numba_cache_dir=str(kernel_cache), poll_health=False)
    report["ready_cold_s"] = round(cold.ready_s, 3)
    cold.terminate()
    cold.close()
    warm = sp_mod.start_service(model_path, cache_root, numba_cache_dir=str(kernel_cache), poll_health=False)
    report["ready_warm_s"] = round(warm.ready_s, 3)
    try:
        model_id = httpx.get(f"{warm.url}/v1/models").json()["data"][0]["id"]
        stream_one(warm.url, model_id, 4)  # first request through the HTTP path
        single = measure_streams(warm.url, model_id, 1, max_tokens)
        multi = measure_streams(warm.url, model_id, streams, max_tokens)
        report["single"] = single
        report["concurrent"] = multi
        report["ratio_e2e"] = round(multi["e2e_tok_s"] / single["e2e_tok_s"], 3)
        if single["decode_tok_s"] and multi["decode_tok_s"]:
            report["ratio_decode"] = round(multi["decode_tok_s"] / single["decode_tok_s"], 3)
    finally:
        report["exit_code"] = warm.terminate()
        warm.close()
    report["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    return report


def format_report(r: dict) -> str:
    s, m = r.get("single", {}), r.get("concurrent", {})
    lines = [
        f"model                 {r['model']}",
        f"READY, cold kernels   {r['ready_cold_s']:.2f} s",
        f"READY, warm kernels   {r['ready_warm_s']:.2f} s",
        f"1 stream              {s.get('decode_tok_s')} tok/s decode, {s.get('e2e_tok_s')} tok/s end to end "
        f"({s.get('tokens')} tokens, TTFT {s.get('ttft_s')} s)",
        f"{m.get('streams')} streams             {m.get('decode_tok_s')} tok/s decode, {m.get('e2e_tok_s')} tok/s "
        f"end to end ({m.get('tokens')} tokens, worst TTFT {m.get('ttft_s')} s)",
        f"ratio                 {r.get('ratio_decode')}x decode, {r.get('ratio_e2e')}x end to end (goal >= 2x)",
        f"machine               {r['cpu_count']} CPUs, load {r['load_average_at_start']} -> "
        f"{r['load_average_at_end']}, busy: {', '.join(r['busy_processes_at_start']) or 'nothing else'}",
        f"exit code on SIGTERM  {r.get('exit_code')}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None, *, model_path: Path | None = None) -> int:
    p = argparse.ArgumentParser(prog="moe-service bench serve", description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--model", help="GGUF to serve (default: the demo model)")
    p.add_argument("--tokens", type=int, default=64, help="tokens per stream (default 64)")
    p.add_argument("--streams", type=int, default=4, help="concurrent streams (default 4)")
    args = p.parse_args(argv)
    if args.model:
        model_path = Path(args.model)
    if model_path is None:
        from moe_service.paths import demo_model_path

        model_path = demo_model_path()
    if not model_path.exists():
        print(f"moe-service bench serve: {model_path} does not exist (run `moe-service demo-model`)", file=sys.stderr)
        return 2
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    report = run_bench(model_path, max_tokens=args.tokens, streams=args.streams)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
