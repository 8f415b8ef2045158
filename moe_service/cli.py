"""Command line: ``moe-service serve|plan|check|config|bench|demo-model``.

Operator mistakes (bad config, missing model, a host that cannot hold the plan) print one clear
sentence plus the details on stderr and exit with the code of their error class (see
moe_service/errors.py); only a bug prints a traceback (exit 1).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from moe_service.config import config_source, dump_toml, load_config
from moe_service.errors import ConfigError, MoeServiceError
from moe_service.log import configure_logging


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="TOML config (default: $MOE_SERVICE_CONFIG, else configs/default.toml)")
    p.add_argument("--model", metavar="PATH", help="shortcut for model.path (any shard of a split set)")


def _settings(args):
    return load_config(getattr(args, "config", None), model=getattr(args, "model", None))


def _logging(settings, args=None) -> None:
    configure_logging(settings.log.level, settings.log.target, settings.log.journal_socket)


# -- commands ---------------------------------------------------------------------------------


def cmd_serve(args) -> int:
    from pipeline.lifecycle import run_service

    settings = _settings(args)
    _logging(settings)
    return run_service(settings)


def cmd_config_show(args) -> int:
    settings = _settings(args)
    sys.stdout.write(f"# effective configuration (file: {config_source(settings)}, then environment overrides)\n")
    sys.stdout.write(dump_toml(settings))
    return 0


def cmd_config_validate(args) -> int:
    """Exit 0 when FILE is a valid config (tables, keys, values and the stage list), else 2."""
    import pipeline.stages  # noqa: F401
    from pipeline.spec import check_stages

    settings = load_config(args.file)
    check_stages(settings.pipeline.stages)
    print(f"{args.file}: valid")
    return 0


def cmd_plan(args) -> int:
    """The placement plan for this host: exit 0 when it fits, 4 when it does not."""
    from moe_service.gguf_model import GGUFModel
    from moe_service.numa import Topology
    from pipeline.plan import format_plan, kv_capacity, plan_summary, prefix_disk_capacity
    from pipeline.prepare import plan_layout

    settings = _settings(args)
    catalog = GGUFModel.open(settings.model_path())
    topology = Topology.read(root=settings.numa.sysfs_root)
    layout = plan_layout(catalog, topology, settings)
    summary = plan_summary(layout, topology, settings)
    kv = summary["kv"] = kv_capacity(catalog, layout, topology, settings)
    disk = summary["prefix_cache_disk"] = prefix_disk_capacity(settings)
    if args.json:
        print_json(summary)
    else:
        print(format_plan(summary))
        print(f"\n{kv['sentence'] if kv['fits'] else 'KV cache does NOT fit:'}")
        print("\n".join(f"  - {r}" for r in kv["reasons"]))
        if disk is not None:
            print(f"\n{disk['sentence'] if disk['fits'] else 'prefix cache on disk does NOT fit:'}")
            print("\n".join(f"  - {r}" for r in disk["reasons"]))
    return 0 if summary["fits"] and kv["fits"] and (disk is None or disk["fits"]) else 4


def cmd_check(args) -> int:
    """Catalog, plan and preflight without allocating: exit 0 ready, 3 bad model file, 4 refused."""
    from pipeline.check import format_check, run_check

    settings = _settings(args)
    configure_logging("error", settings.log.target, settings.log.journal_socket)  # the report is the output
    result = run_check(settings)
    if args.json:
        print_json(result.to_dict())
    else:
        print(format_check(result))
    return result.exit_code


def cmd_demo_model(args) -> int:
    """Build (or find) the embedded demo model and print its path."""
    from moe_service.demo_model import build_demo_model

    configure_logging("info", "auto")
    path = build_demo_model(args.out, force=args.force)
    print(path)
    return 0


BENCHES = {
    "fastload": "bench.fastload",
    "decode": "bench.decode",
    "placement": "bench.placement",
    "serve": "bench.serve",
    "kernels": "bench.kernels",
}


def cmd_bench(args) -> int:
    """Run one side-by-side benchmark; its own options follow the benchmark's name."""
    import importlib

    configure_logging("warning", "auto")  # on stderr: stdout is the report (--json: one object)
    module = importlib.import_module(BENCHES[args.bench])
    return int(module.main(args.bench_args) or 0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moe-service",
        description="Serve huge Mixture-of-Experts GGUF models from multi-socket NUMA hosts.",
        epilog="Exit codes: 0 ok, 1 internal error, 2 config/usage, 3 model file, 4 preflight refused, "
        "5 stage failed, 130 interrupted.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("serve", help="load the model through the pipeline and serve the HTTP API")
    _add_config_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("config", help="show or validate configuration")
    csub = p.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    ps = csub.add_parser("show", help="print the effective configuration as TOML")
    _add_config_args(ps)
    ps.set_defaults(func=cmd_config_show)
    pv = csub.add_parser("validate", help="exit 0 when FILE is valid, 2 with the problems when not")
    pv.add_argument("file", metavar="FILE")
    pv.set_defaults(func=cmd_config_validate)

    p = sub.add_parser("plan", help="print the placement plan: bytes and experts per node, replicas, what does not fit")
    _add_config_args(p)
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("check", help="model files, plan and preflight without allocating anything "
                       "(exit 0 ready, 3 bad model file, 4 preflight refuses)")
    _add_config_args(p)
    p.add_argument("--json", action="store_true", help="one JSON object instead of the report")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("demo-model", help="build the embedded demo model (SmolLM2-135M as an exact 8-expert MoE)")
    p.add_argument("--out", metavar="PATH", type=Path, help="where to write it (default: the cache dir)")
    p.add_argument("--force", action="store_true", help="rebuild even when the file exists")
    p.set_defaults(func=cmd_demo_model)

    p = sub.add_parser("bench", help="side-by-side benchmarks (`moe-service bench NAME --help` for each one's options)")
    p.add_argument("bench", choices=sorted(BENCHES), metavar="NAME", help=", ".join(sorted(BENCHES)))
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="the benchmark's own options")
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ConfigError as e:
        print(f"moe-service: {e}", file=sys.stderr)
        for line in e.errors:
            print(f"  {line}", file=sys.stderr)
        return e.exit_code
    except MoeServiceError as e:
        print(f"moe-service: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


def print_json(obj) -> None:
    """Write one JSON object to stdout (the `--json` output of commands)."""
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


if __name__ == "__main__":
    sys.exit(main())
