"""Architectures: one module per GGUF ``general.architecture``, and the registry.

The engine's forward pass (moe_service.engine.model.Model) is generic: embed, then
``arch.block(backend, layer, x, step)`` per layer, then the output norm and head. What
differs between architectures lives in one module each (base.py says what a module
declares): hyperparameters, tensor list with shapes and types, KV needs per layer, RoPE,
routing rule, MoE activation, and the block function. The same declarations check a model
file before anything is loaded (:func:`check_model`: ``moe-service check``, preflight, the
start of ``serve``, and Model itself).

Backend primitives a block may call (CpuPath and TorchPath in model.py implement each once;
arrays are numpy float32 on the CPU path, torch float32 on the device path; T tokens)::

    be.rmsnorm(x [T, n], w [n], eps) -> [T, n]
    be.rmsnorm_heads(x [T, heads, d], w [d], eps) -> [T, heads, d]
    be.linear(lw, names, x [T, n_in]) -> [ [T, n_out] per name ]  (+ the layer's "<name>" bias when loaded)
    be.heads(x [T, heads*d], heads, d) -> [T, heads, d] contiguous;  be.flat(x [T, a, b]) -> [T, a*b]
    be.rope(x [T, heads, R'], positions, st.rope) -> x with its first R dims rotated
    be.head_linear(W, x [T, NH, n_in]) -> [T, NH, n_out]   per-head matmul (W from be.head_mat /
                 be.head_mat_float in Architecture.prepare_layer; deepseek2's MLA absorption)
    be.concat([a, b, ...], axis) -> the arrays joined along axis
    be.attention(layer, q [T, NH, D], k [T, NKV, D], v [T, NKV, Dv] | None, spans, scale,
                 *, window=0, sinks=None, value_dim=0) -> [T, NH, Dv]
                 (stores k, v in the layer's cache then attends: engine/attention/; a latent
                  layer passes v=None and value_dim: the cache row is the key, V its first Dv dims)
    be.glu_ffn(lw, h [T, H], (gate, up, down), act=MoEAct()) -> [T, H]   dense or shared experts
    st.route(lw, h [T, H]) -> ids int32 [T, K], w float32 [T, K]          the model's Routing
    be.moe(lw, h [T, H], ids, w) -> [T, H]   routed experts (CPU pool, or the GPU prefill offload),
                 with the activation and expert biases the layer's ExpertSet carries
    x + y, x[rows], reshape: plain array operations, the same on numpy and torch

How to add an architecture
==========================

1. Write ``moe_service/engine/arch/<name>.py`` with a subclass of
   :class:`~moe_service.engine.arch.base.Architecture` (or of an existing one, e.g.
   :class:`~moe_service.engine.arch.llama.Llama`, overriding only what differs):

   - ``names``: the ``general.architecture`` values it serves;
   - ``read_hparams(r)``: a frozen dataclass of every hyperparameter, read with
     ``r.int / r.float / r.bool / r.str`` (ranges given there; errors name the file and key);
     ``check_hparams()``: (key, sentence) for each inconsistency between them;
   - ``tensors()``: a :class:`TensorSpec` (``self.spec(name, ne, types, keys, role=...)``)
     per tensor, shapes in ggml order from the hyperparameters, as llama.cpp's
     ``create_tensor`` calls for that architecture (src/llama-model.cpp); optional tensors
     ``required=False``; alternatives with :class:`OneOf`. The ``role`` says how the
     Model loads it (base.TensorSpec), so no loader code is needed;
   - ``kv_layers()``: one :class:`LayerKV` per layer (heads, key dim, value dim, latent,
     window); ``rope()``: a :class:`RopeSpec`; ``routing(k)``: a :class:`Routing` (None for
     dense); ``moe_act()``: a :class:`MoEAct`;
   - ``block(be, lw, x, st)``: the layer, composed of the primitives above; ``lw.mats``,
     ``lw.vecs`` (keyed by the tensor name without ``blk.N.`` and ``.weight``; biases as
     ``"<name>.bias"``), ``lw.router``, ``lw.experts``.
2. Add one line to :data:`ARCHITECTURES` below.
3. Give moe_service/synth/ a preset (real tensor layouts, the demo tokenizer), generate
   llama.cpp goldens with tools/make_golden.py, and add the preset to the golden tests and
   to tests/moe_service/engine/arch/test_arch_mutations.py.

A primitive that does not exist yet (a new attention form, a new activation) is added once
to both backends (CpuPath, TorchPath) and, for routed experts, to moe.py and offload.py;
never an ``if arch == ...`` inside a backend.
"""

from __future__ import annotations

from pathlib import Path

from moe_service.engine.arch.base import (
    ACT_SILU,
    ACT_SWIGLU_OAI,
    F32_ONLY,
    GATING_SIGMOID,
    GATING_SOFTMAX,
    GATING_SOFTMAX_WEIGHT,
    MATRIX_TYPES,
    VECTOR_TYPES,
    Architecture,
    HParamError,
    HParamReader,
    LayerKV,
    MoEAct,
    OneOf,
    RopeSpec,
    Routing,
    TensorSpec,
)
from moe_service.engine.arch.deepseek2 import Deepseek2
from moe_service.engine.arch.deepseek4 import Deepseek4
from moe_service.engine.arch.gpt_oss import GptOss
from moe_service.engine.arch.llama import Llama
from moe_service.engine.arch.qwen2 import Qwen2
from moe_service.engine.arch.qwen3 import Qwen3
from moe_service.engine.arch.qwen3moe import Qwen3Moe
from moe_service.engine.kv import MIN_CONTEXT, StateFn, layers_from_params
from moe_service.errors import ModelFileError
from moe_service.gguf_model import Problem

