"""The storefront: a Starlette app that takes orders over HTTP.

    uvicorn shop.storefront:create_app --factory --port 8000

``POST /orders`` (JSON ``customer``, ``card_number``, ``amount_cents``; an optional
``Idempotency-Key`` header) sends ``PlaceOrder`` to the orders service through the
storefront's outbox, keyed by the idempotency key: the order is never half taken, and a
retried request takes effect once. The storefront is a send-only endpoint: no queue, no
consumer. ``GET /orders/{id}`` asks the orders service's records how the order stands.
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
from idembus.storage import Storage

from . import settings
from .messages import PlaceOrder
from .order_status import OrderOutcome


class OrderForm(BaseModel):
    customer: str
    card_number: str
    amount_cents: int


def make_endpoint() -> Endpoint:
    """The storefront's endpoint, configured from the environment (:mod:`shop.settings`):
    it only sends, so it declares no queue and runs no consumer."""
    return Endpoint(
        "storefront",
        transport=settings.broker_url(),
        storage=settings.storage("storefront"),  # its outbox
        routes={PlaceOrder: "orders"},
        error_queue=settings.ERROR_QUEUE,
        send_only=True,
    )


async def place_order(endpoint: Endpoint, form: OrderForm, order_id: str,
                      request_key: str) -> bool:
    """Send ``PlaceOrder`` through the outbox, once per ``request_key``; False if this
    request was handled before (what it stored and did not get to send is sent again)."""
    async with endpoint.outbox(operation_id=request_key) as work:
        work.bus.send(PlaceOrder(order_id=order_id, **form.model_dump()))
    return not work.duplicate


def order_status(orders: Storage, order_id: str) -> dict[str, str] | None:
    """How an order stands, from the orders service's records: its outcome once it ended,
    ``placed`` while its saga runs; ``None`` if the orders service has not seen it (yet)."""
    outcome = orders.load("OrderOutcome", order_id)
    if outcome.exists:
        return {"order_id": order_id, **OrderOutcome.model_validate(outcome.state).model_dump()}
    if orders.load("Order", order_id).live:
        return {"order_id": order_id, "status": "placed", "reason": ""}
    return None


def create_app() -> Starlette:
    """The storefront app; its endpoint starts and stops with it."""
    endpoint = make_endpoint()
    orders = settings.storage("orders")  # read only: the orders service writes it

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await run_in_threadpool(endpoint.start)  # its outbox relay
        try:
            yield
        finally:
            await run_in_threadpool(endpoint.close)
            await run_in_threadpool(orders.close)

    async def post_order(request: Request) -> JSONResponse:
        try:
            form = OrderForm.model_validate_json(await request.body())
        except ValidationError as invalid:
            return JSONResponse({"error": invalid.errors(include_url=False)}, status_code=422)
        # One order per idempotency key: a retried request names the same order.
        key = request.headers.get("Idempotency-Key") or str(uuid.uuid4())
        order_id = str(uuid.uuid5(uuid.NAMESPACE_URL, f"shop:{key}"))
        created = await place_order(endpoint, form, order_id, key)
        return JSONResponse({"order_id": order_id, "status": "placed"},
                            status_code=201 if created else 200)

    async def get_order(request: Request) -> JSONResponse:
        order_id = request.path_params["order_id"]
        status = await run_in_threadpool(order_status, orders, order_id)
        if status is None:
            return JSONResponse({"order_id": order_id, "status": "unknown",
                                 "error": f"the orders service has no order {order_id} (yet)"},
                                status_code=404)
        return JSONResponse(status)

    return Starlette(routes=[Route("/orders", post_order, methods=["POST"]),
                             Route("/orders/{order_id}", get_order, methods=["GET"])],
                     lifespan=lifespan)
