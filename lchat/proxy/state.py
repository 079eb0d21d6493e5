"""What every connection of the front door shares: its hot figures and its bulk read buffers.

One :class:`FrontDoorState` per router serves both listeners (HTTP and HTTPS) and the upstream
pool: lchat/tap.py gives it to each (a factory or pool made without one has its own: a test's).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from lchat.proxy.bulk import Buffers
from lchat.proxy.hot import HotStats

Report = Literal["all", "requests"]


class _Collector(Collector):
    def __init__(self, stats: HotStats, report: Report = "all") -> None:
        self._stats = stats
        self._report = report

    def describe(self) -> list[CounterMetricFamily | GaugeMetricFamily]:
        # Undescribed: the registry does not check its names against others'. One router runs
        # per process; a test running two in one (tests/test_acme.py) registers both.
        return []

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        stats = self._stats
        requests = CounterMetricFamily(
            "lchat_http_requests",
            "Requests answered, by host class and status",
            labels=["host_class", "code"],
        )
        for (host_class, status), count in sorted(stats.requests.items()):
            requests.add_metric([host_class, str(status)], count)
        yield requests
        if self._report == "requests":
            return
        yield GaugeMetricFamily(
            "lchat_http_in_flight", "Requests being served right now", value=stats.in_flight
        )
        relayed = CounterMetricFamily(
            "lchat_proxy_bytes", "Body bytes relayed", labels=["direction"]
        )
        relayed.add_metric(["up"], stats.bytes_up)
        relayed.add_metric(["down"], stats.bytes_down)
        yield relayed
        one_read = CounterMetricFamily(
            "lchat_proxy_one_read_responses",
            "Responses relayed whole in one write by the one-read path, by their head: as it "
            "came, or spliced (a server's usual hop-by-hop lines taken out); the rest of the "
            "requests answered went the general way",
            labels=["head"],
        )
        one_read.add_metric(["as_sent"], stats.one_read - stats.one_read_spliced)
        one_read.add_metric(["spliced"], stats.one_read_spliced)
        yield one_read
        yield GaugeMetricFamily(
            "lchat_upgraded_connections",
            "Open upgraded (WebSocket) connections",
            value=stats.upgraded,
        )
        yield GaugeMetricFamily(
            "lchat_http_connections", "Open client connections", value=stats.connections
        )
        yield CounterMetricFamily(
            "lchat_http_connections_accepted",
            "Client connections accepted (lchat_http_connections: those open now)",
            value=stats.accepted,
        )
        handshakes = CounterMetricFamily(
            "lchat_tls_handshakes",
            "TLS client connections served, by their handshake: a resumed session or a full one",
            labels=["resumed"],
        )
        handshakes.add_metric(["yes"], stats.tls_resumed)
        handshakes.add_metric(["no"], stats.tls_full)
        yield handshakes
        yield CounterMetricFamily(
            "lchat_tls_closed_at_once",
            "TLS client connections closed once the last answer and our close_notify were "
            "written, without waiting for the client's close_notify (the client said it closes)",
            value=stats.tls_closed_at_once,
        )
        yield GaugeMetricFamily(
            "lchat_upstream_idle_connections",
            "Idle pooled upstream connections",
            value=stats.idle_upstream,
        )


class FrontDoorState:
    """The front door's shared figures (``stats``, which ``collector`` reports to a Prometheus
    registry: the router's front door registers it while it runs, lchat.shutdown.FrontDoor) and
    read buffers (``buffers``, lchat.proxy.bulk).

    ``report="requests"``: the collector reports ``lchat_http_requests`` only. The control
    process's hop door (lchat.controlhop) counts the requests its workers hand it there with
    their true labels (instance, peer, wake_...); every other figure of the box is the workers'
    own (a connection, a byte relayed, a handshake is counted once, where the client is)."""

    __slots__ = ("buffers", "collector", "stats")

    def __init__(self, report: Report = "all") -> None:
        self.stats = HotStats()
        self.buffers = Buffers()
        self.collector: Collector = _Collector(self.stats, report)
