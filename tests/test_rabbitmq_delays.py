"""Native delayed delivery on RabbitMQ: binary delay levels that dead-letter downwards.

The first half checks the topology's arithmetic without a broker, by routing keys through
the bindings of ``transports/delays.py`` with AMQP's topic matching. The second half sends
delayed messages through the RabbitMQ at ``AMQP_URL`` (the shared ``idembus.delay.*``
topology is left in place: other tests and endpoints may be using it).
"""

from __future__ import annotations

import datetime
import random
import time
import uuid
from collections.abc import Callable, Iterator, Mapping

import kombu
import pytest

from idembus import headers as h
from idembus.envelope import Envelope
from idembus.messages import message_name
from idembus.registry import MessageRegistry
from idembus.runtime.decoding import decode
from idembus.transports import delays
from idembus.transports.base import Delivery
from idembus.transports.kombu import KombuTransport
from tests.conftest import AMQP_URL, require_service
from tests.support import Deposit

UTC = datetime.timezone.utc
#: How late a delayed message may be: up to 1 s of rounding plus the broker's hops.
LATE_BY_AT_MOST = 1.5
#: Upper bound on any wait; a failing test fails, it does not hang.
TIMEOUT = 15.0


# -- arithmetic (no broker) ---------------------------------------------------------------


def topic_matches(pattern: str, key: str) -> bool:
    """AMQP topic matching: ``*`` is one word, ``#`` zero or more, other words literal."""
    def match(p: list[str], k: list[str]) -> bool:
        if not p:
            return not k
        if p[0] == "#":
            return any(match(p[1:], k[i:]) for i in range(len(k) + 1))
        return bool(k) and p[0] in ("*", k[0]) and match(p[1:], k[1:])

    return match(pattern.split("."), key.split("."))


def route(delay: int, queue: str, destinations: list[str]) -> tuple[list[str], int]:
    """Follow a delayed message through the declared bindings as RabbitMQ would.

    Returns the queues it ends up in and the seconds it spent in level queues.
    """
    by_name = {level.name: level for level in delays.levels()}
    key = delays.routing_key(delay, queue)
    exchange, waited = delays.entry_exchange(delay), 0
    while exchange != delays.DELIVER_EXCHANGE:
        level = by_name[exchange]
        holds, passes = topic_matches(level.hold_key, key), topic_matches(level.pass_key, key)
        assert holds != passes, f"{exchange} must route {key!r} exactly one way"
        if holds:
            waited += level.ttl_ms // 1000
        exchange = level.dead_letter_exchange
    reached = [name for name in destinations if topic_matches(delays.deliver_key(name), key)]
    return reached, waited


@pytest.mark.parametrize("delay", [*range(1, 70), 1000, 86_400, 2**27, delays.MAX_DELAY])
def test_a_message_waits_exactly_its_delay_and_reaches_only_its_queue(delay: int) -> None:
    names = ["sales", "eu.sales", "sales.eu", "eu-west.sales-q", "a..b"]
    for queue in names:
        assert route(delay, queue, names) == ([queue], delay)


def test_random_delays_route_exactly() -> None:
    rng = random.Random(7)
    for delay in (rng.randint(1, delays.MAX_DELAY) for _ in range(200)):
        assert route(delay, "orders.eu-1", ["orders.eu-1", "eu-1"]) == (["orders.eu-1"], delay)


def test_the_routing_key_spells_the_bits_highest_first_then_the_queue() -> None:
    key = delays.routing_key(5, "sales.eu-west")
    assert key == ".".join(["0"] * 25 + ["1", "0", "1"]) + ".sales.eu-west"
    assert delays.entry_exchange(5) == "idembus.delay.2"
    assert delays.entry_exchange(1) == "idembus.delay.0"
    assert delays.entry_exchange(delays.MAX_DELAY) == "idembus.delay.27"


def test_levels_halve_their_wait_and_dead_letter_one_level_down() -> None:
    levels = delays.levels()
    assert len(levels) == delays.LEVELS == 28
    assert levels[0].queue_arguments == {"x-message-ttl": 1000,
                                         "x-dead-letter-exchange": "idembus.delay.deliver"}
    assert levels[27].queue_arguments == {"x-message-ttl": 1000 * 2**27,
                                          "x-dead-letter-exchange": "idembus.delay.26"}
    assert levels[27].hold_key == "1.#"
    assert levels[0].pass_key == "*." * 27 + "0.#"


