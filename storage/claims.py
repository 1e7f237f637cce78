"""The claim check: large bodies travel as a reference to the payload store.

An endpoint with ``claim_check=ClaimCheck(...)`` checks the body of every message it puts on
the wire: one larger than the threshold (of its type, or of the endpoint) is written to a
:class:`~idembus.storage.base.PayloadStore` under an id derived from the message id, and
the wire carries a small JSON reference with the headers ``idembus.claim_check`` (the id)
and ``idembus.claim_check.bytes`` (the size) instead. A receiver reads the body back before
it decodes the message; a reference it cannot resolve sends the message to the error queue
with the reason.

Where the body is until then: an outgoing message is committed with its body, in the
handler's one conditional write, as every outgoing message is; the body is written to the
payload store just before each publish (the first, and any publish again after a crash
between commit and dispatch), with the same id and the same committed bytes each time.
So no reference is ever on the wire before its body is stored, and an undispatched message
refers to nothing in the store: collecting cannot take a body such a message needs.

A body is kept ``retention`` after its last write (after its ``idembus.deliver_at`` for a
deferred message, or for a delayed retry due later), then collected by the outbox relay's
rounds. A copy moved to the error queue (or parked) holds its body (:func:`hold`, the
header ``idembus.claim_check.hold``) until it is retried — then the body is kept
``retention`` from the retry — or purged (:func:`release`).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

from .. import headers as h
from ..envelope import Envelope
from ..errors import ConfigurationError, MalformedMessage
from ..messages import Message, is_message_type, message_name
from .base import PayloadStore

#: Payload ids are uuid5 names of the message id in this namespace.
_NAMESPACE = uuid.UUID("5d0c6f8e-3a47-5b8e-9c61-1f2d3e4a5b6c")


def payload_id(message_id: str) -> str:
    """The id a message's body is kept under: derived from its message id, so that every
    dispatch of the message writes (and refers to) the same one."""
    return str(uuid.uuid5(_NAMESPACE, message_id))


@dataclass(frozen=True)
class ClaimCheck:
    """Which bodies an endpoint sends as a reference to a payload store
    (``Endpoint(claim_check=ClaimCheck(...))``).

    ``threshold_bytes``: a body larger than this (UTF-8 bytes) is claim-checked.
    ``types``: thresholds of their own for some message types (the class or its wire
    name); ``0`` claim-checks every message of that type. ``retention``: how long a body is
    kept after its last dispatch (it must outlast delivery, retries and the time a failed
    message may wait in the error queue before it is retried). ``store``: where the bodies
    are kept; ``None``: the endpoint's storage (it needs the payload role). Receivers read
    the same store: give them the same ``ClaimCheck(store=...)``, or share the storage.
    """

    threshold_bytes: int = 256 * 1024
    types: Mapping[type[Message] | str, int] = field(default_factory=dict)
    retention: datetime.timedelta = datetime.timedelta(days=14)
    store: PayloadStore | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.threshold_bytes, int) or self.threshold_bytes < 0:
            raise ConfigurationError(
                f"threshold_bytes must be a whole number of bytes, got {self.threshold_bytes!r}")
        if self.retention <= datetime.timedelta(0):
            raise ConfigurationError(f"retention must be positive, got {self.retention!r}")
        if self.store is not None and not isinstance(self.store, PayloadStore):
            raise ConfigurationError(
                f"store must be a PayloadStore (MemoryStorage, MongoStorage, PostgresStorage "
                f"or your own), got {type(self.store).__name__}")
        names: dict[str, int] = {}
        for key, threshold in self.types.items():
            name = key if isinstance(key, str) else (
                message_name(key) if is_message_type(key) else None)
            if not isinstance(name, str) or not isinstance(threshold, int) or threshold < 0:
                raise ConfigurationError(
                    f"types maps message types (or wire names) to thresholds in bytes, got "
                    f"{key!r}: {threshold!r}")
            names[name] = threshold
        object.__setattr__(self, "types", names)

    def threshold(self, message_type: str | None) -> int:
        """The threshold of messages of ``message_type`` (a wire name)."""
        return self.types.get(message_type or "", self.threshold_bytes)

    def applies(self, envelope: Envelope) -> bool:
        """Whether ``envelope`` goes on the wire as a reference."""
        if h.CLAIM_CHECK in envelope.headers:
            return False
        limit, characters = self.threshold(envelope.message_type), len(envelope.body)
        if characters > limit:
            return True
        # A character is at most 4 UTF-8 bytes: most bodies are decided without encoding.
        return characters * 4 > limit and len(_encoded(envelope.body)) > limit


def claimed(envelope: Envelope, claim_check: ClaimCheck, store: PayloadStore, *,
            now: datetime.datetime) -> Envelope:
    """``envelope`` as it goes on the wire: itself, or (its body over the threshold) its
    reference, once the body is kept in ``store`` until ``retention`` after ``now`` (after
    its ``idembus.deliver_at`` if later)."""
    if not claim_check.applies(envelope):
        return envelope
    body = _encoded(envelope.body)
    reference = payload_id(envelope.message_id)
    due = envelope.deliver_at
    keep_until = max(now, due) if due is not None else now
    store.put_payload(reference, body, keep_until=keep_until + claim_check.retention)
    return dataclasses.replace(
        envelope, body=json.dumps({h.CLAIM_CHECK: reference, "bytes": len(body)}),
        headers={**envelope.headers, h.CLAIM_CHECK: reference,
                 h.CLAIM_CHECK_BYTES: str(len(body))},
        content_encoding="utf-8")


def resolved(headers: Mapping[str, str], body: bytes, store: PayloadStore | None) -> bytes:
    """The body of a received message: ``body`` itself, or the one its claim-check
    reference names. Raises :class:`~idembus.errors.MalformedMessage` (the message goes to
    the error queue with the reason) when the reference cannot be resolved; an outage of
    the store raises what the store raises."""
    reference = headers.get(h.CLAIM_CHECK)
    if reference is None:
        return body
    if store is None:
        raise MalformedMessage(
            f"the body is claim-checked ({h.CLAIM_CHECK} {reference[:80]!r}) but this "
            "endpoint has no payload store to read it from: give it "
            "claim_check=ClaimCheck(store=...) on the sender's store, or a storage with the "
            "payload role")
    found = store.get_payload(reference)
    if found is None:
        raise MalformedMessage(
            f"the claim-checked body {reference[:80]!r} is not in the payload store (never "
            "stored there, or collected after its retention)")
    expected = headers.get(h.CLAIM_CHECK_BYTES)
    if expected is not None and expected != str(len(found)):
        raise MalformedMessage(
            f"the claim-checked body {reference[:80]!r} has {len(found)} bytes, its "
            f"{h.CLAIM_CHECK_BYTES} header says {expected[:20]!r}")
    return found


#: How long a body is kept after its last write when the endpoint has no claim check of
#: its own (a receiver reading its storage): :class:`ClaimCheck`'s default.
DEFAULT_RETENTION = datetime.timedelta(days=14)


def retention_of(claim_check: ClaimCheck | None) -> datetime.timedelta:
    """The retention of ``claim_check``, or the default for an endpoint without one."""
    return claim_check.retention if claim_check is not None else DEFAULT_RETENTION


def hold(headers: Mapping[str, str], store: PayloadStore | None) -> dict[str, str]:
    """Hold the body a claim-checked message refers to while a copy of it waits in the
    error queue (or parked): the headers to add to that copy (``idembus.claim_check.hold``,
    a new hold id), or none when the message is not claim-checked, or its body is not in
    ``store`` (nothing to keep). An outage of the store raises what the store raises."""
    reference = headers.get(h.CLAIM_CHECK)
    if reference is None or store is None:
        return {}
    hold_id = uuid.uuid4().hex
    return {h.CLAIM_CHECK_HOLD: hold_id} if store.hold_payload(reference, hold_id) else {}


def release(headers: Mapping[str, str], store: PayloadStore | None, *,
            keep_until: datetime.datetime) -> bool:
    """Release the hold an error-queue copy with ``headers`` had on its body (retried: pass
    a ``keep_until`` that outlasts its new delivery; purged: now). True if there was one."""
    hold_id = headers.get(h.CLAIM_CHECK_HOLD)
    if hold_id is None or store is None:
        return False
    return store.release_payload(hold_id, keep_until=keep_until)


def keep_longer(headers: Mapping[str, str], store: PayloadStore | None, *,
               until: datetime.datetime) -> None:
    """Keep the body a claim-checked message refers to at least until ``until`` (a delayed
    retry due later than its body's time): a hold taken and released at once, which only
    ever moves the time forward and does nothing when the body is gone."""
    reference = headers.get(h.CLAIM_CHECK)
    if reference is None or store is None:
        return
    hold_id = uuid.uuid4().hex
    if store.hold_payload(reference, hold_id):
        store.release_payload(hold_id, keep_until=until)


def _encoded(body: str) -> bytes:
    return body.encode("utf-8", "surrogateescape")
