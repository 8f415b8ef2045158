"""The GGUF writer every synthetic architecture shares: general keys, metadata overrides,
preset lookup, the generic tensor plan entry (:class:`ArchTensor`) and its bytes, the atomic
GGUF writer, and the ``python -m moe_service.synth...`` command shape (:func:`writer_cli`)."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moe_service.errors import ConfigError
from moe_service.paths import gguf_written_atomically
from moe_service.synth.blocks import (
    _uniform_pm1,
    random_bytes,
    successor_q8_head,
    tensor_nbytes,
    weight_chunks,
)
from moe_service.synth.recipe import tensor_types_arg

DENSE_TYPES = ("F32", "F16", "Q8_0")

# general.file_type (llama_ftype) by expert type
_FILE_TYPES = {"Q8_0": 7, "Q4_0": 2, "Q4_1": 3, "Q4_K": 15, "Q5_K": 17, "Q6_K": 18, "MXFP4": 38, "Q5_0": 8, "Q5_1": 9,
               "Q2_K": 10, "Q3_K": 12, "IQ4_XS": 30, "IQ4_NL": 25, "IQ2_XXS": 19, "IQ2_XS": 20, "IQ2_S": 28,
               "IQ3_XXS": 23, "IQ3_S": 26, "IQ1_S": 24, "IQ1_M": 31}
"""(llama.cpp's llama_ftype: Q3_K is LLAMA_FTYPE_MOSTLY_Q3_K_M, the others their MOSTLY_ type)"""


def general_metadata(p: Any, seed: int) -> dict[str, tuple[Any, str]]:
    """The ``general.*`` keys every synthetic writer puts first: key -> (value, gguf value type
    name). ``p`` is a preset (name, expert_type, n_layer)."""
    return {
        "general.type": ("model", "STRING"),
        "general.name": (f"synthetic {p.name} {p.expert_type} L{p.n_layer} seed{seed}", "STRING"),
        "general.file_type": (_FILE_TYPES[p.expert_type], "UINT32"),
        "general.quantization_version": (2, "UINT32"),
    }


def override_metadata(meta: dict[str, tuple[Any, str]], overrides: dict[str, Any] | None) -> None:
    """Replace (in place) architecture keys' values: a key's GGUF type is kept, a new key is
    FLOAT32 for a float and UINT32 otherwise; a value of None drops the key."""
    for key, value in (overrides or {}).items():
        if value is None:
            meta.pop(key, None)
        else:
            vtype = meta[key][1] if key in meta else ("FLOAT32" if isinstance(value, float) else "UINT32")
            meta[key] = (value, vtype)


def lookup_preset(preset: Any, presets: dict[str, Any], what: str, changes: dict[str, Any],
                  **fields: Any) -> Any:
    """A validated preset: ``preset`` (a name from ``presets``, or a preset) with the fields in
    ``changes`` replaced, and those of ``fields`` that are not None (the writers' optional
    ``n_layer`` / ``expert_type`` arguments). ConfigError (``unknown {what} ...``) for an
    unknown name, and the preset's ``validate()`` error for a field that does not fit."""
    changes = {**changes, **{k: v for k, v in fields.items() if v is not None}}
    if isinstance(preset, str):
        if preset not in presets:
            raise ConfigError(f"unknown {what} {preset!r} (known: {', '.join(presets)}).")
        preset = presets[preset]
    if changes:
        preset = dataclasses.replace(preset, **changes)
    preset.validate()
    return preset


@dataclass(frozen=True)
class ArchTensor:
    """One tensor of an architecture writer's plan (synth_deepseek2, synth_deepseek4): name,
    ggml ne (fastest first), type, std, kind, experts, constant value.

    kind: "rand" (tensor_bytes blocks of std ``std``), "norm" (F32 uniform in [0.5, 1.5]),
    "bias" (F32 uniform of std ``std``), "const" (F32 ``value``), "successor"
    (successor_q8_head), "tid2eid" (I32: ne[0] distinct expert ids of ``n_expert`` per token).
    """

    name: str
    ne: tuple[int, ...]
    qtype: str
    std: float = 0.0
    kind: str = "rand"
    n_expert: int = 0
    value: float = 0.0

    @property
    def nbytes(self) -> int:
        if self.qtype == "I32":
            return int(np.prod(self.ne)) * 4
        return tensor_nbytes(self.qtype, self.ne)

    @property
    def n_rows(self) -> int:
        return int(np.prod(self.ne[1:])) if len(self.ne) > 1 else 1


def _tid2eid(t: ArchTensor, seed: int) -> np.ndarray:
    """K distinct expert ids per token (a seeded permutation's first K), int32 {K, V} as bytes."""
    K, V = t.ne
    raw = random_bytes(seed, t.name, 4 * V * t.n_expert).view("<u4").reshape(V, t.n_expert)
    ids = np.argsort(raw, axis=1, kind="stable")[:, :K].astype("<i4")
    return ids.reshape(-1).view(np.uint8)


def arch_tensor_chunks(t: ArchTensor, seed: int, p: Any) -> Iterator[np.ndarray]:
    """The tensor's bytes (uint8), one expert slab at a time for expert tensors (bounded
    memory). ``p`` (the preset: name, embd_type, n_vocab, n_embd, embd_std) serves the
    successor head. ConfigError when a successor head's embedding is not Q8_0."""
    n = int(np.prod(t.ne))
    if t.kind == "successor":
        if p.embd_type != "Q8_0":
            raise ConfigError(f"synthetic preset {p.name}: successor_head needs embd_type Q8_0")
        yield successor_q8_head(seed, p.n_vocab, p.n_embd, p.embd_std or 4.0 / math.sqrt(p.n_embd))
        return
    if t.kind == "tid2eid":
        yield _tid2eid(t, seed)
        return
    if t.kind == "const":
        yield np.full(n, t.value, "<f4").view(np.uint8)
        return
    if t.kind in ("norm", "bias"):
        u = _uniform_pm1(random_bytes(seed, t.name, 3 * n), n)
        vals = 1.0 + 0.5 * u if t.kind == "norm" else u * (t.std * math.sqrt(3.0))
        yield vals.astype("<f4").view(np.uint8)
        return
    yield from weight_chunks(t.qtype, seed, t.name, t.n_rows, t.ne[0], t.std, t.n_expert)


def write_gguf(path: Path, arch: str, meta: dict[str, tuple[Any, str]], vocab: dict[str, Any], plans: list[Any],
               chunks: Callable[[Any], Iterator[np.ndarray]], *, sparse: bool = False,
               progress: Callable[[int, int], None] | None = None) -> None:
    """Write a GGUF atomically: ``meta`` (key -> (value, GGUFValueType name, or ``ARRAY:UINT32``
    for an integer array)), then the tokenizer keys ``vocab``, then every tensor of ``plans``
    (objects with ``name``, ``ne`` (ggml order), ``qtype``, ``nbytes``) with its data from
    ``chunks(t)`` (uint8 arrays, concatenated), each aligned to the writer's alignment.

    sparse: the header only, the file extended to its full size without data.
    progress: ``progress(bytes_written, total_bytes)`` after each chunk.
    """
    import gguf

    with gguf_written_atomically(path, arch) as writer:
        for key, (value, vtype) in meta.items():
            if vtype.startswith("ARRAY:"):
                writer.add_array(key, [int(v) for v in value])
            else:
                writer.add_key_value(key, value, gguf.GGUFValueType[vtype])
        for key, value in vocab.items():
            _add_plain_kv(writer, key, value)
        for t in plans:
            writer.add_tensor_info(t.name, tuple(reversed(t.ne)), np.dtype(np.float32), t.nbytes,
                                   raw_dtype=gguf.GGMLQuantizationType[t.qtype])
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        fout = writer.fout[0]
        align = writer.data_alignment
        fout.write(b"\0" * ((-fout.tell()) % align))
        if sparse:
            end = fout.tell() + sum(t.nbytes + (-t.nbytes) % align for t in plans)
            fout.flush()
            fout.truncate(end)
            fout.seek(end)
            return
        total = sum(t.nbytes for t in plans)
        done = 0
        for t in plans:
            written = 0
            for chunk in chunks(t):
                fout.write(chunk.tobytes())
                written += chunk.nbytes
                done += chunk.nbytes
                if progress is not None:
                    progress(done, total)
            assert written == t.nbytes, (t.name, written, t.nbytes)
            fout.write(b"\0" * ((-written) % align))


def _add_plain_kv(writer: Any, key: str, value: Any) -> None:
    """Add a tokenizer key with the GGUF type llama.cpp expects for it."""
    import gguf

    T = gguf.GGUFValueType
    if isinstance(value, bool):
        writer.add_key_value(key, value, T.BOOL)
    elif isinstance(value, int):
        writer.add_key_value(key, value, T.UINT32)
    elif isinstance(value, float):
        writer.add_key_value(key, value, T.FLOAT32)
    elif isinstance(value, str):
        writer.add_key_value(key, value, T.STRING)
    elif isinstance(value, list):
        if key.endswith("token_type"):
            sub = T.INT32
        elif key.endswith("scores"):
            sub = T.FLOAT32
        elif value and isinstance(value[0], str):
            sub = T.STRING
        else:
            raise ConfigError(f"{key}: cannot infer the GGUF array type.")
        writer.add_key_value(key, value, T.ARRAY, sub_type=sub)
    else:
        raise ConfigError(f"{key}: unsupported metadata value type {type(value).__name__}.")


def sha256_file(path: str | Path, chunk_bytes: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            h.update(block)
    return h.hexdigest()


def writer_cli(argv: list[str] | None, *, prog: str, doc: str | None, presets: dict[str, Any],
               expert_types: tuple[str, ...], write: Callable[[argparse.Namespace], Path],
               extra_args: Callable[[argparse.ArgumentParser], None] | None = None, sparse: bool = True,
               layers: bool = False) -> int:
    """The ``python -m moe_service.synth[_<arch>]`` command of every synthetic writer:
    ``--preset NAME --out PATH`` (+ ``[--layers N]`` with ``layers``, + ``extra_args``)
    ``[--expert-type T] [--tensor-types RECIPE] [--seed S] [--sparse]``, then ``write(args)``
    writes the file. Prints ``PATH sha256=HEX`` (a sparse file: its path) and returns 0; a
    preset that does not fit (ConfigError) is one line on stderr, exit 2."""
    ap = argparse.ArgumentParser(prog=prog, description=doc)
    ap.add_argument("--preset", required=True, choices=sorted(presets))
    ap.add_argument("--out", required=True, type=Path)
    if layers:
        ap.add_argument("--layers", type=int, default=None)
    if extra_args is not None:
        extra_args(ap)
    ap.add_argument("--expert-type", choices=expert_types, default=None)
    tensor_types_arg(ap)
    ap.add_argument("--seed", type=int, default=0)
    if sparse:
        ap.add_argument("--sparse", action="store_true", help="header only, zero data (for check / plan)")
    args = ap.parse_args(argv)
    try:
        path = write(args)
    except ConfigError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    print(str(path) if getattr(args, "sparse", False) else f"{path} sha256={sha256_file(path)}")
    sys.stdout.flush()
    return 0
