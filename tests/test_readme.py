"""Every code block of the README is run by a test, as written, from a scratch working directory
holding a copy of ``config/`` (so its relative paths, ``var/node1`` and ``config/*.toml``, mean what
they mean to a reader in the repository).

- the first look's Python block and the shell block after it (a node with a sample load, the
  daemon, ``state show``, ``control status``): here;
- the set-up's ``cdcd top`` and realtime on/off block: tests/test_readme_setup.py;
- the lake's shell and reader blocks: tests/test_readme_lake.py;
- ``make run`` / ``make test``: the targets exist (``make -n``); what they run is the demo
  (tests/test_lake.py) and this suite.
"""

from __future__ import annotations

import json
import re
import shlex
import signal
import subprocess
from pathlib import Path

import pytest

from tests.support.docs import README, block_with, code_blocks
from tests.support.procs import CDCD, ROOT, child_env, reap, wait_for
from tests.support.shipped import copy_shipped_config

COVERED = {
    "python": ['Node.open("var/node1")', "from cdcd.lake.reading.readers import"],
    "sh": ["make run ", "cdcd node run --config config/node.toml", "cdcd top --node-dir", "config/lake.toml"],
}
"""A marker of each README block, and where it runs (the module docstring)."""


def test_every_readme_block_is_run_by_a_test() -> None:
    text = README.read_text()
    blocks = re.findall(r"```(\w*)\n(.*?)```", text, flags=re.S)
    assert len(blocks) >= 5
    for lang, body in blocks:
        markers = [m for m in COVERED.get(lang, []) if m in body]
        assert len(markers) == 1, f"README block ```{lang} not run by any test:\n{body}"
    for lang, markers in COVERED.items():
        for marker in markers:
            block_with(text, lang, marker)  # exactly one block each


def test_make_targets_exist() -> None:
    block = block_with(README.read_text(), "sh", "make run ")
    targets = [shlex.split(line.split("#")[0])[1] for line in block.splitlines() if line.strip()]
    assert targets == ["run", "test"]
    res = subprocess.run(["make", "-n", *targets], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr


def _argv(line: str) -> tuple[list[str], bool]:
    """A README command line as argv (``cdcd`` is this interpreter's ``-m cdcd``), and whether it ends in ``&``."""
    words = shlex.split(line.split("#", maxsplit=1)[0])
    background = words[-1] == "&"
    if background:
        words = words[:-1]
    assert words[0] == "cdcd", line
    return [*CDCD, *words[1:]], background


@pytest.mark.timeout(600)
def test_the_first_look_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Python block fills ``var/node1``; then the shell block, line by line: the node with its sample
    load in the background, the daemon, ``state show`` once the daemon committed, ``control status``.
    The daemon's jsonl output holds the README's order and the sample load's changes; both stop cleanly."""
    text = README.read_text()
    monkeypatch.chdir(tmp_path)
    copy_shipped_config(tmp_path / "config")  # its metrics ports free ones
    exec(block_with(text, "python", 'Node.open("var/node1")'), {})  # the README's own code

    lines = [ln for ln in block_with(text, "sh", "cdcd node run --config config/node.toml").splitlines() if ln]
    assert [ln.split()[1] for ln in lines] == ["node", "run", "state", "control"]
    env = child_env()
    node_argv, background = _argv(lines[0])
    assert background
    daemon_argv, _ = _argv(lines[1])
    node_err, daemon_err = tmp_path / "node.err", tmp_path / "daemon.err"
    node = subprocess.Popen(node_argv, stdout=subprocess.DEVNULL, stderr=node_err.open("wb"), env=env)
    daemon = None
    try:
        status_argv, _ = _argv(lines[3])

        def node_answers() -> bool:
            assert node.poll() is None, node_err.read_text()[-3000:]
            return subprocess.run(status_argv, capture_output=True, env=env, timeout=60).returncode == 0

        wait_for(node_answers, 120, "the node to answer on its control socket")
        daemon = subprocess.Popen(daemon_argv, stdout=subprocess.DEVNULL, stderr=daemon_err.open("wb"), env=env)
        events = tmp_path / "var" / "cdc-events.jsonl"

        def delivered() -> bool:
            assert daemon is not None and daemon.poll() is None, daemon_err.read_text()[-3000:]
            if not events.exists():
                return False
            caches = {json.loads(line)["cache"] for line in events.read_text().splitlines() if line.endswith("}")}
            return "orders" in caches and len(caches) > 1

        wait_for(delivered, 300, "the daemon to deliver the README's order and the sample load")
        state_argv, _ = _argv(lines[2])
        state = subprocess.run(state_argv, capture_output=True, text=True, env=env, timeout=60)
        assert state.returncode == 0, state.stderr
        shown = dict(line.split(maxsplit=1) for line in state.stdout.splitlines() if " " in line.strip())
        assert shown["mode"] in ("ACTIVE", "PASSIVE") and "orders" in shown["caches"], state.stdout
        status = subprocess.run(status_argv, capture_output=True, text=True, env=env, timeout=60)
        assert status.returncode == 0, status.stderr
        assert shown["node_id"].strip() in status.stdout, status.stdout
        first = json.loads(events.read_text().splitlines()[0])
        assert (first["cache"], first["key"], first["value"]) == ("orders", "o-1", {"qty": 3, "sku": "A-7"})
    finally:
        for proc, err in ((daemon, daemon_err), (node, node_err)):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    assert proc.wait(120) == 0, err.read_text()[-3000:]
                finally:
                    reap(proc)
    assert code_blocks(text, "sh")
