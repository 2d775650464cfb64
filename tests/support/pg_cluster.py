"""A private, throw-away PostgreSQL cluster for the side-by-side benchmarks (``bench_pg``).

``ensure_postgres()`` finds Debian's server binaries under ``/usr/lib/postgresql/*/bin`` and, when
there are none and we are root, installs them (``apt-get install -y postgresql
postgresql-contrib``). ``PgCluster`` runs ``initdb`` into a temporary directory, starts the server
with ``pg_ctl`` listening only on a unix socket inside that directory (no TCP port, so it can never
clash with another cluster), and on ``close()`` -- also after an exception, Ctrl-C or SIGTERM, see
``bench_pg.main`` -- stops it (``-m immediate``: the data is thrown away anyway) and deletes the
directory. The server refuses to run as root, so as root every server-side command runs as the
``postgres`` user through ``runuser`` and the directory is handed to that user; clients (psql,
pg_recvlogical, psycopg) connect as the superuser ``postgres`` with ``trust`` authentication,
which only this socket (mode 0700 directory) can reach.

``server_cpu_s()`` is the CPU time of the whole cluster from ``/proc``: the postmaster's own time,
the time of every live child (backends, walsenders, checkpointer, WAL writer, ...) and the time of
children that already exited (the kernel adds it to the postmaster's ``cutime``/``cstime`` when
the postmaster reaps them), so a walsender that ends with its client is still counted.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["PgCluster", "PgUnavailable", "ensure_postgres", "pg_bin_dir"]

SERVER_USER = "postgres"
CLK_TCK = os.sysconf("SC_CLK_TCK")

SETTINGS: dict[str, str] = {
    "listen_addresses": "''",
    "wal_level": "logical",
    "fsync": "on",
    "synchronous_commit": "on",
    "full_page_writes": "on",
    "max_replication_slots": "16",
    "max_wal_senders": "16",
    # Off so that a 1M-row table's auto-ANALYZE/VACUUM does not run in the background while the
    # cdcd side is being measured (the sides alternate on the same two cores).
    "autovacuum": "off",
    # Decoding output and the live benchmark's commit timestamps are parsed as UTC.
    "timezone": "'UTC'",
    "log_timezone": "'UTC'",
    "logging_collector": "off",
}
"""postgresql.conf additions; everything else (shared_buffers 128MB, max_wal_size 1GB, ...) is the default."""


class PgUnavailable(RuntimeError):
    """PostgreSQL's server binaries are missing and could not be installed."""


def pg_bin_dir() -> Path | None:
    """The newest ``/usr/lib/postgresql/<major>/bin`` holding initdb, pg_ctl, psql and pg_recvlogical."""
    found = []
    for initdb in glob.glob("/usr/lib/postgresql/*/bin/initdb"):
        bin_dir = Path(initdb).parent
        if all((bin_dir / tool).exists() for tool in ("pg_ctl", "postgres", "psql", "pg_recvlogical")):
            try:
                found.append((int(bin_dir.parent.name), bin_dir))
            except ValueError:
                continue
    return max(found)[1] if found else None


def _plugins_present(bin_dir: Path) -> bool:
    lib = bin_dir.parent / "lib"
    return (lib / "pgoutput.so").exists() and (lib / "test_decoding.so").exists()


