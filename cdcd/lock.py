"""Single-instance directory locks: ``flock`` on a lock file that records the holder's pid."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

from cdcd.faults import ExitCode, Fault
from cdcd.retry import poll_until


class LockHeld(Fault, Exception):
    """Another process holds the lock; ``pid`` is what its lock file says (None if unreadable)."""

    exit_code = ExitCode.FAILED

    def __init__(self, path: Path, pid: int | None) -> None:
        self.path = path
        self.pid = pid
        holder = f"pid {pid}" if pid is not None else "an unknown process"
        super().__init__(f"{path} is locked by {holder}")


class DirLock:
    """An exclusive lock released when the process dies (``flock``), so a SIGKILL never leaves it stale."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._fd: int | None = None

    def acquire(self, timeout_ms: int = 0) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            if poll_until(lambda: _try_flock(fd), timeout_ms / 1000, 0.05) is None:
                raise LockHeld(self.path, _read_pid(fd))
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.ftruncate(fd, 0)
            os.close(fd)

    @property
    def held(self) -> bool:
        return self._fd is not None


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode().strip()
        return int(text) if text else None
    except (OSError, ValueError):
        return None


def read_holder_pid(path: str | os.PathLike[str]) -> int | None:
    """The pid a lock file names (for read-only tools such as ``cdcd top``; no lock is taken)."""
    try:
        text = Path(path).read_text().strip()
        return int(text) if text else None
    except (OSError, ValueError):
        return None


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (another user's live process too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _try_flock(fd: int) -> bool | None:
    """True once the exclusive lock is taken; None while another process holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EAGAIN, errno.EACCES):
            raise
        return None
    return True
