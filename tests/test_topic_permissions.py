"""Subscriptions are bound by their own words (issue 24, finding 8).

Every subscription used to bind ``#.<type with ~>.#`` besides its exact name, and the type
header was trusted: an account that RabbitMQ's topic permissions restrict to ``^partner\\.``
routing keys reached any subscriber with a key such as ``partner.shop~OrderEvent``. Now the
hierarchy bindings are anchored at the key's first word (``~``), an upgrade removes the old
binding, and a delivery from the events exchange whose routing key is neither its type nor
that type's hierarchy key goes to the error queue.
"""

from __future__ import annotations

import json
import subprocess
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import amqp
import kombu
import pytest

from idembus import Endpoint, Event
from idembus import headers as h
from idembus.handlers import Handler, handles
from idembus.testing import wait_until_idle
from idembus.transports.kombu import KombuTransport
from tests.conftest import AMQP_URL, foreign_connection, require_service
from tests.hostile import plain_amqp
from tests.support import SignalCounter

MakeEndpoint = Callable[..., Endpoint]


class PartnerEvent(Event, message_name="shop.PartnerEvent"):
    order_id: str


class OrderEvent(Event, message_name="shop.OrderEvent"):
    order_id: str


class OrderPlaced(OrderEvent, message_name="shop.OrderPlaced"):
    amount: int


class Seen(Handler):
    """Records the orders of the OrderEvents it handles (class-level: handlers are copied)."""

    orders: list[str] = []

    @handles
    def on(self, message: OrderEvent) -> None:
        self.orders.append(message.order_id)


class PartnerSeen(Handler):
    @handles
    def on(self, message: PartnerEvent) -> None: ...


def test_a_key_is_expected_only_as_its_type_or_that_types_hierarchy_key():
    from idembus.hierarchy import unexpected_routing_key

    enclosed = "shop.OrderPlaced,shop.OrderEvent"
    key = "~.shop~OrderPlaced.shop~OrderEvent.~"
    assert unexpected_routing_key("shop.OrderEvent", "shop.OrderEvent", None) is None
    assert unexpected_routing_key(key, "shop.OrderPlaced", enclosed) is None
    assert unexpected_routing_key("shop.OrderPlaced", "shop.OrderPlaced", enclosed) is None
    # another type's key, a key with a prefix, enclosed types not starting with the type
    assert unexpected_routing_key("shop.PartnerEvent", "shop.OrderEvent", None)
    assert unexpected_routing_key("partner." + key, "shop.OrderPlaced", enclosed)
    assert unexpected_routing_key(key, "shop.OrderEvent", enclosed)
    assert "neither its type" in str(unexpected_routing_key("x\n" * 200, "t", None))
    assert len(str(unexpected_routing_key("x" * 5000, "t", None))) < 600


def test_a_delivery_whose_key_belongs_to_another_type_goes_to_the_error_queue(
    make_endpoint: MakeEndpoint, make_transport: Callable[..., KombuTransport],
    transport_url: str,
):
    # Given an endpoint subscribed to PartnerEvent that also handles OrderEvent
    Seen.orders = []
    transport = make_transport()
    endpoint = make_endpoint("mixed", transport=transport, handlers=[PartnerSeen, Seen])
    failed = SignalCounter(endpoint, "dead_lettered")
    handled = SignalCounter(endpoint, "handled")
    endpoint.start()

    # When a client publishes an OrderEvent with PartnerEvent's routing key (which its
    # permissions allow), then the real thing through idembus
    with foreign_connection(transport_url) as connection:
        exchange = kombu.Exchange(transport.exchange_name, type="topic", durable=True)
        connection.Producer().publish(
            b'{"order_id": "forged"}', exchange=exchange, routing_key="shop.PartnerEvent",
            content_type="application/json",
            headers={h.MESSAGE_ID: str(uuid.uuid4()), h.MESSAGE_TYPE: "shop.OrderEvent"})
    endpoint.bus.publish(OrderEvent(order_id="real"))

    # Then the forged one is dead-lettered with the reason, and only the real one handled
    assert failed.wait_for(1) and handled.wait_for(1)
    wait_until_idle([endpoint])
    assert Seen.orders == ["real"]
    reason = str(failed.details[0]["error"])
    assert "routing key 'shop.PartnerEvent' is neither its type" in reason, reason


# -- RabbitMQ: an account limited by topic permissions --------------------------------


def _ctl(*args: str) -> None:
    subprocess.run(["rabbitmqctl", *args], check=True, capture_output=True, timeout=60)


