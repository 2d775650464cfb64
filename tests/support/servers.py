"""Real servers on loopback for tests and `make run-cluster`: MinIO and a Spark standalone cluster."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from tests.support.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
MINIO_BIN = Path(sys.prefix) / "bin" / "minio"
MINIO_USER = "cdcd-test"
MINIO_PASSWORD = "cdcd-test-secret"


def wait_until(cond, what: str, timeout_s: float = 120.0, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if cond():
            return
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: process exited {proc.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.2)


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


class MinioServer:
    """``minio server`` on 127.0.0.1 (built by scripts/ensure-minio.sh); stop/start keep the data."""

    def __init__(self, data_dir: Path, port: int | None = None) -> None:
        self.data_dir = data_dir
        self.port = port or free_port()
        self.console_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = data_dir.parent / f"minio-{self.port}.log"

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        if not MINIO_BIN.exists():
            raise RuntimeError(f"{MINIO_BIN} missing: run `make install` (scripts/ensure-minio.sh builds it)")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        env = {
            **os.environ,
            "MINIO_ROOT_USER": MINIO_USER,
            "MINIO_ROOT_PASSWORD": MINIO_PASSWORD,
            "MINIO_BROWSER": "off",
            "MINIO_UPDATE": "off",
        }
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    str(MINIO_BIN),
                    "server",
                    str(self.data_dir),
                    "--quiet",
                    "--address",
                    f"127.0.0.1:{self.port}",
                    "--console-address",
                    f"127.0.0.1:{self.console_port}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        wait_until(lambda: _http_ok(f"{self.endpoint}/minio/health/ready"), "MinIO ready", proc=self.proc)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def _fs(self) -> Any:
        import pyarrow.fs as pafs

        return pafs.S3FileSystem(
            access_key=MINIO_USER,
            secret_key=MINIO_PASSWORD,
            endpoint_override=self.endpoint,
            scheme="http",
            region="us-east-1",
            allow_bucket_creation=True,
        )

    def create_bucket(self, name: str) -> None:
        self._fs().create_dir(name)

    def get_object(self, bucket: str, key: str) -> bytes:
        with self._fs().open_input_stream(f"{bucket}/{key}") as f:
            return bytes(f.read())


class SparkStandalone:
    """A Spark standalone master and ``workers`` workers from pyspark's own ``spark-class`` on loopback."""

    def __init__(self, work_dir: Path, workers: int = 2, cores_per_worker: int = 1, memory: str = "1g") -> None:
        import pyspark

        self.spark_home = Path(pyspark.__file__).parent
        self.work_dir = work_dir
        self.workers = workers
        self.cores_per_worker = cores_per_worker
        self.memory = memory
        self.port = free_port()
        self.ui_port = free_port()
        self.master_proc: subprocess.Popen[bytes] | None = None
        self.worker_procs: list[subprocess.Popen[bytes]] = []

    @property
    def master_url(self) -> str:
        return f"spark://127.0.0.1:{self.port}"

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        # Executors run Python tasks that import this checkout's cdcd (the Spark writer's tasks).
        pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        env = {
            **os.environ,
            "SPARK_HOME": str(self.spark_home),
            "SPARK_LOCAL_IP": "127.0.0.1",
            "SPARK_NO_DAEMONIZE": "1",
            "SPARK_LOG_DIR": str(self.work_dir),
            "PYTHONPATH": pythonpath,
        }
        log = open(self.work_dir / f"{name}.log", "ab")
        try:
            return subprocess.Popen(
                [str(self.spark_home / "bin" / "spark-class"), *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                cwd=self.work_dir,
            )
        finally:
            log.close()

    def alive_workers(self) -> int:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.ui_port}/json/", timeout=2) as r:
                state = json.load(r)
        except OSError:
            return -1
        return sum(1 for w in state.get("workers", []) if w.get("state") == "ALIVE")

    def start(self) -> None:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.master_proc = self._spawn(
            "master",
            [
                "org.apache.spark.deploy.master.Master",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--webui-port",
                str(self.ui_port),
            ],
        )
        wait_until(lambda: self.alive_workers() >= 0, "the Spark master", proc=self.master_proc)
        for i in range(self.workers):
            self.start_worker(i)
        wait_until(lambda: self.alive_workers() >= self.workers, f"{self.workers} Spark workers")

    def start_worker(self, i: int) -> None:
        wdir = self.work_dir / f"worker-{i}"
        wdir.mkdir(exist_ok=True)
        proc = self._spawn(
            f"worker-{i}",
            [
                "org.apache.spark.deploy.worker.Worker",
                self.master_url,
                "--host",
                "127.0.0.1",
                "--cores",
                str(self.cores_per_worker),
                "--memory",
                self.memory,
                "--webui-port",
                str(free_port()),
                "--work-dir",
                str(wdir),
            ],
        )
        if i < len(self.worker_procs):
            self.worker_procs[i] = proc
        else:
            self.worker_procs.append(proc)

    def worker_running(self, pid: int) -> int | None:
        """The index of the worker whose process tree holds ``pid`` (its executors' Python tasks)."""
        pids = {p.pid: i for i, p in enumerate(self.worker_procs) if p.poll() is None}
        while pid > 1:
            if pid in pids:
                return pids[pid]
            try:
                with open(f"/proc/{pid}/stat") as f:
                    pid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                return None
        return None

    def kill_worker(self, i: int) -> None:
        """SIGKILL worker ``i`` with its executors (its process group)."""
        proc = self.worker_procs[i]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)

    def stop(self) -> None:
        for p in [*self.worker_procs, self.master_proc]:
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in [*self.worker_procs, self.master_proc]:
            if p is not None:
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
