"""The storefront: a Starlette app that takes orders over HTTP.

    uvicorn shop.storefront:create_app --factory --port 8000

``POST /orders`` (JSON ``customer``, ``card_number``, ``amount_cents``; an optional
``Idempotency-Key`` header) records a :class:`Checkout` and sends ``PlaceOrder`` to the
orders service in one write, through the storefront endpoint's outbox: the order is never
half taken, and a retried request takes effect once. ``GET /orders/{id}`` tells how the
order stands, which the storefront follows from the orders service's events.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from idembus import Endpoint
from idembus.handlers import AggregateHandler, handles
from idembus.storage import AlreadyProcessed, ConcurrencyConflict

from . import settings
from .messages import OrderCancelled, OrderCompleted, PlaceOrder


class Checkout(BaseModel):
    status: str = "new"  # then "placed", "completed" or "cancelled"
    customer: str = ""
    amount_cents: int = 0
    reason: str = ""


class CheckoutHandler(AggregateHandler[Checkout]):
    """Follows each order's outcome, published by the orders service."""

    def aggregate_id(self, message: OrderCompleted | OrderCancelled) -> str:
        return message.order_id

    @handles
    def completed(self, message: OrderCompleted) -> None:
        self.state.status = "completed"

    @handles
    def cancelled(self, message: OrderCancelled) -> None:
        self.state.status = "cancelled"
        self.state.reason = message.reason


class OrderForm(BaseModel):
    customer: str
    card_number: str
    amount_cents: int


def make_endpoint() -> Endpoint:
    """The storefront's endpoint, configured from the environment (:mod:`shop.settings`)."""
    return Endpoint(
        "storefront",
        transport=settings.broker_url(),
        storage=settings.storage("storefront"),
        handlers=[CheckoutHandler],
        routes={PlaceOrder: "orders"},
        error_queue=settings.ERROR_QUEUE,
    )


async def place_order(endpoint: Endpoint, form: OrderForm, order_id: str,
                      request_key: str) -> bool:
    """Record the checkout and send ``PlaceOrder`` in one write; False if this request
    (``request_key``) was handled before."""
    try:
        async with endpoint.unit_of_work(Checkout, order_id, operation_id=request_key) as work:
            work.state.status = "placed"
            work.state.customer = form.customer
            work.state.amount_cents = form.amount_cents
            work.bus.send(PlaceOrder(order_id=order_id, **form.model_dump()))
    except AlreadyProcessed:  # the same request again: it took effect the first time
        return False
    return True


def create_app() -> Starlette:
    """The storefront app; its endpoint starts and stops with it."""
    endpoint = make_endpoint()

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await run_in_threadpool(endpoint.start)  # consumers and the outbox dispatcher
        try:
            yield
        finally:
            await run_in_threadpool(endpoint.close)

    async def post_order(request: Request) -> JSONResponse:
        try:
            form = OrderForm.model_validate_json(await request.body())
        except ValidationError as invalid:
            return JSONResponse({"error": invalid.errors(include_url=False)}, status_code=422)
        # One order per idempotency key: a retried request names the same order.
        key = request.headers.get("Idempotency-Key") or str(uuid.uuid4())
        order_id = str(uuid.uuid5(uuid.NAMESPACE_URL, f"shop:{key}"))
        try:
            created = await place_order(endpoint, form, order_id, key)
        except ConcurrencyConflict:
            return JSONResponse({"error": "the order changed meanwhile; try again"},
                                status_code=409)
        return JSONResponse({"order_id": order_id, "status": "placed"},
                            status_code=201 if created else 200)

    async def get_order(request: Request) -> JSONResponse:
        order_id = request.path_params["order_id"]
        record = await run_in_threadpool(endpoint.storage.load, "Checkout", order_id)
        if not record.exists:
            return JSONResponse({"error": f"no order {order_id}"}, status_code=404)
        return JSONResponse({"order_id": order_id, **Checkout.model_validate(record.state)
                             .model_dump()})

    return Starlette(routes=[Route("/orders", post_order, methods=["POST"]),
                             Route("/orders/{order_id}", get_order, methods=["GET"])],
                     lifespan=lifespan)
