"""`idembus run --metrics-port N` serves the endpoint's metrics in the Prometheus text
format: scraped over HTTP and read with prometheus_client's own parser."""

from __future__ import annotations

import os
import pathlib
import queue
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from idembus.observability.metrics import Metrics
from idembus.observability.prometheus import MetricsServer
from idembus.pipeline import IncomingMessage, Middleware
from idembus.testing import wait_until_idle
from tests.support import AccountHandler, Deposit, SignalCounter

ROOT = pathlib.Path(__file__).resolve().parent.parent

APP = textwrap.dedent('''
    from idembus import Endpoint
    from idembus.observability.metrics import Metrics
    from idembus.pipeline import Middleware
    from idembus.storage.memory import MemoryStorage
    from tests.support import AccountHandler, Deposit


    class Announce(Middleware):
        """Prints each settled delivery, after every other middleware's after_message."""

        def after_message(self, incoming, error):
            print("settled", incoming.outcome, flush=True)


    def make(middleware=()):
        endpoint = Endpoint("metrics-app", storage=MemoryStorage(), handlers=[AccountHandler],
                            middleware=[Announce(), *middleware])
        endpoint.transport.declare(endpoint.name)
        for index in range(5):  # wait in memory:// until the endpoint runs
            endpoint.bus.send(Deposit(account=f"a{index}", amount=index),
                              message_id=f"deposit-{index}")
        endpoint.bus.send(Deposit(account="a0", amount=0), message_id="deposit-0")  # again
        return endpoint


    def with_metrics():
        return make([Metrics()])


    def without_metrics():
        return make()
''')

SERVING = re.compile(r"serving metrics for Prometheus at http://[^:]+:(\d+)/metrics")


@pytest.fixture
def app_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    (tmp_path / "metrics_app.py").write_text(APP)
    return tmp_path


