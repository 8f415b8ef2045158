"""The synthetic MoE models the lab tests load (random bytes: only sizes and offsets matter).

``big``: 2 MoE layers x 32 experts, hidden 2048, expert width 1536, Q8_0: each expert tensor
is 102 MiB (slabs of 3.19 MiB), 612 MiB of experts in all. Big enough that 2 MiB transparent
huge pages interleaved over 4 nodes give each node its share of every expert tensor within
+-10% (a node's share can be off by at most one 2 MiB page: 2 / 25.5 MiB = 8%).
``small``: 2 MoE layers x 32 experts, hidden 256, expert width 256: 2.1 MiB per expert tensor.

Written on the host before the VM boots (the VM sees the host's files; writing 600 MiB
inside the emulated VM would take minutes and live in its RAM):
``python -m tests.numa.models`` or :func:`ensure_models`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

MODELS = {
    "big": {"n_layer": 2, "n_embd": 2048, "n_expert": 32, "n_expert_used": 6, "n_ff_exp": 1536},
    "small": {"n_layer": 2, "n_embd": 256, "n_expert": 32, "n_expert_used": 6, "n_ff_exp": 256},
}


def models_dir() -> Path:
    """$LAB_MODELS_DIR, else $XDG_CACHE_HOME (or /var/tmp)/moe-service-lab/models."""
    if os.environ.get("LAB_MODELS_DIR"):
        return Path(os.environ["LAB_MODELS_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or "/var/tmp") / "moe-service-lab" / "models"


def model_path(name: str) -> Path:
    p = MODELS[name]
    tag = "-".join(f"{k}{v}" for k, v in p.items()).replace("n_", "")
    return models_dir() / f"lab-{name}-{tag}-kv2.gguf"  # kv2: attn_k/v of 2 KV heads (the arch check's shapes)


def ensure_models(names: tuple[str, ...] = tuple(MODELS)) -> dict[str, Path]:
    """Write the models that are missing (with the load engineer's GGUFWriter factory);
    return name -> path."""
    from tests.support.gguf_factory import write_moe_gguf

    out = {}
    for name in names:
        path = model_path(name)
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp.gguf")
            write_moe_gguf(tmp, seed=1, **MODELS[name])
            tmp.replace(path)
        out[name] = path
    return out


if __name__ == "__main__":
    for name, path in ensure_models().items():
        print(f"{name}: {path} ({path.stat().st_size / 2**20:.0f} MiB)")
    sys.exit(0)
