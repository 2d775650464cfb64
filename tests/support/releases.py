"""Released versions of cdcd for the upgrade tests: a release's source materialised from its commit, and node and
daemon processes of a given release (``tests/test_upgrade.py``).

A release runs from its own source tree with this checkout's interpreter and virtualenv: ``PYTHONPATH`` puts its
tree first, ahead of the editable install of this checkout, so ``python -m cdcd`` is that release's code. Its
dependencies are today's locked ones, not a second venv of its day: v0.1.0 had no lock file, and its ranges are the
same as this checkout's, so a venv of its own would only download and install the same packages again. Its C row
builder is not built: it runs on the Python row builder (``CDCD_LAKE_ROWS=python``, which the suite proves equal to
the C one), so no compiler runs in the test. The commit is recorded here by hash: a clone without tags still has it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support.procs import CDCD, ROOT, child_env, wait_for
from tests.support.replication_rig import DaemonProc, NodeProc, Procs

V0_1_0 = "55b54c3a7dd3ce6407af13092020bcb21efc5e9b"
"""v0.1.0, the first release (tag ``v0.1.0``)."""


class Release:
    """A cdcd release to run: ``root`` is its source tree (this checkout for the current code)."""

    def __init__(self, name: str, root: Path) -> None:
        self.name = name
        self.root = root

    def env(self) -> dict[str, str]:
        """The environment of a process of this release (no CDCD_* override of the test's, its tree first)."""
        if self.root == ROOT:
            return child_env()
        env = {k: v for k, v in os.environ.items() if not k.startswith("CDCD_")}
        env["PYTHONPATH"] = str(self.root)
        env["CDCD_LAKE_ROWS"] = "python"
        return env

    def cdcd(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*CDCD, *args], capture_output=True, text=True, timeout=timeout, env=self.env(), cwd=self.root
        )


CURRENT = Release("current", ROOT)


def materialise(commit: str, dest: Path) -> Release:
    """The source tree of ``commit`` (``git archive``) in ``dest``; fails with one line when this clone lacks it (a
    shallow clone: ``git fetch --unshallow``)."""
    have = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True)
    assert have.returncode == 0, f"commit {commit} is not in this clone (shallow? run `git fetch --unshallow`)"
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.Popen(["git", "-C", str(ROOT), "archive", commit], stdout=subprocess.PIPE)
    assert archive.stdout is not None
    tar = subprocess.run(["tar", "-x", "-C", str(dest)], stdin=archive.stdout, capture_output=True)
    archive.stdout.close()
    assert archive.wait(60) == 0 and tar.returncode == 0, tar.stderr.decode()[-2000:]
    release = Release(commit[:7], dest)
    res = subprocess.run(
        [sys.executable, "-c", "import cdcd; print(cdcd.__file__)"],
        capture_output=True,
        text=True,
        env=release.env(),
        cwd=dest,
        timeout=60,
    )
    assert res.stdout.strip() == str(dest / "cdcd" / "__init__.py"), f"not the release's code: {res.stdout}{res.stderr}"
    return release


class ReleaseNode(NodeProc):
    """A ``cdcd node run`` process (see NodeProc) of ``release``; ``release`` may change between runs."""

    release: Release = CURRENT

    def start(
        self,
        *,
        rate: int = 0,
        seconds: float = 0,
        keyspace: int = 1000,
        remove_pct: int = 0,
        seed: int = 1,
        wait: bool = True,
    ) -> None:
        """``wait``: until it serves its metrics (else ``wait_serving`` later: nodes start side by side)."""
        args = [*CDCD, "node", "run", "--config", str(self.config), "--log-format", "json"]
        if rate:
            args += ["--load-rate", str(rate), "--load-seconds", str(seconds), "--load-keyspace", str(keyspace)]
            args += ["--load-remove-pct", str(remove_pct), "--load-seed", str(seed)]
        self.load = bool(rate)
        self.runs.append(self.tmp / f"{self.name}-{len(self.runs) + 1}.err")
        with self.err.open("wb") as err:
            proc = subprocess.Popen(
                args, stdout=subprocess.DEVNULL, stderr=err, env=self.release.env(), cwd=self.release.root
            )
            self.proc = self.procs.track(proc)
        if wait:
            self.wait_serving()

    def wait_serving(self) -> None:
        wait_for(lambda: self.exited() or self.serving(), 60, f"node {self.name} to serve")
        self.check_running()


class ReleaseDaemon(DaemonProc):
    """A ``cdcd run`` process (see DaemonProc) of ``release`` on a config of any consumer."""

    release: Release = CURRENT

    def __init__(self, procs: Procs, tmp: Path, name: str, config: Path) -> None:
        self.procs = procs
        self.tmp = tmp
        self.name = name
        self.config = config
        self.runs: list[Path] = []
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        # cwd: ``python -m`` puts the working directory first on sys.path, ahead of PYTHONPATH.
        self.runs.append(self.tmp / f"{self.name}-{len(self.runs) + 1}.err")
        with self.err.open("ab") as err:
            proc = subprocess.Popen(
                [*CDCD, "run", "--config", str(self.config)],
                stdout=subprocess.DEVNULL,
                stderr=err,
                env=self.release.env(),
                cwd=self.release.root,
            )
        self.proc = self.procs.track(proc)
