"""idembus.observability.metrics: counters, durations and in-flight from the endpoint's
signals (``received`` ... ``settled``), read with the OpenTelemetry SDK's in-memory reader (no
global state)."""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import HistogramDataPoint, InMemoryMetricReader

from idembus import Endpoint
from idembus import headers as h
from idembus.envelope import format_utc, utc_now
from idembus.handlers import Handler, handles
from idembus.observability.metrics import Metrics
from idembus.pipeline import IncomingMessage, Middleware, SkipMessage
from idembus.policies import RetryPolicy
from idembus.registry import MessageRegistry
from idembus.runtime.recoverability.policy import Recoverability
from idembus.signals import EndpointSignals
from idembus.testing import wait_until_idle
from idembus.testing.faults import SimulatedCrash
from idembus.transports.base import Delivery
from tests.support import AccountHandler, Deposit, Deposited, SignalCounter


def points(reader: InMemoryMetricReader) -> dict[str, list[Any]]:
    """Metric name -> its data points, as collected now."""
    found: dict[str, list[Any]] = {}
    data = reader.get_metrics_data()
    for resource in data.resource_metrics if data else ():
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                found.setdefault(metric.name, []).extend(metric.data.data_points)
    return found


def values(reader: InMemoryMetricReader, name: str) -> dict[tuple[tuple[str, Any], ...], Any]:
    return {tuple(sorted(point.attributes.items())): point.value
            for point in points(reader).get(name, [])}


def labels(**attributes: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(attributes.items()))


def fake_endpoint(name: str = "accounts") -> Any:
    """What Metrics.setup reads of an endpoint: its name, signals and known types."""
    return SimpleNamespace(name=name, signals=EndpointSignals(name),
                           registry=MessageRegistry([Deposit, Deposited]))


@pytest.fixture
def provider_and_reader() -> Iterator[tuple[MeterProvider, InMemoryMetricReader]]:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    yield provider, reader
    provider.shutdown()


def test_signals_are_counted_by_endpoint_message_type_and_handler(provider_and_reader):
    provider, reader = provider_and_reader
    endpoint = fake_endpoint()
    metrics = Metrics(meter_provider=provider)
    metrics.setup(endpoint)
    signals = endpoint.signals
    common = {"message_id": "m-1", "message_type": "test.Deposit"}

    # When the endpoint receives, handles, finds duplicates, fails, retries, dead-letters
    for _ in range(3):
        signals.emit("received", **common)
    signals.emit("handled", handler="AccountHandler", **common)
    signals.emit("handled", handler="AccountHandler", **common)
    signals.emit("duplicate", handler="AccountHandler", **common)
    signals.emit("redispatched", handler="AccountHandler", key="k", count=1, **common)
    signals.emit("failed", handler="AccountHandler", error=KeyError("x"), attempt=1, **common)
    signals.emit("retried", handler="AccountHandler", error=KeyError("x"), attempt=1,
                 kind="immediate", **common)
    signals.emit("dead_lettered", error=ValueError("bad"), **common)

    # Then each counter has its figure, with its attributes
    base = {"endpoint": "accounts", "message_type": "test.Deposit"}
    handler = {**base, "handler": "AccountHandler"}
    assert values(reader, "idembus.messages.received") == {labels(**base): 3}
    assert values(reader, "idembus.messages.handled") == {labels(**handler): 2}
    assert values(reader, "idembus.messages.duplicates") == {labels(**handler): 1}
    assert values(reader, "idembus.messages.redispatched") == {labels(**handler): 1}
    assert values(reader, "idembus.messages.failed") == {
        labels(**handler, error_type="KeyError"): 1}
    assert values(reader, "idembus.messages.retried") == {
        labels(**handler, error_type="KeyError", kind="immediate"): 1}
    assert values(reader, "idembus.messages.dead_lettered") == {
        labels(**base, error_type="ValueError"): 1}

    # And once closed, it counts no more
    metrics.close()
    signals.emit("received", **common)
    assert values(reader, "idembus.messages.received") == {labels(**base): 3}


