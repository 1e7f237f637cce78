"""The ordering sample's history checker catches each kind of violation, on every backend.

Each test writes the stores of Sales, Billing and Shipping through the storage API, the
way the endpoints commit, then corrupts them on purpose: a message handled twice, a
shipment committed before the billing that sent its message, a message nobody handled.
"""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from idembus.envelope import Envelope, utc_now
from idembus.headers import MESSAGE_ID, MESSAGE_TYPE
from idembus.storage.base import INBOX, Storage
from idembus.testing.faults import RandomCrashes
from samples.ordering.billing import Charge
from samples.ordering.history import HistoryCheck, check_history
from samples.ordering.system import build, run

MILLISECOND = datetime.timedelta(milliseconds=1)


def _id() -> str:
    return str(uuid.uuid4())


def _next_millisecond() -> None:
    """Wait until the clock has moved to another millisecond, so that two commits (MongoDB
    keeps milliseconds) have different times."""
    now = utc_now()
    following = now.replace(microsecond=now.microsecond // 1000 * 1000) + MILLISECOND
    while utc_now() < following:
        pass


class Shop:
    """The stores of the three endpoints, written as the ordering sample's handlers
    would."""

    def __init__(self, make: Callable[..., Any]) -> None:
        self.sales: Storage = make()
        self.billing: Storage = make()
        self.shipping: Storage = make()
        self.charges: list[Charge] = []
        self.order_ids: list[str] = []
        #: PlaceOrder message id -> order id, as the driver sent them.
        self.commands: dict[str, str] = {}

    def place(self, order_id: str, *, command: str | None = None) -> str:
        """Sales handles a PlaceOrder: returns the OrderPlaced id."""
        command = command or _id()
        self.commands.setdefault(command, order_id)
        if order_id not in self.order_ids:
            self.order_ids.append(order_id)
        return self.commit(self.sales, "Order", order_id, f"OrderHandler/{command}",
                           {"status": "placed"})

    def bill(self, order_id: str, placed: str, *, handler: str = "BillingHandler") -> str:
        """Billing handles an OrderPlaced and charges: returns the OrderBilled id."""
        charge = Charge(_id(), order_id, 100)
        self.charges.append(charge)
        key = f"{handler}/{placed}"
        return self.commit(self.billing, INBOX, key, key, None)

    def ship(self, order_id: str, billed: str) -> str:
        """Shipping handles an OrderBilled: returns the OrderShipped id."""
        charge = next(c.charge_id for c in reversed(self.charges) if c.order_id == order_id)
        return self.commit(self.shipping, "Shipment", order_id, f"ShippingHandler/{billed}",
                           {"shipped": True, "charge_id": charge})

    def order(self, order_id: str) -> tuple[str, str, str]:
        """One order through the three endpoints: its OrderPlaced, OrderBilled and
        OrderShipped ids."""
        placed = self.place(order_id)
        billed = self.bill(order_id, placed)
        return placed, billed, self.ship(order_id, billed)

    def check(self, *, commands: bool = False) -> HistoryCheck:
        return check_history(sales=self.sales, billing=self.billing, shipping=self.shipping,
                             charges=self.charges, order_ids=self.order_ids,
                             commands=self.commands if commands else None)

    @staticmethod
    def commit(storage: Storage, aggregate_type: str, aggregate_id: str, key: str,
               state: dict[str, Any] | None, *, sends: str | None = None) -> str:
        """Commit ``key`` on the aggregate, sending one message (id ``sends``, or a new
        one) in a later millisecond than the commit before; returns the sent id."""
        _next_millisecond()
        outgoing = Envelope({MESSAGE_ID: sends or _id(), MESSAGE_TYPE: "ordering.Event"}, "{}")
        loaded = storage.load(aggregate_type, aggregate_id, key)
        storage.commit(loaded, key=key, state=state, outgoing=[outgoing])
        return outgoing.message_id


@pytest.fixture
def shop(storage_factory: Callable[..., Any]) -> Shop:
    return Shop(storage_factory)


def kinds(found: HistoryCheck) -> set[str]:
    return set(found.counts())


def texts(found: HistoryCheck) -> Sequence[str]:
    return [str(violation) for violation in found.violations]


def test_a_history_where_each_order_took_effect_once_in_order_passes(shop: Shop):
    for number in range(3):
        shop.order(f"order-{number}")

    found = shop.check(commands=True)

    assert found.ok, found.described()
    assert found.commits == {"sales": 3, "billing": 3, "shipping": 3}
    assert found.described() == []


def test_a_message_handled_twice_is_a_duplicate(shop: Shop):
    # Given an order through, and its OrderPlaced handled again by a renamed handler
    # (a new key: the store's uniqueness cannot refuse it), which charged again
    placed, _, _ = shop.order("order-0")
    shop.bill("order-0", placed, handler="RenamedBillingHandler")

    found = shop.check()

    assert "duplicate" in kinds(found), texts(found)
    assert any(f"billing handled message {placed} 2 times" in text for text in texts(found))
    assert any(text.startswith("charge: order 'order-0' was charged 2 times")
               for text in texts(found))
    assert any(text.startswith("lost: message ") and "never handled by shipping" in text
               for text in texts(found))


def test_a_shipment_committed_before_its_billing_is_out_of_order(shop: Shop):
    # Given an order whose shipment was committed before the billing that sent its
    # OrderBilled (the billing's message id decided beforehand)
    placed = shop.place("order-0")
    billed = _id()
    shop.charges.append(Charge(_id(), "order-0", 100))
    shop.ship("order-0", billed)
    key = f"BillingHandler/{placed}"
    shop.commit(shop.billing, INBOX, key, key, None, sends=billed)

    found = shop.check()

    assert kinds(found) == {"order"}, texts(found)
    (text,) = texts(found)
    assert text.startswith("order: shipping 'order-0' at ") and \
        f"handled message {billed} before it was committed, by billing" in text


def test_a_message_nobody_handled_is_lost(shop: Shop):
    shop.order("order-0")
    placed = shop.place("order-1")
    billed = shop.bill("order-1", placed)  # never shipped

    found = shop.check()

    assert kinds(found) == {"lost"}, texts(found)
    (text,) = texts(found)
    assert text.startswith(f"lost: message {billed} sent by billing 'BillingHandler/{placed}' "
                           "at ") and text.endswith(" was never handled by shipping")


def test_an_order_never_placed_and_a_placement_nobody_ordered_are_caught(shop: Shop):
    shop.order("order-0")
    shop.order_ids.append("order-1")  # ordered, never placed
    shop.order_ids.remove("order-0")  # placed, never ordered

    found = shop.check()

    assert texts(found)[0].startswith("unsent: order 'order-0' nobody ordered was placed "
                                      "(sales 'order-0' at ")
    assert "lost: order 'order-1' was never placed" in texts(found)


def test_a_message_nobody_sent_and_a_placeorder_the_driver_never_sent_are_unsent(shop: Shop):
    shop.order("order-0")
    forged = _id()
    shop.place("order-1", command=forged)
    del shop.commands[forged]
    stray = _id()  # an OrderBilled no billing commit sent
    shop.commit(shop.shipping, "Shipment", "order-0", f"ShippingHandler/{stray}",
                {"shipped": True})

    found = shop.check(commands=True)

    assert any(text.endswith(f"handled PlaceOrder {forged}, which the driver never sent")
               for text in texts(found)), texts(found)
    assert any(f"handled message {stray}, which no billing commit sent" in text
               for text in texts(found)), texts(found)


def test_a_shipment_of_another_order_is_misrouted_and_a_second_charge_is_caught(shop: Shop):
    _, billed, _ = shop.order("order-0")
    placed = shop.place("order-1")
    other = shop.bill("order-1", placed)
    shop.charges.append(Charge(_id(), "order-0", 100))  # the gateway charged order-0 twice
    shop.commit(shop.shipping, "Shipment", "order-0-bis", f"ShippingHandler/{other}",
                {"shipped": True, "charge_id": "nothing"})

    found = shop.check()

    assert any(text.startswith("misrouted: shipping 'order-0-bis'") and
               "shipped for the billing of order 'order-1'" in text for text in texts(found))
    assert "charge: order 'order-0' was charged 2 times for 1 billings" in texts(found)
    assert "charge: shipment 'order-0-bis' carries charge 'nothing', not one made for its " \
        "order" in texts(found)
    assert billed


def test_the_description_counts_by_kind_and_lists_the_first_ten(shop: Shop):
    for number in range(12):
        shop.order_ids.append(f"order-{number}")  # twelve orders never placed

    found = shop.check()

    lines = found.described()
    assert lines[0] == "12 history violations (lost 12)"
    assert len(lines) == 1 + 10 + 1 and lines[-1] == "  ... and 2 more"
    assert not found.ok and found.counts() == {"lost": 12}


def test_the_in_process_demo_with_crashes_has_a_clean_history():
    system = build(namespace=f"h{uuid.uuid4().hex[:6]}", middleware=[RandomCrashes(0.1, seed=3)])
    try:
        result = run(system, orders=40, duplicates=8, seed=4, timeout=120)
    finally:
        system.close()

    assert result.ok and result.history_violations == 0, result.line()
