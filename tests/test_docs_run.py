"""Every ```sh, ```bash and ```python block of docs/*.md runs here as written, and every ```toml block that is a
config loads with the loader cdcd reads it with (README.md's blocks: tests/test_readme.py, test_readme_lake.py).

- The test finds the blocks itself: each runnable block is run by its page's test (``PAGE_TESTS``) and checked by
  the one check of that test whose marker it contains, or it is listed in ``NOT_RUN`` with the reason and the test
  that covers it. A new block that is neither fails ``test_every_block_is_run_or_listed``, and a page test fails on a
  block of its page that no check claims.
- Placeholders (``PLACEHOLDERS`` below, each named with what takes its place) are substituted, nothing else is
  edited: ``/data/lake`` is a real lake this module builds once (a node through the Python API, ``cdcd run`` with
  the deltalake writer run to the end, compaction in-process on the worker's ``spark``; twice, so there are two
  cuts and a time between them).
- Shell blocks run with bash (``set -euo pipefail``), one command at a time, in a scratch directory that holds a
  copy of ``config/`` (and ``scripts/`` as a link, as in a checkout), with ``cdcd`` on PATH (the venv's bin). A line
  ending in ``&`` starts in a process group of its own, tracked; the page's test stops it with SIGTERM at its end
  (exit 0 expected). Every other command must end by itself, within ``COMMAND_TIMEOUT_S``: a long-running
  foreground command (``cdcd run``, ``cdcd node run``) fails by that timeout, so a page that shows one lists it in
  ``NOT_RUN`` with the test that runs it bounded (daemon.md's are the README's first look, which
  tests/test_readme.py runs: the node with a sample load until the daemon delivered, then both stopped).
- Python blocks of one page run in order in one namespace, statement by statement, as a reader pasting them into a
  REPL; each expression statement's value is kept (a DataFrame collected) so the checks compare what the snippet
  prints with what the lake holds. ``spark`` is in the namespace where the page says the reader has a session
  (lake.md: the worker's; kafka.md's block runs in a Spark process of its own that has the Kafka source), and a
  name the page leaves to the reader is defined by the page's test (daemon.md's ``valid``: the reader's schema
  check).
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest

from cdcd.consumer import EventBatch
from cdcd.lake.cuts import Cut, latest_cut
from cdcd.lake.maintenance.compact import compact
from cdcd.node import Node
from tests.support.delta_lake import lake_consumer, wal_batch
from tests.support.docs import (
    DOCS,
    README,
    Block,
    Cell,
    background,
    block_with,
    cell_with,
    fenced_blocks,
    run_python,
    sh_commands,
    substitute,
)
from tests.support.lake import run_to_end, write_config
from tests.support.ports import free_ports
from tests.support.procs import ROOT, child_env

RUNNABLE = ("sh", "bash", "python")
NOT_CODE = ("", "toml", "json", "properties", "text")
"""Languages of blocks that are not run: configs (```toml: ``test_every_config_block_loads``), formats, output.
A block in any other language (``shell``, ``console``, ``py``…) fails: it would escape both."""
COMMAND_TIMEOUT_S = 300

PLACEHOLDERS = {
    "/data/lake": "the lake this module builds (absolute path): caches orders (sku, qty), accounts (balance), "
    "ledger (account, amount) and 'odd name.x', compacted twice",
    "2026-11-26T08:40:00Z": "the moment the lake's first cut was recorded (ISO 8601, Z): --as-of it is the first cut, "
    "the second came later",
    '"versionAsOf", 40': "the changes version after the first run of the daemon (the first half of the changes)",
    '"startingVersion", 42': "the first changes version of the second run (its feed is the second half)",
    "--port 9092": "a free port (tests/support/ports.py, with the next for its controller) for the broker kafka.md "
    "starts",
    "kafka1:9092": "that broker's address, 127.0.0.1:<port>",
}
"""What the docs' snippets name that exists only on a reader's machine, and what takes its place here."""

NOT_RUN = {
    ("daemon.md", "cdcd node run --config config/node.toml --load-rate 2000 &"): (
        "the README's first look, the same three commands (asserted in test_daemon_page): tests/test_readme.py "
        "runs them, the node and the daemon stopped once the daemon delivered"
    ),
    ("operations.md", "sudo useradd --system"): (
        "installs cdcd as root under systemd on a host: tests/test_systemd_units.py verifies the units it installs "
        "(systemd-analyze) and runs what they start (READY=1, watchdog)"
    ),
    ("operations.md", "sudo systemctl edit cdcd@node1"): (
        "a drop-in for an installed unit, as root: tests/test_systemd_units.py runs a lake daemon under the units' "
        "UMask (lake files group-readable, state private) and checks what the example configs write"
    ),
}
"""(page, marker) of each runnable block that no test here runs, and why."""


# --- the blocks ---------------------------------------------------------------------------------------------
def doc_pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def runnable_blocks(page: str) -> list[Block]:
    """The page's runnable blocks not listed in ``NOT_RUN``."""
    return [b for b in fenced_blocks(DOCS / page) if b.lang in RUNNABLE and not_run_reason(b) is None]


def not_run_reason(block: Block) -> str | None:
    reasons = [why for (page, marker), why in NOT_RUN.items() if page == block.page and marker in block.text]
    assert len(reasons) <= 1, f"{block}: more than one NOT_RUN entry"
    return reasons[0] if reasons else None


# --- running shell blocks -----------------------------------------------------------------------------------
@dataclass
class Shell:
    """A reader's shell: a scratch working directory, ``cdcd`` on PATH, the placeholders, the background jobs."""

    cwd: Path
    placeholders: dict[str, str]
    env: dict[str, str] = field(default_factory=dict)
    jobs: list[tuple[str, subprocess.Popen[bytes], Path]] = field(default_factory=list)
    after: Callable[[str, subprocess.CompletedProcess[str]], None] | None = None
    """Called after each foreground command (as the page writes it) exited 0: checks between a block's commands."""

    def __post_init__(self) -> None:
        self.env = child_env()
        self.env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), self.env.get("PATH", "")])

    def run(self, block: Block) -> list[tuple[str, list[str], subprocess.CompletedProcess[str]]]:
        """Each command of ``block`` (placeholders substituted) with the output the page shows and what it did:
        foreground ones must exit 0; ``&`` ones are started and tracked."""
        out = []
        for command, shown in sh_commands(block):
            line = substitute(command, self.placeholders)
            bg = background(line)
            if bg is not None:
                err = self.cwd / f"job{len(self.jobs)}.err"
                with err.open("wb") as f:
                    proc = subprocess.Popen(
                        ["bash", "-c", "set -euo pipefail\n" + bg],
                        cwd=self.cwd,
                        env=self.env,
                        stdout=subprocess.DEVNULL,
                        stderr=f,
                        start_new_session=True,
                    )
                self.jobs.append((command, proc, err))
                continue
            res = subprocess.run(
                ["bash", "-c", "set -euo pipefail\n" + line],
                cwd=self.cwd,
                env=self.env,
                capture_output=True,
                text=True,
                timeout=COMMAND_TIMEOUT_S,
            )
            assert res.returncode == 0, f"{block}: {command}\nexit {res.returncode}\n{res.stderr[-3000:]}"
            if self.after is not None:
                self.after(command, res)
            out.append((command, shown, res))
        return out

    def stop_jobs(self) -> None:
        """SIGTERM each background job's process group; each must exit 0."""
        failed = []
        for command, proc, err in self.jobs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                rc = proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                rc = proc.wait()
            if rc not in (0, -signal.SIGTERM, 128 + signal.SIGTERM):
                failed.append(f"{command}: exit {rc}\n{err.read_text()[-2000:]}")
        self.jobs.clear()
        assert not failed, failed


def scratch_dir(root: Path) -> Path:
    """A reader's working directory in a checkout: a copy of ``config/``, ``scripts/`` as a link."""
    root.mkdir(parents=True, exist_ok=True)
    shutil.copytree(ROOT / "config", root / "config")
    (root / "scripts").symlink_to(ROOT / "scripts")
    return root


Check = Callable[..., None]


PythonRunner = Callable[[Block, dict[str, Any], dict[str, str]], list[Cell]]


def run_page(
    page: str, checks: dict[str, Check], shell: Shell, namespace: dict[str, Any], python: PythonRunner = run_python
) -> None:
    """Every runnable block of ``page`` in page order, each checked by the one check whose marker it contains;
    a block no check claims, or a check no block takes, fails. ``python`` runs a Python block (in this process,
    unless the page's session cannot be this process's)."""
    used: set[str] = set()
    try:
        for block in runnable_blocks(page):
            markers = [m for m in checks if m in block.text]
            assert len(markers) == 1, f"{block}: not claimed by exactly one check of {page} (found {markers})"
            used.add(markers[0])
            if block.lang == "python":
                with contextlib.chdir(shell.cwd):  # relative paths are the reader's working directory's
                    cells = python(block, namespace, shell.placeholders)
                checks[markers[0]](cells)
            else:
                checks[markers[0]](shell.run(block))
    finally:
        shell.stop_jobs()
    assert used == set(checks), f"{page}: checks without a block: {set(checks) - used}"


def test_every_block_is_run_or_listed() -> None:
    """Each runnable block of docs/ belongs to a page this module runs (``PAGE_TESTS``) or is in ``NOT_RUN``, each
    ``NOT_RUN`` entry names one block that exists, and each placeholder is still on some page."""
    pages = {p.name: fenced_blocks(p) for p in doc_pages()}
    assert sum(1 for blocks in pages.values() for b in blocks if b.lang in RUNNABLE) >= 15
    for name, blocks in pages.items():
        for block in blocks:
            assert block.lang in RUNNABLE + NOT_CODE, f"{block}: write ```sh, ```python or one of {NOT_CODE}"
            if block.lang in RUNNABLE and not_run_reason(block) is None:
                assert name in PAGE_TESTS, f"{block}: no test runs this block (add it to a page test or NOT_RUN)"
    for page, marker in NOT_RUN:
        found = [b for b in pages[page] if marker in b.text]
        assert len(found) == 1, f"NOT_RUN ({page}, {marker!r}) names {len(found)} blocks"
    text = "".join(b.text for blocks in pages.values() for b in blocks)
    for name in PLACEHOLDERS:
        assert name in text, f"placeholder {name!r} is on no page any more"


# --- the lake ---------------------------------------------------------------------------------------------------
FIRST: dict[str, dict[str, Any]] = {
    "orders": {"o-1": {"sku": "A-7", "qty": 3}, "o-2": {"sku": "A-7", "qty": 2}, "o-3": {"sku": "B-2", "qty": 5}},
    "accounts": {"a-1": {"balance": 100}, "a-2": {"balance": 50}},
    "ledger": {
        "l-1": {"account": "a-1", "amount": 30},
        "l-2": {"account": "a-1", "amount": -10},
        "l-3": {"account": "a-2", "amount": 5},
    },
    "odd name.x": {"k-1": {"n": 1}, "k-2": {"n": 2}},
}
SECOND: dict[str, dict[str, Any]] = {
    "orders": {"o-1": {"sku": "A-7", "qty": 4}, "o-4": {"sku": "B-2", "qty": 1}, "o-2": None},
    "ledger": {"l-4": {"account": "a-2", "amount": 7}},
    "odd name.x": {"k-3": {"n": 3}},
}
"""The lake's two halves: the first before the first cut, the second (None: a remove) before the second."""


def fold(*halves: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for half in halves:
        for cache, rows in half.items():
            for key, value in rows.items():
                if value is None:
                    out[cache].pop(key)
                else:
                    out.setdefault(cache, {})[key] = value
    return out


FINAL = fold(FIRST, SECOND)


def sums_by_sku(rows: dict[str, Any]) -> dict[str, int]:
    out: dict[str, int] = {}
    for value in rows.values():
        out[value["sku"]] = out.get(value["sku"], 0) + value["qty"]
    return out


@dataclass
class Lake:
    scratch: Path
    path: Path
    node_dir: Path
    first_cut: Cut
    second_cut: Cut
    first_version: int
    """The changes version after the first run (the first half)."""

    def placeholders(self) -> dict[str, str]:
        return {
            "/data/lake": str(self.path),
            "2026-11-26T08:40:00Z": self.first_cut.recorded_at.isoformat().replace("+00:00", "Z"),
            '"versionAsOf", 40': f'"versionAsOf", {self.first_version}',
            '"startingVersion", 42': f'"startingVersion", {self.first_version + 1}',
        }


def write_half(node_dir: Path, half: dict[str, dict[str, Any]]) -> None:
    """One transaction per cache, each rolled into the archive (so the CDC dir holds several segments)."""
    node = Node.open(node_dir)
    try:
        for cache, rows in half.items():
            with node.transaction() as tx:
                for key, value in rows.items():
                    if value is None:
                        tx.remove(cache, key)
                    else:
                        tx.put(cache, key, value)
            node.force_archive()
    finally:
        node.close()


@pytest.fixture(scope="module")
def lake(spark: Any, tmp_path_factory: pytest.TempPathFactory) -> Lake:
    """The lake of every lake snippet, built once: each half written by a node (``var/node1`` of the scratch
    directory), landed by ``cdcd run`` (deltalake writer) run to the end, then compacted, which records a cut."""
    from deltalake import DeltaTable

    scratch = scratch_dir(tmp_path_factory.mktemp("docs") / "work")
    node_dir, path = scratch / "var" / "node1", scratch / "data" / "lake"
    config = write_config(scratch / "lake-daemon.toml", node_dir, lake_consumer(path))
    cuts, versions = [], []
    for half in (FIRST, SECOND):
        write_half(node_dir, half)
        run_to_end(config, node_dir, scratch / "daemon.err")
        versions.append(DeltaTable(str(path / "changes")).version())
        compact(spark, path)
        cut = latest_cut(path)
        assert cut is not None and cut.changes_version == versions[-1]
        cuts.append(cut)
    assert cuts[1].recorded_at > cuts[0].recorded_at
    return Lake(scratch, path, node_dir, cuts[0], cuts[1], versions[0])


def by_key(rows: list[dict[str, Any]], key: str, value: str) -> dict[Any, Any]:
    out = {r[key]: r[value] for r in rows}
    assert len(out) == len(rows), rows
    return out


def test_lake_page(lake: Lake, spark: Any) -> None:
    """docs/lake.md: the readers, the typed tables, the SCD history, the cuts (``lake cut``, ``latest_cut`` and
    ``cut_as_of`` with a string path), the readers at one cut and ``lake sql`` (DuckDB and Spark) print what the
    lake holds."""
    n_first = sum(len(rows) for rows in FIRST.values())
    n_second = sum(len(rows) for rows in SECOND.values())
    live = {cache: len(rows) for cache, rows in FINAL.items()}
    skus = sums_by_sku(FINAL["orders"])

    def readers(cells: list[Cell]) -> None:
        state = cell_with(cells, "where(\"cache = 'orders'\")")  # keys and values as JSON text
        assert {json.loads(r["key"]): json.loads(r["value"]) for r in state} == FINAL["orders"]
        assert by_key(cell_with(cells, "GROUP BY cache"), "cache", "count(1)") == live
        assert len(cell_with(cells, "versionAsOf")) == n_first
        feed = cell_with(cells, "readChangeFeed")
        assert len(feed) == n_second and {r["_change_type"] for r in feed} == {"insert"}
        for marker in ("DeltaTable(", "pl.read_delta(", "duckdb_connect().sql("):
            rows = cell_with(cells, marker)
            assert {(r["cache"], json.loads(r["key"])) for r in rows} == {(c, k) for c, ks in FINAL.items() for k in ks}

    def typed_tables(cells: list[Cell]) -> None:
        assert by_key(cell_with(cells, "spark.sql("), "sku", "sum(qty)") == skus
        for marker in ("DeltaTable(", "pl.read_delta("):
            rows = cell_with(cells, marker)
            assert {r["key"]: {"sku": r["sku"], "qty": r["qty"]} for r in rows} == FINAL["orders"]
        assert by_key(cell_with(cells, "duckdb_connect()"), "sku", "sum(qty)") == skus

    def scd_history(cells: list[Cell]) -> None:
        rows = [r.asDict() for r in namespace["history"].collect()]
        current = {r["key"]: r["qty"] for r in rows if r["is_current"]}
        assert current == {k: v["qty"] for k, v in FINAL["orders"].items()}
        versions = sorted((r["key"], r["qty"], r["is_current"]) for r in rows)
        assert versions == [
            ("o-1", 3, False),
            ("o-1", 4, True),
            ("o-2", 2, False),
            ("o-3", 5, True),
            ("o-4", 1, True),
        ], versions

    def cut_commands(runs: list[tuple[str, list[str], subprocess.CompletedProcess[str]]]) -> None:
        (_, _, latest), (_, _, as_of) = runs
        assert latest.stdout.startswith(f"cut at changes version {lake.second_cut.changes_version}, "), latest.stdout
        tables = {" ".join(ln.split()[:-1]): ln.split()[-1] for ln in latest.stdout.splitlines()[2 : 2 + len(FINAL)]}
        assert tables == {cache: str(v) for cache, v in lake.second_cut.tables.items()}, latest.stdout
        assert json.loads(as_of.stdout)["changes_version"] == lake.first_cut.changes_version

    def cuts_python(cells: list[Cell]) -> None:
        assert namespace["lake"] == str(lake.path)  # a string, as the page writes it
        assert namespace["cut"] == lake.second_cut
        assert namespace["earlier"] == lake.first_cut

    def at_one_cut(cells: list[Cell]) -> None:
        joined = cell_with(cells, "con.sql(")
        balances = {r["key"]: (r["balance"], r["sum(l.amount)"]) for r in joined}
        assert balances == {"a-1": (100, 20), "a-2": (50, 12)}
        assert set(cell_with(cells, "register_spark(").values()) == set(FINAL)
        assert by_key(cell_with(cells, "spark.sql("), "sku", "sum(qty)") == skus
        assert set(namespace["frames"]) == set(FINAL)
        assert by_key(cell_with(cells, "pl.SQLContext("), "sku", "qty") == skus

    def lake_sql(runs: list[tuple[str, list[str], subprocess.CompletedProcess[str]]]) -> None:
        (_, _, table), (_, _, odd), (_, _, spark_count) = runs
        lines = table.stdout.splitlines()
        assert lines[-1] == f"({len(skus)} rows)", table.stdout
        assert {ln.split()[0]: int(ln.split()[1]) for ln in lines[2:-1]} == skus, table.stdout
        rows = list(csv.DictReader(io.StringIO(odd.stdout)))
        assert {r["key"]: int(r["n"]) for r in rows} == {k: v["n"] for k, v in FINAL["odd name.x"].items()}
        assert spark_count.stdout.splitlines()[2].strip() == str(live["odd name.x"]), spark_count.stdout

    namespace: dict[str, Any] = {"spark": spark}
    checks: dict[str, Check] = {
        "# Spark (cdcd.lake.spark.acquire": readers,
        "delta.`/data/lake/tables/orders`": typed_tables,
        "order_changes": scd_history,
        "cdcd lake cut --lake": cut_commands,
        "from cdcd.lake.cuts import": cuts_python,
        "register_duckdb(con": at_one_cut,
        "cdcd lake sql --lake": lake_sql,
    }
    run_page("lake.md", checks, Shell(lake.scratch, lake.placeholders()), namespace)


def test_daemon_page_shell_is_the_readme_first_look() -> None:
    """docs/daemon.md's shell block (in ``NOT_RUN``) is the README's first look, command for command, which
    tests/test_readme.py runs."""
    (block,) = [b for b in fenced_blocks(DOCS / "daemon.md") if b.lang == "sh"]
    readme = block_with(README.read_text(), "sh", "cdcd node run --config config/node.toml")

    def commands(text: str) -> list[list[str]]:
        return [shlex.split(line, comments=True) for line in text.splitlines() if line.strip()]

    ours = commands(block.text)
    assert len(ours) == 3 and all(c in commands(readme) for c in ours), (ours, readme)


def small_batch(node_dir: Path) -> EventBatch:
    """A real batch: two orders, one without ``qty``, read back from the WAL of a node written here."""
    node = Node.open(node_dir)
    try:
        node.cache("orders").put_all({"o-1": {"qty": 3, "sku": "A-7"}, "o-2": {"sku": "B-2"}})
    finally:
        node.close()
    batch = wal_batch(node_dir)
    assert [ev.key for ev in batch] == ["o-1", "o-2"]
    return batch


class Client:
    """A client of the reader's store: ``fail`` set, it raises that as the store's error."""

    def __init__(self, fail: BaseException | None = None) -> None:
        self.fail = fail
        self.sent: list[Any] = []

    def send(self, values: list[Any]) -> None:
        if self.fail is not None:
            raise self.fail
        self.sent.append(values)

    write = send


def test_daemon_page(tmp_path: Path) -> None:
    """docs/daemon.md: the ``python`` consumer classes do what their comments say with a real batch: a client that
    cannot connect becomes RetriableError (the error as its cause, nothing sent), a working one takes every value
    and the call returns True; an event the reader's ``valid`` refuses becomes RefusedEvent at that event's
    position with nothing of the batch written, a valid batch is written whole."""
    from cdcd.consumer import RefusedEvent, RetriableError

    batch = small_batch(tmp_path / "node")
    values = [ev.value for ev in batch]

    def retriable(cells: list[Cell]) -> None:
        sink = namespace["MySink"]()
        sink.client = Client(ConnectionError("connection refused"))
        with pytest.raises(RetriableError, match="my store unreachable") as info:
            sink.on_events(batch)
        assert isinstance(info.value.__cause__, ConnectionError) and sink.client.sent == []
        sink.client = Client()
        assert sink.on_events(batch) is True
        assert sink.client.sent == [values]

    def refused(cells: list[Cell]) -> None:
        sink = namespace["MySink"]()
        sink.store = Client()
        with pytest.raises(RefusedEvent, match="value fails the schema") as info:
            sink.on_events(batch)
        (bad,) = [ev for ev in batch if "qty" not in ev.value]
        assert info.value.position == bad.position and sink.store.sent == []
        namespace["valid"] = lambda value: True
        assert sink.on_events(batch) is True
        assert sink.store.sent == [values]

    namespace: dict[str, Any] = {"valid": lambda value: "qty" in value}
    checks: dict[str, Check] = {"RetriableError(": retriable, "RefusedEvent(": refused}
    run_page("daemon.md", checks, Shell(scratch_dir(tmp_path / "work"), {}), namespace)


def test_node_page(tmp_path: Path) -> None:
    """docs/node.md: the Node API tour returns what its comments say, and what it wrote is in the WAL and in the
    node when opened again."""

    def tour(cells: list[Cell]) -> None:
        assert cell_with(cells, 'orders.get("o-1")') == {"qty": 3, "sku": "A-7"}
        assert cell_with(cells, 'orders.remove("o-2")') is True
        assert cell_with(cells, "orders.remove_all(") == 1
        node = Node.open(shell.cwd / "var" / "node1")
        try:
            assert dict(node.cache("orders").items()) == {"o-1": {"qty": 3, "sku": "A-7"}, "o-4": {"qty": 2}}
        finally:
            node.close()

    shell = Shell(scratch_dir(tmp_path / "work"), {})
    run_page("node.md", {"Node.open(": tour}, shell, {})


def keys_shown(shown: str) -> list[str]:
    """The keys a page's abbreviated JSON object shows at its own level (``{"a":1,"b":{"c":2,...},...}``)."""
    return re.findall(r'(?:^\{|,)"(\w+)":', shown)


def test_operations_page(tmp_path: Path) -> None:
    """docs/operations.md: ``cdcd wal dump … --from 3:40 | head -1`` on a node with five segments prints the record
    at 3:40 with the fields the page shows, in its order."""
    shell = Shell(scratch_dir(tmp_path / "work"), {})
    node = Node.open(shell.cwd / "var" / "node1")
    try:
        for n in range(5):
            node.cache("orders").put_all({f"o-{n}-{i}": {"id": i, "qty": n} for i in range(3)})
            node.force_archive()
    finally:
        node.close()

    def wal_dump(runs: list[tuple[str, list[str], subprocess.CompletedProcess[str]]]) -> None:
        ((_, (shown,), res),) = runs
        (line,) = res.stdout.splitlines()
        record = json.loads(line)
        assert (record["pos"], record["segment"], record["offset"], record["type"]) == ("3:40", 3, 40, "DataRecord")
        head, entry = shown.split('"entries":[')
        assert list(record) == [*keys_shown(head), "entries"], (record, shown)
        assert list(record["entries"][0]) == keys_shown("," + entry.removeprefix("{")), (record, shown)
        assert [e["key"] for e in record["entries"]] == [f"o-3-{i}" for i in range(3)]

    run_page("operations.md", {"cdcd wal dump": wal_dump}, shell, {})


SPARK_KAFKA_JARS = ROOT / "var" / "kafka" / "spark-jars"
KAFKA_READER = """
import json, sys
from pathlib import Path
from pyspark.sql import SparkSession
from tests.support.docs import DOCS, fenced_blocks, run_python
page, line, placeholders, jars, out = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4], sys.argv[5]
spark = (
    SparkSession.builder.master("local[1]").appName("cdcd-docs-kafka")
    .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
    .config("spark.jars", jars).config("spark.sql.shuffle.partitions", "2").getOrCreate()
)
try:
    (block,) = [b for b in fenced_blocks(DOCS / page) if b.line == line]
    namespace = {"spark": spark}
    run_python(block, namespace, placeholders)
    df = namespace["df"]
    query = df.writeStream.format("memory").queryName("envelopes").trigger(availableNow=True).start()
    assert query.awaitTermination(600)
    assert query.exception() is None
    rows = [r.asDict(recursive=True) for r in spark.sql("SELECT * FROM envelopes").collect()]
finally:
    spark.stop()
Path(out).write_text(json.dumps({"streaming": df.isStreaming, "rows": rows}))
"""
"""docs/kafka.md's Spark block in a session of its own: the Kafka source must be on the driver's classpath when it
starts (``spark.jars``), which the worker's ``spark`` is not."""


def test_kafka_page(tmp_path: Path) -> None:
    """docs/kafka.md: the broker's start and stop lines run a broker that serves and is then gone; against it,
    between the two, ``cdcd run`` sends two orders with ``topic_prefix = "shop"`` and the page's Spark block reads
    exactly them back, every envelope field it names parsed (op, the after image, source cache and position)."""
    from confluent_kafka.admin import AdminClient

    if not SPARK_KAFKA_JARS.is_dir():
        pytest.fail(f"{SPARK_KAFKA_JARS} missing: run `make install` first")
    port = free_ports(2)  # kafka.sh's controller listens on the next one
    placeholders = {"--port 9092": f"--port {port}", "kafka1:9092": f"127.0.0.1:{port}"}
    shell = Shell(scratch_dir(tmp_path / "work"), placeholders)
    batch = small_batch(shell.cwd / "var" / "node1")
    deferred: list[Block] = []
    read: list[dict[str, Any]] = []

    def defer(block: Block, namespace: dict[str, Any], placeholders: dict[str, str]) -> list[Cell]:
        deferred.append(block)  # run below, once the page's own broker serves
        return []

    def envelope_block(cells: list[Cell]) -> None:
        assert deferred and not read

    def send_and_read() -> None:
        config = write_config(
            shell.cwd / "kafka.toml",
            shell.cwd / "var" / "node1",
            {"kind": "kafka", "bootstrap_servers": f"127.0.0.1:{port}", "topic_prefix": "shop", "topic_partitions": 1},
        )
        run_to_end(config, shell.cwd / "var" / "node1", shell.cwd / "daemon.err")
        (block,) = deferred
        out = shell.cwd / "read.json"
        args = [
            block.page,
            str(block.line),
            json.dumps(placeholders),
            ",".join(map(str, sorted(SPARK_KAFKA_JARS.glob("*.jar")))),
        ]
        res = subprocess.run(
            [sys.executable, "-c", KAFKA_READER, *args, str(out)],
            capture_output=True,
            text=True,
            env=child_env(),
            timeout=COMMAND_TIMEOUT_S,
        )
        assert res.returncode == 0, res.stderr[-3000:]
        result = json.loads(out.read_text())
        assert result["streaming"] is True
        read.extend(result["rows"])

    def after(command: str, res: subprocess.CompletedProcess[str]) -> None:
        if " start " in command:
            topics = AdminClient({"bootstrap.servers": f"127.0.0.1:{port}"}).list_topics(timeout=30)
            assert topics.brokers, "the broker started by the page answers no metadata request"
            send_and_read()
        else:
            assert not port_open(port), "the broker still listens after the page's stop"

    def broker_lines(runs: list[tuple[str, list[str], subprocess.CompletedProcess[str]]]) -> None:
        assert [c.split()[1] for c, _, _ in runs] == ["start", "stop"] and read

    shell.after = after
    checks: dict[str, Check] = {"ENVELOPE = (": envelope_block, "scripts/kafka.sh start": broker_lines}
    try:
        run_page("kafka.md", checks, shell, {}, python=defer)
    finally:
        subprocess.run(["bash", "scripts/kafka.sh", "stop", "--dir", "var/kafka/b1", "--kill"], cwd=shell.cwd)
    sent = {json.dumps({"key": ev.key, **ev.value}, sort_keys=True): ev for ev in batch}
    assert len(read) == len(sent), read
    for row in read:
        ev = sent.pop(json.dumps(json.loads(row["after"]), sort_keys=True))  # the after image: key and value
        assert (row["op"], row["before"], row["source"]["cache"]) == ("c", None, "orders"), row
        source = row["source"]
        assert (source["segment"], source["offset"], source["entry_index"]) == tuple(msgspec.to_builtins(ev.position))


def port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


# --- configs --------------------------------------------------------------------------------------------------
CONFIGS: dict[tuple[str, str], tuple[str, dict[str, Any]]] = {
    ("cluster.md", "# cdcd.toml of each node's daemon"): ("daemon", {"node_dir": "NODE"}),
    ("daemon.md", 'dead_letters = "on"'): ("daemon", {"node_dir": "NODE", "consumer": {"kind": "jsonl", "path": "x"}}),
    ("daemon.md", 'caches = ["orders*", "people"]'): ("daemon", {"node_dir": "NODE"}),
    ("daemon.md", "[consumers.lake]"): ("daemon", {}),
    ("kafka.md", 'kind = "kafka"'): ("daemon", {"node_dir": "NODE"}),
    ("kafka.md", "# /etc/cdcd/dc2/kafka-to-node.toml"): ("kafka-to-node", {}),
    ("lake.md", "batch_max_events = 500000"): ("daemon", {"node_dir": "NODE"}),
    ("lake.md", "[consumer.tables.orders]"): (
        "daemon",
        {"node_dir": "NODE", "consumer": {"kind": "lake", "lake_path": "LAKE"}},
    ),
    ("realtime.md", "# node.toml"): ("node", {"node_dir": "NODE"}),
}
"""Each ```toml block of docs/ (by a marker): the file it is a part of (``daemon``: a ``cdcd run`` config,
``node``: a ``cdcd node run`` config, ``kafka-to-node``: that command's file) and the keys a fragment leaves to
the rest of its file, added where the block does not set them (``NODE``, ``LAKE``: directories of the test)."""


def completed(block: dict[str, Any], rest: dict[str, Any], tmp: Path) -> dict[str, Any]:
    """``block`` with ``rest``'s keys where it has none (tables merged key by key)."""
    out = dict(block)
    for key, value in rest.items():
        if isinstance(value, dict):
            out[key] = completed(out.get(key, {}), value, tmp)
        elif key not in out:
            out[key] = str(tmp / value.lower()) if value in ("NODE", "LAKE") else value
    return out


def toml_text(data: dict[str, Any], prefix: str = "") -> str:
    """``data`` as TOML: scalars and lists of scalars as JSON (TOML's basic strings escape as JSON does), each
    table under its full dotted name."""
    lines = [f"[{prefix}]"] if prefix else []
    lines += [f"{json.dumps(k)} = {json.dumps(v)}" for k, v in data.items() if not isinstance(v, dict)]
    text = "\n".join(lines) + "\n"
    for key, value in data.items():
        if isinstance(value, dict):
            text += toml_text(value, f"{prefix}.{json.dumps(key)}" if prefix else json.dumps(key))
    return text


CONSUMER_CLASSES = {"lake": "LakeConsumer", "jsonl": "JsonlConsumer", "kafka": "KafkaSink"}


def values_of(loaded: Any, key: str) -> list[Any]:
    """Every value of ``key`` in a loaded config, at any depth (a loader may keep some keys in a part of its own)."""
    if isinstance(loaded, dict):
        return [v for k, v in loaded.items() if k == key] + [x for v in loaded.values() for x in values_of(v, key)]
    if isinstance(loaded, list):
        return [x for v in loaded for x in values_of(v, key)]
    return []


def test_every_config_block_loads(tmp_path: Path) -> None:
    """Each ```toml block of docs/ is a config that loads with the loader cdcd reads its file with (completed with
    what a fragment leaves to the rest of its file), its consumer tables build their consumer, declared tables read
    back as declared, and the loaded values are the block's."""
    from cdcd.config import load_toml
    from cdcd.daemon.config import load_daemon_config
    from cdcd.kafka.options import KafkaToNodeOptions
    from cdcd.lake.typed.declared import load_declared
    from cdcd.node.config import NodeConfig
    from cdcd.sinks import load_consumer

    blocks = [b for p in doc_pages() for b in fenced_blocks(p) if b.lang == "toml"]
    assert len(blocks) >= len(CONFIGS)
    used = set()
    for n, block in enumerate(blocks):
        keys = [k for k in CONFIGS if k[0] == block.page and k[1] in block.text]
        assert len(keys) == 1, f"{block}: a toml block that is not in CONFIGS (or in more than one entry)"
        used.add(keys[0])
        kind, rest = CONFIGS[keys[0]]
        data = tomllib.loads(block.text)
        full = completed(data, rest, tmp_path)
        path = tmp_path / f"{n}-{block.page}.toml"
        path.write_text(toml_text(full))
        assert tomllib.loads(path.read_text()) == full
        if kind == "daemon":
            config = load_daemon_config(path, environ={})
            loaded = msgspec.to_builtins(config)
            consumers = list(config.named_consumers().values())
            assert len(consumers) == ("consumer" in full) + len(full.get("consumers", {}))
            if "tables" in full.get("consumer", {}):
                declared = {name: t.columns for name, t in load_declared(path).items()}
                assert declared == {name: t["columns"] for name, t in full["consumer"]["tables"].items()}
        elif kind == "node":
            loaded = msgspec.to_builtins(load_toml(path, NodeConfig))
            consumers = [full["realtime_consumer"]]
        else:
            loaded = msgspec.to_builtins(KafkaToNodeOptions.load(full, str(path)))
            consumers = []
        for key, value in data.items():
            if not isinstance(value, dict):
                got = values_of(loaded, key)
                assert value in got, f"{block}: {key} = {value!r} loads as {got!r}"
        for table in consumers:
            consumer = load_consumer(table, f"{block}").consumer
            assert type(consumer).__name__ == CONSUMER_CLASSES[table["kind"]], consumer
    assert used == set(CONFIGS), f"CONFIGS entries without a block: {set(CONFIGS) - used}"


PAGE_TESTS = {
    "lake.md": test_lake_page,
    "daemon.md": test_daemon_page,
    "node.md": test_node_page,
    "operations.md": test_operations_page,
    "kafka.md": test_kafka_page,
}
