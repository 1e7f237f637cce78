"""Message expiry: ``discard_after`` on sends and per type, and receivers that acknowledge a
late message unhandled — after the deduplication lookup, so what a handler stored is still
sent again. The receivers run on memory://, RabbitMQ and Redis; their clock is a FakeClock,
so that "later" is a step of the clock, not a sleep."""

from __future__ import annotations

import datetime
import logging
import threading
import uuid

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from pydantic import BaseModel

from idembus import Command, ConfigurationError, Endpoint, Event, MalformedMessage, RetryPolicy
from idembus import headers as h
from idembus.cli.errors import retried_envelope
from idembus.cli.status import summarise
from idembus.context import MessageContext
from idembus.envelope import Envelope, format_utc, utc_now
from idembus.expiry import expiry_of
from idembus.failures import failure_headers
from idembus.handlers import AggregateHandler, Handler, handles
from idembus.observability.metrics import Metrics
from idembus.routing import Router
from idembus.runtime.status import StatusReporter
from idembus.sending import Bus
from idembus.storage.base import AggregateRecord
from idembus.storage.memory import MemoryStorage
from idembus.testing import FakeClock, Scenario, wait_until_idle
from idembus.testing.faults import CrashPoint, FaultInjector, SimulatedCrash
from idembus.transports.base import Delivery
from idembus.transports.kombu import KombuTransport
from tests.support import (
    Account,
    AccountHandler,
    Deposit,
    Ledger,
    SignalCounter,
    outbox_relay,
)
from tests.test_metrics import labels, points, values

START = datetime.datetime(2030, 1, 1, 12, 0, tzinfo=datetime.timezone.utc)
HOUR = datetime.timedelta(hours=1)


class Quote(Command, message_name="expiry.Quote"):
    symbol: str
    price: int


class Reminder(Command, message_name="expiry.Reminder", discard_after=30):
    text: str


class UrgentReminder(Reminder, message_name="expiry.UrgentReminder"):
    pass


class Notice(Event, message_name="expiry.Notice",
             discard_after=datetime.timedelta(minutes=5)):
    text: str


class Book(BaseModel):
    price: int = 0


class QuoteBook(AggregateHandler[Book]):
    def aggregate_id(self, message: Quote) -> str:
        return message.symbol

    @handles
    def quote(self, message: Quote) -> None:
        self.state.price = message.price


def recording_bus(clock: FakeClock, origin: MessageContext | None = None,
                  ) -> tuple[Bus, list[Envelope]]:
    sent: list[Envelope] = []
    router = Router({Quote: "pricing", Reminder: "pricing", UrgentReminder: "pricing"})
    return Bus("sender", router, sent.append, origin, clock=clock), sent


# -- on the wire (no broker) ----------------------------------------------------------------


def test_every_way_of_sending_stamps_the_time_sent_plus_the_time_to_live() -> None:
    origin = MessageContext(message_id="m-1", message_type="expiry.Quote",
                            headers={h.REPLY_TO: "client"}, handler_name="QuoteBook",
                            endpoint="sender")
    bus, sent = recording_bus(FakeClock(START), origin)

    bus.send(Quote(symbol="A", price=1), discard_after=60)
    bus.publish(Notice(text="n"), discard_after=datetime.timedelta(seconds=90))
    bus.reply(Quote(symbol="A", price=1), discard_after=2.5)

    assert [e.headers[h.TIME_SENT] for e in sent] == [format_utc(START)] * 3
    assert [e.headers[h.DISCARD_AFTER] for e in sent] == [
        format_utc(START + datetime.timedelta(seconds=s)) for s in (60, 90, 2.5)]


def test_a_message_without_a_time_to_live_carries_no_deadline() -> None:
    bus, sent = recording_bus(FakeClock(START))
    bus.send(Quote(symbol="A", price=1))
    assert h.DISCARD_AFTER not in sent[0].headers
    assert expiry_of(sent[0].headers) is None


