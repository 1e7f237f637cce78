"""What the stores of the ordering sample say happened, whatever the senders think they sent.

Shared by the in-process demo (:func:`samples.ordering.system.report`) and the multi-process
torture test (:mod:`samples.torture`): both give it the three endpoints' storages, the
payment gateway's charges and the order ids that were placed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from idembus.storage.base import INBOX, Storage
from samples.ordering.billing import BillingHandler, Charge


@dataclass(frozen=True)
class StoreAudit:
    """Figures read from the stores after a run."""

    #: Orders whose Order aggregate is placed.
    placed: int
    #: OrderPlaced events the Billing handler recorded in its inbox.
    billed: int
    #: Shipments that are shipped.
    shipped: int
    #: Charges the payment gateway made.
    charges: int
    #: Expected orders not placed, charged and shipped.
    lost: int
    #: Effects that happened more than once: a second placement, shipment or charge of one
    #: order, or an order nobody placed.
    double_effects: int
    #: The lost orders and those with a double effect, for a post-mortem.
    lost_orders: tuple[str, ...] = field(default=(), repr=False)
    doubled_orders: tuple[str, ...] = field(default=(), repr=False)


def audit(
    *,
    sales: Storage,
    billing: Storage,
    shipping: Storage,
    charges: Iterable[Charge],
    order_ids: Collection[str],
) -> StoreAudit:
    """Read the stores and count what happened to the orders ``order_ids``."""
    orders = {r.aggregate_id: r.state or {} for r in sales.records("Order")}
    shipments = {r.aggregate_id: r.state or {} for r in shipping.records("Shipment")}
    billed = [r for r in billing.records(INBOX)
              if r.aggregate_id.startswith(BillingHandler.name() + "/")]
    made = list(charges)
    charged_orders = {charge.order_id for charge in made}
    expected = set(order_ids)
    complete = {
        order_id for order_id in expected
        if orders.get(order_id, {}).get("status") == "placed"
        and order_id in charged_orders
        and shipments.get(order_id, {}).get("shipped")
    }
    double_effects = (
        sum(max(0, state.get("times_placed", 0) - 1) for state in orders.values())
        + sum(max(0, state.get("times_shipped", 0) - 1) for state in shipments.values())
        + (len(made) - len(charged_orders))
        + sum(1 for order_id in orders if order_id not in expected)
    )
    charges_per_order = Counter(charge.order_id for charge in made)
    doubled = (
        {order_id for order_id, state in orders.items() if state.get("times_placed", 0) > 1}
        | {order_id for order_id, state in shipments.items()
           if state.get("times_shipped", 0) > 1}
        | {order_id for order_id, count in charges_per_order.items() if count > 1}
        | (set(orders) - expected)
    )
    return StoreAudit(
        placed=sum(1 for state in orders.values() if state.get("status") == "placed"),
        billed=len(billed),
        shipped=sum(1 for state in shipments.values() if state.get("shipped")),
        charges=len(made),
        lost=len(expected - complete),
        double_effects=double_effects,
        lost_orders=tuple(sorted(expected - complete)),
        doubled_orders=tuple(sorted(doubled)),
    )
