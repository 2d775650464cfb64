"""The replication endpoint and consumer in one process: real nodes, real sockets, real daemons."""

from __future__ import annotations

import socket
import struct
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from prometheus_client import REGISTRY

from cdcd.config import CacheFilter, ConfigError
from cdcd.daemon.config import DaemonConfig
from cdcd.daemon.daemon import Daemon
from cdcd.node.node import Node
from cdcd.replication.client import ReplicationClient, TargetRefused
from cdcd.replication.protocol import Applied, Error, Hello, ReplEntry, Welcome, encode_frame
from cdcd.sinks import load_consumer
from cdcd.sinks.replication import ReplicationConsumer
from cdcd.wal.records import NIL, CacheVersion, Op
from tests.support.replication import TOKEN, exchange, open_target, token_file
from tests.support.wal import wal_records

_key = msgspec.msgpack.Encoder(order="deterministic").encode
_val = msgspec.msgpack.Encoder().encode


def client_for(node: Node, token: str = TOKEN, **kw: Any) -> ReplicationClient:
    assert node.replication is not None
    return ReplicationClient(("127.0.0.1", node.replication.port), token.encode(), **kw)


def entry(key: Any, value: Any, order: int, cluster: int = 1, op: Op = Op.UPDATE, expire: int = 0) -> ReplEntry:
    raw = NIL if op is Op.DELETE else msgspec.Raw(_val(value))
    return ReplEntry(op, msgspec.Raw(_key(key)), raw, CacheVersion(order, 1, cluster, 1), expire)


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.fixture
def target(tmp_path: Path) -> Iterator[Node]:
    node = open_target(tmp_path, conflict_resolve_field="updated_at")
    yield node
    node.close()


def test_applied_entries_keep_origin_version_and_resend_counts_duplicates(target: Node) -> None:
    """Applied entries land in the target's WAL with its own versions and the origin's in
    other_cluster_version; sending the same request again (a retry) counts held entries as
    duplicates, and replays a removed key's put and remove (no tombstones), ending equal."""
    reqs = [("people", [entry(1, {"n": 1}, 10), entry(2, {"n": 2}, 11), entry(1, None, 12, op=Op.DELETE)])]
    with client_for(target) as client:
        welcome = client.connect()
        assert (welcome.cluster_id, welcome.node_id) == (2, str(target.node_id))
        assert client.apply_all(reqs) == Applied(1, 3, 0, 0)
        assert client.apply_all(reqs) == Applied(2, 2, 0, 1)
        assert client.apply_all(reqs[:1]) == Applied(3, 2, 0, 1)
    people = target.cache("people")
    assert dict(people.items()) == {2: {"n": 2}}
    target.force_archive()
    data = [e for _p, r in wal_records(Path(target.config.node_dir)) for e in getattr(r, "entries", [])]
    assert [(e.op, e.decoded_key()) for e in data] == [(Op.CREATE, 1), (Op.CREATE, 2), (Op.DELETE, 1)] + [
        (Op.CREATE, 1),
        (Op.DELETE, 1),
    ] * 2
    assert {e.version.cluster_id for e in data} == {2}
    assert [e.version.other_cluster_version for e in data] == [CacheVersion(o, 1, 1, 1) for o in (10, 11, 12)] + [
        CacheVersion(o, 1, 1, 1) for o in (10, 12)
    ] * 2


def test_resolver_rules_decide_on_the_receiving_node(target: Node) -> None:
    """Rules 1-5 on a node whose cluster id is 2: local origin wins, same origin by version,
    different origins by the conflict field (tie: higher cluster id), else rejected and counted."""
    cache = target.cache("c")
    cache.put("local", {"updated_at": 100})  # written here: origin cluster 2
    before_rule5 = sample("cdcd_replication_received_entries_total", rule="unresolved")
    with client_for(target) as client:
        client.connect()
        got = client.apply_all(
            [
                (
                    "c",
                    [
                        entry("local", {"updated_at": 50}, 1, cluster=1),  # rule 4: 50 < 100 -> rejected
                        entry("new", {"updated_at": 1}, 2, cluster=1),  # rule 2 -> applied
                        entry("same", {"v": 1}, 5, cluster=3),  # rule 2
                    ],
                ),
                (
                    "c",
                    [
                        entry("new", {"updated_at": 0}, 1, cluster=1),  # rule 3: older version -> rejected
                        entry("same", {"v": 2}, 6, cluster=3),  # rule 3: newer -> applied
                        entry("local", {"updated_at": 100}, 9, cluster=3),  # rule 4 tie: cluster 3 > 2 -> applied
                    ],
                ),
                ("c", [entry("same", {"no-field": 1}, 1, cluster=1)]),  # rule 5: held from 3, no field
                ("c", [entry("mine", {"x": 1}, 1, cluster=2)]),  # rule 1 (origin is this cluster)
            ]
        )
    assert (got.applied, got.rejected, got.duplicates) == (5, 3, 0)
    assert dict(cache.items()) == {
        "local": {"updated_at": 100},
        "new": {"updated_at": 1},
        "same": {"v": 2},
        "mine": {"x": 1},
    }
    assert sample("cdcd_replication_received_entries_total", rule="unresolved") == before_rule5 + 1


