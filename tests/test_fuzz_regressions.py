"""The WAL reader's fuzz contract in CI: replay of every saved fuzz input, a short hypothesis fuzz of each
target, and corrupted archived segments through a real ``cdcd run``.

The long run is ``make fuzz`` (``python -m tests.fuzz.run``); see ``tests/support/wal_fuzz.py`` for the
contract each target checks. Files under ``tests/data/fuzz/`` are ``<name>.bin`` (the target's input)
with a ``<name>.json`` sidecar: ``target``, ``expect`` ("contract": records or a typed error, as the
target documents) and, for hand-made inputs, the exact ``outcome``.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cdcd.wal import BadSegmentName, DataRecord, SegmentReader, WalError
from cdcd.wal.records import RECORD_TYPES
from cdcd.wal.segment import parse_segment_name
from tests.support.config import jsonl_consumer, write_daemon_config
from tests.support.procs import error_lines, run_daemon_until_exit
from tests.support.wal import cdc_links
from tests.support.wal_fuzz import (
    TARGETS,
    FuzzFailure,
    RandomChooser,
    mutate,
    read_segment,
    run_program,
    seeds,
    write_segment,
)
from tests.support.writer import make_node

DATA = Path(__file__).parent / "data" / "fuzz"
PROGRAM_MAX = 256
HYPOTHESIS_EXAMPLES = {"segment": 6000, "memory": 1000, "wal_dir": 1000, "name": 3000, "lake_rows": 3000}
"""14,000 cases in all, ~20 s on this 2-core machine (~30 s under load); ``make fuzz`` runs a million."""
E2E_MUTATIONS = 20


def regression_files() -> list[Path]:
    return sorted(DATA.glob("*.bin"))


def sidecar(path: Path) -> dict[str, Any]:
    meta: dict[str, Any] = json.loads(path.with_suffix(".json").read_text())
    return meta


# --- replay --------------------------------------------------------------------------------------------
def test_regression_corpus_is_complete() -> None:
    """Every saved input has a sidecar naming a known target and every sidecar its input, and the corpus holds
    the hand-made cases (huge length, short header, torn tail) as well as what the fuzzer found."""
    bins = {p.stem for p in DATA.glob("*.bin")}
    jsons = {p.stem for p in DATA.glob("*.json")}
    assert bins == jsons, f"unpaired files: {sorted(bins ^ jsons)}"
    assert len(bins) >= 8
    for path in regression_files():
        meta = sidecar(path)
        assert meta["target"] in TARGETS, path.name
        assert meta["expect"] == "contract", path.name
    names = " ".join(sorted(bins))
    assert "huge-length" in names and "short-header" in names and "torn-tail" in names


@pytest.mark.parametrize("path", regression_files(), ids=lambda p: p.stem)
def test_regression_file_keeps_the_contract(path: Path) -> None:
    """A saved input (a past failure or a hand-made edge case) passes its target's contract, with the recorded
    outcome where the sidecar gives one."""
    meta = sidecar(path)
    data = path.read_bytes()
    failure: FuzzFailure | None = None
    try:
        TARGETS[meta["target"]].check(data)
    except FuzzFailure as f:
        failure = f
    if failure is not None:
        pytest.fail(f"{path.name} ({meta.get('note', '')}): {failure.kind}: {failure.detail}", pytrace=False)
    outcome = meta.get("outcome")
    if outcome is None:
        return
    if meta["target"] == "segment":
        seg = write_segment(data)
        try:
            got = {mode: read_segment(seg, archived=mode == "archived").describe() for mode in ("archived", "active")}
        finally:
            seg.unlink()
        assert got == outcome, meta.get("note")
    elif meta["target"] == "name":
        try:
            index: int | None = parse_segment_name(os.fsdecode(data))
        except BadSegmentName:
            index = None
        assert {"segment": index} == outcome, meta.get("note")


def test_seeds_hold_every_record_type_and_read_back_exactly() -> None:
    """The valid segments the fuzzer mutates are written by the real WalWriter, read back record for record, and
    together hold every record type, including a DataRecord with several entries."""
    found: set[int] = set()
    for s in seeds():
        o = read_segment(write_segment(s.data, "seeds"), archived=s.archived)
        assert o.error is None and [r for _, r in o.records] == list(s.records), s.segment
        assert o.ended == s.archived
        found |= {r.TYPE for r in s.records}
    assert found == set(RECORD_TYPES)
    assert any(type(r) is DataRecord and len(r.entries) >= 5 for s in seeds() for r in s.records)


# --- a short fuzz of each target --------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(TARGETS))
def test_short_hypothesis_fuzz(name: str) -> None:
    """A few hundred to a few thousand hypothesis-driven cases of the target keep its contract: records or typed
    errors only, no hang, bounded memory, names refused unless exactly 16 ASCII digits + .wal."""
    target = TARGETS[name]

    @settings(
        max_examples=HYPOTHESIS_EXAMPLES[name],
        database=None,
        deadline=None,
        derandomize=False,
        suppress_health_check=list(HealthCheck),
    )
    @given(st.binary(max_size=PROGRAM_MAX))
    def fuzz(program: bytes) -> None:
        run_program(target, program)

    fuzz()


# --- end to end: a corrupted archived segment under `cdcd run` ---------------------------------------------
@pytest.fixture(scope="module")
def node_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    node_dir = tmp_path_factory.mktemp("fuzz-node") / "node"
    make_node(node_dir, segments=3, tx_per_segment=3)
    return node_dir


def _detected_corruption(original: bytes, path: Path, rnd: random.Random) -> WalError:
    """Mutate the segment at ``path`` until the reader rejects it the same way with and without skipping
    DataRecords (the daemon reads PASSIVE first) and everything before the error is the original's records
    (so the daemon meets the corruption itself, not a valid but different record)."""
    good = [r for _, r in SegmentReader(path)]
    for _ in range(1000):
        data = mutate(original, RandomChooser(rnd))
        path.write_bytes(data)
        plain = read_segment(path, archived=True)
        skipping = read_segment(path, archived=True, skip_types=frozenset({DataRecord.TYPE}))
        before = [r for _, r in plain.records]
        if plain.error is not None and plain.error_key() == skipping.error_key() and before == good[: len(before)]:
            return plain.error
    raise AssertionError("no detectable mutation in 1000 tries")


def test_corrupted_archived_segment_stops_the_daemon_with_one_error_line(tmp_path: Path, node_template: Path) -> None:
    """For 20 random corruptions of an archived segment in the CDC dir, `cdcd run` exits 5 with exactly one
    `cdcd: error:` line that names the file and offset the reader reports, and no traceback."""
    for i in range(E2E_MUTATIONS):
        rnd = random.Random(f"e2e-{i}")
        case = tmp_path / f"case{i}"
        cdc = case / "cdc"
        cdc.mkdir(parents=True)
        for link in cdc_links(node_template).values():
            shutil.copyfile(link, cdc / link.name)  # copies: the template's archive stays intact
        victim = cdc / sorted(p.name for p in cdc.iterdir())[rnd.randrange(3)]
        error = _detected_corruption(victim.read_bytes(), victim, rnd)
        config = write_daemon_config(
            case / "cdcd.toml",
            node_template,
            jsonl_consumer(case / "out.jsonl"),
            cdc_dir=str(cdc),
            state_dir=str(case / "state"),
        )
        err = case / "run.err"
        rc = run_daemon_until_exit(config, err, timeout=20)
        text = err.read_text()
        assert rc == 5, f"mutation {i} ({error}): exit {rc}\n{text[-3000:]}"
        assert error_lines(err) == [f"cdcd: error: {error}"], f"mutation {i}\n{text[-3000:]}"
        assert str(error).startswith(f"{victim} at offset {error.offset}: ")
        assert "Traceback" not in text, f"mutation {i}\n{text[-3000:]}"
