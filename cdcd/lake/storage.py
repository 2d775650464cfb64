"""Where the lake lives: a local directory or an object store, and how each writer reaches it.

``lake_path`` is a directory or a URL: ``s3://bucket/prefix`` (also ``s3a://``; AWS S3 and S3
compatibles such as MinIO, Ceph or R2), ``abfss://container@account.dfs.core.windows.net/prefix``
(Azure Data Lake Storage) or ``gs://bucket/prefix`` (Google Cloud Storage). delta-rs reaches the
store with ``storage_options``; Spark through Hadoop's file systems (``s3a``, ``abfss``, ``gs``),
configured with ``spark.hadoop.*`` settings derived from the same options, so both writers and
every ``cdcd lake`` command see one table.

Credentials come from the ``storage`` table, then the environment (``AWS_ACCESS_KEY_ID`` ...),
then an AWS credentials file (``credentials_file``/``AWS_SHARED_CREDENTIALS_FILE``, profile
``profile``/``AWS_PROFILE``); with none, each library's default chain (instance roles) applies.
Secrets never appear in ``str()``, logs, ``status`` or errors.
"""

from __future__ import annotations

import configparser
import errno
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import msgspec

from cdcd.faults import ExitCode, Fault
from cdcd.secrets import MASK

OBJECT_STORE_SCHEMES = {"s3": "s3", "s3a": "s3", "abfss": "abfss", "abfs": "abfss", "az": "abfss", "gs": "gs"}
"""URL scheme -> the store it names (the key used below)."""

_SPARK_SCHEME = {"s3": "s3a", "abfss": "abfss", "gs": "gs"}


class LakeStorageError(Fault, ValueError):
    """The lake's location or storage settings are wrong, or the store cannot be reached (one line)."""

    exit_code = ExitCode.BAD_INPUT


class StorageOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``[consumer.storage]`` (and ``cdcd lake --storage-*``): how to reach an object store."""

    endpoint: str = ""
    """S3 compatibles: ``http://127.0.0.1:9000``; empty for AWS S3 (or ``AWS_ENDPOINT_URL``)."""
    region: str = ""
    path_style: bool = False
    """Address buckets as ``endpoint/bucket`` (MinIO and most compatibles) instead of ``bucket.endpoint``."""
    access_key_id: str = ""
    secret_access_key: str = ""
    session_token: str = ""
    credentials_file: str = ""
    profile: str = ""
    options: dict[str, str] = {}
    """Passed to delta-rs as they are (``AZURE_STORAGE_ACCOUNT_KEY``, ``GOOGLE_SERVICE_ACCOUNT`` ...)."""
    spark_conf: dict[str, str] = {}
    """Extra Spark settings (``spark.hadoop.fs.azure.account.key...``), given to the session as they are."""


