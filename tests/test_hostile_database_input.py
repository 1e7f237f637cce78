"""A hostile client with write rights on a database transport's queue writes whatever it
likes into it — the PostgreSQL transport's table (``INSERT``), the MongoDB transport's
collection on mongomock — for a running endpoint on PostgreSQL storage.

The messages are those of the AMQP suite (``tests/hostile.py``: any headers, bodies,
content types and encodings, ids given twice), written as a database holds them: headers as
a JSON object (a name given twice stays twice in the text; bytes become what JSON can
carry), the body as bytes. What the client library or the database refuses to write (a
float JSON cannot hold, text with a NUL or a lone surrogate in a text column) never reaches
the endpoint and is left out. The invariants are the AMQP suite's: every message is applied
exactly once or is in the error queue with a reason of the kind the model expects, its body
unchanged and the headers it lost named, and the endpoint keeps processing. Reduced size in
``make test`` (``IDEMBUS_HOSTILE_EXAMPLES`` raises it).
"""

from __future__ import annotations

import datetime
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import bson
import psycopg
import pytest
from hypothesis import given
from hypothesis import strategies as st

from idembus import Endpoint, Recoverability, RetryPolicy
from idembus import headers as h
from idembus.storage.postgres import PostgresStorage
from idembus.transports.base import Delivery
from idembus.transports.postgres_schema import channel
from tests.conftest import POSTGRES_URL, require_service
from tests.hostile import (
    LIVE_ENDPOINT,
    SEQUENCE,
    Model,
    Pinger,
    WireMessage,
    assert_handled,
    is_text,
    received_value,
    wire_messages,
)
from tests.support import AccountHandler
from tests.test_workers import wait_until

