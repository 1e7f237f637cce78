"""bus.request where the broker cannot tie a reply queue to the requester's connection
(Redis, the PostgreSQL and MongoDB queues): the reply queue of a requester killed while it
waits, and the replies that came for it, are gone one lease later, swept by a live process;
a live requester's queue is untouched."""

from __future__ import annotations

import contextlib
import signal
import textwrap
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from idembus import headers as h
from idembus.envelope import Envelope
from idembus.transports.errors import DestinationRefused
from idembus.transports.kombu import REDIS_QUEUES, KombuTransport
from idembus.transports.kombu_replies import LEASED_QUEUES
from idembus.transports.mongo import MongoTransport
from idembus.transports.postgres import PostgresTransport
from tests.conftest import MONGODB_URL, POSTGRES_URL, REDIS_URL
from tests.support import eventually
from tests.test_requests import GetQuote, Quote, Quotes, requester_process

pytestmark = pytest.mark.parametrize(
    "transport_url", [
        pytest.param(REDIS_URL, id="redis", marks=pytest.mark.redis),
        pytest.param(POSTGRES_URL, id="postgresql-transport", marks=pytest.mark.postgres),
        pytest.param(MONGODB_URL or "mongodb://", id="mongodb-transport",
                     marks=pytest.mark.mongodb),
        pytest.param("mongomock://", id="mongomock-transport"),
    ], indirect=True)

#: The lease of the requester that is killed, in seconds.
LEASE = 3.0

_REQUESTER = textwrap.dedent("""
    import sys
    from idembus import Endpoint
    from tests.test_requests import GetQuote

    url, where, destination, lease = sys.argv[1:5]
    if url.startswith("redis"):
        from idembus.transports.kombu import KombuTransport
        transport = KombuTransport(url, exchange=where, reply_lease=float(lease))
    elif url.startswith("postgresql"):
        from idembus.transports.postgres import PostgresTransport
        transport = PostgresTransport(url, table_prefix=where, reply_lease=float(lease))
    else:
        from idembus.transports.mongo import MongoTransport
        transport = MongoTransport(url, database=where, reply_lease=float(lease))
    asker = Endpoint("asker", transport=transport, send_only=True,
                     routes={GetQuote: destination})
    print(asker._assembly.requests.reply_queue(), flush=True)
    asker.bus.request(GetQuote(item="tea"), timeout=120)
""")


def where(transport: Any) -> str:
    """What the requester process needs to reach ``transport``'s queues."""
    if isinstance(transport, KombuTransport):
        return transport.exchange_name
    if isinstance(transport, PostgresTransport):
        return transport.schema.prefix
    return str(transport.database.name)


def declared(transport: Any, queue: str) -> bool:
    """Whether ``queue`` is declared, or anything of it is left, on ``transport``."""
    if isinstance(transport, KombuTransport):
        with transport._channel() as channel:
            client = channel.client
            return bool(client.sismember(REDIS_QUEUES, queue)
                        or client.sismember(LEASED_QUEUES, queue)
                        or client.exists(f"_idembus.reply_lease.{queue}"))
    if isinstance(transport, PostgresTransport):
        with transport._connection("looking up a queue") as connection:
            return connection.execute(f"SELECT 1 FROM {transport.schema.queues} WHERE name = %s",
                                      (queue,)).fetchone() is not None
    assert isinstance(transport, MongoTransport)
    return transport.queues.find_one({"_id": queue}) is not None


def held(transport: Any, queue: str) -> int:
    """How many messages ``queue`` holds, however they are kept (on Redis: its lists, in
    every priority step)."""
    if isinstance(transport, KombuTransport):
        with transport._channel() as channel:
            return sum(channel.client.llen(channel._q_for_pri(queue, step))
                       for step in channel.priority_steps)
    if isinstance(transport, PostgresTransport):
        with transport._connection("counting messages") as connection:
            row = connection.execute(
                f"SELECT count(*) FROM {transport.schema.messages} WHERE queue = %s",
                (queue,)).fetchone()
            return int(row[0]) if row else 0
    assert isinstance(transport, MongoTransport)
    return int(transport.messages.count_documents({"queue": queue}))


def late_reply(queue: str) -> Envelope:
    """A reply to a request of the requester consuming ``queue``."""
    request = str(uuid.uuid4())
    return Envelope(headers={
        h.MESSAGE_ID: str(uuid.uuid4()), h.MESSAGE_TYPE: "requests.Quote",
        h.INTENT: h.Intent.REPLY.value, h.CORRELATION_ID: request, h.AWAITED: "1"},
        body='{"item": "tea", "price": 7}', destination=queue)


