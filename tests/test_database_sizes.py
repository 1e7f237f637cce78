"""Size before body, and no row that wedges a queue, on the database transports (issue 24,
findings 2 and 4).

* A consumer learns the size of each claimed body before reading it: a message over the
  endpoint's ``max_message_bytes`` is moved to the error queue inside the database, body
  and all, and never read into the consumer's process; ``browse`` and ``inspect`` (what
  ``idembus errors`` reads) leave such bodies in the database until a tool asks for one.
  On PostgreSQL the peak RSS of a consumer (a subprocess: its ``VmHWM``) fed sixteen rows
  of 50 MB each stays under 200 MiB; before, it read them all (about 2.5 GB). mongomock
  keeps every document in the test's own memory, so there the test counts the body bytes
  the collection hands to the transport instead.
* Rows no idembus client writes — a delivery count at the top of its type, a due time of
  'infinity', headers that are not an object or too large, a string count, a body that
  is not bytes — never stop a claim: the good messages beside them are handled, the bad
  ones are in the error queue with a reason.
"""

from __future__ import annotations

import datetime
import json
import pathlib
import subprocess
import sys
import textwrap
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import bson
import mongomock
import psycopg
import pytest

from idembus import Command, Endpoint, Handler, handles
from idembus import headers as h
from idembus.transports.database import MAX_METADATA_BYTES
from idembus.transports.mongo import MongoTransport
from idembus.transports.postgres import PostgresTransport
from tests.conftest import POSTGRES_URL, require_service
from tests.contract.test_transport_contract import envelope
from tests.test_workers import wait_until

ROOT = pathlib.Path(__file__).resolve().parent.parent
#: The body of each oversized row, in bytes (built by the database, not sent).
BIG = 50_000_000
#: The limit the consumers are given.
LIMIT = 1024 * 1024
#: The most a consumer may weigh while the big rows pass (its baseline is about 60 MiB).
MAX_RSS_KIB = 200 * 1024


class Note(Command, message_name="test.SizesNote"):
    text: str


class Notes(Handler):
    """Records the notes it handles (class-level: one endpoint per test)."""

    seen: list[str] = []
    lock = threading.Lock()

    @handles
    def note(self, message: Note) -> None:
        with self.lock:
            self.seen.append(message.text)


def note_body(text: str) -> bytes:
    return json.dumps({"text": text}).encode()


@pytest.fixture
def postgres() -> Iterator[PostgresTransport]:
    require_service(POSTGRES_URL, "PostgreSQL")
    transport = PostgresTransport(POSTGRES_URL, table_prefix=f"sz{uuid.uuid4().hex[:10]}")
    transport.migrate()
    try:
        yield transport
    finally:
        transport.close()
        transport.drop_tables()


def insert(transport: PostgresTransport, queue: str, headers: str, body_sql: str = "%s",
           body: Any = b"{}", *, copies: int = 1, **columns: Any) -> None:
    """Rows written by a client with INSERT rights: ``body_sql`` builds the body in the
    database (``%s``: ``body`` as given); ``columns`` set more columns (SQL text)."""
    names = "".join(f", {name}" for name in columns)
    values = "".join(f", {value}" for value in columns.values())
    with psycopg.connect(POSTGRES_URL, autocommit=True) as connection:
        connection.execute(
            f"INSERT INTO {transport.schema.messages} (queue, headers, body{names}) "
            f"SELECT %s, %s::json, {body_sql}{values} FROM generate_series(1, %s)",
            (queue, headers, body, copies) if body_sql == "%s" else (queue, headers, copies))


def consume_until(transport: Any, queue: str, count: int,
                  drained: Callable[[], bool] = lambda: True) -> list[bytes]:
    """The bodies of the first ``count`` deliveries of ``queue`` (acknowledged), consumed
    until there are as many and ``drained()``."""
    stop, received = threading.Event(), []

    def on_delivery(delivery: Any) -> None:
        received.append(delivery.body)
        delivery.ack()

    consumer = threading.Thread(target=transport.consume, args=(queue, on_delivery),
                                kwargs={"stop": stop, "prefetch": 16})
    consumer.start()
    try:
        assert wait_until(lambda: len(received) >= count and drained(), timeout=60), [
            len(body) for body in received]
    finally:
        stop.set()
        consumer.join(30)
    return received


# -- PostgreSQL: size before body ------------------------------------------------------------