def test_a_types_default_applies_to_its_subclasses_and_a_send_can_name_its_own() -> None:
    bus, sent = recording_bus(FakeClock(START))

    bus.send(Reminder(text="by type"))
    bus.send(UrgentReminder(text="inherited"))
    bus.send(Reminder(text="own"), discard_after=5)
    bus.publish(Notice(text="event type"))

    assert [expiry_of(e.headers) for e in sent] == [
        START + datetime.timedelta(seconds=30), START + datetime.timedelta(seconds=30),
        START + datetime.timedelta(seconds=5), START + datetime.timedelta(minutes=5)]


def test_a_deferred_message_lives_from_when_it_is_due_not_from_when_it_was_sent() -> None:
    clock = FakeClock(START)
    bus, sent = recording_bus(clock)

    bus.defer(Quote(symbol="A", price=1), datetime.timedelta(hours=2), discard_after=60)
    bus.send(Quote(symbol="A", price=2), deliver_at=START - datetime.timedelta(hours=1),
             discard_after=60)

    due = START + datetime.timedelta(hours=2)
    assert sent[0].deliver_at == due
    assert expiry_of(sent[0].headers) == due + datetime.timedelta(seconds=60)
    # a time already past is due now: it lives from now
    assert expiry_of(sent[1].headers) == START + datetime.timedelta(seconds=60)


@pytest.mark.parametrize("wrong", [0, -1, float("nan"), datetime.timedelta(0), "60", True])
def test_a_time_to_live_that_is_not_a_positive_duration_is_refused_where_it_is_written(
    wrong: object,
) -> None:
    bus, sent = recording_bus(FakeClock(START))
    with pytest.raises((TypeError, ValueError), match="discard_after"):
        bus.send(Quote(symbol="A", price=1), discard_after=wrong)  # type: ignore[arg-type]
    assert sent == []

    with pytest.raises(ConfigurationError, match=r"Late: discard_after.*write discard_after="):
        class Late(Command, message_name="expiry.Late", discard_after=wrong):  # noqa: F841
            pass


@pytest.mark.parametrize("text", ["tomorrow", "2030-02-30T10:00:00+00:00", ""])
def test_a_deadline_that_is_not_a_time_is_bad_input(text: str) -> None:
    with pytest.raises(MalformedMessage, match="idembus.discard_after header .* not an ISO"):
        expiry_of({h.DISCARD_AFTER: text})


def test_a_deadline_without_a_zone_is_utc_like_every_idembus_time() -> None:
    assert expiry_of({h.DISCARD_AFTER: "2030-01-01T12:00:00"}) == START


class _ErrorCopy(Delivery):
    def _ack(self) -> None: ...

    def _requeue(self) -> None: ...


def test_an_operators_retry_from_the_error_queue_drops_the_deadline_and_keeps_the_rest(
) -> None:
    # Given an expired message's error-queue copy: the deadline travels with it
    original = {h.MESSAGE_ID: "m-1", h.MESSAGE_TYPE: "expiry.Quote", "tenant": "t-1",
                h.DISCARD_AFTER: format_utc(START)}
    copy = failure_headers(original, RuntimeError("down"), queue="pricing",
                           immediate_attempts=6)
    assert copy[h.DISCARD_AFTER] == format_utc(START)

    # When `idembus errors retry` sends it back
    retried = retried_envelope(_ErrorCopy(queue="error", headers=copy, body=b"{}",
                                          content_type=h.CONTENT_TYPE, redelivered=False))

    # Then it is handled whatever the sender's deadline was
    assert retried.destination == "pricing"
    assert dict(retried.headers) == {h.MESSAGE_ID: "m-1", h.MESSAGE_TYPE: "expiry.Quote",
                                     "tenant": "t-1"}


