"""The object every stage reads and fills: configuration, notifications, and what earlier
stages produced."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from moe_service.config import Settings
from moe_service.errors import Interrupted
from moe_service.log import get_logger
from moe_service.notify import Liveness, Notifier

if TYPE_CHECKING:  # the products' modules import heavy things (torch, numba) or stage modules
    import numpy as np

    from moe_service.engine.device import DevicePlan
    from moe_service.engine.engine import Engine
    from moe_service.gguf_model import GGUFModel
    from moe_service.layout import Layout
    from moe_service.numa import Topology
    from moe_service.server import Service
    from moe_service.weights import WeightStore
    from pipeline.checks import PreflightReport
    from pipeline.products import PinnedRegions, ResidencyReport

log = get_logger(__name__)


@dataclass
class PipelineContext:
    """Shared state of one run of the pipeline.

    Filled in order: ``catalog``, ``topology``, ``device`` (where the dense part runs, resolved
    once), ``layout`` and ``preflight`` by the prepare step (pipeline.spec.PREPARE_WRITES);
    ``arena`` (uint8 [arena_bytes], the mapping) and ``weights`` by fastload; ``residency`` by
    placement, extended by replication (whose copies appear in ``weights``/``layout``);
    ``pins`` by pin; ``engine`` by the engine stage; ``server`` by serve. Each stage declares
    the fields it reads and writes (pipeline.spec.Stage). ``stage_durations_s`` and
    ``skipped`` record what ran.
    """

    config: Settings
    notifier: Notifier = field(default_factory=Notifier)
    liveness: Liveness = field(default_factory=Liveness)
    shutdown: threading.Event = field(default_factory=threading.Event)
    shutdown_signal: str = "SIGTERM"
    catalog: GGUFModel | None = None
    topology: Topology | None = None
    device: DevicePlan | None = None
    layout: Layout | None = None
    preflight: PreflightReport | None = None
    arena: np.ndarray | None = None
    weights: WeightStore | None = None
    residency: ResidencyReport | None = None
    pins: PinnedRegions | None = None
    engine: Engine | None = None
    server: Service | None = None
    current_stage: str = "starting"
    status_text: str = "starting"
    stage_durations_s: dict[str, float] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    progress_marker: object = None  # what the running stage last reported (report_progress)
    progress_reports: int = 0

    def status(self, text: str) -> None:
        """Report progress: STATUS= to systemd and the text /health shows while loading."""
        self.status_text = text
        self.notifier.status(text)

    def report_progress(self, marker: object = None) -> None:
        """The running stage made progress (``marker``: bytes loaded, regions placed, a phase).
        While it keeps changing, the runner extends systemd's start timeout; past the stage's
        stall limit without a change it stops (pipeline.runner, notify.TimeoutExtender)."""
        self.progress_marker = marker
        self.progress_reports += 1

    def request_shutdown(self, signal_name: str = "SIGTERM") -> None:
        """Ask every stage to stop at its next check (called from signal handlers: sets flags only)."""
        self.shutdown_signal = signal_name
        self.shutdown.set()

    def check_shutdown(self) -> None:
        """Raise :class:`~moe_service.errors.Interrupted` when shutdown was requested.

        Long stages call it between units of work (chunks, layers)."""
        if self.shutdown.is_set():
            raise Interrupted(f"{self.shutdown_signal} during {self.current_stage}", self.shutdown_signal)
