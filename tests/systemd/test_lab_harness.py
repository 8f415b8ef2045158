"""The labs' host side (tests/systemd/lab_harness.py): a checkout that the units' sandbox
hides from the service (a clone under /var/tmp, /tmp or /root) is copied where they see it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.systemd import lab_harness


@pytest.mark.parametrize(("path", "root"), [
    ("/var/tmp/ci/moe-service", "/var/tmp"),
    ("/tmp/x", "/tmp"),
    ("/root/src/moe-service", "/root"),
    ("/home/me/moe-service", "/home"),
    ("/run/user/1000/repo", "/run/user"),
    ("/work/main", None),
    ("/srv/moe-service", None),
    ("/rootfs/repo", None),  # a prefix of the name is not the folder
    ("/var/tmpx/repo", None),
])
def test_unit_hidden_root_names_the_folder_the_units_hide(path: str, root: str | None) -> None:
    assert lab_harness.unit_hidden_root(Path(path)) == root


def test_a_hidden_checkout_is_copied_without_git_venv_or_caches(tmp_path: Path, monkeypatch) -> None:
    repo = tmp_path / "clone"  # pytest's tmp_path lies under /tmp: hidden from the units
    (repo / "tests/systemd/lab").mkdir(parents=True)
    (repo / "tests/systemd/lab/syscall_probe.py").write_text("print('probe')\n")
    (repo / ".git").mkdir()
    (repo / ".git/HEAD").write_text("ref: refs/heads/main\n")
    (repo / ".venv/bin").mkdir(parents=True)
    (repo / "moe_service/__pycache__").mkdir(parents=True)
    (repo / "moe_service/__init__.py").write_text("")
    monkeypatch.setattr(lab_harness, "REPO", repo)
    work = tmp_path / "work"
    work.mkdir()
    (work / "checkout").mkdir()
    (work / "checkout/stale.txt").write_text("from an earlier run")
    got = lab_harness.checkout_for_units(work)
    assert got == work / "checkout"
    assert (got / "tests/systemd/lab/syscall_probe.py").read_text() == "print('probe')\n"
    assert (got / "moe_service/__init__.py").is_file()
    assert not (got / ".git").exists() and not (got / ".venv").exists()
    assert not (got / "moe_service/__pycache__").exists()
    assert not (got / "stale.txt").exists()  # made afresh


def test_a_visible_checkout_is_used_in_place(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(lab_harness, "REPO", Path("/srv/moe-service"))
    assert lab_harness.checkout_for_units(tmp_path) == Path("/srv/moe-service")
    assert not (tmp_path / "checkout").exists()