def test_wrong_token_and_garbage_are_refused_and_the_node_keeps_serving(target: Node) -> None:
    """A wrong token, a non-hello first frame, garbage bytes, an undecodable frame and a lying
    length each get one error frame (and the connection closed where the stream is lost); the
    node serves a good client afterwards."""
    port = target.replication.port if target.replication else 0
    refused = {r: sample("cdcd_replication_refused_total", reason=r) for r in ("token", "frame")}
    with pytest.raises(TargetRefused, match="token refused"):
        client_for(target, token="wrong-token-0123456789").connect()

    assert [type(f) for f in exchange(port, encode_frame(Welcome(1, "x")))] == [Error]
    assert [type(f) for f in exchange(port, b"GET / HTTP/1.1\r\n\r\n")] == [Error]  # a 1.2 GB "length"
    hello = encode_frame(Hello(TOKEN))
    garbage = struct.pack(">I", 3) + b"\xc1\xc1\xc1"
    frames = exchange(port, hello + garbage + encode_frame(Hello(TOKEN)) + struct.pack(">I", 1 << 31))
    assert [type(f) for f in frames] == [Welcome, Error, Error, Error]
    assert "undecodable" in frames[1].message and not frames[1].fatal
    assert "unexpected hello" in frames[2].message
    assert frames[3].fatal and "over the limit" in frames[3].message
    assert sample("cdcd_replication_refused_total", reason="token") == refused["token"] + 1
    assert sample("cdcd_replication_refused_total", reason="frame") >= refused["frame"] + 5
    with client_for(target) as client:
        client.connect()
        assert client.apply_all([("c", [entry(1, {"ok": True}, 1)])]).applied == 1


def _dribble(sock: socket.socket, data: bytes, until: float) -> bool:
    """Send ``data`` a byte every 0.2 s (then keep the connection idle); True once the node closed it."""
    sock.settimeout(0.2)
    sent = 0
    while time.monotonic() < until:
        try:
            if not sock.recv(65536):
                return True
        except TimeoutError:
            pass
        except OSError:
            return True
        if sent < len(data):
            try:
                sock.send(data[sent : sent + 1])
            except OSError:
                return True
            sent += 1
    return False


@pytest.mark.parametrize("tls", [False, True])
def test_slow_handshakes_are_cut_at_one_deadline(tmp_path: Path, pki: Path, tls: bool) -> None:
    """Peers that take every connection slot and send their hello (or TLS hello) one byte every 0.2 s
    are disconnected once replication_auth_timeout_ms has passed since they connected (per-read
    timeouts never fire for them), counted as reason "timeout"; a real peer then gets in."""
    settings: dict[str, Any] = {"replication_max_connections": 2, "replication_auth_timeout_ms": 1000}
    if tls:
        settings |= {"replication_tls_cert": str(pki / "server.pem"), "replication_tls_key": str(pki / "server.key")}
    node = open_target(tmp_path, **settings)
    try:
        port = node.replication.port if node.replication else 0
        before = sample("cdcd_replication_refused_total", reason="timeout")
        # A TLS record header and the start of a ClientHello, or a cdcd frame length and a hello.
        data = bytes.fromhex("160301020001") if tls else encode_frame(Hello(TOKEN))
        slow = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(2)]
        until = time.monotonic() + 30  # far beyond the deadline even on a loaded machine
        try:
            assert all(_dribble(s, data, until) for s in slow), "a slow handshake outlived the deadline"
        finally:
            for s in slow:
                s.close()
        assert sample("cdcd_replication_refused_total", reason="timeout") == before + 2
        if not tls:
            with client_for(node) as client:
                client.connect()
                assert client.apply_all([("c", [entry(1, "in", 1)])]).applied == 1
    finally:
        node.close()


def test_malformed_entries_are_refused_whole(target: Node) -> None:
    """A request with one undecodable value, a delete with a value or a bad origin cluster id is
    refused with an error naming the entry, and none of its entries is applied."""
    good = entry(1, {"a": 1}, 1)
    bad_value = ReplEntry(Op.UPDATE, msgspec.Raw(_key(2)), msgspec.Raw(b"\xc1"), CacheVersion(2, 1, 1, 1))
    delete_with_value = ReplEntry(Op.DELETE, msgspec.Raw(_key(3)), msgspec.Raw(_val(1)), CacheVersion(3, 1, 1, 1))
    for bad, message in [
        (bad_value, "undecodable frame"),  # a Raw must be valid MessagePack to be framed at all
        (delete_with_value, "entry 1: a delete carries a value"),
        (entry(4, 1, 4, cluster=0), "entry 1: origin cluster id 0"),
        (entry(5, 1, 5, cluster=32), "entry 1: origin cluster id 32"),
    ]:
        with client_for(target) as client:
            client.connect()
            with pytest.raises(TargetRefused, match=message):
                client.apply_all([("c", [good, bad])])
    assert dict(target.cache("c").items()) == {}


