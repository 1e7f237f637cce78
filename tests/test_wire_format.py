"""The wire format (DESIGN §5).

Requirement: a JSON message published by any AMQP client with the idembus headers is
processed like one sent by idembus. The foreign sender below is py-amqp alone: no idembus
or kombu code on the sending side.

Also, on every broker: what idembus itself puts on the wire (every §5 header), the
deterministic uuid5 ids of a handler's outgoing messages, and replies.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import unquote, urlparse

import amqp
import pytest

from idembus import Command, Endpoint, Event, MessageContext
from idembus import headers as h
from idembus.handlers import Handler, handles
from idembus.testing import wait_until_idle
from idembus.testing.faults import CrashPoint, FaultInjector, SimulatedCrash
from idembus.transports.kombu import KombuTransport
from tests.conftest import AMQP_URL, require_service
from tests.support import Account, AccountHandler, Deposit, Ledger, SignalCounter

MakeEndpoint = Callable[..., Endpoint]

#: Every header DESIGN §5 puts on a message sent from inside a handler.
SECTION_5_HEADERS = {
    h.MESSAGE_ID, h.MESSAGE_TYPE, h.CORRELATION_ID, h.CONVERSATION_ID, h.CAUSATION_ID,
    h.REPLY_TO, h.ORIGINATING_ENDPOINT, h.TIME_SENT, h.INTENT,
}


def derived_id(incoming_id: str, incoming_type: str, handler: str, index: int) -> str:
    context = MessageContext(message_id=incoming_id, message_type=incoming_type, headers={},
                             handler_name=handler, endpoint="unused")
    return context.outgoing_id(index)


# -- a JSON message from a foreign AMQP client (RabbitMQ only) ---------------------------


@contextlib.contextmanager
def foreign_channel() -> Iterator[amqp.Channel]:
    """A py-amqp channel with publisher confirms, on the broker of ``AMQP_URL``."""
    url = urlparse(AMQP_URL)
    vhost = unquote(url.path[1:]) if url.path and url.path != "/" else "/"
    connection = amqp.Connection(
        host=f"{url.hostname or '127.0.0.1'}:{url.port or 5672}",
        userid=unquote(url.username or "guest"),
        password=unquote(url.password or "guest"),
        virtual_host=vhost or "/",
    )
    connection.connect()
    try:
        channel = connection.channel()
        channel.confirm_select()
        yield channel
    finally:
        connection.close()


def foreign_publish(
    body: str, headers: dict[str, str], *, exchange: str = "", routing_key: str,
) -> None:
    with foreign_channel() as channel:
        channel.basic_publish(
            amqp.Message(body.encode("utf-8"), content_type="application/json",
                         delivery_mode=2, application_headers=headers),
            exchange=exchange, routing_key=routing_key,
        )


@pytest.fixture
def amqp_endpoint(unique: str) -> Iterator[Callable[..., Endpoint]]:
    """Endpoints on RabbitMQ sharing this test's exchange; queues and exchange deleted after."""
    require_service(AMQP_URL, "RabbitMQ")
    exchange = events_exchange(unique)
    endpoints: list[Endpoint] = []

    def make(name: str, **options: Any) -> Endpoint:
        options.setdefault("transport", KombuTransport(AMQP_URL, exchange=exchange))
        options.setdefault("error_queue", f"error-{unique}")
        endpoint = Endpoint(f"{name}-{unique}", **options)
        endpoints.append(endpoint)
        return endpoint

    yield make
    for endpoint in endpoints:
        endpoint.close()
    cleaner = KombuTransport(AMQP_URL)
    for queue in {e.name for e in endpoints} | {e.error_queue for e in endpoints}:
        cleaner.delete_queue(queue)
    cleaner.close()
    with foreign_channel() as channel:
        channel.exchange_delete(exchange)


def events_exchange(unique: str) -> str:
    """The topic exchange the ``amqp_endpoint`` fixture gives this test's endpoints."""
    return f"test-events-{unique}"