def test_a_type_the_endpoint_does_not_know_is_counted_as_unknown(provider_and_reader):
    provider, reader = provider_and_reader
    endpoint = fake_endpoint()
    Metrics(meter_provider=provider).setup(endpoint)
    for index in range(50):  # a producer inventing type names makes no new series
        endpoint.signals.emit("received", message_id=str(index), message_type=f"junk.{index}")
    endpoint.signals.emit("received", message_id="x", message_type=None)
    assert values(reader, "idembus.messages.received") == {
        labels(endpoint="accounts", message_type="unknown"): 50, labels(endpoint="accounts"): 1}


def deliver(signals: EndpointSignals, headers: dict[str, str], outcome: str | None,
            during: Callable[[], None] = lambda: None, seconds: float = 0.01) -> None:
    """One delivery as its endpoint reports it: ``received``, then (after ``during``)
    ``settled`` with ``outcome``."""
    details = {"message_id": headers.get(h.MESSAGE_ID),
               "message_type": headers.get(h.MESSAGE_TYPE)}
    signals.emit("received", **details)
    during()
    signals.emit("settled", outcome=outcome, seconds=seconds,
                 time_sent=headers.get(h.TIME_SENT), **details)


def test_in_flight_duration_and_critical_time_come_from_the_received_and_settled_signals(
    provider_and_reader,
):
    provider, reader = provider_and_reader
    endpoint = fake_endpoint()
    Metrics(meter_provider=provider).setup(endpoint)
    sent = utc_now() - datetime.timedelta(seconds=2)
    headers = {h.MESSAGE_ID: "m-1", h.MESSAGE_TYPE: "test.Deposit",
               h.TIME_SENT: format_utc(sent)}
    during: dict[str, Any] = {}

    def look() -> None:
        during.update(values(reader, "idembus.messages.in_flight"))

    # When one delivery is handled and another goes to the error queue
    deliver(endpoint.signals, headers, "handled", look, seconds=0.25)
    deliver(endpoint.signals, headers, "dead_lettered", look)

    # Then one was in flight while it was processed, none afterwards
    assert during == {labels(endpoint="accounts"): 1}
    assert values(reader, "idembus.messages.in_flight") == {labels(endpoint="accounts"): 0}
    # And both have a duration, by outcome, the seconds the signal carried; only the handled
    # one a critical time (>= 2 s)
    durations: list[HistogramDataPoint] = points(reader)["idembus.message.handling.duration"]
    assert sorted(point.attributes["outcome"] for point in durations) == [
        "dead_lettered", "handled"]
    assert all(point.count == 1 for point in durations)
    assert [point.sum for point in durations if point.attributes["outcome"] == "handled"] == [
        0.25]
    [critical] = points(reader)["idembus.message.critical_time"]
    assert critical.count == 1 and critical.sum >= 2.0
    assert dict(critical.attributes) == {"endpoint": "accounts", "message_type": "test.Deposit"}


def handle(signals: EndpointSignals, message_id: str, time_sent: str) -> None:
    """One delivery of a Deposit sent at ``time_sent``, handled."""
    deliver(signals, {h.MESSAGE_ID: message_id, h.MESSAGE_TYPE: "test.Deposit",
                      h.TIME_SENT: time_sent}, "handled")


