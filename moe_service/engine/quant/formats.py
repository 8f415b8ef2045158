"""The block-format declarations' former place: they live in moe_service/formats.py (below the
engine, so the GGUF catalog, the planner and the synthetic writers read them without importing
the engine). This module re-exports them for the kernels' ``moe_service.engine.quant`` lazy
names and for code that still imports this path."""

from moe_service.formats import *  # noqa: F403
