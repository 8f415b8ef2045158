"""The former path of moe_service/synth/deepseek4.py (the synthetic DeepSeek V4 writer): it re-exports
that module's names and still runs as ``python -m moe_service.synth_deepseek4``."""

import sys

from moe_service.synth import deepseek4 as _impl
from moe_service.synth.deepseek4 import *  # noqa: F403

globals().update({k: v for k, v in vars(_impl).items() if k.startswith("_") and not k.startswith("__")})

if __name__ == "__main__":
    sys.exit(_impl.main())