CONSUMER = textwrap.dedent("""
    import json, re, sys
    from idembus.transports.postgres import PostgresTransport
    from tests.test_database_sizes import consume_until

    url, prefix, queue, error_queue, limit, good = sys.argv[1:7]
    transport = PostgresTransport(url, table_prefix=prefix)
    transport.limit_bodies(queue, max_bytes=int(limit), error_queue=error_queue)
    received = [len(body) for body in consume_until(transport, queue, int(good))]
    with transport.browse(error_queue, page=16) as messages:
        listed = [(d.headers.get("idembus.exception.message"), getattr(d, "body_size", None))
                  for d in messages]
    with transport.inspect(error_queue) as taken:
        inspected = len(taken)
    transport.close()
    # The peak of this process's own memory (VmHWM, reset by exec): not ru_maxrss, which
    # starts from the forking process's resident size (pytest's, however large it grew).
    with open("/proc/self/status") as status:
        peak = int(re.search(r"VmHWM:\\s+(\\d+) kB", status.read()).group(1))
    print(json.dumps({"received": received, "listed": listed, "inspected": inspected,
                      "rss": peak}))
""")


@pytest.mark.postgres
def test_a_consumer_moves_bodies_over_its_limit_to_the_error_queue_without_reading_them(
    postgres: PostgresTransport,
) -> None:
    # Given sixteen rows of 50 MB each (built in the database: about 1 MB on disk), then
    # two ordinary messages, in a queue whose consumer takes 1 MiB at most
    queue, error_queue = "sizes", "sizes-error"
    big_headers = {h.MESSAGE_ID: "big", h.MESSAGE_TYPE: "test.SizesNote", "keep": "me"}
    insert(postgres, queue, json.dumps(big_headers),
           f"convert_to(repeat('x', {BIG}), 'UTF8')", copies=16)
    for text in ("one", "two"):
        insert(postgres, queue, json.dumps({h.MESSAGE_ID: text}), body=note_body(text))

    # When a consumer in a process of its own takes them, then lists and inspects the
    # error queue as `idembus errors` does
    done = subprocess.run(
        [sys.executable, "-c", CONSUMER, POSTGRES_URL, postgres.schema.prefix, queue,
         error_queue, str(LIMIT), "2"], capture_output=True, text=True, timeout=120,
        cwd=ROOT)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)

    # Then it never weighed 200 MiB, and received the two ordinary ones only
    assert report["rss"] < MAX_RSS_KIB, f"peak RSS {report['rss'] // 1024} MiB"
    assert report["received"] == [len(note_body("one")), len(note_body("two"))]
    # And the big ones are in the error queue, each whole, with the original headers and
    # the story of the failure after them; the listing read no body of them
    with psycopg.connect(POSTGRES_URL) as connection:
        rows = connection.execute(
            f"SELECT headers::text, octet_length(body), lease FROM"
            f" {postgres.schema.messages} WHERE queue = %s", (error_queue,)).fetchall()
    assert len(rows) == 16
    for text, size, lease in rows:
        headers = json.loads(text)
        assert size == BIG and lease is None  # (inspect counted one delivery)
        assert headers["keep"] == "me" and headers[h.MESSAGE_ID] == "big"
        assert headers[h.FAILED_QUEUE] == queue
        assert headers[h.EXCEPTION_TYPE] == "idembus.errors.MalformedMessage"
        assert f"the body of {BIG} bytes exceeds max_message_bytes={LIMIT}" in (
            headers[h.EXCEPTION_MESSAGE])
    assert [size for _, size in report["listed"]] == [BIG] * 16
    assert all("exceeds max_message_bytes" in said for said, _ in report["listed"])
    assert report["inspected"] == 16
    # And a tool that asks for one body gets it, whole
    with postgres.browse(error_queue, page=1) as messages:
        first = next(iter(messages))
        assert first.body_size == BIG
        assert first.body == b"x" * BIG


@pytest.mark.postgres
def test_an_endpoint_gives_its_transport_its_limit_and_error_queue(
    postgres: PostgresTransport,
) -> None:
    endpoint = Endpoint("sizes-limits", transport=postgres, handlers=[Notes],
                        max_message_bytes=4096, error_queue="sizes-limits-error")
    try:
        limit = postgres.body_limit("sizes-limits")
        assert (limit.max_bytes, limit.error_queue) == (4096, "sizes-limits-error")
    finally:
        endpoint.close()


# -- PostgreSQL: no row wedges a queue -------------------------------------------------------


def note_row(text: str, **extra: str) -> str:
    return json.dumps({h.MESSAGE_ID: str(uuid.uuid4()), h.MESSAGE_TYPE: "test.SizesNote",
                       **extra})


def error_reasons(transport: Any, error_queue: str) -> list[str]:
    """The reasons in ``error_queue``, sorted (the queue emptied)."""
    reasons = []
    while (copy := transport.get(error_queue)) is not None:
        reasons.append(copy.headers[h.EXCEPTION_MESSAGE])
    return sorted(reasons)


