"""lchat.metricsmerge: one scrape for a box of many processes, from real registries' text.

Each worker here is a real ``prometheus_client`` registry holding the data plane's real
collectors (``FrontDoorState``'s, counters and gauges named as lchat registers them) and a process
collector whose start time the test sets, rendered with ``generate_latest`` as a worker's
``/metrics`` answers; the merged scrape is read back with ``prometheus_client``'s parser.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from twisted.trial.unittest import SynchronousTestCase

from lchat.metricsmerge import MergedMetrics, MetricsTextError
from lchat.proxy.state import FrontDoorState

BUCKETS = (0.01, 0.1, 1.0)


class _Process:
    """A process collector with set figures (the real one reads this test's own /proc)."""

    def __init__(self, start: float, cpu: float) -> None:
        self.start = start
        self.cpu = cpu

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("process_start_time_seconds", "Start time", value=self.start)
        yield CounterMetricFamily("process_cpu_seconds", "CPU time", value=self.cpu)
        yield GaugeMetricFamily("process_open_fds", "Open fds", value=12)


class Process:
    """One process's registry: what a worker's ``GET /metrics`` renders, or control's own."""

    def __init__(self, start: float | None = 1000.0, cpu: float = 1.5) -> None:
        self.registry = CollectorRegistry()
        self.front = FrontDoorState()
        self.registry.register(self.front.collector)
        self.process = _Process(start or 0.0, cpu)
        if start is not None:  # None: a platform without the process figures
            self.registry.register(self.process)
        self.failures = Counter(
            "lchat_tls_handshake_failures_total",
            "TLS handshakes that did not complete",
            ["reason"],
            registry=self.registry,
        )
        self.held = Gauge("lchat_tls_held_handshakes", "Handshakes held", registry=self.registry)
        self.routes = Gauge("lchat_routes", "Registry rows", ["status"], registry=self.registry)
        self.reloads = Counter(
            "lchat_registry_reloads_total", "Reloads", ["outcome"], registry=self.registry
        )
        self.dial = Histogram(
            "lchat_upstream_dial_seconds",
            "Dial time",
            ["kind"],
            buckets=BUCKETS,
            registry=self.registry,
        )

    def requests(self, host_class: str, status: int, n: int) -> None:
        for _ in range(n):
            self.front.stats.count(host_class, status)

    def text(self) -> bytes:
        return generate_latest(self.registry)


def scrape(merged: MergedMetrics) -> dict[str, Metric]:
    """The merged scrape parsed back, by family; fails on a family emitted twice."""
    families: dict[str, Metric] = {}
    for family in text_string_to_metric_families(generate_latest(merged).decode()):
        assert family.name not in families, f"{family.name} emitted twice"
        families[family.name] = family
    return families


def value(families: dict[str, Metric], sample: str, **labels: str) -> float | None:
    for family in families.values():
        for s in family.samples:
            if s.name == sample and s.labels == labels:
                return s.value
    return None


class SumTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.control = Process(start=500.0)
        self.merged = MergedMetrics(self.control.registry)
        self.w1 = Process(start=1000.0)
        self.w2 = Process(start=1001.0)

    def test_data_plane_families_are_summed_with_controls(self) -> None:
        self.control.requests("instance", 200, 2)
        self.w1.requests("instance", 200, 5)
        self.w2.requests("instance", 200, 7)
        self.w2.requests("service", 404, 1)
        self.w1.front.stats.connections = 3
        self.w2.front.stats.connections = 4
        self.w1.failures.labels("eof").inc(2)
        self.w2.failures.labels("eof").inc()
        self.w2.failures.labels("no_cert").inc()
        self.w1.held.set(1)
        self.w2.held.set(2)
        self.merged.update(1, self.w1.text())
        self.merged.update(2, self.w2.text())
        got = scrape(self.merged)
        total = "lchat_http_requests_total"
        self.assertEqual(value(got, total, host_class="instance", code="200"), 14)
        self.assertEqual(value(got, total, host_class="service", code="404"), 1)
        self.assertEqual(value(got, "lchat_http_connections"), 7)
        fails = "lchat_tls_handshake_failures_total"
        self.assertEqual(value(got, fails, reason="eof"), 3)
        self.assertEqual(value(got, fails, reason="no_cert"), 1)
        self.assertEqual(value(got, "lchat_tls_held_handshakes"), 3)

    def test_workers_hop_rows_are_dropped_and_controls_hop_door_counts_them(self) -> None:
        # A worker counts what it handed control as host_class="hop"; control's hop door counts
        # the same requests with their true labels: the box counts each request once.
        self.w1.requests("hop", 200, 4)
        self.w1.requests("instance", 200, 1)
        self.control.requests("instance", 200, 4)
        self.merged.update(1, self.w1.text())
        got = scrape(self.merged)
        total = "lchat_http_requests_total"
        self.assertIsNone(value(got, total, host_class="hop", code="200"))
        self.assertEqual(value(got, total, host_class="instance", code="200"), 5)

    def test_control_plane_families_are_controls_alone(self) -> None:
        self.control.routes.labels("ready").set(3)
        self.w1.routes.labels("ready").set(3)
        self.w1.reloads.labels("ok").inc(9)
        self.merged.update(1, self.w1.text())
        got = scrape(self.merged)
        self.assertEqual(value(got, "lchat_routes", status="ready"), 3)
        self.assertIsNone(value(got, "lchat_registry_reloads_total", outcome="ok"))

    def test_process_families_are_labelled_by_worker(self) -> None:
        self.w1.process.cpu = 2.0
        self.w2.process.cpu = 3.0
        self.merged.update(1, self.w1.text())
        self.merged.update(2, self.w2.text())
        got = scrape(self.merged)
        cpu = "process_cpu_seconds_total"
        self.assertEqual(value(got, cpu), 1.5)  # control's own, unlabelled
        self.assertEqual(value(got, cpu, worker="1"), 2.0)
        self.assertEqual(value(got, cpu, worker="2"), 3.0)
        self.assertEqual(value(got, "process_start_time_seconds", worker="2"), 1001.0)

    def test_histograms_merge_bucket_by_bucket(self) -> None:
        self.control.dial.labels("hop").observe(0.05)
        self.w1.dial.labels("instance").observe(0.005)
        self.w1.dial.labels("instance").observe(0.5)
        self.w2.dial.labels("instance").observe(0.05)
        self.w2.dial.labels("hop").observe(2.0)
        self.merged.update(1, self.w1.text())
        self.merged.update(2, self.w2.text())
        got = scrape(self.merged)
        family = got["lchat_upstream_dial_seconds"]
        self.assertEqual(family.type, "histogram")
        instance = [s for s in family.samples if s.labels.get("kind") == "instance"]
        self.assertEqual(
            [(s.name, s.labels.get("le"), s.value) for s in instance],
            [
                ("lchat_upstream_dial_seconds_bucket", "0.01", 1),
                ("lchat_upstream_dial_seconds_bucket", "0.1", 2),
                ("lchat_upstream_dial_seconds_bucket", "1.0", 3),
                ("lchat_upstream_dial_seconds_bucket", "+Inf", 3),
                ("lchat_upstream_dial_seconds_count", None, 3),
                ("lchat_upstream_dial_seconds_sum", None, 0.555),
            ],
        )
        self.assertEqual(value(got, "lchat_upstream_dial_seconds_count", kind="hop"), 2)
        self.assertEqual(value(got, "lchat_upstream_dial_seconds_bucket", kind="hop", le="0.1"), 1)

    def test_a_families_creation_times_are_controls_only(self) -> None:
        self.w1.failures.labels("eof").inc()
        self.merged.update(1, self.w1.text())
        got = scrape(self.merged)
        # Control's counter has no "eof" series: the workers' creation time is not emitted
        # (they do not add up), and no worker's _created family is emitted beside control's.
        self.assertIsNone(value(got, "lchat_tls_handshake_failures_created", reason="eof"))
        self.control.failures.labels("eof").inc()
        got = scrape(self.merged)
        self.assertIsNotNone(value(got, "lchat_tls_handshake_failures_created", reason="eof"))
        self.assertEqual(value(got, "lchat_tls_handshake_failures_total", reason="eof"), 2)

    def test_a_family_only_workers_have_is_emitted_once(self) -> None:
        for w in (self.w1, self.w2):
            Counter("lchat_proxy_reroutes_total", "Reroutes", ["why"], registry=w.registry).labels(
                "refused"
            ).inc()
        self.merged.update(1, self.w1.text())
        self.merged.update(2, self.w2.text())
        got = scrape(self.merged)
        self.assertEqual(value(got, "lchat_proxy_reroutes_total", why="refused"), 2)
        self.assertEqual(got["lchat_proxy_reroutes"].type, "counter")

    def test_a_worker_family_of_another_type_than_controls_is_left_out(self) -> None:
        # A worker of another build that made a counter a gauge: control's family stands alone
        # rather than being emitted twice or mixed.
        text = b"# TYPE lchat_http_requests gauge\nlchat_http_requests 99\n"
        self.control.requests("instance", 200, 1)
        self.merged.update(1, text)
        got = scrape(self.merged)
        self.assertEqual(got["lchat_http_requests"].type, "counter")
        self.assertEqual(
            value(got, "lchat_http_requests_total", host_class="instance", code="200"), 1
        )

    def test_unreadable_text_is_refused_and_keeps_the_earlier_figures(self) -> None:
        self.w1.requests("instance", 200, 3)
        self.merged.update(1, self.w1.text())
        with self.assertRaises(MetricsTextError) as caught:
            self.merged.update(1, b"<html>oops</html>\n")
        self.assertIn("worker 1", str(caught.exception))
        got = scrape(self.merged)
        total = "lchat_http_requests_total"
        self.assertEqual(value(got, total, host_class="instance", code="200"), 3)
        self.assertIsNone(value(got, "process_open_fds", worker="1"))  # not answering


class RestartTests(SynchronousTestCase):
    """Box counters never go down: a worker's run ending carries its counters."""

    def setUp(self) -> None:
        self.control = Process(start=500.0)
        self.merged = MergedMetrics(self.control.registry)
        self.total = "lchat_http_requests_total"

    def served(self) -> float | None:
        return value(scrape(self.merged), self.total, host_class="instance", code="200")

    def test_an_ended_runs_counters_are_carried(self) -> None:
        old = Process(start=1000.0)
        old.requests("instance", 200, 10)
        old.front.stats.connections = 5
        self.merged.update(1, old.text())
        self.assertEqual(self.served(), 10)
        self.merged.ended(1)
        got = scrape(self.merged)
        self.assertEqual(value(got, self.total, host_class="instance", code="200"), 10)
        self.assertEqual(value(got, "lchat_http_connections"), 0)  # control's own only
        self.assertIsNone(value(got, "process_start_time_seconds", worker="1"))
        new = Process(start=2000.0)
        new.requests("instance", 200, 3)
        self.merged.update(1, new.text())
        self.assertEqual(self.served(), 13)
        self.merged.ended(1)
        self.merged.ended(1)  # said twice: counted once
        self.assertEqual(self.served(), 13)

    def test_a_late_answer_of_an_ended_run_is_ignored(self) -> None:
        old = Process(start=1000.0)
        old.requests("instance", 200, 10)
        stale = old.text()
        self.merged.update(1, stale)
        self.merged.ended(1)
        self.merged.update(1, stale)  # a scrape that was in flight when the worker died
        self.assertEqual(self.served(), 10)

    def test_an_unreported_restart_is_seen_by_its_start_time(self) -> None:
        old = Process(start=1000.0)
        old.requests("instance", 200, 10)
        self.merged.update(1, old.text())
        new = Process(start=2000.0)
        new.requests("instance", 200, 12)  # more than before: only the start time tells
        self.merged.update(1, new.text())
        self.assertEqual(self.served(), 22)

    def test_without_start_times_a_counter_going_down_is_a_restart(self) -> None:
        old = Process(start=None)
        old.requests("instance", 200, 10)
        self.merged.update(1, old.text())
        new = Process(start=None)
        new.requests("instance", 200, 4)
        self.merged.update(1, new.text())
        self.assertEqual(self.served(), 14)

    def test_an_overtaken_answer_of_the_same_run_is_ignored(self) -> None:
        w = Process(start=1000.0)
        w.requests("instance", 200, 10)
        older = w.text()
        w.requests("instance", 200, 5)
        w.front.stats.connections = 2
        self.merged.update(1, w.text())
        self.merged.update(1, older)  # two scrapes at once: the first asked answered last
        self.assertEqual(self.served(), 15)
        self.assertEqual(value(scrape(self.merged), "lchat_http_connections"), 2)
        w.requests("instance", 200, 1)
        self.merged.update(1, w.text())
        self.assertEqual(self.served(), 16)

    def test_a_worker_missing_from_a_scrape_keeps_its_counters_and_drops_its_gauges(self) -> None:
        w1, w2 = Process(start=1000.0), Process(start=1001.0)
        for w, n in ((w1, 4), (w2, 6)):
            w.requests("instance", 200, n)
            w.front.stats.connections = n
        self.merged.update(1, w1.text())
        self.merged.update(2, w2.text())
        got = scrape(self.merged)
        self.assertEqual(value(got, "lchat_http_connections"), 10)
        # The next scrape: worker 2 does not answer.
        w1.requests("instance", 200, 1)
        self.merged.update(1, w1.text())
        self.merged.update(2, None)
        got = scrape(self.merged)
        self.assertEqual(value(got, self.total, host_class="instance", code="200"), 11)
        self.assertEqual(value(got, "lchat_http_connections"), 4)
        self.assertIsNone(value(got, "process_open_fds", worker="2"))
        self.assertEqual(value(got, "process_open_fds", worker="1"), 12)
        # And it answers again: its gauges are back, its counters were never lost.
        self.merged.update(1, w1.text())
        self.merged.update(2, w2.text())
        got = scrape(self.merged)
        self.assertEqual(value(got, "lchat_http_connections"), 10)
        self.assertEqual(value(got, self.total, host_class="instance", code="200"), 11)

    def test_a_restarted_workers_histogram_is_carried(self) -> None:
        old = Process(start=1000.0)
        old.dial.labels("instance").observe(0.5)
        self.merged.update(1, old.text())
        self.merged.ended(1)
        new = Process(start=2000.0)
        new.dial.labels("instance").observe(0.05)
        self.merged.update(1, new.text())
        got = scrape(self.merged)
        count = "lchat_upstream_dial_seconds_count"
        self.assertEqual(value(got, count, kind="instance"), 2)
        bucket = "lchat_upstream_dial_seconds_bucket"
        self.assertEqual(value(got, bucket, kind="instance", le="0.1"), 1)
        self.assertEqual(value(got, bucket, kind="instance", le="1.0"), 2)


class RoundTripTests(SynchronousTestCase):
    def test_the_whole_scrape_parses_with_every_family_once(self) -> None:
        control = Process(start=500.0)
        control.requests("instance", 200, 1)
        merged = MergedMetrics(control.registry)
        for slot in (1, 2, 3):
            w = Process(start=1000.0 + slot)
            w.requests("instance", 200, slot)
            w.requests("hop", 502, 1)
            w.failures.labels("eof").inc()
            w.dial.labels("instance").observe(0.2)
            w.routes.labels("ready").set(1)
            merged.update(slot, w.text())
        merged.ended(2)
        families = scrape(merged)  # asserts each family once
        self.assertIn("lchat_http_requests", families)
        self.assertIn("process_cpu_seconds", families)
        self.assertEqual(
            value(families, "lchat_http_requests_total", host_class="instance", code="200"), 7
        )
        # Rendered twice, the same text: collecting changes nothing.
        self.assertEqual(generate_latest(merged), generate_latest(merged))
