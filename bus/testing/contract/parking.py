"""The contract of :class:`~idembus.storage.base.ParkingStore`: a parked message comes back
exactly as it was parked, whatever bytes it carries."""

from __future__ import annotations

import datetime
from typing import ClassVar

from ... import headers as h
from ...envelope import Envelope
from ...storage.base import (
    PARKED_FROM_ERROR_QUEUE,
    PARKED_OUTGOING,
    ParkedMessage,
    ParkingStore,
    StorageRole,
)
from .base import RoleContract, StorageFactory

UTC = datetime.timezone.utc


def parked(parked_id: str, *, endpoint: str = "sales", minute: int = 0,
           body: bytes = b'{"n": 1}') -> ParkedMessage:
    envelope = Envelope(
        headers={h.MESSAGE_ID: f"id-{parked_id}", h.MESSAGE_TYPE: "test.Deposit",
                 h.EXCEPTION_MESSAGE: "NOT_FOUND - no queue 'x'", "odd.$key": "a\x00b\udcff"},
        body=body.decode("utf-8", "surrogateescape"), destination="sales-queue",
        content_type="application/octet-stream")
    return ParkedMessage(parked_id, endpoint, PARKED_FROM_ERROR_QUEUE, envelope,
                         datetime.datetime(2031, 1, 1, 12, minute, tzinfo=UTC))


class ParkingStoreContract(RoleContract):
    """Parked messages are kept byte for byte, once each, per endpoint, until unparked."""

    roles: ClassVar[tuple[type[StorageRole], ...]] = (ParkingStore,)

    def test_a_parked_message_comes_back_byte_for_byte(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        hostile = parked("p1", body=b"\x00\xff\xfe{not json\x80")

        storage.park(hostile)

        [found] = storage.parked_messages("sales")
        assert found == hostile
        body = found.envelope.body.encode("utf-8", "surrogateescape")
        assert body == b"\x00\xff\xfe{not json\x80"

    def test_parked_messages_are_listed_per_endpoint_oldest_first_and_parked_once(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        storage.park(parked("p2", minute=2))
        storage.park(parked("p1", minute=1))
        storage.park(parked("p1", minute=5))  # the same parked message again: kept once
        storage.park(parked("other", endpoint="billing"))
        outbox = ParkedMessage("p3", "sales", PARKED_OUTGOING, parked("x").envelope,
                               datetime.datetime(2031, 1, 1, 12, 3, tzinfo=UTC))
        storage.park(outbox)

        assert [p.parked_id for p in storage.parked_messages("sales")] == ["p1", "p2", "p3"]
        assert storage.parked_messages("sales")[2].source == PARKED_OUTGOING
        assert [p.parked_id for p in storage.parked_messages("billing")] == ["other"]

    def test_unparking_removes_only_what_is_named(self, storage_factory: StorageFactory) -> None:
        storage = storage_factory()
        storage.park(parked("p1"))
        storage.park(parked("p2", minute=1))

        assert storage.unpark(["p1", "never-parked"]) == 1

        assert [p.parked_id for p in storage.parked_messages("sales")] == ["p2"]
        assert storage.unpark(["p1"]) == 0

    def test_parked_messages_are_read_a_page_at_a_time_in_order_and_looked_up_by_id(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        for number in range(7):  # two share a minute: their ids decide
            storage.park(parked(f"p{number}", minute=number // 2 * 2))
        storage.park(parked("other", endpoint="billing", minute=3))

        pages, after = [], None
        while page := storage.parked_page("sales", after=after, limit=3):
            pages.append([p.parked_id for p in page])
            after = (page[-1].parked_at, page[-1].parked_id)

        assert pages == [["p0", "p1", "p2"], ["p3", "p4", "p5"], ["p6"]]
        assert [p.parked_id for p in storage.parked_by_ids("sales", ["p4", "gone", "p1",
                                                                     "other"])] == ["p1", "p4"]
        assert storage.parked_by_ids("sales", ["p4"]) == [parked("p4", minute=4)]
        if type(storage).parked_page is not ParkingStore.parked_page:  # every endpoint's
            everyone = storage.parked_page(None, limit=100)
            assert [p.parked_id for p in everyone] == ["p0", "p1", "p2", "p3", "other", "p4",
                                                       "p5", "p6"]
