"""The former path of moe_service/synth/gpt_oss.py (the synthetic gpt-oss writer): it re-exports
that module's names and still runs as ``python -m moe_service.synth_gpt_oss``."""

import sys

from moe_service.synth import gpt_oss as _impl
from moe_service.synth.gpt_oss import *  # noqa: F403

globals().update({k: v for k, v in vars(_impl).items() if k.startswith("_") and not k.startswith("__")})

if __name__ == "__main__":
    sys.exit(_impl.main())
