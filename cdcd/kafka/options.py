"""Options of the Kafka sink (``[consumer] kind = "kafka"``) and of ``cdcd kafka-to-node``.

Both speak to a cluster through librdkafka (confluent-kafka); the connection and security keys
are shared. Secrets (``sasl_password``, ``ssl_key_password``) are never logged: every log line and
error goes through ``cdcd.secrets``, and ``describe()`` masks them.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

import msgspec
import structlog

from cdcd.config import CacheFilter, ConfigError, check_ranges, convert, unknown_key_error, upgrade_table
from cdcd.replication.target import TargetOptions
from cdcd.secrets import mask_mapping

MiB = 1 << 20

_LIBRDKAFKA_LOG = logging.getLogger("cdcd.kafka.librdkafka")


class _ToStructlog(logging.Handler):
    """librdkafka's own lines (confluent-kafka hands them to the ``logger`` property's logger as
    ``"%s [%s] %s"`` facility, client, text) become ``librdkafka`` events of cdcd's log: JSON lines
    with the rest, never raw text on stderr (without a handler, logging's last resort prints them)."""

    _log = structlog.get_logger("cdcd.kafka")

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args
        if isinstance(args, tuple) and len(args) == 3:
            fields = {"facility": str(args[0]), "client": str(args[1]), "message": str(args[2])}
        else:
            fields = {"message": record.getMessage()}
        if record.levelno >= logging.ERROR:
            self._log.error("librdkafka", **fields)
        elif record.levelno >= logging.WARNING:
            self._log.warning("librdkafka", **fields)
        else:
            self._log.info("librdkafka", **fields)


_LIBRDKAFKA_LOG.addHandler(_ToStructlog())
_LIBRDKAFKA_LOG.propagate = False  # once, through structlog (which, embedded, goes to logging "cdcd.kafka")

_SECURITY_PROTOCOLS = ("plaintext", "ssl", "sasl_plaintext", "sasl_ssl")
_SASL_MECHANISMS = ("", "PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
_TOPIC_NAME = re.compile(r"[A-Za-z0-9._-]{1,249}")


class ClientOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """How to reach the cluster (shared by the sink and kafka-to-node)."""

    bootstrap_servers: str
    """host:port[,host:port...] of one or more brokers."""
    security_protocol: str = "plaintext"
    """plaintext, ssl, sasl_plaintext or sasl_ssl."""
    ssl_ca_location: str = ""
    """CA bundle that signed the brokers' certificates (default: the system's CAs)."""
    ssl_certificate_location: str = ""
    ssl_key_location: str = ""
    ssl_key_password: str = ""
    """Client certificate, its key and the key's password (brokers with ssl.client.auth)."""
    sasl_mechanism: str = ""
    """PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512 (with a sasl_* security_protocol)."""
    sasl_username: str = ""
    sasl_password: str = ""
    sasl_password_file: str = ""
    """A file (mode 0600) holding the SASL password, instead of ``sasl_password`` in the config."""
    client_config: dict[str, str] = msgspec.field(default_factory=dict)
    """More librdkafka properties (``{"socket.keepalive.enable" = "true"}``); not the ones above."""
    connect_timeout_ms: int = 10_000
    """How long to wait for the cluster's metadata at start before failing."""

    def _check_client(self, source: str) -> None:
        if not self.bootstrap_servers.strip():
            raise ConfigError(f"{source}: key 'bootstrap_servers': empty")
        if self.security_protocol not in _SECURITY_PROTOCOLS:
            choices = ", ".join(_SECURITY_PROTOCOLS)
            raise ConfigError(f"{source}: key 'security_protocol': {self.security_protocol!r} is not one of {choices}")
        if self.sasl_mechanism not in _SASL_MECHANISMS:
            choices = ", ".join(_SASL_MECHANISMS[1:])
            raise ConfigError(f"{source}: key 'sasl_mechanism': {self.sasl_mechanism!r} is not one of {choices}")
        if self.security_protocol.startswith("sasl") and not self.sasl_mechanism:
            protocol = self.security_protocol
            raise ConfigError(f"{source}: key 'sasl_mechanism': required with security_protocol {protocol}")
        if self.sasl_password and self.sasl_password_file:
            raise ConfigError(f"{source}: key 'sasl_password_file': give sasl_password or sasl_password_file, not both")
        for key in self.client_config:
            if key.replace(".", "_") in ClientOptions.__struct_fields__ or key in _OWN_PROPERTIES:
                raise ConfigError(f"{source}: key 'client_config.{key}': set by cdcd itself or by its own key")
        if self.connect_timeout_ms < 1:
            raise ConfigError(f"{source}: key 'connect_timeout_ms': out of range: {self.connect_timeout_ms}")

    def librdkafka(self, source: str) -> dict[str, Any]:
        """The librdkafka properties for these options (a password file is read here)."""
        conf: dict[str, Any] = {
            "bootstrap.servers": self.bootstrap_servers,
            "security.protocol": self.security_protocol,
            "client.id": "cdcd",
            # librdkafka's own log lines go through logging (the library writes nothing to stdio)
            "logger": _LIBRDKAFKA_LOG,
        }
        for key in ("ssl_ca_location", "ssl_certificate_location", "ssl_key_location", "ssl_key_password"):
            value = getattr(self, key)
            if value:
                conf[key.replace("_", ".")] = value
        if self.sasl_mechanism:
            conf["sasl.mechanism"] = self.sasl_mechanism
            conf["sasl.username"] = self.sasl_username
            password = self.sasl_password
            if self.sasl_password_file:
                from cdcd.replication import credentials

                password = credentials.read_token(self.sasl_password_file, "sasl_password_file", source).decode()
            conf["sasl.password"] = password
        conf.update(self.client_config)
        return conf

    def describe(self) -> dict[str, Any]:
        """The options for a log line: secrets masked."""
        return mask_mapping(msgspec.structs.asdict(self))


_OWN_PROPERTIES = frozenset(
    {
        "transactional.id",
        "enable.idempotence",
        "isolation.level",
        "enable.auto.commit",
        "group.id",
        "acks",
    }
)
"""librdkafka properties exactly once depends on: not overridable through ``client_config``."""


class KafkaSinkOptions(ClientOptions, frozen=True, forbid_unknown_fields=True, kw_only=True):
    topic: str = ""
    """One data topic for every cache: one Debezium-envelope message per change."""
    topic_prefix: str = ""
    """Instead of ``topic``: one topic per cache, ``<topic_prefix>.<cache>`` (Debezium's naming;
    ``cdcd.kafka.topics`` maps names Kafka does not allow), keyed by the row's key."""
    metadata_topic: str = ""
    """Cache created/destroyed records (default: ``<topic>.metadata``; with ``topic_prefix`` the
    prefix itself, where Debezium puts its schema changes)."""
    transaction_metadata: bool = False
    """BEGIN/END records of each node transaction in ``transaction_topic`` (Debezium's
    ``provide.transaction.metadata``)."""
    transaction_topic: str = ""
    """Default ``<topic_prefix or topic>.transaction``."""
    db: str = ""
    """``source.db`` of the envelope (default: the source node's id); give a cluster's nodes one."""
    offsets_topic: str = "cdcd-offsets"
    """Compacted topic holding each source node's delivered position (written in the same
    transaction as the data). Shared by every cdcd of a cluster; one key per source node."""
    topic_partitions: int = 16
    """Partitions of the data topic when cdcd creates it; an existing topic must have at least
    this many. The Kafka partition of a change is its cache partition modulo this."""
    replication_factor: int = -1
    """Replication factor of the topics cdcd creates (-1: the brokers' default)."""
    name: str = ""
    """``source.name`` of the envelope (default: the topic)."""
    only_primary: bool = True
    """Send only changes of primary copies (backups are the same changes again)."""
    schemas: bool = False
    """Embed a Kafka Connect JSON schema in each message (``{"schema", "payload"}``), as
    JsonConverter with ``schemas.enable=true`` expects."""
    tombstones: bool = True
    """After a delete, a message with the same key and a null value (compaction drops the key)."""
    transactional_id: str = ""
    """Default ``cdcd-<source node>``: one per source node, so a new producer (the daemon after
    the realtime worker, a restart) fences the old one."""
    max_events_per_transaction: int = 50_000
    """Changes per Kafka transaction; the rest of a bigger batch goes in the next one."""
    linger_ms: int = 5
    batch_size_bytes: int = 1 * MiB
    """librdkafka's per-partition batch (``batch.size``)."""
    max_message_bytes: int = 1 * MiB
    """Largest message (``message.max.bytes``); a bigger change fails the batch with an error."""
    compression: str = "lz4"
    """none, gzip, snappy, lz4 or zstd."""
    transaction_timeout_ms: int = 60_000
    request_timeout_ms: int = 30_000

    def __post_init__(self) -> None:
        checks = {
            "topic_partitions": 1 <= self.topic_partitions <= 100_000,
            "replication_factor": self.replication_factor == -1 or 1 <= self.replication_factor <= 32,
            "max_events_per_transaction": self.max_events_per_transaction >= 1,
            "linger_ms": 0 <= self.linger_ms <= 60_000,
            "batch_size_bytes": self.batch_size_bytes >= 1024,
            "max_message_bytes": 1024 <= self.max_message_bytes <= 1_000_000_000,
            "compression": self.compression in ("none", "gzip", "snappy", "lz4", "zstd"),
            "transaction_timeout_ms": self.transaction_timeout_ms >= 1000,
            "request_timeout_ms": self.request_timeout_ms >= 1,
        }
        check_ranges(self, checks)

    @property
    def metadata_topic_name(self) -> str:
        return self.metadata_topic or (self.topic_prefix or f"{self.topic}.metadata")

    @property
    def transaction_topic_name(self) -> str:
        return self.transaction_topic or f"{self.topic_prefix or self.topic}.transaction"

    @property
    def source_name(self) -> str:
        """``source.name``: Debezium's logical server name, its topic prefix."""
        return self.name or self.topic_prefix or self.topic

    @classmethod
    def load(cls, options: Mapping[str, Any], source: str) -> KafkaSinkOptions:
        opts = convert(options, cls, source)
        opts._check_client(source)
        if bool(opts.topic) == bool(opts.topic_prefix):
            raise ConfigError(
                f"{source}: key 'topic': give topic (one topic for all caches) or topic_prefix (one per cache)"
                + (", not both" if opts.topic else "")
            )
        for key in ("topic", "topic_prefix", "metadata_topic", "offsets_topic", "transaction_topic"):
            value = getattr(opts, key)
            if value and not _TOPIC_NAME.fullmatch(value):
                raise ConfigError(f"{source}: key '{key}': {value!r} is not a valid topic name")
        if len(opts.topic_prefix) > 200:
            raise ConfigError(f"{source}: key 'topic_prefix': longer than 200 characters (topics hold at most 249)")
        names = [opts.topic or None, opts.metadata_topic_name, opts.offsets_topic]
        if opts.transaction_metadata:
            names.append(opts.transaction_topic_name)
        named = [n for n in names if n is not None]
        if len(set(named)) != len(named):
            raise ConfigError(
                f"{source}: key 'metadata_topic': topic, metadata_topic, offsets_topic and transaction_topic "
                "must differ"
            )
        opts._check_folded(source)
        return opts

    def _check_folded(self, source: str) -> None:
        """Kafka refuses a topic whose name equals an existing one's with ``.`` and ``_`` taken alike:
        the sink's configured topics (and the one topic's dead letters) must differ so too."""
        keyed = [("metadata_topic", "metadata_topic", self.metadata_topic_name)]
        keyed.append(("offsets_topic", "offsets_topic", self.offsets_topic))
        if self.topic:
            keyed[:0] = [("topic", "topic", self.topic), ("topic", "the dead letters of topic", f"{self.topic}.dlq")]
        if self.transaction_metadata:
            keyed.append(("transaction_topic", "transaction_topic", self.transaction_topic_name))
        seen: dict[str, tuple[str, str]] = {}
        for key, what, name in keyed:
            folded = name.replace(".", "_")
            if folded in seen:
                other_what, other = seen[folded]
                raise ConfigError(
                    f"{source}: key '{key}': {name} collides with {other_what} {other} (Kafka takes '.' and '_' "
                    f"alike in topic names): give {key} another name"
                )
            seen[folded] = (what, name)


def parse_partitions(spec: str, key: str) -> tuple[int, int]:
    """``FROM-TO`` (inclusive, as kafka-to-ignite's ``kafkaPartsFrom``/``kafkaPartsTo``) or one number."""
    m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", spec)
    if m is None:
        raise ConfigError(f"{key}: {spec!r} is not FROM-TO (e.g. 0-15)")
    lo = int(m.group(1))
    hi = int(m.group(2)) if m.group(2) is not None else lo
    if hi < lo:
        raise ConfigError(f"{key}: {spec!r}: FROM is above TO")
    return lo, hi


class KafkaToNodeOptions(ClientOptions, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The ``cdcd kafka-to-node`` TOML file."""

    topic: str = ""
    """The sink's single topic."""
    topic_prefix: str = ""
    """Instead of ``topic``: the sink's per-cache topics ``<topic_prefix>.*``, new ones picked up
    while running."""
    metadata_topic: str = ""
    """Default as the sink's: ``<topic>.metadata``, or the prefix itself."""
    metadata: bool = True
    """Read the metadata topic (the partition count of a cache the target has to create); its absence
    is an error. False (``--no-metadata``): not read, the target creates a cache with its own default."""
    partitions: str = ""
    """Kafka partitions to read, ``FROM-TO`` inclusive (default: all of the topic's)."""
    threads: int = 1
    """Reader threads; each takes an equal share of the partitions and has its own connection to
    the target."""
    group_id: str = "cdcd-kafka-to-node"
    """Consumer group whose committed offsets say where to resume; metadata is read by
    ``<group_id>-metadata``."""
    replication: TargetOptions
    """The target node: the keys of TargetOptions (``target``, ``token_file``, ``tls*``), written at
    the top level of the file as the replication sink's are."""
    caches: list[str] = msgspec.field(default_factory=list)
    exclude_caches: list[str] = msgspec.field(default_factory=list)
    """Which caches go to the target (``CacheFilter``: names or glob patterns; exclusion wins)."""
    max_batch_events: int = 2048
    """Messages read before one apply + offset commit."""
    poll_timeout_ms: int = 200
    request_timeout_ms: int = 30_000
    retry_timeout_s: float = 300.0
    """Retry a failing target or cluster this long, then exit non-zero (systemd restarts it): the
    consumers' ``retry_timeout_s``."""
    metrics_address: str = "127.0.0.1:9470"
    """host:port of the Prometheus listener ("" for none)."""

    def __post_init__(self) -> None:
        checks = {
            "threads": 1 <= self.threads <= 256,
            "max_batch_events": self.max_batch_events >= 1,
            "poll_timeout_ms": self.poll_timeout_ms >= 1,
            "request_timeout_ms": self.request_timeout_ms >= 1,
            "retry_timeout_s": 0 <= self.retry_timeout_s < float("inf"),
        }
        check_ranges(self, checks)

    @property
    def metadata_topic_name(self) -> str:
        return self.metadata_topic or (self.topic_prefix or f"{self.topic}.metadata")

    @classmethod
    def load(cls, options: Mapping[str, Any], source: str) -> KafkaToNodeOptions:
        options = upgrade_table(options, "kafka-to-node", source)  # deprecated spellings (cdcd.config.DEPRECATED)
        if "replication" in options:
            keys = "target, token_file and tls* are top-level keys"
            raise ConfigError(f"{source}: key 'replication': not a key ({keys})")
        known = {*cls.__struct_fields__, *TargetOptions.__struct_fields__} - {"replication"}
        for key in options:  # before the split: an unknown key first, not the target key it is a typo of as missing
            if key not in known:
                raise unknown_key_error(source, key, known)
        CacheFilter.from_table(options, source)
        target, rest = TargetOptions.split(options, source)
        opts = convert({**rest, "replication": msgspec.structs.asdict(target)}, cls, source)
        opts._check_client(source)
        if bool(opts.topic) == bool(opts.topic_prefix):
            raise ConfigError(
                f"{source}: key 'topic': give topic (the sink's one topic) or topic_prefix (its per-cache topics)"
                + (", not both" if opts.topic else "")
            )
        if opts.partitions:
            parse_partitions(opts.partitions, f"{source}: key 'partitions'")
        return opts
