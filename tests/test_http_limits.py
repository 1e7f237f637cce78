"""The HTTP surfaces are bounded: the gateway and the dashboard hold at most
``max_connections`` (an idle connection makes room for a new one; when all are busy the
newcomer gets a fixed 503), log running out once per interval with a count, throttle
failed logins per client address, and answer an unreachable storage with a fixed 503
that names no host, user or database (those go to the log). Raw sockets on loopback play
the idle clients; 127.0.0.2 plays another machine."""

from __future__ import annotations

import errno
import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import pytest

from idembus import Endpoint
from idembus.dashboard import Dashboard
from idembus.gateway import Gateway, serving
from idembus.gateway import limits as limits_module
from idembus.gateway.logins import LoginThrottle
from idembus.gateway.protocol import BUSY
from idembus.logs import Throttle
from idembus.storage.errors import StorageUnavailable
from idembus.storage.memory import MemoryStorage

STREAM = {"Accept": "text/event-stream"}
#: What a driver says when the database is down: its host, user and database.
REVEALING = ('connection to server at "db.internal.example" (10.9.8.7), port 5432 failed: '
             'FATAL: password authentication failed for user "shop_owner" (database '
             '"orders_prod")')
REVEALED = ("db.internal.example", "10.9.8.7", "shop_owner", "orders_prod")


@pytest.fixture
def endpoint() -> Iterator[Endpoint]:
    endpoint = Endpoint(f"limits-{uuid.uuid4().hex[:8]}", storage=MemoryStorage(),
                        journal=True)
    yield endpoint
    endpoint.close()


@pytest.fixture
def gateway_for(endpoint: Endpoint) -> Iterator[Callable[..., Gateway]]:
    started: list[Gateway] = []

    def start(**options: Any) -> Gateway:
        gateway = Gateway(endpoint, port=0, poll_interval=0.02, **options)
        gateway.start()
        started.append(gateway)
        return gateway

    yield start
    for gateway in started:
        gateway.stop(timeout=10)


def idle_sockets(stack: ExitStack, address: tuple[str, int], count: int) -> list[socket.socket]:
    """``count`` connections that send nothing (closed when ``stack`` closes)."""
    return [stack.enter_context(socket.create_connection(address, timeout=10))
            for _ in range(count)]


def open_stream(stack: ExitStack, address: tuple[str, int]) -> socket.socket:
    """A connection holding an event stream open (its answer's head read)."""
    connection = stack.enter_context(socket.create_connection(address, timeout=10))
    connection.sendall(b"GET / HTTP/1.1\r\nHost: gateway\r\nAccept: text/event-stream\r\n\r\n")
    assert connection.recv(65536).startswith(b"HTTP/1.1 200")
    return connection


def records_of(caplog: pytest.LogCaptureFixture, logger: str, text: str) -> list[logging.LogRecord]:
    return [record for record in caplog.records
            if record.name == logger and text in record.getMessage()]


# -- the connection cap ------------------------------------------------------------------


def test_idle_connections_beyond_the_cap_do_not_keep_a_new_client_out(
    gateway_for: Callable[..., Gateway],
) -> None:
    # Given a gateway holding 4 connections at most, and a long idle timeout
    gateway = gateway_for(max_connections=4, idle_timeout=60.0)
    with ExitStack() as stack:
        # When 20 connections open and send nothing
        idle_sockets(stack, gateway.address, 20)

        # Then a new client is answered at once (the idle ones made room), and the
        # gateway never holds more than its cap
        answer = httpx.get(gateway.url + "/healthz", timeout=10)
        assert answer.status_code == 200
        assert gateway.limit.evicted >= 16
        assert gateway.status()["open_connections"] <= 4


