"""Routes of the commands handlers send are checked when the endpoint starts, not at the
first message (idembus.handlers.sends): declared, inferred from the handlers' source, or
neither (a WARNING, or with strict_routes a start failure)."""

from __future__ import annotations

import logging
import textwrap

import pytest

import tests.support as support_module
from idembus import Command, ConfigurationError, Endpoint, Event
from idembus.handlers import Handler, handles
from idembus.handlers.sends import sends_of
from idembus.storage.memory import MemoryStorage
from tests.support import Deposit
from tests.test_cli import idembus


class ChargePayment(Command, message_name="routes.ChargePayment"):
    order_id: str


class ShipOrder(Command, message_name="routes.ShipOrder"):
    order_id: str


class OrderPlaced(Event, message_name="routes.OrderPlaced"):
    order_id: str


class Saga(Handler):  # declares nothing: ChargePayment is read from its source
    @handles
    def on(self, message: Deposit) -> None:
        self.bus.send(ChargePayment(order_id=message.account))
        self.bus.publish(OrderPlaced(order_id=message.account))


def endpoint(*handlers: type[Handler], **options) -> Endpoint:
    return Endpoint("routes", storage=MemoryStorage(), handlers=list(handlers), **options)


def route_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "idembus.handlers.sends" and r.levelno == logging.WARNING]


def test_an_inferred_command_without_a_route_is_a_warning_at_start(caplog):
    # Given a saga that sends ChargePayment without declaring it, and no route for it
    service = endpoint(Saga)
    # When it starts
    with caplog.at_level(logging.WARNING):
        service.start()
    service.close()
    # Then the start says which handler sends which command, where, and what to add
    (line,) = route_warnings(caplog)
    assert "Saga sends routes.ChargePayment (Saga.on (test_sent_routes.py:" in line
    assert "'routes' has no route for it: add routes={ChargePayment: '<endpoint name>'}" in line
    assert "--strict-routes" in line


def test_strict_routes_makes_a_missing_inferred_route_a_start_failure():
    service = endpoint(Saga, strict_routes=True)
    with pytest.raises(ConfigurationError,
                       match=r"strict routes.*Saga sends routes.ChargePayment.*no route"):
        service.start()
    assert not service.running
    service.close()
    # With the route, it starts
    routed = endpoint(Saga, strict_routes=True, routes={ChargePayment: "billing"})
    routed.start()
    routed.close()


def test_a_routed_command_and_events_give_no_warning(caplog):
    with caplog.at_level(logging.WARNING):
        service = endpoint(Saga, routes={ChargePayment: "billing"})
        service.start()
        service.close()
    assert route_warnings(caplog) == []


class Builder:
    def make(self) -> ChargePayment:
        return ChargePayment(order_id="1")

    def ship(self) -> ShipOrder:
        return ShipOrder(order_id="1")


class Inferred(Handler):
    """Every way of sending that is read: model_validate, an alias of the bus, a name
    assigned a command, an annotated parameter, a quoted annotation, a dotted name, defer;
    to= needs no route."""

    @handles
    def on(self, message: Deposit) -> None:
        self.bus.send(ChargePayment.model_validate({"order_id": "1"}))
        bus = self.bus
        command = ShipOrder(order_id="1")
        bus.defer(command, 5)
        self._annotated(ChargePayment(order_id="2"))
        self.bus.send(support_module.Deposit(account="a", amount=1))
        self.bus.send(ShipOrder(order_id="3"), to="elsewhere")

    def _annotated(self, charge: ChargePayment) -> None:
        self.bus.send(charge)
        later: ShipOrder = Builder().ship()  # the annotation says
        self.bus.send(later)


def test_sends_are_inferred_from_calls_aliases_assignments_and_annotations():
    found = sends_of(Inferred)
    assert found.unknown == ()
    assert set(found.commands) == {ChargePayment, ShipOrder, Deposit}
    assert len(found.inferred) == 5  # the send with to= is not among them
    assert all(" (test_sent_routes.py:" in send.where for send in found.inferred)


class Opaque(Handler):
    @handles
    def on(self, message: Deposit) -> None:
        self.bus.send(Builder().make())


class DeclaredOpaque(Opaque):
    sends = (ChargePayment,)


class HandsOverTheBus(Handler):
    @handles
    def on(self, message: Deposit) -> None:
        forward(self.bus)


def forward(bus) -> None:  # not read: a helper outside the class
    bus.send(ChargePayment(order_id="1"))


class Quiet(Handler):  # sends nothing: nothing to say
    @handles
    def on(self, message: Deposit) -> None:
        print(message.account)


def test_a_send_that_cannot_be_named_warns_unless_the_handler_declares_sends(caplog):
    with caplog.at_level(logging.WARNING):
        endpoint(Opaque, HandsOverTheBus, Quiet).start()  # (stopped when collected)
    opaque, handed = route_warnings(caplog)
    assert "Opaque sends a command idembus cannot name (Opaque.on (test_sent_routes.py:" in opaque
    assert "self.bus.send(Builder().make())" in opaque and "declare sends = (...)" in opaque
    assert "HandsOverTheBus" in handed and "forward(self.bus)" in handed

    caplog.clear()
    with caplog.at_level(logging.WARNING):
        endpoint(DeclaredOpaque, routes={ChargePayment: "billing"}).start()
    assert route_warnings(caplog) == []
    with pytest.raises(ConfigurationError, match="HandsOverTheBus sends a command idembus "
                                                 "cannot name.*declare sends"):
        endpoint(HandsOverTheBus, strict_routes=True).start()


def test_a_class_defined_in_a_function_is_read_with_its_closure():
    class Local(Command, message_name="routes.Local"):
        n: int

    class Sender(Handler):
        @handles
        def on(self, message: Deposit) -> None:
            self.bus.send(Local(n=1))

    assert sends_of(Sender).commands == [Local]


APP = textwrap.dedent('''
    from idembus import Command, Endpoint
    from idembus.handlers import Handler, handles
    from idembus.storage.memory import MemoryStorage
    from tests.support import Deposit


    class ChargePayment(Command, message_name="app.ChargePayment"):
        order_id: str


    class Saga(Handler):
        @handles
        def on(self, message: Deposit) -> None:
            self.bus.send(ChargePayment(order_id=message.account))


    def make() -> Endpoint:
        return Endpoint("routes-app", storage=MemoryStorage(), handlers=[Saga])
''')


def test_idembus_run_strict_routes_fails_the_start_with_exit_2(tmp_path):
    (tmp_path / "routes_app.py").write_text(APP)
    process = idembus("run", "routes_app:make", "--strict-routes", cwd=tmp_path)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 2, (out, err)
    assert "Saga sends app.ChargePayment" in err and "no route" in err
