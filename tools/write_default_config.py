"""Regenerate configs/default.toml from the config models (every key, its default, its
description as a comment). Run after adding or changing a config field:

    python tools/write_default_config.py > configs/default.toml
"""

from __future__ import annotations

import textwrap

import tomli_w

from moe_service.config import TABLES, describe_fields

HEADER = """\
# moe-service configuration: every table and key with its default.
# This file serves the embedded demo model (model.path empty). Copy it to /etc/moe-service/
# and point model.path at your GGUF for a real host. Environment variables
# MOE_SERVICE__<TABLE>__<KEY> override any key; `moe-service config show` prints the result.
"""


def main() -> None:
    out = [HEADER]
    for table, fields in describe_fields().items():
        out.append(f"\n[{table}]  # {TABLES[table].__doc__.split(':', 1)[1].strip()}\n")
        for key, info in fields.items():
            for line in textwrap.wrap(info["description"], 92):
                out.append(f"# {line}\n")
            value = info["default"]
            if isinstance(value, dict):  # an inline table: tomli_w would open a [key] table here
                items = ", ".join(tomli_w.dumps({k: v}).strip() for k, v in value.items())
                out.append(f"{key} = {{{' ' + items + ' ' if items else ''}}}\n")
            else:
                out.append(tomli_w.dumps({key: value}))
    print("".join(out), end="")


if __name__ == "__main__":
    main()
