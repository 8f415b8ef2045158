"""``qwen3`` (Qwen3 dense: 0.6B..32B): llama's block with per-head q/k RMSNorm before
RoPE, NEOX RoPE, ``attention.key_length`` head dim, no biases, dense SwiGLU FFN (llama.cpp
src/models/qwen3.cpp). Tensors: see llama.py."""

from __future__ import annotations

from moe_service.engine.arch.llama import Llama


class Qwen3(Llama):
    names = ("qwen3",)
    neox = True
    qk_norm = True
    rope_dim_is_head_dim = False
