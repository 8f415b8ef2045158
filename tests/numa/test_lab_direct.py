"""fastload.io = direct on a real multi-node kernel (the lab VM): every page still on its
planned node.

Direct reads land in pages the pipelined load populated under each region's policy (bound
before first touch), so placement must find 100% of the sampled pages of every expert slab
on its planned node, as with buffered reads. The lab VM reads the models over 9p under an
overlay: where that refuses O_DIRECT the load falls back to buffered reads (logged once) and
must give the same result; the test prints which path ran.
"""

from __future__ import annotations

import numpy as np
from structlog.testing import capture_logs

from moe_service import fileio, memory, numa
from moe_service.gguf_model import GGUFModel
from pipeline.fastload import fastload
from pipeline.placement import format_residency, place
from pipeline.plan import plan
from tests.numa.lab_helpers import file_bytes, lab_config, slab_residency


def test_direct_io_puts_every_slab_on_its_node(topology, models):
    cat = GGUFModel.open(models["big"])
    layout = plan(cat, topology, lab_config("expert_shard"))
    with capture_logs() as logs:
        arena, _weights, stats = fastload(cat, layout, threads=4, io="direct", direct_threads=4)
    try:
        falls = [e for e in logs if e["event"] == "fastload_direct_fallback"]
        print(f"\ndirect I/O on {cat.shards[0].path.parent}: "
              f"{'supported' if fileio.direct_supported(cat.shards[0].path) else 'refused'}; "
              f"{stats.direct_bytes / 2**20:.0f} MiB read with O_DIRECT, fallback: {stats.direct_fallback}")
        assert stats.io == "direct" and stats.pipelined and len(falls) <= 1
        assert stats.direct_bytes + (0 if stats.direct_fallback is None else cat.total_bytes) >= cat.total_bytes
        report = place(arena, layout)
        print(format_residency(report))
        assert report.ok and not report.migrated and report.on_plan_fraction() == 1.0
        checked, bad = slab_residency(arena, layout, slice(0, 1))
        assert checked > 3000 and not bad, "\n".join(bad[:10])
        maps = {m["start"]: m["policy"] for m in numa.read_numa_maps()}
        base = memory.address_of(arena)
        for r in layout.primary_regions():
            want = f"bind:{r.nodes[0]}" if r.policy == "bind" else "interleave:" + numa.format_cpulist(r.nodes)
            assert maps.get(base + r.arena_offset) == want, (r.name, maps.get(base + r.arena_offset))
        # and the bytes are the file's: the last slab of a tensor (its tail near a 4 KiB boundary)
        for (layer, kind), p in layout.experts.items():
            et = cat.expert_layers[layer][kind]
            for e in (0, et.n_expert - 1):
                _s, fo, n = et.slab(e)
                off = int(p.offsets[e, 0])
                assert np.array_equal(arena[off:off + n], file_bytes(cat, fo, n)), (layer, kind, e)
    finally:
        memory.free_arena(arena)
