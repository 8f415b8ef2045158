"""Synthetic ``deepseek4`` GGUF models (DeepSeek V4 / V4-Flash layout): random weights at the
tensor layout llama.cpp 0.3.36 loads (llama_model_deepseek4::load_arch_tensors), deterministic
bytes, written by the project's own writer (moe_service.synth's block makers, vocabularies and
atomic GGUF writer; the same helpers as moe_service/synth/deepseek2.py).

Tensors (ggml ne; H hidden, NH heads, D head dim, Rq q_lora_rank, G output groups, Ro output
lora rank, C = 4 hyper-connection streams, M = (2 + C) C, E experts, K top-k, I expert width,
S = I * shared experts, Ni / Di indexer heads / dims, V vocab)::

    token_embd {H, V}  output_norm {H}  output {H, V}
    output_hc_fn {C H, C} F32  output_hc_base {C} F32  output_hc_scale {1} F32
    blk.i.attn_norm {H}  attn_sinks {NH}  attn_q_a {H, Rq}  attn_q_a_norm {Rq}  attn_q_b {Rq, NH D}
          attn_kv {H, D}  attn_kv_a_norm {D}  attn_output_a {NH D / G, Ro G}  attn_output_b {G Ro, H}
          hc_attn_fn / hc_ffn_fn {C H, M} F32  hc_*_base {M} F32  hc_*_scale {3} F32
      ratio r != 0: attn_compressor_kv / _gate {H, c D}  attn_compressor_ape {c D, r} F32
                    attn_compressor_norm {D}                        (c = 2 for r = 4, else 1)
      ratio 4:      indexer.proj {H, Ni}  indexer.attn_q_b {Rq, Ni Di}
                    indexer_compressor_kv / _gate {H, 2 Di}  indexer_compressor_ape {2 Di, 4} F32
                    indexer_compressor_norm {Di}
          ffn_gate_inp {H, E} F32
          i < hash_layer_count: ffn_gate_tid2eid {K, V} I32 (K distinct expert ids per token)
          else:                 exp_probs_b.bias {E} F32
          ffn_norm {H}  ffn_gate_exps / ffn_up_exps {H, I, E}  ffn_down_exps {I, H, E} (MXFP4)
          ffn_gate_shexp / ffn_up_shexp {H, S}  ffn_down_shexp {S, H}
      MTP block (i = n_layer .. block_count - 1, ratio from compress_ratios as well):
          all of the above + nextn.eh_proj {2H, H}  nextn.enorm {H}  nextn.hnorm {H}

Metadata as llama.cpp's loader reads it (keys under ``deepseek4.``): block_count (trunk +
MTP), nextn_predict_layers, attention.key_length = value_length = D, rope.dimension_count,
attention.q_lora_rank, attention.sliding_window, attention.output_group_count /
output_lora_rank, attention.compress_ratios (array, one per block), compress_rope_freq_base,
attention.indexer.head_count / key_length / top_k, hyper_connection.count /
sinkhorn_iterations / epsilon, hash_layer_count, expert_gating_func = 4 (sqrt-softplus),
expert_weights_norm / scale, swiglu_clamp_exp / swiglu_clamp_shexp, YaRN rope.scaling.*.

Decisive greedy chains: as the deepseek2 tiny presets, the embedding has element std 1 and
``output`` row j is the embedding row j-1 with its Q8_0 scales x 1/4 (the successor of the
current token wins); the logits carry every layer's computation and are compared in full.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from moe_service.errors import ConfigError
from moe_service.log import get_logger
from moe_service.synth.blocks import BLOCK_FORMATS, EXPERT_TYPES
from moe_service.synth.recipe import apply_tensor_types, parse_tensor_types
from moe_service.synth.tokenizer import set_special_ids, vocab_metadata
from moe_service.synth.writer import (
    DENSE_TYPES,
    ArchTensor,
    arch_tensor_chunks,
    general_metadata,
    lookup_preset,
    override_metadata,
    write_gguf,
    writer_cli,
)

log = get_logger(__name__)

ARCH = "deepseek4"

DEEPSEEK_SPECIALS: dict[int, tuple[str, int]] = {
    0: ("<｜begin▁of▁sentence｜>", 3), 1: ("<｜end▁of▁sentence｜>", 3), 2: ("<｜▁pad▁｜>", 3),
    3: ("<｜User｜>", 3), 4: ("<｜Assistant｜>", 3),
    14: ("<think>", 4), 15: ("Let me count.", 4), 16: ("</think>", 4),
}
"""The ``deepseek`` vocabulary's tokens at SmolLM2's 17 control ids (0..16; the others become
unused [PAD] tokens): id -> (text, token type: 3 control, 4 user-defined). DeepSeek's own
begin/end of sentence (BOS 0, EOS 1, as in the DeepSeek V3/V4 GGUFs), pad, User and Assistant
markers; ``<think>`` / ``</think>`` are user-defined (rendered as text, as in DeepSeek's
vocabulary). Ids are chosen for the successor head (the greedy chain walks c -> c + 1): after
the prompt's ``<think>`` the model writes "Let me count.", ``</think>`` and then ordinary
tokens, so a chat request shows reasoning then content; after ``</think>`` (thinking off) it
writes content only."""


def deepseek4_template() -> str:
    """The DeepSeek V4 chat template shipped in the ``deepseek`` vocabulary's files
    (moe_service/deepseek4_template.jinja; also the tokenizer's built-in fallback for a
    deepseek4 file without a template)."""
    return resources.files("moe_service").joinpath("deepseek4_template.jinja").read_text(encoding="utf-8")


def deepseek_vocab_metadata(n_vocab: int) -> dict[str, Any]:
    """``tokenizer.*`` keys of the ``deepseek`` vocabulary: SmolLM2's BPE tokens and merges, its
    control ids replaced by DeepSeek's special tokens (:data:`DEEPSEEK_SPECIALS`), BOS added,
    and the DeepSeek V4 chat template. ConfigError for a size SmolLM2 cannot give."""
    meta = vocab_metadata("smollm2", n_vocab)
    tokens, types = list(meta["tokenizer.ggml.tokens"]), list(meta["tokenizer.ggml.token_type"])
    for i in range(17):
        tokens[i], types[i] = DEEPSEEK_SPECIALS.get(i, (f"[PAD{i}]", 5))
    meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"] = tokens, types
    set_special_ids(meta, bos=0, eos=1, pad=2, add_bos=True, add_eos=False)
    meta["tokenizer.chat_template"] = deepseek4_template()
    return meta


@dataclass(frozen=True)
class Deepseek4Preset:
    """Shape and format of a synthetic deepseek4 model (module docstring for the tensors)."""

    name: str
    compress_ratios: tuple[int, ...]  # one per trunk layer (0, 4 or 128); n_layer = len
    n_embd: int
    n_head: int
    head_dim: int
    n_rot: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window: int
    indexer_heads: int
    indexer_dim: int
    indexer_top_k: int
    hash_layers: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_expert_shared: int
    n_vocab: int
    n_mtp: int = 0  # nextn blocks after the trunk
    mtp_ratio: int = 0  # compress ratio written for the MTP blocks
    vocab: str = "smollm2"
    expert_type: str = "MXFP4"
    dense_type: str = "Q8_0"
    embd_type: str = "Q8_0"
    weights_scale: float = 1.5
    clamp_exp: float = 10.0
    clamp_shexp: float = 10.0
    hc: int = 4
    hc_iters: int = 20
    hc_eps: float = 1e-6
    rope_freq_base: float = 10000.0
    compress_rope_base: float = 160000.0
    yarn_factor: float = 16.0  # 0: no rope scaling keys
    yarn_orig_ctx: int = 65536
    n_ctx_train: int = 1048576
    rms_eps: float = 1e-6
    hc_base_std: float = 0.5  # hc_*_base / output_hc_base element std (larger: sharper stream mixing)
    embd_std: float = 0.0  # 0: 4/sqrt(H)
    successor_head: bool = False
    tensor_types: str = ""  # per-tensor type recipe (synth/recipe.py), applied over the types above

    @property
    def n_layer(self) -> int:
        return len(self.compress_ratios)

    def validate(self) -> None:
        def bad(msg: str) -> ConfigError:
            return ConfigError(f"synthetic preset {self.name}: {msg}")

        parse_tensor_types(self.tensor_types)

        if self.expert_type not in EXPERT_TYPES:
            raise bad(f"expert_type {self.expert_type!r} is not one of {', '.join(EXPERT_TYPES)}.")
        for f in ("dense_type", "embd_type"):
            if getattr(self, f) not in DENSE_TYPES:
                raise bad(f"{f} {getattr(self, f)!r} is not one of {', '.join(DENSE_TYPES)}.")
        if any(r not in (0, 4, 128) for r in self.compress_ratios + (self.mtp_ratio,)):
            raise bad(f"compress_ratios {self.compress_ratios} must be 0, 4 or 128.")
        if self.n_head % self.o_groups:
            raise bad(f"o_groups {self.o_groups} does not divide n_head {self.n_head}.")
        if not 0 <= self.hash_layers <= self.n_layer:
            raise bad(f"hash_layers {self.hash_layers} out of 0..{self.n_layer}.")
        qk = BLOCK_FORMATS[self.expert_type][0]
        for what, n in (("n_embd", self.n_embd), ("n_ff_exp", self.n_ff_exp)):
            if n % qk or n % 32:
                raise bad(f"{what} = {n} is not a multiple of the {self.expert_type} block size {qk} and 32.")
        for what, n in (("q_lora_rank", self.q_lora_rank), ("head_dim", self.head_dim),
                        ("o_lora_rank", self.o_lora_rank), ("indexer_dim", self.indexer_dim)):
            if n % 32:
                raise bad(f"{what} = {n} is not a multiple of 32 (Q8_0 rows).")
        if self.n_rot % 2 or self.n_rot > min(self.head_dim, self.indexer_dim):
            raise bad(f"n_rot = {self.n_rot} must be even and at most head_dim and indexer_dim.")
        if self.hc != 4:
            raise bad("hc must be 4 (llama.cpp's deepseek4 graph).")
        if not 0 < self.n_expert_used <= self.n_expert:
            raise bad(f"n_expert_used {self.n_expert_used} must be in 1..n_expert ({self.n_expert}).")


PRESETS: dict[str, Deepseek4Preset] = {
    p.name: p
    for p in (
        # V4-Flash layout at toy size: 5 layers with ratios 0, 4, 128, 4, 128 (the raw window only,
        # the indexer with top-k, the heavily compressed KV), the first 2 layers hash-routed,
        # MXFP4 experts, one shared expert, one MTP block. Window 128 and top-k 32 so that a
        # 600-token prompt crosses the window, 150 ratio-4 blocks (top-k selects) and 4 ratio-128
        # blocks. SwiGLU clamps low enough to bite (1.5 routed, 1.0 shared: activations ~1), stream
        # mixing bases of std 2 (so the Sinkhorn iterations matter).
        Deepseek4Preset("tiny-deepseek4", compress_ratios=(0, 4, 128, 4, 128), n_embd=256, n_head=8, head_dim=128,
                        n_rot=32, q_lora_rank=128, o_groups=2, o_lora_rank=64, window=128, indexer_heads=4,
                        indexer_dim=64, indexer_top_k=32, hash_layers=2, n_expert=16, n_expert_used=4,
                        n_ff_exp=256, n_expert_shared=1, n_vocab=8192, n_mtp=1, mtp_ratio=0,
                        clamp_exp=1.5, clamp_shexp=1.0, hc_base_std=2.0, embd_std=1.0, successor_head=True),
        # the same model with DeepSeek's special tokens and the V4 chat template (``deepseek``
        # vocabulary): chat requests render the V4 format and serve through the API
        Deepseek4Preset("tiny-deepseek4-chat", compress_ratios=(0, 4, 128, 4, 128), n_embd=256, n_head=8,
                        head_dim=128, n_rot=32, q_lora_rank=128, o_groups=2, o_lora_rank=64, window=128,
                        indexer_heads=4, indexer_dim=64, indexer_top_k=32, hash_layers=2, n_expert=16,
                        n_expert_used=4, n_ff_exp=256, n_expert_shared=1, n_vocab=8192, n_mtp=1, mtp_ratio=0,
                        clamp_exp=1.5, clamp_shexp=1.0, hc_base_std=2.0, embd_std=1.0, successor_head=True,
                        vocab="deepseek"),
        # DeepSeek-V4-Flash at its real layer shapes (43 layers, 129280-token vocabulary in the
        # real model; here a few layers and the qwen2-style vocabulary of that size).
        Deepseek4Preset("deepseek-v4-flash", compress_ratios=(0, 0, 4, 128), n_embd=4096, n_head=64, head_dim=512,
                        n_rot=64, q_lora_rank=1024, o_groups=8, o_lora_rank=1024, window=128, indexer_heads=64,
                        indexer_dim=128, indexer_top_k=512, hash_layers=3, n_expert=256, n_expert_used=6,
                        n_ff_exp=2048, n_expert_shared=1, n_vocab=129280, vocab="qwen2"),
    )
}


def resolve_preset(preset: str | Deepseek4Preset, expert_type: str | None = None,
                   **overrides: Any) -> Deepseek4Preset:
    """A validated preset with fields replaced. ConfigError for an unknown name or a bad field."""
    changes = dict(overrides)
    if expert_type is not None:
        changes["expert_type"] = expert_type
    return lookup_preset(preset, PRESETS, "deepseek4 synthetic preset", changes)


_T = ArchTensor


def tensor_plan(p: Deepseek4Preset) -> list[_T]:
    """Every tensor of the model in file order."""
    H, V, NH, D = p.n_embd, p.n_vocab, p.n_head, p.head_dim
    C = p.hc
    M = (2 + C) * C
    E, K, I, S = p.n_expert, p.n_expert_used, p.n_ff_exp, p.n_ff_exp * p.n_expert_shared  # noqa: E741
    Rq, G, Ro = p.q_lora_rank, p.o_groups, p.o_lora_rank
    dt = p.dense_type
    hc_std = 1.0 / math.sqrt(C * H)
    out: list[_T] = [
        _T("token_embd.weight", (H, V), p.embd_type, p.embd_std or 4.0 / math.sqrt(H)),
        _T("output_norm.weight", (H,), "F32", kind="norm"),
        _T("output.weight", (H, V), p.embd_type, 4.0 / math.sqrt(H), kind="successor" if p.successor_head else "rand"),
        _T("output_hc_fn.weight", (C * H, C), "F32", hc_std),
        _T("output_hc_base.weight", (C,), "F32", p.hc_base_std, kind="bias"),
        _T("output_hc_scale.weight", (1,), "F32", kind="const", value=0.5),
    ]
    ratios = p.compress_ratios + (p.mtp_ratio,) * p.n_mtp
    for i, ratio in enumerate(ratios):
        b = f"blk.{i}."
        out += [
            _T(b + "attn_norm.weight", (H,), "F32", kind="norm"),
            _T(b + "attn_sinks.weight", (NH,), "F32", 1.0, kind="bias"),
            _T(b + "attn_q_a.weight", (H, Rq), dt, 1.0 / math.sqrt(H)),
            _T(b + "attn_q_a_norm.weight", (Rq,), "F32", kind="norm"),
            _T(b + "attn_q_b.weight", (Rq, NH * D), dt, 1.0 / math.sqrt(Rq)),
            _T(b + "attn_kv.weight", (H, D), dt, 1.0 / math.sqrt(H)),
            _T(b + "attn_kv_a_norm.weight", (D,), "F32", kind="norm"),
            _T(b + "attn_output_a.weight", (NH * D // G, Ro * G), dt, 1.0 / math.sqrt(NH * D // G)),
            _T(b + "attn_output_b.weight", (G * Ro, H), dt, 1.0 / math.sqrt(G * Ro)),
            _T(b + "hc_attn_fn.weight", (C * H, M), "F32", hc_std),
            _T(b + "hc_attn_base.weight", (M,), "F32", p.hc_base_std, kind="bias"),
            _T(b + "hc_attn_scale.weight", (3,), "F32", kind="const", value=0.5),
            _T(b + "hc_ffn_fn.weight", (C * H, M), "F32", hc_std),
            _T(b + "hc_ffn_base.weight", (M,), "F32", p.hc_base_std, kind="bias"),
            _T(b + "hc_ffn_scale.weight", (3,), "F32", kind="const", value=0.5),
        ]
        if ratio:
            c = 2 if ratio == 4 else 1
            out += [
                _T(b + "attn_compressor_kv.weight", (H, c * D), dt, 1.0 / math.sqrt(H)),
                _T(b + "attn_compressor_gate.weight", (H, c * D), dt, 1.0 / math.sqrt(H)),
                _T(b + "attn_compressor_ape.weight", (c * D, ratio), "F32", 0.5),
                _T(b + "attn_compressor_norm.weight", (D,), "F32", kind="norm"),
            ]
            if ratio == 4:
                Ni, Di = p.indexer_heads, p.indexer_dim
                out += [
                    _T(b + "indexer.proj.weight", (H, Ni), dt, 1.0 / math.sqrt(H)),
                    _T(b + "indexer.attn_q_b.weight", (Rq, Ni * Di), dt, 1.0 / math.sqrt(Rq)),
                    _T(b + "indexer_compressor_kv.weight", (H, 2 * Di), dt, 1.0 / math.sqrt(H)),
                    _T(b + "indexer_compressor_gate.weight", (H, 2 * Di), dt, 1.0 / math.sqrt(H)),
                    _T(b + "indexer_compressor_ape.weight", (2 * Di, ratio), "F32", 0.5),
                    _T(b + "indexer_compressor_norm.weight", (Di,), "F32", kind="norm"),
                ]
        out.append(_T(b + "ffn_gate_inp.weight", (H, E), "F32", 2.0 / math.sqrt(H)))
        if i < p.hash_layers:
            out.append(_T(b + "ffn_gate_tid2eid.weight", (K, V), "I32", kind="tid2eid", n_expert=E))
        else:
            out.append(_T(b + "exp_probs_b.bias", (E,), "F32", 0.05, kind="bias"))
        out += [
            _T(b + "ffn_norm.weight", (H,), "F32", kind="norm"),
            _T(b + "ffn_gate_exps.weight", (H, I, E), p.expert_type, 1.0 / math.sqrt(H), n_expert=E),
            _T(b + "ffn_up_exps.weight", (H, I, E), p.expert_type, 1.0 / math.sqrt(H), n_expert=E),
            _T(b + "ffn_down_exps.weight", (I, H, E), p.expert_type, 1.0 / math.sqrt(I), n_expert=E),
            _T(b + "ffn_gate_shexp.weight", (H, S), dt, 1.0 / math.sqrt(H)),
            _T(b + "ffn_up_shexp.weight", (H, S), dt, 1.0 / math.sqrt(H)),
            _T(b + "ffn_down_shexp.weight", (S, H), dt, 1.0 / math.sqrt(S)),
        ]
        if i >= p.n_layer:
            out += [
                _T(b + "nextn.eh_proj.weight", (2 * H, H), dt, 1.0 / math.sqrt(2 * H)),
                _T(b + "nextn.enorm.weight", (H,), "F32", kind="norm"),
                _T(b + "nextn.hnorm.weight", (H,), "F32", kind="norm"),
            ]
    return out


def model_metadata(p: Deepseek4Preset, seed: int) -> dict[str, tuple[Any, str]]:
    """Architecture keys: key -> (value, gguf value type name), in file order."""
    a = ARCH
    n_all = p.n_layer + p.n_mtp
    kv: dict[str, tuple[Any, str]] = {
        **general_metadata(p, seed),
        f"{a}.block_count": (n_all, "UINT32"),
        f"{a}.context_length": (p.n_ctx_train, "UINT32"),
        f"{a}.embedding_length": (p.n_embd, "UINT32"),
        f"{a}.attention.head_count": (p.n_head, "UINT32"),
        f"{a}.attention.head_count_kv": (1, "UINT32"),
        f"{a}.attention.key_length": (p.head_dim, "UINT32"),
        f"{a}.attention.value_length": (p.head_dim, "UINT32"),
        f"{a}.rope.dimension_count": (p.n_rot, "UINT32"),
        f"{a}.rope.freq_base": (p.rope_freq_base, "FLOAT32"),
        f"{a}.attention.layer_norm_rms_epsilon": (p.rms_eps, "FLOAT32"),
        f"{a}.attention.q_lora_rank": (p.q_lora_rank, "UINT32"),
        f"{a}.attention.sliding_window": (p.window, "UINT32"),
        f"{a}.attention.output_group_count": (p.o_groups, "UINT32"),
        f"{a}.attention.output_lora_rank": (p.o_lora_rank, "UINT32"),
        f"{a}.attention.compress_rope_freq_base": (p.compress_rope_base, "FLOAT32"),
        f"{a}.attention.compress_ratios": (list(p.compress_ratios) + [p.mtp_ratio] * p.n_mtp, "ARRAY:UINT32"),
        f"{a}.attention.indexer.head_count": (p.indexer_heads, "UINT32"),
        f"{a}.attention.indexer.key_length": (p.indexer_dim, "UINT32"),
        f"{a}.attention.indexer.top_k": (p.indexer_top_k, "UINT32"),
        f"{a}.hyper_connection.count": (p.hc, "UINT32"),
        f"{a}.hyper_connection.sinkhorn_iterations": (p.hc_iters, "UINT32"),
        f"{a}.hyper_connection.epsilon": (p.hc_eps, "FLOAT32"),
        f"{a}.hash_layer_count": (p.hash_layers, "UINT32"),
        f"{a}.expert_count": (p.n_expert, "UINT32"),
        f"{a}.expert_used_count": (p.n_expert_used, "UINT32"),
        f"{a}.expert_feed_forward_length": (p.n_ff_exp, "UINT32"),
        f"{a}.expert_shared_count": (p.n_expert_shared, "UINT32"),
        f"{a}.expert_weights_norm": (True, "BOOL"),
        f"{a}.expert_weights_scale": (p.weights_scale, "FLOAT32"),
        f"{a}.expert_gating_func": (4, "UINT32"),
        f"{a}.swiglu_clamp_exp": (p.clamp_exp, "FLOAT32"),
        f"{a}.swiglu_clamp_shexp": (p.clamp_shexp, "FLOAT32"),
        f"{a}.vocab_size": (p.n_vocab, "UINT32"),
    }
    if p.n_mtp:
        kv[f"{a}.nextn_predict_layers"] = (p.n_mtp, "UINT32")
    if p.yarn_factor:
        kv[f"{a}.rope.scaling.type"] = ("yarn", "STRING")
        kv[f"{a}.rope.scaling.factor"] = (p.yarn_factor, "FLOAT32")
        kv[f"{a}.rope.scaling.original_context_length"] = (p.yarn_orig_ctx, "UINT32")
    return kv


def write_deepseek4(path: str | Path, preset: str | Deepseek4Preset, expert_type: str | None = None,
                    seed: int = 0, sparse: bool = False, progress: Callable[[int, int], None] | None = None,
                    metadata_overrides: dict[str, Any] | None = None, **preset_overrides: Any) -> Path:
    """Write a synthetic deepseek4 GGUF and return its path.

    Args:
        path: output file (written beside it, then renamed).
        preset: a PRESETS name or a Deepseek4Preset; ``expert_type`` and ``preset_overrides``
            (Deepseek4Preset fields, e.g. ``compress_ratios``) replace its fields.
        seed: the same arguments always give the same bytes.
        sparse: header only, the file extended to its full size without data (for ``check``
            and planning of real-shape presets; not for computing).
        progress: ``progress(bytes_written, total_bytes)`` after each chunk.
        metadata_overrides: full keys whose value replaces the preset's in the header (the
            tensors unchanged: a header/tensor disagreement for the checks' tests); None drops
            the key.

    Raises ConfigError (bad preset) or ModelFileError (the vocabulary source missing).
    """
    p = resolve_preset(preset, expert_type=expert_type, **preset_overrides)
    path = Path(path)
    meta = model_metadata(p, seed)
    override_metadata(meta, metadata_overrides)
    vocab = deepseek_vocab_metadata(p.n_vocab) if p.vocab == "deepseek" else vocab_metadata(p.vocab, p.n_vocab)
    plans = apply_tensor_types(tensor_plan(p), p.tensor_types, f"synthetic preset {p.name}")
    write_gguf(path, ARCH, meta, vocab, plans, lambda t: arch_tensor_chunks(t, seed, p), sparse=sparse,
               progress=progress)
    log.info("synthetic_model_written", path=str(path), preset=p.name, arch=ARCH, n_layer=p.n_layer,
             n_mtp=p.n_mtp, expert_type=p.expert_type, seed=seed, sparse=sparse, bytes=path.stat().st_size)
    return path


def main(argv: list[str] | None = None) -> int:
    """``python -m moe_service.synth_deepseek4 --preset NAME --out PATH [--ratios 0,4,128]
    [--hash-layers N] [--expert-type T] [--tensor-types RECIPE] [--seed S] [--sparse]``.

    ``--ratios`` with fewer layers than the preset's hash-routed layers keeps the hash routing
    on at most that many layers (e.g. ``--preset deepseek-v4-flash --ratios 4,128``: two
    layers, both hash-routed), unless ``--hash-layers`` says otherwise."""

    def extra_args(ap) -> None:
        ap.add_argument("--ratios", default=None, help="compress ratio per trunk layer, comma-separated (layer count)")
        ap.add_argument("--hash-layers", type=int, default=None,
                        help="leading layers routed by token id (default: the preset's, capped at the layer count)")

    def write(args) -> Path:
        extra: dict[str, Any] = {}
        if args.ratios is not None:
            extra["compress_ratios"] = tuple(int(x) for x in args.ratios.split(","))
            extra["hash_layers"] = min(PRESETS[args.preset].hash_layers, len(extra["compress_ratios"]))
        if args.hash_layers is not None:
            extra["hash_layers"] = args.hash_layers
        if args.tensor_types is not None:
            extra["tensor_types"] = args.tensor_types
        return write_deepseek4(args.out, args.preset, expert_type=args.expert_type, seed=args.seed,
                               sparse=args.sparse, **extra)

    return writer_cli(argv, prog="python -m moe_service.synth_deepseek4", doc=main.__doc__, presets=PRESETS,
                      expert_types=EXPERT_TYPES, write=write, extra_args=extra_args)


if __name__ == "__main__":
    raise SystemExit(main())
