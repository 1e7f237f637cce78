"""The endpoint of the dashboard's browser test (``tests/test_dashboard_browser.py``): an
order saga on RabbitMQ and PostgreSQL. The test runs it in its own process and serves
``idembus dashboard tests.dashboard_app:endpoint`` in another, which builds the same
endpoint from the ``APP_*`` environment variables (name, error queue, exchange, table
prefix) and the service URLs of ``tests/conftest.py``.

An order is placed (the saga starts and publishes ``OrderPlaced``), then paid (it publishes
``OrderPaid`` and completes: a tombstone remains). Placing an order whose id is in
``declined`` raises :class:`CardDeclined`.
"""

from __future__ import annotations

import os

from pydantic import BaseModel

from idembus import Command, Endpoint, Event, RetryPolicy
from idembus.handlers import AggregateHandler, handles
from idembus.runtime.recoverability.policy import Recoverability
from idembus.storage.postgres import PostgresStorage
from idembus.transports.kombu import KombuTransport


class PlaceOrder(Command, message_name="shop.PlaceOrder"):
    order_id: str
    amount: int
    note: str = ""


class PayOrder(Command, message_name="shop.PayOrder"):
    order_id: str


class OrderPlaced(Event, message_name="shop.OrderPlaced"):
    order_id: str
    amount: int

    def journal_parents(self) -> list[str]:
        return [f"customer/{self.order_id.split('-')[0]}"]


class OrderPaid(Event, message_name="shop.OrderPaid"):
    order_id: str


class Order(BaseModel):
    amount: int = 0
    note: str = ""


class CardDeclined(Exception):
    """The payment provider refused the card."""


class OrderSaga(AggregateHandler[Order]):
    starts = (PlaceOrder,)

    def __init__(self, declined: set[str]) -> None:
        self.declined = declined

    def aggregate_id(self, message: PlaceOrder | PayOrder) -> str:
        return message.order_id

    @handles
    def placed(self, message: PlaceOrder) -> None:
        if message.order_id in self.declined:
            raise CardDeclined(f"card declined for order {message.order_id} "
                               f"({message.amount} EUR)")
        self.state.amount = message.amount
        self.state.note = message.note
        self.bus.publish(OrderPlaced(order_id=message.order_id, amount=message.amount))

    @handles
    def paid(self, message: PayOrder) -> None:
        self.bus.publish(OrderPaid(order_id=message.order_id))
        self.complete()


def endpoint(declined: set[str] | None = None, *, status_interval: float = 1.0) -> Endpoint:
    """The shop endpoint the environment describes."""
    environ = os.environ
    return Endpoint(
        environ["APP_NAME"],
        transport=KombuTransport(environ["IDEMBUS_AMQP_URL"], exchange=environ["APP_EXCHANGE"]),
        storage=PostgresStorage(environ["IDEMBUS_POSTGRES_URL"],
                                table_prefix=environ["APP_PREFIX"]),
        handlers=[OrderSaga(declined if declined is not None else set())],
        error_queue=environ["APP_ERROR_QUEUE"], journal=True, status_interval=status_interval,
        recoverability=Recoverability(retries=RetryPolicy(immediate_retries=0, delayed=())))
