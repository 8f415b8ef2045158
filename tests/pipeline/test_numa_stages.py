"""The placement and replication stages through the declared runner on this host (one node):
fastload fills the arena, placement records that there is nothing to place, replication is
skipped with its reason. The prepare step on fake multi-node hosts: the GPU's node for the
dense tensors, no replicas planned when no stage fills them. Multi-node runs of the same stages
are in tests/numa (lab VM)."""

from __future__ import annotations

import pipeline.fastload  # noqa: F401  (registers the stage)
import pipeline.placement  # noqa: F401
import pipeline.replication  # noqa: F401
from bench.placement import synthetic_topology
from moe_service.config import load_config
from moe_service.numa import Topology
from pipeline.context import PipelineContext
from pipeline.placement import PlacementStage, single_node_reason
from pipeline.plan import format_plan, plan, plan_summary
from pipeline.prepare import plan_layout, prepare
from pipeline.runner import PipelineRunner
from tests.support.gguf_factory import write_moe_gguf
from tests.support.numa_fixtures import cfg, fake_catalog, write_sysfs


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
    settings = load_config(data={"placement": {"verify": False}})
    assert PlacementStage().skip_reason(PipelineContext(settings)) == "placement.verify = false"
    two = synthetic_topology(2)
    one = synthetic_topology(1)
    assert single_node_reason(None, one) == "one NUMA node on this host (node 0)"
    assert single_node_reason(None, two) is None
    cat_layout = plan(fake_catalog(), two, cfg("local"))
    assert single_node_reason(cat_layout, two) == "policy 'local' binds nothing"


def prepared(tmp_path, gpus=None, **tables):
    """prepare() on a fake two-node host (8 GiB and two CPUs per node, ``gpus``: [(pci, node)])."""
    root = write_sysfs(tmp_path / "host", [[0, 1], [2, 3]], [8.0, 8.0], gpus=gpus)
    path = write_moe_gguf(tmp_path / "moe.gguf", n_expert=8, n_embd=128, n_ff_exp=64)[0]
    data = {"model": {"path": str(path)}, **tables, "numa": {**tables.get("numa", {}), "sysfs_root": str(root)}}
    ctx = PipelineContext(load_config(data=data))
    prepare(ctx)
    return ctx


def test_dense_tensors_bound_to_the_gpus_node(tmp_path, clean_env, monkeypatch):
    import torch

    from moe_service.engine import device as device_mod

    gpus = [("0000:17:00.0", 1), ("0000:65:00.0", 0)]
    ctx = prepared(tmp_path / "cpu", gpus=gpus)  # this host has no CUDA: the dense part runs on the CPU
    dense = next(r for r in ctx.layout.regions if r.name == "dense")
    assert dense.policy == "interleave" and dense.nodes == (0, 1)
    assert ctx.device.device == "cpu" and ctx.device.gpu_node is None
    # the engine resolves to a GPU: the first NVIDIA GPU's node gets the dense region
    monkeypatch.setattr(device_mod, "cuda_absent_reason", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    ctx = prepared(tmp_path / "gpu", gpus=gpus)
    assert ctx.device == device_mod.DevicePlan("cuda:0", "torch", "auto", 1)  # resolved once, in prepare
    dense = next(r for r in ctx.layout.regions if r.name == "dense")
    assert dense.policy == "bind" and dense.nodes == (1,)
    assert ctx.preflight.ok
    topo = Topology.read(write_sysfs(tmp_path / "nonode", [[0], [1]], [4.0, 4.0], gpus=[("0000:17:00.0", -1)]))
    assert device_mod.resolve_device("auto", topo.gpus).gpu_node is None  # firmware gave the GPU no node
    assert device_mod.resolve_device("auto", synthetic_topology(2).gpus).gpu_node is None  # no GPU in sysfs
    # a GPU on a node the config leaves out: interleave over the chosen nodes, not a refusal
    layout = plan_layout(fake_catalog(), topo, load_config(data={"numa": {"nodes": [0]}}), gpu_node=1)
    assert layout.nodes == (0,)


def test_no_replicas_planned_without_the_replication_stage(tmp_path, clean_env):
    kept = prepared(tmp_path / "kept", replication={"replicas": 1},
                    pipeline={"stages": ["fastload", "placement", "replication"]})
    assert {r.name for r in kept.layout.replica_regions()} == {"replicas.node0", "replicas.node1"}
    assert (kept.layout.experts[(0, "up")].offsets[:, 1] >= 0).all()
    ctx = prepared(tmp_path / "dropped", replication={"replicas": 1}, pipeline={"stages": ["fastload", "placement"]})
    layout = ctx.layout
    assert layout.replica_regions() == [] and layout.replicas == 0
    for p in layout.experts.values():
        assert (p.offsets[:, 0] >= 0).all() and (p.offsets[:, 1:] == -1).all() and (p.nodes[:, 1:] == -1).all()
    assert layout.arena_bytes == max(r.arena_offset + r.nbytes for r in layout.primary_regions())
    assert layout.arena_bytes < kept.layout.arena_bytes
    assert "replication.replicas = 1: no replica regions planned, the declared stages lack replication, " \
        "which fills them" in layout.warnings
    assert any(c.name == "plan" and "no replica regions planned" in c.message for c in ctx.preflight.warnings)
    mirror = prepared(tmp_path / "mirror", numa={"policy": "mirror"}, pipeline={"stages": ["fastload", "placement"]})
    assert [(r.name, r.role) for r in mirror.layout.regions] == [("mirror.node0", "primary")]
    assert mirror.layout.replicas == 0 and mirror.layout.nodes == (0, 1)
    assert any("mirror keeps one copy of the model, on node 0" in w for w in mirror.layout.warnings)
