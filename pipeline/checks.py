"""What a preflight check is: :class:`Check` (one verdict with its numbers) and
:class:`PreflightReport` (all of them), shared by :mod:`pipeline.preflight`, which runs the
host and model checks, and the stages whose own checks it lists (``Stage.preflight_checks``,
e.g. :mod:`pipeline.pin`). A module of its own so that neither imports the other.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

from moe_service.errors import CapacityError, PreflightError

Status = Literal["ok", "warn", "fail"]


@dataclass
class Check:
    """One preflight check: ``name`` (``memory.node1``), ``status``, a one-sentence ``message``
    and the numbers behind it (``needed_bytes``, ``available_bytes``, ...)."""

    name: str
    status: Status
    message: str
    numbers: dict = field(default_factory=dict)
    capacity: bool = False  # a memory shortfall: raises CapacityError rather than PreflightError


@dataclass
class PreflightReport:
    """Every check of one preflight run, in the order they ran."""

    checks: list[Check] = field(default_factory=list)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if c.status == "fail"]

    @property
    def warnings(self) -> list[Check]:
        return [c for c in self.checks if c.status == "warn"]

    @property
    def ok(self) -> bool:
        return not self.failures

    def to_dict(self) -> dict:
        return {"ok": self.ok, "checks": [{k: v for k, v in asdict(c).items() if k != "capacity"}
                                          for c in self.checks]}

    def raise_for_failures(self) -> None:
        """Raise CapacityError when a memory check failed, else PreflightError, else nothing."""
        fails = self.failures
        if not fails:
            return
        msg = "preflight refused the start: " + "; ".join(c.message for c in fails)
        if any(c.capacity for c in fails):
            raise CapacityError(msg)
        raise PreflightError(msg)


def format_report(report: PreflightReport, numbers: bool = False) -> str:
    """Human table for ``moe-service check``: one line per check (``numbers``: then its
    numbers, ``key=value``), and a last line with the verdict."""
    lines = []
    for c in report.checks:
        lines.append(f"{c.status.upper():<5} {c.name:<18} {c.message}")
        if numbers and c.numbers:
            lines.append(" " * 25 + "  ".join(f"{k}={v}" for k, v in c.numbers.items()))
    lines.append("preflight: " + ("passed" if report.ok else f"{len(report.failures)} check(s) failed"))
    return "\n".join(lines)
