"""``cdcd lake``: the Delta lake's maintenance and checks."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import msgspec

from cdcd.cli.exits import fail, fail_on
from cdcd.cli.process import log_to_stderr
from cdcd.faults import ExitCode

_Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


@click.group()
def lake() -> None:
    """The Delta lake: <lake>/changes (every change) and <lake>/state (latest per key)."""


def _spark(master: str, app: str, lake_root: Any = None) -> Any:
    from cdcd.lake import spark as spark_session
    from cdcd.lake.storage import ObjectPath

    log_to_stderr()
    conf = lake_root.location.spark_conf if isinstance(lake_root, ObjectPath) else {}
    try:
        return spark_session.acquire(master, app, conf)
    except spark_session.DeltaJarsMissing as exc:
        fail_on(exc)


def _config_storage(path: str) -> dict[str, Any]:
    """``[consumer.storage]`` of a daemon config, read as the daemon reads it (``CDCD_*`` overrides
    included)."""
    from cdcd.config import convert
    from cdcd.daemon.config import load_daemon_config
    from cdcd.lake.storage import StorageOptions

    try:
        config = load_daemon_config(path)
        storage = convert(config.consumer.get("storage", {}), StorageOptions, f"{path}: consumer.storage")
    except Exception as exc:
        fail_on(exc)
    return {name: getattr(storage, name) for name in StorageOptions.__struct_fields__}


def _lake_root(ctx: click.Context, _param: click.Parameter, value: str) -> Any:
    """``--lake`` (a directory or an object-store URL) with the ``--storage-*`` settings: the lake's root."""
    from cdcd.config import convert
    from cdcd.lake.storage import LakeLocation, StorageOptions

    config = ctx.meta.get("cdcd_storage_config")
    settings = _config_storage(config) if config is not None else {}
    settings.update({k: v for k, v in ctx.meta.get("cdcd_storage", {}).items() if v})
    where = f" ({config} [consumer.storage])" if config is not None else ""
    try:
        location = LakeLocation(value, convert(settings, StorageOptions, "--storage-*"))
        if location.is_local:
            if not Path(value.removeprefix("file://")).exists():
                raise click.BadParameter(f"directory {value!r} does not exist")
        else:
            location.check()
    except click.BadParameter:
        raise
    except Exception as exc:
        fail_on(exc, f"--lake {value}{where}")
    return location.root()


def _storage_meta(name: str) -> Callable[[click.Context, click.Parameter, Any], None]:
    def store(ctx: click.Context, _param: click.Parameter, value: Any) -> None:
        if name == "config":
            ctx.meta["cdcd_storage_config"] = value
        else:
            ctx.meta.setdefault("cdcd_storage", {})[name] = value

    return store


def _lake_option() -> _Decorator:
    def wrap(f: Callable[..., Any]) -> Callable[..., Any]:
        f = click.option(
            "--lake",
            "lake_path",
            required=True,
            callback=_lake_root,
            help="The lake: a directory, or s3://bucket/prefix (also abfss://, gs://).",
        )(f)
        extra = [
            ("--storage-config", "config", "A daemon config file whose [consumer.storage] reaches the store."),
            ("--storage-endpoint", "endpoint", "S3 compatibles: the endpoint URL (else AWS_ENDPOINT_URL)."),
            ("--storage-region", "region", "The store's region (else AWS_REGION)."),
        ]
        for flag, name, text in extra:
            f = click.option(flag, is_eager=True, expose_value=False, callback=_storage_meta(name), help=text)(f)
        return click.option(
            "--storage-path-style",
            is_flag=True,
            is_eager=True,
            expose_value=False,
            callback=_storage_meta("path_style"),
            help="Address buckets as endpoint/bucket (MinIO and most S3 compatibles).",
        )(f)

    return wrap


def _file_rows_option() -> _Decorator:
    return click.option(
        "--file-rows",
        type=click.IntRange(min=1),
        default=None,
        help="Rows per key-range clustered file of state and the typed tables: the daemon's compact_file_rows "
        "[default: 65536].",
    )


def _master_option() -> _Decorator:
    return click.option("--spark-master", default="local[*]", show_default=True, help="Spark master URL.")


def _require_lake(lake_path: Any) -> None:
    """``--lake`` names a lake (one of its Delta tables is there), else one line naming the path as no
    lake, with where the lake is when it is close by (``--lake var`` for ``var/lake``): exit 2."""
    from cdcd.lake.reading.readers import not_a_lake

    try:
        missing = not_a_lake(lake_path)
    except OSError as exc:  # e.g. a directory this user may not read: the OS error's own line
        fail_on(exc, f"--lake {lake_path}")
    if missing is not None:
        fail_on(missing)