@pytest.mark.amqp
def test_a_command_from_a_foreign_amqp_client_is_processed_and_deduplicated_like_ours(
    amqp_endpoint: Callable[..., Endpoint],
) -> None:
    # Given an accounts endpoint and a ledger subscribed to its Deposited events
    accounts = amqp_endpoint("accounts", handlers=[AccountHandler])
    ledger = Ledger()
    downstream = amqp_endpoint("ledger", handlers=[ledger])
    dispatched = SignalCounter(accounts, "dispatched")
    duplicate = SignalCounter(accounts, "duplicate")
    recorded = SignalCounter(downstream, "handled")
    accounts.start()
    downstream.start()

    # When a py-amqp client puts a Deposit on the accounts queue with only id and type
    foreign_id = str(uuid.uuid4())
    foreign_headers = {h.MESSAGE_ID: foreign_id, h.MESSAGE_TYPE: "test.Deposit"}
    foreign_publish('{"account": "foreign", "amount": 7}', foreign_headers,
                    routing_key=accounts.name)
    assert recorded.wait_for(1)
    # ... and idembus sends the same deposit to another account
    ours_id = accounts.bus.send(Deposit(account="ours", amount=7))
    assert recorded.wait_for(2)

    # Then both were applied alike, and their Deposited events look alike
    for name in ("foreign", "ours"):
        state = accounts.storage.load("Account", name).state
        assert Account.model_validate(state) == Account(balance=7, deposits=1)
    assert dispatched.wait_for(2)
    events = {d["envelope"].headers[h.CAUSATION_ID]: d["envelope"] for d in dispatched.details}
    foreign_event, ours_event = events[foreign_id], events[ours_id]
    for incoming_id, event in ((foreign_id, foreign_event), (ours_id, ours_event)):
        assert event.message_id == derived_id(incoming_id, "test.Deposit", "AccountHandler", 0)
        assert event.headers[h.CAUSATION_ID] == incoming_id
        assert event.headers[h.CORRELATION_ID] == incoming_id
        assert event.headers[h.CONVERSATION_ID] == incoming_id
    assert set(foreign_event.headers) == set(ours_event.headers)
    assert sorted(entry[1] for entry in ledger.entries) == ["foreign", "ours"]

    # When the foreign client publishes the same message again
    foreign_publish('{"account": "foreign", "amount": 7}', foreign_headers,
                    routing_key=accounts.name)

    # Then it is a duplicate: not applied again, not recorded again downstream
    assert duplicate.wait_for(1)
    wait_until_idle([accounts, downstream])
    state = accounts.storage.load("Account", "foreign").state
    assert Account.model_validate(state) == Account(balance=7, deposits=1)
    assert len(ledger.entries) == 2
    assert accounts.counters["dead_lettered"] == 0


@pytest.mark.amqp
def test_an_event_from_a_foreign_amqp_client_reaches_subscribers_and_is_deduplicated(
    amqp_endpoint: Callable[..., Endpoint], unique: str,
) -> None:
    # Given a ledger endpoint subscribed to test.Deposited
    ledger = Ledger()
    downstream = amqp_endpoint("ledger", handlers=[ledger])
    handled = SignalCounter(downstream, "handled")
    duplicate = SignalCounter(downstream, "duplicate")
    downstream.start()

    # When a py-amqp client publishes a Deposited to the events exchange, twice
    event_id = str(uuid.uuid4())
    for _ in range(2):
        foreign_publish(
            '{"account": "a", "amount": 3}',
            {h.MESSAGE_ID: event_id, h.MESSAGE_TYPE: "test.Deposited"},
            exchange=events_exchange(unique), routing_key="test.Deposited",
        )

    # Then the ledger records it once and counts the second as a duplicate
    assert handled.wait_for(1)
    assert duplicate.wait_for(1)
    wait_until_idle([downstream])
    assert ledger.entries == [(event_id, "a", 3)]
    assert downstream.counters["dead_lettered"] == 0


# -- what idembus puts on the wire (every broker) ------------------------------------------


class Start(Command, message_name="test.wire.Start"):
    text: str


class Ping(Command, message_name="test.wire.Ping"):
    text: str


class Pong(Command, message_name="test.wire.Pong"):
    text: str


class Pinged(Event, message_name="test.wire.Pinged"):
    text: str


class Seen:
    """Headers and bodies of received messages, by type name; shared by handler copies."""

    def __init__(self) -> None:
        self.messages: dict[str, list[tuple[dict[str, str], Any]]] = {}
        self._lock = threading.Lock()

    def add(self, context: MessageContext, message: Any) -> None:
        with self._lock:
            self.messages.setdefault(context.message_type, []).append(
                (dict(context.headers), message)
            )

    def only(self, message_type: str) -> dict[str, str]:
        [(headers, _)] = self.messages[message_type]
        return headers


class Starter(Handler):
    """Client side: turns a Start into a Ping for the server."""

    sends = (Ping,)

    def __init__(self, seen: Seen) -> None:
        self.seen = seen

    @handles
    def start(self, message: Start) -> None:
        self.seen.add(self.context, message)
        self.bus.send(Ping(text=message.text))


class Listener(Handler):
    """Client side: receives the server's reply and its event."""

    def __init__(self, seen: Seen) -> None:
        self.seen = seen

    @handles
    def pong(self, message: Pong) -> None:
        self.seen.add(self.context, message)

    @handles
    def pinged(self, message: Pinged) -> None:
        self.seen.add(self.context, message)


class Responder(Handler):
    """Server side: replies Pong and publishes Pinged; records the ids each run produced."""

    def __init__(self, seen: Seen) -> None:
        self.seen = seen
        self.runs: list[tuple[str, str]] = []

    @handles
    def ping(self, message: Ping) -> None:
        self.seen.add(self.context, message)
        reply_id = self.bus.reply(Pong(text=message.text.upper()))
        event_id = self.bus.publish(Pinged(text=message.text))
        self.runs.append((reply_id, event_id))


