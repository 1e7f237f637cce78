"""Misconfiguration fails at start with a message that says what to fix."""

from __future__ import annotations

import threading

import pytest

from idembus import Command, ConfigurationError, Endpoint, Event, RoutingError
from idembus.handlers import Handler, handles
from idembus.storage.errors import StorageUnavailable
from idembus.storage.memory import MemoryStorage
from idembus.storage.mongo import MongoStorage
from idembus.transports.errors import TransportUnavailable
from idembus.transports.kombu import KombuTransport
from tests.support import AccountHandler, Deposit, SignalCounter


class Refund(Command, message_name="cfg.Refund"):
    order_id: str


class Refunded(Event, message_name="cfg.Refunded"):
    order_id: str


class Refunds(Handler):
    sends = (Refund,)

    @handles
    def on(self, message: Refunded) -> None:
        self.bus.send(Refund(order_id=message.order_id))


def endpoint(**options) -> Endpoint:
    options.setdefault("storage", MemoryStorage())
    return Endpoint(options.pop("name", "cfg"), **options)


def test_an_event_in_routes_is_refused_because_events_are_published():
    with pytest.raises(ConfigurationError, match="cfg.Refunded|Refunded is an event"):
        endpoint(routes={Refunded: "billing"})


def test_a_route_key_that_is_not_a_command_type_is_refused():
    with pytest.raises(ConfigurationError, match="is not a command type"):
        endpoint(routes={"cfg.Refund": "billing"})


def test_a_route_without_an_endpoint_name_is_refused():
    with pytest.raises(ConfigurationError, match="Refund needs an endpoint name"):
        endpoint(routes={Refund: " "})


def test_a_declared_sent_command_without_a_route_fails_at_start():
    with pytest.raises(ConfigurationError, match=r"Refunds sends cfg.Refund but 'cfg' has no route"
                                                 r".*routes=\{Refund: '<endpoint name>'\}"):
        endpoint(handlers=[Refunds])
    assert endpoint(handlers=[Refunds], routes={Refund: "billing"}).router.destination_for(
        Refund) == "billing"


def test_a_sends_declaration_listing_an_event_is_refused():
    class Confused(Handler):
        sends = (Refunded,)

        @handles
        def on(self, message: Refund) -> None:
            pass

    with pytest.raises(ConfigurationError, match="list the Command types"):
        endpoint(handlers=[Confused])


def test_a_route_to_this_endpoint_for_a_command_it_does_not_handle_fails():
    with pytest.raises(ConfigurationError, match="no handler of 'cfg' handles it"):
        endpoint(routes={Refund: "cfg"})


def test_commands_an_endpoint_handles_are_routed_to_itself():
    assert endpoint(handlers=[AccountHandler]).router.destination_for(Deposit) == "cfg"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"name": "has space"}, "endpoint name 'has space'"),
        ({"name": ""}, "endpoint name ''"),
        ({"concurrency": 0}, "concurrency must be at least 1"),
        ({"prefetch": 0}, "prefetch must be at least 1"),
        ({"error_queue": "cfg"}, "error queue cannot be the endpoint's own queue"),
        ({"transport": 42}, "transport must be a Transport or a kombu URL"),
        ({"storage": "mongodb://db"}, "storage must be a storage backend"),
        ({"transport": "nosuch://host"}, "transport URL 'nosuch://host' cannot be used"),
        ({"clock": "now"}, "clock must have a now\\(\\) method"),
    ],
)
def test_bad_endpoint_options_fail_with_what_to_change(options, message):
    with pytest.raises(ConfigurationError, match=message):
        endpoint(**options)


def test_an_unreachable_database_fails_at_start_with_a_clear_message():
    storage = MongoStorage("mongodb://127.0.0.1:1/?serverSelectionTimeoutMS=200")
    unreachable = endpoint(storage=storage, handlers=[AccountHandler])
    try:
        with pytest.raises(StorageUnavailable, match="MongoDB is unreachable"):
            unreachable.start()
        assert not unreachable.running
    finally:
        unreachable.close()


def test_an_unreachable_broker_fails_at_start_with_a_clear_message():
    broker = KombuTransport("amqp://guest:guest@127.0.0.1:1//")
    unreachable = endpoint(transport=broker, handlers=[AccountHandler])
    try:
        with pytest.raises(TransportUnavailable, match="cannot connect to amqp://"):
            unreachable.start()
        assert not unreachable.running
    finally:
        unreachable.close()


def test_sending_an_unrouted_command_from_outside_a_handler_raises_at_the_call():
    with pytest.raises(RoutingError, match="no route for command cfg.Refund"):
        endpoint(handlers=[AccountHandler]).bus.send(Refund(order_id="1"))


def test_a_handler_sending_an_unrouted_command_goes_to_the_error_queue_without_retries(
    make_endpoint,
):
    class Undeclared(Handler):  # no `sends`: the missing route shows at run time
        @handles
        def on(self, message: Deposit) -> None:
            self.bus.send(Refund(order_id=message.account))

    service = make_endpoint("cfg", handlers=[Undeclared])
    failed = SignalCounter(service, "failed")
    dead = SignalCounter(service, "dead_lettered")
    service.start()

    service.bus.send(Deposit(account="a", amount=1))

    assert dead.wait_for(1)
    assert failed.count == 1
    assert isinstance(dead.details[0]["error"], RoutingError)


def test_starting_twice_is_refused(make_endpoint):
    service = make_endpoint("cfg", handlers=[AccountHandler])
    service.start()
    with pytest.raises(RuntimeError, match="already running"):
        service.start()


def test_a_stop_requested_while_starting_is_honoured(make_endpoint):
    # Given an endpoint asked to stop before it has even started (SIGTERM during start-up)
    service = make_endpoint("cfg", handlers=[AccountHandler])
    service.request_stop()

    # When it runs, it stops at once instead of forgetting the request
    done = threading.Event()
    runner = threading.Thread(target=lambda: (service.run(), done.set()), daemon=True)
    runner.start()
    assert done.wait(15), "run() ignored the stop requested before start"
    assert not service.running


def test_an_endpoint_can_start_again_after_a_stop(make_endpoint):
    service = make_endpoint("cfg", handlers=[AccountHandler])
    handled = SignalCounter(service, "handled")
    service.start()
    assert service.stop()
    service.start()
    service.bus.send(Deposit(account="a", amount=1))
    assert handled.wait_for(1)