def test_a_time_sent_in_the_future_or_decades_back_is_counted_apart_from_critical_times(
    provider_and_reader,
):
    # Issue 24, finding 9: the histogram trusted the sender's idembus.time_sent, and one
    # message sent "in 1970" added 56 years to its sum.
    provider, reader = provider_and_reader
    endpoint = fake_endpoint()
    Metrics(meter_provider=provider).setup(endpoint)
    now = utc_now()
    sent_times = {
        "1970": "1970-01-01T00:00:00+00:00",
        "eight days": format_utc(now - datetime.timedelta(days=8)),
        "2100": "2100-01-01T00:00:00+00:00",
        "an hour ahead": format_utc(now + datetime.timedelta(hours=1)),
        "a minute ahead": format_utc(now + datetime.timedelta(minutes=1)),  # clocks differ
        "ten seconds ago": format_utc(now - datetime.timedelta(seconds=10)),
    }
    for message_id, sent in sent_times.items():
        handle(endpoint.signals, message_id, sent)

    # Only the plausible two are critical times: the skewed clock's as 0 s
    [critical] = points(reader)["idembus.message.critical_time"]
    assert critical.count == 2
    assert 10.0 <= critical.sum < 60.0
    # The others are counted apart, by reason
    assert values(reader, "idembus.message.critical_time.implausible") == {
        labels(endpoint="accounts", message_type="test.Deposit", reason="too_old"): 2,
        labels(endpoint="accounts", message_type="test.Deposit", reason="future"): 2}


def test_the_plausible_window_of_critical_times_can_be_set(provider_and_reader):
    provider, reader = provider_and_reader
    metrics = Metrics(meter_provider=provider, plausible_critical_time=datetime.timedelta(
        days=60), clock_skew=datetime.timedelta(0))
    endpoint = fake_endpoint()
    metrics.setup(endpoint)
    for sent in (utc_now() - datetime.timedelta(days=30),
                 utc_now() + datetime.timedelta(seconds=30)):
        handle(endpoint.signals, "m", format_utc(sent))
    [critical] = points(reader)["idembus.message.critical_time"]
    assert critical.count == 1 and critical.sum >= 30 * 86400
    assert values(reader, "idembus.message.critical_time.implausible") == {
        labels(endpoint="accounts", message_type="test.Deposit", reason="future"): 1}
    with pytest.raises(ValueError, match="plausible_critical_time"):
        Metrics(plausible_critical_time=datetime.timedelta(0))


class Received(Delivery):
    """A delivery handed straight to a processor; settling it changes nothing."""

    def _ack(self) -> None:
        pass

    def _requeue(self) -> None:
        pass


def test_an_interrupted_delivery_is_no_longer_in_flight(provider_and_reader):
    # Given an endpoint whose middleware crashes (the process dying) before a message
    provider, reader = provider_and_reader

    class Dies(Middleware):
        def before_message(self, incoming: IncomingMessage) -> None:
            raise SimulatedCrash("dies here")

    accounts = Endpoint("accounts", handlers=[AccountHandler],
                        middleware=[Metrics(meter_provider=provider), Dies()])
    delivery = Received(queue="accounts", headers={
        h.MESSAGE_ID: "m-1", h.MESSAGE_TYPE: "test.Deposit"}, body=b"{}",
        content_type=h.CONTENT_TYPE, redelivered=False)
    # When a delivery is processed and the crash goes through
    with pytest.raises(SimulatedCrash):
        accounts._processor(delivery)
    # Then it is no longer in flight, and its duration says it was interrupted
    assert values(reader, "idembus.messages.in_flight") == {labels(endpoint="accounts"): 0}
    [duration] = points(reader)["idembus.message.handling.duration"]
    assert duration.attributes["outcome"] == "interrupted"


def test_a_delivery_s_handling_time_is_measured_once_for_every_observer(provider_and_reader):
    # Issue 25, point 4: HandlingTimes and Metrics each timed the message stage with their
    # own clock readings; now the processor measures it once and says it with ``settled``.
    # Before: EndpointSignals had no ``settled`` signal (AttributeError).
    provider, reader = provider_and_reader
    accounts = Endpoint("accounts", handlers=[AccountHandler],
                        middleware=[Metrics(meter_provider=provider)])
    settled: list[dict[str, Any]] = []
    accounts.signals.settled.connect(lambda sender, **details: settled.append(details),
                                     weak=False)
    with accounts:
        accounts.bus.send(Deposit(account="a", amount=1))
        wait_until_idle([accounts])
    [once] = settled
    assert once["outcome"] == "handled" and once["seconds"] > 0
    [duration] = points(reader)["idembus.message.handling.duration"]
    assert duration.count == 1 and duration.sum == once["seconds"]
    assert accounts.handling_times is not None
    assert sum(accounts.handling_times.snapshot().values()) == 1


