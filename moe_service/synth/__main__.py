"""``python -m moe_service.synth --preset NAME --out PATH ...``: the llama-family writer's
command (moe_service/synth/llama.py; the other architectures: ``python -m
moe_service.synth.deepseek2`` / ``.deepseek4`` / ``.gpt_oss``)."""

import sys

from moe_service.synth.llama import main

sys.exit(main())
