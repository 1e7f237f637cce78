"""The claim check: large bodies travel as a reference to the payload store.

An endpoint with ``claim_check=ClaimCheck(...)`` checks the body of every message it puts on
the wire: one larger than the threshold (of its type, or of the endpoint) is written to a
:class:`~idembus.storage.base.PayloadStore` under an id derived from the message id, and
the wire carries a small JSON reference with the headers ``idembus.claim_check`` (the id)
and ``idembus.claim_check.bytes`` (the size) instead. For a type with ``fields``, each named
top-level field over the threshold is written on its own (an id derived from the message id
and the field's name) and replaced in the body by its reference; the header
``idembus.claim_check.fields`` names them. A receiver reads the body (or the fields) back
before it decodes the message; a reference it cannot resolve sends the message to the
error queue with the reason.

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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import headers as h
from ..envelope import Envelope
from ..errors import ConfigurationError, MalformedMessage
from ..messages import Message, is_message_type, message_name
from .base import PayloadStore

#: Payload ids are uuid5 names of the message id in this namespace.
_NAMESPACE = uuid.UUID("5d0c6f8e-3a47-5b8e-9c61-1f2d3e4a5b6c")
#: A claim-checked field's payload id is a uuid5 name of ``[message id, field]`` in this one.
_FIELDS_NAMESPACE = uuid.UUID("8a1e2b3c-4d5f-5a6b-8c7d-9e0f1a2b3c4d")
#: How a field's value and a body with references in place of fields are written (compact,
#: as written: the same committed body gives the same bytes at every dispatch).
_JSON: dict[str, Any] = {"ensure_ascii": False, "separators": (",", ":")}


def payload_id(message_id: str) -> str:
    """The id a message's body is kept under: derived from its message id, so that every
    dispatch of the message writes (and refers to) the same one."""
    return str(uuid.uuid5(_NAMESPACE, message_id))


def field_payload_id(message_id: str, field_name: str) -> str:
    """The id one claim-checked field of a message is kept under: derived from its message
    id and the field's name (one payload per field), the same at every dispatch."""
    return str(uuid.uuid5(_FIELDS_NAMESPACE, json.dumps([message_id, field_name])))


@dataclass(frozen=True)
class ClaimCheck:
    """Which bodies an endpoint sends as a reference to a payload store
    (``Endpoint(claim_check=ClaimCheck(...))``).

    ``threshold_bytes``: a body larger than this (UTF-8 bytes) is claim-checked.
    ``types``: thresholds of their own for some message types (the class or its wire
    name); ``0`` claim-checks every message of that type. ``fields``: for some message
    types (the class or its wire name), the top-level fields claim-checked one by one
    instead of the whole body: each of them whose JSON value is larger than the type's
    threshold is kept in the store and the rest of the body travels inline. ``retention``:
    how long a body is kept after its last dispatch (it must outlast delivery and the wait
    in the queue; copies in the error queue and delayed retries keep their bodies longer
    themselves). ``store``: where the bodies are kept; ``None``: the endpoint's storage (it
    needs the payload role). Receivers read the same store: give them the same
    ``ClaimCheck(store=...)``, or share the storage.
    """

    threshold_bytes: int = 256 * 1024
    types: Mapping[type[Message] | str, int] = field(default_factory=dict)
    retention: datetime.timedelta = datetime.timedelta(days=14)
    store: PayloadStore | None = None
    fields: Mapping[type[Message] | str, Sequence[str]] = field(default_factory=dict)

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
            name = _wire_name(key)
            if name is None or not isinstance(threshold, int) or threshold < 0:
                raise ConfigurationError(
                    f"types maps message types (or wire names) to thresholds in bytes, got "
                    f"{key!r}: {threshold!r}")
            names[name] = threshold
        object.__setattr__(self, "types", names)
        object.__setattr__(self, "fields", _checked_fields(self.fields))

    def threshold(self, message_type: str | None) -> int:
        """The threshold of messages of ``message_type`` (a wire name)."""
        return self.types.get(message_type or "", self.threshold_bytes)

    def applies(self, envelope: Envelope) -> bool:
        """Whether ``envelope`` goes on the wire as a reference (its whole body: a type
        with ``fields`` never does)."""
        if is_claimed(envelope.headers) or (envelope.message_type or "") in self.fields:
            return False
        return _over(envelope.body, self.threshold(envelope.message_type))

    def sends_apart(self, envelope: Envelope) -> bool:
        """Whether ``envelope`` may go on the wire with a reference in it: its whole body
        (:meth:`applies`), or, for a type with ``fields``, one of them (its body is over
        the threshold, so one of its fields may be)."""
        if is_claimed(envelope.headers):
            return False
        return _over(envelope.body, self.threshold(envelope.message_type))