def test_the_outbox_sends_a_stored_message_whose_deadline_has_passed() -> None:
    # Given a committed entry, never dispatched, whose message expired long ago
    storage = MemoryStorage()
    transport = KombuTransport("memory://")
    transport.declare("pricing")
    bus, recorded = recording_bus(FakeClock(START - datetime.timedelta(days=1)))
    bus.send(Quote(symbol="A", price=1), discard_after=1)
    storage.commit(AggregateRecord("Book", "A"), key="op/1", state={"price": 1},
                   outgoing=recorded)

    # When the outbox repairs it
    outbox = outbox_relay("sender", transport, storage, grace=0)
    assert outbox.run_once() == 1

    # Then the message went out as stored: only a receiver judges the deadline
    delivery = transport.get("pricing")
    assert delivery is not None
    assert delivery.headers[h.MESSAGE_ID] == recorded[0].message_id
    assert delivery.headers[h.DISCARD_AFTER] == recorded[0].headers[h.DISCARD_AFTER]
    outbox.stop()
    transport.close()


# -- receivers on memory://, RabbitMQ and Redis -----------------------------------------------


def pricing_endpoint(make_endpoint, clock: FakeClock, **options) -> Endpoint:  # type: ignore[no-untyped-def]
    """A QuoteBook endpoint on ``clock``, its queues declared, not started."""
    endpoint: Endpoint = make_endpoint("pricing", handlers=[QuoteBook], storage=MemoryStorage(),
                                       clock=clock, **options)
    endpoint.transport.declare(endpoint.name, subscriptions=endpoint.subscriptions)
    endpoint.transport.declare(endpoint.error_queue)
    return endpoint


@pytest.mark.parametrize("waited", [30, 60])
def test_a_message_received_in_time_is_handled(make_endpoint, waited: int) -> None:
    # Given a quote that lives 60 s, waiting in the queue while the receiver's clock moves
    clock = FakeClock()
    pricing = pricing_endpoint(make_endpoint, clock)
    handled = SignalCounter(pricing, "handled")
    pricing.bus.send(Quote(symbol="ACME", price=7), discard_after=60)
    clock.advance(seconds=waited)

    # When the endpoint takes it, at its deadline at the latest
    pricing.start()

    # Then it is handled
    assert handled.wait_for(1)
    wait_until_idle([pricing])
    assert pricing.storage.load("Book", "ACME").state == {"price": 7}
    assert pricing.counters["discarded"] == 0


def test_a_message_received_after_its_time_is_acknowledged_unhandled_and_counted(
    make_endpoint, caplog: pytest.LogCaptureFixture,
) -> None:
    # Given a quote that lives 60 s, taken 61 s after it was sent
    clock = FakeClock()
    pricing = pricing_endpoint(make_endpoint, clock)
    discarded = SignalCounter(pricing, "discarded")
    quote_id = pricing.bus.send(Quote(symbol="ACME", price=7), discard_after=60)
    deadline = format_utc(clock.now() + datetime.timedelta(seconds=60))
    clock.advance(seconds=61)

    # When the endpoint takes it
    with caplog.at_level(logging.INFO, logger="idembus.runtime.processing"):
        pricing.start()
        assert discarded.wait_for(1)
        wait_until_idle([pricing])

    # Then its handler did not run, nothing was stored, and it is gone from the queue,
    # counted and logged, not in the error queue
    assert not pricing.storage.load("Book", "ACME").exists
    assert discarded.details == [{"message_id": quote_id, "message_type": "expiry.Quote",
                                  "handler": "QuoteBook", "discard_after": deadline,
                                  "time_sent": format_utc(clock.now() -
                                                          datetime.timedelta(seconds=61))}]
    assert pricing.counters["handled"] == 0 and pricing.counters["received"] == 1
    assert pricing.transport.pending(pricing.name) == 0
    assert pricing.transport.get(pricing.error_queue) is None
    lines = [r for r in caplog.records if r.levelno == logging.INFO and quote_id in r.message]
    assert len(lines) == 1 and "discarded" in lines[0].message and deadline in lines[0].message


