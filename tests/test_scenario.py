"""idembus.testing.Scenario: endpoints' handlers on in-memory parts with a FakeClock,
through the endpoints' own processor, deterministic and without sleeps."""

from __future__ import annotations

import datetime

import pytest
from pydantic import BaseModel

from idembus import Command, ConfigurationError, Event, RetryPolicy, RoutingError
from idembus import headers as h
from idembus.clock import Clock
from idembus.envelope import Envelope, format_utc
from idembus.handlers import AggregateHandler, Handler, handles
from idembus.storage.memory import MemoryStorage
from idembus.testing import FakeClock, Scenario, ScenarioError

START = datetime.datetime(2030, 1, 1, 12, 0, tzinfo=datetime.timezone.utc)
HOUR = datetime.timedelta(hours=1)


class PlaceOrder(Command, message_name="scenario.PlaceOrder"):
    order_id: str
    amount: int = 10


class ChargeCard(Command, message_name="scenario.ChargeCard"):
    order_id: str
    amount: int


class CardCharged(Event, message_name="scenario.CardCharged"):
    order_id: str


class CancelUnpaid(Command, message_name="scenario.CancelUnpaid"):
    order_id: str


class OrderPlaced(Event, message_name="scenario.OrderPlaced"):
    order_id: str


class OrderPaid(Event, message_name="scenario.OrderPaid"):
    order_id: str


class OrderCancelled(Event, message_name="scenario.OrderCancelled"):
    order_id: str


class Order(BaseModel):
    status: str = "new"


class OrderPolicy(AggregateHandler[Order]):
    """Places an order, has the card charged, and cancels it if unpaid after 24 hours."""

    sends = (ChargeCard,)

    def aggregate_id(self, message: PlaceOrder | CardCharged | CancelUnpaid) -> str:
        return message.order_id

    @handles
    def place(self, message: PlaceOrder) -> None:
        self.state.status = "placed"
        self.bus.send(ChargeCard(order_id=message.order_id, amount=message.amount))
        self.bus.publish(OrderPlaced(order_id=message.order_id))
        self.request_timeout(CancelUnpaid(order_id=message.order_id), 24 * HOUR)

    @handles
    def paid(self, message: CardCharged) -> None:
        self.state.status = "paid"
        self.bus.publish(OrderPaid(order_id=message.order_id))

    @handles
    def timed_out(self, message: CancelUnpaid) -> None:
        if self.state.status == "placed":
            self.state.status = "cancelled"
            self.bus.publish(OrderCancelled(order_id=message.order_id))


class Billing(Handler):
    @handles
    def charge(self, message: ChargeCard) -> None:
        self.bus.reply(CardCharged(order_id=message.order_id))


def sales_and_billing(**options) -> Scenario:  # type: ignore[no-untyped-def]
    scenario = Scenario(handlers=[OrderPolicy], routes={ChargeCard: "billing"},
                        endpoint="sales", clock=FakeClock(START), **options)
    scenario.add_endpoint("billing", handlers=[Billing])
    return scenario


# -- the clock ----------------------------------------------------------------------------


def test_a_fake_clock_moves_only_when_told_and_only_forward() -> None:
    clock = FakeClock(START)
    assert isinstance(clock, Clock) and clock.now() == START == clock.now()

    assert clock.advance(HOUR, minutes=30, seconds=1) == START + datetime.timedelta(
        hours=1, minutes=30, seconds=1)
    assert clock.set(START + 2 * HOUR) == clock.now() == START + 2 * HOUR
    assert clock.advance(days=1) == START + datetime.timedelta(days=1, hours=2)

    with pytest.raises(ValueError, match="only moves forward"):
        clock.set(START)
    with pytest.raises(ValueError, match="only moves forward"):
        clock.advance(seconds=-1)
    with pytest.raises(ValueError, match="aware datetime"):
        FakeClock(datetime.datetime(2030, 1, 1))


def test_a_fake_clock_starts_at_the_whole_second_it_was_made_by_default() -> None:
    before = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    now = FakeClock().now()
    after = datetime.datetime.now(datetime.timezone.utc)
    assert before <= now <= after and now.microsecond == 0


# -- messages in, state and messages out ------------------------------------------------