def _wire_name(key: type[Message] | str) -> str | None:
    """The wire name of a message class or a wire name; ``None``: neither."""
    if isinstance(key, str):
        return key
    return message_name(key) if is_message_type(key) else None


def _checked_fields(
        fields: Mapping[type[Message] | str, Sequence[str]]) -> dict[str, tuple[str, ...]]:
    """``fields`` by wire name; ConfigurationError for anything else (a field a message
    class does not have, a name that is not a non-empty string)."""
    if not isinstance(fields, Mapping):
        raise ConfigurationError(f"fields maps message types to field names, got {fields!r}")
    checked: dict[str, tuple[str, ...]] = {}
    for key, names in fields.items():
        name = _wire_name(key)
        if (name is None or isinstance(names, str) or not isinstance(names, Sequence)
                or not names or not all(isinstance(n, str) and n for n in names)):
            raise ConfigurationError(
                f"fields maps message types (or wire names) to lists of field names, got "
                f"{key!r}: {names!r}")
        if is_message_type(key):
            known = {info.alias or field_name
                     for field_name, info in key.model_fields.items()}  # type: ignore[union-attr]
            unknown = [n for n in names if n not in known]
            if unknown:
                raise ConfigurationError(
                    f"fields: {name} has no field {', '.join(map(repr, unknown))} (it has "
                    f"{', '.join(sorted(known)) or 'none'}); name top-level fields as they "
                    "are on the wire")
        checked[name] = tuple(dict.fromkeys(names))
    return checked


def is_claimed(headers: Mapping[str, str]) -> bool:
    """Whether a message with ``headers`` refers to claim-checked content (its body, or
    some of its fields)."""
    return h.CLAIM_CHECK in headers or h.CLAIM_CHECK_FIELDS in headers


def claimed(envelope: Envelope, claim_check: ClaimCheck, store: PayloadStore, *,
            now: datetime.datetime) -> Envelope:
    """``envelope`` as it goes on the wire: itself, or (its body over the threshold) its
    reference, or (a type with claim-checked fields) its body with a reference in place of
    each field over the threshold, once what it refers to is kept in ``store`` until
    ``retention`` after ``now`` (after its ``idembus.deliver_at`` if later)."""
    if not claim_check.sends_apart(envelope):
        return envelope
    due = envelope.deliver_at
    keep_until = (max(now, due) if due is not None else now) + claim_check.retention
    names = claim_check.fields.get(envelope.message_type or "")
    if names:
        return _claimed_fields(envelope, names, claim_check.threshold(envelope.message_type),
                               store, keep_until)
    body = _encoded(envelope.body)
    reference = payload_id(envelope.message_id)
    store.put_payload(reference, body, keep_until=keep_until)
    return dataclasses.replace(
        envelope, body=json.dumps({h.CLAIM_CHECK: reference, "bytes": len(body)}),
        headers={**envelope.headers, h.CLAIM_CHECK: reference,
                 h.CLAIM_CHECK_BYTES: str(len(body))},
        content_encoding="utf-8")


def _claimed_fields(envelope: Envelope, names: Sequence[str], limit: int,
                    store: PayloadStore, keep_until: datetime.datetime) -> Envelope:
    """``envelope`` (its body over ``limit``: :meth:`ClaimCheck.sends_apart`) with each of
    the fields ``names`` whose JSON value is over ``limit`` bytes kept in ``store`` and
    replaced by its reference."""
    try:
        document = json.loads(envelope.body)
    except ValueError:
        return envelope  # not JSON: it travels as it is, and its receiver says why
    if not isinstance(document, dict):
        return envelope
    references: dict[str, dict[str, Any]] = {}
    for name in names:
        if name not in document:
            continue
        value = _encoded(json.dumps(document[name], **_JSON))
        if len(value) <= limit:
            continue
        reference = field_payload_id(envelope.message_id, name)
        store.put_payload(reference, value, keep_until=keep_until)
        references[name] = {"id": reference, "bytes": len(value)}
        document[name] = {h.CLAIM_CHECK: reference, "bytes": len(value)}
    if not references:
        return envelope
    return dataclasses.replace(
        envelope, body=json.dumps(document, **_JSON),
        headers={**envelope.headers, h.CLAIM_CHECK_FIELDS: json.dumps(references, **_JSON)},
        content_encoding="utf-8")


