"""The messages of the ordering sample."""

from __future__ import annotations

from idembus import Command, Event


class PlaceOrder(Command, message_name="sales.PlaceOrder"):
    order_id: str
    customer: str
    amount_cents: int


class OrderPlaced(Event, message_name="sales.OrderPlaced"):
    order_id: str
    customer: str
    amount_cents: int

    def journal_parents(self) -> list[str]:
        """Clients of the event stream can follow one customer: ``parents=customer/c-3``."""
        return [f"customer/{self.customer}"]


class OrderBilled(Event, message_name="billing.OrderBilled"):
    order_id: str
    charge_id: str
    amount_cents: int


class OrderShipped(Event, message_name="shipping.OrderShipped"):
    order_id: str
