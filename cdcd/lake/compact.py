"""``cdcd lake compact``: fold the change log into current-state tables, incrementally.

``<lake>/state/cache=<name>`` is a symlink to ``state/_versions/cache=<name>/<n>``; a compaction writes
version n+1 from the previous state plus the change files committed since, then swaps the link
atomically, so readers always see one complete version.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import msgspec
import structlog

from cdcd.durable import write_atomic
from cdcd.lake.log import CHANGES_DIR, LakeLog
from cdcd.lake.parquet import escape_partition

log = structlog.get_logger("cdcd.lake")

STATE_DIR = "state"
COMPACT_META_DIR = "_cdcd_compact"
STATE_COLUMNS = ["key", "value", "version_order", "commit_ts", "source_node", "wal_segment", "wal_offset", "wal_index"]


class CompactMeta(msgspec.Struct):
    seq: int = -1
    """Last lake-log entry folded in."""
    version: int = 0
    rows: int = 0


def _meta_path(lake: Path, cache: str) -> Path:
    return lake / COMPACT_META_DIR / f"{cache_dir(cache)}.json"


def read_meta(lake: Path, cache: str) -> CompactMeta:
    path = _meta_path(lake, cache)
    if not path.exists():
        return CompactMeta()
    return msgspec.json.decode(path.read_bytes(), type=CompactMeta)


def _write_meta(lake: Path, cache: str, meta: CompactMeta) -> None:
    path = _meta_path(lake, cache)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, msgspec.json.encode(meta))


def cache_dir(cache: str) -> str:
    """``cache=<name>``, escaped as Spark does: any cache name is one safe path component."""
    return f"cache={escape_partition(cache)}"


def cache_of(component: str) -> str:
    """The cache name of a ``cache=<name>`` path component."""
    return unquote(component.removeprefix("cache="))


def state_path(lake: Path, cache: str) -> Path:
    return lake / STATE_DIR / cache_dir(cache)


def compact(spark: Any, lake: Path, only: str | None = None) -> dict[str, CompactMeta]:
    """Compact every cache (or ``only``); returns the new metadata per compacted cache."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    lake_log = LakeLog(lake, create=False)
    lake_log.refresh()
    by_cache: dict[str, list[tuple[int, str]]] = {}
    for entry in lake_log.entries:
        for rel in entry.files:
            name = cache_of(rel.split("/", 1)[0])
            by_cache.setdefault(name, []).append((entry.seq, rel))
    done: dict[str, CompactMeta] = {}
    for cache, files in sorted(by_cache.items()):
        if only is not None and cache != only:
            continue
        meta = read_meta(lake, cache)
        new = [rel for seq, rel in files if seq > meta.seq]
        if not new:
            continue
        last_seq = max(seq for seq, _ in files)
        changes = spark.read.parquet(*[str(lake / CHANGES_DIR / rel) for rel in new]).select("op", *STATE_COLUMNS)
        current = state_path(lake, cache)
        if current.exists():
            prev = spark.read.parquet(str(current)).select(*STATE_COLUMNS).withColumn("op", F.lit("update"))
            changes = changes.unionByName(prev)
        latest = Window.partitionBy("key").orderBy(
            F.col("version_order").desc(),
            F.col("wal_segment").desc(),
            F.col("wal_offset").desc(),
            F.col("wal_index").desc(),
        )
        state = (
            changes.withColumn("_rank", F.row_number().over(latest))
            .where((F.col("_rank") == 1) & (F.col("op") != "delete"))
            .select(*STATE_COLUMNS)
        )
        version = meta.version + 1
        target = lake / STATE_DIR / "_versions" / cache_dir(cache) / str(version)
        shutil.rmtree(target, ignore_errors=True)
        state.coalesce(max(1, min(8, len(new) // 50 + 1))).write.parquet(str(target))
        rows = spark.read.parquet(str(target)).count()
        link = current
        link.parent.mkdir(parents=True, exist_ok=True)
        tmp_link = link.with_name(f".{link.name}.tmp")
        tmp_link.unlink(missing_ok=True)
        os.symlink(os.path.relpath(target, link.parent), tmp_link)
        os.replace(tmp_link, link)  # the swap readers see atomically
        new_meta = CompactMeta(seq=last_seq, version=version, rows=rows)
        _write_meta(lake, cache, new_meta)
        old = lake / STATE_DIR / "_versions" / cache_dir(cache) / str(version - 2)
        shutil.rmtree(old, ignore_errors=True)  # keep one previous version for readers in flight
        log.info("lake_compacted", cache=cache, version=version, rows=rows, new_files=len(new), seq=last_seq)
        done[cache] = new_meta
    return done
