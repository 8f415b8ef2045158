"""``qwen3moe`` (Qwen3-30B-A3B, Qwen3-235B-A22B): llama's block with per-head q/k RMSNorm
before RoPE, NEOX RoPE (rotated halves), a head dim of its own (``attention.key_length``)
and routed experts of width ``expert_feed_forward_length``; softmax router, top-k weights
renormalised (llama.cpp src/models/qwen3moe.cpp). Tensors: see llama.py."""

from __future__ import annotations

from moe_service.engine.arch.llama import Llama


class Qwen3Moe(Llama):
    names = ("qwen3moe",)
    neox = True
    qk_norm = True
    expert_width_key = "expert_feed_forward_length"
    rope_dim_is_head_dim = False