class CrashAfterCommitComeBackLate(FaultInjector):
    """Dies once after ``message_id``'s commit, before its dispatch; the broker's redelivery
    reaches the endpoint an hour later by its clock."""

    def __init__(self, clock: FakeClock, message_id: str) -> None:
        self.clock = clock
        self.message_id = message_id
        self.crashed = threading.Event()

    def reached(self, point: CrashPoint, message_id: str) -> None:
        if (point is CrashPoint.AFTER_COMMIT and message_id == self.message_id
                and not self.crashed.is_set()):
            self.crashed.set()
            self.clock.advance(hours=1)
            raise SimulatedCrash(f"crash after the commit of {message_id}")


def test_an_expired_duplicate_of_a_processed_message_still_sends_what_was_stored(
    make_endpoint,
) -> None:
    # Given an accounts endpoint that dies after committing a deposit that lives 60 s,
    # before sending the Deposited it stored, and whose redelivery comes an hour later
    clock = FakeClock()
    deposit_id = str(uuid.uuid4())
    crash = CrashAfterCommitComeBackLate(clock, deposit_id)
    ledger = Ledger()
    accounts = make_endpoint("accounts", handlers=[AccountHandler], storage=MemoryStorage(),
                             clock=clock, middleware=[crash])
    downstream = make_endpoint("ledger", handlers=[ledger], storage=MemoryStorage())
    recorded = SignalCounter(downstream, "handled")
    redispatched = SignalCounter(accounts, "redispatched")
    accounts.start()
    downstream.start()

    # When the deposit is sent, and redelivered after its deadline
    accounts.bus.send(Deposit(account="a", amount=5), message_id=deposit_id, discard_after=60)

    # Then the late duplicate is found processed first, and sends the stored event
    assert recorded.wait_for(1)
    assert redispatched.wait_for(1)
    wait_until_idle([accounts, downstream])
    assert crash.crashed.is_set()
    assert accounts.counters["duplicate"] == 1 and accounts.counters["discarded"] == 0
    assert accounts.storage.load("Account", "a").state == Account(balance=5,
                                                                  deposits=1).model_dump()
    assert [(account, amount) for _, account, amount in ledger.entries] == [("a", 5)]


@pytest.mark.parametrize(("late", "fate", "other"), [(1.2, "handled", "discarded"),
                                                     (2.0, "discarded", "handled")])
def test_a_deferred_message_is_judged_by_its_due_time_plus_its_time_to_live(
    make_endpoint, late: float, fate: str, other: str,
) -> None:
    # Given a quote due in 1 s that lives 0.5 s from then, and a receiver that takes it
    # `late` seconds after it was sent (by its clock)
    clock = FakeClock()
    pricing = pricing_endpoint(make_endpoint, clock, delayed_poll_interval=0.05)
    outcome = SignalCounter(pricing, fate)
    pricing.bus.defer(Quote(symbol="ACME", price=7), 1,
                      discard_after=datetime.timedelta(milliseconds=500))
    clock.advance(seconds=late)

    # When the broker (or the storage's poller) delivers it
    pricing.start()

    # Then within 0.5 s of its due time it is handled (counted from sending, it would have
    # expired at 0.5 s); after that, discarded
    assert outcome.wait_for(1)
    wait_until_idle([pricing])
    assert pricing.counters[other] == 0


@pytest.mark.parametrize("text", ["next tuesday", "2030-02-30T10:00:00+00:00"])
def test_an_unreadable_deadline_sends_the_message_to_the_error_queue_with_the_reason(
    make_endpoint, text: str,
) -> None:
    # Given a foreign message whose deadline is not a time
    pricing = pricing_endpoint(make_endpoint, FakeClock())
    dead = SignalCounter(pricing, "dead_lettered")
    message_id = str(uuid.uuid4())
    pricing.transport.send(Envelope(
        headers={h.MESSAGE_ID: message_id, h.MESSAGE_TYPE: "expiry.Quote",
                 h.DISCARD_AFTER: text},
        body=Quote(symbol="ACME", price=7).model_dump_json(), destination=pricing.name))

    # When the endpoint takes it
    pricing.start()

    # Then it is neither handled nor discarded on a guess: the error queue has it, and why
    assert dead.wait_for(1)
    wait_until_idle([pricing])
    copy = pricing.transport.get(pricing.error_queue)
    assert copy is not None and copy.headers[h.MESSAGE_ID] == message_id
    assert "idembus.discard_after header" in copy.headers[h.EXCEPTION_MESSAGE]
    assert copy.headers[h.DISCARD_AFTER] == text
    assert not pricing.storage.load("Book", "ACME").exists
    assert pricing.counters["discarded"] == 0


