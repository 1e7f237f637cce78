"""One ``/metrics`` for a group of workers: how the supervisor adds up the files its
workers write (``idembus run --workers N --metrics-port P``), without any worker process.
The whole command on RabbitMQ and PostgreSQL: tests/test_workers_metrics.py."""

from __future__ import annotations

import logging
import pathlib

import httpx
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from idembus.errors import ConfigurationError
from idembus.observability.metrics_group import GroupMetrics, GroupMetricsServer
from idembus.observability.metrics_snapshots import METRICS_FILE, SnapshotWriter
from idembus.observability.prometheus import prometheus_meter_provider

WORKER = """\
# HELP idembus_messages_handled_total Messages handled
# TYPE idembus_messages_handled_total counter
idembus_messages_handled_total{{endpoint="orders",handler="Orders"}} {handled}
# HELP idembus_message_handling_duration_seconds Handling time
# TYPE idembus_message_handling_duration_seconds histogram
idembus_message_handling_duration_seconds_bucket{{endpoint="orders",le="0.1"}} {fast}
idembus_message_handling_duration_seconds_bucket{{endpoint="orders",le="+Inf"}} {handled}
idembus_message_handling_duration_seconds_count{{endpoint="orders"}} {handled}
idembus_message_handling_duration_seconds_sum{{endpoint="orders"}} {seconds}
# HELP idembus_messages_in_flight Deliveries being processed
# TYPE idembus_messages_in_flight gauge
idembus_messages_in_flight{{endpoint="orders"}} {in_flight}
"""


def worker_text(handled: int, fast: int = 0, seconds: float = 0.0, in_flight: int = 0) -> str:
    return WORKER.format(handled=handled, fast=fast, seconds=seconds, in_flight=in_flight)


class Group:
    """A :class:`GroupMetrics` and the workers a test pretends to run."""

    def __init__(self, directory: pathlib.Path) -> None:
        self.metrics = GroupMetrics(directory)
        self.files: dict[int, pathlib.Path] = {}
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.metrics)

    def start(self, index: int, pid: int) -> None:
        self.files[index] = pathlib.Path(self.metrics.starting(index)[METRICS_FILE])
        self.metrics.started(index, pid)

    def write(self, index: int, text: str) -> None:
        self.files[index].write_text(text)

    def scrape(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """What Prometheus would read: value by (sample name, labels)."""
        text = generate_latest(self.registry).decode()
        return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
                for family in text_string_to_metric_families(text)
                for sample in family.samples}


@pytest.fixture
def group(tmp_path: pathlib.Path) -> Group:
    return Group(tmp_path)


HANDLED = ("idembus_messages_handled_total", (("endpoint", "orders"), ("handler", "Orders")))
COUNT = ("idembus_message_handling_duration_seconds_count", (("endpoint", "orders"),))
SUM = ("idembus_message_handling_duration_seconds_sum", (("endpoint", "orders"),))