class LakeLocation:
    """A parsed ``lake_path`` plus resolved storage settings."""

    def __init__(self, lake_path: str, storage: StorageOptions | None = None, env: Mapping[str, str] | None = None):
        self.raw = lake_path
        self.storage = storage or StorageOptions()
        self._fs: Any = None
        env = os.environ if env is None else env
        parts = urlsplit(lake_path)
        scheme = parts.scheme.lower()
        if scheme in ("", "file"):
            path = parts.path if scheme == "file" else lake_path
            if not path:
                raise LakeStorageError("lake_path is empty - at `$.lake_path`")
            self.store = "local"
            self.local_path: Path | None = Path(path).absolute()
            self.bucket = ""
            self.prefix = str(self.local_path)
            self._delta_options: dict[str, str] = {}
            self._spark_conf: dict[str, str] = {}
            return
        if scheme not in OBJECT_STORE_SCHEMES:
            known = ", ".join(sorted(OBJECT_STORE_SCHEMES))
            raise LakeStorageError(
                f"lake_path {lake_path!r}: unknown scheme {scheme!r} (known: {known}, or a directory)"
            )
        if not parts.netloc:
            raise LakeStorageError(f"lake_path {lake_path!r}: no bucket or container - at `$.lake_path`")
        self.store = OBJECT_STORE_SCHEMES[scheme]
        self.local_path = None
        self.bucket = parts.netloc
        self.prefix = parts.path.strip("/")
        if self.store == "s3":
            self._delta_options, self._spark_conf = self._s3(env)
        else:
            self._delta_options, self._spark_conf = {}, {}
        self._delta_options.update(self.storage.options)
        self._spark_conf.update(self.storage.spark_conf)

    def __getstate__(self) -> dict[str, Any]:
        # Pickled into Spark tasks (cdcd/lake/landing/spark_write.py): the open client stays behind.
        return {**self.__dict__, "_fs": None}

    # --- what each writer needs --------------------------------------------------------------------
    @property
    def is_local(self) -> bool:
        return self.store == "local"

    def uri(self, table: str = "") -> str:
        """The location for delta-rs, DuckDB and polars (a plain path when local)."""
        if self.local_path is not None:
            return str(self.local_path / table) if table else str(self.local_path)
        scheme = "s3" if self.store == "s3" else self.store
        return self._join(f"{scheme}://{self.bucket}", table)

    def spark_uri(self, table: str = "") -> str:
        """The location for Spark (``s3a://`` for S3)."""
        if self.local_path is not None:
            return (self.local_path / table).as_uri() if table else self.local_path.as_uri()
        return self._join(f"{_SPARK_SCHEME[self.store]}://{self.bucket}", table)

    def _join(self, root: str, table: str) -> str:
        return "/".join(p for p in (root, self.prefix, table) if p)

    @property
    def delta_options(self) -> dict[str, str]:
        """``storage_options`` for delta-rs (secrets included: never log this)."""
        return dict(self._delta_options)

    @property
    def spark_conf(self) -> dict[str, str]:
        """Spark session settings for this store (secrets included: never log this)."""
        return dict(self._spark_conf)

    def masked(self) -> dict[str, Any]:
        """For logs and ``status``: the location and settings with every secret replaced."""
        secret = ("SECRET", "TOKEN", "KEY", "PASSWORD", "CREDENTIAL", "SAS")
        opts = {
            k: MASK if any(s in k.upper() for s in secret) and "KEY_ID" not in k.upper() else v
            for k, v in self._delta_options.items()
        }
        return {"lake_path": self.uri(), "store": self.store, "options": opts}

    def __str__(self) -> str:
        return self.uri()

    def __repr__(self) -> str:
        return f"LakeLocation({self.masked()!r})"

    # --- S3 -----------------------------------------------------------------------------------------
    def _s3(self, env: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
        st = self.storage
        key_id, secret, token = st.access_key_id, st.secret_access_key, st.session_token
        where = "[consumer.storage]"
        if not key_id and env.get("AWS_ACCESS_KEY_ID"):
            key_id, secret = env["AWS_ACCESS_KEY_ID"], env.get("AWS_SECRET_ACCESS_KEY", "")
            token = env.get("AWS_SESSION_TOKEN", "")
            where = "AWS_ACCESS_KEY_ID"
        if not key_id:
            key_id, secret, token, where = self._credentials_file(env)
        if key_id and not secret:
            raise LakeStorageError(f"lake storage: an access key id without a secret access key (from {where})")
        endpoint = st.endpoint or env.get("AWS_ENDPOINT_URL_S3", "") or env.get("AWS_ENDPOINT_URL", "")
        region = st.region or env.get("AWS_REGION", "") or env.get("AWS_DEFAULT_REGION", "") or "us-east-1"
        if endpoint and urlsplit(endpoint).scheme not in ("http", "https"):
            raise LakeStorageError(f"lake storage: endpoint {endpoint!r} must start with http:// or https://")
        delta = {
            "AWS_REGION": region,
            # Conditional put (If-None-Match) makes a commit fail when another process took the same
            # table version: safe concurrent writers with no lock service (AWS S3, MinIO, R2 have it).
            "aws_conditional_put": "etag",
        }
        spark = {
            "spark.hadoop.fs.s3a.impl": "org.apache.hadoop.fs.s3a.S3AFileSystem",
            "spark.hadoop.fs.s3a.endpoint.region": region,
            "spark.hadoop.fs.s3a.path.style.access": "true" if st.path_style else "false",
        }
        if endpoint:
            delta["AWS_ENDPOINT_URL"] = endpoint
            spark["spark.hadoop.fs.s3a.endpoint"] = endpoint
            if endpoint.startswith("http://"):
                delta["AWS_ALLOW_HTTP"] = "true"
                spark["spark.hadoop.fs.s3a.connection.ssl.enabled"] = "false"
        if st.path_style:
            delta["AWS_VIRTUAL_HOSTED_STYLE_REQUEST"] = "false"
        if key_id:
            delta["AWS_ACCESS_KEY_ID"], delta["AWS_SECRET_ACCESS_KEY"] = key_id, secret
            spark["spark.hadoop.fs.s3a.access.key"], spark["spark.hadoop.fs.s3a.secret.key"] = key_id, secret
            provider = "org.apache.hadoop.fs.s3a.SimpleAWSCredentialsProvider"
            if token:
                delta["AWS_SESSION_TOKEN"] = token
                spark["spark.hadoop.fs.s3a.session.token"] = token
                provider = "org.apache.hadoop.fs.s3a.TemporaryAWSCredentialsProvider"
            spark["spark.hadoop.fs.s3a.aws.credentials.provider"] = provider
        return delta, spark

    def _credentials_file(self, env: Mapping[str, str]) -> tuple[str, str, str, str]:
        path_text = self.storage.credentials_file or env.get("AWS_SHARED_CREDENTIALS_FILE", "")
        explicit = bool(path_text)
        home = Path(env.get("HOME", "~")).expanduser()
        path = Path(path_text).expanduser() if path_text else home / ".aws" / "credentials"
        profile = self.storage.profile or env.get("AWS_PROFILE", "") or "default"
        if not path.is_file():
            if explicit:
                raise LakeStorageError(f"lake storage: credentials file {path} not found")
            return "", "", "", ""
        parser = configparser.ConfigParser(interpolation=None)
        try:
            parser.read(path)
        except configparser.Error as exc:
            reason = type(exc).__name__
            raise LakeStorageError(f"lake storage: {path}: not an AWS credentials file ({reason})") from None
        if profile not in parser:
            if explicit or self.storage.profile:
                raise LakeStorageError(f"lake storage: {path}: no profile [{profile}]")
            return "", "", "", ""
        sec = parser[profile]
        return (
            sec.get("aws_access_key_id", ""),
            sec.get("aws_secret_access_key", ""),
            sec.get("aws_session_token", ""),
            f"{path} [{profile}]",
        )

    # --- files -----------------------------------------------------------------------------------------
    def root(self) -> LakeDir:
        """The lake directory: a ``Path`` when local, else an ``ObjectPath`` on the store."""
        if self.local_path is not None:
            return self.local_path
        return ObjectPath(self, "")

    def filesystem(self, timeout_s: float = 30.0) -> Any:
        """A pyarrow file system reaching the store (paths ``bucket/prefix/...``)."""
        if self._fs is not None:
            return self._fs
        import pyarrow.fs as pafs

        if self.store != "s3":
            # ABFS and GCS: pyarrow's own clients read their standard environment.
            fs, _ = pafs.FileSystem.from_uri(self.uri())
            self._fs = fs
            return fs
        self._fs = self._s3_filesystem(timeout_s, attempts=5)
        return self._fs

    def _s3_filesystem(self, timeout_s: float, attempts: int) -> Any:
        import pyarrow.fs as pafs

        o = self._delta_options
        endpoint = o.get("AWS_ENDPOINT_URL", "")
        split = urlsplit(endpoint) if endpoint else None
        return pafs.S3FileSystem(
            access_key=o.get("AWS_ACCESS_KEY_ID") or None,
            secret_key=o.get("AWS_SECRET_ACCESS_KEY") or None,
            session_token=o.get("AWS_SESSION_TOKEN") or None,
            region=o.get("AWS_REGION"),
            endpoint_override=split.netloc if split else None,
            scheme=split.scheme if split else "https",
            force_virtual_addressing=not self.storage.path_style and not endpoint,
            connect_timeout=timeout_s,
            request_timeout=timeout_s,
            retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=attempts),
        )

    def fs_path(self, rel: str = "") -> str:
        """``rel`` (below the lake) as a path of ``filesystem()``."""
        return "/".join(p for p in (self.bucket, self.prefix, rel) if p)

    # --- reachability ---------------------------------------------------------------------------------
    def check(self, timeout_s: float = 10.0) -> None:
        """Raise LakeStorageError (one line naming the endpoint or bucket) when the store cannot be
        used: no such bucket, credentials refused, endpoint unreachable. Local: the directory's
        parent must exist or be creatable (the writer creates the lake)."""
        if self.local_path is not None or self.store != "s3":
            return
        import pyarrow.fs as pafs

        o = self._delta_options
        endpoint = o.get("AWS_ENDPOINT_URL", "")
        fs = self._s3_filesystem(timeout_s, attempts=2)
        where = f"s3://{self.bucket} at {endpoint or 'AWS S3'}"
        try:
            info = fs.get_file_info(self.bucket)
        except OSError as exc:
            raise LakeStorageError(f"lake storage: {where}: {_aws_reason(str(exc))}") from None
        if info.type == pafs.FileType.NotFound:
            raise LakeStorageError(f"lake storage: {where}: no such bucket (create it first) - at `$.lake_path`")


