"""Rate and concurrency limits (``idembus.runtime.recoverability.limits``): a message over a
limit is postponed without spending a retry and never reaches the error queue because of
it; the limits hold across the threads of an endpoint and, through the storage, across
processes."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from idembus import (
    Command,
    ConcurrencyLimit,
    ConfigurationError,
    Endpoint,
    Limits,
    RateLimit,
)
from idembus.handlers import Handler, handles
from idembus.storage.memory import MemoryStorage
from idembus.testing import wait_until_idle
from idembus.transports.kombu import KombuTransport
from tests.support import SignalCounter


class Export(Command, message_name="test.limits.Export"):
    tenant: str
    number: int


class Ping(Command, message_name="test.limits.Ping"):
    number: int


class Gate:
    """What the handlers below share with the test."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.in_flight = 0
        self.most_in_flight: dict[str, int] = {}
        self.running: dict[str, int] = {}
        self.release = threading.Event()
        self.handled: list[tuple[float, Any]] = []


GATE = Gate()


class ExportHandler(Handler):
    @handles
    def export(self, message: Export) -> None:
        with GATE.lock:
            GATE.running[message.tenant] = GATE.running.get(message.tenant, 0) + 1
            GATE.most_in_flight[message.tenant] = max(
                GATE.most_in_flight.get(message.tenant, 0), GATE.running[message.tenant])
        GATE.release.wait(60)
        with GATE.lock:
            GATE.running[message.tenant] -= 1
            GATE.handled.append((time.monotonic(), message))


class PingHandler(Handler):
    @handles
    def ping(self, message: Ping) -> None:
        with GATE.lock:
            GATE.handled.append((time.monotonic(), message))


@pytest.fixture(autouse=True)
def fresh_gate() -> None:
    global GATE
    GATE = Gate()


def endpoint(name: str, *limits: Any, **options: Any) -> Endpoint:
    return Endpoint(name, transport=KombuTransport("memory://"), storage=MemoryStorage(),
                    error_queue=f"error-{name}", middleware=[Limits(*limits)],
                    delayed_poll_interval=0.01, **options)


def test_a_concurrency_limit_postpones_without_spending_retries_and_loses_nothing() -> None:
    # Given one export at a time per tenant, four threads, and postponements that would
    # reach the error queue after 100 in a row if they counted
    exports = endpoint("exports", ConcurrencyLimit(1, types=(Export,), key="tenant",
                                                   retry_after=0.001),
                       handlers=[ExportHandler], concurrency=4, prefetch=1)
    # (prefetch=1: each thread takes one message at a time; in a batch, the held export
    # would hold up its batch mates on its thread, which is batching's rule, not the limit's)
    postponed = SignalCounter(exports, "postponed")
    handled = SignalCounter(exports, "handled")
    with exports:
        # When three exports of one tenant and one of another arrive together, and the
        # first ones are held until the others were postponed 150 times
        for number in range(3):
            exports.bus.send(Export(tenant="a", number=number))
        exports.bus.send(Export(tenant="b", number=9))
        assert postponed.wait_for(150, timeout=60)
        GATE.release.set()
        assert handled.wait_for(4, timeout=60)
        wait_until_idle([exports])
    # Then never two of a tenant ran at once, though two tenants did
    assert GATE.most_in_flight == {"a": 1, "b": 1}
    assert sorted(m.number for _, m in GATE.handled) == [0, 1, 2, 9]
    # and nothing went to the error queue, nor was counted as a failure or retry
    assert exports.counters["dead_lettered"] == 0 and exports.counters["failed"] == 0
    assert exports.transport.get(exports.error_queue) is None
    assert {details["attempt"] for details in postponed.details} == {0}


def test_a_rate_limit_spaces_the_messages_by_its_interval() -> None:
    # Given 20 pings a second, one at a time after a quiet spell
    pings = endpoint("pings", RateLimit(per_second=20, types=(Ping,)), handlers=[PingHandler],
                     concurrency=4)
    handled = SignalCounter(pings, "handled")
    with pings:
        # When 30 arrive at once
        for number in range(30):
            pings.bus.send(Ping(number=number))
        assert handled.wait_for(30, timeout=60)
        wait_until_idle([pings])
    # Then the 30 took at least the 29 intervals between them (a slower machine only
    # takes longer), and none failed
    times = sorted(moment for moment, _ in GATE.handled)
    assert times[-1] - times[0] >= 29 / 20 * 0.95
    assert sorted(m.number for _, m in GATE.handled) == list(range(30))
    assert pings.counters["dead_lettered"] == 0 and pings.counters["failed"] == 0


@pytest.mark.parametrize("batching", [True, False])
def test_a_postponed_message_comes_back_at_its_slot_and_is_not_charged_again(
    batching: bool,
) -> None:
    # Given one ping every second and a half (beyond wait_inline: the later ones go back)
    options: dict[str, Any] = {} if batching else {"batching": None}
    pings = endpoint("pings", RateLimit(per_second=1 / 1.5, types=(Ping,), wait_inline=1.0),
                     handlers=[PingHandler], **options)
    postponed = SignalCounter(pings, "postponed")
    handled = SignalCounter(pings, "handled")
    with pings:
        for number in range(3):
            pings.bus.send(Ping(number=number))
        assert handled.wait_for(3, timeout=30)
        wait_until_idle([pings])
    # Then each of the two later ones went back once, to its own slot, and ran there: had
    # a returning message been charged again, it would have gone back a second time
    assert sorted(details["delay"] for details in postponed.details) == pytest.approx(
        [1.5, 3.0], abs=0.3)
    assert postponed.count == 2 and {d["attempt"] for d in postponed.details} == {0}
    times = sorted(moment for moment, _ in GATE.handled)
    assert times[2] - times[0] >= 3.0 * 0.95


def test_limits_refuse_a_storage_that_cannot_keep_them_and_bad_settings() -> None:
    with pytest.raises(ConfigurationError, match="limits"):
        Limits(RateLimit(per_second=1)).setup(type("E", (), {"storage": object(),
                                                             "clock": None, "name": "x"})())
    with pytest.raises(ConfigurationError, match="per_second"):
        RateLimit(per_second=0)
    with pytest.raises(ConfigurationError, match="max_in_flight"):
        ConcurrencyLimit(0)
    with pytest.raises(ConfigurationError, match="at least one"):
        Limits()
