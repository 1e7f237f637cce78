"""RabbitMQ's frames read from the socket in chunks (idembus.transports.amqp_reads): the
same frames, fewer system calls, nothing lost across a timeout or a frame larger than a
chunk; and deliveries of every size intact through a real broker."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import amqp.transport
import pytest
from amqp.exceptions import UnexpectedFrame

from idembus.transports import amqp_reads
from tests.conftest import AMQP_URL, foreign_connection

FRAME_END = b"\xce"


class CountingSocket(socket.socket):
    """A socket that counts its ``recv`` calls."""

    recv_calls = 0

    def recv(self, size: int, *args: Any) -> bytes:
        self.recv_calls += 1
        return super().recv(size, *args)


@pytest.fixture
def pair() -> Iterator[tuple[Any, socket.socket]]:
    """py-amqp's TCP transport reading one end of a socket pair; the other end."""
    left, right = socket.socketpair()
    reader = CountingSocket(fileno=left.detach())
    transport = amqp.transport.TCPTransport.__new__(amqp.transport.TCPTransport)
    transport.sock = reader
    transport._setup_transport()
    yield transport, right
    reader.close()
    right.close()


def frame(payload: bytes, *, kind: int = 1, channel: int = 1) -> bytes:
    return struct.pack(">BHI", kind, channel, len(payload)) + payload + FRAME_END


def read_all(transport: Any, count: int) -> list[tuple[int, int, bytes]]:
    return [(kind, channel, bytes(payload))
            for kind, channel, payload in (transport.read_frame() for _ in range(count))]


def test_frames_already_received_are_read_with_one_system_call(pair):
    transport, peer = pair
    payloads = [os.urandom(size) for size in (3, 40, 700, 12)]
    peer.sendall(b"".join(frame(payload, channel=n) for n, payload in enumerate(payloads)))

    assert amqp_reads.read_in_chunks(transport)
    assert read_all(transport, 4) == [(1, n, payload) for n, payload in enumerate(payloads)]
    assert transport.sock.recv_calls == 1


def test_without_chunks_py_amqp_makes_a_call_per_piece(pair):
    """What the chunks save, and what the first test would find if they stopped working."""
    transport, peer = pair
    peer.sendall(frame(b"a") + frame(b"b"))

    assert read_all(transport, 2) == [(1, 1, b"a"), (1, 1, b"b")]
    assert transport.sock.recv_calls >= 4


def test_a_frame_larger_than_a_chunk_arrives_whole(pair):
    transport, peer = pair
    amqp_reads.read_in_chunks(transport)
    big = os.urandom(3 * amqp_reads.CHUNK + 17)
    sender = threading.Thread(target=peer.sendall, args=(frame(big) + frame(b"next"),))
    sender.start()
    try:
        assert read_all(transport, 2) == [(1, 1, big), (1, 1, b"next")]
    finally:
        sender.join()


def test_a_read_that_times_out_mid_frame_keeps_what_it_had(pair):
    transport, peer = pair
    amqp_reads.read_in_chunks(transport)
    whole = frame(b"split across two sends")
    peer.sendall(whole[:10])
    with transport.having_timeout(0.05), pytest.raises(socket.timeout):
        transport.read_frame()
    peer.sendall(whole[10:] + frame(b"after"))

    assert read_all(transport, 2) == [(1, 1, b"split across two sends"), (1, 1, b"after")]


class FakeKombuConnection:
    """What :func:`amqp_reads.drain` uses of a kombu connection: py-amqp's connection
    (here its transport and a frame handler that completes a method every other frame),
    and ``drain_events``, which reads from the socket."""

    def __init__(self, transport: Any) -> None:
        self.handled: list[bytes] = []
        self.drained = 0
        self._connection = self
        self.transport = transport

    def on_inbound_frame(self, frame: Any) -> bool:
        self.handled.append(bytes(frame[2]))
        return len(self.handled) % 2 == 0

    def drain_events(self, timeout: float) -> None:
        self.drained += 1
        with self.transport.having_timeout(timeout):
            while not self.on_inbound_frame(self.transport.read_frame()):
                pass


