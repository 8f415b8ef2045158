"""Config: TOML tables, strictness, env overrides, error messages, show/validate."""

from __future__ import annotations

import subprocess
import sys
import tomllib

import pytest

from moe_service.config import TABLES, Settings, describe_fields, dump_toml, load_config
from moe_service.errors import ConfigError
from tests.conftest import REPO


def write(tmp_path, text: str, name: str = "x.toml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def problems(path=None, **kw) -> list[str]:
    with pytest.raises(ConfigError) as ei:
        load_config(path, **kw)
    return ei.value.errors


def test_mistyped_table_is_named_with_a_suggestion(tmp_path, clean_env):
    p = write(tmp_path, "[fastlaod]\nthreads = 4\n")
    (line,) = problems(p)
    assert line == f"{p}: unknown table [fastlaod] (did you mean 'fastload'?)"


def test_mistyped_key_is_named(tmp_path, clean_env):
    p = write(tmp_path, "[serve]\nprot = 9000\n")
    (line,) = problems(p)
    assert line == f"{p}: serve.prot: unknown key (did you mean 'port'?)"


def test_out_of_range_value_reads_like_the_spec(tmp_path, clean_env):
    p = write(tmp_path, "[fastload]\nthreads = 0\n")
    assert problems(p) == [f"{p}: fastload.threads: must be >= 1 (got 0)"]


def test_every_problem_is_reported_at_once(tmp_path, clean_env):
    p = write(tmp_path, '[fastload]\nthreads = 0\npopulate = "fast"\n[log]\nlevel = "loud"\n')
    lines = problems(p)
    assert len(lines) == 3
    assert any("fastload.populate: must be one of" in x and "'fast'" in x for x in lines)
    assert any(x.startswith(f"{p}: log.level:") for x in lines)


def test_invalid_toml_names_the_file(tmp_path, clean_env):
    p = write(tmp_path, "[serve\nport = 1\n")
    with pytest.raises(ConfigError, match=r"x\.toml: invalid TOML"):
        load_config(p)


def test_missing_file_is_a_config_error(tmp_path, clean_env):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.toml")


def test_env_overrides_win_over_the_file(tmp_path, clean_env):
    p = write(tmp_path, "[serve]\nport = 9000\nhost = '0.0.0.0'\n")
    clean_env.setenv("MOE_SERVICE__SERVE__PORT", "9100")
    s = load_config(p)
    assert s.serve.port == 9100
    assert s.serve.host == "0.0.0.0"  # untouched keys keep the file's value


def test_env_list_values_are_json(clean_env):
    clean_env.setenv("MOE_SERVICE__PIPELINE__STAGES", '["fastload", "warmup"]')
    assert load_config(data={}).pipeline.stages == ["fastload", "warmup"]


def test_bad_env_value_names_the_variable(clean_env):
    clean_env.setenv("MOE_SERVICE__FASTLOAD__THREADS", "many")
    (line,) = problems(data={})
    assert line == "MOE_SERVICE__FASTLOAD__THREADS: fastload.threads: must be an integer (got 'many')"


def test_env_with_unknown_table_is_an_error(clean_env):
    clean_env.setenv("MOE_SERVICE__FASTLOD__THREADS", "2")
    (line,) = problems(data={})
    assert "MOE_SERVICE__FASTLOD__THREADS: unknown table [fastlod]" in line


def test_model_shortcut_beats_env_and_file(tmp_path, clean_env):
    p = write(tmp_path, "[model]\npath = 'file.gguf'\n")
    clean_env.setenv("MOE_SERVICE__MODEL__PATH", "env.gguf")
    assert load_config(p, model="cli.gguf").model.path == "cli.gguf"
    assert load_config(p).model.path == "env.gguf"


def test_config_path_from_environment(tmp_path, clean_env):
    p = write(tmp_path, "[serve]\nport = 1234\n")
    clean_env.setenv("MOE_SERVICE_CONFIG", str(p))
    assert load_config().serve.port == 1234


def test_cross_field_rule_extension_must_outlast_interval(clean_env):
    (line,) = problems(data={"pipeline": {"extend_interval_s": 10, "extend_timeout_s": 5}})
    assert "extend_timeout_s (5.0) must exceed extend_interval_s (10.0)" in line


def test_every_field_has_a_default_and_description():
    fields = describe_fields()
    assert set(fields) == set(TABLES)
    for table, keys in fields.items():
        for key, info in keys.items():
            assert info["description"], f"{table}.{key} has no description"


def test_default_toml_equals_builtin_defaults(clean_env):
    text = (REPO / "configs" / "default.toml").read_text()
    assert Settings(**tomllib.loads(text)).model_dump() == Settings().model_dump()


def test_show_round_trips(clean_env):
    s = load_config(data={"serve": {"port": 9999}, "numa": {"policy": "mirror"}})
    again = load_config(data=tomllib.loads(dump_toml(s)))
    assert again.model_dump() == s.model_dump()


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "moe_service.cli", *args], capture_output=True, text=True, env=env, cwd=REPO)


def _env_without_moe():
    import os

    return {k: v for k, v in os.environ.items() if not k.upper().startswith("MOE_SERVICE")}


def test_cli_validate_exit_codes(tmp_path):
    good = write(tmp_path, "[serve]\nport = 8001\n[pipeline]\nstages = []\n", "good.toml")
    bad = write(tmp_path, "[fastload]\nthreads = 0\n", "bad.toml")
    env = _env_without_moe()
    r = run_cli("config", "validate", str(good), env=env)
    assert r.returncode == 0, r.stderr
    r = run_cli("config", "validate", str(bad), env=env)
    assert r.returncode == 2
    assert f"{bad}: fastload.threads: must be >= 1 (got 0)" in r.stderr


def test_cli_validate_refuses_a_broken_stage_order(tmp_path):
    bad = write(tmp_path, '[pipeline]\nstages = ["engine", "warmup", "serve", "fastload"]\n', "order.toml")
    r = run_cli("config", "validate", str(bad), env=_env_without_moe())
    assert r.returncode == 2
    assert "engine must come after fastload" in r.stderr
    assert "stage 'engine' reads ctx.weights, which stage 'fastload' writes after it" in r.stderr


def test_cli_show_prints_effective_toml(tmp_path):
    p = write(tmp_path, "[serve]\nport = 8123\n")
    env = _env_without_moe() | {"MOE_SERVICE__SERVE__HOST": "0.0.0.0"}
    r = run_cli("config", "show", "--config", str(p), env=env)
    assert r.returncode == 0, r.stderr
    shown = tomllib.loads(r.stdout)
    assert shown["serve"]["port"] == 8123 and shown["serve"]["host"] == "0.0.0.0"
    assert set(shown) == set(TABLES)
