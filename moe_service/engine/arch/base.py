"""What an architecture module declares, and the checks built from it.

An architecture (one module in this package) is a subclass of :class:`Architecture` that
says, from the GGUF metadata alone:

- its hyperparameters (:meth:`Architecture.read_hparams`: a typed dataclass read through
  :class:`HParamReader`, whose errors name the file and the key), and their consistency
  (:meth:`Architecture.check_hparams`);
- its tensors (:meth:`Architecture.tensors`): every name with the ggml shape ``ne`` and the
  types it must have, derived from the hyperparameters, and the metadata keys that shape
  comes from (so a header/tensor disagreement is reported with the key to blame);
- its per-layer KV cache needs (:meth:`Architecture.kv_layers`: :class:`LayerKV`), its RoPE
  (:class:`RopeSpec`), its routing rule (:class:`Routing`) and MoE activation
  (:class:`MoEAct`);
- its block function (:meth:`Architecture.block`), composed of the backend primitives
  (moe_service.engine.model.CpuPath / TorchPath; the list is in the package docstring).

Nothing here imports torch or numba: ``moe-service check`` runs the same checks as a start.
Shape legend: H hidden (n_embd), NH / NKV query / KV heads, D key (head) dim, Dv value dim,
R rotated dims, E experts, K experts per token, I expert width, F dense FFN width, V vocab.
ggml order throughout (``ne[0]`` = elements per row), as llama.cpp's ``create_tensor``.
"""

from __future__ import annotations

import builtins
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, overload

from gguf import GGMLQuantizationType as _T

from moe_service.engine.kv import LayerKV  # the KV plan's per-layer needs, declared by kv_layers()
from moe_service.errors import ModelFileError
from moe_service.gguf_model import SUPPORTED_GGML_TYPES, Problem

# ---------------------------------------------------------------------------------------------
# Tensor types an architecture may allow

MATRIX_TYPES: frozenset[int] = SUPPORTED_GGML_TYPES - {int(_T.I32)}
"""Weights the quantized matmul kernels read in place (every type the catalog supports but
the int32 index tables)."""
VECTOR_TYPES: frozenset[int] = frozenset(int(t) for t in (_T.F32, _T.F16, _T.BF16))
"""Norm weights, biases, sinks, router matrices: dequantized to float32 once at load."""
F32_ONLY: frozenset[int] = frozenset({int(_T.F32)})
"""Tensors the kernels read as raw float32 in the arena (expert biases)."""


class HParamError(ModelFileError):
    """A hyperparameter is missing or out of range; ``key`` is the full metadata key."""

    def __init__(self, message: str, key: str):
        super().__init__(message)
        self.key = key


class HParamReader:
    """Reads ``{arch}.{key}`` metadata values with the checks every architecture needs.

    ``metadata``: the first shard's key/value pairs (GGUFModel.metadata); ``path``: the file
    named in errors. Every method raises :class:`HParamError` naming the file and the full
    key. Per-layer arrays (llama.cpp's ``get_key_or_arr``) are accepted when every layer has
    the same value. ``keys`` records each key read (short name -> full key).
    """

    _MISSING = object()

    def __init__(self, metadata: dict, arch: str, path: str | Path):
        self.md, self.arch, self.path = metadata, arch, str(path)
        self.keys: dict[str, str] = {}

    def full(self, key: str) -> str:
        return key if "." in key and key.split(".", 1)[0] in ("general", "tokenizer") else f"{self.arch}.{key}"

    def _get(self, key: str, default):
        full = self.full(key)
        self.keys[key] = full
        v = self.md.get(full, self._MISSING)
        if v is self._MISSING:
            if default is self._MISSING:
                raise HParamError(f"{self.path}: metadata key {full} is missing", full)
            return default, full
        if isinstance(v, list):
            vals = set(v)
            if len(vals) != 1:
                raise HParamError(f"{self.path}: metadata key {full} has per-layer values {sorted(vals)[:8]}; "
                                  "only one value for every layer is supported", full)
            v = v[0]
        return v, full

    # A default of None is returned as is when the key is missing (the overloads say so); any
    # other default is returned when the key is missing and checked like a value otherwise.
    @overload
    def int(self, key: str, default: None, *, lo: builtins.int = 0, hi: builtins.int = 1 << 40) -> builtins.int | None: ...
    @overload
    def int(self, key: str, default: Any = _MISSING, *, lo: builtins.int = 0,
            hi: builtins.int = 1 << 40) -> builtins.int: ...

    def int(self, key: str, default: Any = _MISSING, *, lo: builtins.int = 0,
            hi: builtins.int = 1 << 40) -> builtins.int | None:
        """An integer in [lo, hi] (a missing key gives ``default`` when one is given)."""
        v, full = self._get(key, default)
        if v is None:
            return v
        if isinstance(v, bool) or not isinstance(v, int):
            raise HParamError(f"{self.path}: metadata key {full} is {v!r}, expected an integer", full)
        if not lo <= v <= hi:
            raise HParamError(f"{self.path}: metadata key {full} is {v}, expected {lo}..{hi}", full)
        return int(v)

    @overload
    def float(self, key: str, default: None, *, lo: builtins.float = -math.inf, hi: builtins.float = math.inf,
              lo_open: builtins.bool = False) -> builtins.float | None: ...
    @overload
    def float(self, key: str, default: Any = _MISSING, *, lo: builtins.float = -math.inf,
              hi: builtins.float = math.inf, lo_open: builtins.bool = False) -> builtins.float: ...

    def float(self, key: str, default: Any = _MISSING, *, lo: builtins.float = -math.inf,
              hi: builtins.float = math.inf, lo_open: builtins.bool = False) -> builtins.float | None:
        """A finite float in [lo, hi] ((lo, hi] with ``lo_open``)."""
        v, full = self._get(key, default)
        if v is None:
            return v
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise HParamError(f"{self.path}: metadata key {full} is {v!r}, expected a finite number", full)
        if v < lo or v > hi or (lo_open and v == lo):
            rng = f"{'(' if lo_open else '['}{lo}, {hi}]"
            raise HParamError(f"{self.path}: metadata key {full} is {v}, expected a value in {rng}", full)
        return float(v)

    def bool(self, key: str, default: Any = _MISSING) -> bool:
        v, full = self._get(key, default)
        if not isinstance(v, bool | int):
            raise HParamError(f"{self.path}: metadata key {full} is {v!r}, expected a boolean", full)
        return bool(v)

    @overload
    def str(self, key: str, default: None) -> builtins.str | None: ...
    @overload
    def str(self, key: str, default: Any = _MISSING) -> builtins.str: ...

    def str(self, key: str, default: Any = _MISSING) -> builtins.str | None:
        v, full = self._get(key, default)
        if v is not None and not isinstance(v, str):
            raise HParamError(f"{self.path}: metadata key {full} is {v!r}, expected a string", full)
        return v