def test_a_drain_handles_the_frames_already_read_without_the_socket(pair):
    transport, peer = pair
    amqp_reads.read_in_chunks(transport)
    peer.sendall(frame(b"a") + frame(b"b") + frame(b"c") + frame(b"d") + frame(b"e")[:5])
    connection = FakeKombuConnection(transport)
    transport.read_frame()  # the first read takes every byte sent so far
    connection.on_inbound_frame((1, 1, b"a"))

    amqp_reads.drain(connection, 1.0)  # b: completes a method, from the buffer
    amqp_reads.drain(connection, 1.0)  # c, d
    assert connection.handled == [b"a", b"b", b"c", b"d"]
    assert connection.drained == 0 and transport.sock.recv_calls == 1
    # The rest of a frame is not there yet: the drain reads the socket, as kombu does.
    peer.sendall(frame(b"e")[5:] + frame(b"f"))
    amqp_reads.drain(connection, 1.0)
    assert connection.handled[-2:] == [b"e", b"f"] and connection.drained == 1
    with pytest.raises(socket.timeout):
        amqp_reads.drain(connection, 0.05)


class DeliveryHandler(FakeKombuConnection):
    """A frame handler as py-amqp's: a method with content is complete after its body;
    each frame sees what the buffer holds then (a handler may read the connection)."""

    def __init__(self, transport: Any, *, fail_at: bytes | None = None) -> None:
        super().__init__(transport)
        self.seen: list[bytes] = []
        self.fail_at = fail_at

    def on_inbound_frame(self, frame: Any) -> bool:
        kind, _, payload = frame
        if payload == self.fail_at:
            raise UnexpectedFrame("refused")
        self.handled.append(bytes(payload))
        self.seen.append(self.transport._read_buffer)
        return kind == 3 or (kind == 1 and payload[:4] != DELIVER)


DELIVER = struct.pack(">HH", 60, 60)


def delivery(body: bytes) -> bytes:
    header = struct.pack(">HHQH", 60, 0, len(body), 0)
    return frame(DELIVER + b"args") + frame(header, kind=2) + frame(body, kind=3)


def test_a_delivery_is_handled_whole_from_the_buffer_cut_before_its_body(pair):
    transport, peer = pair
    amqp_reads.read_in_chunks(transport)
    peer.sendall(frame(b"first") + delivery(b"one") + delivery(b"two") + frame(b"x")[:3])
    connection = DeliveryHandler(transport)
    transport.read_frame()  # the first read takes every byte sent so far

    amqp_reads.drain(connection, 1.0)
    assert connection.handled[-1] == b"one" and len(connection.handled) == 3
    # the body's handling sees the buffer as py-amqp would leave it: the rest only
    assert connection.seen[-1] == delivery(b"two") + frame(b"x")[:3]
    assert transport._read_buffer == delivery(b"two") + frame(b"x")[:3]
    amqp_reads.drain(connection, 1.0)
    assert connection.handled[-1] == b"two"
    assert transport._read_buffer == frame(b"x")[:3] and connection.drained == 0


def test_every_frame_read_already_is_handled_at_once_for_a_batch(pair):
    transport, peer = pair
    amqp_reads.read_in_chunks(transport)
    peer.sendall(frame(b"first") + delivery(b"one") + delivery(b"two") + frame(b"x")[:3])
    connection = DeliveryHandler(transport)
    transport.read_frame()

    amqp_reads.drain(connection, 1.0, every=True)
    assert connection.handled[-1] == b"two" and len(connection.handled) == 6
    assert transport._read_buffer == frame(b"x")[:3] and connection.drained == 0
    # nothing whole left: the socket is read, as without ``every``
    peer.sendall(frame(b"x")[3:])
    amqp_reads.drain(connection, 1.0, every=True)
    assert connection.handled[-1] == b"x" and connection.drained == 1


def test_frames_that_complete_nothing_are_cut_and_the_socket_read_after_them(pair):
    transport, peer = pair
    amqp_reads.read_in_chunks(transport)
    whole = delivery(b"body")
    body_at = len(whole) - len(frame(b"body", kind=3))
    peer.sendall(frame(b"first") + whole[:body_at + 2])
    connection = DeliveryHandler(transport)
    transport.read_frame()

    peer.sendall(whole[body_at + 2:])
    amqp_reads.drain(connection, 1.0, every=True)
    assert connection.handled[-1] == b"body" and connection.drained == 1
    assert transport._read_buffer == b""


