"""Stage declarations: what each stage reads and writes in the context, checked against the
declared order before anything runs; and the pipeline package's imports, free of cycles."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import pipeline.stages  # noqa: F401  (registers every stage)
from moe_service.config import DEFAULT_STAGES, load_config
from moe_service.errors import ConfigError, StageError
from pipeline.context import PipelineContext
from pipeline.runner import PipelineRunner
from pipeline.spec import (
    CONTEXT_FIELDS,
    PREPARE_WRITES,
    STAGES,
    Stage,
    check_stages,
    register_stage,
    validate_stages,
)

PIPELINE_DIR = Path(__file__).resolve().parents[2] / "pipeline"


def test_the_default_stage_list_is_valid_and_every_declaration_names_a_context_field():
    assert validate_stages(list(DEFAULT_STAGES)) == []
    assert DEFAULT_STAGES.index("engine") < DEFAULT_STAGES.index("warmup") < DEFAULT_STAGES.index("serve")
    assert set(PREPARE_WRITES) <= CONTEXT_FIELDS
    for cls in STAGES.values():
        assert set(cls.reads) | set(cls.reads_if_present) | set(cls.writes) <= CONTEXT_FIELDS, cls.name
    assert STAGES["engine"].writes == ("engine",)
    assert "engine" in STAGES["warmup"].reads and "engine" in STAGES["serve"].reads


def test_a_stage_list_from_before_the_engine_stage_says_what_to_add():
    old = ["fastload", "placement", "replication", "pin", "warmup", "serve"]
    problems = validate_stages(old)
    assert problems == [
        "pipeline.stages: stage 'warmup' reads ctx.engine, which neither the prepare step nor an earlier "
        "declared stage writes: add 'engine' before 'warmup'",
        "pipeline.stages: stage 'serve' reads ctx.engine, which neither the prepare step nor an earlier "
        "declared stage writes: add 'engine' before 'serve'",
    ]
    with pytest.raises(ConfigError) as err:
        check_stages(old)
    assert err.value.errors == problems


def test_a_reader_before_its_writer_names_both():
    problems = validate_stages(["fastload", "warmup", "engine", "serve"])
    assert ("pipeline.stages: stage 'warmup' reads ctx.engine, which stage 'engine' writes after it: "
            "declare 'engine' before 'warmup'") in problems
    assert any(p.startswith("pipeline.stages: warmup must come after engine:") for p in problems)
    problems = validate_stages(["engine", "fastload"])
    assert ("pipeline.stages: stage 'engine' reads ctx.weights, which stage 'fastload' writes after it: "
            "declare 'fastload' before 'engine'") in problems


def test_an_optional_read_written_later_is_refused_but_an_absent_writer_is_fine():
    problems = validate_stages(["fastload", "placement", "engine", "pin", "warmup", "serve"])
    assert ("pipeline.stages: stage 'engine' reads ctx.pins when present, which stage 'pin' writes after it: "
            "declare 'pin' before 'engine'") in problems
    assert validate_stages(["fastload", "engine", "warmup", "serve"]) == []  # no pin stage: no pins, by choice
    assert validate_stages(["fastload", "placement"]) == []


def test_a_declaration_that_is_not_a_context_field_is_refused_at_registration():
    class Bad(Stage):
        name = "bad-declaration"
        reads = ("enigne",)

        def run(self, ctx):
            pass

    with pytest.raises(TypeError, match=r"stage 'bad-declaration' declares \['enigne'\], which are not "
                                        r"PipelineContext fields"):
        register_stage(Bad)
    assert "bad-declaration" not in STAGES


def test_a_read_left_empty_by_a_skipped_stage_fails_before_the_reader_runs(clean_env):
    ran = []

    class Builder(Stage):
        name = "builder"
        writes = ("engine",)

        def skip_reason(self, ctx):
            return "disabled here"

        def run(self, ctx):
            ran.append(self.name)

    class User(Stage):
        name = "user"
        reads = ("engine",)

        def run(self, ctx):
            ran.append(self.name)

    ctx = PipelineContext(load_config(data={"pipeline": {"stages": ["builder", "user"]}}))
    runner = PipelineRunner(ctx, {"builder": Builder, "user": User})
    with pytest.raises(StageError, match=r"stage user reads ctx.engine, which no earlier stage filled "
                                         r"\(skipped: builder\)"):
        runner.run()
    runner.close()
    assert ran == []


def _imports(path: Path) -> set[str]:
    """Every ``pipeline.*`` module ``path`` imports, at module level or inside functions
    (an import that runs later still closes a cycle), leaving out ``if TYPE_CHECKING:`` blocks."""
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("pipeline.")}
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "pipeline":
                out |= {f"pipeline.{a.name}" for a in node.names}
            elif node.module.startswith("pipeline."):
                out.add(node.module)
    return out


def test_the_pipeline_package_has_no_import_cycle():
    graph = {f"pipeline.{p.stem}": _imports(p) for p in PIPELINE_DIR.glob("*.py") if p.stem != "__init__"}
    assert "pipeline.lifecycle" not in graph["pipeline.serve"]  # start_watchdog lives in moe_service.notify
    assert "pipeline.preflight" not in graph["pipeline.pin"]  # Check lives in pipeline.checks
    state: dict[str, int] = {}  # 1 on the path, 2 done

    def visit(mod: str, path: list[str]) -> None:
        state[mod] = 1
        for dep in sorted(graph.get(mod, ())):
            if state.get(dep) == 1:
                cycle = path[path.index(dep):] + [dep]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep, path + [dep])
        state[mod] = 2

    for mod in sorted(graph):
        if mod not in state:
            visit(mod, [mod])
