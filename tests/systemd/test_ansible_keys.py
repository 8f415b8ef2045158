"""The moe_service role's API key file, run for real on this machine (connection local):
keys from an ansible-vault encrypted variable file -> one key per line in a 0600 file owned by
the service user, never printed; every instance's config gets serve.api_key_file."""

from __future__ import annotations

import grp
import json
import os
import pwd
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.systemd.test_ansible import ANSIBLE, PLAYBOOK_BIN, ansible_env, needs_ansible

KEYS = ["sk-vaulted-aaaaaaaaaaaaaaaaaaaa", "sk-vaulted-bbbbbbbbbbbbbbbbbbbb"]

PLAYBOOK = """
- hosts: localhost
  connection: local
  gather_facts: false
  vars_files:
    - {roles}/moe_service/defaults/main.yml
    - {roles}/moe_service/vars/main.yml
    - {vault}
  tasks:
    - ansible.builtin.import_tasks: {roles}/moe_service/tasks/api_keys.yml
    - name: What an instance's config gets
      ansible.builtin.copy:
        content: "{{{{ moe_service_item_config | to_json }}}}"
        dest: {out}/config.json
        mode: "0600"
      vars:
        item: {{name: "", config: {{serve: {{port: 8001}}}}}}
"""


@needs_ansible
def test_key_file_from_vault_is_0600_owned_by_the_service_user_and_never_printed(tmp_path: Path):
    vault_bin = Path(PLAYBOOK_BIN).with_name("ansible-vault")
    if not vault_bin.exists():
        pytest.skip("ansible-vault is not installed next to ansible-playbook")
    out = tmp_path / "out"
    out.mkdir()
    password = tmp_path / "vault-pass"
    password.write_text("test-vault-password\n")
    vault = tmp_path / "vault.yml"
    vault.write_text("vault_moe_service_api_keys:\n" + "".join(f"  - {k}\n" for k in KEYS))
    env = ansible_env()
    subprocess.run([str(vault_bin), "encrypt", "--vault-password-file", str(password), str(vault)], check=True,
                   capture_output=True, env=env, timeout=120)
    assert vault.read_text().startswith("$ANSIBLE_VAULT")
    user, group = pwd.getpwuid(os.getuid()).pw_name, grp.getgrgid(os.getgid()).gr_name
    book = tmp_path / "keys.yml"
    book.write_text(PLAYBOOK.format(roles=ANSIBLE / "roles", out=out, vault=vault))
    extra = tmp_path / "extra.json"  # extra vars: above the role defaults read as vars_files
    extra.write_text(json.dumps({"moe_service_api_keys": "{{ vault_moe_service_api_keys }}",
                                 "moe_service_api_key_file": str(out / "api-keys"),
                                 "moe_service_user": user, "moe_service_group": group}))
    res = subprocess.run([PLAYBOOK_BIN, "-i", "localhost,", str(book), "--vault-password-file", str(password), "-v",
                          "-e", f"@{extra}",
                          "-e", f"ansible_python_interpreter={sys.executable}"], capture_output=True, text=True,
                         env=env, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert not any(k in res.stdout + res.stderr for k in KEYS)  # no_log
    keys = out / "api-keys"
    st = keys.stat()
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid() and st.st_gid == os.getgid()
    from moe_service.api.auth import read_key_file

    assert read_key_file(keys) == KEYS
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["serve"] == {"host": "127.0.0.1", "port": 8001, "api_key_file": str(keys)}
