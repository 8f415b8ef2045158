"""Where moe-service keeps files it builds itself (the demo model, kernel caches).

Resolution order for :func:`cache_dir`, first match wins:

==================================  =====================================================
``$CACHE_DIRECTORY``                set by systemd from ``CacheDirectory=moe-service``
                                    (the first path when systemd lists several, ``:``-separated)
``$XDG_CACHE_HOME/moe-service``     the XDG base-directory rule for a user session
``~/.cache/moe-service``            the XDG default when ``XDG_CACHE_HOME`` is unset or empty
==================================  =====================================================

Nothing here creates directories: callers that write make the parents they need.
"""

from __future__ import annotations

import os
from pathlib import Path

APP_NAME = "moe-service"
DEMO_MODEL_FILENAME = "smollm2-135m-instruct-moe8.gguf"


def cache_dir() -> Path:
    """The service's cache directory (an absolute path; not created here)."""
    systemd_dirs = os.environ.get("CACHE_DIRECTORY", "")
    if systemd_dirs:
        # systemd joins several CacheDirectory= entries with ':'; ours is the first.
        return Path(systemd_dirs.split(":")[0]).expanduser().absolute()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if xdg:
        return (Path(xdg).expanduser() / APP_NAME).absolute()
    return (Path.home() / ".cache" / APP_NAME).absolute()


def models_dir() -> Path:
    """``cache_dir()/models``: models the service builds (the demo MoE model)."""
    return cache_dir() / "models"


def demo_model_path() -> Path:
    """Default location of the embedded demo model, ``cache_dir()/models/smollm2-135m-instruct-moe8.gguf``."""
    return models_dir() / DEMO_MODEL_FILENAME


def fsync_dir(path: Path) -> None:
    """fsync a directory so a rename into it survives a crash (best effort: some filesystems refuse)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
