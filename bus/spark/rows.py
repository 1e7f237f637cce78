"""Rows of a DataFrame as deliveries, the form in which an endpoint's processor takes messages.

A row carries ``message_id``, ``message_type``, ``body`` (the JSON text; a struct or map is
serialised back to JSON) and optionally ``headers`` (a JSON object text, a map or a struct of
strings). The row's headers come first and the ``message_id`` / ``message_type`` columns
override theirs, so a row built from a broker's export and a row typed by hand are read the
same way. The headers a move to the error queue adds (exception, failed queue, attempt
counts) are dropped, as ``idembus errors retry`` drops them: a message replayed from the
error queue's export starts its retries afresh. There is no broker to settle with:
acknowledging a row only records that it was.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from .. import headers as h
from ..failures import FAILURE_HEADERS
from ..transports.base import Delivery

#: Columns every input must have.
REQUIRED_COLUMNS = ("message_id", "message_type", "body")
#: The optional column of further headers.
HEADERS_COLUMN = "headers"


class RowDelivery(Delivery):
    """One row as a delivery; ``ack()`` and ``requeue()`` are only counted.

    ``problem`` says why the row itself cannot be read as a message (its headers column is
    not an object of strings); such a row belongs in the error queue.
    """

    def __init__(self, *, queue: str, headers: Mapping[str, str], body: bytes,
                 redelivered: bool, problem: str | None = None) -> None:
        super().__init__(queue=queue, headers=headers, body=body,
                         content_type=h.CONTENT_TYPE, redelivered=redelivered)
        self.problem = problem
        self.acked = False
        self.requeued = False

    def _ack(self) -> None:
        self.acked = True

    def _requeue(self) -> None:
        self.requeued = True


def row_delivery(row: Mapping[str, Any], *, queue: str, redelivered: bool) -> RowDelivery:
    """The delivery of ``row`` (a ``Row.asDict()``), as if it had been taken from ``queue``."""
    try:
        headers = _headers_of(row.get(HEADERS_COLUMN))
        problem = None
    except ValueError as exc:
        headers, problem = {}, f"the {HEADERS_COLUMN} column cannot be read: {exc}"
    for column, header in (("message_id", h.MESSAGE_ID), ("message_type", h.MESSAGE_TYPE)):
        value = row.get(column)
        if value is not None and value != "":
            headers[header] = str(value)
    return RowDelivery(queue=queue, headers=headers, body=_body_of(row.get("body")),
                       redelivered=redelivered, problem=problem)


def _headers_of(value: Any) -> dict[str, str]:
    """The headers column as text headers; ``ValueError`` if it is not an object."""
    if value is None:
        return {}
    if isinstance(value, str):
        if not value.strip():
            return {}
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not JSON ({exc})") from None
    value = _plain(value)
    if not isinstance(value, Mapping):
        raise ValueError(f"a JSON object of strings is expected, got {type(value).__name__}")
    return {str(name): _text(item) for name, item in value.items()
            if item is not None and str(name) not in FAILURE_HEADERS}


def _text(value: Any) -> str:
    """A header value as text (numbers and flags as their JSON spelling)."""
    return value if isinstance(value, str) else json.dumps(_plain(value))


def _body_of(value: Any) -> bytes:
    """The body column as JSON bytes; a missing body is empty (and fails decoding)."""
    if value is None:
        return b""
    if isinstance(value, str):
        return value.encode("utf-8", "surrogateescape")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    return json.dumps(_plain(value)).encode("utf-8")


def _plain(value: Any) -> Any:
    """Spark's ``Row`` values (structs) as dictionaries, recursively."""
    as_dict = getattr(value, "asDict", None)
    if callable(as_dict):
        return as_dict(recursive=True)
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value