def resolved(headers: Mapping[str, str], body: bytes, store: PayloadStore | None) -> bytes:
    """The body of a received message: ``body`` itself, or the one its claim-check
    reference names, or ``body`` with its claim-checked fields read back in place. Raises
    :class:`~idembus.errors.MalformedMessage` (the message goes to the error queue with the
    reason) when a reference cannot be resolved; an outage of the store raises what the
    store raises."""
    reference, fields = headers.get(h.CLAIM_CHECK), headers.get(h.CLAIM_CHECK_FIELDS)
    if reference is None and fields is None:
        return body
    if store is None:
        raise _no_store(*((h.CLAIM_CHECK, reference) if reference is not None
                          else (h.CLAIM_CHECK_FIELDS, fields or "")))
    if reference is not None:
        body = _read(store, reference, headers.get(h.CLAIM_CHECK_BYTES), "body")
    if fields is not None:
        body = _with_fields(body, field_references(fields), store)
    return body


def _no_store(header: str, value: str) -> MalformedMessage:
    """Why a claim-checked message cannot be read where there is no payload store."""
    return MalformedMessage(
        f"the body is claim-checked ({header} {value[:80]!r}) but this endpoint has no "
        "payload store to read it from: give it claim_check=ClaimCheck(store=...) on the "
        "sender's store, or a storage with the payload role")


def _read(store: PayloadStore, reference: str, expected: str | None, what: str) -> bytes:
    """What ``store`` keeps under ``reference``, of ``expected`` bytes if given;
    MalformedMessage naming ``what`` (the body, a field) if it cannot be read."""
    found = store.get_payload(reference)
    if found is None:
        raise MalformedMessage(
            f"the claim-checked {what} {reference[:80]!r} is not in the payload store (never "
            "stored there, or collected after its retention)")
    if expected is not None and expected != str(len(found)):
        header = h.CLAIM_CHECK_BYTES if what == "body" else h.CLAIM_CHECK_FIELDS
        raise MalformedMessage(
            f"the claim-checked {what} {reference[:80]!r} has {len(found)} bytes, its "
            f"{header} header says {expected[:20]!r}")
    return found


def field_references(header: str) -> dict[str, tuple[str, int]]:
    """The ``idembus.claim_check.fields`` header read: field name -> (payload id, bytes);
    MalformedMessage if it is not an object of ``{"id": "<id>", "bytes": <size>}``."""
    try:
        parsed = json.loads(header)
    except ValueError:
        parsed = None
    references: dict[str, tuple[str, int]] = {}
    if isinstance(parsed, dict) and parsed:
        for name, reference in parsed.items():
            if not isinstance(reference, dict):
                break
            payload, size = reference.get("id"), reference.get("bytes")
            if (not isinstance(payload, str) or not payload or isinstance(size, bool)
                    or not isinstance(size, int) or size < 0):
                break
            references[name] = (payload, size)
        else:
            return references
    raise MalformedMessage(
        f"the {h.CLAIM_CHECK_FIELDS} header is not an object of field names to "
        f'{{"id": "<payload id>", "bytes": <size>}}: {header[:200]!r}')


def _with_fields(body: bytes, references: Mapping[str, tuple[str, int]],
                 store: PayloadStore) -> bytes:
    """``body`` with each referenced field read back from ``store`` in its place."""
    try:
        document = json.loads(body)
    except ValueError:
        document = None
    if not isinstance(document, dict):
        raise MalformedMessage(
            f"the message has claim-checked fields ({h.CLAIM_CHECK_FIELDS}) but its body is "
            "not a JSON object to put them back in")
    for name, (reference, size) in references.items():
        value = _read(store, reference, str(size), f"field {name!r}")
        try:
            document[name] = json.loads(value)
        except ValueError as error:
            raise MalformedMessage(
                f"the claim-checked field {name!r} ({reference[:80]!r}) is not JSON: "
                f"{error}") from None
    return _encoded(json.dumps(document, **_JSON))


def references(headers: Mapping[str, str]) -> list[tuple[str | None, str]]:
    """What a message with ``headers`` refers to in the payload store: ``(None, id)`` for
    its body, ``(field, id)`` for each claim-checked field (a header that cannot be read
    refers to nothing)."""
    found: list[tuple[str | None, str]] = []
    reference = headers.get(h.CLAIM_CHECK)
    if reference is not None:
        found.append((None, reference))
    fields = headers.get(h.CLAIM_CHECK_FIELDS)
    if fields is not None:
        try:
            found.extend((name, payload) for name, (payload, _) in
                         field_references(fields).items())
        except MalformedMessage:
            pass
    return found


def _hold_id(hold_id: str, field_name: str | None) -> str:
    """The hold of one payload of a copy: the copy's hold id for its body, the id and the
    field's name for a field."""
    return hold_id if field_name is None else f"{hold_id}:{field_name}"


