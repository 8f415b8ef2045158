"""RoPE tables with YaRN context scaling, rounded as ggml's CPU rope, and DeepSeek's
attention-scale correction (mscale), as llama.cpp computes them.

From GGUF keys (``{arch}.rope.*``; llama-model.cpp, llama-context.cpp):

    freq_scale = 1 / rope.scaling.factor          (1 when absent or 0, or type not yarn/linear)
    ext_factor = 1 when rope.scaling.type == "yarn" else 0
    n_ctx_orig = rope.scaling.original_context_length (else context_length)
    beta_fast, beta_slow = 32, 1
    log_mul    = rope.scaling.yarn_log_multiplier / 0.1   (deepseek2 only: the converter
                 writes 0.1 * mscale_all_dim; 0 when absent)

    attn_factor (what ggml_rope receives), with get_mscale(s, m) = 0.1 m ln(s) + 1 (1 if s <= 1):
        yarn, log_mul != 0:  mscale = log_mul if (deepseek2 and log_mul != 1) else 1
                             a = get_mscale(f, mscale) / get_mscale(f, log_mul)
        yarn, log_mul == 0:  a = get_mscale(f, 1)
        yarn:                a *= 1 / (1 + 0.1 ln f)     (cancels the factor ggml's rope applies)
        a *= rope.scaling.attn_factor (1 when absent)

ggml's rope (ops.cpp rope_yarn) per position p and pair i (theta_0 = p, theta_{i+1} =
theta_i * base^(-2/d) in float32):
    theta_interp = freq_scale * theta_extrap
    ramp = 1 - clamp((i - lo) / max(0.001, hi - lo), 0, 1), lo/hi = floor/ceil of
           d * ln(n_ctx_orig / (beta * 2 pi)) / (2 ln base) for beta_fast/beta_slow, clamped
           to [0, d - 1]
    theta = theta_interp * (1 - ramp * ext) + theta_extrap * (ramp * ext)
    mscale = attn_factor * (1 + 0.1 ln(1 / freq_scale)) when ext != 0, else attn_factor
    cos = cosf(theta) * mscale, sin = sinf(theta) * mscale

DeepSeek's softmax scale (models/deepseek2.cpp): attn_factor_org = attn_factor * (1 + 0.1
ln(1/freq_scale)); m = attn_factor_org * (1 + 0.1 log_mul ln(1/freq_scale)); kq_scale =
m^2 / sqrt(head_k) with head_k = qk_nope + qk_rope.

Every step is float32 arithmetic in that order (logf, cosf, sinf correctly rounded), so the
tables equal ggml's up to the compiler's fused multiply-adds in the ramp band.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

F32 = np.float32


def _logf(x) -> np.float32:
    return F32(math.log(float(F32(x))))


@dataclass(frozen=True)
class RopeScaling:
    """The rope parameters llama.cpp hands to ggml_rope_ext for one model (float32 values)."""

    freq_base: float
    freq_scale: float = 1.0
    ext_factor: float = 0.0
    attn_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    n_ctx_orig: int = 0
    log_mul: float = 0.0  # deepseek2's yarn_log_multiplier / 0.1

    @classmethod
    def from_metadata(cls, md: dict, arch: str, freq_base: float, n_ctx_train: int) -> RopeScaling:
        """From ``{arch}.rope.*`` keys (module docstring). Raises ValueError naming the key for a
        scaling type llama.cpp does not know or a non-positive factor."""
        kind = str(md.get(f"{arch}.rope.scaling.type", "linear") or "linear")
        if kind not in ("none", "linear", "yarn", "longrope"):
            raise ValueError(f"{arch}.rope.scaling.type: unknown rope scaling {kind!r}")
        factor = float(md.get(f"{arch}.rope.scaling.factor", md.get(f"{arch}.rope.scale_linear", 0.0)) or 0.0)
        if factor < 0 or not math.isfinite(factor):
            raise ValueError(f"{arch}.rope.scaling.factor: must be a positive number (got {factor})")
        freq_scale = F32(1.0) if factor == 0.0 else F32(F32(1.0) / F32(factor))
        if kind == "none":
            freq_scale = F32(1.0)
        ext = F32(1.0) if kind == "yarn" else F32(0.0)
        log_mul = F32(0.0)
        if f"{arch}.rope.scaling.yarn_log_multiplier" in md:
            log_mul = F32(md[f"{arch}.rope.scaling.yarn_log_multiplier"])
            if arch == "deepseek2":
                log_mul = F32(log_mul / F32(0.1))
        attn = F32(1.0)
        if ext != 0:
            f = F32(F32(1.0) / freq_scale)

            def get_mscale(s, m):
                return F32(1.0) if s <= 1.0 else F32(F32(F32(F32(0.1) * F32(m)) * _logf(s)) + F32(1.0))

            if log_mul != 0:
                mscale = log_mul if (arch == "deepseek2" and log_mul != F32(1.0)) else F32(1.0)
                attn = F32(get_mscale(f, mscale) / get_mscale(f, log_mul))
            else:
                attn = get_mscale(f, F32(1.0))
            attn = F32(attn * F32(F32(1.0) / F32(F32(1.0) + F32(F32(0.1) * _logf(f)))))
        attn = F32(attn * F32(md.get(f"{arch}.rope.scaling.attn_factor", 1.0) or 1.0))
        n_orig = int(md.get(f"{arch}.rope.scaling.original_context_length", 0) or 0) or int(n_ctx_train)
        return cls(freq_base=float(F32(freq_base)), freq_scale=float(freq_scale), ext_factor=float(ext),
                   attn_factor=float(attn), n_ctx_orig=n_orig, log_mul=float(log_mul))

    def deepseek_kq_scale(self, head_k: int) -> float:
        """DeepSeek's attention softmax scale (module docstring) as a float32 value."""
        lf = _logf(F32(1.0) / F32(self.freq_scale))
        org = F32(F32(self.attn_factor) * F32(F32(1.0) + F32(F32(0.1) * lf)))
        m = F32(org * F32(F32(1.0) + F32(F32(F32(0.1) * F32(self.log_mul)) * lf)))
        return float(F32(F32(m * m) / F32(math.sqrt(float(head_k)))))

    def corr_dims(self, rope_dim: int) -> tuple[float, float]:
        """ggml_rope_yarn_corr_dims: the ramp's start and end pair index (float32)."""
        def corr(beta):
            num = F32(rope_dim) * _logf(F32(self.n_ctx_orig) / F32(F32(beta) * F32(2.0) * F32(math.pi)))
            return F32(num / F32(F32(2.0) * _logf(self.freq_base)))

        lo = max(F32(0.0), F32(math.floor(corr(self.beta_fast))))
        hi = min(F32(rope_dim - 1), F32(math.ceil(corr(self.beta_slow))))
        return float(lo), float(hi)

    def tables(self, n_ctx: int, rope_dim: int) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin float32 [n_ctx, rope_dim/2] for positions 0..n_ctx-1, each already times
        the rope's magnitude scale (module docstring), in ggml's float32 order."""
        half = rope_dim // 2
        theta_scale = F32(math.pow(float(F32(self.freq_base)), float(F32(-2.0) / F32(rope_dim))))
        theta = np.empty((n_ctx, half), F32)
        theta[:, 0] = np.arange(n_ctx, dtype=F32)
        for j in range(1, half):
            theta[:, j] = theta[:, j - 1] * theta_scale
        fs = F32(self.freq_scale)
        interp = (theta * fs).astype(F32)
        mscale = F32(self.attn_factor)
        if self.ext_factor != 0.0:
            lo, hi = self.corr_dims(rope_dim)
            i0 = np.arange(half, dtype=np.int64) * 2
            y = ((i0 // 2).astype(F32) - F32(lo)) / max(F32(0.001), F32(F32(hi) - F32(lo)))
            ramp = (F32(1.0) - np.minimum(F32(1.0), np.maximum(F32(0.0), y.astype(F32)))).astype(F32)
            mix = (ramp * F32(self.ext_factor)).astype(F32)
            ang = (interp * (F32(1.0) - mix) + theta * mix).astype(F32)
            mscale = F32(mscale * F32(F32(1.0) + F32(F32(0.1) * _logf(F32(1.0) / fs))))
        else:
            ang = interp
        a = ang.astype(np.float64)
        cos = (np.cos(a).astype(F32) * mscale).astype(F32)
        sin = (np.sin(a).astype(F32) * mscale).astype(F32)
        return cos, sin
