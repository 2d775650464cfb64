"""The lake on an object store: settings, reachability errors and racing commits, against a real
MinIO server on loopback (built by scripts/ensure-minio.sh)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from cdcd.lake.storage import LakeLocation, LakeStorageError, StorageOptions
from cdcd.secrets import MASK
from tests.support.ports import free_port
from tests.support.servers import MINIO_BIN, MINIO_PASSWORD, MINIO_USER, MinioServer

pytestmark = pytest.mark.skipif(not MINIO_BIN.exists(), reason="MinIO not built: run make install")


@pytest.fixture(scope="module")
def minio(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MinioServer]:
    server = MinioServer(tmp_path_factory.mktemp("minio") / "data")
    server.start()
    server.create_bucket("lake")
    try:
        yield server
    finally:
        server.stop()


def storage(server: MinioServer, **over: object) -> StorageOptions:
    base: dict[str, object] = {
        "endpoint": server.endpoint,
        "path_style": True,
        "access_key_id": MINIO_USER,
        "secret_access_key": MINIO_PASSWORD,
    }
    base.update(over)
    return StorageOptions(**base)  # type: ignore[arg-type]


def test_local_paths_and_urls() -> None:
    loc = LakeLocation("relative/lake")
    assert loc.is_local and loc.uri("changes") == str(Path("relative/lake/changes").absolute())
    assert loc.spark_uri("state").startswith("file:///")
    s3 = LakeLocation("s3://bucket/a/b", StorageOptions(region="eu-west-1"), env={})
    assert s3.uri("changes") == "s3://bucket/a/b/changes"
    assert s3.spark_uri("changes") == "s3a://bucket/a/b/changes"
    assert s3.delta_options["aws_conditional_put"] == "etag"
    assert LakeLocation("s3a://bucket", env={}).uri("state") == "s3://bucket/state"
    with pytest.raises(LakeStorageError, match="unknown scheme 'ftp'"):
        LakeLocation("ftp://host/x")
    with pytest.raises(LakeStorageError, match="no bucket"):
        LakeLocation("s3:///x", env={})


def test_secrets_never_shown() -> None:
    loc = LakeLocation(
        "s3://bucket/p", StorageOptions(access_key_id="AKIDEXAMPLE", secret_access_key="s3cr3t-value"), env={}
    )
    shown = f"{loc} {loc!r} {loc.masked()}"
    assert "s3cr3t-value" not in shown
    assert loc.masked()["options"]["AWS_SECRET_ACCESS_KEY"] == MASK
    assert loc.spark_conf["spark.hadoop.fs.s3a.secret.key"] == "s3cr3t-value"


def test_credentials_from_env_and_file(tmp_path: Path) -> None:
    env = {"AWS_ACCESS_KEY_ID": "id-env", "AWS_SECRET_ACCESS_KEY": "secret-env", "AWS_REGION": "eu-north-1"}
    loc = LakeLocation("s3://b", env=env)
    assert loc.delta_options["AWS_ACCESS_KEY_ID"] == "id-env"
    assert loc.delta_options["AWS_REGION"] == "eu-north-1"
    creds = tmp_path / "credentials"
    creds.write_text(
        "[default]\naws_access_key_id = id-d\naws_secret_access_key = s-d\n"
        "[ci]\naws_access_key_id = id-ci\naws_secret_access_key = s-ci\naws_session_token = t\n"
    )
    loc = LakeLocation("s3://b", StorageOptions(credentials_file=str(creds), profile="ci"), env={})
    assert loc.delta_options["AWS_SESSION_TOKEN"] == "t"
    assert loc.spark_conf["spark.hadoop.fs.s3a.aws.credentials.provider"].endswith("TemporaryAWSCredentialsProvider")
    with pytest.raises(LakeStorageError, match=r"no profile \[nope\]"):
        LakeLocation("s3://b", StorageOptions(credentials_file=str(creds), profile="nope"), env={})
    with pytest.raises(LakeStorageError, match="not found"):
        LakeLocation("s3://b", StorageOptions(credentials_file=str(tmp_path / "missing")), env={})


def test_check_names_what_is_wrong(minio: MinioServer) -> None:
    LakeLocation("s3://lake/ok", storage(minio), env={}).check()
    with pytest.raises(LakeStorageError, match=r"s3://no-such-bucket .*no such bucket"):
        LakeLocation("s3://no-such-bucket/x", storage(minio), env={}).check()
    with pytest.raises(LakeStorageError, match=r"credentials refused|access denied") as info:
        LakeLocation("s3://lake/x", storage(minio, secret_access_key="wrong-secret"), env={}).check()
    assert "wrong-secret" not in str(info.value)
    dead = StorageOptions(
        endpoint=f"http://127.0.0.1:{free_port()}", path_style=True, access_key_id="a", secret_access_key="b"
    )
    with pytest.raises(LakeStorageError, match="unreachable"):
        LakeLocation("s3://lake/x", dead, env={}).check(timeout_s=3)


RACER = textwrap.dedent(
    """
    import sys, json
    import pyarrow as pa
    from deltalake import write_deltalake
    uri, opts, who, n = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    for i in range(n):
        write_deltalake(uri, pa.table({"who": [who], "i": [i]}), mode="append", storage_options=opts)
    """
)


def test_racing_commits_never_share_a_version(minio: MinioServer, tmp_path: Path) -> None:
    """Four processes appending to one table on the object store: every commit lands, each in a
    table version of its own (conditional put; no lock service)."""
    import json

    loc = LakeLocation("s3://lake/race", storage(minio), env={})
    uri, opts = loc.uri("t"), loc.delta_options
    write_deltalake(
        uri, pa.table({"who": pa.array([], pa.string()), "i": pa.array([], pa.int64())}), storage_options=opts
    )
    n, writers = 20, "abcd"
    procs = [subprocess.Popen([sys.executable, "-c", RACER, uri, json.dumps(opts), who, str(n)]) for who in writers]
    for p in procs:
        assert p.wait(300) == 0
    dt = DeltaTable(uri, storage_options=opts)
    rows = dt.to_pyarrow_table().to_pylist()
    assert sorted((r["who"], r["i"]) for r in rows) == sorted((w, i) for w in writers for i in range(n))
    history = dt.history()
    assert dt.version() == len(writers) * n  # version 0 created the table; each append took a version of its own
    assert len({h["version"] for h in history}) == len(history) == len(writers) * n + 1


def test_the_scheduled_vacuum_on_the_store(minio: MinioServer) -> None:
    """delta-rs's full vacuum lists and judges the store's objects with the lake's storage settings; a file replaced
    a moment ago stays (the retention is at least an hour), and sizes are read from the store, a missing object
    skipped."""
    from cdcd.lake.maintenance.vacuum_rs import Swept, existing_sizes, sweep_table
    from cdcd.lake.storage import open_delta

    loc = LakeLocation("s3://lake/vacuum", storage(minio), env={})
    uri, opts = loc.uri("t"), loc.delta_options
    write_deltalake(uri, pa.table({"i": [1, 2]}), storage_options=opts)
    first = {
        a["path"]: a["size_bytes"]
        for a in pa.table(DeltaTable(uri, storage_options=opts).get_add_actions(flatten=True)).to_pylist()
    }
    write_deltalake(uri, pa.table({"i": [3]}), mode="overwrite", storage_options=opts)  # the first file replaced
    table = loc.root() / "t"
    assert sweep_table(open_delta(table), table, 1) == Swept(0, 0, 1)
    ((rel, size),) = first.items()
    assert existing_sizes(table, [rel, "part-missing.parquet"]) == {rel: size}
    assert DeltaTable(uri, storage_options=opts).to_pyarrow_table().column("i").to_pylist() == [3]
