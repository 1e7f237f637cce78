"""The records PostgreSQL's load rows make (idembus.storage.postgres): built without the
frozen dataclasses' ``__init__``, they are the very records it would build, every field
set, and compare, copy and replace as such."""

from __future__ import annotations

import dataclasses
import datetime

import pytest

from idembus.envelope import Envelope
from idembus.storage.base import INBOX, AggregateRecord, ProcessedMessage
from idembus.storage.postgres import _entry, _record

AT = datetime.datetime(2026, 1, 2, tzinfo=datetime.timezone.utc)


def envelope() -> Envelope:
    return Envelope(headers={"idembus.message_id": "e-1", "idembus.message_type": "E"},
                    body="{}", destination="q")


def test_a_loaded_entry_is_the_dataclass_built_one():
    record = envelope().to_record()
    for outgoing, ids, dispatched in (([record], ["e-1"], False), (None, ["e-1"], True),
                                      ([], [], True), (None, None, True)):
        built = _entry("k", outgoing, ids, dispatched, AT, "T")
        expected = ProcessedMessage(
            key="k", outgoing=tuple(Envelope.from_record(item) for item in outgoing or ()),
            outgoing_ids=tuple(ids or ()), dispatched=dispatched, at=AT, message_type="T")
        assert built == expected
        assert vars(built) == vars(expected)  # every field, stored_bytes and attempts too
        assert dataclasses.replace(built, attempts=2).attempts == 2


def test_a_loaded_record_is_the_dataclass_built_one():
    row = (3, '[{"n": 1}, ["e-1"]]', 2, "k", None, True, AT, False, "T")
    built = _record("Order", "o-1", row)
    expected = AggregateRecord("Order", "o-1", 3, {"n": 1}, {"k": _entry(
        "k", None, ["e-1"], True, AT, "T")}, state_version=2)
    assert built == expected and vars(built) == vars(expected)
    assert built.live and built.processed["k"].outgoing == ()
    assert vars(_record("Order", "o-2", None)) == vars(AggregateRecord("Order", "o-2"))
    none_found = _record("Order", "o-1", (3, '[{"n": 1}, null]', None, None, None, None,
                                          None, False, None))
    assert vars(none_found) == vars(AggregateRecord("Order", "o-1", 3, {"n": 1}))


def test_a_tombstone_keeps_its_last_state_as_before():
    built = _record("Order", "o-1", (4, '[{"n": 2}, null]', None, None, None, None, None,
                                     True, None))
    assert built.completed and built.state is None and built.final_state == {"n": 2}


@pytest.mark.postgres
def test_outgoing_loads_until_compacted_then_none_for_every_load(postgres_storage):
    """A duplicate whose outgoing messages were not dispatched finds them (same ids) in
    a single load and in a group of loads; once marked and compacted, none."""
    postgres = postgres_storage
    sent = envelope()
    for aggregate_type, aggregate_id in (("Order", "o-1"), (INBOX, "m-1")):
        loaded = postgres.load(aggregate_type, aggregate_id, "m-1")
        postgres.commit(loaded, key="m-1", state={"n": 1} if aggregate_type != INBOX
                        else None, outgoing=[sent])
    requests = [("Order", "o-1", "m-1"), (INBOX, "m-1", "m-1"), ("Order", "o-2", "m-2")]

    def entries() -> list[ProcessedMessage | None]:
        single = [postgres.load(*request).processed.get(request[2]) for request in requests]
        grouped = [record.processed.get(request[2])  # type: ignore[union-attr]
                   for record, request in zip(postgres.load_many(requests), requests,
                                              strict=True)]
        assert single == grouped
        aggregates_only = [requests[0], requests[2]]  # one statement, outside a pipeline
        assert [record.processed.get(request[2]) for record, request in zip(  # type: ignore[union-attr]
            postgres.load_many(aggregates_only), aggregates_only, strict=True)] == [
            single[0], single[2]]
        return single

    pending = entries()
    assert [entry.outgoing_ids for entry in pending[:2]] == [("e-1",), ("e-1",)]
    assert all(entry.outgoing[0].message_id == "e-1" and not entry.dispatched
               for entry in pending[:2])
    assert pending[2] is None
    assert postgres.load("Order", "o-1", "m-1").state == {"n": 1}
    assert postgres.load_many([requests[0], requests[0]])[0].state == {"n": 1}  # type: ignore[union-attr]
    assert all(entry.at.utcoffset() == datetime.timedelta(0) for entry in pending[:2])
    postgres.mark_dispatched("Order", "o-1", "m-1")
    postgres.mark_dispatched(INBOX, "m-1", "m-1")
    postgres.flush()
    compacted = entries()
    assert all(entry.outgoing == () and entry.dispatched
               and entry.outgoing_ids == ("e-1",) for entry in compacted[:2])