# ---------------------------------------------------------------------------------------------
# Declarations


@dataclass(frozen=True)
class TensorSpec:
    """One tensor an architecture reads.

    ``name``: full GGUF name; ``ne``: ggml shape (ne[0] fastest); ``types``: allowed ggml type
    ids; ``keys``: the metadata keys its shape derives from (named when it disagrees);
    ``required``: False for tensors llama.cpp treats as optional (``TENSOR_NOT_REQUIRED``);
    ``role``: how the engine loads it: ``"mat"`` (2-D weight read in place by the matmul
    kernels), ``"vec"`` (float32 vector: norms, biases, sinks), ``"router"`` (float32 matrix
    [E, H]), ``"router_bias"`` (float32 [E] selection bias, ``exp_probs_b``), ``"expert"``
    (3-D routed-expert tensor, slab per expert), ``"expert_bias"``
    (float32 [E, rows] read in place by the MoE kernels), ``"model"`` (token_embd, output,
    output_norm, rope_freqs: the Model reads them itself), ``"custom"`` (checked here, loaded
    by the architecture's :meth:`Architecture.prepare_layer`).
    """

    name: str
    ne: tuple[int, ...]
    types: frozenset[int]
    keys: tuple[str, ...] = ()
    required: bool = True
    role: str = "mat"


@dataclass(frozen=True)
class OneOf:
    """Alternative tensor sets, one of which must be present (e.g. separate gate/up experts
    or one fused gate_up tensor). ``options``: tuples of TensorSpec; every tensor present
    from any option is shape-checked."""

    options: tuple[tuple[TensorSpec, ...], ...]
    what: str


@dataclass(frozen=True)
class RopeSpec:
    """RoPE of an architecture, as ggml's rope with YaRN (ggml_rope_yarn_corr_dims, rope_yarn).

    ``dim``: rotated dims R of each head (the first R, or the given slice the block passes);
    ``base``: theta base; ``neox``: pairs (i, i + R/2) instead of (2i, 2i+1); ``freq_scale``:
    1 / the context scaling factor; ``ext_factor``: YaRN ramp mix (0: plain linear
    interpolation by ``freq_scale``); ``attn_factor``: mscale multiplying cos and sin;
    ``beta_fast`` / ``beta_slow``, ``n_ctx_orig``: YaRN correction dims; ``freqs_tensor``:
    name of a per-dimension frequency-factor tensor (llama3's ``rope_freqs.weight``) when the
    file has one.
    """

    dim: int
    base: float
    neox: bool
    freq_scale: float = 1.0
    ext_factor: float = 0.0
    attn_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    n_ctx_orig: int = 0
    freqs_tensor: str | None = None


