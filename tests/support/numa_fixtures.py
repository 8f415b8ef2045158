"""Fake machines and fake catalogs for the NUMA, plan and preflight unit tests.

``write_sysfs(root, ...)`` writes the sysfs/procfs files :meth:`Topology.read` reads, so a test
describes any host (nodes, CPUs, memory, distances, hugepage pools, GPUs, sysctls).
``fake_catalog(...)`` builds an object with the GGUF catalog's attributes (tensors,
expert_layers, shards, total_bytes) and no file behind it: only sizes and offsets matter to
the planner. ``cfg(...)`` builds the Settings they read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from moe_service.config import Settings, load_config

GIB = 1024**3


def write_sysfs(
    root: Path,
    node_cpus: list[list[int]],
    node_mem_gib: list[float],
    distances: list[list[int]] | None = None,
    node_free_gib: list[float] | None = None,
    numa_balancing: int | None = 0,
    thp: str = "always [madvise] never",
    hugepages_2m: list[tuple[int, int]] | None = None,
    gpus: list[tuple[str, int]] | None = None,
    cpu_flags: str = "fpu sse2 avx avx2 fma f16c",
    allowed_cpus: str | None = None,
    cgroup_cpus: str | None = None,
) -> Path:
    """Write a fake /sys + /proc under ``root`` and return it.

    ``node_cpus[i]``/``node_mem_gib[i]``: CPUs and MemTotal of node i; MemFree defaults to
    MemTotal. ``gpus``: [(pci address, numa node)] NVIDIA 3D controllers. ``allowed_cpus``:
    Cpus_allowed_list of /proc/self/status; ``cgroup_cpus``: cgroup v2 cpuset.cpus.effective.
    """
    n = len(node_cpus)
    node_dir = root / "sys/devices/system/node"
    node_dir.mkdir(parents=True, exist_ok=True)
    (node_dir / "online").write_text(f"0-{n - 1}\n" if n > 1 else "0\n")
    (node_dir / "has_memory").write_text(f"0-{n - 1}\n" if n > 1 else "0\n")
    distances = distances or [[10 if i == j else 20 for j in range(n)] for i in range(n)]
    free = node_free_gib or node_mem_gib
    all_cpus = sorted(c for cpus in node_cpus for c in cpus)
    for i in range(n):
        d = node_dir / f"node{i}"
        d.mkdir(exist_ok=True)
        (d / "cpulist").write_text(",".join(str(c) for c in node_cpus[i]) + "\n")
        (d / "distance").write_text(" ".join(str(x) for x in distances[i]) + "\n")
        total_kib = int(node_mem_gib[i] * 1024 * 1024)
        free_kib = int(free[i] * 1024 * 1024)
        (d / "meminfo").write_text(
            f"Node {i} MemTotal:       {total_kib} kB\n"
            f"Node {i} MemFree:        {free_kib} kB\n"
            f"Node {i} MemUsed:        {total_kib - free_kib} kB\n"
            f"Node {i} Active(file):   0 kB\n"
            f"Node {i} Inactive(file): 0 kB\n"
            f"Node {i} SReclaimable:   0 kB\n"
            f"Node {i} HugePages_Total:     0\n"
        )
        for size, (nr, fr) in (("2048", (hugepages_2m or [(0, 0)] * n)[i]), ("1048576", (0, 0))):
            hp = d / f"hugepages/hugepages-{size}kB"
            hp.mkdir(parents=True, exist_ok=True)
            (hp / "nr_hugepages").write_text(f"{nr}\n")
            (hp / "free_hugepages").write_text(f"{fr}\n")
    cpu_dir = root / "sys/devices/system/cpu"
    cpu_dir.mkdir(parents=True, exist_ok=True)
    (cpu_dir / "online").write_text(f"{all_cpus[0]}-{all_cpus[-1]}\n")
    proc = root / "proc"
    (proc / "self").mkdir(parents=True, exist_ok=True)
    (proc / "sys/kernel").mkdir(parents=True, exist_ok=True)
    total_kib = int(sum(node_mem_gib) * 1024 * 1024)
    free_kib = int(sum(free) * 1024 * 1024)
    (proc / "meminfo").write_text(
        f"MemTotal:       {total_kib} kB\nMemFree:        {free_kib} kB\nMemAvailable:   {free_kib} kB\n"
    )
    (proc / "cpuinfo").write_text(
        "".join(f"processor\t: {c}\nflags\t\t: {cpu_flags}\n\n" for c in all_cpus)
    )
    status = f"Name:\tpython\nCpus_allowed_list:\t{allowed_cpus or f'{all_cpus[0]}-{all_cpus[-1]}'}\n"
    (proc / "self/status").write_text(status)
    if numa_balancing is not None:
        (proc / "sys/kernel/numa_balancing").write_text(f"{numa_balancing}\n")
    thp_dir = root / "sys/kernel/mm/transparent_hugepage"
    thp_dir.mkdir(parents=True, exist_ok=True)
    (thp_dir / "enabled").write_text(thp + "\n")
    (thp_dir / "defrag").write_text("always defer defer+madvise [madvise] never\n")
    if cgroup_cpus is not None:
        (proc / "self/cgroup").write_text("0::/system.slice/moe.service\n")
        cg = root / "sys/fs/cgroup/system.slice/moe.service"
        cg.mkdir(parents=True, exist_ok=True)
        (cg / "cpuset.cpus.effective").write_text(cgroup_cpus + "\n")
        (cg / "cpuset.mems.effective").write_text(f"0-{n - 1}\n" if n > 1 else "0\n")
    pci = root / "sys/bus/pci/devices"
    pci.mkdir(parents=True, exist_ok=True)
    for addr, node in gpus or []:
        d = pci / addr
        d.mkdir()
        (d / "vendor").write_text("0x10de\n")
        (d / "class").write_text("0x030200\n")
        (d / "device").write_text("0x2335\n")
        (d / "numa_node").write_text(f"{node}\n")
        audio = pci / (addr[:-1] + "1")  # the card's HDMI audio function: not a GPU
        audio.mkdir()
        (audio / "vendor").write_text("0x10de\n")
        (audio / "class").write_text("0x040300\n")
        (audio / "numa_node").write_text(f"{node}\n")
    return root


@dataclass
class FakeTensor:
    name: str
    shard: int
    file_offset: int
    nbytes: int


@dataclass
class FakeExpertTensor:
    layer: int
    kind: str
    tensor: FakeTensor
    n_expert: int
    slab_bytes: int

    def slab(self, e: int) -> tuple[int, int, int]:
        if not 0 <= e < self.n_expert:
            raise IndexError(e)
        return self.tensor.shard, self.tensor.file_offset + e * self.slab_bytes, self.slab_bytes


@dataclass
class FakeShard:
    path: Path
    index: int
    size_bytes: int
    data_offset: int = 0
    alignment: int = 32
    n_tensors: int = 0


@dataclass
class FakeCatalog:
    tensors: dict[str, FakeTensor] = field(default_factory=dict)
    expert_layers: dict[int, dict[str, FakeExpertTensor]] = field(default_factory=dict)
    shards: list[FakeShard] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def fake_catalog(n_layers: int = 2, n_expert: int = 8, slab_bytes: int = 4096, dense_bytes: int = 10_000,
                 kinds: tuple[str, ...] = ("gate", "up", "down"), path: Path | None = None) -> FakeCatalog:
    """A one-shard MoE catalog: token_embd, then per layer attn (dense) + expert tensors, output."""
    cat = FakeCatalog()
    off = 4096  # data section start

    def add(name: str, nbytes: int) -> FakeTensor:
        nonlocal off
        off = (off + 31) // 32 * 32
        t = FakeTensor(name, 0, off, nbytes)
        cat.tensors[name] = t
        off += nbytes
        return t

    add("token_embd.weight", dense_bytes)
    for layer in range(n_layers):
        add(f"blk.{layer}.attn_q.weight", dense_bytes)
        add(f"blk.{layer}.ffn_gate_inp.weight", 4 * n_expert * 64)
        cat.expert_layers[layer] = {}
        for kind in kinds:
            t = add(f"blk.{layer}.ffn_{kind}_exps.weight", n_expert * slab_bytes)
            cat.expert_layers[layer][kind] = FakeExpertTensor(layer, kind, t, n_expert, slab_bytes)
    add("output.weight", dense_bytes)
    cat.shards.append(FakeShard(path or Path("/nonexistent/model.gguf"), 0, off, 4096, 32, len(cat.tensors)))
    return cat


def cfg(policy: str = "expert_shard", *, replicas: int = 0, node_reserve_gib: float = 0.0, pages: str = "thp",
        **numa) -> Settings:
    """Settings for the planner and preflight tests, through the real config loader: numa.policy,
    replication.replicas, numa.node_reserve_gib (0 here, so sizes in the tests are the fake
    node's own), fastload.pages and any other numa key (nodes, expert_homes, sysfs_root)."""
    return load_config(data={"numa": {"policy": policy, "node_reserve_gib": node_reserve_gib, **numa},
                             "replication": {"replicas": replicas}, "fastload": {"pages": pages}})
