"""The inference engine: block kernels (quant), worker pool (pool), fused MoE (moe), the forward
pass (model), tokenizer, sampler, batching.

Importing this package points numba's on-disk kernel cache at a folder keyed by the kernel
sources. numba invalidates a cached function only when *its own* file changes, yet the pool's
and the MoE step's compiled code inline the block kernels of quant/: after an upgrade that
changes only quant/ they would keep running the old kernels. A folder per source hash makes
every change a fresh cache, and a restart with unchanged sources reuses it (no recompile).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from moe_service.numa import l2_cache_bytes

# Files whose kernels other files' cached kernels inline (cpu_layers: its float16 intrinsics, in
# attention/; attention/*.py: the package's modules inline each other's kernels).
_KERNEL_SOURCES = ("quant/*.py", "pool.py", "moe.py", "cpu_layers.py", "attention/*.py")


def kernel_cache_key() -> str:
    """16 hex digits over the kernel sources, the numba version, the forced ISA and the L2 size."""
    import numba

    h = hashlib.sha256()
    here = Path(__file__).resolve().parent
    for pattern in _KERNEL_SOURCES:
        for path in sorted(here.glob(pattern)):
            h.update(path.relative_to(here).as_posix().encode())
            h.update(path.read_bytes())
    h.update(numba.__version__.encode())
    h.update(os.environ.get("MOE_SERVICE_KERNEL_ISA", "").encode())
    h.update(str(l2_cache_bytes()).encode())  # quant/tiles_iq_blocked's block sizes
    return h.hexdigest()[:16]


def kernel_cache_dir() -> Path:
    """Where compiled kernels are cached: ``$NUMBA_CACHE_DIR`` (else the service cache dir's
    ``numba/``), then one folder per :func:`kernel_cache_key`."""
    from moe_service.paths import cache_dir

    base = Path(os.environ["NUMBA_CACHE_DIR"]) if os.environ.get("NUMBA_CACHE_DIR") else cache_dir() / "numba"
    return base / kernel_cache_key()


def _configure_numba_cache() -> None:
    from numba.core import config as numba_config

    numba_config.CACHE_DIR = str(kernel_cache_dir())


_configure_numba_cache()
