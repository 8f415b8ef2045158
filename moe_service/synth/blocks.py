"""Random tensor bytes per block format: the weights of every synthetic writer.

The same (name, seed, chunk) always gives the same bytes: every random byte comes from
``PCG64(SeedSequence([seed, crc32(tensor name), chunk]))`` raw 64-bit outputs (numpy keeps
bit generators' raw streams and SeedSequence stable across versions; Generator methods such
as ``normal`` carry no such promise, so none is used), turned into weights with integer
arithmetic and single correctly-rounded float operations only (no transcendental functions,
no reductions), so no numpy version or CPU changes a byte. Fixtures record the sha256 of
each file; tests regenerate and compare.

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
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator

import numpy as np

from moe_service.errors import ConfigError
from moe_service.formats import BY_NAME, IQ4NL_KVALUES, set_iq1m_d

# ggml type name -> (block elements, block bytes), from the format declarations
BLOCK_FORMATS: dict[str, tuple[int, int]] = {f.name: (f.block_elems, f.block_bytes) for f in BY_NAME.values()}
EXPERT_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "MXFP4", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "IQ4_XS",
                "IQ4_NL", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M")
"""Every quantized format of the registry (formats.py), each with a block maker (make_blocks)."""


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


def successor_rows(seed: int, n_vocab: int) -> np.ndarray:
    """The successor permutation of a ``successor_output`` preset: int64 [V], output row v is
    token_embd row ``perm[v]``. So the logit of token v is e(perm[v]) . h: when the final
    hidden state h is dominated by the current token's embedding e(c), the winner is the v
    with perm[v] = c by a wide margin (|e|^2 against random dot products), and the greedy
    chain walks the permutation's cycles through distinct tokens, a decisive choice at each
    step that attention and the FFN still shift (the margins are recorded in the goldens)."""
    keys = random_bytes(seed, "output.weight:successor", 8 * n_vocab).view("<u8")
    return np.argsort(keys, kind="stable").astype(np.int64)


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


def tensor_nbytes(qtype: str, ne: tuple[int, ...]) -> int:
    """Bytes of a ``qtype`` tensor of ggml shape ``ne`` (rows a whole number of blocks)."""
    qk, bs = BLOCK_FORMATS[qtype]
    return int(np.prod(ne)) // qk * bs


def weight_chunks(qtype: str, seed: int, name: str, n_rows: int, row_elems: int, std: float,
                  n_expert: int = 0) -> Iterator[np.ndarray]:
    """A tensor of random weights (:func:`tensor_bytes`) as uint8 chunks: with ``n_expert`` > 0
    one expert slab of ``n_rows / n_expert`` rows at a time (chunk e + 1: bounded memory, and
    each expert's bytes independent of the others), else the whole tensor (chunk 0)."""
    if n_expert:
        per = n_rows // n_expert
        for e in range(n_expert):
            yield tensor_bytes(qtype, seed, name, per, row_elems, std, chunk=e + 1)
        return
    yield tensor_bytes(qtype, seed, name, n_rows, row_elems, std)


def permuted_rows_bytes(qtype: str, seed: int, src_name: str, n_rows: int, row_elems: int,
                        std: float) -> np.ndarray:
    """Tensor ``src_name``'s random bytes (uint8) with its rows permuted by
    :func:`successor_rows`: row v is the source's row ``perm[v]`` (a successor output head)."""
    src = tensor_bytes(qtype, seed, src_name, n_rows, row_elems, std).reshape(n_rows, -1)
    return np.ascontiguousarray(src[successor_rows(seed, n_rows)]).reshape(-1)
