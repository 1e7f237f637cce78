"""Every log line about a message says which message, endpoint, handler and attempt it is
about — idembus's own lines (retries, the error queue, parking, redispatch, duplicates, the
per-message line) and a handler's own ``logging`` calls — as JSON fields and in the text
prefix, with the process id and the worker index in the JSON lines."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Iterator

import pytest

from idembus import Endpoint, RetryPolicy
from idembus import headers as h
from idembus.envelope import Envelope
from idembus.handlers import AggregateHandler, handles
from idembus.logs import ContextFilter, JsonFormatter, TextFormatter, log_per_message
from idembus.runtime.recoverability.policy import Recoverability
from idembus.storage.memory import MemoryStorage
from idembus.testing import wait_until_idle
from idembus.testing.faults import CrashPoint
from idembus.transports.errors import DestinationRefused
from idembus.transports.kombu import KombuTransport
from tests.support import Account, Deposit, Deposited, SignalCounter
from tests.test_failure_matrix import CrashAt

#: The logger of the handler below (an application's own).
APP = logging.getLogger("shop.accounts")
FIELDS = ("endpoint", "message_id", "message_type", "handler", "attempt")


class Teller(AggregateHandler[Account]):
    """Logs each deposit and publishes Deposited; fails the first attempt on account
    ``flaky`` and every attempt on accounts ``broken`` and ``huge``."""

    def aggregate_id(self, message: Deposit) -> str:
        return message.account

    @handles
    def deposit(self, message: Deposit) -> None:
        APP.info("depositing %d", message.amount)
        if message.account in ("broken", "huge") or (
                message.account == "flaky" and self.state.deposits == 0
                and not getattr(Teller, "flaked", False)):
            Teller.flaked = True
            raise ValueError(f"account {message.account} refused the deposit")
        self.state.balance += message.amount
        self.state.deposits += 1
        self.bus.publish(Deposited(account=message.account, amount=message.amount))


class RefusesHugeCopies(KombuTransport):
    """memory:// whose error queue refuses the copy of the deposits on account ``huge`` (as
    RabbitMQ refuses a copy larger than it takes): they are parked."""

    def send(self, envelope: Envelope) -> None:
        if envelope.headers.get(h.FAILED_QUEUE) and '"huge"' in envelope.body:
            raise DestinationRefused("PRECONDITION_FAILED - message size exceeds the limit")
        super().send(envelope)


@pytest.fixture
def logged(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """Records of idembus (DEBUG) and of the application, the capturing handler filtered
    as ``idembus run``'s is (:class:`ContextFilter`), the per-message line at INFO."""
    caplog.set_level(logging.INFO, logger="shop")
    caplog.set_level(logging.DEBUG, logger="idembus")  # last: it sets the handler's level
    context = ContextFilter()
    caplog.handler.addFilter(context)
    log_per_message()
    Teller.flaked = False
    try:
        yield caplog
    finally:
        log_per_message(False)
        caplog.handler.removeFilter(context)


def on_memory(handler: type) -> Endpoint:
    """An endpoint of ``handler`` on memory:// and a MemoryStorage."""
    suffix = uuid.uuid4().hex[:8]
    return Endpoint(f"tellers-{suffix}", transport=KombuTransport("memory://"),
                    storage=MemoryStorage(), handlers=[handler],
                    error_queue=f"tellers-error-{suffix}")


def line(records: list[logging.LogRecord], text: str, message_id: str) -> logging.LogRecord:
    """The one record whose text has ``text`` and that is about ``message_id``."""
    found = [r for r in records if text in r.getMessage()
             and getattr(r, "message_id", None) == message_id]
    assert len(found) == 1, [(r.getMessage(), getattr(r, "message_id", None))
                             for r in records if text in r.getMessage()]
    return found[0]


