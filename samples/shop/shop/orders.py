"""The orders service: a saga that takes each order from payment to shipping.

    idembus run shop.orders:make_endpoint --workers 2

PlaceOrder starts it; it asks payments to charge the card and waits for the answer, at most
``SHOP_PAYMENT_TIMEOUT`` seconds (900). Paid, it asks shipping to ship; shipped, the order
is completed. A failed payment, or none in time, cancels it.
"""

from __future__ import annotations

import datetime
import os

from pydantic import BaseModel

from idembus import Endpoint, Message, RejectMessage
from idembus.handlers import AggregateHandler, handles

from . import settings
from .messages import (
    ChargePayment,
    OrderCancelled,
    OrderCompleted,
    OrderShipped,
    PaymentFailed,
    PaymentSucceeded,
    PaymentTimedOut,
    PlaceOrder,
    ShipOrder,
)
from .order_status import OrderOutcomes

DEFAULT_PAYMENT_TIMEOUT = datetime.timedelta(minutes=15)


class Order(BaseModel):
    status: str = "new"  # then "awaiting_payment", "paid"
    customer: str = ""
    amount_cents: int = 0
    charge_id: str = ""


class OrderSaga(AggregateHandler[Order]):
    """One saga per order, keyed by the order id; it ends when the order is completed or
    cancelled."""

    starts = (PlaceOrder,)

    def __init__(self, payment_timeout: datetime.timedelta = DEFAULT_PAYMENT_TIMEOUT) -> None:
        self.payment_timeout = payment_timeout

    def aggregate_id(self, message: PlaceOrder | PaymentSucceeded | PaymentFailed
                     | PaymentTimedOut | OrderShipped) -> str:
        return message.order_id

    @handles
    def place(self, message: PlaceOrder) -> None:
        self.state.status = "awaiting_payment"
        self.state.customer = message.customer
        self.state.amount_cents = message.amount_cents
        self.bus.send(ChargePayment(order_id=message.order_id, card_number=message.card_number,
                                    amount_cents=message.amount_cents))
        self.request_timeout(PaymentTimedOut(order_id=message.order_id), self.payment_timeout)

    @handles
    def paid(self, message: PaymentSucceeded) -> None:
        self.state.status = "paid"
        self.state.charge_id = message.charge_id
        self.bus.send(ShipOrder(order_id=message.order_id, customer=self.state.customer))

    @handles
    def shipped(self, message: OrderShipped) -> None:
        self.bus.publish(OrderCompleted(order_id=message.order_id))
        self.complete()

    @handles
    def payment_failed(self, message: PaymentFailed) -> None:
        self.bus.publish(OrderCancelled(order_id=message.order_id, reason=message.reason))
        self.complete()

    @handles
    def payment_timed_out(self, message: PaymentTimedOut) -> None:
        if self.state.status != "awaiting_payment":
            return  # paid in time: the parcel is on its way
        self.bus.publish(OrderCancelled(order_id=message.order_id,
                                        reason="no payment in time"))
        self.complete()

    def saga_not_found(self, message: PaymentSucceeded | PaymentFailed | OrderShipped) -> None:
        if isinstance(message, PaymentSucceeded):
            # Money came in for an order that was cancelled meanwhile: a person refunds it.
            raise RejectMessage(f"order {message.order_id} was charged ({message.charge_id}) "
                                "after it ended: refund it")
        super().saga_not_found(message)


def payment_timeout() -> datetime.timedelta:
    """``SHOP_PAYMENT_TIMEOUT`` seconds, 15 minutes by default."""
    seconds = os.environ.get("SHOP_PAYMENT_TIMEOUT")
    return datetime.timedelta(seconds=float(seconds)) if seconds else DEFAULT_PAYMENT_TIMEOUT


#: Where the commands this service sends go: the queue of the service that handles them.
ROUTES: dict[type[Message], str] = {ChargePayment: "payments", ShipOrder: "shipping"}


def make_endpoint() -> Endpoint:
    """The orders service, configured from the environment (:mod:`shop.settings`)."""
    return Endpoint(
        "orders",
        transport=settings.broker_url(),
        storage=settings.storage("orders"),
        # OrderOutcomes keeps how each order ended (shop.order_status), for the storefront
        handlers=[OrderSaga(payment_timeout()), OrderOutcomes],
        routes=ROUTES,
        error_queue=settings.ERROR_QUEUE,
        journal=True,  # the dashboard's live page shows its events as they are published
    )