def running(transport: Any, name: str) -> Endpoint:
    Notes.seen = []
    endpoint = Endpoint(name, transport=transport, handlers=[Notes], prefetch=8,
                        error_queue=f"{name}-error", max_message_bytes=LIMIT)
    endpoint.start()
    return endpoint


@pytest.mark.postgres
def test_no_row_stops_a_postgresql_queue(postgres: PostgresTransport) -> None:
    # Given, between two ordinary notes, rows no idembus client writes: a delivery count
    # at the top of its type, due times of 'infinity', headers that are not an object,
    # headers or a content type over what a claim reads
    endpoint = running(postgres, "wedge")
    queue, json_type = "wedge", "'application/json'"
    rows: list[tuple[str, dict[str, str]]] = [
        ("first", {}), ("maxed", {"deliveries": "2147483647"}),
        ("never", {"visible_at": "'infinity'"}),
        ("held", {"visible_at": "now() - interval '1 hour'", "leased_until": "'infinity'"}),
    ]
    try:
        for text, columns in rows:
            insert(postgres, queue, note_row(text), body=note_body(text),
                   content_type=json_type, **columns)
        insert(postgres, queue, "null", body=note_body("null"), content_type=json_type)
        insert(postgres, queue, '["idembus.message_id", "array"]', body=note_body("array"),
               content_type=json_type)
        insert(postgres, queue, note_row("wide", pad="y" * (MAX_METADATA_BYTES + 1)),
               body=note_body("wide"), content_type=json_type)
        insert(postgres, queue, note_row("typed"), body=note_body("typed"),
               content_type=f"'{'z' * (MAX_METADATA_BYTES + 1)}'")
        insert(postgres, queue, note_row("last"), body=note_body("last"),
               content_type=json_type)

        # When the endpoint consumes them
        assert wait_until(lambda: "last" in Notes.seen, timeout=30), Notes.seen
    finally:
        endpoint.close()

    # Then the good ones are handled (the count saturates), the delayed-forever ones wait,
    # and the bad ones are in the error queue saying why
    assert sorted(Notes.seen) == ["first", "last", "maxed"]
    reader = PostgresTransport(POSTGRES_URL, table_prefix=postgres.schema.prefix)
    try:
        # (listed by `idembus errors` too: the failure story of headers too large to read
        # is found at their end)
        with reader.browse("wedge-error") as messages:
            assert [d.headers.get(h.FAILED_QUEUE) for d in messages] == [queue] * 4
        # (but not taken to retry or purge: a retry without those headers would lose them)
        with reader.inspect("wedge-error") as taken:
            assert len(taken) == 2
        reasons = error_reasons(reader, "wedge-error")
    finally:
        reader.close()
    assert len(reasons) == 4, reasons
    assert sum("not an object" in said for said in reasons) == 2, reasons
    assert sum(f"at most {MAX_METADATA_BYTES} are read" in said for said in reasons) == 2
    with psycopg.connect(POSTGRES_URL) as connection:
        left = connection.execute(
            f"SELECT count(*) FROM {postgres.schema.messages} WHERE queue = %s",
            (queue,)).fetchone()
    assert left == (2,)


# -- MongoDB (mongomock): the same ------------------------------------------------------------

#: The body of each oversized document: mongomock keeps every document in this process, so
#: the test counts the body bytes handed to the transport rather than its memory.
MONGO_BIG = 2 * LIMIT


class Counted:
    """The transport's queue collection, counting the largest body it hands over."""

    def __init__(self, collection: Any) -> None:
        self._collection = collection
        self.largest = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._collection, name)

    def _seen(self, document: Any) -> Any:
        if isinstance(document, dict) and isinstance(document.get("body"), bytes):
            self.largest = max(self.largest, len(document["body"]))
        return document

    def find_one_and_update(self, *args: Any, **kwargs: Any) -> Any:
        return self._seen(self._collection.find_one_and_update(*args, **kwargs))

    def find_one(self, *args: Any, **kwargs: Any) -> Any:
        return self._seen(self._collection.find_one(*args, **kwargs))

    def find(self, *args: Any, **kwargs: Any) -> Any:
        return CountedCursor(self, self._collection.find(*args, **kwargs))


class CountedCursor:
    """A cursor of :class:`Counted`'s collection, counting what it yields."""

    def __init__(self, counted: Counted, cursor: Any) -> None:
        self._counted = counted
        self._cursor = cursor

    def sort(self, *args: Any) -> CountedCursor:
        return CountedCursor(self._counted, self._cursor.sort(*args))

    def limit(self, count: int) -> CountedCursor:
        return CountedCursor(self._counted, self._cursor.limit(count))

    def __iter__(self) -> Iterator[Any]:
        return (self._counted._seen(document) for document in self._cursor)


