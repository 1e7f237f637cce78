"""The ordering sample behind HTTP: ``POST /orders`` places an order through
``async with sales.unit_of_work(...)``, so the Order's new state and its ``OrderPlaced`` are
committed in one write (in a worker thread, never blocking the event loop) and a retried
request (same ``Idempotency-Key``) takes effect once. The endpoints —
and with them the outbox dispatcher that sends what a crash left committed but unsent — run
in the app's lifespan.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Header, HTTPException
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from idembus.storage.errors import AlreadyProcessed, ConcurrencyConflict
from samples.ordering.messages import OrderPlaced
from samples.ordering.sales import Order
from samples.ordering.system import OrderingSystem


class OrderRequest(BaseModel):
    order_id: str
    customer: str
    amount_cents: int


def create_app(system: OrderingSystem) -> FastAPI:
    """The HTTP front of ``system``, whose endpoints start and stop with the app."""
    sales = system.sales

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        system.start()  # consumers, delayed deliveries and each endpoint's outbox dispatcher
        try:
            yield
        finally:
            system.close()

    app = FastAPI(title="idembus ordering", lifespan=lifespan)

    @app.post("/orders", status_code=201)
    async def place_order(
        request: OrderRequest, idempotency_key: str | None = Header(default=None)
    ) -> JSONResponse:
        operation = idempotency_key or str(uuid.uuid4())
        try:
            # Loads, commits and sends in a worker thread: the event loop is never blocked.
            async with sales.unit_of_work(Order, request.order_id,
                                          operation_id=operation) as work:
                if work.state.status != "new":
                    raise HTTPException(409, f"order {request.order_id} is already placed")
                work.state.status = "placed"
                work.state.customer = request.customer
                work.state.amount_cents = request.amount_cents
                work.state.times_placed += 1
                work.bus.publish(OrderPlaced(order_id=request.order_id,
                                             customer=request.customer,
                                             amount_cents=request.amount_cents))
        except AlreadyProcessed:
            return JSONResponse({"order_id": request.order_id, "status": "placed",
                                 "replayed": True}, status_code=200)
        except ConcurrencyConflict:
            raise HTTPException(409, "the order changed meanwhile; try again") from None
        return JSONResponse({"order_id": request.order_id, "status": "placed",
                             "replayed": False}, status_code=201)

    @app.get("/orders/{order_id}")
    def get_order(order_id: str) -> dict[str, object]:  # a plain def: FastAPI's threadpool
        record = sales.storage.load("Order", order_id)
        if not record.exists:
            raise HTTPException(404, f"no order {order_id}")
        shipment = system.shipping.storage.load("Shipment", order_id)
        return {"order_id": order_id, **Order.model_validate(record.state).model_dump(),
                "shipped": bool(shipment.exists and (shipment.state or {}).get("shipped"))}

    return app
