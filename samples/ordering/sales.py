"""Sales: the Order aggregate. PlaceOrder -> OrderPlaced."""

from __future__ import annotations

from pydantic import BaseModel

from idembus.handlers import AggregateHandler, handles
from samples.ordering.messages import OrderPlaced, PlaceOrder


class Order(BaseModel):
    status: str = "new"
    customer: str = ""
    amount_cents: int = 0
    #: How many times a PlaceOrder took effect: anything but 1 is a double effect.
    times_placed: int = 0


class OrderHandler(AggregateHandler[Order]):
    def aggregate_id(self, message: PlaceOrder) -> str:
        return message.order_id

    @handles
    def place(self, message: PlaceOrder) -> None:
        self.state.status = "placed"
        self.state.customer = message.customer
        self.state.amount_cents = message.amount_cents
        self.state.times_placed += 1
        self.bus.publish(OrderPlaced(
            order_id=message.order_id, customer=message.customer,
            amount_cents=message.amount_cents,
        ))