def _aws_reason(text: str) -> str:
    """The useful part of an AWS SDK error, on one line, with nothing secret in it."""
    low = text.lower()
    if "curlcode: 7" in low or "couldn't connect" in low or "connection refused" in low:
        return "endpoint unreachable (connection refused)"
    if "curlcode: 28" in low or "timeout" in low:
        return "endpoint did not answer in time"
    if "curlcode: 6" in low or "resolve host" in low:
        return "endpoint host name does not resolve"
    if "access_denied" in low or "accessdenied" in low or "403" in low:
        return "access denied: credentials refused (check access_key_id/secret_access_key)"
    if "invalidaccesskeyid" in low or "signaturedoesnotmatch" in low:
        return "credentials refused (check access_key_id/secret_access_key)"
    return " ".join(text.split())[:300]


class ObjectPath:
    """A file or directory on the lake's object store, with the few ``pathlib.Path`` calls the lake
    code makes (``/``, ``exists``, ``open``, ``read_bytes``, ``unlink`` ...), so one code path serves
    a local lake and one on S3. ``str()`` is the URL (no secrets)."""

    def __init__(self, location: LakeLocation, rel: str) -> None:
        self.location = location
        self.rel = rel.strip("/")

    def __truediv__(self, part: str | Path) -> ObjectPath:
        return ObjectPath(self.location, f"{self.rel}/{part}" if self.rel else str(part))

    def __str__(self) -> str:
        return self.location.uri(self.rel)

    def __repr__(self) -> str:
        return f"ObjectPath({self})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ObjectPath) and str(other) == str(self)

    def __hash__(self) -> int:
        return hash(str(self))

    @property
    def name(self) -> str:
        return self.rel.rsplit("/", 1)[-1]

    @property
    def fs(self) -> Any:
        return self.location.filesystem()

    @property
    def fs_path(self) -> str:
        return self.location.fs_path(self.rel)

    @property
    def storage_options(self) -> dict[str, str]:
        return self.location.delta_options

    @property
    def spark_uri(self) -> str:
        return self.location.spark_uri(self.rel)

    def _type(self) -> Any:
        return self.fs.get_file_info(self.fs_path).type

    def exists(self) -> bool:
        import pyarrow.fs as pafs

        return bool(self._type() != pafs.FileType.NotFound)

    def is_file(self) -> bool:
        import pyarrow.fs as pafs

        return bool(self._type() == pafs.FileType.File)

    def is_dir(self) -> bool:
        import pyarrow.fs as pafs

        return bool(self._type() == pafs.FileType.Directory)

    def open(self, mode: str = "rb") -> Any:
        if mode != "rb":
            raise ValueError(f"{self}: object store paths open for reading only")
        try:
            return self.fs.open_input_stream(self.fs_path)
        except FileNotFoundError:
            raise
        except OSError as exc:
            if "NoSuchKey" in str(exc) or "not found" in str(exc).lower():
                raise FileNotFoundError(str(self)) from None
            raise

    def read_bytes(self) -> bytes:
        with self.open() as f:
            return bytes(f.read())

    def write_bytes(self, data: bytes) -> None:
        with self.fs.open_output_stream(self.fs_path) as f:
            f.write(data)

    def unlink(self, missing_ok: bool = False) -> None:
        try:
            self.fs.delete_file(self.fs_path)
        except FileNotFoundError:
            if not missing_ok:
                raise

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        """Object stores have no directories: nothing to create."""

    @property
    def parts(self) -> tuple[str, ...]:
        return tuple(self.rel.split("/")) if self.rel else ()

    def rglob(self, pattern: str) -> list[ObjectPath]:
        """Files below this prefix whose name matches ``pattern`` (``fnmatch``)."""
        import fnmatch

        import pyarrow.fs as pafs

        base = self.fs_path
        sel = pafs.FileSelector(base, allow_not_found=True, recursive=True)
        out = []
        for info in self.fs.get_file_info(sel):
            if info.type == pafs.FileType.File and fnmatch.fnmatch(info.base_name, pattern):
                out.append(self / info.path[len(base) :].lstrip("/"))
        return out

    def size(self) -> int:
        return int(self.fs.get_file_info(self.fs_path).size)


