"""The placement and replication stages through the declared runner on this host (one node):
fastload fills the arena, placement records that there is nothing to place, replication is
skipped with its reason. Multi-node runs of the same stages are in tests/numa (lab VM)."""

from __future__ import annotations

from numa_fixtures import Cfg, fake_catalog

import pipeline.fastload  # noqa: F401  (registers the stage)
import pipeline.placement  # noqa: F401
import pipeline.replication  # noqa: F401
from bench.placement import synthetic_topology
from moe_service.config import load_config
from moe_service.numa import Topology
from pipeline.context import PipelineContext
from pipeline.placement import PlacementStage, single_node_reason
from pipeline.plan import format_plan, plan, plan_summary
from pipeline.prepare import prepare
from pipeline.runner import PipelineRunner
from tests.gguf_factory import write_moe_gguf


def run_stages(tmp_path, **tables):
    path = write_moe_gguf(tmp_path / "moe.gguf", n_expert=8, n_embd=128, n_ff_exp=64)[0]
    cfg = load_config(data={"model": {"path": str(path)},
                            "pipeline": {"stages": ["fastload", "placement", "replication"]},
                            "fastload": {"threads": 2}, **tables})
    ctx = PipelineContext(cfg)
    prepare(ctx)
    runner = PipelineRunner(ctx)
    return ctx, runner


def test_one_node_host_records_nothing_to_place(tmp_path, clean_env):
    ctx, runner = run_stages(tmp_path)
    try:
        runner.run()
        topo = Topology.read()
        if topo.is_multi_node:  # a multi-node build host: the stage really places
            assert ctx.residency.ok
        else:
            assert ctx.residency.note == f"nothing to place: one NUMA node on this host (node {topo.node_ids[0]})"
            assert ctx.residency.regions == []
            assert len(ctx.layout.regions) == 1 and ctx.layout.regions[0].policy == "local"
        assert ctx.skipped["replication"].startswith("the plan has no replica regions")
        offs, nodes = ctx.weights.expert_copies(0, "gate")
        assert offs.shape == (8, 1) and (offs >= 0).all()
    finally:
        runner.close()


def test_plan_from_settings_and_summary(tmp_path, clean_env):
    ctx, runner = run_stages(tmp_path, numa={"policy": "interleave"})
    layout = plan(ctx.catalog, ctx.topology, ctx.config)  # the whole Settings is accepted
    assert layout.policy == "interleave"
    s = plan_summary(layout, ctx.topology, ctx.config)
    assert s["fits"] and s["nodes"] == list(layout.nodes) and s["policy"] == "interleave"
    assert "fits: yes" in format_plan(s)


def test_placement_skip_and_reasons(tmp_path, clean_env):
    cfg = load_config(data={"placement": {"verify": False}})
    assert PlacementStage().skip_reason(PipelineContext(cfg)) == "placement.verify = false"
    two = synthetic_topology(2)
    one = synthetic_topology(1)
    assert single_node_reason(None, one) == "one NUMA node on this host (node 0)"
    assert single_node_reason(None, two) is None
    cat_layout = plan(fake_catalog(), two, Cfg(policy="local"), Cfg())
    assert single_node_reason(cat_layout, two) == "policy 'local' binds nothing"
