"""Run mutated model files through the engine, in a process of its own (a kernel reading
outside its buffer would take the test process down with it).

    python -m tests.support.arch_mutation_runner CASES.json

CASES.json: a list of {"path", "offset", "dtype", "value", "old", "what"}: for each case
the file's metadata value at ``offset`` is set to ``value`` (in place, then back to ``old``), the model is built through
moe_service.engine.model.Model (which runs the architecture's check first) and the
tokenizer from its metadata; then a 6-token prompt and 2 decode steps run. One JSON line per
case on stdout: {"case": i, "outcome": "refused" | "ran", "message", "finite", "logits_sha"}.
A line ``start i`` is printed (flushed) before each case, so a crash names the case.
"""

from __future__ import annotations

import hashlib
import json
import sys

import numpy as np


def scalar_fields(path: str) -> dict[str, tuple[int, str, object]]:
    """key -> (byte offset of the value in the file, numpy dtype, value) of every scalar
    numeric metadata value (one gguf.GGUFReader pass; patching then needs no reader)."""
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(path)
    base = reader.data.__array_interface__["data"][0]
    out = {}
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or len(f.types) != 1:
            continue
        if f.types[0] in (GGUFValueType.STRING, GGUFValueType.ARRAY, GGUFValueType.BOOL):
            continue
        part = f.parts[f.data[0]]
        out[key] = (part.__array_interface__["data"][0] - base, part.dtype.str, part[0].item())
    del reader
    return out


def patch(path: str, offset: int, dtype: str, value) -> None:
    """Write ``value`` as ``dtype`` at ``offset`` of ``path`` (a metadata value in place)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(np.array([value], dtype=dtype).tobytes())


def set_metadata(path: str, key: str, value) -> object:
    """Set a scalar metadata value of ``path`` in place; returns the previous value."""
    offset, dtype, old = scalar_fields(path)[key]
    patch(path, offset, dtype, value)
    return old


def run_case(path: str, ops) -> dict:
    from moe_service.engine.model import Model
    from moe_service.engine.tokenizer import Tokenizer
    from moe_service.errors import MoeServiceError
    from moe_service.gguf_model import GGUFModel
    from moe_service.weights import WeightStore

    try:
        cat = GGUFModel.open(path)
        tok = Tokenizer.from_gguf(cat.metadata, source=path)
        model = Model(cat, WeightStore.load_simple(cat), ops, n_seq=1, n_ctx=32)
    except MoeServiceError as e:
        return {"outcome": "refused", "message": str(e), "exit_code": e.exit_code}
    ids = tok.encode("Hello there, general")[:6] or [1]
    s = model.kv.alloc()
    out = [model.step([(s, ids)])[0].numpy()]
    for _ in range(2):
        out.append(model.step([(s, [int(np.argmax(out[-1]))])])[0].numpy())
    logits = np.stack(out)
    del model
    return {"outcome": "ran", "finite": bool(np.isfinite(logits).all()),
            "logits_sha": hashlib.sha256(logits.tobytes()).hexdigest()[:16]}


def main(argv: list[str]) -> int:
    import torch

    from moe_service.engine.ops import CpuOps

    torch.set_num_threads(1)
    cases = json.loads(open(argv[0]).read())
    ops = CpuOps(threads=1)
    try:
        for i, c in enumerate(cases):
            print(f"start {i}", flush=True)
            if c.get("offset") is not None:
                patch(c["path"], c["offset"], c["dtype"], c["value"])
            try:
                r = run_case(c["path"], ops)
            finally:
                if c.get("offset") is not None:
                    patch(c["path"], c["offset"], c["dtype"], c["old"])
            print(json.dumps({"case": i, **r}), flush=True)
    finally:
        ops.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