def test_the_delivery_key_skips_the_bits_and_spells_the_name() -> None:
    assert delays.deliver_key("eu.sales-q") == "*." * 28 + "eu.sales-q"
    # NServiceBus's "#.sales" would also take messages for "eu.sales"; this one does not:
    assert not topic_matches(delays.deliver_key("sales"), delays.routing_key(3, "eu.sales"))


@pytest.mark.parametrize("delay", [0, -1, delays.MAX_DELAY + 1])
def test_a_delay_out_of_range_is_refused(delay: int) -> None:
    with pytest.raises(ValueError, match="a delay is 1 to"):
        delays.routing_key(delay, "q")


@pytest.mark.parametrize("queue", ["", "a.*", "#", "x.#.y", "q" * 200])
def test_queue_names_that_cannot_be_matched_literally_are_refused(queue: str) -> None:
    with pytest.raises(ValueError):
        delays.deliver_key(queue)


def test_wildcard_characters_inside_a_word_are_literal() -> None:
    assert delays.deliver_key("a*b.c#") == "*." * 28 + "a*b.c#"
    assert delays.deliver_key("q" * 199)


def test_delays_round_up_to_whole_seconds_and_due_times_are_not_delayed() -> None:
    now = datetime.datetime(2026, 1, 1, tzinfo=UTC)

    def after(seconds: float) -> int:
        return delays.delay_seconds(now + datetime.timedelta(seconds=seconds), now)

    assert [after(0.5), after(2), after(2.001), after(0), after(-5)] == [1, 2, 3, 0, 0]
    assert delays.delay_seconds(None, now) == 0
    assert after(delays.MAX_DELAY) == delays.MAX_DELAY
    with pytest.raises(ValueError, match="longest delay"):
        after(delays.MAX_DELAY + 0.5)


def test_deliver_at_is_read_as_iso_8601_utc() -> None:
    expected = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    assert delays.parse_time("2026-01-02T03:04:05+00:00") == expected
    assert delays.parse_time("2026-01-02T03:04:05Z") == expected
    assert delays.parse_time("2026-01-02T03:04:05") == expected
    assert delays.parse_time("2026-01-02T04:04:05+01:00") == expected
    assert delays.parse_time("tomorrow") is None
    assert delays.parse_time(None) is None


def test_dead_letter_bookkeeping_headers_are_dropped_and_others_kept() -> None:
    headers = {"x-death": [{"count": 1}], "x-first-death-queue": "q", "x-last-death-reason": "x",
               "x-deathly": "kept", h.MESSAGE_ID: "1"}
    assert delays.without_dead_letter_headers(headers) == {h.MESSAGE_ID: "1",
                                                           "x-deathly": "kept"}


def test_only_amqp_has_native_delay_and_elsewhere_a_future_time_is_delivered_at_once() -> None:
    assert KombuTransport(AMQP_URL).native_delay is True
    memory = KombuTransport("memory://")
    assert memory.native_delay is False
    queue = f"memory-delays-{uuid.uuid4().hex[:8]}"
    memory.declare(queue)
    memory.send(message(queue, delay=60))
    assert memory.get(queue) is not None


# -- on RabbitMQ --------------------------------------------------------------------------


@pytest.fixture
def rabbitmq() -> Iterator[Callable[[], KombuTransport]]:
    """Fresh transports on RabbitMQ, closed afterwards."""
    require_service(AMQP_URL, "RabbitMQ")
    created: list[KombuTransport] = []

    def make() -> KombuTransport:
        created.append(KombuTransport(AMQP_URL))
        return created[-1]

    yield make
    for transport in created:
        transport.close()


@pytest.fixture
def queue(unique: str) -> Iterator[Callable[[str], str]]:
    """``queue("sales")`` -> a queue declared for this test alone, deleted afterwards."""
    names: list[str] = []
    cleaner = KombuTransport(AMQP_URL)

    def name(prefix: str) -> str:
        names.append(f"{prefix}-{unique}")
        cleaner.declare(names[-1])
        return names[-1]

    yield name
    for created in names:
        cleaner.delete_queue(created)
    cleaner.close()


def message(queue: str, *, delay: float, **headers: str) -> Envelope:
    """An envelope to ``queue`` that must not be delivered before ``delay`` seconds."""
    deliver_at = datetime.datetime.now(UTC) + datetime.timedelta(seconds=delay)
    return Envelope(
        headers={h.MESSAGE_ID: str(uuid.uuid4()), h.MESSAGE_TYPE: message_name(Deposit),
                 h.DELIVER_AT: deliver_at.isoformat(), **headers},
        body='{"account": "ünïcode €", "amount": 5}',
        destination=queue,
    )


