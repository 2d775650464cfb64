"""Prometheus endpoints as the tests read them, and promtool (Debian's prometheus package, from
scripts/ensure-promtool.sh)."""

from __future__ import annotations

import shutil
import subprocess
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.procs import ROOT

CONFIG = ROOT / "config"


@pytest.fixture(scope="module")
def promtool() -> str:
    res = subprocess.run(["bash", str(ROOT / "scripts" / "ensure-promtool.sh")], capture_output=True, text=True)
    path = shutil.which("promtool")
    assert res.returncode == 0 and path, f"scripts/ensure-promtool.sh could not provide promtool: {res.stderr}"
    return path


def scrape_text(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return str(resp.read().decode())


def try_samples(port: int) -> dict[str, float] | None:
    """name{labels} summed per name, or None while the endpoint is not up."""
    try:
        text = scrape_text(port)
    except OSError:
        return None
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + float(s.value)
    return out
