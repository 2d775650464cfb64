"""Which cdcd this is: the release version, and the git commit when it runs from a checkout.

One place for ``cdcd --version``, the daemon's ``daemon_started`` line and anything else that
names the running code. Installed from a wheel, the version is the package metadata's; run from
a git checkout (an editable install, ``make install``), it is ``pyproject.toml``'s, because an
editable install's metadata keeps the version of the last ``pip install -e`` however often the
checkout moved on since, and the commit is asked of git, with a short timeout: a missing git, a
slow file system or a tree that is no checkout leaves the commit out, never fails a command."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import tomllib
from importlib import metadata
from pathlib import Path

GIT_TIMEOUT_S = 2.0
"""Each git call; a start must not wait on a hung network file system."""

_SOURCE_ROOT = Path(__file__).resolve().parent.parent


def _checkout() -> Path | None:
    """The git work tree cdcd's own source sits in, if it runs from one."""
    if (_SOURCE_ROOT / ".git").exists() and (_SOURCE_ROOT / "pyproject.toml").is_file():
        return _SOURCE_ROOT
    return None


@functools.cache
def version() -> str:
    """The release version, e.g. ``0.2.0`` (``unknown`` when neither metadata nor a checkout says)."""
    root = _checkout()
    if root is not None:
        try:
            project = tomllib.loads((root / "pyproject.toml").read_text()).get("project", {})
        except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
            project = {}
        if project.get("name") == "cdcd" and isinstance(project.get("version"), str):
            return str(project["version"])
    try:
        return metadata.version("cdcd")
    except metadata.PackageNotFoundError:
        return "unknown"


def _git(root: Path, *args: str) -> str | None:
    """git's stdout, or None when git is missing, fails or takes too long."""
    # GIT_OPTIONAL_LOCKS=0: `git status` must not take the index lock of a tree someone is committing in.
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0", "LC_ALL": "C"}
    try:
        done = subprocess.run(
            ["git", "-C", str(root), *args],
            capture_output=True,
            text=True,
            timeout=GIT_TIMEOUT_S,
            env=env,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


@functools.cache
def commit() -> str | None:
    """The checkout's commit, short, with ``-dirty`` when tracked files differ from it; None when
    cdcd does not run from a git checkout (or git cannot say)."""
    root = _checkout()
    if root is None:
        return None
    head = _git(root, "rev-parse", "--short=12", "HEAD")
    if head is None or not re.fullmatch(r"[0-9a-f]{4,40}", head.strip()):
        return None
    status = _git(root, "status", "--porcelain", "--untracked-files=no")
    return head.strip() + ("-dirty" if status else "")


def version_and_commit() -> str:
    """``0.2.0`` installed, ``0.2.0 (git 55b54c3a7dd3-dirty)`` from a checkout."""
    sha = commit()
    return f"{version()} (git {sha})" if sha else version()


def release(text: str) -> tuple[int, ...]:
    """``"0.2.0"`` as ``(0, 2, 0)`` for comparing releases (a suffix such as ``.dev1`` is ignored)."""
    parts = re.match(r"\d+(?:\.\d+)*", text)
    return tuple(int(p) for p in parts.group(0).split(".")) if parts else ()
