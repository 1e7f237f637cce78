"""Size before body, and no row that wedges a queue, on the database transports (issue 24,
findings 2 and 4).

* A consumer learns the size of each claimed body before reading it: a message over the
  endpoint's ``max_message_bytes`` is moved to the error queue inside the database, body
  and all, and never read into the consumer's process; ``browse`` and ``inspect`` (what
  ``idembus errors`` reads) leave such bodies in the database until a tool asks for one.
  On PostgreSQL the peak RSS of a consumer (a subprocess: ``ru_maxrss``) fed sixteen rows
  of 50 MB each stays under 200 MiB; before, it read them all (about 2.5 GB). mongomock
  keeps every document in the test's own memory, so there the test counts the body bytes
  the collection hands to the transport instead.
* Rows no idembus client writes — a delivery count at the top of its type, a due time of
  'infinity', headers that are not an object or too large, a string count, a body that
  is not bytes — never stop a claim: the good messages beside them are handled, the bad
  ones are in the error queue with a reason.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from idembus import Command, Endpoint, Handler, handles
from idembus import headers as h
from idembus.transports.database import MAX_METADATA_BYTES
from idembus.transports.postgres import PostgresTransport
from tests.conftest import POSTGRES_URL, require_service
from tests.test_workers import wait_until

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


# -- PostgreSQL: size before body ------------------------------------------------------------

CONSUMER = textwrap.dedent("""
    import json, resource, sys, threading
    from idembus.transports.postgres import PostgresTransport

    url, prefix, queue, error_queue, limit, good = sys.argv[1:7]
    transport = PostgresTransport(url, table_prefix=prefix)
    transport.limit_bodies(queue, max_bytes=int(limit), error_queue=error_queue)
    stop, received = threading.Event(), []

    def on_delivery(delivery):
        received.append(len(delivery.body))
        delivery.ack()
        if len(received) >= int(good):
            stop.set()

    consumer = threading.Thread(target=transport.consume, args=(queue, on_delivery),
                                kwargs={"stop": stop, "prefetch": 16})
    consumer.start()
    stop.wait(60)
    stop.set()
    consumer.join(30)
    after_consuming = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with transport.browse(error_queue, page=16) as messages:
        listed = [(d.headers.get("idembus.exception.message"), getattr(d, "body_size", None))
                  for d in messages]
    with transport.inspect(error_queue) as taken:
        inspected = len(taken)
    transport.close()
    print(json.dumps({"received": received, "rss_consuming": after_consuming,
                      "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                      "listed": listed, "inspected": inspected}))
""")


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
         error_queue, str(LIMIT), "2"], capture_output=True, text=True, timeout=120)
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
