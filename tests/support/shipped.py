"""The repository's shipped ``config/`` as a reader's scratch working directory holds it: copied as it is, but
for the metrics ports, which become ports from ``tests/support/ports.py`` (the shipped fixed ports would
collide between parallel test workers, and with a reader's own node or daemon running on this machine)."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.support.ports import free_port
from tests.support.procs import ROOT

SHIPPED_PORTS = ("127.0.0.1:9469", "127.0.0.1:9470")
"""The metrics addresses of the shipped configs: the daemon's (config/cdcd.toml, config/lake.toml), the node's
(config/node.toml)."""


def copy_shipped_config(dest: Path) -> dict[str, str]:
    """Copy ``config/`` to ``dest``, each shipped metrics address replaced by a free one; returns the
    replacements (shipped address -> the test's), for command lines that name a shipped address too."""
    ports = {old: f"127.0.0.1:{free_port()}" for old in SHIPPED_PORTS}
    shutil.copytree(ROOT / "config", dest)
    for toml in dest.glob("*.toml"):
        text = toml.read_text()
        for old, new in ports.items():
            text = text.replace(old, new)
        toml.write_text(text)
    return ports