def test_a_command_is_handled_at_once_and_its_effects_are_visible() -> None:
    # Given the order policy alone
    scenario = Scenario(handlers=[OrderPolicy], routes={ChargeCard: "billing"},
                        clock=FakeClock(START))

    # When an order is placed
    scenario.send(PlaceOrder(order_id="42", amount=30))

    # Then its state is stored and what it sent is recorded, with destinations and times
    assert scenario.state(Order, "42") == Order(status="placed")
    assert scenario.state(Order, "nope") is None
    assert scenario.sent == [ChargeCard(order_id="42", amount=30), CancelUnpaid(order_id="42")]
    assert scenario.published == [OrderPlaced(order_id="42")]
    charge, placed, timeout = scenario.outgoing
    assert (charge.destination, charge.endpoint, charge.source) == ("billing", "app", "handler")
    assert placed.destination is None and placed.intent is h.Intent.PUBLISH
    assert [o.at for o in scenario.outgoing] == [START] * 3
    assert charge.headers[h.TIME_SENT] == format_utc(START)
    # ChargeCard waits in billing's queue: billing is not part of this scenario
    assert [e.message_id for e in scenario.transport.messages("billing")] == [charge.message_id]


def test_a_saga_timeout_comes_due_only_when_the_clock_reaches_it() -> None:
    # Given a placed order whose billing never answers
    scenario = Scenario(handlers=[OrderPolicy], routes={ChargeCard: "billing"},
                        clock=FakeClock(START))
    scenario.send(PlaceOrder(order_id="42"))
    (timeout,) = scenario.deferred
    assert (timeout.message, timeout.deliver_at, timeout.destination) == (
        CancelUnpaid(order_id="42"), START + 24 * HOUR, "app")
    assert scenario.next_due == START + 24 * HOUR

    # When almost a day passes, nothing happens
    assert scenario.advance(hours=23, minutes=59) == 0
    assert scenario.state(Order, "42") == Order(status="placed")

    # When the day is over, the timeout is handled at its due time
    assert scenario.advance(minutes=2) == 1
    assert scenario.state(Order, "42") == Order(status="cancelled")
    assert scenario.published == [OrderPlaced(order_id="42"), OrderCancelled(order_id="42")]
    assert scenario.outgoing[-1].at == START + 24 * HOUR
    assert scenario.now == START + 24 * HOUR + datetime.timedelta(minutes=1)
    assert scenario.next_due is None


def test_a_reply_from_another_endpoint_pays_the_order_and_the_timeout_finds_it_paid() -> None:
    # Given sales and billing
    scenario = sales_and_billing()

    # When an order is placed, and a day passes
    scenario.send(PlaceOrder(order_id="42"))
    scenario.advance(days=1)

    # Then billing replied to sales, which was paid, and the timeout changed nothing
    (reply,) = [o for o in scenario.outgoing if o.intent is h.Intent.REPLY]
    charge = scenario.outgoing[0]
    assert (reply.message, reply.destination, reply.endpoint) == (
        CardCharged(order_id="42"), "sales", "billing")
    assert reply.headers[h.CORRELATION_ID] == charge.message_id
    assert scenario.replied == [CardCharged(order_id="42")]
    assert scenario.state(Order, "42") == Order(status="paid")
    assert scenario.published == [OrderPlaced(order_id="42"), OrderPaid(order_id="42")]
    assert scenario.endpoint("sales").counters["handled"] == 3
    assert scenario.errors == []


class Tick(Command, message_name="scenario.Tick"):
    n: int


class Ticker(Handler):
    """Notes each tick with the time it was handled, and defers the next an hour later."""

    def __init__(self, until: int, clock: FakeClock) -> None:
        self.until = until
        self.clock = clock
        self.seen: list[tuple[int, datetime.datetime]] = []

    @handles
    def tick(self, message: Tick) -> None:
        self.seen.append((message.n, self.clock.now()))
        if message.n < self.until:
            self.bus.defer(Tick(n=message.n + 1), HOUR)


