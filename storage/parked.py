"""How backends store a parked message: its envelope as ASCII JSON bytes and its body as
bytes, so that any header text or body a broker delivered (NUL characters, invalid UTF-8
kept as surrogate escapes, keys with dots or dollars) is stored and returned unchanged."""

from __future__ import annotations

import json

from ..envelope import TEXT_ENCODING, Envelope


def envelope_bytes(envelope: Envelope) -> bytes:
    """Headers, destination, content type and encoding, as ASCII JSON (lone surrogates
    escaped)."""
    return json.dumps({"headers": dict(envelope.headers), "destination": envelope.destination,
                       "content_type": envelope.content_type,
                       "content_encoding": envelope.content_encoding}).encode("ascii")


def body_bytes(envelope: Envelope) -> bytes:
    """The body as the broker's bytes."""
    return envelope.body.encode("utf-8", "surrogateescape")


def envelope_from(stored: bytes, body: bytes) -> Envelope:
    """Inverse of :func:`envelope_bytes` and :func:`body_bytes`."""
    fields = json.loads(stored.decode("ascii"))
    return Envelope(headers=fields["headers"], body=body.decode("utf-8", "surrogateescape"),
                    destination=fields["destination"], content_type=fields["content_type"],
                    content_encoding=fields.get("content_encoding", TEXT_ENCODING))
