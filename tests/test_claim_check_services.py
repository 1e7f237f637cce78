"""The claim check on the services: a 50 MB body through RabbitMQ with PostgreSQL storage
and a crash between commit and publish, and the database queues (PostgreSQL, where the
shared transaction hands claim-checked messages to the dispatcher, and mongomock), each
with the bodies kept in the endpoints' own storage."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import mongomock
import pytest

from idembus import ClaimCheck, Endpoint, MongoStorage
from idembus import headers as h
from idembus.storage.postgres import PostgresStorage
from idembus.testing import wait_until_idle
from tests.conftest import AMQP_URL, POSTGRES_URL, require_service
from tests.test_claim_check import Blobs, StoreBlob, Upload, Uploads, Watched, WireHeaders

MakeEndpoint = Callable[..., Endpoint]
FIFTY_MB = 50 * 1024 * 1024


@pytest.fixture
def postgres_storage(unique: str) -> Iterator[Callable[[], PostgresStorage]]:
    """New storages on one set of tables (each endpoint closes its own), dropped after."""
    require_service(POSTGRES_URL, "PostgreSQL")

    def make() -> PostgresStorage:
        storage = PostgresStorage(POSTGRES_URL, table_prefix=f"c{unique}")
        storage.verify()
        return storage

    yield make
    cleaner = PostgresStorage(POSTGRES_URL, table_prefix=f"c{unique}")
    cleaner.drop_tables()
    cleaner.close()


@pytest.mark.amqp
@pytest.mark.postgres
@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport_url", [pytest.param(AMQP_URL, id="amqp")], indirect=True)
def test_50_mb_through_rabbitmq_with_a_crash_between_commit_and_publish(
    make_endpoint: MakeEndpoint, postgres_storage: Callable[[], PostgresStorage],
) -> None:
    # Given two endpoints on RabbitMQ and one PostgreSQL database, the sender's process
    # dying right after it wrote the claim-checked body, before publishing the reference
    payloads = postgres_storage()
    watched = Watched(payloads, crash_after_first_write=True)
    blobs, wire = Blobs(), WireHeaders()
    receiver = make_endpoint("blobs", handlers=[blobs], middleware=[wire],
                             storage=postgres_storage())
    uploads = make_endpoint("uploads", handlers=[Uploads], storage=postgres_storage(),
                            routes={StoreBlob: receiver.name},
                            claim_check=ClaimCheck(threshold_bytes=1024 * 1024, store=watched))
    started = time.perf_counter()
    with uploads, receiver:
        # When a handler sends a 50 MB body
        uploads.bus.send(Upload(name="fifty", size=FIFTY_MB))
        wait_until_idle([uploads, receiver], timeout=500)
    seconds = time.perf_counter() - started

    # Then the body arrived whole, once, through the reference written again after the crash
    assert blobs.received == [("fifty", FIFTY_MB, True)], seconds
    [headers] = wire.seen
    reference = headers[h.CLAIM_CHECK]
    assert watched.writes == [reference, reference]
    assert uploads.counters["duplicate"] == 1
    assert receiver.counters["handled"] == 1 and receiver.counters["dead_lettered"] == 0
    stored = payloads.get_payload(reference)
    assert stored is not None and str(len(stored)) == headers[h.CLAIM_CHECK_BYTES]
    assert len(stored) > FIFTY_MB
    payloads.close()


@pytest.mark.parametrize(
    "transport_url", [pytest.param(POSTGRES_URL, id="postgresql-transport",
                                   marks=pytest.mark.postgres),
                      pytest.param("mongomock://", id="mongomock-transport")],
    indirect=True)
@pytest.mark.parametrize("apart", ["body", "field"])
def test_a_claim_checked_message_through_the_database_queues(
    make_endpoint: MakeEndpoint, transport_url: str, unique: str,
    request: pytest.FixtureRequest, apart: str,
) -> None:
    # Given two endpoints on a database queue, with the bodies in their shared storage
    if transport_url.startswith("postgres"):
        storage: Callable[[], Any] = request.getfixturevalue("postgres_storage")
    else:
        client: Any = mongomock.MongoClient()

        def storage() -> Any:
            return MongoStorage(client, database=f"claims-{unique}")
    blobs, wire = Blobs(), WireHeaders()
    receiver = make_endpoint("blobs", handlers=[blobs], middleware=[wire], storage=storage())
    uploads = make_endpoint("uploads", handlers=[Uploads], storage=storage(),
                            routes={StoreBlob: receiver.name},
                            claim_check=ClaimCheck(
                                threshold_bytes=64 * 1024,
                                fields={StoreBlob: ["data"]} if apart == "field" else {}))
    if transport_url.startswith("postgres"):  # commit and send share one transaction...
        assert uploads.shared_transaction is not None
    with uploads, receiver:
        # When a handler sends a large body and a small one
        uploads.bus.send(Upload(name="large", size=2 * 1024 * 1024))
        uploads.bus.send(Upload(name="small", size=10))
        wait_until_idle([uploads, receiver])

    # Then both arrived whole, the large one as a reference resolved from the storage
    # (...but the claim-checked one is committed apart and sent by the dispatcher)
    assert sorted(blobs.received) == [("large", 2 * 1024 * 1024, True), ("small", 10, True)]
    header = h.CLAIM_CHECK if apart == "body" else h.CLAIM_CHECK_FIELDS
    claimed = [headers for headers in wire.seen if h.CLAIM_CHECK in headers
               or h.CLAIM_CHECK_FIELDS in headers]
    assert len(claimed) == 1 and header in claimed[0]
    reference = (claimed[0][h.CLAIM_CHECK] if apart == "body"
                 else json.loads(claimed[0][h.CLAIM_CHECK_FIELDS])["data"]["id"])
    reader = storage()
    assert reader.get_payload(reference) is not None
    reader.close()