def test_what_comes_due_is_handled_in_due_order_with_what_it_causes_in_one_advance() -> None:
    # Given ticks deferred out of order from outside, and a ticker that defers the next
    # tick an hour after each, up to 12
    clock = FakeClock(START)
    ticker = Ticker(until=12, clock=clock)
    scenario = Scenario(handlers=[ticker], clock=clock)
    for n, hours in ((10, 3), (0, 1), (5, 2)):
        scenario.defer(Tick(n=n), hours * HOUR)

    # When ten hours pass
    scenario.advance(hours=10)

    # Then each tick was handled at its due time, in due order, the chains included (at
    # one time, in the order they were sent)
    by_hour = {1: [0], 2: [5, 1], 3: [10, 6, 2], 4: [11, 7, 3], 5: [12, 8, 4], 6: [9, 5],
               7: [10, 6], 8: [11, 7], 9: [12, 8], 10: [9]}
    assert ticker.seen == [(n, START + hour * HOUR) for hour, ticks in by_hour.items()
                           for n in ticks]
    assert scenario.next_due == START + 11 * HOUR


def test_two_messages_due_at_the_same_time_come_in_the_order_they_were_sent() -> None:
    clock = FakeClock(START)
    ticker = Ticker(until=0, clock=clock)
    scenario = Scenario(handlers=[ticker], clock=clock)
    for n in (3, 1, 2):
        scenario.defer(Tick(n=n), HOUR)
    scenario.advance(hours=1)
    assert [n for n, _ in ticker.seen] == [3, 1, 2]


# -- failures, in virtual time ------------------------------------------------------------


class Flaky(Handler):
    """Fails its first ``failures`` attempts."""

    retry_policy = RetryPolicy(immediate_retries=1, delayed=(10.0, 60.0))

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.tries = [0]  # shared by the copies the endpoint makes for each message

    @property
    def attempts(self) -> int:
        return self.tries[0]

    @handles
    def on(self, message: Tick) -> None:
        self.tries[0] += 1
        if self.attempts <= self.failures:
            raise ConnectionError(f"attempt {self.attempts} failed")
        self.bus.publish(OrderPlaced(order_id=str(message.n)))


def test_delayed_retries_wait_the_retry_policys_delays_in_virtual_time() -> None:
    # Given a handler that always fails, retried once at once, then after 10 s and 60 s
    flaky = Flaky(failures=100)
    scenario = Scenario(handlers=[flaky], clock=FakeClock(START))

    # When a message comes, the immediate retry happens and the first delayed one waits
    scenario.send(Tick(n=1))
    assert flaky.attempts == 2
    assert scenario.next_due == START + datetime.timedelta(seconds=10)
    assert scenario.advance(seconds=9) == 0 and flaky.attempts == 2

    # Then each delayed round comes at its time, and after the last the error queue has it
    assert scenario.advance(seconds=1) == 1 and flaky.attempts == 4
    assert scenario.next_due == START + datetime.timedelta(seconds=70)
    assert scenario.errors == []
    scenario.advance(minutes=1)
    assert flaky.attempts == 6
    (failed,) = scenario.errors
    assert failed.message == Tick(n=1)
    assert (failed.exception_type, failed.reason) == ("builtins.ConnectionError",
                                                      "attempt 6 failed")
    assert (failed.failed_queue, failed.error_queue, failed.attempts) == ("app", "error", (2, 2))
    assert scenario.published == [] and scenario.next_due is None


def test_a_handler_that_recovers_on_a_delayed_retry_takes_effect_once() -> None:
    flaky = Flaky(failures=3)
    scenario = Scenario(handlers=[flaky], clock=FakeClock(START))
    scenario.send(Tick(n=7))
    scenario.advance(minutes=5)
    assert flaky.attempts == 4  # two in the first round, one failing and one passing later
    assert scenario.published == [OrderPlaced(order_id="7")]
    assert scenario.errors == []
    counters = scenario.endpoint().counters
    assert (counters["handled"], counters["retried"], counters["failed"]) == (1, 3, 3)


def test_fail_fast_raises_at_the_first_message_that_reaches_an_error_queue() -> None:
    scenario = Scenario(handlers=[Flaky(failures=100)], clock=FakeClock(START),
                        fail_fast=True)
    scenario.send(Tick(n=1))  # the delayed retries wait: nothing in the error queue yet
    with pytest.raises(ScenarioError, match=r"scenario.Tick .* went to error: "
                                            r"builtins.ConnectionError: attempt 6 failed"):
        scenario.advance(minutes=2)


def test_bad_input_goes_to_the_error_queue_with_the_reason() -> None:
    scenario = Scenario(handlers=[OrderPolicy], routes={ChargeCard: "billing"},
                        clock=FakeClock(START))
    scenario.deliver(Envelope(headers={h.MESSAGE_ID: "m-1", h.MESSAGE_TYPE: "scenario.Nope"},
                              body="{}", destination="app"))
    (failed,) = scenario.errors
    assert failed.message is None and failed.message_id == "m-1"
    assert failed.exception_type == "idembus.errors.UnknownMessageType"
    assert "unknown message type 'scenario.Nope'" in failed.reason


