"""What the gateway does with connections that do not behave: one that never sends a
request, or half of one, or stays silent after its answer, is closed after the idle timeout;
a stream whose client stops reading is cut off after the write timeout; stopping does not
wait for such a client. Raw sockets on loopback play the clients."""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from idembus import Endpoint, Event
from idembus.gateway import Gateway
from idembus.storage.memory import MemoryStorage

IDLE = 0.3


class Noted(Event, message_name="test.Noted"):
    note: str


@pytest.fixture
def endpoint() -> Iterator[Endpoint]:
    endpoint = Endpoint(f"conn-{uuid.uuid4().hex[:8]}", storage=MemoryStorage(), journal=True)
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


def connect(gateway: Gateway, *, receive_buffer: int | None = None) -> socket.socket:
    connection = socket.socket()
    if receive_buffer is not None:  # before connecting: the window is agreed then
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    connection.connect(gateway.address)
    connection.settimeout(10)
    return connection


def closed_within(connection: socket.socket, seconds: float) -> float:
    """How long until the server closed ``connection`` (reading and dropping what it
    sends); fails after ``seconds``."""
    started = time.monotonic()
    connection.settimeout(seconds)
    try:
        while connection.recv(65536):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        pytest.fail(f"the connection was still open after {seconds}s")
    return time.monotonic() - started


def test_a_connection_that_never_sends_a_request_is_closed_after_the_idle_timeout(
    gateway_for: Callable[..., Gateway],
) -> None:
    gateway = gateway_for(idle_timeout=IDLE)
    with connect(gateway) as connection:
        assert closed_within(connection, 10) >= IDLE * 0.8


def test_a_connection_that_sends_half_a_request_is_closed_after_the_idle_timeout(
    gateway_for: Callable[..., Gateway],
) -> None:
    gateway = gateway_for(idle_timeout=IDLE)
    with connect(gateway) as connection:
        connection.sendall(b"GET /status HTTP/1.1\r\nHost: gateway\r\n")  # no blank line
        closed_within(connection, 10)


def test_a_keep_alive_connection_is_closed_when_idle_after_its_answer(
    gateway_for: Callable[..., Gateway],
) -> None:
    gateway = gateway_for(idle_timeout=IDLE)
    with connect(gateway) as connection:
        connection.sendall(b"GET /healthz HTTP/1.1\r\nHost: gateway\r\n\r\n")
        assert connection.recv(65536).startswith(b"HTTP/1.1 200")
        closed_within(connection, 10)


def test_an_open_stream_is_not_an_idle_connection(
    gateway_for: Callable[..., Gateway],
) -> None:
    gateway = gateway_for(idle_timeout=IDLE, heartbeat=3600.0)
    with connect(gateway) as connection:
        connection.sendall(b"GET / HTTP/1.1\r\nHost: gateway\r\n"
                           b"Accept: text/event-stream\r\n\r\n")
        opening = connection.recv(65536)
        assert opening.startswith(b"HTTP/1.1 200")
        while b"retry:" not in opening:  # the stream's preamble may come in its own packet
            opening += connection.recv(65536)
        connection.settimeout(IDLE * 5)
        with pytest.raises(TimeoutError):  # silence, not a close: the stream stays open
            connection.recv(1)
    assert gateway.counters.wait_until(lambda counters: counters.clients == 0, timeout=10)


def test_a_stream_whose_client_stops_reading_is_cut_off_after_the_write_timeout(
    endpoint: Endpoint, gateway_for: Callable[..., Gateway],
) -> None:
    # Given a stream client that reads its answer's head, then nothing
    gateway = gateway_for(write_timeout=0.5, buffer=100_000)
    with connect(gateway, receive_buffer=4096) as connection:
        connection.sendall(b"GET / HTTP/1.1\r\nHost: gateway\r\n"
                           b"Accept: text/event-stream\r\n\r\n")
        assert connection.recv(4096).startswith(b"HTTP/1.1 200")
        assert gateway.counters.clients == 1

        # When more events are published than the sockets between them hold
        for n in range(2000):
            endpoint.bus.publish(Noted(note=f"{n}" + "x" * 4000))

        # Then the gateway lets the client go, and resets its connection
        assert gateway.counters.wait_until(lambda counters: counters.clients == 0,
                                           timeout=30)
        closed_within(connection, 30)


def test_stopping_does_not_wait_for_a_client_that_stopped_reading(
    endpoint: Endpoint, gateway_for: Callable[..., Gateway],
) -> None:
    gateway = gateway_for(buffer=100_000)  # the default write timeout: 30 s
    with connect(gateway, receive_buffer=4096) as connection:
        connection.sendall(b"GET / HTTP/1.1\r\nHost: gateway\r\n"
                           b"Accept: text/event-stream\r\n\r\n")
        assert connection.recv(4096).startswith(b"HTTP/1.1 200")
        for n in range(2000):
            endpoint.bus.publish(Noted(note=f"{n}" + "x" * 4000))
        assert gateway.hub.wait_for_position(2000, timeout=30)
        started = time.monotonic()
        gateway.stop(timeout=2)
        assert time.monotonic() - started < 4
        closed_within(connection, 10)
