"""bus.request where the queues are in a database: the reply queue is an ordinary queue
of the transport's tables, deleted when the endpoint closes."""

from __future__ import annotations

import signal
import textwrap
import uuid

import pytest

from idembus import RequestTimeout
from idembus.transports.mongo import MongoTransport
from idembus.transports.postgres import PostgresTransport
from tests.conftest import POSTGRES_URL
from tests.test_requests import (
    NO_RETRIES,
    GetQuote,
    Quote,
    Quotes,
    Silent,
    requester_process,
)

pytestmark = pytest.mark.parametrize(
    "transport_url", [pytest.param(POSTGRES_URL, id="postgresql-transport",
                                   marks=pytest.mark.postgres),
                      pytest.param("mongomock://", id="mongomock-transport")],
    indirect=True)


def test_a_request_through_database_queues_gets_its_reply_and_the_stored_one_again(
        make_endpoint, make_transport):
    quotes = Quotes()
    pricing = make_endpoint("pricing", handlers=[quotes], recoverability=NO_RETRIES)
    shop = make_endpoint("shop", routes={GetQuote: pricing.name})
    pricing.start()
    request_id = str(uuid.uuid4())
    first = shop.bus.request(GetQuote(item="tea"), timeout=20, message_id=request_id)
    again = shop.bus.request(GetQuote(item="tea"), timeout=20, message_id=request_id)
    assert first == again == Quote(item="tea", price=7)
    assert quotes.runs == {request_id: 1}


def test_closing_the_endpoint_deletes_its_reply_queue_from_the_tables(make_endpoint):
    pricing = make_endpoint("pricing", handlers=[Quotes()])
    shop = make_endpoint("shop", routes={GetQuote: pricing.name})
    pricing.start()
    shop.bus.request(GetQuote(item="tea"), timeout=20)
    queue = shop._assembly.requests.queue
    assert _declared(pricing.transport, queue)
    shop.close()
    assert not _declared(pricing.transport, queue)


def _declared(transport: object, queue: str) -> bool:
    """Whether the database queue ``queue`` is recorded in the transport's tables."""
    if isinstance(transport, PostgresTransport):
        with transport._connection("looking up a queue") as connection:
            return connection.execute(f"SELECT 1 FROM {transport.schema.queues} WHERE name = %s",
                                      (queue,)).fetchone() is not None
    assert isinstance(transport, MongoTransport)
    return transport.queues.find_one({"_id": queue}) is not None


_REQUESTER = textwrap.dedent("""
    import sys
    from idembus import Endpoint
    from idembus.transports.postgres import PostgresTransport
    from tests.test_requests import GetQuote

    url, prefix, destination = sys.argv[1:4]
    asker = Endpoint("asker", transport=PostgresTransport(url, table_prefix=prefix),
                     send_only=True, routes={GetQuote: destination})
    print(asker._assembly.requests.reply_queue(), flush=True)
    asker.bus.request(GetQuote(item="tea"), timeout=120)
""")


@pytest.mark.timeout(120)
def test_the_reply_queue_of_a_killed_requester_is_deleted_by_the_next_one_opened(
        make_endpoint, make_transport, transport_url):
    if not isinstance(make_transport(), PostgresTransport):
        pytest.skip("MongoDB's queues have no session to tie a reply queue to")
    # Given a requester process that dies (SIGKILL) while it waits:
    silent = make_endpoint("silent", handlers=[Silent()])
    silent.start()
    with requester_process(_REQUESTER, transport_url, silent.transport.schema.prefix,
                           silent.name) as (requester, dead):
        assert _declared(silent.transport, dead)
        requester.send_signal(signal.SIGKILL)
        requester.wait(30)
    # When another process opens its reply queue (a request of this one):
    shop = make_endpoint("shop", routes={GetQuote: silent.name})
    with pytest.raises(RequestTimeout):
        shop.bus.request(GetQuote(item="tea"), timeout=0.5)
    # Then the dead requester's queue is gone, and the live one stays.
    assert not _declared(silent.transport, dead)
    assert _declared(silent.transport, shop._assembly.requests.queue)


@pytest.mark.postgres
def test_in_one_transaction_with_postgresql_storage_a_request_sent_again_gets_its_reply(
        make_endpoint, make_transport, postgres_storage):
    if not isinstance(make_transport(), PostgresTransport):
        pytest.skip("the shared transaction needs the PostgreSQL queues")
    quotes = Quotes()
    pricing = make_endpoint("pricing", handlers=[quotes], storage=postgres_storage)
    assert pricing.shared_transaction is not None
    shop = make_endpoint("shop", routes={GetQuote: pricing.name})
    pricing.start()
    request_id = str(uuid.uuid4())
    first = shop.bus.request(GetQuote(item="tea"), timeout=20, message_id=request_id)
    again = shop.bus.request(GetQuote(item="tea"), timeout=20, message_id=request_id)
    assert first == again == Quote(item="tea", price=7)
    assert quotes.runs == {request_id: 1}