def _require_changes(lake_path: Path) -> None:
    """A cdcd lake whose logs check out (``lake check`` without reading data files), else one line:
    exit 2 for no lake, 8 for a damaged one."""
    from cdcd.lake.maintenance.compact import table_version
    from cdcd.lake.reading.check import require_sound
    from cdcd.lake.table import CHANGES

    if not (lake_path / CHANGES).exists():
        _require_lake(lake_path)
    if not (lake_path / CHANGES / "_delta_log").exists():
        fail(f"{lake_path / CHANGES}: not a Delta table (no _delta_log/): not a cdcd lake", ExitCode.BAD_INPUT)
    try:
        require_sound(lake_path)
        version = table_version(lake_path / CHANGES)
    except Exception as exc:
        fail_on(exc)
    if version is None:
        fail(f"{lake_path / CHANGES}: not a Delta table (no _delta_log/): not a cdcd lake", ExitCode.BAD_INPUT)


@lake.command("compact")
@_lake_option()
@click.option(
    "--engine",
    type=click.Choice(["auto", "spark", "deltalake"]),
    default="auto",
    show_default=True,
    help="Who MERGEs: Spark, or delta-rs in this process (no JVM). auto: Spark when --spark-master is given.",
)
@click.option("--spark-master", default=None, help="Spark master URL (with --engine spark: default local[*]).")
@click.option(
    "--tables-config",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Declared column types: a daemon config's [consumer.tables.*] or a file of [tables.*] tables.",
)
@_file_rows_option()
def lake_compact(
    lake_path: Path, engine: str, spark_master: str | None, tables_config: Path | None, file_rows: int | None
) -> None:
    """MERGE the changes committed since the last compaction into <lake>/state and the typed table of
    each cache, <lake>/tables/<cache> (latest per key by version, then WAL position; deletes applied;
    idempotent), and record the cut they make together. Either engine writes the same tables."""
    from deltalake.exceptions import DeltaError

    from cdcd.lake import spark as spark_session
    from cdcd.lake.maintenance.clustered import FILE_ROWS
    from cdcd.lake.maintenance.compact import compact, compact_engine, compacted_version
    from cdcd.lake.maintenance.log_cleanup import clean_logs
    from cdcd.lake.reading.report import compact_summary
    from cdcd.lake.typed.declared import DeclaredSchemaError, load_declared
    from cdcd.lake.typed.layout import NotATypedTable, list_tables
    from cdcd.logging import describe

    try:
        use_spark = compact_engine(engine, spark_master, spark_writer=False) == "spark"
    except ValueError as exc:
        fail(f"--engine {engine}: {exc}", ExitCode.BAD_INPUT)
    _require_changes(lake_path)
    try:
        declared = load_declared(tables_config) if tables_config is not None else {}
        list_tables(lake_path)
    except (DeclaredSchemaError, NotATypedTable) as exc:
        fail(str(exc), ExitCode.BAD_INPUT)
    if not use_spark:
        log_to_stderr()
        rows = FILE_ROWS if file_rows is None else file_rows
        result = compact(None, lake_path, tables=declared, file_rows=rows)
    else:
        spark = _spark(spark_master or "local[*]", "cdcd-lake-compact", lake_path)
        try:
            result = compact(spark, lake_path, tables=declared, file_rows=FILE_ROWS if file_rows is None else file_rows)
        finally:
            spark_session.release()
    # As the sink's maintainer does after each compaction: where compaction runs from a timer, nothing else
    # deletes the old log files of changes and of the typed tables (Delta's own cleanup is off on them).
    try:
        clean_logs(lake_path, compacted_version(lake_path))
    except (DeltaError, OSError, ValueError) as exc:  # the log stays longer; the next run tries again
        click.echo(f"cdcd: warning: old log files not cleaned: {describe(exc)}", err=True)
    click.echo(compact_summary(result))


@lake.command("optimize")
@_lake_option()
@_master_option()
@_file_rows_option()
def lake_optimize(lake_path: Path, spark_master: str, file_rows: int | None) -> None:
    """Bin-pack the small files of changes (Delta OPTIMIZE) and merge the overlapping files of state and the
    typed tables into key-range sorted runs (no data changes)."""
    from cdcd.lake import spark as spark_session
    from cdcd.lake.maintenance.ops import optimize
    from cdcd.lake.reading.report import optimize_line

    _require_changes(lake_path)
    spark = _spark(spark_master, "cdcd-lake-optimize", lake_path)
    try:
        done = optimize(spark, lake_path, file_rows)
    finally:
        spark_session.release()
    for name, m in done.items():
        click.echo(optimize_line(name, m))