def ensure_postgres(*, install: bool = True, log: Any = None) -> Path:
    """The server's bin dir; installs Debian's ``postgresql`` (+contrib: test_decoding) if missing."""
    bin_dir = pg_bin_dir()
    if bin_dir is not None and _plugins_present(bin_dir):
        return bin_dir
    if not install:
        raise PgUnavailable("PostgreSQL server binaries not found under /usr/lib/postgresql/*/bin")
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise PgUnavailable(
            "PostgreSQL is not installed and this is not a root shell with apt-get: "
            "run `apt-get install -y postgresql postgresql-contrib` as root"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = ["apt-get", "install", "-y", "-q", "postgresql", "postgresql-contrib"]
    for attempt in ("install", "update+install"):
        if log is not None:
            log(f"installing PostgreSQL: {' '.join(cmd)} ({attempt})")
        if attempt != "install":
            subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, check=False)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        bin_dir = pg_bin_dir()
        if proc.returncode == 0 and bin_dir is not None and _plugins_present(bin_dir):
            # Debian's postinst creates and may start a "main" cluster on port 5432; the benchmark
            # uses a private one, so leave no idle server of ours behind (the cluster stays, stopped).
            if shutil.which("pg_ctlcluster"):
                subprocess.run(["pg_ctlcluster", bin_dir.parent.name, "main", "stop"], capture_output=True, check=False)
            return bin_dir
    tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-5:])
    raise PgUnavailable(f"apt-get install postgresql failed (exit {proc.returncode}):\n{tail}")


