"""The line a torture run ends with, read from the stores and the broker."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from idembus.storage.base import Storage
from samples.ordering.audit import StoreAudit, audit
from samples.ordering.deployment import ENDPOINTS, Deployment
from samples.ordering.history import HistoryCheck, check_history


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
    #: Violations of the stores' history (:mod:`samples.ordering.history`): a message
    #: handled twice, out of causal order or never, or sent by nobody.
    history_violations: int = 0
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
        for name in ("error_queue", "lost", "double_effects", "history_violations"):
            if getattr(self, name) != 0:
                problems.append(f"{name}={getattr(self, name)}, expected 0")
        if broker_restart_expected and self.broker_restarts != 1:
            problems.append(f"broker_restarts={self.broker_restarts}, expected 1")
        if kills_expected and self.kills == 0:
            problems.append("no worker was killed")
        problems += [f"{figure}=0, expected at least 1" for figure, count in self.cluster
                     if count == 0]
        return problems


def read_stores(deployment: Deployment, order_ids: Sequence[str],
                commands: Mapping[str, str] | None = None) -> tuple[StoreAudit, HistoryCheck]:
    """What the deployment's tables and its gateway's charges say happened: the counts,
    and the check of their history (``commands``: the PlaceOrder ids the driver sent,
    each with its order id)."""
    storages = {name: deployment.storage(name) for name in ENDPOINTS}
    gateway = deployment.gateway()
    try:
        charges = gateway.charges
        return (audit(sales=storages["sales"], billing=storages["billing"],
                      shipping=storages["shipping"], charges=charges, order_ids=order_ids),
                check_history(sales=storages["sales"], billing=storages["billing"],
                              shipping=storages["shipping"], charges=charges,
                              order_ids=order_ids, commands=commands))
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
                error_queue: int, history: HistoryCheck | None = None,
                cluster: tuple[tuple[str, int], ...] = ()) -> TortureReport:
    """The line's figures: the stores' (their counts and ``history``'s violations) and the
    chaos's."""
    return TortureReport(
        orders=orders, placed=stores.placed, billed=stores.billed, shipped=stores.shipped,
        charges=stores.charges, kills=kills, broker_restarts=broker_restarts,
        error_queue=error_queue, lost=stores.lost, double_effects=stores.double_effects,
        history_violations=len(history.violations) if history is not None else 0,
        cluster=cluster,
    )
