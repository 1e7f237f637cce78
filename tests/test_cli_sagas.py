"""``idembus sagas list`` pages through the live (or completed) sagas of a type and
``idembus sagas show`` tells one saga's story: its messages with their types and times, the
one that ended it, and its last state.

The CLI runs in-process on a :class:`~tests.test_cli_errors.SharedMemoryStorage`, shared in
this test process as a database is between processes.
"""

from __future__ import annotations

import json
import sys
import types
from collections.abc import Callable
from typing import Any

import pytest

from idembus import Endpoint, message_name
from idembus.cli import main
from idembus.storage.base import AggregateRecord
from idembus.storage.errors import SchemaMissing
from idembus.storage.memory import MemoryStorage
from tests.saga_orders import CloseOrder, OrderSaga, PayOrder, PlaceOrder
from tests.support import SignalCounter
from tests.test_cli_errors import SharedMemoryStorage
from tests.test_sagas import SAGA, settle

Expose = Callable[[MemoryStorage], str]


@pytest.fixture
def exposed(monkeypatch: pytest.MonkeyPatch, unique: str) -> Expose:
    """``exposed(storage)`` makes a sales endpoint on ``storage`` reachable as
    ``sagas_app:make``, built anew by each command (as another process would)."""
    def expose(storage: MemoryStorage) -> str:
        module = types.ModuleType("sagas_app")
        module.make = lambda: Endpoint(  # type: ignore[attr-defined]
            f"sales-{unique}", storage=storage, handlers=[OrderSaga], status_interval=0)
        monkeypatch.setitem(sys.modules, "sagas_app", module)
        return "sagas_app:make"
    return expose


def orders(storage: MemoryStorage, *, live: int, paid: tuple[str, ...] = (),
           closed: tuple[str, ...] = ()) -> None:
    """Orders o-00.. placed (``live`` of them left live), and those named placed then paid
    or closed, handled by a running endpoint."""
    with Endpoint("sales-writer", storage=storage, handlers=[OrderSaga],
                  status_interval=0) as sales:
        handled = SignalCounter(sales, "handled")
        placed = [(f"o-{index:02}", f"m-place-{index}") for index in range(live)]
        placed += [(order, f"m-place-{order}") for order in paid + closed]
        for order, message_id in placed:
            sales.bus.send(PlaceOrder(order_id=order), to=sales.name, message_id=message_id)
        settle(sales, handled, len(placed))
        for order in paid:
            sales.bus.send(PayOrder(order_id=order), to=sales.name, message_id=f"m-pay-{order}")
        for order in closed:
            sales.bus.send(CloseOrder(order_id=order), to=sales.name,
                           message_id=f"m-close-{order}")
        settle(sales, handled, len(placed) + len(paid) + len(closed))


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_list_pages_through_the_live_sagas_of_a_type_in_the_order_of_their_ids(
    exposed: Expose, capsys: pytest.CaptureFixture[str],
) -> None:
    # Given five live orders and one that was paid
    storage = SharedMemoryStorage()
    orders(storage, live=5, paid=("x-1",))
    app = exposed(storage)

    # When they are listed two at a time, each page after the last id of the one before
    status, out, _ = run(capsys, "sagas", "list", app, "--type", SAGA, "--limit", "2",
                         "--json")
    first = json.loads(out)
    _, out, _ = run(capsys, "sagas", "list", app, "--type", SAGA, "--limit", "2", "--json",
                    "--after", first["next_after"])
    second = json.loads(out)
    _, out, _ = run(capsys, "sagas", "list", app, "--type", SAGA, "--limit", "2", "--json",
                    "--after", second["next_after"])
    third = json.loads(out)

    # Then every live one is listed once, in order, with its state; the paid one is not
    assert status == 0
    assert [item["id"] for page in (first, second, third) for item in page["sagas"]] == [
        "o-00", "o-01", "o-02", "o-03", "o-04"]
    assert third["next_after"] is None
    assert first["sagas"][0]["state"] == {"express": False, "reminders": 0}
    assert first["sagas"][0]["version"] == 1 and first["sagas"][0]["updated_at"]

    # And the text form says the same for people, with how to get the next page
    _, text, _ = run(capsys, "sagas", "list", app, "--type", SAGA, "--limit", "2")
    assert "OrderProcess of endpoint" in text and "2 live saga(s)" in text
    assert "o-00" in text and "o-01" in text and "more: --after o-01" in text


def test_list_completed_shows_the_tombstones_with_their_last_state_and_filters_on_the_id(
    exposed: Expose, capsys: pytest.CaptureFixture[str],
) -> None:
    storage = SharedMemoryStorage()
    orders(storage, live=1, paid=("a-1", "b-1"), closed=("a-2",))
    app = exposed(storage)

    status, out, _ = run(capsys, "sagas", "list", app, "--type", SAGA, "--completed",
                         "--prefix", "a-", "--json")

    listed = json.loads(out)
    assert status == 0 and listed["completed"] is True
    assert [item["id"] for item in listed["sagas"]] == ["a-1", "a-2"]
    assert all(item["completed"] and item["state"] == {"express": False, "reminders": 0}
               for item in listed["sagas"])


