"""RoPE angle tables with ggml's rounding: plain, linear-scaled and YaRN (gpt-oss, deepseek2).

The tables are what ggml's CPU rope op computes per (position, pair) before rotating
(ggml-cpu ops.cpp ``ggml_rope_cache_init`` / ``rope_yarn``), so both dense paths rotate with
the same float32 values llama.cpp uses:

- theta_scale = powf(base, -2/R); per position p: theta_0 = p, theta_{j+1} = theta_j * theta_scale
  (float32 products, not p * base^(-2j/R) exactly); divided by the ``rope_freqs`` factor of
  pair j when the file has one;
- theta_extrap = theta_j, theta_interp = freq_scale * theta_extrap;
- YaRN (ext_factor != 0): ramp_mix = ramp(j) * ext_factor with
  ramp(j) = 1 - min(1, max(0, (j - low) / max(0.001, high - low))),
  theta = theta_interp * (1 - ramp_mix) + theta_extrap * ramp_mix, and the magnitude
  mscale = attn_factor * (1 + 0.1 ln(1 / freq_scale)); without YaRN theta = theta_interp and
  mscale = attn_factor;
- cos = cosf(theta) * mscale, sin = sinf(theta) * mscale (cos/sin correctly rounded).

low/high are YaRN's correction dims (ggml ``ggml_rope_yarn_corr_dims``):
corr(b) = R * ln(n_ctx_orig / (2 pi b)) / (2 ln base), low = max(0, floor(corr(beta_fast))),
high = min(R - 1, ceil(corr(beta_slow))).

How llama.cpp derives the parameters from a file (llama-model.cpp load_hparams and
llama-context.cpp, reproduced by :func:`scaling_from_metadata`): ``rope.scaling.type``
("none" | "linear" | "yarn", default linear); freq_scale = 1 / ``rope.scaling.factor`` (1 when
absent or 0; forced to 1 for "none"); ext_factor = 1 for yarn, else 0; n_ctx_orig =
``rope.scaling.original_context_length``, else ``context_length``; with YaRN the attention
factor is get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dims) when
``rope.scaling.yarn_log_multiplier`` (mscale_all_dims) is set, else get_mscale(factor, 1),
with get_mscale(s, m) = 1 + 0.1 m ln s; then divided by (1 + 0.1 ln factor) because rope_yarn
multiplies that factor in again; finally times ``rope.scaling.attn_factor`` (default 1).
For gpt-oss (factor 32, no log multiplier) the net magnitude on cos/sin is 1 + 0.1 ln 32.

Shapes: C positions (the context), R rotated dims (``rope.dimension_count``), R/2 pairs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from moe_service.errors import ModelFileError

_F = np.float32


def _logf(x) -> np.float32:
    """float32 natural log, correctly rounded (glibc's logf agrees to < 1 ulp)."""
    return _F(math.log(float(x)))


@dataclass(frozen=True)
class RopeScaling:
    """The rope op's scaling parameters (ggml_rope_ext arguments).

    freq_scale: 1 / scaling factor; ext_factor: YaRN mix (0 = no YaRN); attn_factor: the
    magnitude factor passed to the op (before rope_yarn's own 1 + 0.1 ln(1/freq_scale));
    beta_fast / beta_slow: YaRN ramp bounds in rotations; n_ctx_orig: the pre-extension
    context the ramp is computed for; kind: "none", "linear" or "yarn" (for logs).
    """

    kind: str = "linear"
    freq_scale: float = 1.0
    ext_factor: float = 0.0
    attn_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    n_ctx_orig: int = 0

    @property
    def factor(self) -> float:
        return 1.0 / self.freq_scale if self.freq_scale else 1.0


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> np.float32:
    """llama-context.cpp get_mscale in float32: 1 when scale <= 1, else 0.1 * mscale * ln(scale) + 1."""
    if scale <= 1.0:
        return _F(1.0)
    return _F(_F(_F(_F(0.1) * _F(mscale)) * _logf(_F(scale))) + _F(1.0))


def scaling_from_metadata(md: dict, arch: str, n_ctx_train: int, *, path: str = "", deepseek_mscale: bool = False
                          ) -> RopeScaling:
    """The RoPE scaling llama.cpp applies to a file (module docstring), from its metadata.

    md: GGUF metadata (plain values); arch: ``general.architecture``; n_ctx_train:
    ``{arch}.context_length``; deepseek_mscale: llama.cpp's deepseek2 special case (mscale =
    mscale_all_dims when the log multiplier is not 1). Raises ModelFileError naming the
    key for an unknown scaling type or a negative factor.
    """
    def get(key, default=None):
        v = md.get(f"{arch}.{key}", default)
        return v[0] if isinstance(v, list) and v else v

    kind = get("rope.scaling.type", "linear")
    if kind not in ("none", "linear", "yarn"):
        raise ModelFileError(f"{path}: {arch}.rope.scaling.type = {kind!r} is not supported (none, linear, yarn)")
    factor = get("rope.scaling.factor")
    if factor is None:
        factor = get("rope.scale_linear", 0.0)
    factor = float(factor or 0.0)
    if factor < 0 or not math.isfinite(factor):
        raise ModelFileError(f"{path}: {arch}.rope.scaling.factor = {factor} must be a positive number")
    freq_scale = float(_F(1.0) / _F(factor)) if factor else 1.0
    if kind == "none":
        freq_scale = 1.0
    n_ctx_orig = int(get("rope.scaling.original_context_length", 0) or n_ctx_train)
    ext = 1.0 if kind == "yarn" else 0.0
    attn = _F(1.0)
    if ext:
        f = float(_F(1.0) / _F(freq_scale))
        log_mul = float(get("rope.scaling.yarn_log_multiplier", 0.0) or 0.0)
        if log_mul:
            m = log_mul if (deepseek_mscale and log_mul != 1.0) else 1.0
            attn = _F(yarn_get_mscale(f, m) / yarn_get_mscale(f, log_mul))
        else:
            attn = yarn_get_mscale(f, 1.0)
        attn = _F(attn * _F(_F(1.0) / _F(_F(1.0) + _F(_F(0.1) * _logf(_F(f))))))
    attn = _F(attn * _F(get("rope.scaling.attn_factor", 1.0) or 1.0))
    return RopeScaling(kind=kind, freq_scale=freq_scale, ext_factor=ext, attn_factor=float(attn),
                       n_ctx_orig=n_ctx_orig)


def yarn_corr_dims(n_dims: int, n_ctx_orig: int, base: float, beta_fast: float, beta_slow: float) -> tuple[float, float]:
    """(low, high) pair indices of YaRN's ramp, as ggml_rope_yarn_corr_dims in float32."""
    def corr(n_rot: float) -> np.float32:
        denom = _F(_F(_F(n_rot) * _F(2.0)) * _F(math.pi))
        num = _F(_F(n_dims) * _logf(_F(_F(n_ctx_orig) / denom)))
        return _F(num / _F(_F(2.0) * _logf(_F(base))))

    start = math.floor(float(corr(beta_fast)))
    end = math.ceil(float(corr(beta_slow)))
    return float(max(0, start)), float(min(n_dims - 1, end))


def rope_tables(n_ctx: int, rope_dim: int, base: float, scaling: RopeScaling | None = None,
                freq_factors: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin float32 [C, R/2] for positions 0..n_ctx-1 (module docstring), magnitude folded in.

    rope_dim R: even number of rotated dims; base: ``rope.freq_base``; scaling: default none;
    freq_factors: float32 [>= R/2] per-pair divisors (``rope_freqs.weight``) or None.
    Raises ValueError for an odd or non-positive R or fewer freq factors than pairs.
    """
    if rope_dim <= 0 or rope_dim % 2:
        raise ValueError(f"rope dimension count {rope_dim} must be a positive even number")
    sc = scaling or RopeScaling(kind="none")
    half = rope_dim // 2
    theta_scale = _F(_F(base) ** _F(-2.0 / rope_dim))
    theta = np.empty((n_ctx, half), dtype=np.float32)
    theta[:, 0] = np.arange(n_ctx, dtype=np.float32)
    for j in range(1, half):
        theta[:, j] = theta[:, j - 1] * theta_scale
    if freq_factors is not None:
        ff = np.asarray(freq_factors, dtype=np.float32).reshape(-1)
        if ff.shape[0] < half:
            raise ValueError(f"rope_freqs has {ff.shape[0]} factors for {half} rotated pairs")
        theta = theta / ff[None, :half]
    fs = _F(sc.freq_scale)
    interp = theta * fs
    mscale = _F(sc.attn_factor)
    if sc.ext_factor != 0.0:
        low, high = yarn_corr_dims(rope_dim, sc.n_ctx_orig or n_ctx, base, sc.beta_fast, sc.beta_slow)
        y = (np.arange(half, dtype=np.float32) - _F(low)) / _F(max(0.001, float(_F(high) - _F(low))))
        ramp = _F(1.0) - np.minimum(_F(1.0), np.maximum(_F(0.0), y))
        mix = (ramp * _F(sc.ext_factor)).astype(np.float32)
        ang = interp * (_F(1.0) - mix)[None, :] + theta * mix[None, :]
        mscale = _F(mscale * _F(_F(1.0) + _F(_F(0.1) * _logf(_F(_F(1.0) / fs)))))
    else:
        ang = interp
    a64 = ang.astype(np.float64)
    cos = np.cos(a64).astype(np.float32)
    sin = np.sin(a64).astype(np.float32)
    if mscale != _F(1.0):
        cos *= mscale
        sin *= mscale
    return cos, sin