def test_a_message_skipped_by_middleware_is_timed_as_skipped_not_interrupted(
    provider_and_reader,
):
    # Before: Metrics timed its own message stage, which ended before the endpoint decided
    # what the SkipMessage meant, so the histogram said "interrupted".
    provider, reader = provider_and_reader

    class Skips(Middleware):
        def before_message(self, incoming: IncomingMessage) -> None:
            raise SkipMessage("not for us")

    accounts = Endpoint("accounts", handlers=[AccountHandler],
                        middleware=[Metrics(meter_provider=provider), Skips()])
    with accounts:
        accounts.bus.send(Deposit(account="a", amount=1))
        wait_until_idle([accounts])
    [duration] = points(reader)["idembus.message.handling.duration"]
    assert duration.attributes["outcome"] == "skipped"
    assert values(reader, "idembus.messages.in_flight") == {labels(endpoint="accounts"): 0}


# -- an endpoint's traffic ------------------------------------------------------------------


class Refuses(Handler):
    """Fails on every deposit to account "bad"."""

    @handles
    def on(self, message: Deposit) -> None:
        if message.account == "bad":
            raise LookupError("no account 'bad'")


def test_an_endpoint_s_traffic_is_counted(make_endpoint, provider_and_reader):
    # Given an endpoint whose second handler fails on one account, retried once at once
    provider, reader = provider_and_reader
    accounts = make_endpoint(
        "accounts", handlers=[AccountHandler, Refuses],
        middleware=[Metrics(meter_provider=provider)],
        recoverability=Recoverability(retries=RetryPolicy(immediate_retries=1, delayed=())))
    dead = SignalCounter(accounts, "dead_lettered")
    accounts.start()

    # When 3 deposits arrive, one of them twice, and one that fails
    for index in range(3):
        accounts.bus.send(Deposit(account=f"a{index}", amount=1), message_id=f"d-{index}")
    accounts.bus.send(Deposit(account="a0", amount=1), message_id="d-0")
    accounts.bus.send(Deposit(account="bad", amount=1), message_id="d-bad")
    assert dead.wait_for(1)
    wait_until_idle([accounts])

    # Then the counters say so, by handler
    mine = {"endpoint": accounts.name, "message_type": "test.Deposit"}
    assert values(reader, "idembus.messages.received") == {labels(**mine): 5}
    assert values(reader, "idembus.messages.handled") == {
        labels(**mine, handler="AccountHandler"): 4, labels(**mine, handler="Refuses"): 3}
    assert values(reader, "idembus.messages.duplicates") == {
        labels(**mine, handler="AccountHandler"): 1, labels(**mine, handler="Refuses"): 1}
    assert values(reader, "idembus.messages.failed") == {
        labels(**mine, handler="Refuses", error_type="LookupError"): 2}
    assert values(reader, "idembus.messages.retried") == {
        labels(**mine, handler="Refuses", error_type="LookupError", kind="immediate"): 1}
    assert values(reader, "idembus.messages.dead_lettered") == {
        labels(**mine, error_type="LookupError"): 1}
    assert values(reader, "idembus.messages.in_flight") == {labels(endpoint=accounts.name): 0}
    durations = {point.attributes["outcome"]: point.count
                 for point in points(reader)["idembus.message.handling.duration"]}
    assert durations == {"handled": 4, "dead_lettered": 1}
    [critical] = points(reader)["idembus.message.critical_time"]
    assert critical.count == 4
