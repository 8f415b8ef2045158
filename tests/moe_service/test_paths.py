"""moe_service.paths: CACHE_DIRECTORY (systemd) > XDG_CACHE_HOME > ~/.cache."""

from __future__ import annotations

from pathlib import Path

from moe_service.paths import cache_dir, demo_model_path


def test_systemd_cache_directory_wins(monkeypatch, tmp_path):
    monkeypatch.setenv("CACHE_DIRECTORY", f"{tmp_path}/a:{tmp_path}/b")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "a"


def test_xdg_cache_home_next(monkeypatch, tmp_path):
    monkeypatch.delenv("CACHE_DIRECTORY", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "moe-service"
    assert demo_model_path() == tmp_path / "xdg" / "moe-service" / "models" / "smollm2-135m-instruct-moe8.gguf"


def test_home_default(monkeypatch, tmp_path):
    monkeypatch.delenv("CACHE_DIRECTORY", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_dir() == tmp_path / ".cache" / "moe-service"
    assert cache_dir().is_absolute()
    assert not (tmp_path / ".cache").exists()  # nothing is created


def test_relative_values_become_absolute(monkeypatch):
    monkeypatch.setenv("CACHE_DIRECTORY", "rel/dir")
    assert cache_dir() == Path.cwd() / "rel" / "dir"
