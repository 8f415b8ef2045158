"""Importing this module registers every stage that exists (see pipeline.spec.STAGES)."""

import pipeline.engine  # noqa: F401
import pipeline.fastload  # noqa: F401
import pipeline.pin  # noqa: F401
import pipeline.placement  # noqa: F401
import pipeline.replication  # noqa: F401
import pipeline.serve  # noqa: F401
import pipeline.warmup  # noqa: F401