@contextlib.contextmanager
def dead_requester(make_transport: Callable[..., Any], transport_url: str,
                   destination: str) -> Iterator[str]:
    """Start a requester waiting for a reply to a request sent to ``destination``, kill it
    (SIGKILL), and yield its reply queue. On PostgreSQL, the queue's lock is held here
    until the block ends, so that no sweep deletes it meanwhile (the server noticing the
    killed session later). On mongomock, whose collections live in this process, what a
    killed process leaves: the queue and its lease, never renewed."""
    responder = make_transport()
    if transport_url.startswith("mongomock"):
        ghost = make_transport(reply_lease=LEASE)
        queue = f"asker.replies.{uuid.uuid4().hex}"
        ghost.declare(queue)
        ghost.renew_reply_queue(queue)
        yield queue
        return
    with contextlib.ExitStack() as stack:
        requester, queue = stack.enter_context(requester_process(
            _REQUESTER, transport_url, where(responder), destination, str(LEASE)))
        assert eventually(lambda: responder.pending(destination) == 1, 60), "no request came"
        if isinstance(responder, PostgresTransport):
            holder = stack.enter_context(psycopg.connect(transport_url, autocommit=True))
            taken = threading.Thread(target=holder.execute, args=(
                "SELECT pg_advisory_lock(hashtextextended(%s, 0))", (queue,)), daemon=True)
            taken.start()  # granted once the requester's session is gone
        requester.send_signal(signal.SIGKILL)
        requester.wait(30)
        if isinstance(responder, PostgresTransport):
            taken.join(30)
            assert not taken.is_alive()
        yield queue


@pytest.mark.timeout(180)
def test_the_reply_queue_of_a_killed_requester_and_its_late_reply_go_within_a_lease(
        make_endpoint, make_transport, transport_url):
    # Given a live requester (its lease short: it sweeps every third of it), whose reply
    # queue is open:
    responder = make_transport()
    pricing = make_endpoint("pricing", handlers=[Quotes()])  # started at the end
    responder.declare(pricing.name)
    shop = make_endpoint("shop", routes={GetQuote: pricing.name},
                         transport=make_transport(reply_lease=1.0))
    live = shop._assembly.requests.reply_queue()
    # And a requester killed (SIGKILL) while it waits for a reply, which arrives afterwards:
    with dead_requester(make_transport, transport_url, pricing.name) as dead:
        assert declared(responder, dead)
        responder.send(late_reply(dead))
        assert held(responder, dead) == 1
    # Then, within the dead requester's lease (and a turn of the sweeps), its queue and
    # the reply in it are gone:
    assert eventually(lambda: not declared(responder, dead), LEASE + 15), "the queue stayed"
    assert held(responder, dead) == 0
    # And the live requester's queue, kept past that lease, still gets its replies ...
    assert declared(responder, live)
    pricing.start()
    assert shop.bus.request(GetQuote(item="tea"), timeout=30) == Quote(item="tea", price=7)
    # ... while the answer to the dead requester's request, sent after the sweep, left
    # nothing behind.
    assert eventually(lambda: pricing.is_idle(), 30)
    assert not declared(responder, dead) and held(responder, dead) == 0
    assert declared(responder, live)


@pytest.mark.timeout(60)
def test_closing_the_endpoint_deletes_its_reply_queue_and_its_lease(make_endpoint,
                                                                     make_transport):
    pricing = make_endpoint("pricing", handlers=[Quotes()])
    pricing.start()
    shop = make_endpoint("shop", routes={GetQuote: pricing.name},
                         transport=make_transport(reply_lease=1.0))
    assert shop.bus.request(GetQuote(item="tea"), timeout=30) == Quote(item="tea", price=7)
    queue = shop._assembly.requests.queue
    assert declared(pricing.transport, queue)
    shop.close()
    assert not declared(pricing.transport, queue)


def test_starting_an_endpoint_sweeps_the_expired_reply_queues(make_endpoint, make_transport,
                                                               transport_url):
    if transport_url.startswith(("postgresql", "mongodb")) and "mock" not in transport_url:
        pytest.skip("the sweep at start is the same call; the killed requester test covers "
                    "these transports")
    ghost = make_transport(reply_lease=0.2)
    queue = f"gone.replies.{uuid.uuid4().hex}"
    ghost.declare(queue)
    ghost.renew_reply_queue(queue)
    ghost.send(late_reply(queue))
    time.sleep(0.3)  # the lease runs out: there is nothing to wait for but the clock
    # When an endpoint starts, that requests nothing:
    make_endpoint("bystander", handlers=[Quotes()]).start()
    # Then the expired queue is gone, with its reply.
    assert not declared(ghost, queue)
    assert held(ghost, queue) == 0


def test_a_reply_lease_that_is_not_positive_is_refused(make_transport, transport_url):
    from idembus.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="reply_lease"):
        make_transport(reply_lease=0)


def test_a_reply_sent_after_the_sweep_is_refused_and_leaves_nothing(make_transport):
    # Given a reply queue whose requester is gone, to which a responder sent a reply while
    # it was there (so the responder knows the queue):
    ghost = make_transport(reply_lease=0.2)
    responder = make_transport()
    queue = f"gone.replies.{uuid.uuid4().hex}"
    ghost.declare(queue)
    ghost.renew_reply_queue(queue)
    responder.send(late_reply(queue))
    time.sleep(0.3)  # the lease runs out: there is nothing to wait for but the clock
    assert queue in ghost.sweep_reply_queues()
    # When the responder sends it another reply, it is refused (the responder drops it),
    # and nothing of the queue is left.
    with pytest.raises(DestinationRefused):
        responder.send(late_reply(queue))
    assert not declared(responder, queue)
    assert held(responder, queue) == 0
