"""Keys and values the node refuses (issue 46.3): an integer MessagePack cannot hold, a string with a lone
surrogate, nesting past Python's recursion limit (and past the node's own limits, and a type with no
MessagePack form) raise one documented exception, ``cdcd.node.ValueRefused``, naming the cache, the key as
the node's log lines name it (its ``key_hash`` unless ``log_keys = true``) and the limit, from ``put``,
``put_all`` and transactions; nothing of the call is written. A real node: its WAL, read back after close,
is the proof."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from cdcd.node import Node, ValueRefused
from cdcd.node.writes import INT_RANGE, MAX_KEY_BYTES, MAX_NESTING, key_encoder, key_hash
from tests.support.wal import wal_events


def nested(depth: int, kind: type[list[Any]] | type[tuple[Any, ...]] = list) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = kind([value])
    return value


TOO_DEEP_FOR_PYTHON = 100_000
"""Past the interpreter's recursion limit: msgspec's encoder raises a bare RecursionError there."""

SURROGATE = "ok \udc80"

# (what is refused, the bad part, where it goes: "value" or "key", the limit named, words of the problem)
CASES: list[tuple[str, Any, str, str, str]] = [
    ("int at 2**64", 2**64, "value", INT_RANGE, "integer out of range"),
    ("int below -2**63", -(2**63) - 1, "value", INT_RANGE, "integer out of range"),
    ("int key at 2**64", 2**64, "key", INT_RANGE, "integer out of range"),
    (
        "surrogate in a value",
        {"note": SURROGATE},
        "value",
        "without lone surrogates",
        "lone surrogate, '\\udc80' at index 3",
    ),
    ("surrogate in a field name", {SURROGATE: 1}, "value", "without lone surrogates", "lone surrogate"),
    ("surrogate in a key", SURROGATE, "key", "without lone surrogates", "lone surrogate"),
    ("nested past recursion", nested(TOO_DEEP_FOR_PYTHON), "value", f"{MAX_NESTING} levels", "nests deeper"),
    ("key nested past recursion", nested(TOO_DEEP_FOR_PYTHON), "key", f"{MAX_NESTING} levels", "nests deeper"),
    ("nested past the node's limit", nested(MAX_NESTING + 1), "value", f"{MAX_NESTING} levels", "nests deeper"),
    ("key nested past the node's limit", nested(MAX_NESTING + 1, tuple), "key", f"{MAX_NESTING} levels", "nests"),
    ("key too long", "k" * MAX_KEY_BYTES, "key", f"{MAX_KEY_BYTES} bytes", "bytes encoded, over the limit"),
]

GOOD_KEY, GOOD_VALUE = "o-1", {"qty": 3}


Writes = list[tuple[Any, Any]]


def writes_of(bad: Any, where: str) -> Writes:
    """A good write, then the bad one (the refusal must name the second of two)."""
    return [(GOOD_KEY, GOOD_VALUE), ("bad-key", bad) if where == "value" else (bad, 1)]


def via_put(node: Node, writes: Writes) -> None:
    key, value = writes[-1]
    node.cache("orders").put(key, value)


def via_put_all(node: Node, writes: Writes) -> None:
    node.cache("orders").put_all(dict(writes))


def via_transaction(node: Node, writes: Writes) -> None:
    with node.transaction() as tx:
        for k, v in writes:
            tx.put("orders", k, v)


CALLS: dict[str, tuple[Callable[[Node, Writes], None], int]] = {
    "put": (via_put, 1),
    "put_all": (via_put_all, 2),
    "transaction": (via_transaction, 2),
}
"""How a refused write is made, and how many writes the call holds."""


PARAMS = [
    pytest.param(call, *case, id=f"{case[0]}-{call}")
    for case in CASES
    for call in CALLS
    # A list is no dict key: put_all cannot be handed a key nested past the recursion limit.
    if not (call == "put_all" and isinstance(case[1], list) and case[2] == "key")
]


@pytest.mark.parametrize(("call", "case", "bad", "where", "limit", "problem"), PARAMS)
def test_a_refused_key_or_value_names_cache_key_and_limit_and_writes_nothing(
    tmp_path: Path, call: str, case: str, bad: Any, where: str, limit: str, problem: str
) -> None:
    node_dir = tmp_path / "node"
    make, count = CALLS[call]
    writes = writes_of(bad, where)
    with Node.open(node_dir, cdc_enabled=False) as node:
        node.cache("orders").put("before", 1)
        with pytest.raises(ValueRefused) as caught:
            make(node, writes)
        assert node.cache("orders").get(GOOD_KEY) is None, "nothing of the call is written"
    exc = caught.value
    assert (exc.cache, exc.what, exc.key_masked) == ("orders", where, True)
    assert limit in exc.limit, exc.limit
    assert exc.index == count - 1
    text = str(exc)
    assert text.startswith(f"cache 'orders': {where} "), text
    assert problem in text and f"limit: {exc.limit})" in text, text
    assert (f"write {count} of {count}" in text) == (count > 1), text
    if where == "value":
        # The name the node's log lines give a key: the conflict resolver's key_hash of its canonical bytes.
        assert exc.key == key_hash(key_encoder.encode("bad-key"))
        assert f"key_hash {exc.key}" in text
    elif case in ("key too long", "key nested past the node's limit"):  # encodable: named by its hash
        assert exc.key == key_hash(key_encoder.encode(bad))
    else:
        assert exc.key is None and "key not shown, as keys are masked: log_keys = true shows it" in text
    assert SURROGATE not in text and repr(SURROGATE) not in text, "a masked key's text is never shown"
    assert [(e["key"], e["value"]) for e in wal_events(node_dir)] == [("before", 1)], "the WAL holds the one good put"


def test_with_log_keys_the_refusal_shows_the_key(tmp_path: Path) -> None:
    """``log_keys = true``: the key in clear (its repr, as the resolver's log lines), also one that cannot be
    encoded."""
    with Node.open(tmp_path / "node", cdc_enabled=False, log_keys=True) as node:
        with pytest.raises(ValueRefused) as caught:
            node.cache("people").put_all({"p-7": {"age": 2**64}})
        assert (caught.value.key, caught.value.key_masked) == ("'p-7'", False)
        assert "(key 'p-7'; limit: integers from -2**63 to 2**64-1)" in str(caught.value)
        with pytest.raises(ValueRefused) as caught:
            node.cache("people").put(SURROGATE, 1)
        assert caught.value.key == repr(SURROGATE)


def test_a_type_without_a_messagepack_form_is_refused_and_still_a_type_error(tmp_path: Path) -> None:
    """msgspec's TypeError for an unsupported type becomes a ValueRefused naming cache and key, and stays a
    TypeError (what callers caught before)."""

    class Opaque:
        pass

    with Node.open(tmp_path / "node", cdc_enabled=False) as node:
        for refuse in (lambda: node.cache("c").put("k", Opaque()), lambda: node.cache("c").put_all({"k": Opaque()})):
            with pytest.raises(ValueRefused) as caught:
                refuse()
            assert isinstance(caught.value, TypeError)
            assert caught.value.key == key_hash(key_encoder.encode("k"))
            assert "value cannot be stored: Encoding objects of type Opaque is unsupported" in str(caught.value)
    assert wal_events(tmp_path / "node") == []


def test_the_edges_of_every_limit_are_accepted(tmp_path: Path) -> None:
    """The refusals are exact: -2**63, 2**64-1, MAX_NESTING levels, any valid Unicode and a key of exactly
    MAX_KEY_BYTES encoded are written and read back."""
    edge_key = "k" * (MAX_KEY_BYTES - 3)  # a str16 header
    assert len(key_encoder.encode(edge_key)) == MAX_KEY_BYTES
    writes = {"lo": -(2**63), "hi": 2**64 - 1, "deep": nested(MAX_NESTING), "text": "\U0001f600 \u00e9", edge_key: 1}
    with Node.open(tmp_path / "node", cdc_enabled=False) as node:
        node.cache("c").put_all(writes)
        assert {k: node.cache("c").get(k) for k in writes} == msgspec.msgpack.decode(msgspec.msgpack.encode(writes))
    assert len(wal_events(tmp_path / "node")) == len(writes)
