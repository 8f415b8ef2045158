"""Declared stages: the Stage contract, the registry, and the rules a stage list must obey.

A stage is a small class registered under its name. The runner validates the declared list
(``[pipeline] stages``) against the registry and the rules below *before anything runs*: an
unknown or duplicated stage, a missing prerequisite or a broken ordering is a ConfigError that
names the rule and why it exists.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from moe_service.errors import ConfigError

if TYPE_CHECKING:
    from pipeline.context import PipelineContext


class Stage(abc.ABC):
    """One step of the run path.

    Class attributes: ``name`` (the name used in ``[pipeline] stages``), ``requires`` (stages
    that must appear earlier in the list whenever this one is present), ``summary`` (what it
    needs from the context and what it adds; shown by ``moe-service config validate``).

    Methods: :meth:`skip_reason` (None to run, else the logged reason: a disabled stage),
    :meth:`run` (does the work, reading and filling the :class:`~pipeline.context.PipelineContext`;
    long work checks ``ctx.check_shutdown()`` and reports with ``ctx.status()``), :meth:`close`
    (releases what ``run`` acquired; called in reverse stage order at shutdown, also after a
    failure, and only for stages whose ``run`` started).
    """

    name: ClassVar[str]
    requires: ClassVar[tuple[str, ...]] = ()
    summary: ClassVar[str] = ""
    stall_limit_s: ClassVar[float] = 600.0
    """Most seconds the stage may go without reporting progress (``ctx.report_progress``, or a
    new ``ctx.status`` text when ``progress_from_status``) before the runner stops extending
    systemd's start timeout (``pipeline.stall_limit_s`` overrides it per stage)."""
    progress_from_status: ClassVar[bool] = True
    """Whether a changed STATUS text counts as progress (False for stages whose status line
    changes without progress, e.g. a throughput figure)."""

    def skip_reason(self, ctx: PipelineContext) -> str | None:
        return None

    @abc.abstractmethod
    def run(self, ctx: PipelineContext) -> None: ...

    def close(self, ctx: PipelineContext) -> None:
        return None


STAGES: dict[str, type[Stage]] = {}


def register_stage(cls: type[Stage]) -> type[Stage]:
    """Class decorator: add a Stage subclass to the registry under ``cls.name``."""
    if not getattr(cls, "name", None):
        raise TypeError(f"{cls.__qualname__} has no stage name")
    if cls.name in STAGES and STAGES[cls.name] is not cls:
        raise TypeError(f"stage {cls.name!r} is registered twice ({STAGES[cls.name].__qualname__}, {cls.__qualname__})")
    STAGES[cls.name] = cls
    return cls


@dataclass(frozen=True)
class OrderRule:
    """When both stages are declared, ``first`` must come before ``then``."""

    first: str
    then: str
    reason: str


ORDER_RULES: tuple[OrderRule, ...] = (
    OrderRule("fastload", "placement", "placement verifies and repairs the memory that fastload filled"),
    OrderRule(
        "placement",
        "replication",
        "replicas are copied from the primaries, so the primaries must be verified in place first",
    ),
    OrderRule(
        "placement",
        "pin",
        "pinned pages cannot be migrated, so placement would be silently lost",
    ),
    OrderRule(
        "replication",
        "pin",
        "replica regions must exist before they can be pinned; pinning first leaves every replica "
        "pageable and pinning after would need a second pass",
    ),
    OrderRule("fastload", "warmup", "warmup runs the model, which must be loaded"),
    OrderRule(
        "warmup",
        "serve",
        "the first requests would pay kernel compilation and cold expert pages while systemd "
        "already reports the service ready",
    ),
)


def validate_stages(stages: list[str], registry: dict[str, type[Stage]] | None = None) -> list[str]:
    """Check a declared stage list. Returns the problems, one sentence each (empty when valid).

    Rules: every name is a registered stage; no duplicates; each stage's ``requires`` appear
    earlier; every :data:`ORDER_RULES` pair that is present is in order.
    """
    registry = STAGES if registry is None else registry
    problems: list[str] = []
    known = ", ".join(sorted(registry)) or "none"
    seen: dict[str, int] = {}
    for i, name in enumerate(stages):
        if name not in registry:
            problems.append(f"pipeline.stages: unknown stage {name!r} (known stages: {known})")
        if name in seen:
            problems.append(f"pipeline.stages: stage {name!r} is declared twice (positions {seen[name] + 1} and {i + 1})")
        else:
            seen[name] = i
    for name in seen:
        cls = registry.get(name)
        for req in cls.requires if cls else ():
            if req not in seen:
                problems.append(f"pipeline.stages: stage {name!r} requires {req!r}, which is not declared")
    for rule in ORDER_RULES:
        if rule.first in seen and rule.then in seen and seen[rule.first] > seen[rule.then]:
            problems.append(f"pipeline.stages: {rule.then} must come after {rule.first}: {rule.reason}")
    return problems


def check_stages(stages: list[str], registry: dict[str, type[Stage]] | None = None) -> None:
    """:func:`validate_stages`, raising ConfigError with every problem."""
    problems = validate_stages(stages, registry)
    if problems:
        raise ConfigError(f"invalid pipeline ({len(problems)} problem(s))", problems)
