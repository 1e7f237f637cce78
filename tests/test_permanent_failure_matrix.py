"""The permanent-failure matrix with the real drivers, on every transport (memory://,
RabbitMQ, Redis) and every storage (memory, mongomock, PostgreSQL): each refusal a broker or
a database makes for good is applied once, parked or dead-lettered with its reason — never
retried forever, never lost — and the endpoint goes on with the next message.

Which refusal happens depends on the pair: a reply to a queue nobody declared is refused by
every transport, a routing key over 255 bytes only by AMQP (elsewhere it is simply a queue
nobody declared), a NUL character and an unindexable key only by PostgreSQL (the other
storages keep them, and the deposit is applied).
"""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from idembus import Endpoint, RetryPolicy
from idembus import headers as h
from idembus.envelope import Envelope
from idembus.messages import message_name
from idembus.runtime.recoverability.policy import Recoverability
from idembus.storage.memory import MemoryStorage
from idembus.storage.mongo import MongoStorage
from idembus.testing import wait_until_idle
from tests.conftest import POSTGRES_URL, require_service
from tests.hostile import Ping, Pinger
from tests.support import Account, AccountHandler, Deposit, SignalCounter

NO_RETRIES = RetryPolicy(immediate_retries=0, delayed=())


@pytest.fixture(params=["memory", "mongomock", pytest.param("postgres",
                                                            marks=pytest.mark.postgres)])
def storage(request: pytest.FixtureRequest) -> Iterator[Any]:
    kind: str = request.param
    if kind == "memory":
        yield MemoryStorage()
    elif kind == "mongomock":
        yield MongoStorage.embedded(f"matrix-{uuid.uuid4().hex}")
    else:
        require_service(POSTGRES_URL, "PostgreSQL")
        from idembus.storage.postgres import PostgresStorage

        postgres = PostgresStorage(POSTGRES_URL, table_prefix=f"m{uuid.uuid4().hex[:12]}")
        postgres.verify()
        yield postgres
        postgres.drop_tables()
        postgres.close()


def raw(endpoint: Endpoint, message: Any, **headers: str) -> str:
    """Send ``message`` to ``endpoint`` with extra headers, as a foreign client would."""
    message_id = str(uuid.uuid4())
    endpoint.transport.send(Envelope(
        {h.MESSAGE_ID: message_id, h.MESSAGE_TYPE: message_name(type(message)), **headers},
        message.model_dump_json(), destination=endpoint.name))
    return message_id


def test_each_refusal_is_applied_parked_or_dead_lettered_and_the_endpoint_goes_on(
    make_endpoint: Callable[..., Endpoint], storage: Any, transport_url: str,
) -> None:
    # Given an endpoint that replies to pings and applies deposits, on the pair at hand
    endpoint = make_endpoint("matrix", handlers=[Pinger, AccountHandler], storage=storage,
                             recoverability=Recoverability(retries=NO_RETRIES))
    handled = SignalCounter(endpoint, "handled")
    dead = SignalCounter(endpoint, "dead_lettered")
    endpoint.start()
    is_postgres = type(storage).__name__ == "PostgresStorage"

    # When messages arrive that the broker or the database refuses for good, then a good one
    unknown_reply = raw(endpoint, Ping(note="unknown"), **{h.REPLY_TO: "nobody-declared-this"})
    long_reply = raw(endpoint, Ping(note="long"), **{h.REPLY_TO: "r" * 300})
    nul = Deposit(account="nul\x00inside", amount=1)
    long_key = Deposit(account=secrets.token_hex(3200), amount=1)  # 6,400 bytes
    nul_id, long_key_id = raw(endpoint, nul), raw(endpoint, long_key)
    raw(endpoint, Deposit(account="good", amount=7))

    # Then every message was dealt with: handled (four; the two deposits the database
    # refuses are dead-lettered instead on PostgreSQL), and the endpoint went on
    refused = 2 if is_postgres else 0
    assert handled.wait_for(5 - refused, timeout=30)
    assert dead.wait_for(refused, timeout=30)
    wait_until_idle([endpoint])
    endpoint.stop()
    assert Account.model_validate(storage.load("Account", "good").state).balance == 7
    # And the replies nobody can receive are parked with the broker's reason
    parked = {p.envelope.headers.get(h.CAUSATION_ID): p
              for p in storage.parked_messages(endpoint.name)}
    assert set(parked) == {unknown_reply, long_reply}
    assert all(p.envelope.headers[h.EXCEPTION_MESSAGE] for p in parked.values())
    # And the deposits are applied once, or in the error queue with the database's reason
    copies = {}
    while (copy := endpoint.transport.get(endpoint.error_queue)) is not None:
        copies[copy.headers[h.MESSAGE_ID]] = copy
    if is_postgres:
        assert set(copies) == {nul_id, long_key_id}
        assert "StorageRefused" in copies[nul_id].headers[h.EXCEPTION_TYPE]
        assert "54000" in copies[long_key_id].headers[h.EXCEPTION_MESSAGE]
    else:
        assert copies == {}
        for deposit in (nul, long_key):
            state = storage.load("Account", deposit.account).state
            assert Account.model_validate(state).balance == 1
    # And nothing waits in the endpoint's queue
    assert endpoint.transport.pending(endpoint.name) == 0
