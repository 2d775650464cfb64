"""`cdcd kafka-to-node` as the tests run it: a config per applier, its runs' stderr, its metrics."""

from __future__ import annotations

import subprocess
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.support.ports import free_port
from tests.support.procs import CDCD, cdcd, child_env
from tests.support.replication_rig import NodeProc, Procs


def _toml(values: dict[str, Any]) -> str:
    out = []
    for k, v in values.items():
        out.append(f"{k} = {v!r}" if not isinstance(v, str) else f'{k} = "{v}"')
    return "\n".join(out).replace("True", "true").replace("False", "false") + "\n"


class Applier:
    """`cdcd kafka-to-node` runs with one config; stderr per run."""

    def __init__(self, procs: Procs, tmp: Path, name: str, **values: Any) -> None:
        self.procs = procs
        self.tmp = tmp
        self.name = name
        self.metrics_port = free_port()
        self.config = tmp / f"{name}.toml"
        self.config.write_text(_toml({**values, "metrics_address": f"127.0.0.1:{self.metrics_port}"}))
        self.runs: list[Path] = []
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        err = self.tmp / f"{self.name}-{len(self.runs) + 1}.err"
        self.runs.append(err)
        with err.open("wb") as f:
            self.proc = self.procs.track(
                subprocess.Popen(
                    [*CDCD, "kafka-to-node", "--config", str(self.config), "--log-format", "json", *args],
                    stdout=subprocess.DEVNULL,
                    stderr=f,
                    env=env or child_env(),
                )
            )
        return self.proc

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name)

    def tail(self) -> str:
        return self.runs[-1].read_text()[-3000:]

    def tail_all(self) -> str:
        """Every line of the last run's log."""
        return self.runs[-1].read_text()


def node_diff_rc(a_dir: Path, b: NodeProc) -> int:
    res = cdcd("node", "diff", str(a_dir), str(b.dir), "--json", timeout=120)
    assert res.returncode in (0, 1), res.stdout + res.stderr
    return res.returncode
