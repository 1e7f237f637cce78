"""The dashboard's saga pages over HTTP: the live sagas of a type listed a page at a time
(filtered on the id, or the completed ones with the state each ended with), and one saga's
story — the messages it handled with their types and times, the one that ended it, and its
last state."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from idembus import Endpoint, message_name
from idembus.dashboard import Dashboard, saga_list
from idembus.storage.memory import MemoryStorage
from tests.saga_orders import CloseOrder, OrderSaga, PayOrder, PlaceOrder
from tests.support import SignalCounter
from tests.test_dashboard import HOSTILE, assert_shown_as_text, text_of
from tests.test_sagas import SAGA, settle


@dataclass
class Sales:
    endpoint: Endpoint
    client: httpx.Client
    handled: SignalCounter

    def run(self, *commands: PlaceOrder | PayOrder | CloseOrder) -> None:
        """Send ``commands`` to the saga and wait until each was handled."""
        waited = self.handled.count + len(commands)
        for command in commands:
            self.endpoint.bus.send(command, to=self.endpoint.name)
        settle(self.endpoint, self.handled, waited)

    def page(self, **query: str) -> httpx.Response:
        return self.client.get("/aggregates", params=query)


@pytest.fixture
def sales(unique: str) -> Iterator[Sales]:
    storage = MemoryStorage()
    endpoint = Endpoint(f"sales-{unique}", storage=storage, handlers=[OrderSaga],
                        status_interval=0)
    tool = Endpoint(f"sales-{unique}", storage=storage, handlers=[OrderSaga], status_interval=0)
    dashboard = Dashboard([tool], port=0, sample_interval=0.05)
    handled = SignalCounter(endpoint, "handled")
    endpoint.start()
    dashboard.start()
    client = httpx.Client(base_url=dashboard.url, timeout=15)
    try:
        yield Sales(endpoint, client, handled)
    finally:
        client.close()
        dashboard.stop(5)
        endpoint.close()
        tool.close()


def test_the_types_link_to_their_live_sagas_listed_a_page_at_a_time(
    sales: Sales, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given three live orders and a paid one, and pages of two
    monkeypatch.setattr(saga_list, "PAGE", 2)
    sales.run(*(PlaceOrder(order_id=order) for order in ("o-3", "o-1", "o-2", "x-1")))
    sales.run(PayOrder(order_id="x-1"))

    # When the type is followed from the lookup page, then the next page
    start = sales.client.get("/aggregates")
    first = sales.page(type=SAGA)
    after = first.text.split('rel="next"')[0].rsplit('href="', 1)[1].split('"')[0]
    second = sales.client.get(after.replace("&amp;", "&"))

    # Then the live ones are listed in the order of their ids, each linking to its story
    assert f"type={SAGA}" in start.text
    assert first.status_code == 200 and second.status_code == 200
    assert "o-1" in text_of(first) and "o-2" in text_of(first) and "o-3" not in text_of(first)
    assert "o-3" in text_of(second) and "Next page" not in text_of(second)
    assert "x-1" not in text_of(first) + text_of(second)  # completed: not live
    assert f"/aggregates?endpoint={sales.endpoint.name}&amp;type={SAGA}&amp;id=o-1" in first.text
    assert '"express": false, "reminders": 0' in text_of(first)


def test_the_completed_ones_are_listed_with_their_last_state_and_filtered_on_the_id(
    sales: Sales,
) -> None:
    sales.run(*(PlaceOrder(order_id=order) for order in ("a-1", "a-2", "b-1", "a-3")))
    sales.run(PayOrder(order_id="a-1"), CloseOrder(order_id="a-2"), PayOrder(order_id="b-1"))

    page = sales.page(type=SAGA, status="completed", prefix="a-")

    text = text_of(page)
    assert page.status_code == 200
    assert "a-1" in text and "a-2" in text and "b-1" not in text and "a-3" not in text
    assert "last state" in text and '"reminders": 0' in text
    assert "no live" in text_of(sales.page(type=SAGA, prefix="zz"))


def test_a_paid_and_a_cancelled_order_tell_their_stories_apart(sales: Sales) -> None:
    # Given one order paid and one cancelled
    sales.run(PlaceOrder(order_id="o-1"), PlaceOrder(order_id="o-2"))
    sales.run(PayOrder(order_id="o-1"), CloseOrder(order_id="o-2"))

    # When their stories are shown
    paid = text_of(sales.page(type=SAGA, id="o-1"))
    cancelled = text_of(sales.page(type=SAGA, id="o-2"))

    # Then each names the message that ended it, by type, and keeps its last state
    assert f"ended by {message_name(PayOrder)}" in paid
    assert f"ended by {message_name(CloseOrder)}" in cancelled
    for story in (paid, cancelled):
        assert "completed (tombstone)" in story and "Last state" in story
        assert '"reminders": 0' in story and "none (tombstone)" not in story
        # And lists what it handled with the types, the ending one marked
        assert message_name(PlaceOrder) in story and "completed the saga" in story
        assert "OrderSaga" in story


def test_a_live_saga_shows_its_state_and_no_ending(sales: Sales) -> None:
    sales.run(PlaceOrder(order_id="o-1"))

    text = text_of(sales.page(type=SAGA, id="o-1"))

    assert "live" in text and "State" in text and "ended by" not in text
    assert message_name(PlaceOrder) in text and "completed the saga" not in text


def test_html_in_listed_ids_and_filters_is_shown_as_text(sales: Sales) -> None:
    sales.run(PlaceOrder(order_id=HOSTILE))

    assert_shown_as_text(sales.page(type=SAGA))
    assert_shown_as_text(sales.page(type=SAGA, prefix=HOSTILE))
    assert HOSTILE in text_of(sales.page(type=SAGA))
