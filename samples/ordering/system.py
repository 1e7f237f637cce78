"""Wiring of the ordering sample and the report computed from its stores."""

from __future__ import annotations

import random
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from idembus import Endpoint
from idembus.handlers import Handler
from idembus.pipeline import Middleware
from idembus.storage.base import Storage
from idembus.testing import wait_until_idle
from idembus.transports.base import Transport
from idembus.transports.kombu import KombuTransport
from samples.ordering.audit import audit
from samples.ordering.billing import BillingHandler, FakePaymentGateway
from samples.ordering.history import check_history
from samples.ordering.messages import PlaceOrder
from samples.ordering.sales import Order, OrderHandler
from samples.ordering.shipping import Shipment, ShippingHandler


@dataclass
class OrderingSystem:
    """The three endpoints of the sample, their stores and the payment gateway."""

    sales: Endpoint
    billing: Endpoint
    shipping: Endpoint
    gateway: FakePaymentGateway

    @property
    def endpoints(self) -> list[Endpoint]:
        return [self.sales, self.billing, self.shipping]

    def start(self) -> None:
        for endpoint in self.endpoints:
            endpoint.start()

    def close(self) -> None:
        for endpoint in self.endpoints:
            endpoint.close()


def build(
    transport: Callable[[], Transport] | str = "memory://",
    *,
    namespace: str | None = None,
    storage: Callable[[str], Storage] | None = None,
    middleware: Sequence[Middleware] = (),
    concurrency: int = 2,
    journal: bool = False,
) -> OrderingSystem:
    """Create Sales, Billing and Shipping; queue names carry ``namespace`` so that runs
    sharing a broker do not see each other's messages. ``storage(endpoint_name)`` makes
    each endpoint's storage (default: the endpoint's own, an in-process MemoryStorage).
    With ``journal`` each keeps the events it publishes in its storage's event journal
    (``samples.stream`` serves Sales')."""
    suffix = f"-{namespace}" if namespace else ""
    if isinstance(transport, str):
        url = transport
        transport = lambda: KombuTransport(url)  # noqa: E731
    gateway = FakePaymentGateway()

    def endpoint(name: str, handler: Handler | type[Handler]) -> Endpoint:
        return Endpoint(
            f"{name}{suffix}",
            transport=transport(),
            storage=storage(f"{name}{suffix}") if storage is not None else None,
            handlers=[handler],
            error_queue=f"error{suffix}",
            concurrency=concurrency,
            middleware=middleware,
            journal=journal,
        )

    return OrderingSystem(
        sales=endpoint("sales", OrderHandler),
        billing=endpoint("billing", BillingHandler(gateway)),
        shipping=endpoint("shipping", ShippingHandler),
        gateway=gateway,
    )


@dataclass(frozen=True)
class Report:
    """Figures read from the stores after a run."""

    orders: int
    placed: int
    billed: int
    shipped: int
    charges: int
    duplicates_injected: int
    duplicates_detected: int
    redispatched: int
    lost: int
    double_effects: int
    #: What :func:`samples.ordering.history.check_history` found wrong in the stores'
    #: history (a message handled twice, out of order, never, or sent by nobody).
    history_violations: int = 0
    violations: tuple[str, ...] = field(default=(), repr=False, compare=False)

    def line(self) -> str:
        return " ".join(f"{name}={value}" for name, value in vars(self).items()
                        if name != "violations")

    @property
    def ok(self) -> bool:
        expected = self.orders
        return (
            self.lost == 0 and self.double_effects == 0 and self.history_violations == 0
            and self.placed == self.billed == self.shipped == self.charges == expected
        )


def order_commands(orders: int, duplicates: int, *,
                   seed: int = 0) -> Iterator[tuple[PlaceOrder, str, bool]]:
    """The orders of a run, ``order-0`` .. ``order-<orders-1>``: each PlaceOrder with its
    message id, and whether it is to be sent twice (``duplicates`` of them are)."""
    rng = random.Random(seed)
    twice = set(rng.sample(range(orders), duplicates))
    for index in range(orders):
        command = PlaceOrder(order_id=f"order-{index}", customer=f"customer-{index % 17}",
                             amount_cents=rng.randint(100, 100_000))
        message_id = str(uuid.UUID(int=rng.getrandbits(128)))
        yield command, message_id, index in twice


def place_orders(system: OrderingSystem, orders: int, duplicates: int, *,
                 seed: int = 0) -> list[str]:
    """Send ``orders`` PlaceOrder commands, ``duplicates`` of them twice with the same id."""
    order_ids: list[str] = []
    for command, message_id, twice in order_commands(orders, duplicates, seed=seed):
        order_ids.append(command.order_id)
        system.sales.bus.send(command, message_id=message_id)
        if twice:
            system.sales.bus.send(command, message_id=message_id)
    return order_ids


def report(system: OrderingSystem, order_ids: list[str], duplicates_injected: int) -> Report:
    """Read what happened from the stores (not from what the senders think they sent)."""
    stores = audit(sales=system.sales.storage, billing=system.billing.storage,
                   shipping=system.shipping.storage, charges=system.gateway.charges,
                   order_ids=order_ids)
    history = check_history(sales=system.sales.storage, billing=system.billing.storage,
                            shipping=system.shipping.storage, charges=system.gateway.charges,
                            order_ids=order_ids)
    counts = [endpoint.counters.snapshot() for endpoint in system.endpoints]
    return Report(
        orders=len(order_ids),
        placed=stores.placed,
        billed=stores.billed,
        shipped=stores.shipped,
        charges=stores.charges,
        duplicates_injected=duplicates_injected,
        duplicates_detected=sum(c["duplicate"] for c in counts),
        redispatched=sum(c["redispatched"] for c in counts),
        lost=stores.lost,
        double_effects=stores.double_effects,
        history_violations=len(history.violations),
        violations=tuple(history.described()),
    )


def run(system: OrderingSystem, orders: int, duplicates: int, *, seed: int = 0,
        timeout: float = 600.0) -> Report:
    """Start the system, place the orders, wait for quiescence and report."""
    system.start()
    order_ids = place_orders(system, orders, duplicates, seed=seed)
    wait_until_idle(system.endpoints, timeout=timeout)
    return report(system, order_ids, duplicates)


# Keep the aggregate state types importable from here for readers of the report.
__all__ = ["Order", "OrderingSystem", "Report", "Shipment", "build", "order_commands",
           "place_orders", "report", "run"]
