"""A failed message the broker refuses a place in the error queue is parked in the storage
with its reason and acknowledged: never retried forever, never dropped. ``idembus errors``
lists, retries and purges it with the error queue's messages."""

from __future__ import annotations

import json
import sys
import types
import uuid
from typing import Any

import pytest

from idembus import Endpoint, RetryPolicy
from idembus import headers as h
from idembus.cli import main
from idembus.envelope import Envelope
from idembus.handlers import AggregateHandler, handles
from idembus.storage.errors import StorageUnavailable
from idembus.storage.memory import MemoryStorage
from idembus.transports.errors import DestinationRefused
from idembus.transports.kombu import KombuTransport
from tests.conftest import AMQP_URL, require_service
from tests.hostile import WireMessage, plain_amqp, publish
from tests.support import Account, Deposit, SignalCounter

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
                        handlers=[Picky], error_queue=error_queue, retry_policy=NO_RETRIES)
    signals = {name: SignalCounter(endpoint, name) for name in ("handled", "failed")}
    endpoint.start()
    return endpoint, signals


def cli(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        endpoint: Endpoint, *args: str) -> tuple[int, str]:
    """``idembus errors ARGS`` on a second, never started endpoint sharing the storage."""
    module_name = f"parking_app_{uuid.uuid4().hex[:8]}"
    module = types.ModuleType(module_name)
    module.endpoint = lambda: Endpoint(  # type: ignore[attr-defined]
        endpoint.name, transport=KombuTransport("memory://"), storage=endpoint.storage,
        error_queue=endpoint.error_queue)
    monkeypatch.setitem(sys.modules, module_name, module)
    capsys.readouterr()
    status = main(["errors", args[0], f"{module_name}:endpoint", *args[1:]])
    return status, capsys.readouterr().out


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


def test_when_the_storage_cannot_park_either_the_message_waits_in_its_queue(
    names: tuple[str, str],
) -> None:
    # Given an endpoint whose error queue refuses copies and whose storage fails once
    storage = ParkFailsOnce()
    endpoint, signals = start(names, storage)
    try:
        # When a deposit fails
        failed_id = endpoint.bus.send(Deposit(account="closed", amount=5))

        # Then the first delivery goes back to the queue, and the next one is parked
        assert signals["failed"].wait_for(2)
        endpoint.stop()
        assert storage.park_attempts == 2
        assert [p.envelope.message_id for p in storage.parked_messages(endpoint.name)] == [
            failed_id]
        assert endpoint.transport.pending(endpoint.name) == 0
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
                        handlers=[Picky], error_queue=error_queue, retry_policy=NO_RETRIES)
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
