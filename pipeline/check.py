"""``moe-service check``: everything a start would refuse, found without allocating anything.

::

    model       the catalog's verdict on the GGUF files (moe_service.gguf_model.verdict):
                architecture, layers, experts/top-k, tensors, bytes, type histogram, problems;
                then the architecture's own check (moe_service.engine.arch.check_model):
                supported, every hyperparameter consistent, every tensor present with the
                shape the header gives and a type the engine reads
                -> a bad file stops here                                           exit 3
    plan        topology + the plan the service would load (pipeline.prepare.plan_layout,
                not strict): policy, bytes and experts per node, what does not fit
    preflight   every check of pipeline.preflight (raise_on_fail=False) with its numbers
                -> a failing check                                                 exit 4
    verdict     "check: ready to start" (exit 0, warnings allowed) or "check: N problem(s)"
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_service.config import Settings
from moe_service.engine.device import DevicePlan, resolve_device
from moe_service.errors import ModelFileError, PreflightError
from moe_service.gguf_model import CatalogReport, GGUFModel, verdict
from moe_service.numa import Topology
from pipeline.checks import PreflightReport, format_report
from pipeline.plan import format_plan, plan_summary
from pipeline.preflight import run_preflight
from pipeline.prepare import plan_layout

EXIT_MODEL_FILE = 3
EXIT_PREFLIGHT = 4


@dataclass
class CheckResult:
    """What ``moe-service check`` found: the catalog's report, then (when the model files are
    valid) the plan summary (pipeline.plan.plan_summary) and the preflight report."""

    catalog: CatalogReport
    plan: dict | None = None
    preflight: PreflightReport | None = None

    @property
    def problems(self) -> int:
        """Problems in the model files, else failed preflight checks."""
        if not self.catalog.ok:
            return len(self.catalog.problems)
        return len(self.preflight.failures) if self.preflight is not None else 0

    @property
    def exit_code(self) -> int:
        """0 ready (warnings allowed), 3 the model files are bad, 4 preflight refuses."""
        if not self.catalog.ok:
            return EXIT_MODEL_FILE
        return EXIT_PREFLIGHT if self.problems else 0

    def verdict_line(self) -> str:
        return "check: ready to start" if self.exit_code == 0 else f"check: {self.problems} problem(s)"

    def to_dict(self) -> dict:
        return {
            "ready": self.exit_code == 0,
            "exit_code": self.exit_code,
            "problems": self.problems,
            "model": {"path": str(self.catalog.path), "summary": list(self.catalog.summary),
                      "problems": [{"kind": p.kind, "message": p.message, "tensor": p.tensor,
                                    "path": str(p.path) if p.path else None} for p in self.catalog.problems]},
            "plan": self.plan,
            "preflight": self.preflight.to_dict() if self.preflight is not None else None,
        }


def run_check(config: Settings) -> CheckResult:
    """Catalog, topology, plan and preflight for ``config``, allocating nothing (module doc).

    Never raises for a bad model file or a host that cannot hold the plan: those are the
    result. Raises ConfigError for a plan the host's nodes cannot take (numa.nodes,
    replication.replicas).
    """
    path = config.model_path()
    try:
        model = GGUFModel.open(path, strict=False)
    except ModelFileError:
        return CheckResult(verdict(path))
    report = verdict(model)
    from moe_service.engine.arch import ARCHITECTURES, CHECK_ONLY, check_model

    runnable = model.params.arch in ARCHITECTURES
    if not runnable and model.params.arch not in CHECK_ONLY:  # named (with the supported list) whatever else is wrong
        report.problems.extend(check_model(model))
    if not report.ok:
        return CheckResult(report)
    arch_problems = check_model(model, runnable=False)
    if arch_problems:
        report.problems.extend(arch_problems)
        return CheckResult(report)
    report.summary.append(f"architecture check: {model.params.arch} "
                          f"{'supported' if runnable else 'declared (not run by this engine yet)'}, "
                          f"hyperparameters and {len(model.tensors)} tensors agree")
    topology = Topology.read(root=config.numa.sysfs_root)
    device: DevicePlan | PreflightError
    try:
        device = resolve_device(config.engine.device, topology.gpus)
    except PreflightError as e:  # engine.device = cuda without a GPU: preflight's engine.device check says so
        device = e
    layout = plan_layout(model, topology, config, device.gpu_node if isinstance(device, DevicePlan) else None)
    summary = plan_summary(layout, topology, config)
    pre = run_preflight(model, topology, layout, config, device=device, raise_on_fail=False)
    return CheckResult(report, summary, pre)


def format_check(result: CheckResult) -> str:
    """The human report: model, plan and preflight sections, then the verdict line."""
    lines = ["model:"] + [f"  {line}" for line in result.catalog.lines()]
    if result.plan is not None:
        lines += ["", "plan:"] + [f"  {line}" for line in format_plan(result.plan, regions=False).splitlines()]
    if result.preflight is not None:
        lines += ["", "preflight:"] + [f"  {line}" for line in format_report(result.preflight, numbers=True).splitlines()]
    lines += ["", result.verdict_line()]
    return "\n".join(line.rstrip() for line in lines)
