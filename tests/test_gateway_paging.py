"""Full replication pages through the aggregates on every storage: ``records`` reads
``records_page`` of them at a time (a keyset on the id), never the whole type at once, and
the gateway's stream streams them page by page."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import httpx

from idembus import Endpoint
from idembus.gateway import Gateway
from tests.sse_client import events, take
from tests.support import Account, AccountHandler

ACCOUNT = AccountHandler.storage_name()


def commit(storage: Any, aggregate_id: str, balance: int) -> None:
    loaded = storage.load(ACCOUNT, aggregate_id, "k")
    storage.commit(loaded, key=f"k{uuid.uuid4().hex}", state={"balance": balance},
                   outgoing=[])


def test_records_reads_one_page_at_a_time_in_id_order_on_every_storage(
    storage_factory: Callable[..., Any],
) -> None:
    # Given five accounts, and a storage reading two per page
    storage = storage_factory()
    storage.records_page = 2
    for n in (4, 0, 3, 1, 2):
        commit(storage, f"a{n}", n)
    storage.commit(storage.load("Other", "a2", "k"), key="k", state={}, outgoing=[])
    records = storage.records(ACCOUNT)

    # When a record is committed after the first page was read
    first = next(records)
    commit(storage, "a9", 9)

    # Then a later page has it: nothing was read ahead beyond the page in hand
    rest = list(records)
    assert [r.aggregate_id for r in [first, *rest]] == ["a0", "a1", "a2", "a3", "a4", "a9"]
    assert [dict(r.state or {})["balance"] for r in rest] == [1, 2, 3, 4, 9]
    assert all(r.updated_at is not None for r in rest)


def test_replication_of_more_aggregates_than_a_page_sends_each_state_once(
    storage_factory: Callable[..., Any],
) -> None:
    storage = storage_factory()
    storage.records_page = 7
    endpoint = Endpoint(f"paging-{uuid.uuid4().hex[:8]}", storage=storage,
                        handlers=[AccountHandler], journal=True)
    for n in range(60):
        with endpoint.unit_of_work(Account, f"acc{n:02d}") as work:
            work.state.balance = n
    gateway = Gateway(endpoint, port=0, poll_interval=0.02)
    gateway.start()
    try:
        with httpx.Client(timeout=15.0) as client, client.stream(
                "GET", gateway.url + "/",
                headers={"Accept": "text/event-stream", "Last-Event-ID": "0"}) as response:
            reset, *states, live = take(events(response), 62)
    finally:
        gateway.stop()
        endpoint.transport.close()  # the storage is the fixture's to close
    assert (reset.kind, live.kind) == ("reset", "live")
    assert [state.data["aggregate_id"] for state in states] == [f"acc{n:02d}" for n in range(60)]
    assert [state.data["state"]["balance"] for state in states] == list(range(60))
    assert gateway.status()["states_sent"] == 60
