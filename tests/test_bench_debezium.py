"""The arithmetic of ``make bench-kafka``'s steady state (``tests.bench.bench_debezium``), without a JVM: the
window runs between the counts actually read (not the thresholds), its CPU per row is the CPU spent inside it,
and cdcd's ratio is taken against the tuned Debezium, with the one against the defaults beside it. The whole
benchmark needs Debezium Server, PostgreSQL and a broker (``make bench-kafka ARGS="--quick --only backlog
--repeats 1"`` runs it small)."""

from __future__ import annotations

from tests.bench.bench_debezium import Mark, _backlog_sample, _ratios, _table


def test_the_steady_window_runs_between_the_counts_read() -> None:
    # cdcd counts whole Kafka transactions: the first read past the 100k warm-up saw 130k rows
    warm = Mark(t=12.0, rows=130_000, cpu={"process": 5.0, "walsender": 1.0})
    done = Mark(t=22.0, rows=1_100_000, cpu={"process": 14.7, "walsender": 1.97})
    s = _backlog_sample(1_100_000, t0=0.0, t_first=2.0, warm=warm, done=done, messages=1_100_000)
    assert s["steady_rows"] == 970_000 and s["steady_s"] == 10.0
    assert s["steady_rows_per_s"] == 97_000  # not 1M rows over the window: the rows counted in it
    assert s["steady_process_cpu_us_per_row"] == 10.0  # (14.7 - 5.0) s / 970k rows
    assert s["steady_walsender_cpu_us_per_row"] == 1.0
    assert s["rows_per_s"] == 55_000 and s["wall_s"] == 22.0 and s["cpu_s"] == 14.7


def test_the_claim_is_against_the_tuned_peer_and_the_table_has_both() -> None:
    def run(rate: float, cpu: float) -> dict[str, float]:
        return {"steady_rows_per_s": rate, "steady_process_cpu_us_per_row": cpu, "rows_per_s": rate}

    results = {
        "debezium.backlog": [run(4_000, 170.0), run(4_400, 160.0)],
        "debezium_tuned.backlog": [run(40_000, 20.0)],
        "cdcd.backlog": [run(100_000, 10.0)],
    }
    goals = _ratios(results)
    assert goals["steady_ratio_vs_tuned"] == {"value": 2.5, "goal": ">= 3", "met": False}
    assert goals["steady_ratio_vs_defaults"]["value"] == round(100_000 / 4_200, 2)
    table = _table(results).splitlines()
    assert table[0].split(" | ")[1:4] == [
        "Debezium Server 2.7, defaults",
        "Debezium Server 2.7, tuned",
        "cdcd (backlog: `cdcd run`; live: realtime)",
    ]
    steady = next(line for line in table if line.startswith("| steady-state rows/s"))
    assert steady.split(" | ")[1:4] == ["4,200 (4,000-4,400)", "40.0k", "100.0k"], steady
    assert not any(line.startswith("| live lag") for line in table)  # no live runs: no empty rows