__all__ = [
    "ACT_SILU", "ACT_SWIGLU_OAI", "ARCHITECTURES", "Architecture", "F32_ONLY", "GATING_SIGMOID", "GATING_SOFTMAX",
    "GATING_SOFTMAX_WEIGHT", "HParamError", "HParamReader", "LayerKV", "MATRIX_TYPES", "MoEAct", "OneOf",
    "RopeSpec", "Routing", "TensorSpec", "VECTOR_TYPES", "check_model", "for_model", "get", "kv_needs", "register",
    "supported",
]

ARCHITECTURES: dict[str, type[Architecture]] = {}
"""``general.architecture`` value -> Architecture subclass."""


def register(cls: type[Architecture]) -> type[Architecture]:
    """Add ``cls`` under each of its ``names`` (usable as a class decorator)."""
    for name in cls.names:
        ARCHITECTURES[name] = cls
    return cls


for _cls in (Llama, Qwen3Moe, Qwen2, Qwen3, Deepseek2, Deepseek4, GptOss):
    register(_cls)


CHECK_ONLY: dict[str, type[Architecture]] = {}
"""Architectures whose files are checked in full (hyperparameters, every tensor's shape and
type) but which the engine does not run yet: :func:`check_model` names them as not runnable
after their checks pass (``runnable=False`` leaves that out: ``moe-service check`` then goes
on to the plan, and preflight's architecture check refuses the start)."""


def supported() -> list[str]:
    """The architecture names the engine runs, sorted."""
    return sorted(ARCHITECTURES)


def get(name: str, path: str | Path = "<model>") -> type[Architecture]:
    """The class for ``name``; ModelFileError (exit 3) naming it and listing the supported
    ones when there is none."""
    cls = ARCHITECTURES.get(name)
    if cls is None:
        shown = repr(name) if name else "(general.architecture missing)"
        raise ModelFileError(f"{path}: architecture {shown} is not supported "
                             f"(supported: {', '.join(supported())})")
    return cls


def for_model(catalog) -> Architecture:
    """The Architecture instance of a GGUFModel (hyperparameters read and checked).

    Raises ModelFileError: unsupported architecture, or a hyperparameter missing, out of
    range or inconsistent (naming the file and the key).
    """
    path = catalog.shards[0].path if getattr(catalog, "shards", None) else catalog.path
    name = catalog.params.arch
    return get(name, path)(catalog.metadata, path, arch=name,
                           tensor_ne={n: t.ne for n, t in catalog.tensors.items()})


def kv_needs(catalog) -> tuple[list[LayerKV], StateFn | None]:
    """What the KV plan (moe_service.engine.kv.plan_for_config) needs from ``catalog``'s
    architecture: its per-layer KV needs (``kv_layers()``) and its per-sequence state
    (``seq_state``, None when it declares none). A file no architecture here describes (or
    whose declarations fail) gets the classic layout from its GGUF parameters and no state,
    so that ``plan`` still prints a cache for it (``check`` names the real problem)."""
    try:
        a = for_model(catalog)
        layers = list(a.kv_layers())
    except Exception:  # noqa: BLE001 - unknown or malformed: the classic layout
        return layers_from_params(catalog.params), None
    fn = getattr(a, "seq_state", None)
    return layers, (fn if fn is not None and list(fn(MIN_CONTEXT)) else None)


def check_model(catalog, runnable: bool = True) -> list[Problem]:
    """Everything the architecture finds wrong with a cataloged model, before any byte of it
    is loaded: an unsupported architecture, a hyperparameter missing / out of range /
    inconsistent, a tensor missing, of another shape than the header gives, or of a type
    the architecture does not read. Empty when the model can run. Never raises for a bad
    file."""
    path = catalog.shards[0].path if getattr(catalog, "shards", None) else catalog.path
    name = catalog.params.arch
    if name not in ARCHITECTURES and name in CHECK_ONLY:
        try:
            arch = CHECK_ONLY[name](catalog.metadata, path, arch=name,
                                    tensor_ne={n: t.ne for n, t in catalog.tensors.items()})
        except HParamError as e:
            return [Problem("arch_hparam", str(e), Path(path))]
        problems = arch.check_tensors(catalog) or arch.check_consistency(catalog)
        if problems or not runnable:
            return problems
        return [Problem("architecture", f"{path}: architecture {name!r}: the header and tensors agree, but this "
                        f"engine does not run {name} yet (its forward pass is not built; supported: "
                        f"{', '.join(supported())})", Path(path))]
    try:
        arch = for_model(catalog)
    except HParamError as e:
        return [Problem("arch_hparam", str(e), Path(path))]
    except ModelFileError as e:
        return [Problem("architecture", str(e), Path(path))]
    problems = arch.check_tensors(catalog)
    if problems:
        return problems
    return arch.check_consistency(catalog)


def validate(catalog) -> Architecture:
    """:func:`for_model` plus :func:`check_model`'s tensor checks; raises one ModelFileError
    listing the problems (``err.problems``) when the model cannot run."""
    problems = check_model(catalog)
    if problems:
        path = catalog.shards[0].path if getattr(catalog, "shards", None) else catalog.path
        shown = "; ".join(p.message for p in problems[:8])
        more = f"; and {len(problems) - 8} more" if len(problems) > 8 else ""
        err = ModelFileError(f"{path}: {len(problems)} problem(s) for the architecture: {shown}{more}"
                             if len(problems) > 1 else problems[0].message)
        err.problems = problems
        raise err
    return for_model(catalog)