def test_token_file_must_be_private_and_long(tmp_path: Path) -> None:
    """A token file readable by others, too short, or missing stops the node with the key named."""
    for path, message in [
        (token_file(tmp_path, mode=0o644), "readable by group or others"),
        (token_file(tmp_path, text="short"), "at least 16"),
        (tmp_path / "missing", "cannot open"),
    ]:
        with pytest.raises(ConfigError, match=f"replication_token_file.*{message}"):
            open_target(tmp_path, name=f"n{path.name}", replication_token_file=str(path))
    with pytest.raises(ConfigError, match="replication_listen needs a replication_token_file"):
        Node.open(tmp_path / "x", replication_listen="127.0.0.1:0")


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=cdcd test CA",
             "-keyout", str(d / "ca.key"), "-out", str(d / "ca.pem"))  # fmt: skip
    for name in ("server", "client", "rogue"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
                 "-keyout", str(d / f"{name}.key"), "-out", str(d / f"{name}.csr"))  # fmt: skip
        ext = d / f"{name}.ext"
        ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        ca = (
            ("-CA", str(d / "ca.pem"), "-CAkey", str(d / "ca.key"))
            if name != "rogue"
            else ("-signkey", str(d / "rogue.key"))
        )
        _openssl("x509", "-req", "-in", str(d / f"{name}.csr"), *ca, "-days", "2", "-extfile", str(ext),
                 "-out", str(d / f"{name}.pem"))  # fmt: skip
    return d


def test_tls_with_client_certificates(tmp_path: Path, pki: Path) -> None:
    """With TLS and a client CA, a client with a CA-signed certificate replicates; one without a
    certificate, with a self-signed one, or one that does not trust the server is refused."""
    node = open_target(
        tmp_path,
        replication_tls_cert=str(pki / "server.pem"),
        replication_tls_key=str(pki / "server.key"),
        replication_tls_ca=str(pki / "ca.pem"),
    )
    try:
        opts = {"target": f"127.0.0.1:{node.replication.port if node.replication else 0}"}
        good = ReplicationConsumer.from_options(
            {**opts, "token_file": str(token_file(tmp_path)), "tls_ca": str(pki / "ca.pem"),
             "tls_cert": str(pki / "client.pem"), "tls_key": str(pki / "client.key")}, "test",
        )  # fmt: skip
        with good.client as client:
            client.connect()
            assert client.apply_all([("c", [entry(1, "over tls", 1)])]).applied == 1
        for extra in (
            {"tls_ca": str(pki / "ca.pem")},  # no client certificate
            {"tls_ca": str(pki / "ca.pem"), "tls_cert": str(pki / "rogue.pem"), "tls_key": str(pki / "rogue.key")},
            {"tls": True},  # the system CAs do not know this server
        ):
            bad = ReplicationConsumer.from_options({**opts, "token_file": str(token_file(tmp_path)), **extra}, "t")
            with pytest.raises(OSError), bad.client as client:  # ssl.SSLError or a reset
                client.connect()
                client.apply_all([("c", [entry(2, "must not land", 2)])])
        assert dict(node.cache("c").items()) == {1: "over tls"}
    finally:
        node.close()


def test_daemon_replicates_a_node_and_nothing_comes_back(tmp_path: Path) -> None:
    """A daemon with the replication consumer makes B equal to A (puts, updates, removes, two
    caches, a cache filter); a daemon on B pointed back at A sends none of A's changes back."""
    tok = token_file(tmp_path)
    a = Node.open(tmp_path / "a", cluster_id=1, replication_listen="127.0.0.1:0", replication_token_file=str(tok))
    b = open_target(tmp_path, replication_token_file=str(tok))
    try:
        people, other, skip = a.cache("people"), a.cache("orders"), a.cache("private")
        for i in range(300):
            people.put_all({i: {"i": i}, i + 1000: [i]})
            other.put(i % 7, i)
            skip.put(i, "stays on a")
        people.remove_all(range(0, 300, 3))
        a.force_archive()
        consumer = {"kind": "replication", "target": f"127.0.0.1:{b.replication.port if b.replication else 0}",
                    "token_file": str(tok), "caches": ["people", "ord*"], "max_batch_size": 64}  # fmt: skip
        a_to_b = load_consumer(consumer).consumer
        config = DaemonConfig(node_dir=a.config.node_dir, metrics_address="", consumer=consumer)
        with Daemon(config, a_to_b) as daemon:
            assert daemon.sync_once() == 600 + 100 + 300  # people puts + removes, orders; private is filtered out
        assert isinstance(a_to_b, ReplicationConsumer)
        assert (a_to_b.sent, a_to_b.applied, a_to_b.rejected) == (1000, 1000, 0)
        assert dict(b.cache("people").items()) == dict(people.items())
        assert dict(b.cache("orders").items()) == dict(other.items())
        assert "private" not in b.caches()
        b.force_archive()
        b_to_a = load_consumer(
            {**consumer, "target": f"127.0.0.1:{a.replication.port if a.replication else 0}"}
        ).consumer
        config = DaemonConfig(node_dir=b.config.node_dir, metrics_address="", consumer=consumer)
        with Daemon(config, b_to_a) as daemon:
            assert daemon.sync_once() == 1000  # delivered to the consumer, which sends none of it
        assert isinstance(b_to_a, ReplicationConsumer) and b_to_a.sent == 0
    finally:
        a.close()
        b.close()


