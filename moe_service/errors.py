"""The project's error types and the process exit code each maps to.

Every error an operator can cause (bad config, broken model file, a host that cannot hold
the plan) is one of these, with a message that is one clear sentence naming the file, key,
tensor, node or request field involved; the CLI prints it without a traceback and exits
with the class's ``exit_code``.

Exit codes (also documented in README.md):

====  ===========================================================
0     success
1     unexpected internal error (a bug: the traceback is logged)
2     config or command-line error (ConfigError)
3     model file error (ModelFileError: missing shard, truncated file, bad type)
4     preflight refused the start (PreflightError, CapacityError)
5     a pipeline stage failed (StageError and subclasses)
130   interrupted by SIGINT before the service was ready
====  ===========================================================
"""

from __future__ import annotations


class MoeServiceError(Exception):
    """Base class: ``str(err)`` is the operator-facing sentence."""

    exit_code = 1


class ConfigError(MoeServiceError):
    """The TOML file, an environment override or a command-line option is invalid.

    ``errors`` holds one line per problem, e.g.
    ``configs/x.toml: fastload.threads: must be >= 1 (got 0)``.
    """

    exit_code = 2

    def __init__(self, message: str, errors: list[str] | None = None):
        super().__init__(message)
        self.errors = list(errors or [message])


class ModelFileError(MoeServiceError):
    """A GGUF file or split set is unusable (missing shard, truncated, unknown type, ...)."""

    exit_code = 3
    problems: list  # every problem found, where the raiser collected several (set on the instance)


class PreflightError(MoeServiceError):
    """The host cannot run the planned start (memory, limits, CPU features)."""

    exit_code = 4


class CapacityError(PreflightError):
    """Memory is not there: a plan does not fit a node, or populate hit ENOMEM/EFAULT."""


class StageError(MoeServiceError):
    """A pipeline stage failed while running. ``errno``: the OS error behind it, when there is
    one (the runner sends it to systemd as ERRNO=)."""

    exit_code = 5
    errno: int | None = None


class NumaError(StageError):
    """A NUMA syscall (mbind, set_mempolicy, get_mempolicy, move_pages) failed."""


class PinError(StageError):
    """cudaHostRegister failed or the pin mode cannot be honoured. A failed call sets ``chunk``
    (the pipeline.pin.PinChunk), ``flags`` and ``cuda_error`` (the cudaError_t number)."""

    chunk: object = None
    flags: int | None = None
    cuda_error: int | None = None


class Interrupted(MoeServiceError):
    """A shutdown signal arrived before the pipeline finished starting.

    Not a failure: SIGTERM (systemctl stop during a load) exits 0, SIGINT (Ctrl-C) exits 130.
    """

    def __init__(self, message: str = "interrupted", signal_name: str = "SIGTERM"):
        super().__init__(message)
        self.signal_name = signal_name
        self.exit_code = 130 if signal_name == "SIGINT" else 0
