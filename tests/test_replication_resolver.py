"""The conflict resolver's rules, alone and as a pair of active-active nodes would apply them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cdcd.config import ConfigError
from cdcd.node.node import Node
from cdcd.replication.client import ReplicationClient
from cdcd.replication.protocol import ReplEntry
from cdcd.replication.resolver import ConflictResolver, Held, Rule, Verdict, load_resolver
from cdcd.wal.records import NIL, CacheVersion, Op

_enc = msgspec.msgpack.Encoder().encode


def new(value: Any, order: int, cluster: int, expire: int = 0) -> ReplEntry:
    raw = NIL if value is None else msgspec.Raw(_enc(value))
    op = Op.DELETE if value is None else Op.UPDATE
    return ReplEntry(op, msgspec.Raw(_enc("k")), raw, CacheVersion(order, 1, cluster, 1), expire)


def held(value: Any, order: int, cluster: int, expire: int = 0) -> Held:
    return Held(_enc(value), CacheVersion(order, 1, cluster, 1), expire)


@pytest.mark.parametrize(
    ("held_entry", "new_entry", "field", "verdict"),
    [
        (held({"t": 9}, 5, 3), new({"t": 1}, 1, 2), "", Verdict(True, Rule.LOCAL)),  # new from here (2)
        (held({"t": 9}, 5, 2), new({"t": 1}, 1, 2), "", Verdict(False, Rule.VERSION)),  # both local: versions
        (None, new({"t": 1}, 1, 3), "", Verdict(True, Rule.NEW)),
        (held(1, 5, 3), new(2, 6, 3), "", Verdict(True, Rule.VERSION)),
        (held(1, 5, 3), new(2, 4, 3), "", Verdict(False, Rule.VERSION)),
        (held(1, 5, 3, expire=10), new(1, 5, 3, expire=20), "", Verdict(True, Rule.VERSION)),
        (held(1, 5, 3, expire=20), new(1, 5, 3, expire=10), "", Verdict(False, Rule.VERSION)),
        (held(1, 5, 3), new(1, 5, 3), "", Verdict(False, Rule.VERSION, duplicate=True)),
        (held({"t": 1}, 9, 3), new({"t": 2}, 1, 4), "t", Verdict(True, Rule.FIELD)),
        (held({"t": 2}, 1, 3), new({"t": 1}, 9, 4), "t", Verdict(False, Rule.FIELD)),
        (held({"t": 2}, 1, 3), new({"t": 2}, 1, 4), "t", Verdict(True, Rule.FIELD)),  # tie: higher cluster
        (held({"t": 2}, 1, 4), new({"t": 2}, 1, 3), "t", Verdict(False, Rule.FIELD)),
        (held({"t": "b"}, 1, 3), new({"t": "a"}, 1, 4), "t", Verdict(False, Rule.FIELD)),
        (held({"t": 1}, 1, 3), new({"t": "x"}, 1, 4), "t", Verdict(False, Rule.UNRESOLVED)),  # incomparable
        (held({"t": 1}, 1, 3), new({"u": 5}, 1, 4), "t", Verdict(False, Rule.UNRESOLVED)),  # field missing
        (held({"t": 1}, 1, 3), new(None, 1, 4), "t", Verdict(False, Rule.UNRESOLVED)),  # a remove has no field
        (held({"t": 1}, 1, 3), new({"t": 5}, 1, 4), "", Verdict(False, Rule.UNRESOLVED)),  # no field configured
        (held([1], 1, 3), new([2], 1, 4), "t", Verdict(False, Rule.UNRESOLVED)),  # not maps
    ],
)
def test_rules_in_order(held_entry: Held | None, new_entry: ReplEntry, field: str, verdict: Verdict) -> None:
    """Each of the five rules decides the case it is for, in the documented order (receiver: cluster 2)."""
    assert ConflictResolver(2, field).resolve("c", _enc("k"), held_entry, new_entry) == verdict


_field_values = st.one_of(st.integers(-(2**40), 2**40), st.floats(allow_nan=False, allow_infinity=False))


@settings(max_examples=500, deadline=None)
@given(
    a_field=_field_values,
    b_field=_field_values,
    a_order=st.integers(1, 100),
    b_order=st.integers(1, 100),
    clusters=st.lists(st.integers(1, 31), min_size=2, max_size=2, unique=True),
)
def test_active_active_pair_picks_one_winner(
    a_field: float, b_field: float, a_order: int, b_order: int, clusters: list[int]
) -> None:
    """Two clusters that wrote the same key concurrently each resolve the other's change; with a
    conflict field both keep the same value (the higher field, ties to the higher cluster id)."""
    ca, cb = clusters
    a_val, b_val = {"t": a_field, "from": ca}, {"t": b_field, "from": cb}
    at_a = ConflictResolver(ca, "t").resolve("c", b"k", held(a_val, a_order, ca), new(b_val, b_order, cb))
    at_b = ConflictResolver(cb, "t").resolve("c", b"k", held(b_val, b_order, cb), new(a_val, a_order, ca))
    a_keeps = b_val if at_a.use_new else a_val
    b_keeps = a_val if at_b.use_new else b_val
    assert a_keeps == b_keeps
    assert a_keeps["t"] == max(a_field, b_field)


class PreferLonger(ConflictResolver):
    """Rule 5 replaced: the longer value wins."""

    def unresolved(self, cache: str, key: bytes, held: Held, new: ReplEntry) -> Verdict:
        return Verdict(len(new.value) > len(held.value), Rule.UNRESOLVED)


def test_user_resolver_class_from_config(tmp_path: Path) -> None:
    """``replication_resolver = "module:Class"`` makes the node resolve with a user subclass; a
    spec that is not a ConflictResolver subclass is a one-line config error naming the key."""
    token = tmp_path / "token"
    token.write_text("0123456789abcdef0123")
    token.chmod(0o600)
    with Node.open(
        tmp_path / "n",
        cluster_id=2,
        replication_listen="127.0.0.1:0",
        replication_token_file=str(token),
        replication_resolver="tests.test_replication_resolver:PreferLonger",
    ) as node:
        node.cache("c").put("k", "short")
        assert node.replication is not None
        with ReplicationClient(("127.0.0.1", node.replication.port), b"0123456789abcdef0123") as client:
            client.connect()
            got = client.apply_all([("c", [new("a much longer value", 1, 3)])])
            assert (got.applied, got.rejected) == (1, 0)
            got = client.apply_all([("c", [new("tiny", 1, 4)])])
            assert (got.applied, got.rejected) == (0, 1)
        assert node.cache("c").get("k") == "a much longer value"
    for spec, message in [
        ("tests.test_replication_resolver:held", "not a subclass"),
        ("no_such_module_xyz:R", "cannot import"),
        ("justaname", "expected 'package.module:ClassName'"),
    ]:
        with pytest.raises(ConfigError, match=f"key 'replication_resolver': .*{message}"):
            load_resolver(spec, 1, "", "node.toml")
