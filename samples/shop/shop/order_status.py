"""How each order ended, kept by the orders service for whoever asks (the storefront's
``GET /orders/{id}``): the orders saga's record is a tombstone once the order completed or
was cancelled, so this view follows the saga's outcome events into a record of its own.
"""

from __future__ import annotations

from pydantic import BaseModel

from idembus.handlers import AggregateHandler, handles

from .messages import OrderCancelled, OrderCompleted


class OrderOutcome(BaseModel):
    status: str = ""  # "completed" or "cancelled"
    reason: str = ""


class OrderOutcomes(AggregateHandler[OrderOutcome]):
    """One record per ended order, keyed by the order id."""

    def aggregate_id(self, message: OrderCompleted | OrderCancelled) -> str:
        return message.order_id

    @handles
    def completed(self, message: OrderCompleted) -> None:
        self.state.status = "completed"

    @handles
    def cancelled(self, message: OrderCancelled) -> None:
        self.state.status = "cancelled"
        self.state.reason = message.reason
