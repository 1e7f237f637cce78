"""A failed message the broker refuses a place in the error queue is parked in the storage
with its reason and acknowledged: never retried forever, never dropped. ``idembus errors``
lists, retries and purges it with the error queue's messages."""

from __future__ import annotations

import json
import sys
import threading
import time
import types
import uuid
from typing import Any

import pytest

from idembus import Endpoint, RetryPolicy
from idembus import headers as h
from idembus.cli import main
from idembus.envelope import Envelope
from idembus.handlers import AggregateHandler, handles
from idembus.runtime.recoverability.parking import BODY_NOT_KEPT, park_outgoing
from idembus.runtime.recoverability.policy import Recoverability
from idembus.storage.errors import StorageRefused, StorageUnavailable
from idembus.storage.memory import MemoryStorage
from idembus.transports.errors import DestinationRefused
from idembus.transports.kombu import KombuTransport
from tests.conftest import AMQP_URL, require_service
from tests.hostile import WireMessage, plain_amqp, publish
from tests.support import Account, Deposit, Ledger, SignalCounter

NO_RETRIES = RetryPolicy(immediate_retries=0, delayed=())


class RefusesTheErrorQueue(KombuTransport):
    """memory:// whose error queue refuses every copy, as RabbitMQ refuses a copy larger
    than it takes."""

    def __init__(self, error_queue: str) -> None:
        super().__init__("memory://")
        self.error_queue = error_queue
        self.refusals = 0

    def send(self, envelope: Envelope) -> None:
        if envelope.destination == self.error_queue:
            self.refusals += 1
            raise DestinationRefused(f"PRECONDITION_FAILED - message size exceeds "
                                     f"the limit of {self.error_queue!r}")
        super().send(envelope)


class ParkFailsOnce(MemoryStorage):
    """A storage that is unreachable the first time a message is parked."""

    def __init__(self) -> None:
        super().__init__()
        self.park_attempts = 0

    def park(self, parked: Any) -> None:
        self.park_attempts += 1
        if self.park_attempts == 1:
            raise StorageUnavailable("connection reset while parking")
        super().park(parked)


class Picky(AggregateHandler[Account]):
    """Refuses deposits on accounts named in ``refused``."""

    refused: set[str] = set()

    def aggregate_id(self, message: Deposit) -> str:
        return message.account

    @handles
    def deposit(self, message: Deposit) -> None:
        if message.account in self.refused:
            raise ValueError(f"account {message.account} is closed")
        self.state.balance += message.amount


@pytest.fixture
def names() -> tuple[str, str]:
    suffix = uuid.uuid4().hex[:8]
    return f"parking-{suffix}", f"parking-error-{suffix}"


def start(names: tuple[str, str], storage: MemoryStorage) -> tuple[Endpoint, dict[str, Any]]:
    queue, error_queue = names
    Picky.refused = {"closed"}
    endpoint = Endpoint(queue, transport=RefusesTheErrorQueue(error_queue), storage=storage,
                        handlers=[Picky], error_queue=error_queue,
                        recoverability=Recoverability(retries=NO_RETRIES))
    signals = {name: SignalCounter(endpoint, name) for name in ("handled", "failed")}
    endpoint.start()
    return endpoint, signals


def cli(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        endpoint: Endpoint, *args: str) -> tuple[int, str]:
    """``idembus errors ARGS`` on a second, never started endpoint sharing the storage."""
    status, out, _ = errors_cli(monkeypatch, capsys, lambda: Endpoint(
        endpoint.name, transport=KombuTransport("memory://"), storage=endpoint.storage,
        error_queue=endpoint.error_queue), *args)
    return status, out


