"""The shipping service: sends one parcel per order.

    idembus run shop.shipping:make_endpoint --workers 2
"""

from __future__ import annotations

from pydantic import BaseModel

from idembus import Endpoint
from idembus.handlers import AggregateHandler, handles

from . import settings
from .messages import OrderShipped, ShipOrder


class Shipment(BaseModel):
    customer: str = ""
    tracking_number: str = ""
    #: Parcels handed to the courier for this order: anything but 1 would be a double effect.
    parcels: int = 0


class ShipmentHandler(AggregateHandler[Shipment]):
    """One Shipment per order, keyed by the order id."""

    def aggregate_id(self, message: ShipOrder) -> str:
        return message.order_id

    @handles
    def ship(self, message: ShipOrder) -> None:
        self.state.customer = message.customer
        self.state.tracking_number = f"TRK-{message.order_id}"
        self.state.parcels += 1
        self.bus.publish(OrderShipped(order_id=message.order_id,
                                      tracking_number=self.state.tracking_number))


def make_endpoint() -> Endpoint:
    """The shipping service, configured from the environment (:mod:`shop.settings`)."""
    return Endpoint(
        "shipping",
        transport=settings.broker_url(),
        storage=settings.storage("shipping"),
        handlers=[ShipmentHandler],
        error_queue=settings.ERROR_QUEUE,
    )
