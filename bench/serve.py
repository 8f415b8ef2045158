"""`moe-service bench serve`: start-up and decode throughput of the whole service, over HTTP.

::

    spawn `moe-service serve` (fresh kernel cache)  -> READY=1 time, cold      -> SIGTERM
    spawn again (same kernel cache)                 -> READY=1 time, warm
      one stream,  N tokens (greedy, ignore_eos)    -> tok/s single
      K streams at once, N tokens each              -> tok/s aggregate, ratio to single (goal >= 2x:
                                                       the K sequences share every expert read)
    SIGTERM -> exit code

    --prefix: one service; the shared prefix (~3000 tokens) + question 1   -> TTFT cold
              the same prefix + questions 2..5 (one at a time)         -> TTFT reused (median),
              usage.prompt_tokens_details.cached_tokens of each; ratio cold / reused (goal >= 10x)
              the first prompt again (now cached): text and top-5 logprobs equal to the cold run's

Token timings come from the SSE chunks as the client sees them: ``decode_tok_s`` =
(n - 1) / (last token time - first token time) per stream; ``e2e_tok_s`` = n / request wall
time (prefill included). The aggregate uses the union window of the K streams. The machine's
load average and its busiest other processes are recorded with the numbers, since the
throughput of a 2-core box depends on what else runs.
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

import httpx

REPO = Path(__file__).resolve().parents[1]
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


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
    from bench import service_proc as sp_mod
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


PREFIX_PARAGRAPH = ("You are a careful assistant for a fleet of inference servers. Tools: read_file(path), "
                    "list_nodes(), restart(unit), query_metrics(name, window_s). Answer briefly and cite the "
                    "metric you used. The conversation so far follows. ")
QUESTIONS = ["How many nodes are there?", "Which unit restarts the engine?", "What does TTFT measure?",
             "Why is the prefix cached?", "What is a KV cache?", "Name one metric."]


def prefix_prompt(model_path: Path, n_tokens: int) -> str:
    """A shared prefix of about ``n_tokens`` tokens of the model (PREFIX_PARAGRAPH repeated,
    counted with the model's own tokenizer)."""
    from moe_service.engine.tokenizer import Tokenizer
    from moe_service.gguf_model import GGUFModel

    tok = Tokenizer.from_gguf(GGUFModel.open(model_path).metadata, source=str(model_path))
    per = len(tok.encode(PREFIX_PARAGRAPH, add_special=False, parse_special=False))
    return PREFIX_PARAGRAPH * max(1, round(n_tokens / max(1, per)))


def run_prefix_bench(model_path: Path, *, prefix_tokens: int = 3000, questions: int = 4, max_tokens: int = 8,
                     cache_root: Path | None = None) -> dict:
    """`bench serve --prefix`: one warm service; a request with the shared prefix and a first
    question (cold: nothing cached), then ``questions`` requests with the same prefix and other
    questions, one at a time. TTFT of each (client side, first streamed token), the prompt and
    cached token counts from usage, and the cold / median-reused TTFT ratio (goal >= 10x)."""
    from bench import service_proc as sp_mod
    cache_root = cache_root or Path(tempfile.mkdtemp(prefix="moe-bench-cache-"))
    kernel_cache = os.environ.get("NUMBA_CACHE_DIR") or str(Path(tempfile.mkdtemp(prefix="moe-bench-numba-")))
    prefix = prefix_prompt(model_path, prefix_tokens)
    report: dict = {"model": str(model_path), "cpu_count": os.cpu_count(), "prefix_tokens_asked": prefix_tokens,
                    "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
                    "busy_processes_at_start": busy_processes(), "max_tokens": max_tokens}
    svc = sp_mod.start_service(model_path, cache_root, numba_cache_dir=kernel_cache, poll_health=False)
    report["ready_s"] = round(svc.ready_s, 3)
    try:
        model_id = httpx.get(f"{svc.url}/v1/models").json()["data"][0]["id"]
        stream_one(svc.url, model_id, 2)  # first request through the HTTP path (short, unrelated prompt)
        runs = []
        for i in range(questions + 1):
            r = stream_one_usage(svc.url, model_id, max_tokens, prefix + "\nQuestion: " + QUESTIONS[i % len(QUESTIONS)],
                                 logprobs=5 if i == 0 else None)
            runs.append(r)
            print(f"  request {i}: TTFT {r['ttft_s']:.3f} s, prompt {r['prompt_tokens']} tokens, "
                  f"cached {r['cached_tokens']}", file=sys.stderr, flush=True)
        # the first request's prompt again, now from the cache: greedy output and log-probabilities
        # (top 5, from the logits) must equal the cold run's, bit for bit
        again = stream_one_usage(svc.url, model_id, max_tokens, prefix + "\nQuestion: " + QUESTIONS[0], logprobs=5)
        print(f"  request 0 again: TTFT {again['ttft_s']:.3f} s, cached {again['cached_tokens']}", file=sys.stderr,
              flush=True)
        report["repeat"] = {k: again[k] for k in ("ttft_s", "total_s", "prompt_tokens", "cached_tokens")}
        report["outputs_identical"] = (again["text"], again["logprobs"]) == (runs[0]["text"], runs[0]["logprobs"])
        cold = runs[0]["ttft_s"]
        reused = sorted(r["ttft_s"] for r in runs[1:])
        med = reused[len(reused) // 2] if len(reused) % 2 else (reused[len(reused) // 2 - 1] + reused[len(reused) // 2]) / 2
        for r in runs:
            r.pop("text"), r.pop("logprobs")
        report.update(runs=runs, ttft_cold_s=round(cold, 3), ttft_reused_median_s=round(med, 3),
                      ttft_ratio=round(cold / med, 2) if med > 0 else None)
    finally:
        report["exit_code"] = svc.terminate()
        svc.close()
    report["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    return report


def stream_one_usage(url: str, model: str, max_tokens: int, prompt: str, logprobs: int | None = None) -> dict:
    """One streamed completion: TTFT (s), usage (prompt, cached tokens), the text, and with
    ``logprobs`` each chunk's ``logprobs`` object (the sampled tokens' and the top
    alternatives' log-probabilities)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    if logprobs is not None:
        body["logprobs"] = logprobs
    t0 = time.monotonic()
    t_first = None
    usage: dict = {}
    text: list[str] = []
    lps: list = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=1200) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if obj.get("error"):
                raise RuntimeError(obj["error"]["message"])
            if obj.get("usage"):
                usage = obj["usage"]
            if obj.get("choices"):
                if t_first is None:
                    t_first = time.monotonic()
                choice = obj["choices"][0]
                text.append(choice.get("text") or "")
                if choice.get("logprobs"):
                    lps.append(choice["logprobs"])
    t1 = time.monotonic()
    return {"ttft_s": round((t_first or t1) - t0, 4), "total_s": round(t1 - t0, 4),
            "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
            "text": "".join(text), "logprobs": lps}


def format_prefix_report(r: dict) -> str:
    lines = [f"model                 {r['model']}",
             f"shared prefix         {r['runs'][0]['prompt_tokens']} prompt tokens in the first request"]
    for i, run in enumerate(r["runs"]):
        lines.append(f"request {i}             TTFT {run['ttft_s']:.3f} s, cached {run['cached_tokens']} of "
                     f"{run['prompt_tokens']} prompt tokens")
    lines += [f"TTFT cold / reused    {r['ttft_cold_s']} s / {r['ttft_reused_median_s']} s (median): "
              f"{r['ttft_ratio']}x (goal >= 10x)",
              f"request 0 again       TTFT {r['repeat']['ttft_s']:.3f} s, cached {r['repeat']['cached_tokens']}: "
              f"text and top-5 logprobs {'identical to' if r['outputs_identical'] else 'DIFFERENT from'} the cold run",
              f"machine               {r['cpu_count']} CPUs, load {r['load_average_at_start']} -> "
              f"{r['load_average_at_end']}, busy: {', '.join(r['busy_processes_at_start']) or 'nothing else'}"]
    return "\n".join(lines)


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
    p.add_argument("--prefix", action="store_true",
                   help="prefix cache: a shared prefix then different questions; TTFT cold vs reused")
    p.add_argument("--prefix-tokens", type=int, default=3000, help="shared prefix length (default 3000)")
    p.add_argument("--questions", type=int, default=4, help="requests after the first one (default 4)")
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
    if args.prefix:
        report = run_prefix_bench(model_path, prefix_tokens=args.prefix_tokens, questions=args.questions,
                                  max_tokens=min(args.tokens, 16))
        print(json.dumps(report, indent=2) if args.json else format_prefix_report(report))
        return 0
    report = run_bench(model_path, max_tokens=args.tokens, streams=args.streams)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
