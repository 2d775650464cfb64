"""``cdcd kafka-to-node``: apply a cdcd Kafka topic to a node."""

from __future__ import annotations

from pathlib import Path

import click

from cdcd.cli.exits import fail_on
from cdcd.cli.process import log_to_stderr, on_stop_signals, serve_metrics, stop_timeout_option


@click.command("kafka-to-node")
@click.option("--config", "config_path", required=True, type=click.Path(path_type=Path), help="kafka-to-node TOML.")
@click.option("--partitions", default=None, metavar="FROM-TO", help="Kafka partitions to read (overrides the config).")
@click.option("--threads", type=click.IntRange(1, 256), default=None, help="Reader threads (overrides the config).")
@click.option(
    "--no-metadata",
    is_flag=True,
    help="Do not read the metadata topic (metadata = false): the target creates caches with its default partitions.",
)
@click.option("--log-format", type=click.Choice(["json", "console"]), default=None, help="Default: console on a TTY.")
@stop_timeout_option
def kafka_to_node(
    *,
    config_path: Path,
    partitions: str | None,
    threads: int | None,
    no_metadata: bool,
    log_format: str | None,
    stop_timeout: float,
) -> None:
    """Apply a cdcd Kafka topic to a node through its replication endpoint (kafka-to-ignite's twin).

    Offsets are committed after the target confirmed; a restart re-applies at most the last
    batches, which the target's resolver counts as duplicates. Exit codes: 0 stopped (SIGTERM),
    128 + the signal when not stopped within --stop-timeout, 1 Kafka or the target failing past
    retry_timeout_s, or a topic (the metadata topic too, unless --no-metadata) that does not exist,
    2 bad config (or metrics port in use).
    """
    from cdcd import metrics
    from cdcd.config import read_toml
    from cdcd.kafka.options import KafkaToNodeOptions
    from cdcd.kafka.to_node import KafkaToNode

    log_to_stderr(log_format)
    try:
        table = read_toml(config_path)
        if partitions is not None:
            table["partitions"] = partitions
        if threads is not None:
            table["threads"] = threads
        if no_metadata:
            table["metadata"] = False
        opts = KafkaToNodeOptions.load(table, str(config_path))
        app = KafkaToNode(opts, str(config_path))
    except Exception as exc:
        fail_on(exc)
    # A target or broker call that never returns must not hold a stop (systemd's TimeoutStopSec, an operator's
    # Ctrl-C): the offsets of what was applied and not committed are re-applied at the next start, as after a crash.
    on_stop_signals(
        lambda _signal: app.stop(),
        bound_s=stop_timeout,
        what=f"kafka-to-node of {config_path}",
        hint="the next start re-applies at most the batches in hand",
    )
    try:
        if opts.metrics_address:
            metrics.export(metrics.KAFKA_TO_NODE)
            metrics.export(metrics.REPLICATION_SENDER)
        serve_metrics(opts.metrics_address, config_path)
        app.run()
    except Exception as exc:
        fail_on(exc)
