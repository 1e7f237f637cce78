"""The idembus side: Sales (PlaceOrder -> OrderPlaced) and Billing (OrderPlaced ->
OrderBilled) as two endpoints of one consumer thread each, defaults otherwise.

N PlaceOrder commands for N distinct orders are queued for Sales before either endpoint
starts, so Sales ends with N Order aggregates and Billing with N inbox records; the clock
runs from Sales' first delivery until Billing has handled N OrderPlaced events. Nobody
subscribes to OrderBilled, so the broker drops it after confirming it, as in the raw loop.

Storages (:data:`STORAGES`): the embedded default (mongomock), MemoryStorage, and
PostgreSQL at ``IDEMBUS_POSTGRES_URL`` (tables of the run's own, dropped afterwards).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench.common import (
    MEMORY_POLLING_INTERVAL,
    PREFETCH,
    FlowClock,
    orders,
    postgres_unreachable_reason,
    timeout_for,
    unique_suffix,
)
from bench.pg_common import POSTGRES_URL
from idembus.pipeline import Middleware
from idembus.runtime.endpoint import Endpoint
from idembus.storage.base import Storage
from idembus.storage.memory import MemoryStorage
from idembus.storage.mongo import MongoStorage
from idembus.storage.postgres import PostgresStorage
from idembus.transports.kombu import KombuTransport
from samples.ordering.billing import BillingHandler, FakePaymentGateway
from samples.ordering.sales import OrderHandler

#: Storage backends measured, by the name of the option, each made for an endpoint name;
#: ``default`` is what an Endpoint given no storage uses (``None`` is passed on: the
#: endpoint picks it).
STORAGES: dict[str, Callable[[str], Storage | None]] = {
    "default": lambda name: None,
    "memory": lambda name: MemoryStorage(),
    "mongomock": lambda name: MongoStorage.embedded(name),
    "postgres": lambda name: PostgresStorage(POSTGRES_URL, table_prefix=_table_prefix(name)),
}


def default_storage_name() -> str:
    """The class an Endpoint given no storage uses, as the table names it."""
    probe = Endpoint("bench-default-storage-probe", transport="memory://")
    try:
        return type(probe.storage).__name__
    finally:
        probe.close()


def unavailable(storage: str) -> str | None:
    """Why ``storage`` cannot be measured here, or ``None`` (only PostgreSQL may be
    missing)."""
    return postgres_unreachable_reason(POSTGRES_URL) if storage == "postgres" else None


def drop_storage(storage: str, name: str) -> None:
    """Drop the tables of ``name``'s PostgreSQL storage (with a storage of their own: the
    endpoint closed its); the other storages keep nothing."""
    if storage != "postgres":
        return
    cleaner = PostgresStorage(POSTGRES_URL, table_prefix=_table_prefix(name))
    try:
        cleaner.drop_tables()
    finally:
        cleaner.close()


def _table_prefix(name: str) -> str:
    return name.replace("-", "_")

TransportFactory = Callable[..., KombuTransport]


@dataclass
class Flow:
    """The two endpoints of one run, their exchange and the clock watching them."""

    sales: Endpoint
    billing: Endpoint
    #: Sales' transport, kept with its kombu type for the clean-up.
    transport: KombuTransport
    exchange: str
    clock: FlowClock
    #: The storage kind of both endpoints (a key of :data:`STORAGES`).
    storage: str

    @property
    def endpoints(self) -> tuple[Endpoint, Endpoint]:
        return self.sales, self.billing


def build_flow(url: str, storage: str, count: int, *, confirm: bool,
               transport: TransportFactory = KombuTransport,
               middleware: Callable[[], list[Middleware]] = list) -> Flow:
    """Create both endpoints on fresh queues, declare them and hook up the clock."""
    suffix = unique_suffix()
    exchange = f"bench.events.{suffix}"
    polling = MEMORY_POLLING_INTERVAL if url.startswith("memory://") else None

    def endpoint(name: str, handler: Any, kombu_transport: KombuTransport) -> Endpoint:
        return Endpoint(
            f"bench-{name}-{suffix}",
            transport=kombu_transport,
            storage=STORAGES[storage](f"bench-{name}-{suffix}"),
            handlers=[handler],
            error_queue=f"bench-error-{suffix}",
            concurrency=1,
            prefetch=PREFETCH,
            middleware=middleware(),
        )

    sales_transport, billing_transport = (
        transport(url, exchange=exchange, confirm_publish=confirm, polling_interval=polling)
        for _ in range(2)
    )
    flow = Flow(endpoint("sales", OrderHandler, sales_transport),
                endpoint("billing", BillingHandler(FakePaymentGateway()), billing_transport),
                sales_transport, exchange, FlowClock(count), storage)
    for each in flow.endpoints:
        each.transport.declare(each.name, subscriptions=each.subscriptions)
    flow.sales.signals.received.connect(lambda sender, **_: flow.clock.start(), weak=False)
    flow.billing.signals.handled.connect(lambda sender, **_: flow.clock.finish_one(),
                                         weak=False)
    return flow


def preload(flow: Flow, count: int) -> None:
    """Queue ``count`` PlaceOrder commands for Sales while no endpoint runs."""
    for command in orders(count):
        flow.sales.bus.send(command)


def check(flow: Flow, count: int) -> None:
    """Fail loudly if the run did something other than what it was meant to time."""
    for each in flow.endpoints:
        counts = each.counters.snapshot()
        if counts["handled"] != count or counts["dead_lettered"] or counts["duplicate"]:
            raise RuntimeError(f"{each.name} did not handle {count} messages cleanly: {counts}")


def cleanup(flow: Flow) -> None:
    """Delete the run's queues and exchange (memory:// keeps them at class level too), and
    its tables."""
    transport = flow.transport
    for queue in (flow.sales.name, flow.billing.name, flow.sales.error_queue):
        transport.delete_queue(queue)
    transport.delete_exchange()
    for each in flow.endpoints:
        drop_storage(flow.storage, each.name)


def run(url: str, storage: str, count: int, *, confirm: bool = True,
        transport: TransportFactory = KombuTransport,
        middleware: Callable[[], list[Middleware]] = list, least_rate: float = 20.0) -> float:
    """One timed run; returns the seconds taken for 2 x ``count`` handled messages, with
    ``middleware()`` on each endpoint; a run slower than ``least_rate`` messages/s fails
    (:func:`~bench.common.timeout_for`)."""
    flow = build_flow(url, storage, count, confirm=confirm, transport=transport,
                      middleware=middleware)
    try:
        preload(flow, count)
        flow.billing.start()
        flow.sales.start()
        seconds = flow.clock.wait(timeout_for(2 * count, least_rate=least_rate))
    finally:
        for each in flow.endpoints:
            each.close()
        cleanup(flow)
    check(flow, count)
    return seconds
