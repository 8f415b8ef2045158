"""sha256 of the synthetic writers' files over every preset and the main options, to prove a
refactor of moe_service/synth/ leaves every byte as it was.

Writes each case (every preset of the four writers; real-shape presets sparse; every expert
type incl. the i-quants; --tensor-types recipes; deepseek4 ratios; metadata overrides;
vocab-only files; the five ``python -m`` commands) into OUTDIR, prints ``CASE SHA256`` and
deletes the file. It imports the writers by their old module paths (moe_service.synth,
synth_deepseek2, synth_deepseek4, synth_gpt_oss), so it runs on trees before and after the
package. Compare two trees (a few minutes each, ~1 GB free disk)::

    git archive REV moe_service | tar -x -C /tmp/before
    (cd /tmp/before && PYTHONPATH=. python $PWD/tools/synth_digests.py /tmp/out-a) | grep -E '^[^ ]+ [0-9a-f]{64}$' > a
    PYTHONPATH=. python tools/synth_digests.py /tmp/out-b | grep -E '^[^ ]+ [0-9a-f]{64}$' > b
    diff a b

An optional second argument keeps only the cases whose name contains it.
"""
import hashlib
import subprocess
import sys
from pathlib import Path

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)

from moe_service import synth, synth_deepseek2, synth_deepseek4, synth_gpt_oss  # noqa: E402

cases = []
EXPERT = synth.EXPERT_TYPES
UD = "gate=IQ1_S,up=IQ1_S,down=IQ2_XXS,experts@0=Q4_K,attn=Q8_0,embd=Q6_K,output=Q6_K"
for name in synth.PRESETS:
    if name == "qwen3-30b-a3b":
        cases.append((f"s-{name}-sparse", lambda p, n=name: synth.write_synthetic(p, n, sparse=True)))
        cases.append((f"s-{name}-L1-IQ1_S", lambda p, n=name: synth.write_synthetic(p, n, n_layer=1, expert_type="IQ1_S")))
        continue
    cases.append((f"s-{name}", lambda p, n=name: synth.write_synthetic(p, n)))
for et in EXPERT:
    cases.append((f"s-tiny-qwen3moe-{et}", lambda p, e=et: synth.write_synthetic(p, "tiny-qwen3moe", n_layer=1, expert_type=e, seed=3)))
cases.append(("s-llama-Q4_K-seed7", lambda p: synth.write_synthetic(p, "tiny-llama", expert_type="Q4_K", seed=7)))
cases.append(("s-qwen3moe-ud", lambda p: synth.write_synthetic(p, "tiny-qwen3moe", n_layer=3, tensor_types=UD)))
cases.append(("s-qwen3moe-ud-sparse", lambda p: synth.write_synthetic(p, "tiny-qwen3moe", n_layer=3, tensor_types=UD, sparse=True)))
cases.append(("s-qwen2-ffn", lambda p: synth.write_synthetic(p, "tiny-qwen2", tensor_types="ffn=Q4_K,attn@1=Q6_K")))
for kind, n in (("smollm2", 8192), ("qwen2", 8192), ("spm", 4000)):
    cases.append((f"vocab-{kind}", lambda p, k=kind, n=n: synth.write_vocab_only(p, k, n)))
cases.append(("vocab-qwen2-pre", lambda p: synth.write_vocab_only(p, "qwen2", 2048, pre="llama-bpe")))

for name in synth_deepseek2.PRESETS:
    if name in ("kimi-k2", "deepseek-v3"):
        cases.append((f"d2-{name}-sparse", lambda p, n=name: synth_deepseek2.write_deepseek2(p, n, sparse=True)))
        continue
    cases.append((f"d2-{name}", lambda p, n=name: synth_deepseek2.write_deepseek2(p, n)))
for et in ("Q4_K", "IQ2_XS", "IQ4_NL", "MXFP4"):
    cases.append((f"d2-{et}", lambda p, e=et: synth_deepseek2.write_deepseek2(p, "tiny-deepseek2", n_layer=2, expert_type=e, seed=2)))