def test_when_every_connection_is_busy_a_new_one_gets_a_fixed_503_and_one_log_line(
    gateway_for: Callable[..., Gateway], caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(limits_module, "LOG_INTERVAL", 3600.0)  # one line for the whole test
    gateway = gateway_for(max_connections=2, heartbeat=3600.0)
    with ExitStack() as stack:
        # Given two open streams: every connection busy
        first = open_stream(stack, gateway.address)
        open_stream(stack, gateway.address)

        # When 25 more clients come
        answers = [httpx.get(gateway.url + "/healthz", timeout=10) for _ in range(25)]

        # Then each gets the fixed 503, with Retry-After
        assert {answer.status_code for answer in answers} == {503}
        assert answers[0].content == BUSY.split(b"\r\n\r\n", 1)[1]
        assert answers[0].headers["retry-after"] == "5"
        assert gateway.limit.turned_away == 25
        # And the log says so once, not once per connection
        assert len(records_of(caplog, "idembus.gateway.limits", "turned new ones away")) == 1

        # And once a stream ends, a client is served again
        first.close()
        deadline = time.monotonic() + 10
        while httpx.get(gateway.url + "/healthz", timeout=10).status_code != 200:
            assert time.monotonic() < deadline, "no room was made when a stream ended"


class ExhaustedSocket(socket.socket):
    """A listening socket whose ``accept`` fails as with no descriptor left, while
    :attr:`exhausted` is set."""

    exhausted = threading.Event()

    def accept(self) -> tuple[socket.socket, Any]:
        if self.exhausted.is_set():
            raise OSError(errno.EMFILE, "Too many open files")
        return super().accept()


def test_accept_failing_for_want_of_descriptors_is_logged_once_without_a_traceback(
    endpoint: Endpoint, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a gateway whose accept() fails as when the process has no descriptor left
    monkeypatch.setattr(limits_module, "LOG_INTERVAL", 3600.0)
    plain_listen = serving._listen

    def exhausted_listen(host: str, port: int) -> socket.socket:
        plain = plain_listen(host, port)
        return ExhaustedSocket(plain.family, plain.type, fileno=plain.detach())

    monkeypatch.setattr(serving, "_listen", exhausted_listen)
    ExhaustedSocket.exhausted.set()
    gateway = Gateway(endpoint, port=0)
    gateway.start()
    try:
        with socket.create_connection(gateway.address, timeout=10):
            # When a client connects: asyncio tries accept() up to the backlog each round
            deadline = time.monotonic() + 10
            while gateway.limit.exhausted < 100:
                assert time.monotonic() < deadline, "accept() was not tried"
                time.sleep(0.01)
        ExhaustedSocket.exhausted.clear()

        # Then one line says so, without a traceback, and asyncio logs none of its own
        said = records_of(caplog, "idembus.gateway.limits", "cannot accept connections")
        assert len(said) == 1 and said[0].exc_info is None
        assert "Too many open files" in said[0].getMessage()
        assert not [record for record in caplog.records if record.name == "asyncio"]
        # And once descriptors are back, clients are served again (asyncio retries)
        assert httpx.get(gateway.url + "/healthz", timeout=10).status_code == 200
    finally:
        ExhaustedSocket.exhausted.clear()
        gateway.stop(timeout=10)


def test_a_flood_of_bad_requests_is_one_log_line(
    gateway_for: Callable[..., Gateway], caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(limits_module, "LOG_INTERVAL", 3600.0)
    gateway = gateway_for()
    [quiet] = [item for item in logging.getLogger("uvicorn.error").filters
               if isinstance(item, limits_module.PerConnectionLines)]
    monkeypatch.setattr(quiet, "lines", Throttle(3600.0))  # nothing said by earlier tests
    for _ in range(30):
        with socket.create_connection(gateway.address, timeout=10) as connection:
            connection.sendall(b"NOT HTTP AT ALL\r\n\r\n")
            assert connection.recv(65536).startswith(b"HTTP/1.1 400")
    assert len(records_of(caplog, "uvicorn.error", "Invalid HTTP request")) == 1


def test_the_cap_stays_below_the_descriptor_limit() -> None:
    assert limits_module.connection_cap(1000, None) == 1000
    assert limits_module.connection_cap(50, 1024) == 50
    lowered = limits_module.connection_cap(1000, 256)
    lingering = max(limits_module.LINGERING_AT_LEAST, lowered // limits_module.LINGERING_SHARE)
    assert lowered + lingering <= 256 - 64  # a quarter kept for the process's own
    # and a burst accepted in one turn of the loop fits in what is kept
    assert limits_module.accept_backlog(2048, 256) <= 64 // 2
    assert limits_module.accept_backlog(2048, None) == 2048


# -- failed logins ---------------------------------------------------------------------------


def client_from(address: str, **options: Any) -> httpx.Client:
    """An httpx client whose connections leave from ``address`` (a loopback one)."""
    return httpx.Client(transport=httpx.HTTPTransport(local_address=address), timeout=10,
                        **options)


def test_the_gateway_throttles_failed_logins_per_address(
    gateway_for: Callable[..., Gateway],
) -> None:
    gateway = gateway_for(auth="ops:right", logins=LoginThrottle(limit=5, window=60.0))
    with client_from("127.0.0.1", auth=("ops", "wrong")) as guesser, \
            client_from("127.0.0.1", auth=("ops", "right")) as same_address, \
            client_from("127.0.0.2", auth=("ops", "right")) as other_address:
        # When one address guesses wrong 20 times
        answers = [guesser.get(gateway.url + "/status").status_code for _ in range(20)]

        # Then the first 5 are refused as wrong, the rest throttled with Retry-After
        assert answers == [401] * 5 + [429] * 15
        throttled = guesser.get(gateway.url + "/status")
        assert 0 < int(throttled.headers["retry-after"]) <= 60
        # And even the right password from that address waits
        assert same_address.get(gateway.url + "/status").status_code == 429
        # While the right password from another address is let in
        assert other_address.get(gateway.url + "/status").status_code == 200
    assert gateway.status()["throttled"] == 17


def test_the_dashboard_throttles_failed_logins_per_address(endpoint: Endpoint) -> None:
    dashboard = Dashboard([endpoint], port=0, auth="ops:right")
    dashboard.start()
    try:
        limit = dashboard.logins.limit
        with client_from("127.0.0.1", auth=("ops", "wrong")) as guesser, \
                client_from("127.0.0.2", auth=("ops", "right")) as other_address:
            answers = [guesser.get(dashboard.url + "/").status_code
                       for _ in range(limit + 5)]
            assert answers == [401] * limit + [429] * 5
            assert other_address.get(dashboard.url + "/").status_code == 200
    finally:
        dashboard.stop(10)


def test_a_login_throttle_forgets_failures_older_than_its_window() -> None:
    now = [0.0]
    throttle = LoginThrottle(limit=3, window=60.0, clock=lambda: now[0])
    for _ in range(3):
        throttle.failed("10.0.0.1")
    assert throttle.retry_after("10.0.0.1") == 60
    assert throttle.retry_after("10.0.0.2") is None
    now[0] = 59.5
    assert throttle.retry_after("10.0.0.1") == 1
    now[0] = 60.0
    assert throttle.retry_after("10.0.0.1") is None
    throttle.failed("10.0.0.1")
    assert throttle.retry_after("10.0.0.1") is None  # two of its three failures are old


# -- what a 503 says -------------------------------------------------------------------------


class DownStorage(MemoryStorage):
    """Readable until ``down``; then every read fails as a database driver would."""

    process_local = False
    down = False

    def _fail(self) -> None:
        if self.down:
            raise StorageUnavailable(REVEALING)

    def journal_bounds(self) -> Any:
        self._fail()
        return super().journal_bounds()

    def status_reports(self, endpoint: str) -> Any:
        self._fail()
        return super().status_reports(endpoint)

    def parked_messages(self, endpoint: str) -> Any:
        self._fail()
        return super().parked_messages(endpoint)

    def parked_page(self, *args: Any, **options: Any) -> Any:  # what the failed pages read
        self._fail()
        return super().parked_page(*args, **options)


def assert_told_nothing(body: bytes, caplog: pytest.LogCaptureFixture) -> None:
    text = body.decode()
    assert not [word for word in REVEALED if word in text], text
    logged = "\n".join(record.getMessage() for record in caplog.records)
    assert "db.internal.example" in logged and "orders_prod" in logged


def test_the_gateway_s_503_names_no_host_user_or_database(
    caplog: pytest.LogCaptureFixture,
) -> None:
    storage = DownStorage()
    with Endpoint(f"down-{uuid.uuid4().hex[:8]}", storage=storage, journal=True) as endpoint:
        gateway = Gateway(endpoint, port=0)
        gateway.start()
        try:
            storage.down = True
            answers = [httpx.get(gateway.url + "/status", timeout=10),
                       httpx.get(gateway.url + "/", headers={**STREAM, "Last-Event-ID": "1"},
                                 timeout=10)]
        finally:
            gateway.stop(10)
    for answer in answers:
        assert answer.status_code == 503
        assert_told_nothing(answer.content, caplog)


def test_the_dashboard_s_503_names_no_host_user_or_database(
    caplog: pytest.LogCaptureFixture,
) -> None:
    storage = DownStorage()
    with Endpoint(f"down-{uuid.uuid4().hex[:8]}", storage=storage) as endpoint:
        dashboard = Dashboard([endpoint], port=0)
        dashboard.start()
        try:
            storage.down = True
            answer = httpx.get(dashboard.url + "/errors", timeout=10)
        finally:
            dashboard.stop(10)
    assert answer.status_code == 503
    assert_told_nothing(answer.content, caplog)
