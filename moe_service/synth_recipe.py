"""The former path of moe_service/synth/recipe.py (per-tensor type recipes): it re-exports
that module's names."""

from moe_service.synth import recipe as _impl
from moe_service.synth.recipe import *  # noqa: F403

globals().update({k: v for k, v in vars(_impl).items() if k.startswith("_") and not k.startswith("__")})