@pytest.fixture
def partner(unique: str) -> Iterator[tuple[str, str]]:
    """A RabbitMQ user of this vhost that may publish to this test's events exchange only
    with keys starting ``partner.``; deleted afterwards. Yields (user, exchange)."""
    require_service(AMQP_URL, "RabbitMQ")
    vhost = urllib.parse.unquote(urllib.parse.urlparse(AMQP_URL).path[1:]) or "/"
    user, exchange = f"partner-{unique}", f"test-events-{unique}"
    _ctl("add_user", user, f"pw-{unique}")
    try:
        _ctl("set_permissions", "-p", vhost, user, "^$", f"^{exchange}$", "^$")
        _ctl("set_topic_permissions", "-p", vhost, user, exchange, r"^partner\.", r"^partner\.")
        yield user, exchange
    finally:
        _ctl("delete_user", user)


def _publish_as(user: str, password: str, exchange: str, key: str,
                message_type: str) -> bool:
    """Publish as ``user`` (mandatory, confirmed); True if some queue took it."""
    parsed = urllib.parse.urlparse(AMQP_URL)
    vhost = urllib.parse.unquote(parsed.path[1:]) or "/"
    connection = amqp.Connection(host=f"{parsed.hostname}:{parsed.port or 5672}",
                                 userid=user, password=password, virtual_host=vhost,
                                 confirm_publish=True)
    connection.connect()
    returned: list[Any] = []
    try:
        channel = connection.channel()
        channel.events["basic_return"].add(lambda *args: returned.append(args))
        channel.basic_publish(
            amqp.Message(json.dumps({"order_id": "forged"}), content_type="application/json",
                         application_headers={h.MESSAGE_ID: str(uuid.uuid4()),
                                              h.MESSAGE_TYPE: message_type}),
            exchange=exchange, routing_key=key, mandatory=True)
    finally:
        connection.close()
    return not returned


@pytest.mark.amqp
def test_an_account_limited_to_partner_keys_reaches_no_subscriber_of_another_type(
    partner: tuple[str, str], unique: str,
):
    user, exchange = partner
    Seen.orders = []
    transport = KombuTransport(AMQP_URL, exchange=exchange)
    queue, error = f"orders-{unique}", f"error-{unique}"
    endpoint: Endpoint | None = None
    try:
        # Given an endpoint subscribed to OrderEvent whose queue an older idembus had bound
        # with the unanchored pattern
        transport.declare(queue)
        with plain_amqp(AMQP_URL) as channel:
            channel.exchange_declare(exchange, "topic", durable=True, auto_delete=False)
            channel.queue_bind(queue, exchange, "#.shop~OrderEvent.#")
        endpoint = Endpoint(queue, transport=transport, error_queue=error, handlers=[Seen])
        handled = SignalCounter(endpoint, "handled")
        endpoint.start()

        # When the partner account publishes an OrderEvent with a key its permissions allow
        # Then no queue takes it (before: the legacy and the #.<word>.# bindings did)
        assert not _publish_as(user, f"pw-{unique}", exchange, "partner.shop~OrderEvent",
                               "shop.OrderEvent")
        assert not _publish_as(user, f"pw-{unique}", exchange,
                               "partner.~.shop~OrderEvent.~", "shop.OrderEvent")
        # and the keys that would reach it are refused by its topic permissions
        with pytest.raises(amqp.exceptions.AccessRefused):
            _publish_as(user, f"pw-{unique}", exchange, "~.shop~OrderEvent.~",
                        "shop.OrderEvent")

        # and the permission the docs give a partner for its own hierarchies lets it
        # publish them, never with another's words
        vhost = urllib.parse.unquote(urllib.parse.urlparse(AMQP_URL).path[1:]) or "/"
        own = r"^~(\.partner~[^.]+)+\.~$"
        _ctl("set_topic_permissions", "-p", vhost, user, exchange, own, own)
        assert not _publish_as(user, f"pw-{unique}", exchange,
                               "~.partner~Refund.partner~Event.~", "partner.Refund")
        with pytest.raises(amqp.exceptions.AccessRefused):
            _publish_as(user, f"pw-{unique}", exchange, "~.partner~Refund.shop~OrderEvent.~",
                        "partner.Refund")

        # While the legitimate hierarchy delivery still works
        endpoint.bus.publish(OrderPlaced(order_id="real", amount=1))
        assert handled.wait_for(1)
        wait_until_idle([endpoint])
        assert Seen.orders == ["real"]
    finally:
        if endpoint is not None:
            endpoint.close()
        cleaner = KombuTransport(AMQP_URL, exchange=exchange)
        for name in (queue, error):
            cleaner.delete_queue(name)
        cleaner.delete_exchange()
        cleaner.close()
        transport.close()
