"""Importing this module registers every stage that exists (see pipeline.spec.STAGES)."""

import pipeline.pin  # noqa: F401