cases.append(("d2-ud", lambda p: synth_deepseek2.write_deepseek2(p, "tiny-deepseek2", tensor_types="experts=IQ3_S,shexp=Q4_K,attn=Q8_0")))
cases.append(("d2-dense2-e8", lambda p: synth_deepseek2.write_deepseek2(p, "tiny-deepseek2-lite", n_dense_lead=2, n_expert=8)))
cases.append(("d2-meta", lambda p: synth_deepseek2.write_deepseek2(p, "tiny-deepseek2", metadata_overrides={"deepseek2.expert_count": 9, "deepseek2.expert_weights_scale": None})))

for name in synth_deepseek4.PRESETS:
    if name == "deepseek-v4-flash":
        cases.append((f"d4-{name}-sparse", lambda p, n=name: synth_deepseek4.write_deepseek4(p, n, sparse=True)))
        continue
    cases.append((f"d4-{name}", lambda p, n=name: synth_deepseek4.write_deepseek4(p, n)))
cases.append(("d4-ratios", lambda p: synth_deepseek4.write_deepseek4(p, "tiny-deepseek4", compress_ratios=(4, 128), hash_layers=1)))
cases.append(("d4-Q4_K", lambda p: synth_deepseek4.write_deepseek4(p, "tiny-deepseek4", expert_type="Q4_K", seed=5)))
cases.append(("d4-ud", lambda p: synth_deepseek4.write_deepseek4(p, "tiny-deepseek4", tensor_types="experts=IQ2_XXS,attn=Q8_0")))

for name in synth_gpt_oss.PRESETS:
    if name != "tiny-gpt-oss":
        cases.append((f"g-{name}-sparse", lambda p, n=name: synth_gpt_oss.write_gpt_oss(p, n, n_vocab=32768, sparse=True)))
        continue
    cases.append((f"g-{name}", lambda p, n=name: synth_gpt_oss.write_gpt_oss(p, n)))
for et in ("Q8_0", "Q4_K", "IQ1_M"):
    cases.append((f"g-{et}", lambda p, e=et: synth_gpt_oss.write_gpt_oss(p, expert_type=e, n_layer=2, seed=1)))
cases.append(("g-decisive", lambda p: synth_gpt_oss.write_gpt_oss(p, decisive=10.0, output_norm=0.4, swa_pattern=2)))
cases.append(("g-ud", lambda p: synth_gpt_oss.write_gpt_oss(p, tensor_types="down=IQ4_XS,attn=Q6_K")))

only = sys.argv[2] if len(sys.argv) > 2 else ""
for name, fn in cases:
    if only and only not in name:
        continue
    path = out / f"{name}.gguf"
    fn(path)
    h = hashlib.sha256(path.read_bytes()).hexdigest()
    print(name, h, flush=True)
    path.unlink()

# the CLIs, as users run them
clis = [
    ("cli-synth", ["moe_service.synth", "--preset", "tiny-llama", "--layers", "1", "--expert-type", "IQ3_XXS",
                   "--tensor-types", "down=Q4_K", "--seed", "4"]),
    ("cli-d2", ["moe_service.synth_deepseek2", "--preset", "tiny-deepseek2", "--layers", "2", "--dense-layers", "1",
                "--experts", "8", "--expert-type", "Q5_K"]),
    ("cli-d4", ["moe_service.synth_deepseek4", "--preset", "tiny-deepseek4", "--ratios", "0,4", "--tensor-types",
                "experts=IQ4_XS"]),
    ("cli-d4-flash", ["moe_service.synth_deepseek4", "--preset", "deepseek-v4-flash", "--ratios", "4,128", "--sparse"]),
    ("cli-g", ["moe_service.synth_gpt_oss", "--preset", "tiny-gpt-oss", "--layers", "1", "--vocab", "4096",
               "--expert-type", "MXFP4"]),
]
for name, argv in clis:
    if only and only not in name:
        continue
    path = out / f"{name}.gguf"
    r = subprocess.run([sys.executable, "-m", *argv, "--out", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, (name, r.stderr)
    print(name, hashlib.sha256(path.read_bytes()).hexdigest(), flush=True)
    path.unlink()