class Command:
    """``python -m idembus ARGS`` with its stdout and stderr read line by line."""

    def __init__(self, *args: str, cwd: pathlib.Path, python: tuple[str, ...] = ("-m",
                                                                              "idembus")):
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.process = subprocess.Popen([sys.executable, *python, *args], cwd=cwd, env=env,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True)
        self.stdout: queue.Queue[str] = queue.Queue()
        self.stderr: list[str] = []
        self._port: queue.Queue[int] = queue.Queue()
        self._readers = [threading.Thread(target=self._read_stdout, daemon=True),
                         threading.Thread(target=self._read_stderr, daemon=True)]
        for reader in self._readers:
            reader.start()

    def _read_stdout(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.stdout.put(line.strip())

    def _read_stderr(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.stderr.append(line)
            found = SERVING.search(line)
            if found:
                self._port.put(int(found.group(1)))

    def port(self) -> int:
        """The port the command logged it serves metrics on."""
        try:
            return self._port.get(timeout=30)
        except queue.Empty:
            raise AssertionError(f"no metrics port logged: {''.join(self.stderr)}") from None

    def settled(self, count: int) -> list[str]:
        """The outcomes of the first ``count`` deliveries the app announced."""
        return [self.stdout.get(timeout=30) for _ in range(count)]

    def exit_status(self, timeout: float = 30) -> int:
        status = self.process.wait(timeout=timeout)
        for reader in self._readers:
            reader.join(timeout)
        return status

    def kill(self) -> None:
        """Kill the command if it still runs; close its pipes."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for reader in self._readers:
            reader.join()
        for pipe in (self.process.stdout, self.process.stderr):
            if pipe is not None:
                pipe.close()


def scrape(port: int) -> dict[str, list[Sample]]:
    """GET /metrics, parsed by prometheus_client: samples by sample name."""
    response = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples: dict[str, list[Sample]] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def total(samples: dict[str, list[Sample]], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(sample.value for sample in samples.get(name, [])
               if all(sample.labels.get(key) == value for key, value in labels.items()))


# -- the command ---------------------------------------------------------------------------


def test_run_serves_the_endpoint_s_metrics_to_prometheus(app_dir):
    # Given an endpoint with 5 deposits and a duplicate waiting, run with --metrics-port 0
    command = Command("run", "metrics_app:with_metrics", "--metrics-port", "0",
                      "--metrics-host", "127.0.0.1", cwd=app_dir)
    try:
        port = command.port()
        assert command.settled(6) == ["settled handled"] * 6

        # When Prometheus scrapes it
        samples = scrape(port)

        # Then the counters match what was sent, by endpoint, message type and handler
        mine = {"endpoint": "metrics-app", "message_type": "test.Deposit"}
        assert total(samples, "idembus_messages_received_total", **mine) == 6
        assert total(samples, "idembus_messages_handled_total", handler="AccountHandler",
                     **mine) == 5
        assert total(samples, "idembus_messages_duplicates_total", handler="AccountHandler",
                     **mine) == 1
        assert total(samples, "idembus_messages_failed_total") == 0
        assert total(samples, "idembus_messages_dead_lettered_total") == 0
        # And the histograms and the gauge are there, in seconds
        assert total(samples, "idembus_message_handling_duration_seconds_count",
                     outcome="handled", **mine) == 6
        assert total(samples, "idembus_message_handling_duration_seconds_bucket",
                     le="+Inf", **mine) == 6
        assert total(samples, "idembus_message_critical_time_seconds_count", **mine) == 6
        assert total(samples, "idembus_messages_in_flight", endpoint="metrics-app") == 0
        [target] = samples["target_info"]
        assert target.labels["service_name"] == "metrics-app"

        # And SIGTERM stops the endpoint and the server: exit 0
        command.process.send_signal(signal.SIGTERM)
        assert command.exit_status() == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
    finally:
        command.kill()


def test_an_endpoint_without_the_middleware_is_given_one(app_dir):
    command = Command("run", "metrics_app:without_metrics", "--metrics-port", "0",
                      "--metrics-host", "127.0.0.1", cwd=app_dir)
    try:
        port = command.port()
        assert command.settled(6) == ["settled handled"] * 6
        samples = scrape(port)
        assert total(samples, "idembus_messages_handled_total", endpoint="metrics-app") == 5
        assert total(samples, "idembus_messages_duplicates_total",
                     endpoint="metrics-app") == 1
        assert total(samples, "idembus_message_handling_duration_seconds_count",
                     endpoint="metrics-app") == 6
        assert total(samples, "idembus_messages_in_flight", endpoint="metrics-app") == 0
        command.process.send_signal(signal.SIGTERM)
        assert command.exit_status() == 0
    finally:
        command.kill()


def test_without_the_prometheus_extra_the_command_says_what_to_install(app_dir):
    hide = ("import sys; sys.modules['opentelemetry.exporter.prometheus'] = None; "
            "from idembus.cli import main; sys.exit(main(sys.argv[1:]))")
    command = Command("run", "metrics_app:with_metrics", "--metrics-port", "0", cwd=app_dir,
                      python=("-c", hide))
    try:
        assert command.exit_status() == 2
        assert "pip install 'idembus[prometheus]'" in "".join(command.stderr)
    finally:
        command.kill()


def test_a_port_in_use_is_a_configuration_error(app_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        command = Command("run", "metrics_app:with_metrics", "--metrics-port", str(port),
                          "--metrics-host", "127.0.0.1", cwd=app_dir)
        try:
            assert command.exit_status() == 2
            assert f"cannot serve metrics on 127.0.0.1:{port}" in "".join(command.stderr)
        finally:
            command.kill()


def test_with_workers_a_port_in_use_fails_at_start_before_any_worker(app_dir):
    # The supervisor serves the workers' metrics (tests/test_workers_metrics.py): it takes
    # the port before starting any worker, and says which one it could not have
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        command = Command("run", "metrics_app:with_metrics", "--workers", "2",
                          "--metrics-port", str(port), cwd=app_dir)
        try:
            assert command.exit_status() == 2
            errors = "".join(command.stderr)
            assert f"idembus: cannot serve metrics on 127.0.0.1:{port}" in errors
            assert "worker 0 started" not in errors
        finally:
            command.kill()


def test_with_workers_the_supervisor_says_what_to_install_before_any_worker(app_dir):
    hide = ("import sys; sys.modules['opentelemetry.exporter.prometheus'] = None; "
            "from idembus.cli import main; sys.exit(main(sys.argv[1:]))")
    command = Command("run", "metrics_app:with_metrics", "--workers", "2", "--metrics-port",
                      "0", cwd=app_dir, python=("-c", hide))
    try:
        assert command.exit_status() == 2
        errors = "".join(command.stderr)
        assert "pip install 'idembus[prometheus]'" in errors
        assert "worker 0 started" not in errors
    finally:
        command.kill()


def test_with_workers_a_port_out_of_range_fails_at_start(app_dir):
    command = Command("run", "metrics_app:with_metrics", "--workers", "2",
                      "--metrics-port", "70000", cwd=app_dir)
    try:
        assert command.exit_status() == 2
        assert ("idembus: --metrics-port must be within 0..65535, got 70000"
                in "".join(command.stderr))
    finally:
        command.kill()


# -- the server in a process of its own making ---------------------------------------------


class Settled(Middleware):
    """Counts settled deliveries; first in the list, so after every other after hook."""

    def __init__(self) -> None:
        self.outcomes: list[str | None] = []
        self._condition = threading.Condition()

    def after_message(self, incoming: IncomingMessage, error: BaseException | None) -> None:
        with self._condition:
            self.outcomes.append(incoming.outcome)
            self._condition.notify_all()

    def wait_for(self, count: int, timeout: float = 15.0) -> bool:
        with self._condition:
            return self._condition.wait_for(lambda: len(self.outcomes) >= count, timeout)


@pytest.fixture
def server() -> Iterator[MetricsServer]:
    served = MetricsServer(0, "127.0.0.1", service_name="in-process")
    yield served
    served.stop()


def test_a_metrics_server_shows_an_endpoint_s_traffic_and_stops_cleanly(make_endpoint, server):
    # Given an endpoint whose Metrics middleware uses the server's meter provider
    settled = Settled()
    accounts = make_endpoint("accounts", handlers=[AccountHandler],
                             middleware=[settled, Metrics(meter_provider=server.meter_provider)])
    duplicates = SignalCounter(accounts, "duplicate")
    accounts.start()

    # When 5 deposits arrive, and one of them again
    for index in range(5):
        accounts.bus.send(Deposit(account=f"a{index}", amount=1), message_id=f"d-{index}")
    accounts.bus.send(Deposit(account="a0", amount=1), message_id="d-0")
    assert settled.wait_for(6)
    assert duplicates.wait_for(1)
    wait_until_idle([accounts])

    # Then the scrape shows them
    samples = scrape(server.port)
    assert total(samples, "idembus_messages_received_total", endpoint=accounts.name) == 6
    assert total(samples, "idembus_messages_handled_total", endpoint=accounts.name) == 5
    assert total(samples, "idembus_messages_duplicates_total", endpoint=accounts.name) == 1
    assert total(samples, "idembus_message_handling_duration_seconds_count",
                 endpoint=accounts.name) == 6

    # And once stopped, the port is closed
    server.stop()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{server.port}/metrics", timeout=5)


# -- bounded and private -------------------------------------------------------------------


def test_the_metrics_endpoint_listens_on_loopback_unless_told_otherwise(app_dir):
    command = Command("run", "metrics_app:with_metrics", "--metrics-port", "0", cwd=app_dir)
    try:
        port = command.port()
        assert f"at http://127.0.0.1:{port}/metrics" in "".join(command.stderr)
        assert total(scrape(port), "idembus_messages_in_flight") == 0
        command.process.send_signal(signal.SIGTERM)
        assert command.exit_status() == 0
    finally:
        command.kill()


#: The worker's descriptor limit in the next test, and the idle connections opened to it.
DESCRIPTORS, IDLE_SOCKETS = 128, 300


def test_idle_connections_neither_exhaust_the_worker_s_descriptors_nor_keep_a_scrape_out(
    app_dir,
):
    # Given a worker that may open 128 descriptors, serving its metrics
    limited = ("import resource, sys; "
               f"resource.setrlimit(resource.RLIMIT_NOFILE, ({DESCRIPTORS}, "
               "resource.getrlimit(resource.RLIMIT_NOFILE)[1])); "
               "from idembus.cli import main; sys.exit(main(sys.argv[1:]))")
    command = Command("run", "metrics_app:with_metrics", "--metrics-port", "0", cwd=app_dir,
                      python=("-c", limited))
    idle: list[socket.socket] = []
    try:
        port = command.port()
        # When 300 connections open and send nothing
        for _ in range(IDLE_SOCKETS):
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=5))

        # Then a scrape is still answered (behind them all in the accept queue)
        assert total(scrape(port), "idembus_messages_in_flight") == 0
        # And the worker holds far fewer descriptors than it may open: it can still
        # connect to its broker and database
        held = len(os.listdir(f"/proc/{command.process.pid}/fd"))
        assert held < DESCRIPTORS - 32, held
        command.process.send_signal(signal.SIGTERM)
        assert command.exit_status() == 0
    finally:
        for connection in idle:
            connection.close()
        command.kill()


def test_the_metrics_endpoint_needs_no_web_extra(app_dir):
    hide = ("import sys; sys.modules['starlette'] = None; sys.modules['fastapi'] = None; "
            "from idembus.cli import main; sys.exit(main(sys.argv[1:]))")
    command = Command("run", "metrics_app:with_metrics", "--metrics-port", "0", cwd=app_dir,
                      python=("-c", hide))
    try:
        port = command.port()
        assert len(command.settled(6)) == 6  # the app's six deliveries, then nothing is in flight
        assert total(scrape(port), "idembus_messages_in_flight") == 0
        command.process.send_signal(signal.SIGTERM)
        assert command.exit_status() == 0
    finally:
        command.kill()


def test_a_metrics_server_holds_at_most_its_cap_of_connections():
    server = MetricsServer(0, service_name="capped", max_connections=3)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as first:
            others = [socket.create_connection(("127.0.0.1", server.port), timeout=10)
                      for _ in range(10)]
            try:
                assert "python_info" in scrape(server.port)
                assert server.open_connections <= 3
                first.settimeout(10)
                assert first.recv(1) == b""  # the oldest idle one was closed to make room
            finally:
                for connection in others:
                    connection.close()
    finally:
        server.stop()
