"""Shipping: the Shipment aggregate. OrderBilled -> OrderShipped."""

from __future__ import annotations

from pydantic import BaseModel

from idembus.handlers import AggregateHandler, handles
from samples.ordering.messages import OrderBilled, OrderShipped


class Shipment(BaseModel):
    shipped: bool = False
    charge_id: str = ""
    #: How many times an OrderBilled took effect: anything but 1 is a double effect.
    times_shipped: int = 0


class ShippingHandler(AggregateHandler[Shipment]):
    def aggregate_id(self, message: OrderBilled) -> str:
        return message.order_id

    @handles
    def ship(self, message: OrderBilled) -> None:
        self.state.shipped = True
        self.state.charge_id = message.charge_id
        self.state.times_shipped += 1
        self.bus.publish(OrderShipped(order_id=message.order_id))