# -- the real processor ---------------------------------------------------------------------


def test_a_duplicate_is_found_processed_and_its_handler_does_not_run_again() -> None:
    scenario = Scenario(handlers=[OrderPolicy], routes={ChargeCard: "billing"},
                        clock=FakeClock(START))
    scenario.send(PlaceOrder(order_id="42"), message_id="m-42")
    scenario.advance(hours=1)
    scenario.send(PlaceOrder(order_id="42"), message_id="m-42")

    counters = scenario.endpoint().counters
    assert (counters["handled"], counters["duplicate"]) == (1, 1)
    assert len(scenario.deferred) == 1 and scenario.deferred[0].deliver_at == START + 24 * HOUR
    # the first dispatch was confirmed: the duplicate has nothing left to send
    assert len(scenario.outgoing) == 3


def test_endpoint_options_reach_the_real_endpoint_and_its_storage_is_the_given_one() -> None:
    storage = MemoryStorage()
    scenario = Scenario(handlers=[OrderPolicy], routes={ChargeCard: "billing"},
                        clock=FakeClock(START), storage=storage,
                        propagate_headers=("tenant",))
    scenario.send(PlaceOrder(order_id="42"), headers={"tenant": "t-1"})
    assert storage.load("Order", "42").state == {"status": "placed"}
    assert {o.headers.get("tenant") for o in scenario.outgoing} == {"t-1"}
    endpoint = scenario.endpoint()
    assert endpoint.clock is scenario.clock and endpoint.transport is scenario.transport


def test_what_a_unit_of_work_or_endpoint_bus_sends_is_recorded_and_run_delivers_it() -> None:
    # Given sales and billing
    scenario = sales_and_billing()
    sales = scenario.endpoint("sales")

    # When a unit of work of sales places an order, and sales' bus sends a charge
    with sales.unit_of_work(Order, "42", operation_id="op-1") as work:
        work.state.status = "placed"
        work.bus.publish(OrderPlaced(order_id="42"))
    sales.bus.send(ChargeCard(order_id="42", amount=5))
    assert scenario.endpoint("billing").counters["received"] == 0

    # Then both are recorded with their source, and run() delivers the charge to billing,
    # whose reply pays the order
    assert [(o.message, o.source) for o in scenario.outgoing] == [
        (OrderPlaced(order_id="42"), "unit_of_work"),
        (ChargeCard(order_id="42", amount=5), "bus")]
    assert scenario.run() == 2
    assert scenario.state(Order, "42") == Order(status="paid")


def test_a_handler_that_keeps_sending_itself_messages_ends_in_a_scenario_error() -> None:
    class Echo(Handler):
        @handles
        def on(self, message: Tick) -> None:
            self.bus.send(Tick(n=message.n + 1))

    scenario = Scenario(handlers=[Echo], clock=FakeClock(START), max_messages=50)
    with pytest.raises(ScenarioError, match="still busy after 50 deliveries"):
        scenario.send(Tick(n=0))
    assert scenario.endpoint().counters["handled"] == 50


def test_a_deferral_chain_over_a_long_advance_is_bounded_too() -> None:
    clock = FakeClock(START)
    scenario = Scenario(handlers=[Ticker(until=10**9, clock=clock)], clock=clock,
                        max_messages=100)
    scenario.defer(Tick(n=0), HOUR)
    with pytest.raises(ScenarioError, match="still busy after 100 deliveries"):
        scenario.advance(days=365)
    assert scenario.now == START + 101 * HOUR
    assert scenario.endpoint().counters["handled"] == 100


# -- wiring ---------------------------------------------------------------------------------


def test_a_scenario_keeps_its_own_transport_and_clock_and_one_name_per_endpoint() -> None:
    scenario = Scenario(clock=FakeClock(START))
    with pytest.raises(ConfigurationError, match="own transport and clock: leave"):
        scenario.add_endpoint("a", handlers=[Billing], transport="memory://",
                              clock=FakeClock(START))
    scenario.add_endpoint("a", handlers=[Billing])
    with pytest.raises(ConfigurationError, match="already has an endpoint named 'a'"):
        scenario.add_endpoint("a", handlers=[Billing])
    with pytest.raises(ConfigurationError, match="the name the scenario itself sends under"):
        scenario.add_endpoint("scenario", handlers=[Billing])
    with pytest.raises(ConfigurationError, match="runs on a FakeClock"):
        Scenario(clock=object())  # type: ignore[arg-type]


