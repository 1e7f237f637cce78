"""Billing: charges each placed order through a payment gateway. OrderPlaced -> OrderBilled.

The gateway is an external system: the handler cannot commit it together with its own
records, so it passes ``self.context.idempotency_key``, which stays the same when the
handler is re-run for the same message after a crash.
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass
from typing import Protocol

from idembus.handlers import Handler, handles
from samples.ordering.messages import OrderBilled, OrderPlaced


@dataclass(frozen=True)
class Charge:
    charge_id: str
    order_id: str
    amount_cents: int


class FakePaymentGateway:
    """Records every charge and honours idempotency keys, like Stripe's API does."""

    def __init__(self) -> None:
        self._by_key: dict[str, Charge] = {}
        self.calls = 0
        self._lock = threading.Lock()

    def charge(self, order_id: str, amount_cents: int, *, idempotency_key: str) -> Charge:
        with self._lock:
            self.calls += 1
            existing = self._by_key.get(idempotency_key)
            if existing is None:
                existing = Charge(str(uuid.uuid4()), order_id, amount_cents)
                self._by_key[idempotency_key] = existing
            return existing

    @property
    def charges(self) -> list[Charge]:
        with self._lock:
            return list(self._by_key.values())


class PaymentGateway(Protocol):
    """What Billing needs of a payment service (the fake one, or the PostgreSQL-backed one
    of :mod:`samples.ordering.gateway`)."""

    def charge(self, order_id: str, amount_cents: int, *, idempotency_key: str) -> Charge: ...


class BillingHandler(Handler):
    def __init__(self, gateway: PaymentGateway) -> None:
        self.gateway = gateway

    @handles
    def bill(self, message: OrderPlaced) -> None:
        charge = self.gateway.charge(
            message.order_id, message.amount_cents, idempotency_key=self.context.idempotency_key
        )
        self.bus.publish(OrderBilled(
            order_id=message.order_id, charge_id=charge.charge_id,
            amount_cents=message.amount_cents,
        ))