def test_bad_addresses_name_their_key(tmp_path: Path) -> None:
    """A replication target or listen address that is not host:port is a config error naming the key."""
    with pytest.raises(ConfigError, match=r"test: key 'target': expected host:port, got '7470'"):
        ReplicationConsumer.from_options({"target": "7470", "token_file": str(token_file(tmp_path))}, "test")
    with pytest.raises(ConfigError, match=r"key 'replication_listen': expected host:port, got 'h:99999'"):
        Node.open(tmp_path / "n", replication_listen="h:99999", replication_token_file=str(token_file(tmp_path)))


def _kafka_to_node(options: dict[str, Any]) -> Any:
    from cdcd.kafka.options import KafkaToNodeOptions
    from cdcd.kafka.to_node import KafkaToNode

    opts = KafkaToNodeOptions.load({"bootstrap_servers": "127.0.0.1:9", "topic": "t", **options}, "test")
    return KafkaToNode(opts, "test")


def _replication_sink(options: dict[str, Any]) -> Any:
    """The sink as the daemon builds it, and the cache filter the daemon applies for it."""
    sink = load_consumer({"kind": "replication", **options}, "test").consumer
    assert isinstance(sink, ReplicationConsumer)
    return sink.client.address, CacheFilter.from_table(options, "test")


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        ({"target": "7470"}, r"^test: key 'target': expected host:port, got '7470'$"),
        ({"caches": "orders("}, r"^test: key 'caches': one regular expression \('orders\('\) is the old form"),
        ({"exclude_caches": ["ord[ers"]}, r"^test: key 'exclude_caches': bad pattern 'ord\[ers': '\[' without"),
        ({"token_file": "world-readable"}, r"^test: key 'token_file': .* is readable by group or others"),
        ({"tls_ca": "no-such-ca.pem"}, r"^test: key 'tls_ca'"),
    ],
    ids=["target", "caches", "exclude_caches", "token_file", "tls_ca"],
)
def test_the_sink_and_kafka_to_node_read_a_target_alike(tmp_path: Path, bad: dict[str, str], error: str) -> None:
    """One TargetOptions (cdcd/replication/target.py) for the replication sink and kafka-to-node: the same flat
    keys, refused with the same one line naming the key."""
    good = {"target": "127.0.0.1:7470", "token_file": str(token_file(tmp_path)), "caches": ["orders", "items"]}
    if bad.get("token_file") == "world-readable":
        bad = {"token_file": str(token_file(tmp_path, mode=0o644))}
    options = {**good, **bad}
    with pytest.raises(ConfigError, match=error) as sink_error:
        _replication_sink(options)
    with pytest.raises(ConfigError, match=error) as k2n_error:
        _kafka_to_node(options)
    assert str(sink_error.value) == str(k2n_error.value)


def test_a_good_target_gives_both_the_same_address_token_and_caches(tmp_path: Path) -> None:
    from cdcd.kafka.options import KafkaToNodeOptions

    options = {
        "target": "127.0.0.1:7470",
        "token_file": str(token_file(tmp_path)),
        "caches": ["orders", "it?m?"],
        "exclude_caches": ["*s"],
    }
    k2n = _kafka_to_node(options)
    address, selected = _replication_sink(options)
    assert address == k2n.target.address == ("127.0.0.1", 7470)
    assert k2n.target.token == TOKEN.encode() and k2n.target.tls is None
    for name in ("orders", "items", "order", "other", "itemz", "Itemz"):
        assert selected(name) == k2n.selected(name) == (name == "itemz")
    with pytest.raises(ConfigError, match=r"^test: key 'replication': not a key"):
        KafkaToNodeOptions.load({"bootstrap_servers": "h:9", "topic": "t", "replication": options}, "test")