def deliver_at(envelope: Envelope) -> datetime.datetime:
    moment = delays.parse_time(envelope.headers[h.DELIVER_AT])
    assert moment is not None
    return moment


def next_arrival(transport: KombuTransport, queue: str,
                 timeout: float = TIMEOUT) -> tuple[Delivery, datetime.datetime]:
    """Poll ``queue`` until a message arrives; return it and when it was seen."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        delivery = transport.get(queue)
        if delivery is not None:
            return delivery, datetime.datetime.now(UTC)
        time.sleep(0.01)
    pytest.fail(f"nothing arrived in {queue!r} within {timeout}s")


def assert_on_time(envelope: Envelope, arrived: datetime.datetime) -> None:
    late = (arrived - deliver_at(envelope)).total_seconds()
    assert 0 <= late <= LATE_BY_AT_MOST, f"arrived {late:+.3f}s after its delivery time"


@pytest.mark.amqp
def test_a_delayed_message_arrives_no_earlier_than_asked_and_soon_after(
    rabbitmq: Callable[[], KombuTransport], queue: Callable[[str], str],
) -> None:
    transport, destination = rabbitmq(), queue("delayed")
    sent = message(destination, delay=2)
    transport.send(sent)
    assert transport.pending(destination) == 0  # held by the broker, not in the queue
    delivery, arrived = next_arrival(transport, destination)
    assert delivery.headers[h.MESSAGE_ID] == sent.message_id
    assert_on_time(sent, arrived)


@pytest.mark.amqp
def test_a_short_delay_does_not_wait_behind_a_long_one(
    rabbitmq: Callable[[], KombuTransport], queue: Callable[[str], str],
) -> None:
    transport, destination = rabbitmq(), queue("head-of-line")
    long, short = message(destination, delay=4), message(destination, delay=0.5)
    transport.send(long)
    transport.send(short)
    first, first_arrived = next_arrival(transport, destination)
    assert first.headers[h.MESSAGE_ID] == short.message_id
    assert_on_time(short, first_arrived)
    second, second_arrived = next_arrival(transport, destination)
    assert second.headers[h.MESSAGE_ID] == long.message_id
    assert_on_time(long, second_arrived)


@pytest.mark.amqp
def test_delays_through_several_levels_arrive_on_time(
    rabbitmq: Callable[[], KombuTransport], queue: Callable[[str], str],
) -> None:
    transport, destination = rabbitmq(), queue("levels")
    five, three = message(destination, delay=5), message(destination, delay=3)  # 4+1, 2+1
    transport.send(five)
    transport.send(three)
    for expected in (three, five):
        delivery, arrived = next_arrival(transport, destination)
        assert delivery.headers[h.MESSAGE_ID] == expected.message_id
        assert_on_time(expected, arrived)


@pytest.mark.amqp
def test_headers_body_id_and_content_type_arrive_unchanged_and_decode(
    rabbitmq: Callable[[], KombuTransport], queue: Callable[[str], str],
) -> None:
    transport, destination = rabbitmq(), queue("unchanged")
    raw_copy = message(destination, delay=1)
    sent = message(destination, delay=1, **{"custom.header": "kept as is",
                                            h.CORRELATION_ID: "c-1"})
    transport.send(raw_copy)
    transport.send(sent)
    # The broker adds its dead-letter bookkeeping on the way ...
    raw_headers, raw_properties = raw_get(destination)
    assert "x-death" in raw_headers and raw_properties["message_id"] == raw_copy.message_id
    # ... which deliveries do not show: the sender's headers come out exactly.
    delivery, _ = next_arrival(transport, destination)
    assert delivery.headers == dict(sent.headers)
    assert delivery.body == sent.body.encode("utf-8")
    assert delivery.content_type == sent.content_type
    decoded = decode(delivery.headers, delivery.body, delivery.content_type,
                     MessageRegistry([Deposit]))
    assert decoded == Deposit(account="ünïcode €", amount=5)


def raw_get(queue: str, timeout: float = TIMEOUT
            ) -> tuple[Mapping[str, object], Mapping[str, object]]:
    """The headers and the properties of the next message of ``queue`` as RabbitMQ
    delivers them."""
    deadline = time.monotonic() + timeout
    with kombu.Connection(AMQP_URL) as connection:
        channel = connection.channel()
        while time.monotonic() < deadline:
            found = kombu.Queue(queue, no_declare=True)(channel).get(no_ack=True)
            if found is not None:
                return dict(found.headers), dict(found.properties)
            time.sleep(0.01)
    pytest.fail(f"nothing arrived in {queue!r} within {timeout}s")


@pytest.mark.amqp
def test_a_delayed_message_lives_in_the_broker_after_its_sender_closed(
    rabbitmq: Callable[[], KombuTransport], queue: Callable[[str], str],
) -> None:
    sender, destination = rabbitmq(), queue("outlives")
    sent = message(destination, delay=1)
    sender.send(sent)
    sender.close()
    delivery, arrived = next_arrival(rabbitmq(), destination)
    assert delivery.headers[h.MESSAGE_ID] == sent.message_id
    assert_on_time(sent, arrived)


@pytest.mark.amqp
def test_a_delivered_message_can_be_delayed_again(
    rabbitmq: Callable[[], KombuTransport], queue: Callable[[str], str],
) -> None:
    """What a delayed retry does: the same message through the same levels once more."""
    transport, destination = rabbitmq(), queue("again")
    transport.send(message(destination, delay=1))
    first, _ = next_arrival(transport, destination)
    again = message(destination, delay=1)
    again = Envelope(headers={**first.headers, h.DELIVER_AT: again.headers[h.DELIVER_AT]},
                     body=first.body.decode("utf-8"), destination=destination)
    transport.send(again)
    second, arrived = next_arrival(transport, destination)
    assert second.headers == dict(again.headers)
    assert_on_time(again, arrived)


@pytest.mark.amqp
def test_dotted_queue_names_get_only_their_own_delayed_messages(
    rabbitmq: Callable[[], KombuTransport], queue: Callable[[str], str],
) -> None:
    transport = rabbitmq()
    short, dotted = queue("orders"), queue("eu-west.orders")  # "eu-west.orders-<unique>"
    for destination in (short, dotted):
        transport.send(message(destination, delay=1, destined="for " + destination))
    for destination in (short, dotted):
        delivery, _ = next_arrival(transport, destination)
        assert delivery.headers["destined"] == "for " + destination
    # The broker routes a message to all matching queues at once: a wrong copy would be here.
    assert transport.pending(short) == transport.pending(dotted) == 0


@pytest.mark.amqp
def test_a_due_or_past_delivery_time_is_sent_at_once(
    rabbitmq: Callable[[], KombuTransport], queue: Callable[[str], str],
) -> None:
    transport, destination = rabbitmq(), queue("due")
    transport.send(message(destination, delay=-3))
    transport.send(message(destination, delay=0))
    # Publisher confirms: once send returns, the messages are in the queue.
    assert transport.pending(destination) == 2


@pytest.mark.amqp
@pytest.mark.parametrize("queue_type", ["quorum", "classic"])
def test_messages_whose_queue_was_deleted_while_they_waited_are_kept_and_stall_nothing(
    queue_type: str, queue: Callable[[str], str],
) -> None:
    # Given more delayed messages for a deleted queue than RabbitMQ's dead-letter worker
    # holds in flight (32) -- on quorum levels, unroutable ones used to stay at the head of
    # level 0 forever and stop it for every endpoint --
    transport = KombuTransport(AMQP_URL, queue_type=queue_type)
    levels = delays.Topology.for_queue_type(queue_type)
    try:
        doomed, destination = queue(f"deleted-{queue_type}"), f"kept-{uuid.uuid4().hex[:8]}"
        transport.declare(destination)
        orphans = [message(doomed, delay=1) for _ in range(40)]
        for orphan in orphans:
            transport.send(orphan)
        transport.delete_queue(doomed)
        # When a message for a queue that exists follows them through the same level,
        sent = message(destination, delay=1)
        transport.send(sent)
        # Then it arrives on time,
        delivery, arrived = next_arrival(transport, destination)
        assert delivery.headers[h.MESSAGE_ID] == sent.message_id
        assert_on_time(sent, arrived)
        # and every orphan waits in the undeliverable queue with its headers.
        wanted = {orphan.message_id for orphan in orphans}
        deadline = time.monotonic() + TIMEOUT
        found: dict[str, Delivery] = {}
        while wanted - found.keys() and time.monotonic() < deadline:
            with transport.inspect(levels.undeliverable) as waiting:
                for kept in waiting:
                    if kept.headers.get(h.MESSAGE_ID) in wanted:
                        found[kept.headers[h.MESSAGE_ID]] = kept
                        kept.ack()
        assert found.keys() == wanted
        assert all(kept.headers[h.DELIVER_AT] for kept in found.values())
    finally:
        transport.delete_queue(destination)
        transport.close()
