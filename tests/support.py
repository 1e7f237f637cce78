"""Message types, handlers and waiting helpers shared by the tests."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Collection
from typing import Any

from pydantic import BaseModel

from idembus import Command, Endpoint, Event
from idembus.handlers import AggregateHandler, Handler, handles
from idembus.policies import Backoff
from idembus.runtime.delayed import DelayedDeliveries
from idembus.runtime.dispatching import Dispatcher
from idembus.runtime.endpoint_context import EndpointContext
from idembus.runtime.health import Health
from idembus.runtime.outbox import OutboxRelay
from idembus.runtime.recoverability.policy import Recoverability
from idembus.transports.base import Delivery, OnDelivery, Transport


class Deposit(Command, message_name="test.Deposit"):
    account: str
    amount: int


class Deposited(Event, message_name="test.Deposited"):
    account: str
    amount: int


class Account(BaseModel):
    balance: int = 0
    deposits: int = 0


class AccountHandler(AggregateHandler[Account]):
    """Adds each deposit to its account and publishes Deposited."""

    def aggregate_id(self, message: Deposit) -> str:
        return message.account

    @handles
    def deposit(self, message: Deposit) -> None:
        self.state.balance += message.amount
        self.state.deposits += 1
        self.bus.publish(Deposited(account=message.account, amount=message.amount))


class Ledger(Handler):
    """A stateless downstream handler whose effect (an entry) must happen once per event."""

    def __init__(self) -> None:
        self.entries: list[tuple[str, str, int]] = []
        self._lock = threading.Lock()

    @handles
    def record(self, message: Deposited) -> None:
        with self._lock:
            self.entries.append((self.context.message_id, message.account, message.amount))


class SignalCounter:
    """Counts one signal of an endpoint and lets a test wait for a count."""

    def __init__(self, endpoint: Endpoint, name: str) -> None:
        self.count = 0
        self.details: list[dict[str, Any]] = []
        self._condition = threading.Condition()
        getattr(endpoint.signals, name).connect(self._on_signal, weak=False)

    def _on_signal(self, sender: object, **details: Any) -> None:
        with self._condition:
            self.count += 1
            self.details.append(details)
            self._condition.notify_all()

    def wait_for(self, count: int, timeout: float = 15.0) -> bool:
        """True once the signal was sent ``count`` times; False after ``timeout``."""
        with self._condition:
            return self._condition.wait_for(lambda: self.count >= count, timeout)


class RecordedDelivery(Delivery):
    """A delivery (JSON body) whose settlement is only recorded."""

    def __init__(self, queue: str, headers: dict[str, str], body: bytes, *,
                 redelivered: bool = False) -> None:
        super().__init__(queue=queue, headers=headers, body=body,
                         content_type="application/json", redelivered=redelivered)
        self.acked = False
        self.requeued = False

    def _ack(self) -> None:
        self.acked = True

    def _requeue(self) -> None:
        self.requeued = True


class DrivenTransport(Transport):
    """A transport for tests that drive an endpoint's processor themselves (they play the
    broker's queue): it neither declares, consumes nor gets; subclasses say what sending
    and publishing do."""

    def declare(self, queue: str, *, subscriptions: Collection[str] = ()) -> None:
        raise NotImplementedError("the test drives the processor directly")

    def consume(self, queue: str, on_delivery: OnDelivery, *, stop: threading.Event,
                prefetch: int = 1) -> None:
        raise NotImplementedError("the test drives the processor directly")

    def get(self, queue: str) -> Delivery | None:
        raise NotImplementedError("the test drives the processor directly")

    def pending(self, queue: str) -> int:
        return 0


def outbox_relay(endpoint: str, transport: Transport, storage: Any, *,
                 health: Health | None = None, backoff: Backoff | None = None,
                 **options: Any) -> OutboxRelay:
    """The outbox relay of ``endpoint``'s entries, run alone (as ``idembus outbox`` runs
    one): its own dispatcher, with ``health`` and the outage ``backoff`` if given."""
    context = EndpointContext.standalone(endpoint, transport, storage, health=health)
    if backoff is not None:
        context = dataclasses.replace(
            context, recoverability=Recoverability(outage_backoff=backoff))
    return OutboxRelay(context, Dispatcher(context), **options)


def delayed_poller(endpoint: str, transport: Transport, storage: Any,
                   **options: Any) -> DelayedDeliveries:
    """The delayed-message poller of ``endpoint``, run alone."""
    return DelayedDeliveries(EndpointContext.standalone(endpoint, transport, storage),
                             **options)


def eventually(condition: Callable[[], bool], timeout: float = 120.0,
               interval: float = 0.1) -> bool:
    """Look at ``condition`` (a query of a broker, a database or another process, which
    tells no one when it changes) every ``interval`` seconds until it holds; ``False`` if it
    still does not after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True
