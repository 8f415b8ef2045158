"""Synthetic GGUF models: random weights at real layer shapes, few layers, deterministic bytes.

One module per architecture, as moe_service/engine/arch/ (each with its presets, tensor plan,
metadata, ``write_*`` function and ``main``):

- :mod:`.llama`: ``llama`` (Mixtral layout), ``qwen3moe``, dense ``qwen2`` / ``qwen3``
  (``python -m moe_service.synth``, :func:`write_synthetic`);
- :mod:`.deepseek2`: DeepSeek V2/V3, Kimi K2 (``python -m moe_service.synth.deepseek2``);
- :mod:`.deepseek4`: DeepSeek V4 (``python -m moe_service.synth.deepseek4``);
- :mod:`.gpt_oss`: gpt-oss (``python -m moe_service.synth.gpt_oss``).

And the pieces they share, once: :mod:`.blocks` (random bytes and valid blocks per format),
:mod:`.tokenizer` (vocabularies from SmolLM2's tokens), :mod:`.recipe` (per-tensor type
recipes, ``--tensor-types``), :mod:`.writer` (general keys, the atomic GGUF writer, the
command shape). The old module paths ``moe_service.synth_deepseek2``, ``synth_deepseek4``,
``synth_gpt_oss`` and ``synth_recipe`` re-export these modules and still run as commands.

This package re-exports the llama-family writer and the shared pieces under the names the
former ``moe_service/synth.py`` had (``from moe_service.synth import write_synthetic``).
"""

from __future__ import annotations

from moe_service.synth.blocks import (
    BLOCK_FORMATS,
    EXPERT_TYPES,
    _pack_k_scales,
    _uniform_pm1,
    make_blocks,
    permuted_rows_bytes,
    random_bytes,
    successor_q8_head,
    successor_rows,
    tensor_bytes,
    tensor_nbytes,
    weight_chunks,
)
from moe_service.synth.llama import (
    _DECISIVE,
    DENSE_ARCHS,
    PRESETS,
    SYNTH_ARCHS,
    SynthPreset,
    TensorPlan,
    main,
    model_metadata,
    resolve_preset,
    tensor_plan,
    write_synthetic,
    write_vocab_only,
)
from moe_service.synth.tokenizer import (
    QWEN_CHAT_TEMPLATE,
    QWEN_FIRST_SPECIAL_ID,
    QWEN_SPECIALS,
    QWEN_USER_DEFINED,
    vocab_metadata,
)
from moe_service.synth.writer import (
    DENSE_TYPES,
    ArchTensor,
    arch_tensor_chunks,
    general_metadata,
    lookup_preset,
    override_metadata,
    sha256_file,
    write_gguf,
    writer_cli,
)

__all__ = [
    "BLOCK_FORMATS",
    "DENSE_ARCHS",
    "DENSE_TYPES",
    "EXPERT_TYPES",
    "PRESETS",
    "QWEN_CHAT_TEMPLATE",
    "QWEN_FIRST_SPECIAL_ID",
    "QWEN_SPECIALS",
    "QWEN_USER_DEFINED",
    "SYNTH_ARCHS",
    "_DECISIVE",
    "ArchTensor",
    "SynthPreset",
    "TensorPlan",
    "_pack_k_scales",
    "_uniform_pm1",
    "arch_tensor_chunks",
    "general_metadata",
    "lookup_preset",
    "main",
    "make_blocks",
    "model_metadata",
    "override_metadata",
    "permuted_rows_bytes",
    "random_bytes",
    "resolve_preset",
    "sha256_file",
    "successor_q8_head",
    "successor_rows",
    "tensor_bytes",
    "tensor_nbytes",
    "tensor_plan",
    "vocab_metadata",
    "weight_chunks",
    "write_gguf",
    "write_synthetic",
    "write_vocab_only",
    "writer_cli",
]
