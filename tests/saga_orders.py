"""An order-fulfilment saga shared by the saga tests: started by PlaceOrder (or its
subclass PlaceExpressOrder), reminded by a timeout, completed by PayOrder or CloseOrder."""

from __future__ import annotations

from pydantic import BaseModel

from idembus import Command, Event
from idembus.handlers import AggregateHandler, handles

#: Seconds before the payment reminder of an order placed without ``remind_after``.
AN_HOUR = 3600.0


class PlaceOrder(Command, message_name="sagas.PlaceOrder"):
    order_id: str
    remind_after: float = AN_HOUR


class PlaceExpressOrder(PlaceOrder, message_name="sagas.PlaceExpressOrder"):
    """A subclass of a starting type: it starts the saga too."""


class PayOrder(Command, message_name="sagas.PayOrder"):
    order_id: str


class PaymentReminder(Command, message_name="sagas.PaymentReminder"):
    order_id: str


class CloseOrder(Command, message_name="sagas.CloseOrder"):
    """Ends the saga; with ``remind_after``, the very commit that completes it also asks
    for a reminder, which therefore arrives once the saga is completed."""

    order_id: str
    remind_after: float | None = None


class OrderAccepted(Event, message_name="sagas.OrderAccepted"):
    order_id: str


class OrderPaid(Event, message_name="sagas.OrderPaid"):
    order_id: str


class OrderReminded(Event, message_name="sagas.OrderReminded"):
    order_id: str
    reminders: int


class OrderClosed(Event, message_name="sagas.OrderClosed"):
    order_id: str


class OrderProcess(BaseModel):
    express: bool = False
    reminders: int = 0


class OrderSaga(AggregateHandler[OrderProcess]):
    starts = (PlaceOrder,)

    def aggregate_id(self, message: PlaceOrder | PayOrder | PaymentReminder | CloseOrder) -> str:
        return message.order_id

    @handles
    def place(self, message: PlaceOrder | PlaceExpressOrder) -> None:
        self.state.express = isinstance(message, PlaceExpressOrder)
        self.bus.publish(OrderAccepted(order_id=message.order_id))
        self.request_timeout(PaymentReminder(order_id=message.order_id), message.remind_after)

    @handles
    def pay(self, message: PayOrder) -> None:
        self.bus.publish(OrderPaid(order_id=message.order_id))
        self.complete()

    @handles
    def remind(self, message: PaymentReminder) -> None:
        self.state.reminders += 1
        self.bus.publish(OrderReminded(order_id=message.order_id,
                                       reminders=self.state.reminders))

    @handles
    def close(self, message: CloseOrder) -> None:
        self.bus.publish(OrderClosed(order_id=message.order_id))
        if message.remind_after is not None:
            self.request_timeout(PaymentReminder(order_id=message.order_id),
                                 message.remind_after)
        self.complete()