class CrashOnce(FaultInjector):
    """Crash once at ``point`` while processing ``message_id``."""

    def __init__(self, point: CrashPoint, message_id: str) -> None:
        self.point = point
        self.message_id = message_id
        self.crashes = 0

    def reached(self, point: CrashPoint, message_id: str) -> None:
        if point is self.point and message_id == self.message_id and not self.crashes:
            self.crashes += 1
            raise SimulatedCrash(f"simulated crash {point.value} of {message_id}")


def sent_at(headers: dict[str, str]) -> datetime.datetime:
    moment = datetime.datetime.fromisoformat(headers[h.TIME_SENT])
    assert moment.tzinfo is not None, "time sent must say its time zone"
    return moment


def test_idembus_messages_carry_every_header_and_replies_go_back_with_stable_ids(
    make_endpoint: MakeEndpoint,
) -> None:
    # Given a client that answers Start with a Ping to a server, and a server that replies
    # Pong and publishes Pinged but crashes once before committing (its handler runs twice)
    client_seen, server_seen = Seen(), Seen()
    start_id = str(uuid.uuid4())
    ping_id = derived_id(start_id, "test.wire.Start", "Starter", 0)
    crash = CrashOnce(CrashPoint.BEFORE_COMMIT, ping_id)
    server = make_endpoint("server", handlers=[responder := Responder(server_seen)],
                           middleware=[crash])
    client = make_endpoint("client", handlers=[Starter(client_seen), Listener(client_seen)],
                           routes={Ping: server.name})
    dispatched = SignalCounter(server, "dispatched")
    listened = SignalCounter(client, "handled")
    server.start()
    client.start()
    before = datetime.datetime.now(datetime.timezone.utc)

    # When the client is told to start
    assert client.bus.send(Start(text="hi"), message_id=start_id) == start_id

    # Then Start, Ping, Pong and Pinged are handled: 3 at the client, 1 at the server
    assert listened.wait_for(3)
    wait_until_idle([client, server])
    after = datetime.datetime.now(datetime.timezone.utc)
    reply_id = derived_id(ping_id, "test.wire.Ping", "Responder", 0)
    event_id = derived_id(ping_id, "test.wire.Ping", "Responder", 1)

    # ... a message sent from outside a handler starts its conversation
    start = client_seen.only("test.wire.Start")
    assert start[h.MESSAGE_ID] == start_id
    assert start[h.MESSAGE_TYPE] == "test.wire.Start"
    assert start[h.INTENT] == "send"
    assert start[h.CORRELATION_ID] == start[h.CONVERSATION_ID] == start_id
    assert h.CAUSATION_ID not in start
    assert start[h.REPLY_TO] == start[h.ORIGINATING_ENDPOINT] == client.name
    assert before <= sent_at(start) <= after

    # ... a command sent from a handler carries every header, its id derived with uuid5
    ping = server_seen.messages["test.wire.Ping"][0][0]
    assert SECTION_5_HEADERS <= set(ping)
    assert ping[h.MESSAGE_ID] == ping_id and uuid.UUID(ping_id).version == 5
    assert ping[h.MESSAGE_TYPE] == "test.wire.Ping"
    assert ping[h.INTENT] == "send"
    assert ping[h.CAUSATION_ID] == start_id
    assert ping[h.CORRELATION_ID] == ping[h.CONVERSATION_ID] == start_id
    assert ping[h.REPLY_TO] == ping[h.ORIGINATING_ENDPOINT] == client.name
    assert before <= sent_at(ping) <= after

    # ... the server's handler produced the same ids on both runs
    assert crash.crashes == 1
    assert responder.runs == [(reply_id, event_id), (reply_id, event_id)]
    assert server.counters["handled"] == 1

    # ... the reply went to the sender's reply-to queue, correlated with the request
    [reply_envelope] = [d["envelope"] for d in dispatched.details if d["message_id"] == reply_id]
    assert reply_envelope.destination == client.name
    pong = client_seen.only("test.wire.Pong")
    assert SECTION_5_HEADERS <= set(pong)
    assert pong[h.MESSAGE_ID] == reply_id
    assert pong[h.INTENT] == "reply"
    assert pong[h.CORRELATION_ID] == ping_id
    assert pong[h.CAUSATION_ID] == ping_id
    assert pong[h.CONVERSATION_ID] == start_id
    assert pong[h.REPLY_TO] == pong[h.ORIGINATING_ENDPOINT] == server.name
    assert client_seen.messages["test.wire.Pong"][0][1] == Pong(text="HI")

    # ... the event was published (no destination), keeping the request's correlation
    [event_envelope] = [d["envelope"] for d in dispatched.details if d["message_id"] == event_id]
    assert event_envelope.destination is None
    pinged = client_seen.only("test.wire.Pinged")
    assert SECTION_5_HEADERS <= set(pinged)
    assert pinged[h.MESSAGE_ID] == event_id
    assert pinged[h.INTENT] == "publish"
    assert pinged[h.CORRELATION_ID] == start_id
    assert pinged[h.CAUSATION_ID] == ping_id
    assert pinged[h.CONVERSATION_ID] == start_id
    assert pinged[h.ORIGINATING_ENDPOINT] == server.name