def _proc_times(pid: int) -> tuple[int, int, int]:
    """(ppid, utime+stime, cutime+cstime) in clock ticks, from ``/proc/<pid>/stat``."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        data = f.read()
    # The command name (field 2) may hold spaces and parentheses: split after its closing one.
    fields = data[data.rindex(b")") + 2 :].split()
    return int(fields[1]), int(fields[11]) + int(fields[12]), int(fields[13]) + int(fields[14])


class PgCluster:
    """initdb + pg_ctl start in a fresh temp dir; ``close()`` stops it and deletes the dir."""

    def __init__(self, bin_dir: Path, *, base_dir: str | None = None, port: int = 5432) -> None:
        self.bin_dir = bin_dir
        self.port = port  # only names the socket file: listen_addresses is empty
        self.root = Path(tempfile.mkdtemp(prefix="cdcd-bench-pg-", dir=base_dir))
        self.data_dir = self.root / "data"
        self.socket_dir = self.root
        self.log_path = self.root / "server.log"
        self.user = "postgres"
        self.dbname = "postgres"
        self._as_server_user = os.geteuid() == 0
        self._postmaster_pid: int | None = None
        self.version = ""
        self.settings = dict(SETTINGS)

    # --- lifecycle ---------------------------------------------------------------------------------
    def _server_cmd(self, args: Sequence[str]) -> list[str]:
        if self._as_server_user:
            return ["runuser", "-u", SERVER_USER, "--", *args]
        return list(args)

    def start(self) -> None:
        if self._as_server_user:
            shutil.chown(self.root, SERVER_USER, SERVER_USER)
        os.chmod(self.root, 0o700)
        subprocess.run(
            self._server_cmd(
                [
                    str(self.bin_dir / "initdb"),
                    "-D",
                    str(self.data_dir),
                    "-U",
                    self.user,
                    "--auth=trust",
                    "-E",
                    "UTF8",
                    "--locale=C",
                    "--no-instructions",
                ]
            ),
            check=True,
            capture_output=True,
            text=True,
        )
        conf = [f"{k} = {v}" for k, v in self.settings.items()]
        conf += [f"unix_socket_directories = '{self.socket_dir}'", f"port = {self.port}"]
        with open(self.data_dir / "postgresql.conf", "a") as f:
            f.write("\n# cdcd bench_pg\n" + "\n".join(conf) + "\n")
        # A session of its own: a Ctrl-C in the terminal reaches us, not the postmaster, so the
        # cleanup below decides how the server stops.
        subprocess.run(
            self._server_cmd(
                [str(self.bin_dir / "pg_ctl"), "-D", str(self.data_dir), "-l", str(self.log_path), "-w", "start"]
            ),
            check=True,
            capture_output=True,
            text=True,
            start_new_session=True,
        )
        self._postmaster_pid = int((self.data_dir / "postmaster.pid").read_text().split()[0])
        self.version = self.sql("SHOW server_version").split()[0]  # "15.18 (Debian 15.18-0+deb12u1)" -> "15.18"

    def close(self) -> None:
        """Stop the server (immediate) and delete the cluster; safe to call twice or after a failed start."""
        try:
            if (self.data_dir / "postmaster.pid").exists():
                proc = subprocess.run(
                    self._server_cmd(
                        [str(self.bin_dir / "pg_ctl"), "-D", str(self.data_dir), "-m", "immediate", "-w", "stop"]
                    ),
                    capture_output=True,
                    text=True,
                    check=False,
                    timeout=60,
                )
                if proc.returncode != 0 and self._postmaster_pid is not None:
                    self._kill_postmaster()
        except subprocess.TimeoutExpired:
            self._kill_postmaster()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def _kill_postmaster(self) -> None:
        pid = self._postmaster_pid
        if pid is None:
            return
        try:
            os.kill(pid, signal.SIGQUIT)  # immediate shutdown: the postmaster takes its children down
            for _ in range(100):
                os.kill(pid, 0)
                time.sleep(0.05)
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def __enter__(self) -> PgCluster:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- clients -----------------------------------------------------------------------------------
    def conn_args(self) -> list[str]:
        return ["-h", str(self.socket_dir), "-p", str(self.port), "-U", self.user]

    def conninfo(self) -> str:
        return f"host={self.socket_dir} port={self.port} user={self.user} dbname={self.dbname}"

    def psql_cmd(self, *args: str) -> list[str]:
        return [
            str(self.bin_dir / "psql"),
            "-X",
            "-q",
            "-v",
            "ON_ERROR_STOP=1",
            *self.conn_args(),
            "-d",
            self.dbname,
            *args,
        ]

    def sql(self, statement: str) -> str:
        """Run one statement (or several, ';'-separated) with psql; returns unaligned tuples-only output."""
        proc = subprocess.run(
            self.psql_cmd("-At", "-c", statement), capture_output=True, text=True, check=False, timeout=600
        )
        if proc.returncode != 0:
            raise RuntimeError(f"psql failed ({proc.returncode}) on {statement[:200]!r}: {proc.stderr.strip()}")
        return proc.stdout

    def recvlogical_cmd(self, slot: str, *args: str) -> list[str]:
        return [
            str(self.bin_dir / "pg_recvlogical"),
            "--no-loop",  # fail instead of retrying every 5 s forever
            *self.conn_args(),
            "-d",
            self.dbname,
            "-S",
            slot,
            *args,
        ]

    # --- accounting --------------------------------------------------------------------------------
    def _children(self) -> dict[int, int]:
        """Live children of the postmaster: pid -> CPU ticks."""
        pm = self._postmaster_pid
        out: dict[int, int] = {}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                ppid, own, _ = _proc_times(int(entry.name))
            except (OSError, ValueError):
                continue  # gone meanwhile
            if ppid == pm:
                out[int(entry.name)] = own
        return out

    def server_cpu_s(self) -> float:
        """CPU seconds used by the cluster so far: postmaster + live children + reaped children."""
        pm = self._postmaster_pid
        if pm is None:
            return 0.0
        _ppid, own, reaped = _proc_times(pm)
        return (own + reaped + sum(self._children().values())) / CLK_TCK

    def _backends(self) -> list[int]:
        """Children serving a connection (backends, walsenders) or exiting/exited but not yet reaped.

        A connection's process title names its ``[local]`` socket peer. An exiting process has no
        title any more (its memory is gone), and until the postmaster reaps it its CPU time shows
        neither in its own /proc entry nor in the postmaster's cutime: wait for it too.
        """
        out = []
        for pid in self._children():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    title = f.read()
            except OSError:
                continue
            if not title or b"[local]" in title:
                out.append(pid)
        return out

    def settle(self, timeout_s: float = 10.0) -> None:
        """Wait until no connection's process is left, i.e. every one has exited and been reaped.

        Their CPU time is then in the postmaster's cutime; read while they are exiting it could be
        counted twice or not at all. Polls /proc rather than asking the server, which would start a
        backend of its own. The background processes (checkpointer, WAL writer, ...) stay.
        """
        deadline = time.monotonic() + timeout_s
        while self._backends() and time.monotonic() < deadline:
            time.sleep(0.01)
