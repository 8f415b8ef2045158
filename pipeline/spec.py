"""Declared stages: the Stage contract, the registry, and the rules a stage list must obey.

A stage is a small class registered under its name. It declares the
:class:`~pipeline.context.PipelineContext` fields it ``reads`` (must be filled before it runs),
``reads_if_present`` (used when an earlier stage filled them) and ``writes``. The runner
validates the declared list (``[pipeline] stages``) against the registry, those declarations
and the rules below *before anything runs*: an unknown or duplicated stage, a missing
prerequisite, a field read before any stage (or the prepare step, :data:`PREPARE_WRITES`)
writes it, or a broken ordering is a ConfigError that names the rule and why it exists.
"""

from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from moe_service.errors import ConfigError
from pipeline.context import PipelineContext

if TYPE_CHECKING:
    from moe_service.config import Settings
    from moe_service.layout import Layout
    from pipeline.checks import Check

PREPARE_WRITES: tuple[str, ...] = ("catalog", "topology", "device", "layout", "preflight")
"""The context fields the prepare step (pipeline.prepare.prepare) fills before the first stage."""

CONTEXT_FIELDS: frozenset[str] = frozenset(f.name for f in dataclasses.fields(PipelineContext))


class Stage(abc.ABC):
    """One step of the run path.

    Class attributes: ``name`` (the name used in ``[pipeline] stages``), ``requires`` (stages
    that must appear earlier in the list whenever this one is present, for a reason other than
    data), ``reads`` / ``reads_if_present`` / ``writes`` (context fields, see the module doc;
    the runner checks ``reads`` are filled before :meth:`run`), ``summary`` (what it does,
    one line; what it reads and writes is in the declarations, not restated here).

    Methods: :meth:`skip_reason` (None to run, else the logged reason: a disabled stage),
    :meth:`run` (does the work, reading and filling the :class:`~pipeline.context.PipelineContext`;
    long work checks ``ctx.check_shutdown()`` and reports with ``ctx.status()``), :meth:`close`
    (releases what ``run`` acquired; called in reverse stage order at shutdown, also after a
    failure, and only for stages whose ``run`` started), :meth:`preflight_checks` (what the
    stage will need from the host, checked by the prepare step when the stage is declared).
    """

    name: ClassVar[str]
    requires: ClassVar[tuple[str, ...]] = ()
    reads: ClassVar[tuple[str, ...]] = ()
    reads_if_present: ClassVar[tuple[str, ...]] = ()
    writes: ClassVar[tuple[str, ...]] = ()
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

    @classmethod
    def preflight_checks(cls, config: Settings, layout: Layout) -> list[Check]:
        """Preflight checks of this stage for ``layout`` on this host (pipeline.preflight runs
        them for every declared stage); none by default."""
        return []


STAGES: dict[str, type[Stage]] = {}


def register_stage(cls: type[Stage]) -> type[Stage]:
    """Class decorator: add a Stage subclass to the registry under ``cls.name``."""
    if not getattr(cls, "name", None):
        raise TypeError(f"{cls.__qualname__} has no stage name")
    unknown = [f for f in (*cls.reads, *cls.reads_if_present, *cls.writes) if f not in CONTEXT_FIELDS]
    if unknown:
        raise TypeError(f"stage {cls.name!r} declares {unknown}, which are not PipelineContext fields")
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
    OrderRule("fastload", "engine", "the engine is built over the loaded weights"),
    OrderRule(
        "pin",
        "engine",
        "the engine's GPU expert offload reads the pinned regions it is given when it is built; "
        "pinning afterwards leaves it streaming pageable memory",
    ),
    OrderRule("engine", "warmup", "warmup runs the engine, which the engine stage builds"),
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
    earlier; every field a stage ``reads`` is written by the prepare step or an earlier
    declared stage, and every field it ``reads_if_present`` that a declared stage writes is
    written earlier (:func:`data_flow_problems`); every :data:`ORDER_RULES` pair that is
    present is in order.
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
    problems += data_flow_problems([n for n in seen if n in registry], registry)
    for rule in ORDER_RULES:
        if rule.first in seen and rule.then in seen and seen[rule.first] > seen[rule.then]:
            problems.append(f"pipeline.stages: {rule.then} must come after {rule.first}: {rule.reason}")
    return problems


def data_flow_problems(stages: list[str], registry: dict[str, type[Stage]]) -> list[str]:
    """The declared ``reads`` / ``reads_if_present`` / ``writes`` of ``stages`` (registered,
    distinct names, in run order) checked in order: one sentence per field read before anything
    writes it, naming the reader and the stage that writes the field (declared later, or
    registered but not declared)."""
    problems: list[str] = []
    written: dict[str, str] = dict.fromkeys(PREPARE_WRITES, "prepare")
    later: dict[str, str] = {}  # field -> first declared stage that writes it
    for name in stages:
        for f in registry[name].writes:
            later.setdefault(f, name)
    for name in stages:
        cls = registry[name]
        for f in cls.reads:
            if f in written:
                continue
            if f in later:
                problems.append(f"pipeline.stages: stage {name!r} reads ctx.{f}, which stage {later[f]!r} writes "
                                f"after it: declare {later[f]!r} before {name!r}")
                continue
            writers = sorted(n for n, c in registry.items() if f in c.writes)
            fix = (f"add {' or '.join(repr(w) for w in writers)} before {name!r}" if writers
                   else "no registered stage writes it")
            problems.append(f"pipeline.stages: stage {name!r} reads ctx.{f}, which neither the prepare step nor "
                            f"an earlier declared stage writes: {fix}")
        for f in cls.reads_if_present:
            if f not in written and f in later and later[f] != name:
                problems.append(f"pipeline.stages: stage {name!r} reads ctx.{f} when present, which stage "
                                f"{later[f]!r} writes after it: declare {later[f]!r} before {name!r}")
        for f in cls.writes:
            written.setdefault(f, name)
    return problems


def check_stages(stages: list[str], registry: dict[str, type[Stage]] | None = None) -> None:
    """:func:`validate_stages`, raising ConfigError with every problem."""
    problems = validate_stages(stages, registry)
    if problems:
        raise ConfigError(f"invalid pipeline ({len(problems)} problem(s))", problems)
