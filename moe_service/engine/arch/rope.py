"""RoPE cos/sin tables as ggml's CPU rope computes them, YaRN included (numpy only).

ggml (ggml-cpu ops.cpp ``ggml_rope_cache_init`` / ``rope_yarn`` and ggml.c
``ggml_rope_yarn_corr_dims``), per position p and pair j < R/2, in float32:

    theta_scale = powf(base, -2/R);  theta_0 = p;  theta_{j+1} = theta_j * theta_scale
    theta_extrap = theta_j / freq_factor[j]                    (factor 1 without a rope_freqs tensor)
    theta_interp = freq_scale * theta_extrap
    ext_factor == 0:  theta = theta_interp,  mscale = attn_factor
    ext_factor != 0:  ramp = 1 - clamp((j - lo) / max(0.001, hi - lo), 0, 1)
                      mix = ramp * ext_factor;  theta = theta_interp (1 - mix) + theta_extrap mix
                      mscale = attn_factor * (1 + 0.1 logf(1 / freq_scale))
                      lo = max(0, floor(R ln(n_ctx_orig / (beta_fast 2 pi)) / (2 ln base)))
                      hi = min(R - 1, ceil(R ln(n_ctx_orig / (beta_slow 2 pi)) / (2 ln base)))
    cos = cosf(theta) * mscale,  sin = sinf(theta) * mscale

cosf/sinf are taken as the correctly rounded float32 of the float64 values (glibc's are
correctly rounded in practice for these arguments).
"""

from __future__ import annotations

import math

import numpy as np

from moe_service.engine.arch.base import RopeSpec


def yarn_corr_dims(dim: int, n_ctx_orig: int, base: float, beta_fast: float, beta_slow: float) -> tuple[float, float]:
    """(lo, hi) pair indices of the YaRN ramp (ggml_rope_yarn_corr_dims)."""

    def corr(n_rot: float) -> float:
        return dim * math.log(n_ctx_orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    lo = math.floor(np.float32(corr(beta_fast)))
    hi = math.ceil(np.float32(corr(beta_slow)))
    return float(max(0, lo)), float(min(dim - 1, hi))


def rope_tables(spec: RopeSpec, n_ctx: int, freq_factors: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin float32 [n_ctx, spec.dim / 2] for positions 0..n_ctx-1 (module docstring).

    ``freq_factors``: float32 [>= dim/2] (the rope_freqs tensor) or None.
    """
    half = spec.dim // 2
    f32 = np.float32
    theta_scale = f32(f32(spec.base) ** f32(-2.0 / spec.dim))
    theta = np.empty((n_ctx, half), dtype=np.float32)
    theta[:, 0] = np.arange(n_ctx, dtype=np.float32)
    for j in range(1, half):
        theta[:, j] = theta[:, j - 1] * theta_scale
    if freq_factors is not None:
        theta = theta / np.asarray(freq_factors, dtype=np.float32).reshape(1, -1)[:, :half]
    mscale = f32(spec.attn_factor)
    if spec.freq_scale != 1.0 or spec.ext_factor != 0.0:
        interp = f32(spec.freq_scale) * theta
        if spec.ext_factor != 0.0:
            lo, hi = yarn_corr_dims(spec.dim, spec.n_ctx_orig, spec.base, spec.beta_fast, spec.beta_slow)
            dims = np.arange(half, dtype=np.float32)
            y = (dims - f32(lo)) / f32(max(0.001, hi - lo))
            ramp = (f32(1.0) - np.minimum(f32(1.0), np.maximum(f32(0.0), y))).astype(np.float32)
            mix = (ramp * f32(spec.ext_factor)).reshape(1, -1)
            theta = (interp * (f32(1.0) - mix) + theta * mix).astype(np.float32)
            mscale = f32(mscale * f32(1.0 + 0.1 * np.log(f32(1.0) / f32(spec.freq_scale), dtype=np.float32)))
        else:
            theta = interp.astype(np.float32)
    ang = theta.astype(np.float64)
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    if mscale != f32(1.0):
        cos, sin = cos * mscale, sin * mscale
    return cos, sin


def scaling_from_metadata(r, n_ctx_train: int, *, deepseek_mscale: bool = False) -> dict:
    """The RoPE scaling llama.cpp applies to a file, as RopeSpec keyword arguments
    (freq_scale, ext_factor, attn_factor, n_ctx_orig), read through an arch HParamReader
    ``r`` (errors name the file and the key).

    llama.cpp (llama-model.cpp load_hparams, llama-context.cpp): ``rope.scaling.type`` is
    "none", "linear" (default) or "yarn"; freq_scale = 1 / ``rope.scaling.factor`` (the old
    key ``rope.scale_linear`` when absent; 1 when 0 or absent; forced to 1 for "none");
    ext_factor = 1 for yarn, else 0; n_ctx_orig = ``rope.scaling.original_context_length``,
    else ``n_ctx_train``. With YaRN the attention factor is get_mscale(f, m) /
    get_mscale(f, ``rope.scaling.yarn_log_multiplier``) when that key is set (m = 1, or the
    multiplier itself for deepseek2 when it is not 1: ``deepseek_mscale``), else
    get_mscale(f, 1), with get_mscale(s, m) = 1 + 0.1 m ln s for s > 1; then divided by
    1 + 0.1 ln f, because rope_yarn multiplies that factor in again (module docstring);
    finally times ``rope.scaling.attn_factor`` (default 1). All in float32 as llama.cpp.
    For gpt-oss (factor 32, no multiplier) the net magnitude on cos/sin is 1 + 0.1 ln 32.
    """
    from moe_service.engine.arch.base import HParamError

    f32 = np.float32
    kind = r.str("rope.scaling.type", "linear")
    if kind not in ("none", "linear", "yarn"):
        key = r.full("rope.scaling.type")
        raise HParamError(f"{r.path}: metadata key {key} is {kind!r}, expected none, linear or yarn", key)
    factor = r.float("rope.scaling.factor", None, lo=0.0)
    if factor is None:
        factor = r.float("rope.scale_linear", 0.0, lo=0.0)
    freq_scale = float(f32(1.0) / f32(factor)) if factor and kind != "none" else 1.0
    ext = 1.0 if kind == "yarn" else 0.0

    def get_mscale(s: float, m: float) -> np.float32:
        return f32(1.0) if s <= 1.0 else f32(f32(f32(f32(0.1) * f32(m)) * f32(math.log(s))) + f32(1.0))

    attn = f32(1.0)
    if ext:
        fac = float(f32(1.0) / f32(freq_scale))
        log_mul = r.float("rope.scaling.yarn_log_multiplier", 0.0)
        if log_mul:
            m = log_mul if deepseek_mscale and log_mul != 1.0 else 1.0
            attn = f32(get_mscale(fac, m) / get_mscale(fac, log_mul))
        else:
            attn = get_mscale(fac, 1.0)
        attn = f32(attn * f32(f32(1.0) / f32(f32(1.0) + f32(f32(0.1) * f32(math.log(fac))))))
    attn = f32(attn * f32(r.float("rope.scaling.attn_factor", 1.0, lo=0.0, lo_open=True)))
    n_orig = r.int("rope.scaling.original_context_length", 0, hi=1 << 30) or n_ctx_train
    return {"freq_scale": freq_scale, "ext_factor": ext, "attn_factor": float(attn), "n_ctx_orig": int(n_orig)}