def test_a_message_the_error_queue_refuses_is_parked_listed_and_retried(
    names: tuple[str, str], capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given an endpoint whose broker refuses every copy for its error queue
    storage = MemoryStorage()
    endpoint, signals = start(names, storage)
    try:
        # When a deposit fails, and then a good one arrives
        failed_id = endpoint.bus.send(Deposit(account="closed", amount=5))
        endpoint.bus.send(Deposit(account="open", amount=7))

        # Then the endpoint goes on (the good one is applied) and the failed one is parked
        # once, with its reason and the broker's, and is not in the queue any more
        assert signals["handled"].wait_for(1)
        endpoint.stop()
        [parked] = storage.parked_messages(endpoint.name)
        assert parked.envelope.message_id == failed_id
        reason = parked.envelope.headers[h.EXCEPTION_MESSAGE]
        assert "account closed is closed" in reason and "PRECONDITION_FAILED" in reason
        assert parked.envelope.destination == endpoint.name
        assert endpoint.transport.pending(endpoint.name) == 0
        assert signals["failed"].count == 1

        # When the operator lists the errors
        status, out = cli(capsys, monkeypatch, endpoint, "list", "--json")

        # Then the parked message is there, marked as parked
        assert status == 0
        [row] = json.loads(out)
        assert (row["message_id"], row["parked"]) == (failed_id, True)
        assert row["exception_type"] == "builtins.ValueError"

        # When the account is reopened and the message retried
        Picky.refused = set()
        status, out = cli(capsys, monkeypatch, endpoint, "retry", failed_id)

        # Then it is back in its queue without the failure story, and no longer parked
        assert status == 0
        assert storage.parked_messages(endpoint.name) == []
        retried = endpoint.transport.get(endpoint.name)
        assert retried is not None
        assert retried.headers[h.MESSAGE_ID] == failed_id
        assert h.EXCEPTION_MESSAGE not in retried.headers
    finally:
        endpoint.close()


def test_a_purged_parked_message_is_gone(
    names: tuple[str, str], capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    storage = MemoryStorage()
    endpoint, signals = start(names, storage)
    try:
        failed_id = endpoint.bus.send(Deposit(account="closed", amount=5))
        assert signals["failed"].wait_for(1)
        endpoint.stop()

        status, out = cli(capsys, monkeypatch, endpoint, "purge", failed_id, "--yes")

        assert status == 0 and "1 message(s) purged" in out
        assert storage.parked_messages(endpoint.name) == []
    finally:
        endpoint.close()


def test_when_the_storage_cannot_park_either_the_message_waits_in_place_and_is_parked_once(
    names: tuple[str, str],
) -> None:
    # Given an endpoint whose error queue refuses copies and whose storage fails once
    storage = ParkFailsOnce()
    endpoint, signals = start(names, storage)
    dead_lettered = SignalCounter(endpoint, "dead_lettered")
    try:
        # When a deposit fails
        failed_id = endpoint.bus.send(Deposit(account="closed", amount=5))

        # Then the handler ran once: the message waited for the storage, then was parked
        assert dead_lettered.wait_for(1)
        endpoint.stop()
        assert signals["failed"].count == 1
        assert storage.park_attempts == 2
        assert [p.envelope.message_id for p in storage.parked_messages(endpoint.name)] == [
            failed_id]
        assert endpoint.transport.pending(endpoint.name) == 0
    finally:
        endpoint.close()


class RefusesBodies(MemoryStorage):
    """A storage that refuses to park any message with a body (as MongoDB refuses a
    document over 16 MB), and, while ``refuse_all`` is set, any message at all."""

    def __init__(self) -> None:
        super().__init__()
        self.park_attempts = 0
        self.refuse_all = threading.Event()
        self.refused_all = threading.Event()

    def park(self, parked: Any) -> None:
        self.park_attempts += 1
        if self.refuse_all.is_set():
            self.refused_all.set()
            raise StorageRefused("document too large (simulated)")
        if parked.envelope.body:
            raise StorageRefused("BSON document too large (simulated)")
        super().park(parked)


def test_a_message_neither_the_broker_nor_the_storage_will_keep_whole_is_parked_without_body(
    names: tuple[str, str],
) -> None:
    # Given an endpoint whose error queue refuses copies and whose storage refuses bodies
    storage = RefusesBodies()
    endpoint, signals = start(names, storage)
    dead_lettered = SignalCounter(endpoint, "dead_lettered")
    try:
        # When a deposit fails, and a good one follows
        failed_id = endpoint.bus.send(Deposit(account="closed", amount=5))
        endpoint.bus.send(Deposit(account="open", amount=7))

        # Then the endpoint goes on, and the failed one is parked with its headers, the
        # reason, and what its body was (size and digest), never dropped without a trace
        assert dead_lettered.wait_for(1) and signals["handled"].wait_for(1)
        endpoint.stop()
        [parked] = storage.parked_messages(endpoint.name)
        assert parked.envelope.message_id == failed_id
        assert parked.envelope.body == ""
        note = parked.envelope.headers[BODY_NOT_KEPT]
        assert "sha256" in note and "BSON document too large" in note
        assert "account closed is closed" in parked.envelope.headers[h.EXCEPTION_MESSAGE]
    finally:
        endpoint.close()


def test_when_nothing_will_keep_a_failed_message_the_endpoint_waits_with_backoff_and_says_so(
    names: tuple[str, str],
) -> None:
    # Given an endpoint whose error queue refuses copies and whose storage refuses to park
    storage = RefusesBodies()
    storage.refuse_all.set()
    endpoint, signals = start(names, storage)
    dead_lettered = SignalCounter(endpoint, "dead_lettered")
    try:
        # When a deposit fails
        failed_id = endpoint.bus.send(Deposit(account="closed", amount=5))

        # Then the message keeps its place (the handler ran once), the endpoint reports
        # what blocks it, and it tries again with backoff rather than in a hot loop
        assert storage.refused_all.wait(10)
        deadline = time.monotonic() + 10
        while not endpoint.health.problems() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "refused to park" in endpoint.health.problems()["storage"]
        attempts_before = storage.park_attempts
        time.sleep(0.5)  # a window in which a hot loop would try thousands of times
        assert storage.park_attempts - attempts_before <= 12
        assert signals["failed"].count == 1

        # When the storage takes it again, the message is parked and the problem is gone
        storage.refuse_all.clear()
        assert dead_lettered.wait_for(1, timeout=15)
        assert [p.envelope.message_id for p in storage.parked_messages(endpoint.name)] == [
            failed_id]
        assert endpoint.health.problems() == {}
    finally:
        endpoint.close()


@pytest.mark.amqp
def test_on_rabbitmq_a_copy_too_large_for_a_frame_is_parked_and_the_endpoint_goes_on(
    names: tuple[str, str],
) -> None:
    # Given an endpoint on RabbitMQ
    require_service(AMQP_URL, "RabbitMQ")
    queue, error_queue = names
    storage = MemoryStorage()
    Picky.refused = set()
    endpoint = Endpoint(queue, transport=KombuTransport(AMQP_URL), storage=storage,
                        handlers=[Picky], error_queue=error_queue,
                        recoverability=Recoverability(retries=NO_RETRIES))
    handled = SignalCounter(endpoint, "handled")
    endpoint.start()
    try:
        # When a client publishes a message of an unknown type whose headers fill nearly
        # a whole frame (so that the failure story cannot fit beside them), then a good one
        stuffed = WireMessage(headers={h.MESSAGE_ID: str(uuid.uuid4()),
                                       h.MESSAGE_TYPE: "nobody.KnowsThis",
                                       "padding": "x" * 130_000}, body=b"{}")
        with plain_amqp(AMQP_URL) as channel:
            publish(channel, queue, stuffed)
        endpoint.bus.send(Deposit(account="open", amount=7))

        # Then the good one is applied, and the stuffed one is parked with its bytes
        assert handled.wait_for(1)
        endpoint.stop()
        [parked] = storage.parked_messages(endpoint.name)
        assert parked.envelope.message_id == stuffed.headers[h.MESSAGE_ID]
        assert parked.envelope.headers["padding"] == "x" * 130_000
        assert "frame" in parked.envelope.headers[h.EXCEPTION_MESSAGE]
        assert endpoint.transport.pending(queue) == 0
    finally:
        endpoint.close()
        endpoint.transport.delete_queue(queue)
        endpoint.transport.delete_queue(error_queue)


def errors_cli(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
               make: Any, *args: str) -> tuple[int, str, str]:
    """``idembus errors ARGS`` on the endpoint ``make()`` builds, whose memory:// broker and
    storage are shared in this test process as a broker and a database are between
    processes (``idembus errors`` refuses process-local ones)."""
    module_name = f"parking_app_{uuid.uuid4().hex[:8]}"
    module = types.ModuleType(module_name)

    def shared() -> Endpoint:
        endpoint = make()
        for part in (endpoint.transport, endpoint.storage):
            monkeypatch.setattr(part, "process_local", False)
        return endpoint

    module.endpoint = shared  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module_name, module)
    capsys.readouterr()
    status = main(["errors", args[0], f"{module_name}:endpoint", *args[1:]])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_an_event_the_outbox_parked_is_listed_and_published_again_by_idembus_errors(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    # Given an event of "sales" that the outbox parked, and a subscriber of its type
    suffix = uuid.uuid4().hex[:8]
    exchange, storage = f"parking-events-{suffix}", MemoryStorage()
    event = Envelope({h.MESSAGE_ID: str(uuid.uuid4()), h.MESSAGE_TYPE: "test.Deposited",
                      h.INTENT: "publish", h.ORIGINATING_ENDPOINT: f"sales-{suffix}"},
                     '{"account": "a", "amount": 3}', destination=None)
    park_outgoing(storage, event, RuntimeError("refused five times (simulated)"),
                  endpoint=f"sales-{suffix}", attempts=5)
    ledger = Ledger()
    subscriber = Endpoint(f"ledger-{suffix}", handlers=[ledger], storage=MemoryStorage(),
                          transport=KombuTransport("memory://", exchange=exchange))
    recorded = SignalCounter(subscriber, "handled")
    subscriber.start()

    def sales() -> Endpoint:
        return Endpoint(f"sales-{suffix}", storage=storage, error_queue=f"error-{suffix}",
                        transport=KombuTransport("memory://", exchange=exchange))

    try:
        # When the operator lists the failed messages of sales, then retries the event
        status, out, _ = errors_cli(monkeypatch, capsys, sales, "list", "--json")
        assert status == 0
        [row] = json.loads(out)
        assert (row["message_id"], row["parked"]) == (event.message_id, True)
        status, _, _ = errors_cli(monkeypatch, capsys, sales, "retry", event.message_id)

        # Then it is published again, with its id, to its subscribers, and no longer parked
        assert status == 0
        assert recorded.wait_for(1)
        assert [entry[0] for entry in ledger.entries] == [event.message_id]
        assert storage.parked_messages(f"sales-{suffix}") == []
    finally:
        subscriber.close()


class CannotListParked(MemoryStorage):
    def parked_messages(self, endpoint: str) -> list[Any]:
        raise StorageUnavailable("connection refused (simulated)")

    def parked_page(self, endpoint: str | None, **_: Any) -> list[Any]:
        raise StorageUnavailable("connection refused (simulated)")


def test_errors_list_says_it_cannot_read_the_parked_messages_instead_of_showing_none(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    def sales() -> Endpoint:
        return Endpoint(f"sales-{uuid.uuid4().hex[:8]}", storage=CannotListParked(),
                        transport=KombuTransport("memory://"))

    status, out, err = errors_cli(monkeypatch, capsys, sales, "list")

    assert status == 2
    assert "cannot read the failed messages" in err and "connection refused" in err
    assert "0 failed message" not in out
