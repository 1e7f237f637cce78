"""A row of the PostgreSQL transport's messages table as a delivery
(:class:`_PostgresDelivery`), and the seam where psycopg's failures become transport errors
(:func:`_seam`, by the taxonomy of :mod:`idembus.storage.postgres_errors`)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from .. import headers as h
from .. import wire
from ..storage.postgres_errors import classified
from .database import (
    MAX_METADATA_BYTES,
    BodyLimit,
    encode_headers,
    failure_story,
    oversize,
    read_headers,
    story_at_end,
    transport_error,
)
from .db_engine import ClaimedRow
from .errors import DestinationRefused, TransportError

log = logging.getLogger("idembus.transports.postgres")


class _PostgresDelivery(ClaimedRow):
    """A row of the messages table, claimed (or read): the columns of
    :data:`~.postgres_statements.COLUMNS`, or of :data:`~.postgres_statements.SIZED_COLUMNS`
    (a body or headers not read are fetched on demand)."""

    def __init__(self, transport: Any, queue: str, row: Sequence[Any], *,
                 lease: int, connection: psycopg.Connection[Any] | None = None,
                 settled: bool = False) -> None:
        row_id, raw_headers, body, content_type, content_encoding, deliveries = row[:6]
        body_size, metadata_size, tail = row[6:9] if len(row) >= 9 else (None, None, None)
        unread = (oversize(None, metadata_size, MAX_METADATA_BYTES)
                  if raw_headers is None else None)
        headers, problem = ((story_at_end(tail), unread) if unread
                            else read_headers(raw_headers, content_encoding))
        super().__init__(queue=queue, headers=headers,
                         body=b"" if body is None else bytes(body),
                         content_type=content_type, content_encoding=content_encoding,
                         redelivered=int(deliveries) > 1, wire_error=problem)
        if body is None and body_size is not None:
            self.leave_body(body_size, lambda: transport._body_of(row_id, queue))
        #: Its headers were too large to read: :attr:`headers` holds only the failure
        #: story found at their end, if any.
        self.headers_left = unread is not None
        self.settled = settled
        #: The row's id and the claim's lease token.
        self.row_id: int = row_id
        self.lease = lease
        #: The consumer connection it was claimed on (``None``: settled through the pool).
        self.connection = connection
        self._engine = transport
        #: The table its row is in.
        self.table: str = transport.schema.messages


@contextlib.contextmanager
def _seam(url: str, what: str, *,
          refusal: type[TransportError] = DestinationRefused) -> Iterator[None]:
    """The driver's failures met while doing ``what`` on the database at ``url``, as
    transport errors; ``refusal`` stands for what the database refuses that is not an
    outage or the endpoint's."""
    try:
        yield
    except psycopg.Error as exc:
        error = transport_error(classified(exc, url), what)
        if isinstance(error, DestinationRefused) and refusal is not DestinationRefused:
            error = refusal(str(error))
        raise error from exc
    except UnicodeEncodeError as exc:  # text the database cannot hold as UTF-8
        raise refusal(f"{what}: {exc}") from exc


def _database_of(conninfo: str) -> tuple[str, str, str, str]:
    """Host, port, database and role a conninfo names (libpq's defaults where absent)."""
    try:
        parts = conninfo_to_dict(conninfo)
    except psycopg.ProgrammingError:
        return (conninfo, "", "", "")
    user = str(parts.get("user") or "")
    return (str(parts.get("host") or ""), str(parts.get("port") or "5432"),
            str(parts.get("dbname") or user), user)


def _close_quietly(connection: psycopg.Connection[Any]) -> None:
    try:
        connection.close()
    except Exception:  # closing a broken connection may raise; nothing to do about it
        log.debug("closing a PostgreSQL connection failed", exc_info=True)


def moved_aside(rows: Sequence[Sequence[Any]], queue: str, limits: BodyLimit) -> list[str]:
    """The failure stories (JSON members) of the claimed ``rows`` of ``queue`` (sizes and
    what was read) that a consumer moves to ``limits.error_queue``, each said at WARNING."""
    stories = []
    for row in rows:
        reason = oversize(row[6], row[7], limits.max_bytes) or "too large"
        headers, _ = read_headers(row[1], row[4]) if row[1] is not None else ({}, None)
        story = failure_story(headers, f"{reason} (moved to {limits.error_queue!r} by "
                              "the database, unread)", queue=queue)
        stories.append(encode_headers(story)[1:-1])
        log.warning("moved %s from %r to %r inside the database, unread: %s",
                    wire.shown(headers.get(h.MESSAGE_ID, "a message without id")), queue,
                    limits.error_queue, reason)
    return stories


def consumer_connection(url: str, connect_timeout: float, role: str,
                        queue: str) -> psycopg.Connection[Any]:
    """A connection of its own for a consumer (``role`` ``consume``) or the listener
    (``listen``) of ``queue``, named ``idembus <role> <queue>`` in ``pg_stat_activity``, that
    commits without waiting for the disk."""
    try:
        connection = psycopg.connect(
            url, autocommit=True, connect_timeout=max(1, int(connect_timeout)),
            application_name=f"idembus {role} {queue}"[:63])
    except psycopg.Error as exc:
        raise transport_error(classified(exc, url), f"consuming {queue!r}") from exc
    try:
        # Claims and acknowledgements need not wait for the disk: one a crash of the
        # database forgets only delivers its message again, which is deduplicated.
        connection.execute("SET synchronous_commit TO off")
    except psycopg.Error as exc:
        _close_quietly(connection)
        raise transport_error(classified(exc, url), f"consuming {queue!r}") from exc
    return connection