# -- in virtual time (idembus.testing.Scenario) ---------------------------------------------


class Courier(Handler):
    """Fails its first attempt; its one delayed retry comes two minutes later."""

    retry_policy = RetryPolicy(immediate_retries=0, delayed=(120.0,))

    def __init__(self) -> None:
        self.tries = [0]  # shared by the copies the endpoint makes for each message

    @handles
    def deliver(self, message: Quote) -> None:
        self.tries[0] += 1
        if self.tries[0] == 1:
            raise ConnectionError("the courier is out")


def test_a_delayed_retry_that_comes_back_after_the_deadline_is_discarded() -> None:
    # Given a quote that lives 60 s and a handler whose retry comes 120 s after it failed
    courier = Courier()
    scenario = Scenario(handlers=[courier], clock=FakeClock(START))
    scenario.send(Quote(symbol="ACME", price=7), discard_after=60)
    assert courier.tries == [1]

    # When the retry comes back
    scenario.advance(minutes=2)

    # Then it is too late: acknowledged unhandled, not in the error queue, not tried again
    counters = scenario.endpoint().counters
    assert (counters["retried"], counters["discarded"], counters["handled"]) == (1, 1, 0)
    assert courier.tries == [1]
    assert scenario.errors == [] and scenario.next_due is None


def test_a_deferred_reminder_past_its_time_to_live_from_sending_is_handled_when_due() -> None:
    # Given a quote deferred by an hour that lives a minute (from when it is due)
    scenario = Scenario(handlers=[QuoteBook], clock=FakeClock(START))
    scenario.defer(Quote(symbol="ACME", price=7), HOUR, discard_after=60)

    # When the hour is over
    scenario.advance(hours=1)

    # Then it is handled
    assert scenario.state(Book, "ACME") == Book(price=7)
    assert scenario.endpoint().counters["discarded"] == 0


def late_quote() -> Envelope:
    """A quote whose deadline passed an hour before START."""
    return Envelope(headers={h.MESSAGE_ID: "q-1", h.MESSAGE_TYPE: "expiry.Quote",
                             h.DISCARD_AFTER: format_utc(START - HOUR)},
                    body=Quote(symbol="ACME", price=7).model_dump_json(), destination="app")


def test_metrics_and_status_count_discarded_messages() -> None:
    # Given an endpoint with the metrics middleware
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    scenario = Scenario(handlers=[QuoteBook], clock=FakeClock(START),
                        middleware=[Metrics(meter_provider=provider)])
    endpoint = scenario.endpoint()

    # When a late message comes
    scenario.deliver(late_quote())

    # Then the metric, the counters and the status report count it
    assert values(reader, "idembus.messages.discarded") == {
        labels(endpoint="app", message_type="expiry.Quote", handler="QuoteBook"): 1}
    durations = points(reader)["idembus.message.handling.duration"]
    assert [point.attributes["outcome"] for point in durations] == ["discarded"]
    assert endpoint.counters["discarded"] == 1
    StatusReporter(endpoint.storage, "app", endpoint.counters.snapshot).report()
    summary = summarise("app", endpoint.storage.status_reports("app"), now=utc_now(),
                        stale_after=datetime.timedelta(minutes=1))
    assert summary["total"]["discarded"] == 1
    provider.shutdown()
