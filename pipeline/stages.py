"""Importing this module registers every stage that exists (see pipeline.spec.STAGES)."""

from pipeline import serve, warmup  # noqa: F401,E402