def bucket(le: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    return ("idembus_message_handling_duration_seconds_bucket",
            (("endpoint", "orders"), ("le", le)))


def in_flight(worker: int, pid: int) -> tuple[str, tuple[tuple[str, str], ...]]:
    return ("idembus_messages_in_flight",
            (("endpoint", "orders"), ("pid", str(pid)), ("worker", str(worker))))


def test_counters_and_histograms_add_up_and_gauges_are_per_worker(group):
    # Given two workers, with 3 and 4 messages handled and one in flight each
    group.start(0, pid=100)
    group.start(1, pid=101)
    group.write(0, worker_text(3, fast=1, seconds=0.5, in_flight=1))
    group.write(1, worker_text(4, fast=4, seconds=0.25, in_flight=1))

    # When Prometheus scrapes the supervisor
    scraped = group.scrape()

    # Then the counter and every part of the histogram are the sums, without a worker label
    assert scraped[HANDLED] == 7
    assert scraped[bucket("0.1")] == 5
    assert scraped[bucket("+Inf")] == 7
    assert scraped[COUNT] == 7
    assert scraped[SUM] == 0.75
    # And the gauge is one series per worker, labelled with its index and pid
    assert scraped[in_flight(0, 100)] == 1
    assert scraped[in_flight(1, 101)] == 1
    assert not any(name == "idembus_messages_in_flight" and ("worker", "") in labels
                   for name, labels in scraped)


def test_a_worker_that_exits_leaves_its_counts_and_its_replacement_adds_to_them(group):
    # Given two workers that handled 3 and 4 messages
    group.start(0, pid=100)
    group.start(1, pid=101)
    group.write(0, worker_text(3, fast=3, seconds=0.5, in_flight=1))
    group.write(1, worker_text(4))
    assert group.scrape()[HANDLED] == 7

    # When worker 0 is killed and its replacement (a new process) starts from 0
    group.metrics.exited(0)
    scraped = group.scrape()
    assert scraped[HANDLED] == 7, "no counter may go backwards"
    assert in_flight(0, 100) not in scraped, "a dead process's gauges are dropped"
    group.start(0, pid=200)
    assert group.files[0] != pathlib.Path(group.files[1])
    group.write(0, worker_text(0))
    assert group.scrape()[HANDLED] == 7

    # Then what the replacement handles adds to what its predecessor had counted
    group.write(0, worker_text(2, fast=2, seconds=0.1, in_flight=0))
    scraped = group.scrape()
    assert scraped[HANDLED] == 9
    assert scraped[bucket("0.1")] == 5
    assert scraped[SUM] == pytest.approx(0.6)
    assert scraped[in_flight(0, 200)] == 0
    # And the dead worker's file is gone from the directory
    assert sorted(path.name for path in group.metrics.directory.iterdir()) == sorted(
        path.name for path in group.files.values())


def test_a_worker_that_wrote_nothing_yet_counts_nothing(group):
    group.start(0, pid=100)
    group.start(1, pid=101)
    group.write(1, worker_text(4))
    assert group.scrape()[HANDLED] == 4
    group.metrics.exited(0)  # died before its first snapshot
    assert group.scrape()[HANDLED] == 4


def test_a_file_that_does_not_parse_is_logged_and_skipped(group, caplog):
    group.start(0, pid=100)
    group.start(1, pid=101)
    group.write(0, worker_text(3))
    group.write(1, 'idembus_messages_handled_total{endpoint="orders" 3\n')
    with caplog.at_level(logging.WARNING, "idembus.observability.metrics_group"):
        assert group.scrape()[HANDLED] == 3
    assert "do not parse" in caplog.text


def test_quantiles_are_not_added_up_and_creation_times_stay_per_worker(group):
    # Given what prometheus_client writes for its own counters and a summary with a
    # quantile: creation times as gauges of their own
    text = ("# HELP jobs_total Jobs\n# TYPE jobs_total counter\njobs_total 2\n"
            "# HELP jobs_created Jobs\n# TYPE jobs_created gauge\njobs_created 1.7e9\n"
            "# HELP latency Latency\n# TYPE latency summary\n"
            'latency{quantile="0.5"} 0.2\nlatency_count 2\nlatency_sum 0.4\n')
    group.start(0, pid=100)
    group.start(1, pid=101)
    group.write(0, text)
    group.write(1, text)
    scraped = group.scrape()
    assert scraped[("jobs_total", ())] == 4
    assert scraped[("latency_count", ())] == 4
    assert scraped[("latency_sum", ())] == 0.8
    assert scraped[("jobs_created", (("pid", "100"), ("worker", "0")))] == 1.7e9
    assert ("jobs_created", ()) not in scraped
    assert not any(("quantile", "0.5") in labels for _, labels in scraped)


def test_a_snapshot_writer_replaces_its_file_whole_and_writes_once_more_at_stop(tmp_path):
    provider = prometheus_meter_provider("snapshots")
    counter = provider.get_meter("test").create_counter("test.snapshot.jobs")
    path = tmp_path / "worker-0-1.prom"
    writer = SnapshotWriter(path, provider, interval=3600).start()
    try:
        first = path.read_text()
        assert "process_cpu_seconds_total" in first
        assert "test_snapshot_jobs_total" not in first
        counter.add(5)
    finally:
        writer.stop()
    families = {family.name: family for family in
                text_string_to_metric_families(path.read_text())}
    assert families["test_snapshot_jobs"].samples[0].value == 5
    assert families["target_info"].samples[0].labels["service_name"] == "snapshots"
    assert [p.name for p in tmp_path.iterdir()] == [path.name], "no temporary file left"


def test_a_snapshot_writer_that_cannot_write_says_so_once(tmp_path, caplog):
    writer = SnapshotWriter(tmp_path / "gone" / "worker.prom", MeterProvider(), interval=3600)
    with caplog.at_level(logging.WARNING, "idembus.observability.metrics_snapshots"):
        writer.write()
        writer.write()
        writer.stop()
    assert caplog.text.count("cannot write this worker's metrics") == 1


def test_the_group_server_serves_the_sum_and_removes_its_directory_at_stop():
    server = GroupMetricsServer(0, "127.0.0.1")
    try:
        for index, handled in enumerate((3, 4)):
            path = pathlib.Path(server.starting(index)[METRICS_FILE])
            server.started(index, 100 + index)
            path.write_text(worker_text(handled))
        response = httpx.get(f"http://127.0.0.1:{server.port}/metrics", timeout=10)
        assert response.status_code == 200
        assert ('idembus_messages_handled_total{endpoint="orders",handler="Orders"} 7.0'
                in response.text)
    finally:
        server.stop()
    assert not server.group.directory.exists()


@pytest.mark.parametrize("port", [-1, 65536])
def test_a_port_out_of_range_is_a_configuration_error(port):
    with pytest.raises(ConfigurationError, match="--metrics-port must be within 0..65535"):
        GroupMetricsServer(port)