#: How long a body is kept after its last write when the endpoint has no claim check of
#: its own (a receiver reading its storage): :class:`ClaimCheck`'s default.
DEFAULT_RETENTION = datetime.timedelta(days=14)


def retention_of(claim_check: ClaimCheck | None) -> datetime.timedelta:
    """The retention of ``claim_check``, or the default for an endpoint without one."""
    return claim_check.retention if claim_check is not None else DEFAULT_RETENTION


def hold(headers: Mapping[str, str], store: PayloadStore | None) -> dict[str, str]:
    """Hold what a claim-checked message refers to (its body, its fields) while a copy of
    it waits in the error queue (or parked): the headers to add to that copy
    (``idembus.claim_check.hold``, a new hold id), or none when the message refers to
    nothing, or to nothing ``store`` still has. An outage of the store raises what the
    store raises."""
    found = references(headers)
    if not found or store is None:
        return {}
    hold_id = uuid.uuid4().hex
    held = [store.hold_payload(reference, _hold_id(hold_id, name)) for name, reference in found]
    return {h.CLAIM_CHECK_HOLD: hold_id} if any(held) else {}


def release(headers: Mapping[str, str], store: PayloadStore | None, *,
            keep_until: datetime.datetime) -> bool:
    """Release the holds an error-queue copy with ``headers`` had on what it refers to
    (retried: pass a ``keep_until`` that outlasts its new delivery; purged: now). True if
    there was one."""
    hold_id = headers.get(h.CLAIM_CHECK_HOLD)
    if hold_id is None or store is None:
        return False
    released = [store.release_payload(_hold_id(hold_id, name), keep_until=keep_until)
                for name, _ in references(headers)]
    return any(released)


def keep_longer(headers: Mapping[str, str], store: PayloadStore | None, *,
                until: datetime.datetime) -> None:
    """Keep what a claim-checked message refers to at least until ``until`` (a delayed
    retry due later than its body's time): a hold taken and released at once, which only
    ever moves the time forward and does nothing when the body is gone."""
    if store is None:
        return
    for _, reference in references(headers):
        hold_id = uuid.uuid4().hex
        if store.hold_payload(reference, hold_id):
            store.release_payload(hold_id, keep_until=until)


#: How much of a claim-checked body (or field) :func:`peek` shows, in characters.
PREFIX = 2000


def peek(headers: Mapping[str, str], store: PayloadStore | None, *,
         prefix: int = PREFIX) -> list[dict[str, Any]]:
    """What ``store`` keeps for each thing a message with ``headers`` refers to, for the
    error tools: ``field`` (``None``: the body), ``payload_id``, ``bytes``, ``found``, and
    the first ``prefix`` characters (``prefix``, ``truncated``) or why it cannot be read
    (``problem``)."""
    expected: dict[str | None, str | None] = {None: headers.get(h.CLAIM_CHECK_BYTES)}
    fields = headers.get(h.CLAIM_CHECK_FIELDS)
    problem: str | None = None
    if fields is not None:
        try:
            expected.update((name, str(size)) for name, (_, size) in
                            field_references(fields).items())
        except MalformedMessage as unreadable:
            problem = unreadable.reason
    shown: list[dict[str, Any]] = []
    for name, reference in references(headers):
        what = "body" if name is None else f"field {name!r}"
        entry: dict[str, Any] = {"field": name, "payload_id": reference,
                                 "bytes": expected.get(name)}
        try:
            if store is None:
                raise _no_store(h.CLAIM_CHECK if name is None else h.CLAIM_CHECK_FIELDS,
                                reference)
            found = _read(store, reference, expected.get(name), what)
        except MalformedMessage as unresolved:
            shown.append({**entry, "found": False, "problem": unresolved.reason})
            continue
        text = found.decode("utf-8", "replace")
        shown.append({**entry, "found": True, "bytes": len(found), "prefix": text[:prefix],
                      "truncated": len(text) > prefix})
    if problem is not None:
        shown.append({"field": None, "payload_id": None, "bytes": None, "found": False,
                      "problem": problem})
    return shown


def _over(body: str, limit: int) -> bool:
    """Whether ``body`` is larger than ``limit`` UTF-8 bytes."""
    characters = len(body)
    if characters > limit:
        return True
    # A character is at most 4 UTF-8 bytes: most bodies are decided without encoding.
    return characters * 4 > limit and len(_encoded(body)) > limit


def _encoded(body: str) -> bytes:
    return body.encode("utf-8", "surrogateescape")