def test_a_command_from_outside_goes_to_the_one_endpoint_that_handles_it() -> None:
    scenario = Scenario(clock=FakeClock(START))
    scenario.add_endpoint("billing-eu", handlers=[Billing])
    with pytest.raises(RoutingError, match="no endpoint of the scenario handles"):
        scenario.send(PlaceOrder(order_id="1"))
    scenario.send(ChargeCard(order_id="1", amount=5))
    assert scenario.endpoint("billing-eu").counters["handled"] == 1

    scenario.add_endpoint("billing-us", handlers=[Billing])
    with pytest.raises(RoutingError, match="handled by billing-eu, billing-us: pass to="):
        scenario.send(ChargeCard(order_id="2", amount=5))
    scenario.send(ChargeCard(order_id="2", amount=5), to="billing-us")
    assert scenario.endpoint("billing-us").counters["handled"] == 1
    # the replies went to the scenario itself, the sender
    assert {o.destination for o in scenario.outgoing} == {"scenario"}


def test_state_asks_which_endpoint_when_two_keep_the_type() -> None:
    scenario = Scenario(clock=FakeClock(START))
    for name in ("sales-eu", "sales-us"):
        scenario.add_endpoint(name, handlers=[OrderPolicy], routes={ChargeCard: "billing"})
    scenario.send(PlaceOrder(order_id="42"), to="sales-us")
    with pytest.raises(ValueError, match=r"2 endpoints .* keep Order \(sales-eu, sales-us\)"):
        scenario.state(Order, "42")
    assert scenario.state(Order, "42", endpoint="sales-us") == Order(status="placed")
    assert scenario.state(Order, "42", endpoint="sales-eu") is None
    with pytest.raises(ValueError, match="no endpoints of the scenario keep Order"):
        scenario.state(Order, "42", endpoint="billing")


class ShortSaga(AggregateHandler[Order]):
    """A saga that ends when its order is paid, leaving a tombstone."""

    starts = (PlaceOrder,)

    def aggregate_id(self, message: PlaceOrder | CardCharged) -> str:
        return message.order_id

    @handles
    def place(self, message: PlaceOrder) -> None:
        self.state.status = "placed"

    @handles
    def paid(self, message: CardCharged) -> None:
        self.complete()


def test_a_completed_saga_has_no_state_but_is_known_as_completed() -> None:
    scenario = Scenario(handlers=[ShortSaga], clock=FakeClock(START))
    scenario.send(PlaceOrder(order_id="7"))
    assert scenario.state(Order, "7") == Order(status="placed")
    assert not scenario.completed(Order, "7")

    scenario.publish(CardCharged(order_id="7"))

    assert scenario.state(Order, "7") is None
    assert scenario.completed(Order, "7")
    assert not scenario.completed(Order, "never-placed")


class OrderEvent(Event, message_name="scenario.OrderEvent"):
    order_id: str


class RushOrderPlaced(OrderEvent, message_name="scenario.RushOrderPlaced"):
    courier: str = "bike"


class OrderEventLog(Handler):
    def __init__(self) -> None:
        self.seen: list[OrderEvent] = []

    @handles
    def any_order_event(self, message: OrderEvent) -> None:
        self.seen.append(message)


def test_a_handler_of_a_base_event_receives_its_subclass_in_a_scenario_once() -> None:
    log = OrderEventLog()
    scenario = Scenario(handlers=[log], clock=FakeClock(START))

    scenario.publish(RushOrderPlaced(order_id="9", courier="van"))

    assert [type(seen) for seen in log.seen] == [OrderEvent]  # decoded as the type it knows
    assert log.seen[0].order_id == "9"
    assert scenario.endpoint().counters["handled"] == 1


def test_an_event_no_endpoint_of_the_scenario_subscribes_to_is_counted_as_unrouted() -> None:
    scenario = Scenario(handlers=[ShortSaga], clock=FakeClock(START))

    scenario.endpoint().bus.publish(OrderPaid(order_id="1"))

    assert scenario.endpoint().counters["unrouted"] == 1
