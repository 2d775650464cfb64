"""Child-process entry points of the chaos suite."""

from __future__ import annotations

import os


def node_main() -> None:
    """``tests.support.realtime.node_main`` (same arguments), serving the node's Prometheus metrics on
    ``127.0.0.1:$CHAOS_NODE_METRICS_PORT`` when that is set."""
    port = os.environ.get("CHAOS_NODE_METRICS_PORT")
    if port:
        from prometheus_client import start_http_server

        start_http_server(int(port), addr="127.0.0.1")
    from tests.support.realtime import node_main as realtime_node_main

    realtime_node_main()
