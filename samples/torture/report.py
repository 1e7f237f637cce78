"""The line a torture run ends with, read from the stores and the broker."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from idembus.storage.base import Storage
from samples.ordering.audit import StoreAudit, audit
from samples.ordering.deployment import ENDPOINTS, Deployment


@dataclass(frozen=True)
class TortureReport:
    """The figures of the final line, in its order."""

    orders: int
    placed: int
    billed: int
    shipped: int
    charges: int
    kills: int
    broker_restarts: int
    error_queue: int
    lost: int
    double_effects: int
    #: A cluster run's chaos (``node_kills``, ``node_stops``, ...), after broker_restarts.
    cluster: tuple[tuple[str, int], ...] = ()

    def line(self) -> str:
        parts = []
        for name, value in vars(self).items():
            if name == "cluster":
                continue
            parts.append(f"{name}={value}")
            if name == "broker_restarts":
                parts += [f"{figure}={count}" for figure, count in self.cluster]
        return " ".join(parts)

    def failures(self, *, broker_restart_expected: bool, kills_expected: bool) -> list[str]:
        """What is off, in words; empty when the run proved exactly-once."""
        problems = []
        for name in ("placed", "billed", "shipped", "charges"):
            if getattr(self, name) != self.orders:
                problems.append(f"{name}={getattr(self, name)}, expected {self.orders}")
        for name in ("error_queue", "lost", "double_effects"):
            if getattr(self, name) != 0:
                problems.append(f"{name}={getattr(self, name)}, expected 0")
        if broker_restart_expected and self.broker_restarts != 1:
            problems.append(f"broker_restarts={self.broker_restarts}, expected 1")
        if kills_expected and self.kills == 0:
            problems.append("no worker was killed")
        problems += [f"{figure}=0, expected at least 1" for figure, count in self.cluster
                     if count == 0]
        return problems


def read_stores(deployment: Deployment, order_ids: Sequence[str]) -> StoreAudit:
    """What the deployment's tables and its gateway's charges say happened."""
    storages = {name: deployment.storage(name) for name in ("sales", "billing", "shipping")}
    gateway = deployment.gateway()
    try:
        return audit(sales=storages["sales"], billing=storages["billing"],
                     shipping=storages["shipping"], charges=gateway.charges,
                     order_ids=order_ids)
    finally:
        gateway.close()
        for storage in storages.values():
            storage.close()


#: The counters a torture run's notes show, per endpoint.
COUNTED = ("handled", "duplicate", "redispatched", "left_to_outbox")


def counted(deployment: Deployment) -> str:
    """Each endpoint's counters of :data:`COUNTED`, summed over its processes' reports:
    ``sales handled=… duplicate=…; billing …``."""
    parts = []
    for name in ENDPOINTS:
        storage = deployment.storage(name)
        try:
            reports = storage.status_reports(deployment.queue(name))
        finally:
            storage.close()
        figures = " ".join(f"{counter}={sum(r.counters.get(counter, 0) for r in reports)}"
                           for counter in COUNTED)
        parts.append(f"{name} {figures}")
    return "; ".join(parts)


def gateway_calls(deployment: Deployment) -> int:
    """Calls the Billing workers made to the payment gateway (retries included)."""
    gateway = deployment.gateway()
    try:
        return gateway.total_calls()
    finally:
        gateway.close()


def shipped_orders(shipping: Storage) -> int:
    """How many Shipment aggregates are shipped (a cheap progress figure)."""
    return sum(1 for record in shipping.records("Shipment") if (record.state or {}).get("shipped"))


def make_report(stores: StoreAudit, *, orders: int, kills: int, broker_restarts: int,
                error_queue: int, cluster: tuple[tuple[str, int], ...] = ()) -> TortureReport:
    """The line's figures: the stores' and the chaos's."""
    return TortureReport(
        orders=orders, placed=stores.placed, billed=stores.billed, shipped=stores.shipped,
        charges=stores.charges, kills=kills, broker_restarts=broker_restarts,
        error_queue=error_queue, lost=stores.lost, double_effects=stores.double_effects,
        cluster=cluster,
    )