def test_each_line_about_a_message_carries_its_endpoint_id_type_handler_and_attempt(
        logged: pytest.LogCaptureFixture) -> None:
    # Given an endpoint that retries once at once, then gives up, whose broker refuses the
    # error queue's copies of one account's deposits, and which crashes once after
    # committing a deposit (so that its redelivery sends again what it stored)
    suffix = uuid.uuid4().hex[:8]
    crash_id = str(uuid.uuid4())
    endpoint = Endpoint(
        f"tellers-{suffix}", transport=RefusesHugeCopies("memory://"), storage=MemoryStorage(),
        handlers=[Teller], error_queue=f"tellers-error-{suffix}",
        recoverability=Recoverability(retries=RetryPolicy(immediate_retries=1, delayed=())),
        middleware=[CrashAt(CrashPoint.AFTER_COMMIT, crash_id)])
    name = endpoint.name
    dead_lettered = SignalCounter(endpoint, "dead_lettered")
    with endpoint:
        # When a deposit fails once, one fails for good, one is parked, one is redispatched
        # and one arrives twice
        flaky = endpoint.bus.send(Deposit(account="flaky", amount=1))
        broken = endpoint.bus.send(Deposit(account="broken", amount=2))
        huge = endpoint.bus.send(Deposit(account="huge", amount=3))
        endpoint.bus.send(Deposit(account="crash", amount=4), message_id=crash_id)
        twice = endpoint.bus.send(Deposit(account="twice", amount=5))
        endpoint.bus.send(Deposit(account="twice", amount=5), message_id=twice)
        assert dead_lettered.wait_for(2)
        wait_until_idle([endpoint])

    records = logged.records
    expected = {
        # the immediate retry
        "retrying": (flaky, "Teller", 1),
        # the failure that went to the error queue, after its second attempt
        f"to {endpoint.error_queue}": (broken, "Teller", 2),
        # the one parked in the storage instead
        "parked": (huge, "Teller", 2),
        # what a redelivery sent again, and a duplicate
        " redispatched ": (crash_id, "Teller", 1),
        " duplicate ": (twice, "Teller", 1),
    }
    for text, (message_id, handler, attempt) in expected.items():
        record = line(records, text, message_id)
        seen = {key: getattr(record, key, None) for key in FIELDS}
        assert seen == {"endpoint": name, "message_id": message_id,
                        "message_type": "test.Deposit", "handler": handler,
                        "attempt": attempt}, (text, seen)
        # as a JSON line (with the process id and the worker's index) and a text line
        entry = json.loads(JsonFormatter(worker=3).format(record))
        assert {key: entry.get(key) for key in FIELDS} == seen
        assert entry["pid"] == record.process and entry["worker"] == 3
        prefix = TextFormatter().format(record).split(": ", 1)[0]
        assert (f"[endpoint={name} message_id={message_id} message_type=test.Deposit "
                f"handler={handler} attempt={attempt}]") in prefix, prefix

    # And the handler's own lines carry them too, one per attempt
    own = [r for r in records if r.name == "shop.accounts" and r.message_id == flaky]
    assert [(r.endpoint, r.message_type, r.handler, r.attempt) for r in own] == [
        (name, "test.Deposit", "Teller", 1), (name, "test.Deposit", "Teller", 2)]
    assert json.loads(JsonFormatter().format(own[1]))["attempt"] == 2

    # And one line per message says how it ended and how long it took, at INFO
    for message_id, outcome in ((flaky, "handled"), (broken, "dead_lettered"),
                                (huge, "dead_lettered")):
        [done] = [r for r in records if r.name == "idembus.per_message"
                  and r.message_id == message_id]
        assert done.levelno == logging.INFO and done.endpoint == name
        assert done.getMessage().startswith(f"{outcome} test.Deposit {message_id} in ")
        assert done.getMessage().endswith(" ms") and not hasattr(done, "handler")
        entry = json.loads(JsonFormatter().format(done))
        assert entry["outcome"] == outcome and entry["duration_ms"] >= 0
    # And no line outside a message carries a message's fields
    started = next(r for r in records if "started: queue" in r.getMessage())
    assert getattr(started, "message_id", None) is None


def test_values_from_the_wire_stay_escaped_and_capped_in_the_prefix(
        logged: pytest.LogCaptureFixture) -> None:
    # A message id with a line break and 300 characters, as a hostile sender sends it
    endpoint = on_memory(Teller)
    hostile = "m-1\nFORGED CRITICAL all accounts emptied" + "x" * 300
    with endpoint:
        endpoint.bus.send(Deposit(account="a", amount=1), message_id=hostile)
        wait_until_idle([endpoint])
    lines = [r for r in logged.records if r.name == "idembus.per_message"
             or r.getMessage().startswith("moved ")]
    assert len(lines) == 2
    for record in lines:
        for text in (TextFormatter().format(record), JsonFormatter().format(record)):
            assert "\n" not in text and "(340 characters)" in text, text
            assert len(text) < 1000, text


class AsyncTeller(AggregateHandler[Account]):
    """An ``async def`` handler that logs after waiting on its loop."""

    def aggregate_id(self, message: Deposit) -> str:
        return message.account

    @handles
    async def deposit(self, message: Deposit) -> None:
        await asyncio.sleep(0.01)  # the task resumes in a later turn of the loop
        APP.info("async deposit %d", message.amount)
        self.state.balance += message.amount


def test_an_async_handlers_own_lines_carry_the_context_after_it_waited(
        logged: pytest.LogCaptureFixture) -> None:
    endpoint = on_memory(AsyncTeller)
    with endpoint:
        message_id = endpoint.bus.send(Deposit(account="a", amount=1))
        wait_until_idle([endpoint])
    [own] = [r for r in logged.records if r.name == "shop.accounts"]
    assert (own.endpoint, own.message_id, own.handler, own.attempt) == (
        endpoint.name, message_id, "AsyncTeller", 1)