GATING_SOFTMAX = 0  # probabilities = softmax over all experts' logits
GATING_SIGMOID = 1  # probabilities = sigmoid of each logit (deepseek2 expert_gating_func = 2)
GATING_SOFTMAX_WEIGHT = 2  # select by logits, weights = softmax over the K selected logits (gpt-oss)


@dataclass(frozen=True)
class Routing:
    """The routing rule of an MoE layer (llama.cpp build_moe_ffn, src/llama-graph.cpp).

    ``k`` experts per token; ``gating``: GATING_*; selection score = probability + the
    layer's ``exp_probs_b`` when it has one (selects, does not weight); ``n_group`` /
    ``n_group_used``: group-limited top-k (experts split into ``n_group`` equal groups,
    group score = sum of its 2 best selection scores, only the best ``n_group_used`` groups
    compete; 1/1 = off); ``norm``: weights renormalised to sum 1; ``scale``: weights times
    this. Ties go to the lower expert id.
    """

    k: int
    gating: int = GATING_SOFTMAX
    norm: bool = True
    scale: float = 1.0
    n_group: int = 1
    n_group_used: int = 1


ACT_SILU = 0  # moe_service.engine.moe.ACT_SILU: silu(g) * u
ACT_SWIGLU_OAI = 1  # moe.ACT_SWIGLU_OAI: min(g, limit) * sigmoid(alpha min(g, limit)) * (clamp(u, +-limit) + 1)
ACT_SWIGLU_CLAMP = 2  # moe.ACT_SWIGLU_CLAMP: silu(min(g, limit)) * clamp(u, +-limit) (deepseek4)


@dataclass(frozen=True)
class MoEAct:
    """The expert FFN activation: ``kind`` ACT_SILU or ACT_SWIGLU_OAI with ``alpha`` and
    ``limit`` (gpt-oss: 1.702, 7.0). Carried by each layer's ExpertSet, so the CPU MoE step,
    its reference path and the GPU prefill offload all apply the same one."""

    kind: int = ACT_SILU
    alpha: float = 1.702
    limit: float = 7.0


# ---------------------------------------------------------------------------------------------
# The base class