LakeDir = Path | ObjectPath
"""Where a lake (or a table, a file in it) is: a local path or an object on a store."""


def as_location_arg(path: LakeDir) -> tuple[str, dict[str, str] | None]:
    """(uri, storage_options) for delta-rs."""
    if isinstance(path, ObjectPath):
        return str(path), path.storage_options
    return str(path), None


def spark_path(path: LakeDir) -> str:
    """The location for Spark (``s3a://`` on S3, the absolute path locally: Delta's table builder takes a
    relative location for a table name and refuses it, and executors need not share the driver's working
    directory). Symlinks are not resolved."""
    return path.spark_uri if isinstance(path, ObjectPath) else os.path.abspath(path)


def file_source(path: LakeDir) -> Any:
    """What pyarrow's readers take for ``path``: the path itself, or an open stream on the store."""
    if isinstance(path, ObjectPath):
        return path.fs.open_input_file(path.fs_path)
    return path


def lake_root(lake_path: str | Path, storage: StorageOptions | None = None) -> LakeDir:
    """``lake_path`` (a directory or a URL) as the lake's root; LakeStorageError on a bad URL."""
    return LakeLocation(str(lake_path), storage).root()


def open_delta(path: LakeDir, version: int | None = None) -> Any:
    """delta-rs's ``DeltaTable`` at ``path`` (with the store's options), at ``version`` (None: the latest)."""
    from deltalake import DeltaTable

    uri, options = as_location_arg(path)
    return DeltaTable(uri, version=version, storage_options=options)


def is_delta(path: LakeDir) -> bool:
    from deltalake import DeltaTable

    uri, options = as_location_arg(path)
    return bool(DeltaTable.is_deltatable(uri, storage_options=options))


def check_writable(lake: Path) -> None:
    """Fail at start, with the path, if a local lake cannot be written."""
    try:
        lake.mkdir(parents=True, exist_ok=True)
        probe = lake / f".cdcd-write-probe-{os.getpid()}"
        probe.write_bytes(b"x")
        probe.unlink()
    except OSError as exc:
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            reason = f"not writable ({reason})"
        raise OSError(exc.errno, f"lake_path {lake}: {reason}") from None
