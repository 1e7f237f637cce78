"""The messages of the ordering sample."""

from __future__ import annotations

from bus import Command, Event


class PlaceOrder(Command, name="sales.PlaceOrder"):
    order_id: str
    customer: str
    amount_cents: int


class OrderPlaced(Event, name="sales.OrderPlaced"):
    order_id: str
    customer: str
    amount_cents: int


class OrderBilled(Event, name="billing.OrderBilled"):
    order_id: str
    charge_id: str
    amount_cents: int


class OrderShipped(Event, name="shipping.OrderShipped"):
    order_id: str
