"""``cdcd node diff``: do two nodes hold the same data? (A stand-by against its primary.)

Per cache: rows and an order-independent checksum of every (key, value) pair — the MessagePack
bytes, which replication carries unchanged. A stopped node is read from a read-only snapshot and
compared key by key (which keys differ); a running node answers the checksums over its control
socket, so a live pair can be compared without stopping either.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

_MASK = (1 << 64) - 1
_decoder = msgspec.msgpack.Decoder()


class RawItems(Protocol):
    def caches(self) -> list[str]: ...

    def raw_items(self, cache: str) -> Iterator[tuple[bytes, bytes]]: ...


def pair_hash(key: bytes, value: bytes) -> int:
    digest = hashlib.blake2b(value, digest_size=8, key=hashlib.blake2b(key, digest_size=32).digest()).digest()
    return int.from_bytes(digest, "big")


def digest(items: Iterable[tuple[bytes, bytes]]) -> tuple[int, int]:
    """(rows, checksum) of (key, value) pairs in any order."""
    rows = total = 0
    for key, value in items:
        total = (total + pair_hash(key, value)) & _MASK
        rows += 1
    return rows, total


def digests(node: RawItems) -> dict[str, dict[str, Any]]:
    """What the control socket's ``digest`` command answers."""
    out = {}
    for cache in node.caches():
        rows, checksum = digest(node.raw_items(cache))
        out[cache] = {"rows": rows, "checksum": f"{checksum:016x}"}
    return out


@dataclass
class CacheDiff:
    cache: str
    rows_a: int
    rows_b: int
    checksum_a: str
    checksum_b: str
    only_a: int | None = None
    """Keys only A holds (None: not known, a node was running)."""
    only_b: int | None = None
    different: int | None = None
    examples: list[str] = field(default_factory=list)

    @property
    def same(self) -> bool:
        return self.rows_a == self.rows_b and self.checksum_a == self.checksum_b


def _show_key(key: bytes) -> str:
    text = repr(_decoder.decode(key))
    return text if len(text) <= 80 else text[:77] + "..."


def compare_items(cache: str, a: Iterator[tuple[bytes, bytes]], b: Iterator[tuple[bytes, bytes]]) -> CacheDiff:
    """Key-by-key comparison of two key-ordered streams."""
    result = CacheDiff(cache, 0, 0, "", "", 0, 0, 0)
    sum_a = sum_b = 0
    ka = next(a, None)
    kb = next(b, None)
    while ka is not None or kb is not None:
        if kb is None or (ka is not None and ka[0] < kb[0]):
            assert ka is not None
            what, key = "only in A", ka[0]
            sum_a = (sum_a + pair_hash(*ka)) & _MASK
            result.rows_a += 1
            result.only_a = (result.only_a or 0) + 1
            ka = next(a, None)
        elif ka is None or kb[0] < ka[0]:
            what, key = "only in B", kb[0]
            sum_b = (sum_b + pair_hash(*kb)) & _MASK
            result.rows_b += 1
            result.only_b = (result.only_b or 0) + 1
            kb = next(b, None)
        else:
            what, key = ("different", ka[0]) if ka[1] != kb[1] else ("", b"")
            if what:
                result.different = (result.different or 0) + 1
            sum_a = (sum_a + pair_hash(*ka)) & _MASK
            sum_b = (sum_b + pair_hash(*kb)) & _MASK
            result.rows_a += 1
            result.rows_b += 1
            ka, kb = next(a, None), next(b, None)
        if what and len(result.examples) < 5:
            result.examples.append(f"{_show_key(key)}: {what}")
    result.checksum_a, result.checksum_b = f"{sum_a:016x}", f"{sum_b:016x}"
    return result


def compare_digests(cache: str, a: dict[str, Any] | None, b: dict[str, Any] | None) -> CacheDiff:
    a = a or {"rows": 0, "checksum": f"{0:016x}"}
    b = b or {"rows": 0, "checksum": f"{0:016x}"}
    return CacheDiff(cache, a["rows"], b["rows"], a["checksum"], b["checksum"])