@lake.command("vacuum")
@_lake_option()
@click.option(
    "--retain-hours",
    type=click.FloatRange(min=0),
    default=168.0,
    show_default=True,
    help="Keep files any snapshot of the last N hours needs (time travel and readers in flight).",
)
@click.option("--force", is_flag=True, help="Allow --retain-hours below Delta's default of 168 h.")
@_master_option()
def lake_vacuum(lake_path: Path, retain_hours: float, force: bool, spark_master: str) -> None:
    """Delete data files no longer needed: replaced by OPTIMIZE or compaction longer ago than
    --retain-hours, and orphans of writes that never committed. Refused while older changes wait
    for compaction, and below Delta's default retention (168 h) without --force. No JVM: --spark-master
    is accepted and not used."""
    from cdcd.lake.maintenance.ops import DEFAULT_RETAIN_HOURS, VacuumRefused, check_vacuum
    from cdcd.lake.maintenance.vacuum_rs import vacuum
    from cdcd.lake.reading.report import retention_check_off, vacuum_line

    _require_changes(lake_path)
    try:
        check_vacuum(lake_path, retain_hours, force=force)  # refused: one line, nothing said about --force
        if retain_hours < DEFAULT_RETAIN_HOURS:
            click.echo(retention_check_off(retain_hours), err=True)
        done = vacuum(lake_path, retain_hours, force=force)
    except VacuumRefused as exc:
        fail_on(exc)
    for name, table in done.items():
        click.echo(vacuum_line(name, table, retain_hours))


@lake.command("verify")
@_lake_option()
@click.option(
    "--node-dir",
    "node_dirs",
    required=True,
    multiple=True,
    type=click.Path(path_type=Path, exists=True),
    help="A node whose data lands in the lake (stopped); repeat for several.",
)
def lake_verify(lake_path: Path, node_dirs: tuple[Path, ...]) -> None:
    """Compare <lake>/state with the nodes' data (rows and an order-independent checksum per cache).
    The nodes must be stopped; exit 2 when state is behind changes (compact first), 1 on a mismatch."""
    from contextlib import ExitStack

    from cdcd.lake.maintenance.compact import state_lag
    from cdcd.lake.reading.report import print_verify, verify_summary
    from cdcd.lake.reading.verify import verify
    from cdcd.node.node import NodeLocked
    from cdcd.node.snapshot import NodeSnapshot

    log_to_stderr(level="warning")
    _require_changes(lake_path)
    end, done, behind = state_lag(lake_path)
    if behind:
        at = "never compacted" if done < 0 else f"at changes version {done}"
        fail(
            f"{lake_path}: state is behind changes ({at}, changes at version {end}): "
            f"compact first (`cdcd lake compact --lake {lake_path}`)",
            ExitCode.BAD_INPUT,
        )
    with ExitStack() as stack:
        snapshots = []
        for node_dir in node_dirs:
            try:
                snapshots.append(stack.enter_context(NodeSnapshot(node_dir)))  # read-only
            except NodeLocked as exc:
                fail_on(exc, hint="stop the node first")
        checks = verify(lake_path, snapshots)
    print_verify(checks)
    click.echo(verify_summary(checks))
    # Once in a CI run the interpreter's shutdown aborted (SIGABRT, "terminate called without an
    # active exception") after this result was printed: Arrow's and delta-rs' native thread pools
    # can be torn down while a worker is still joinable (apache/arrow#34314, delta-io/delta-rs#2184).
    # The result and its exit code are what matter, so leave without that shutdown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if all(c.ok for c in checks) else 1)


@lake.command("check")
@_lake_option()
@click.option("--no-read", is_flag=True, help="Do not open the data files (only that they exist).")
def lake_check(lake_path: Any, no_read: bool) -> None:
    """Check the lake's Delta logs and files (changes, state, _cuts and every typed table): every
    commit file parses, no version is missing, checkpoints match the log, every file the log names
    exists with the size the log records and reads. One line per fault naming the file and what to
    do; exit 8 on any fault."""
    from cdcd.lake.reading.check import check_lake, report_lines

    log_to_stderr(level="warning")
    _require_lake(lake_path)
    checks = check_lake(lake_path, read_files=not no_read, every_table=True)
    if not checks:
        fail(f"{lake_path}: no Delta table to check", ExitCode.BAD_INPUT)
    for line in report_lines(checks):
        click.echo(line)
    if any(t.faults for t in checks):
        sys.exit(ExitCode.DAMAGED_LAKE)