@pytest.fixture
def mongo() -> Iterator[MongoTransport]:
    transport = MongoTransport(mongomock.MongoClient(), database=f"sz{uuid.uuid4().hex[:8]}")
    try:
        yield transport
    finally:
        transport.close()


def test_a_mongodb_consumer_moves_bodies_over_its_limit_aside_without_reading_them(
    mongo: MongoTransport,
) -> None:
    # Given sixteen messages of 2 MiB sent by idembus (which records each body's size),
    # then two ordinary ones, in a queue whose consumer takes 1 MiB at most
    queue, error_queue = "sizes", "sizes-error"
    mongo.declare(queue)
    mongo.limit_bodies(queue, max_bytes=LIMIT, error_queue=error_queue)
    for _ in range(16):
        mongo.send(envelope(destination=queue, body="x" * MONGO_BIG))
    for text in ("one", "two"):
        mongo.send(envelope(destination=queue, body=note_body(text).decode()))
    counted = Counted(mongo.messages)
    mongo.messages = counted

    # When a consumer takes them
    received = consume_until(mongo, queue, 2, lambda: mongo.pending(queue) == 0)

    # Then it received the two ordinary ones, and no body over the limit reached it
    assert received == [note_body("one"), note_body("two")]
    assert counted.largest <= LIMIT
    # And the big ones are in the error queue, whole, saying why
    copies = list(counted._collection.find({"queue": error_queue}))
    assert len(copies) == 16
    for copy in copies:
        headers = json.loads(copy["headers"])
        assert copy["body"] == b"x" * MONGO_BIG and copy["lease"] is None
        assert headers["custom.header"] == "kept as is"
        assert headers[h.FAILED_QUEUE] == queue
        assert f"the body of {MONGO_BIG} bytes exceeds max_message_bytes={LIMIT}" in (
            headers[h.EXCEPTION_MESSAGE])
    # And listing or inspecting the error queue reads none of their bodies, until a tool
    # asks for one
    with mongo.browse(error_queue, page=4) as messages:
        listed = list(messages)
    with mongo.inspect(error_queue) as taken:
        assert [d.body_size for d in taken] == [MONGO_BIG] * 16  # type: ignore[attr-defined]
    assert [d.body_size for d in listed] == [MONGO_BIG] * 16  # type: ignore[attr-defined]
    assert counted.largest <= LIMIT
    assert listed[0].body == b"x" * MONGO_BIG


def test_no_document_stops_a_mongodb_queue(mongo: MongoTransport) -> None:
    # Given, between two ordinary notes, documents no idembus client writes: a string or
    # overflowing delivery count, no body or a text body, headers that are a number, a
    # content encoding that is not text, a size that is not a number; and one whose due
    # time is not a time (never due)
    endpoint = running(mongo, "wedge")
    queue = "wedge"
    now = datetime.datetime.now(datetime.timezone.utc)
    hostile = [
        {"deliveries": "x"}, {"deliveries": 2**31 - 1}, {"deliveries": float("nan")},
        {"body": None}, {"body": "text"}, {"headers": 5}, {"content_encoding": 7},
        {"size": "big"},
    ]
    try:
        def write(text: str, **fields: Any) -> None:
            body = note_body(text)
            document = {
                "_id": uuid.uuid4().hex, "queue": queue, "headers": note_row(text),
                "body": body, "size": len(body), "content_type": "application/json",
                "content_encoding": None, "visible_at": now, "order": bson.ObjectId(),
                "leased_until": None, "lease": None, "deliveries": 0, **fields}
            with mongo._guard:
                mongo.messages.insert_one(document)

        write("first")
        for number, fields in enumerate(hostile):
            write(f"bad{number}", **fields)
        write("never", visible_at="soon")
        write("last")

        # When the endpoint consumes them
        assert wait_until(lambda: "last" in Notes.seen, timeout=30), Notes.seen
        reasons = error_reasons(mongo, "wedge-error")
    finally:
        endpoint.close()

    # Then the good ones are handled and every bad one is in the error queue, saying why
    assert sorted(Notes.seen) == ["first", "last"]
    assert len(reasons) == len(hostile), reasons
    for said in ("its delivery count is 'x'", "its delivery count is 2147483647",
                 "its delivery count is nan", "not bytes", "its headers are 5",
                 "its content encoding is 7", "its size is 'big'"):
        assert any(said in reason for reason in reasons), (said, reasons)
    with mongo._guard:
        assert [d["visible_at"] for d in mongo.messages.find({"queue": queue})] == ["soon"]
