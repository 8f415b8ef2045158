"""``qwen2`` (Qwen2/2.5 dense, QwQ-32B): llama's block with required Q/K/V biases (no
output bias), NEOX RoPE, dense SwiGLU FFN (llama.cpp src/models/qwen2.cpp). Tensors: see
llama.py (``attn_q/k/v.bias`` required)."""

from __future__ import annotations

from moe_service.engine.arch.llama import Llama


class Qwen2(Llama):
    names = ("qwen2",)
    neox = True
    qkv_bias = True
    rope_dim_is_head_dim = False