def test_a_frame_refused_mid_delivery_leaves_the_buffer_after_it(pair):
    transport, peer = pair
    amqp_reads.read_in_chunks(transport)
    header = struct.pack(">HHQH", 60, 0, 3, 0)
    peer.sendall(frame(b"first") + delivery(b"one") + frame(b"next"))
    connection = DeliveryHandler(transport, fail_at=header)
    transport.read_frame()

    with pytest.raises(UnexpectedFrame, match="refused"):
        amqp_reads.drain(connection, 1.0)
    assert transport._read_buffer == frame(b"one", kind=3) + frame(b"next")


def test_what_is_read_already_is_readable_without_a_wait_or_a_system_call(pair):
    transport, peer = pair
    amqp_reads.read_in_chunks(transport)
    connection = FakeKombuConnection(transport)
    assert not amqp_reads.readable_within(connection, 0)  # nothing sent yet
    peer.sendall(frame(b"a") + frame(b"b") + frame(b"c")[:4])
    assert amqp_reads.readable_within(connection, 0)  # in the socket
    transport.read_frame()  # takes every byte sent so far

    assert amqp_reads.readable_within(connection, 60)  # b, whole in the buffer
    transport.read_frame()
    # Only part of c is in the buffer: the rest is waited for in the socket.
    assert not amqp_reads.readable_within(connection, 0.01)
    assert transport.sock.recv_calls == 1


def test_a_short_wait_is_not_rounded_up_to_a_millisecond(pair):
    """A batch looks 0.2 ms for a delivery that came with the first; a socket timeout
    (what a drain waits with) waits whole milliseconds, rounded up: never less than 1 ms.
    A busy machine makes waits longer, never shorter: the shortest of a few tells."""
    transport, _ = pair
    amqp_reads.read_in_chunks(transport)
    connection = FakeKombuConnection(transport)
    waits = []
    for _ in range(20):
        started = time.perf_counter()
        assert not amqp_reads.readable_within(connection, 0.0002)
        waits.append(time.perf_counter() - started)

    assert min(waits) < 0.0009, waits


def test_a_transport_it_cannot_watch_is_always_worth_a_drain():
    class Unknown:
        _connection = None

    assert amqp_reads.readable_within(Unknown(), 0.0002)


def test_a_buffered_frame_that_does_not_end_as_a_frame_must_is_refused(pair):
    transport, peer = pair
    amqp_reads.read_in_chunks(transport)
    peer.sendall(frame(b"a") + frame(b"b")[:-1] + b"\x00")
    transport.read_frame()

    with pytest.raises(UnexpectedFrame, match="0x00"):
        amqp_reads.drain(FakeKombuConnection(transport), 1.0)


def test_a_transport_it_does_not_know_is_left_as_it_is():
    class Unknown:
        sock = None

    assert not amqp_reads.read_in_chunks(Unknown())


@pytest.mark.amqp
def test_deliveries_of_every_size_reach_a_consumer_intact(rabbitmq):
    transport, name = rabbitmq
    queue = name("sizes")
    transport.declare(queue)
    bodies = [os.urandom(size).hex().encode() for size in
              (1, 5, 300, amqp_reads.CHUNK // 2 - 40, amqp_reads.CHUNK, 2 * amqp_reads.CHUNK + 3,
               *range(10, 30))]
    with foreign_connection(AMQP_URL) as connection:
        producer = connection.Producer()
        for index, body in enumerate(bodies):
            producer.publish(body, exchange="", routing_key=queue, headers={"n": index},
                             content_type="text/plain", content_encoding="utf-8")
    received: list[bytes] = []
    stop = threading.Event()

    def on_batch(deliveries: Any) -> None:
        received.extend(delivery.body for delivery in deliveries)
        transport.ack_many(deliveries)
        if len(received) >= len(bodies):
            stop.set()

    transport.consume_batches(queue, on_batch, stop=stop, prefetch=64, size=64, linger=0.05)

    assert received == bodies