@lake.command("cut")
@_lake_option()
@click.option("--latest", "latest", is_flag=True, default=True, help="The newest cut (the default).")
@click.option("--as-of", "as_of", default=None, metavar="TIME", help="The newest cut at or before TIME (ISO 8601).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def lake_cut(lake_path: Any, latest: bool, as_of: str | None, as_json: bool) -> None:
    """A consistent cut across the cache tables: the changes version it was compacted from, each
    table's version and each source's WAL position. Exit 1 when there is none."""
    from cdcd.lake.cuts import cut_command

    log_to_stderr(level="warning")
    _require_lake(lake_path)
    text, code = cut_command(lake_path, as_of=as_of, as_json=as_json)
    if code:
        fail(text, code)
    click.echo(text)


@lake.command("sql")
@_lake_option()
@click.argument("query")
@click.option(
    "--engine", type=click.Choice(["duckdb", "spark"]), default="duckdb", show_default=True, help="Who runs it."
)
@click.option(
    "--format", "fmt", type=click.Choice(["table", "csv", "json"]), default="table", show_default=True, help="Output."
)
@click.option("--as-of", "as_of", default=None, metavar="TIME", help="Read at the newest cut at or before TIME.")
@click.option("--max-rows", type=click.IntRange(1), default=None, help="Rows the table format shows at most.")
@click.option("--spark-master", default="local[*]", show_default=True, help="With --engine spark.")
def lake_sql(  # noqa: PLR0917 (click passes every option by keyword)
    lake_path: Any, query: str, engine: str, fmt: str, as_of: str | None, max_rows: int | None, spark_master: str
) -> None:
    """Run QUERY over the cache tables, each a view under its cache name (docs/lake.md, view names),
    read at the latest cut: DuckDB by default (no JVM), or Spark. Only a query runs (SELECT, WITH,
    EXPLAIN, DESCRIBE, SHOW): anything else is refused, exit 2; a failed query is one line, exit 1;
    nothing is printed before the whole result is there."""
    import io

    from cdcd.lake.reading.sql import MAX_TABLE_ROWS, run_sql

    log_to_stderr(level="warning")
    if engine == "spark":
        _quiet_spark_query_errors()
    err = io.StringIO()
    code = run_sql(
        lake_path,
        query,
        sys.stdout,
        err,
        engine=engine,
        fmt=fmt,
        as_of=as_of,
        max_rows=max_rows or MAX_TABLE_ROWS,
        spark_master=spark_master,
    )
    sys.stdout.flush()
    if code:
        fail(err.getvalue().strip() or f"lake sql exited {code}", code)
    sys.exit(code)


def _quiet_spark_query_errors() -> None:
    """pyspark logs a failed query's error with its stack as a JSON line of its own, beside the one
    line ``lake sql`` ends with: only that line is printed."""
    import logging

    from pyspark.logger import PySparkLogger

    for name in ("SQLQueryContextLogger", "DataFrameQueryContextLogger"):
        PySparkLogger.getLogger(name).setLevel(logging.CRITICAL + 1)


@lake.command("show")
@_lake_option()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def lake_show(lake_path: Path, as_json: bool) -> None:
    """From the Delta logs: table versions, last commit, application transactions (per source, and
    compaction's), rows per cache in changes and state, whether state is behind; each typed table's
    version, rows, rescued rows and columns with when each appeared."""
    from cdcd.lake.maintenance.ops import show
    from cdcd.lake.reading.report import print_show
    from cdcd.lake.typed.show import print_tables, tables_json, tables_show

    _require_lake(lake_path)
    try:
        info = show(lake_path)
        tables = tables_show(lake_path)
    except Exception as exc:
        fail_on(exc)
    if as_json:
        click.echo(msgspec.json.encode({**msgspec.to_builtins(info), "typed_tables": tables_json(tables)}).decode())
    else:
        print_show(info)
        print_tables(tables)


@lake.command("history")
@_lake_option()
@click.option(
    "--table",
    default="changes",
    show_default=True,
    metavar="TABLE",
    help="changes, state, _cuts, or a typed table by its cache's name (orders, tables/orders) or view name.",
)
@click.option("--limit", type=click.IntRange(min=1), default=20, show_default=True, help="Newest N commits.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def lake_history(lake_path: Path, table: str, limit: int, as_json: bool) -> None:
    """A table's commits, newest first (Delta's history): version, time, operation, rows, writer."""
    from cdcd.lake.maintenance.ops import find_table, table_history
    from cdcd.lake.reading.report import print_history

    _require_lake(lake_path)
    try:
        named = find_table(lake_path, table)
        rows = table_history(named.path, limit)
    except Exception as exc:
        fail_on(exc)
    if as_json:
        click.echo(msgspec.json.encode(rows).decode())
    else:
        print_history(named.name, rows)
