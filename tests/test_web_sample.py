"""samples/web: orders placed over HTTP through a unit of work, with a real HTTP client
against uvicorn, and the endpoints running in the app's lifespan."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn

from samples.ordering.system import OrderingSystem, build
from samples.web.app import create_app
from tests.support import SignalCounter


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def served(unique: str) -> Iterator[tuple[OrderingSystem, httpx.Client]]:
    system = build(namespace=unique)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(system), host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)  # uvicorn offers no event for "listening"
    assert server.started, "uvicorn did not start"
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
        yield system, client
    server.should_exit = True
    thread.join(timeout=30)
    assert not thread.is_alive()


def order(order_id: str) -> dict[str, object]:
    return {"order_id": order_id, "customer": "ann", "amount_cents": 1200}


def test_an_order_placed_over_http_flows_to_shipping_once(served):
    system, client = served
    shipped = SignalCounter(system.shipping, "handled")

    placed = client.post("/orders", json=order("o-1"), headers={"Idempotency-Key": "k-1"})

    assert placed.status_code == 201 and placed.json()["replayed"] is False
    assert shipped.wait_for(1)
    assert client.get("/orders/o-1").json() == {
        "order_id": "o-1", "status": "placed", "customer": "ann", "amount_cents": 1200,
        "times_placed": 1, "shipped": True}
    assert len(system.gateway.charges) == 1


def test_a_retried_request_with_the_same_idempotency_key_takes_effect_once(served):
    system, client = served
    shipped = SignalCounter(system.shipping, "handled")

    first = client.post("/orders", json=order("o-2"), headers={"Idempotency-Key": "k-2"})
    again = client.post("/orders", json=order("o-2"), headers={"Idempotency-Key": "k-2"})

    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json()["replayed"] is True
    assert shipped.wait_for(1)
    assert client.get("/orders/o-2").json()["times_placed"] == 1
    assert [c.order_id for c in system.gateway.charges] == ["o-2"]


def test_placing_the_same_order_with_another_key_is_a_conflict(served):
    _, client = served
    assert client.post("/orders", json=order("o-3"),
                       headers={"Idempotency-Key": "a"}).status_code == 201
    refused = client.post("/orders", json=order("o-3"), headers={"Idempotency-Key": "b"})
    assert refused.status_code == 409
    assert "already placed" in refused.json()["detail"]
    assert client.get("/orders/nope").status_code == 404


def test_the_endpoints_and_their_outbox_dispatchers_run_in_the_lifespan(served):
    system, _ = served
    assert all(endpoint.running for endpoint in system.endpoints)
    deadline = time.monotonic() + 30
    while system.sales.outbox.lease is None and time.monotonic() < deadline:
        time.sleep(0.02)  # its first round takes the lease
    assert system.sales.outbox.lease is not None