class Architecture:
    """One GGUF ``general.architecture`` (or several that share a layout): subclass it in a
    module of this package and register it (package docstring).

    Construction reads and checks the hyperparameters: ``Arch(metadata, path)`` (``tensor_ne``:
    the file's tensor shapes, for sizes no key gives, e.g. the vocabulary) raises
    HParamError (a ModelFileError, exit 3) naming the file and the key. Then
    :meth:`tensors`, :meth:`kv_layers`, :meth:`rope`, :meth:`routing`, :meth:`moe_act`
    describe the model and :meth:`block` computes one layer.
    """

    names: ClassVar[tuple[str, ...]] = ()

    def __init__(self, metadata: dict, path: str | Path = "<model>", arch: str | None = None,
                 tensor_ne: dict[str, tuple[int, ...]] | None = None):
        self.name = arch or metadata.get("general.architecture") or self.names[0]
        self.path = str(path)
        self.tensor_ne = tensor_ne or {}  # name -> ne of the file's tensors, when known (sizes no key gives)
        self.r = HParamReader(metadata, self.name, self.path)
        self.hp = self.read_hparams(self.r)
        problems = self.check_hparams()
        if problems:
            key, msg = problems[0]
            raise HParamError(f"{self.path}: {msg}", key)

    def read_n_vocab(self, r: HParamReader) -> int:
        """The vocabulary size: the tokenizer's token list, else ``<arch>.vocab_size``, else
        token_embd's rows (0 when none of them is known)."""
        tokens = r.md.get("tokenizer.ggml.tokens")
        n_vocab = len(tokens) if isinstance(tokens, list) else r.int("vocab_size", 0, hi=1 << 24)
        if not n_vocab:
            ne = self.tensor_ne.get("token_embd.weight")
            n_vocab = int(ne[1]) if ne is not None and len(ne) == 2 else 0
        return n_vocab

    # -- to override -------------------------------------------------------------------------

    def read_hparams(self, r: HParamReader):
        """The typed hyperparameters (a dataclass) read through ``r``."""
        raise NotImplementedError

    def check_hparams(self) -> list[tuple[str, str]]:
        """(full key, sentence) for every inconsistency between hyperparameters."""
        return []

    def tensors(self) -> Sequence[TensorSpec | OneOf]:
        """Every tensor the model reads, with shapes from the hyperparameters."""
        raise NotImplementedError

    def kv_layers(self) -> list[LayerKV]:
        """One LayerKV per layer."""
        raise NotImplementedError

    def seq_state(self, n_ctx: int) -> list:
        """Arrays this architecture keeps per sequence beside the KV rows, for a context of
        ``n_ctx`` tokens (moe_service.engine.kv.SeqState: layer, name, per-sequence shape,
        dtype). The plan counts them and the KV cache allocates them (``KVCache.state``).
        Default: none."""
        return []

    def rope(self) -> RopeSpec | None:
        return None

    def routing(self, k: int = 0) -> Routing | None:
        """The routing rule with ``k`` experts per token (0: the model's own); None for a
        dense model."""
        return None

    def moe_act(self) -> MoEAct:
        return MoEAct()

    def block(self, be, lw, x, st):
        """One layer: x [T, H] float32 (backend array) -> x [T, H]. ``be``: the backend
        (CpuPath or TorchPath), ``lw``: moe_service.engine.model.LayerWeights, ``st``: the
        step (positions, spans, rope table, route)."""
        raise NotImplementedError

    def prepare_layer(self, be, lw) -> None:
        """Load what the generic roles do not cover (tensors declared with ``role="custom"``)
        into ``lw``, through the backend's loading primitives (e.g. ``be.head_mat``). Called
        once per layer at load, after the role-based loading. Default: nothing."""

    def final_norm(self, be, x, w):
        """The output norm before the head (RMSNorm with the model's epsilon by default)."""
        return be.rmsnorm(x, w, self.hp.rms_eps)

    # -- helpers for subclasses ---------------------------------------------------------------

    def key(self, short: str) -> str:
        return self.r.full(short)

    def spec(self, name: str, ne: tuple[int, ...], types: frozenset[int] = MATRIX_TYPES, keys: tuple[str, ...] = (),
             *, required: bool = True, role: str = "mat") -> TensorSpec:
        return TensorSpec(name, tuple(int(n) for n in ne), types, tuple(self.key(k) for k in keys), required, role)

    # -- the check -------------------------------------------------------------------------

    def check_tensors(self, catalog) -> list[Problem]:
        """Presence, shape and type of every declared tensor in ``catalog`` (GGUFModel), and
        the vocabulary against token_embd. One Problem per tensor at fault, naming the file,
        the tensor, the expected and found shape and the keys the shape comes from."""
        out: list[Problem] = []
        tensors = catalog.tensors
        for item in self.tensors():
            if isinstance(item, OneOf):
                have = [opt for opt in item.options if all(s.name in tensors for s in opt if s.required)]
                if not have:
                    names = " or ".join("+".join(s.name for s in opt) for opt in item.options)
                    out.append(Problem("arch_tensor", f"{self.path}: {item.what}: tensor {names} is missing",
                                       Path(self.path), item.options[0][0].name))
                    continue
                specs = [s for opt in item.options for s in opt]
            else:
                specs = [item]
            for s in specs:
                t = tensors.get(s.name)
                if t is None:
                    if s.required and not isinstance(item, OneOf):
                        out.append(Problem("arch_tensor", f"{self.path}: tensor {s.name} is missing "
                                           f"({self.name} needs it)", Path(self.path), s.name))
                    continue
                if tuple(t.ne) != s.ne:
                    keys = f" ({', '.join(f'{k}={self._md_value(k)}' for k in s.keys)})" if s.keys else ""
                    out.append(Problem("arch_shape", f"{self.path}: tensor {s.name} has shape {list(t.ne)} but the "
                                       f"header gives {list(s.ne)}{keys}", Path(self.path), s.name))
                elif t.ggml_type not in s.types:
                    allowed = ", ".join(sorted(_T(x).name for x in s.types))
                    out.append(Problem("arch_type", f"{self.path}: tensor {s.name} is {t.type_name}, {self.name} "
                                       f"reads it as one of {allowed}", Path(self.path), s.name))
        return out

    def check_consistency(self, catalog) -> list[Problem]:
        """Checks beyond one tensor's shape (run after :meth:`check_tensors` passed): the
        vocabulary size keys against token_embd, by default."""
        out: list[Problem] = []
        emb = catalog.tensors.get("token_embd.weight")
        rows = emb.ne[1] if emb is not None and len(emb.ne) == 2 else None
        tokens = self.r.md.get("tokenizer.ggml.tokens")
        if rows is not None and isinstance(tokens, list) and len(tokens) != rows:
            out.append(Problem("arch_shape", f"{self.path}: tokenizer.ggml.tokens lists {len(tokens)} tokens but "
                               f"tensor token_embd.weight has {rows} rows", Path(self.path), "token_embd.weight"))
        vs = self.r.md.get(f"{self.name}.vocab_size")
        if rows is not None and isinstance(vs, int) and vs != rows:
            out.append(Problem("arch_shape", f"{self.path}: metadata key {self.name}.vocab_size is {vs} but tensor "
                               f"token_embd.weight has {rows} rows", Path(self.path), "token_embd.weight"))
        return out

    def _md_value(self, full_key: str):
        v = self.r.md.get(full_key)
        return "absent" if v is None else v