pytestmark = [pytest.mark.postgres,
              pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisWarning")]


@dataclass
class Row:
    """A hostile message as the client writes it into the queue."""

    message: WireMessage
    headers: str
    body: bytes
    content_type: str | None
    content_encoding: str | None


def as_json_value(value: Any) -> Any:
    """A header value as JSON can carry it: bytes as the text they read as, or as their
    numbers; the rest as it is (a float that is not finite stays: JSON refuses it)."""
    value = received_value(value)
    if isinstance(value, bytes):
        return list(value)
    if isinstance(value, dict):
        return {str(received_value(k)): as_json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [as_json_value(item) for item in value]
    return value


def as_text(value: str | bytes | None) -> str | None:
    """A content type or encoding as a text column holds it (bytes read as UTF-8, else as
    latin-1: a database keeps no bytes there)."""
    value = received_value(value)
    return value.decode("latin-1") if isinstance(value, bytes) else value


def row_of(message: WireMessage) -> Row | None:
    """``message`` as a database client writes it, or ``None`` if no client can (JSON
    refuses a float that is not finite; a text column refuses NUL and lone surrogates)."""
    pairs = [*message.earlier, *message.headers.items(), (SEQUENCE, str(message.sequence))]
    try:
        members = [json.dumps(str(received_value(name)), ensure_ascii=True) + ":"
                   + json.dumps(as_json_value(value), ensure_ascii=True, allow_nan=False)
                   for name, value in pairs]
    except ValueError:
        return None
    content_type, content_encoding = (as_text(message.content_type),
                                      as_text(message.content_encoding))
    for text in (content_type, content_encoding):
        if text is not None and ("\x00" in text or not is_text(text)):
            return None
    # What the endpoint receives is the JSON read back: let the model judge that
    received = {str(received_value(name)): as_json_value(value) for name, value in pairs
                if name != SEQUENCE}
    judged = replace(message, headers=received, earlier=[], content_type=content_type,
                     content_encoding=content_encoding, extra={})
    return Row(judged, "{" + ",".join(members) + "}", message.body, content_type,
               content_encoding)


# -- the two queues a hostile client writes into -----------------------------------------------


class PostgresQueue:
    """Writes rows into the PostgreSQL transport's messages table."""

    def __init__(self, prefix: str) -> None:
        from idembus.transports.postgres import PostgresTransport

        self.transport: Any = PostgresTransport(POSTGRES_URL, table_prefix=prefix)

    def write(self, queue: str, row: Row) -> None:
        with psycopg.connect(POSTGRES_URL, autocommit=True) as connection:
            connection.execute(
                f"INSERT INTO {self.transport.schema.messages} "
                "(queue, headers, body, content_type, content_encoding) "
                "VALUES (%s, %s::json, %s, %s, %s)",
                (queue, row.headers, row.body, row.content_type, row.content_encoding))
            # as a writer that wants it handled at once does (else: within max_idle_wait)
            connection.execute("SELECT pg_notify(%s, '')",
                               (channel(self.transport.schema.prefix, queue),))

    def drop(self) -> None:
        self.transport.drop_tables()


class MongoQueue:
    """Inserts documents into the MongoDB transport's queue collection (mongomock)."""

    def __init__(self, prefix: str) -> None:
        import mongomock

        from idembus.transports.mongo import MongoTransport

        self.transport = MongoTransport(mongomock.MongoClient(), database=prefix)

    def write(self, queue: str, row: Row) -> None:
        now = datetime.datetime.now(datetime.timezone.utc)
        with self.transport._guard:
            self.transport.messages.insert_one({
                "_id": uuid.uuid4().hex, "queue": queue, "headers": row.headers,
                "body": row.body, "content_type": row.content_type,
                "content_encoding": row.content_encoding, "visible_at": now,
                "order": bson.ObjectId(), "leased_until": None, "lease": None,
                "deliveries": 0})

    def drop(self) -> None:
        self.transport.drop_tables()


@dataclass
class Target:
    """A running endpoint on a database transport and what was written to it so far."""

    endpoint: Endpoint
    queue: PostgresQueue | MongoQueue
    storage: PostgresStorage
    model: Model = field(default_factory=Model)
    sequence: int = 0
    sentinels: int = 0

    def accounts(self) -> dict[str, dict[str, Any]]:
        with psycopg.connect(POSTGRES_URL) as connection:
            rows = connection.execute(
                f"SELECT aggregate_id, state FROM {self.storage.table_prefix}_aggregates"
            ).fetchall()
        return {row[0]: row[1] for row in rows}

    def write(self, messages: list[WireMessage]) -> dict[int, Row]:
        """Write ``messages`` and a good sentinel deposit after them; return once the
        endpoint (one consumer, in order) has handled the sentinel."""
        written: dict[int, Row] = {}
        for message in [*messages, self._sentinel()]:
            self.sequence += 1
            message.sequence = self.sequence
            row = row_of(message)
            if row is None:
                continue  # no client can write it
            self.queue.write(self.endpoint.name, row)
            self.model.expect(row.message)
            written[message.sequence] = row
        self.sentinels += 1
        assert wait_until(lambda: self.accounts().get("sentinel", {}).get("deposits")
                          == self.sentinels, timeout=60), "the endpoint stopped processing"
        return written

    @staticmethod
    def _sentinel() -> WireMessage:
        return WireMessage(headers={h.MESSAGE_ID: str(uuid.uuid4()), h.MESSAGE_TYPE:
                                    "test.Deposit"},
                           body=json.dumps({"account": "sentinel", "amount": 1}).encode())

    def take_error_queue(self) -> dict[int, Delivery]:
        copies: dict[int, Delivery] = {}
        transport = self.endpoint.transport
        while (copy := transport.get(self.endpoint.error_queue)) is not None:
            sequence = int(copy.headers[SEQUENCE])
            assert sequence not in copies, f"message {sequence} dead-lettered twice"
            copies[sequence] = copy
        return copies


@pytest.fixture(scope="module", params=[
    pytest.param(PostgresQueue, id="postgresql-transport"),
    pytest.param(MongoQueue, id="mongomock-transport"),
])
def target(request: pytest.FixtureRequest) -> Iterator[Target]:
    require_service(POSTGRES_URL, "PostgreSQL")
    suffix = uuid.uuid4().hex[:10]
    queue = request.param(f"hq{suffix}")
    storage = PostgresStorage(POSTGRES_URL, table_prefix=f"hs{suffix}")
    endpoint = Endpoint(
        f"hostile-{suffix}", transport=queue.transport, storage=storage,
        handlers=[AccountHandler, Pinger], error_queue=f"hostile-error-{suffix}",
        recoverability=Recoverability(retries=RetryPolicy(immediate_retries=1, delayed=())),
        prefetch=8)
    endpoint.start()
    running = Target(endpoint, queue, storage)
    try:
        yield running
    finally:
        endpoint.close()
        dropper = PostgresStorage(POSTGRES_URL, table_prefix=f"hs{suffix}")
        dropper.drop_tables()
        dropper.close()
        queue.drop()


def check(target: Target, written: dict[int, Row]) -> None:
    """The invariants, after the endpoint has handled everything ``written``."""
    assert_handled(target.model, target.take_error_queue(),
                   {sequence: row.message for sequence, row in written.items()},
                   target.accounts())


@LIVE_ENDPOINT
@given(messages=st.lists(wire_messages(), min_size=1, max_size=8))
def test_whatever_a_hostile_client_writes_into_the_queue_is_applied_once_or_dead_lettered(
    target: Target, messages: list[WireMessage],
) -> None:
    written = target.write(messages)
    check(target, written)


def test_rows_no_idembus_client_would_write_go_to_the_error_queue_with_a_reason(
    target: Target,
) -> None:
    # Given headers that are not an object, a body that is not bytes (MongoDB), and a
    # message whose headers a client wrote as a JSON object in a JSON string
    good = json.dumps({"account": "odd", "amount": 1}).encode()
    odd = [
        ('["idembus.message_id", "x"]', good),
        ('"just text"', good),
        (json.dumps(json.dumps({h.MESSAGE_ID: str(uuid.uuid4()),
                                h.MESSAGE_TYPE: "test.Deposit"})), good),
    ]
    for headers, body in odd:
        target.queue.write(target.endpoint.name, Row(WireMessage({}, body), headers, body,
                                                     "application/json", None))
    if isinstance(target.queue, MongoQueue):
        with target.queue.transport._guard:
            target.queue.transport.messages.insert_one({
                "_id": "not-bytes", "queue": target.endpoint.name, "body": "text, not bytes",
                "headers": {h.MESSAGE_ID: str(uuid.uuid4()), h.MESSAGE_TYPE: "test.Deposit"},
                "visible_at": datetime.datetime.now(datetime.timezone.utc),
                "order": bson.ObjectId(), "leased_until": None, "deliveries": 0})

    # When the endpoint has handled them (a sentinel after them is applied)
    target.write([])

    # Then each is in the error queue, saying what is wrong; none was applied
    copies = []
    while (copy := target.endpoint.transport.get(target.endpoint.error_queue)) is not None:
        copies.append(copy.headers[h.EXCEPTION_MESSAGE])
    assert len(copies) == len(odd) + isinstance(target.queue, MongoQueue), copies
    assert all("not an object" in said or "not bytes" in said for said in copies), copies
    assert "odd" not in target.accounts()
