"""Grammar engines side by side on a model's vocabulary, and the mask's cost in the engine.

Part 1 (``engines``): llguidance, xgrammar and outlines-core, each given the same tokenizer
(the GGUF's token bytes, end-of-generation ids as stop tokens) and the same JSON schema,
walk the same valid token path (a fixed JSON answer tokenized by the model's tokenizer):
tokenizer build time, schema compile time, and per token the mask computation (+ accepting
the token), median and p90 in microseconds. An engine that is not importable is reported as
such (xgrammar needs ``transformers`` at import).

Part 2 (``decode``): the demo model's decode speed, greedy, one sequence, the same number of
tokens with and without a json_schema constraint applied on the engine's sampling path
(moe_service.engine.engine.Sequence), alternating runs; the mask's cost is the difference
in tokens per second.

    PYTHONPATH=$PWD python -m bench.grammar [--model PATH] [--tokens 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "maxLength": 40},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["admin", "user", "guest"]}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "active"],
    "additionalProperties": False,
}
ANSWER = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["admin", "user"], "active": True}


def _stats(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"median_us": round(statistics.median(xs) * 1e6, 1), "p90_us": round(xs[int(0.9 * (len(xs) - 1))] * 1e6, 1)}


def bench_engines(tok) -> dict:
    from moe_service.api.grammar import JSON_OPTIONS, _TokenizerView

    view = _TokenizerView(tok)
    text = json.dumps(ANSWER, separators=(", ", ": "))
    path = tok.encode(text, add_special=False) + [view.eos_token_id]
    out: dict = {"vocab": tok.n_vocab, "path_tokens": len(path)}

    # llguidance
    import llguidance

    t0 = time.perf_counter()
    llt = llguidance.LLTokenizer(llguidance.TokenizerWrapper(view), n_vocab=tok.n_vocab, eos_token=view.eog_ids)
    t1 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults=JSON_OPTIONS)
    m = llguidance.LLMatcher(llt, grammar, log_level=0)
    t2 = time.perf_counter()
    import numpy as np

    mask = np.zeros((tok.n_vocab + 31) // 32, dtype=np.int32)
    times = []
    for t in path:
        a = time.perf_counter()
        m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        ok = (mask[t // 32] >> (t % 32)) & 1
        m.consume_token(t)
        times.append(time.perf_counter() - a)
        assert ok, f"llguidance refused token {t}"
    out["llguidance"] = {"tokenizer_s": round(t1 - t0, 3), "compile_s": round(t2 - t1, 4), **_stats(times)}

    # xgrammar
    try:
        import torch
        import xgrammar as xgr

        t0 = time.perf_counter()
        info = xgr.TokenizerInfo([b.removeprefix(b"\xff") if i in set(view.special_token_ids) else b
                                  for i, b in enumerate(view.tokens)],
                                 vocab_type=xgr.VocabType.RAW, vocab_size=tok.n_vocab,
                                 stop_token_ids=view.eog_ids, add_prefix_space=False)
        compiler = xgr.GrammarCompiler(info, max_threads=1)
        t1 = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(", ", ": "))
        t2 = time.perf_counter()
        matcher = xgr.GrammarMatcher(compiled)
        bm = xgr.allocate_token_bitmask(1, tok.n_vocab)
        times = []
        for t in path:
            a = time.perf_counter()
            matcher.fill_next_token_bitmask(bm)
            ok = (int(bm[0, t // 32]) >> (t % 32)) & 1
            matcher.accept_token(t)
            times.append(time.perf_counter() - a)
            assert ok, f"xgrammar refused token {t}"
        del torch
        out["xgrammar"] = {"tokenizer_s": round(t1 - t0, 3), "compile_s": round(t2 - t1, 4), **_stats(times)}
    except ImportError as e:
        out["xgrammar"] = {"error": f"not importable: {e}"}

    # outlines-core (regex from the schema, then an index over the whole vocabulary)
    try:
        from outlines_core import Guide, Index, Vocabulary
        from outlines_core.json_schema import build_regex_from_schema

        t0 = time.perf_counter()
        eos = view.eos_token_id
        vmap: dict[bytes, list[int]] = {}
        for i, b in enumerate(view.tokens):
            if i in view.eog_ids or b.startswith(b"\xff") or not b:
                continue
            vmap.setdefault(b, []).append(i)
        vocab = Vocabulary(eos, vmap)
        t1 = time.perf_counter()
        regex = build_regex_from_schema(json.dumps(SCHEMA), whitespace_pattern="")
        index = Index(regex, vocab)
        t2 = time.perf_counter()
        guide = Guide(index)
        times = []
        walked = 0
        compact = tok.encode(json.dumps(ANSWER, separators=(",", ":")), add_special=False)
        for t in compact:  # its regex has no spaces after separators: the compact form of ANSWER
            a = time.perf_counter()
            allowed = guide.get_tokens()
            ok = t in allowed
            if not ok:
                break
            guide.advance(t)
            times.append(time.perf_counter() - a)
            walked += 1
        entry = {"tokenizer_s": round(t1 - t0, 3), "compile_s": round(t2 - t1, 4)}
        if times:
            entry.update(_stats(times))
        if walked < len(compact):
            entry["note"] = f"refused the compact path at token {walked}: timed on the tokens it walked"
        out["outlines_core"] = entry
    except ImportError as e:
        out["outlines_core"] = {"error": f"not importable: {e}"}
    return out


def bench_decode(model_path: str, n_tokens: int, rounds: int) -> dict:
    """Greedy decode of ``n_tokens`` on one sequence, free vs under a JSON-schema constraint
    (mask computed and applied on the sampling path, serially: the batch loop overlaps the
    computation with the forward pass, so this is the upper bound of its cost)."""
    import numpy as np
    import torch

    from moe_service.api.grammar import compile_constraint, json_schema_grammar
    from moe_service.engine.engine import Engine, GenerationRequest
    from moe_service.engine.model import Model
    from moe_service.engine.ops import CpuOps
    from moe_service.engine.sampler import SamplingParams
    from moe_service.engine.tokenizer import Tokenizer
    from moe_service.gguf_model import GGUFModel
    from moe_service.weights import WeightStore

    torch.set_num_threads(1)
    ops = CpuOps(threads=0)
    cat = GGUFModel.open(model_path)
    model = Model(cat, WeightStore.load_simple(cat), ops, n_seq=1, n_ctx=64 + n_tokens + 64)
    tok = Tokenizer.from_gguf(cat.metadata, source=model_path)
    engine = Engine(model, tok, model_name="bench")
    prompt, _ = engine.render_chat([{"role": "user", "content": "Write a long story about a robot, as JSON."}])
    # a schema that lets the model write n_tokens: one long string
    long_schema = {"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"]}
    grammar = json_schema_grammar(long_schema)

    def run(constrained: bool) -> dict:
        constraint = compile_constraint(tok, grammar) if constrained else None
        req = GenerationRequest(list(prompt), n_tokens, SamplingParams(temperature=0.0), ignore_eos=True,
                                constraint=constraint)
        seq = engine.new_sequence(req)
        slot = model.kv.alloc()
        try:
            logits = model.step([(slot, seq.prompt_ids)])
            seq.n_prefilled = len(seq.prompt_ids)
            t0 = time.perf_counter()
            n = 0
            accept_s, step_s = [], []
            while True:
                a = time.perf_counter()
                ev = seq.accept(logits[0].numpy())
                accept_s.append(time.perf_counter() - a)
                n += 1
                if ev.final:
                    break
                a = time.perf_counter()
                logits = model.step([(slot, seq.next_input())])
                step_s.append(time.perf_counter() - a)
            dt = time.perf_counter() - t0
        finally:
            model.kv.free(slot)
        out = {"tokens": n, "tok_per_s": n / dt, "accept_ms": 1e3 * float(np.median(accept_s)),
               "step_ms": 1e3 * float(np.median(step_s))}
        if constraint is not None:
            out["mask_ms_mean"] = 1e3 * constraint.mask_s / max(1, constraint.masks)
            out["text"] = tok.decode(seq.generated)[:80]
        return out

    free, cons = [], []
    for _ in range(rounds):
        free.append(run(False))
        cons.append(run(True))
    ops.close()
    f = float(np.median([r["tok_per_s"] for r in free]))
    c = float(np.median([r["tok_per_s"] for r in cons]))
    acc_f = float(np.median([r["accept_ms"] for r in free]))
    acc_c = float(np.median([r["accept_ms"] for r in cons]))
    step = float(np.median([r["step_ms"] for r in free + cons]))
    # the mask's cost per token: the extra sampling time under the constraint (mask computed
    # and applied serially here), over a free token's whole time (forward step + sampling)
    cost = (acc_c - acc_f) / (step + acc_f)
    return {"free_tok_per_s": round(f, 2), "constrained_tok_per_s": round(c, 2),
            "wall_cost_pct": round(100 * (f - c) / f, 2),
            "step_ms_median": round(step, 2), "sample_ms_free": round(acc_f, 3), "sample_ms_constrained": round(acc_c, 3),
            "mask_cost_pct": round(100 * cost, 3),
            "tok_per_s_at_mask_cost": round(1e3 / (step + acc_c), 2), "tok_per_s_free_model": round(1e3 / (step + acc_f), 2),
            "mask_ms_mean": round(float(np.median([r["mask_ms_mean"] for r in cons])), 4),
            "tokens": [r["tokens"] for r in cons], "sample": cons[-1]["text"],
            "rounds": rounds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF (default: the demo model in the cache dir)")
    ap.add_argument("--part", choices=["engines", "decode", "all"], default="all")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from moe_service.engine.tokenizer import Tokenizer
    from moe_service.paths import demo_model_path

    path = args.model or str(demo_model_path())
    tok = Tokenizer.from_file(path)
    if args.part in ("engines", "all"):
        print(json.dumps({"engines": bench_engines(tok)}, indent=1))
    if args.part in ("decode", "all"):
        print(json.dumps({"decode": bench_decode(path, args.tokens, args.rounds)}, indent=1))


if __name__ == "__main__":
    main()