def test_show_tells_which_message_ended_a_saga_and_lists_its_messages_with_their_types(
    exposed: Expose, capsys: pytest.CaptureFixture[str],
) -> None:
    # Given one order paid and one closed (cancelled)
    storage = SharedMemoryStorage()
    orders(storage, live=0, paid=("p-1",), closed=("c-1",))
    app = exposed(storage)

    # When each is shown
    status, out, _ = run(capsys, "sagas", "show", app, SAGA, "p-1", "--json")
    paid = json.loads(out)
    _, out, _ = run(capsys, "sagas", "show", app, SAGA, "c-1", "--json")
    closed = json.loads(out)

    # Then the stories tell them apart: the message that ended each, with its type and id
    assert status == 0
    assert paid["completed"] and paid["ended_by"]["message_type"] == message_name(PayOrder)
    assert paid["ended_by"]["message_id"] == "m-pay-p-1"
    assert closed["ended_by"]["message_type"] == message_name(CloseOrder)
    # And each lists its messages oldest first, with types, times, handler and what was sent
    assert [(m["message_type"], m["outcome"]) for m in paid["messages"]] == [
        (message_name(PlaceOrder), "handled"), (message_name(PayOrder), "completed the saga")]
    assert all(m["at"] and m["handler"] == "OrderSaga" and m["sent"] for m in paid["messages"])
    assert paid["state"] == {"express": False, "reminders": 0}

    # And the text form names the ending message and the last state
    _, text, _ = run(capsys, "sagas", "show", app, SAGA, "p-1")
    assert f"completed at {paid['updated_at']} by {message_name(PayOrder)} m-pay-p-1" in text
    assert 'last state: {"express": false, "reminders": 0}' in text
    assert "<- completed the saga" in text and message_name(PlaceOrder) in text


def test_show_of_a_live_saga_gives_its_state_and_no_ending(
    exposed: Expose, capsys: pytest.CaptureFixture[str],
) -> None:
    storage = SharedMemoryStorage()
    orders(storage, live=1)

    status, text, _ = run(capsys, "sagas", "show", exposed(storage), SAGA, "o-00")

    assert status == 0
    assert "OrderProcess o-00: live" in text
    assert 'state: {"express": false, "reminders": 0}' in text
    assert "completed" not in text


@pytest.mark.parametrize(("argv", "says"), [
    (("show", SAGA, "nobody"), "keeps no OrderProcess 'nobody'"),
    (("show", "Invoice", "i-1"), "keeps no aggregate type 'Invoice'; its types: OrderProcess"),
    (("list", "--type", "Invoice"), "keeps no aggregate type 'Invoice'"),
    (("list", "--type", SAGA, "--limit", "0"), "--limit must be between 1 and 1000"),
], ids=["unknown-id", "unknown-type-show", "unknown-type-list", "bad-limit"])
def test_what_cannot_be_shown_exits_2_saying_why(
    exposed: Expose, capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], says: str,
) -> None:
    app = exposed(SharedMemoryStorage())
    action, *rest = argv

    status, _, err = run(capsys, "sagas", action, app, *rest)

    assert status == 2
    assert says in err


def test_a_process_local_storage_is_refused_not_shown_as_empty(
    exposed: Expose, capsys: pytest.CaptureFixture[str],
) -> None:
    status, out, err = run(capsys, "sagas", "list", exposed(MemoryStorage()), "--type", SAGA)

    assert status == 2 and out == ""
    assert "process-local" in err and "sagas" in err


class Unmigrated(SharedMemoryStorage):
    """A storage whose tables were never created, as PostgreSQL answers then."""

    def history(self, aggregate_type: str, aggregate_id: str, *,
                entries: int = 200) -> AggregateRecord:
        raise SchemaMissing('relation "idembus_aggregates" does not exist (SQLSTATE 42P01)')

    def aggregate_page(self, aggregate_type: str, **options: Any) -> list[AggregateRecord]:
        raise SchemaMissing('relation "idembus_aggregates" does not exist (SQLSTATE 42P01)')


@pytest.mark.parametrize("argv", [("show", SAGA, "o-1"), ("list", "--type", SAGA)],
                         ids=["show", "list"])
def test_a_storage_without_its_schema_exits_2_saying_to_migrate(
    exposed: Expose, capsys: pytest.CaptureFixture[str], argv: tuple[str, ...],
) -> None:
    app = exposed(Unmigrated())
    action, *rest = argv

    status, _, err = run(capsys, "sagas", action, app, *rest)

    assert status == 2
    assert "does not exist" in err and f"run `idembus migrate {app}`" in err
