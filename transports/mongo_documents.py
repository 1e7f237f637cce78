"""The documents of the MongoDB transport's queue collection
(:mod:`idembus.transports.mongo`): a document as a delivery (:class:`_MongoDelivery`,
whatever its fields hold), the filters of due and readable documents, what keeps a claim
from using one as it is (:func:`_flaws`), and a copy's ``_id``."""

from __future__ import annotations

import datetime
import hashlib
import threading
from collections.abc import Collection, Mapping
from typing import Any, TypeGuard

from .. import headers as h
from .. import wire
from ..envelope import Envelope
from .base import OrderedKeys, QueueDepth
from .database import oversize, read_headers
from .db_engine import ClaimedRow


class _MongoDelivery(ClaimedRow):
    """A document of the queue collection, claimed (or read): whatever its fields hold,
    what cannot be used is said in ``wire_error``; a body not read with it (over the
    limit: no ``body`` field, a numeric ``size``) is fetched on demand."""

    def __init__(self, transport: Any, queue: str, document: Mapping[str, Any], *,
                 lease: int, settled: bool = False) -> None:
        content_type, content_encoding = (
            value if value is None or isinstance(value, str) else wire.shown(value)
            for value in (document.get("content_type"), document.get("content_encoding")))
        headers, problem = read_headers(document.get("headers"), content_encoding)
        problem = wire.joined(problem, *(
            f"its {name} is {wire.shown(document.get(field))}, not text"
            for name, field in (("content type", "content_type"),
                                ("content encoding", "content_encoding"))
            if not isinstance(document.get(field), (str, type(None)))))
        size = document.get("size")
        left = "body" not in document
        body = b"" if left else document.get("body")
        if not isinstance(body, bytes):
            problem = problem or f"its body is {type(body).__name__}, not bytes"
            body = b"" if body is None else str(body).encode("utf-8", "surrogateescape")
        deliveries = document.get("deliveries")
        super().__init__(queue=queue, headers=headers, body=bytes(body),
                         content_type=content_type, content_encoding=content_encoding,
                         redelivered=_is_count(deliveries) and deliveries > 1,
                         wire_error=problem)
        if left:
            document_id = document["_id"]
            self.leave_body(int(size) if _is_count(size) else None,
                            lambda: transport._body_of(document_id, queue))
        self.settled = settled
        self.document_id = document["_id"]
        self.lease = lease
        self._engine = transport


def _due(queue: str, now: datetime.datetime) -> dict[str, Any]:
    """The filter of ``queue``'s messages that are due and not leased at ``now``."""
    return {"queue": queue, "visible_at": {"$lte": now},
            "$or": [{"leased_until": None}, {"leased_until": {"$lte": now}}]}


def queue_depth(messages: Any, queue: str, now: datetime.datetime) -> QueueDepth:
    """Ready, leased (unacknowledged) and delayed documents of ``queue`` in the collection
    ``messages``, and how long the oldest ready one has been due; consumers are not
    counted (a waiting consumer holds no document)."""
    leased = {"queue": queue, "leased_until": {"$gt": now}}
    delayed = {"queue": queue, "visible_at": {"$gt": now},
               "$or": [{"leased_until": None}, {"leased_until": {"$lte": now}}]}
    oldest = messages.find_one(_due(queue, now), {"visible_at": 1},
                               sort=[("visible_at", 1), ("order", 1)])
    waited = (now - _aware(oldest["visible_at"])).total_seconds() if oldest else None
    return QueueDepth(ready=int(messages.count_documents(_due(queue, now))),
                      unacked=int(messages.count_documents(leased)),
                      delayed=int(messages.count_documents(delayed)),
                      oldest_seconds=max(0.0, waited) if waited is not None else None)


def behind(messages: Any, queue: str, document: Mapping[str, Any]) -> bool:
    """Whether an older document of ``document``'s ordering key is still in ``queue``
    (waiting, delayed, or claimed and not yet settled): then it must wait its turn."""
    return messages.find_one(
        {"queue": queue, "ordering_key": document["ordering_key"],
         "order": {"$lt": document.get("order")}}, {"_id": 1}) is not None


def pass_over(messages: Any, document: Mapping[str, Any], lease: int) -> None:
    """Give back ``document``, claimed under ``lease`` though its key is in flight, as it
    was (its place, its delivery count): no other consumer could have taken it."""
    messages.update_one(
        {"_id": document["_id"], "lease": lease},
        {"$set": {"leased_until": None, "lease": None}, "$inc": {"deliveries": -1}})


def ordered_keys(messages: Any, queue: str, now: datetime.datetime) -> OrderedKeys:
    """The keys of ``queue``'s ordered documents with one leased (claimed, not settled),
    and its ordered documents no lease holds, in the collection ``messages``."""
    keyed = {"queue": queue, "ordering_key": {"$type": "string"}}
    in_flight = messages.distinct("ordering_key", {**keyed, "leased_until": {"$gt": now}})
    waiting = messages.count_documents(
        {**keyed, "$or": [{"leased_until": None}, {"leased_until": {"$lte": now}}]})
    return OrderedKeys(in_flight=len(in_flight), waiting=int(waiting))


#: Delivery counts a claim increments: from 2**31 - 1 on, ``$inc`` could overflow a
#: 32-bit count on a server.
_MAX_DELIVERIES = 2**31 - 1


def _either(field: str, *conditions: Any) -> dict[str, Any]:
    """``field`` meets one of ``conditions`` (``None``: null or absent)."""
    return {"$or": [{field: condition} for condition in conditions]}


def _readable(max_bytes: int) -> dict[str, Any]:
    """The filter of documents a claim can use as they are, and read whole: fields of the
    types idembus writes, a delivery count that can grow, a body within ``max_bytes`` (or
    of no recorded size: written by another client)."""
    return {
        "deliveries": {"$type": "number", "$lt": _MAX_DELIVERIES},
        "body": {"$type": "binData"},
        "$and": [
            _either("headers", {"$type": "string"}, {"$type": "object"}),
            _either("content_type", None, {"$type": "string"}),
            _either("content_encoding", None, {"$type": "string"}),
            _either("size", {"$exists": False}, {"$type": "number", "$lte": max_bytes}),
        ],
    }


def _is_count(value: Any) -> TypeGuard[float]:
    """A number that counts: an int, or a finite float (not a bool)."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and value == value and abs(value) != float("inf"))


def _flaws(document: Mapping[str, Any], *, is_bytes: bool, max_bytes: int) -> list[str]:
    """What keeps a claim from using ``document`` (due, read without its body) as it
    is."""
    flaws = []
    deliveries = document.get("deliveries")
    if not _is_count(deliveries) or deliveries >= _MAX_DELIVERIES:
        flaws.append(f"its delivery count is {wire.shown(deliveries)}, not a number below "
                     f"{_MAX_DELIVERIES}")
    if not is_bytes:
        flaws.append("its body is missing or not bytes")
    headers = document.get("headers")
    if not isinstance(headers, (str, Mapping)):
        flaws.append(f"its headers are {wire.shown(headers)}, not text or a document")
    for name, field in (("content type", "content_type"),
                        ("content encoding", "content_encoding")):
        if not isinstance(document.get(field), (str, type(None))):
            flaws.append(f"its {name} is {wire.shown(document.get(field))}, not text")
    size = document.get("size")
    if "size" in document and not _is_count(size):
        flaws.append(f"its size is {wire.shown(size)}, not a number")
    elif _is_count(size):
        flaws.append(oversize(int(size), None, max_bytes) or "")
    return [flaw for flaw in flaws if flaw]


def _document_id(envelope: Envelope, queue: str, headers: str, body: bytes) -> str:
    """The message id, then a digest of what makes this copy this copy: the same bytes to
    the same queue are the same document."""
    digest = hashlib.sha256(b"\0".join((queue.encode("utf-8", "surrogateescape"),
                                         headers.encode("ascii"), body))).hexdigest()[:32]
    return f"{envelope.headers.get(h.MESSAGE_ID, '')}:{digest}"


def _client_lock(client: Any) -> Any:
    """The lock of every transport on this mongomock client, kept on the client itself."""
    attributes = vars(client)
    return attributes.setdefault("_idembus_transport_lock", threading.RLock())


class _Wakeups:
    """The wake-ups of the idle consumers of one mongomock client, in this process (the
    only one that can see its collections): a count per queue, raised by each insert and
    each settlement that frees a message, and a condition to wait for it on."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._counts: dict[str, int] = {}

    def count(self, queue: str) -> int:
        """How many wake-ups ``queue`` has had."""
        with self._changed:
            return self._counts.get(queue, 0)

    def wake(self, queues: Collection[str]) -> None:
        """Wake the idle consumers of ``queues``."""
        with self._changed:
            for queue in queues:
                self._counts[queue] = self._counts.get(queue, 0) + 1
            self._changed.notify_all()

    def wait(self, queue: str, seen: int, seconds: float) -> bool:
        """Wait until ``queue`` has had more than ``seen`` wake-ups (True), or ``seconds``
        passed (False)."""
        with self._changed:
            return self._changed.wait_for(lambda: self._counts.get(queue, 0) != seen, seconds)


def _client_wakeups(client: Any) -> _Wakeups:
    """The wake-ups of every transport on this mongomock client, kept on the client."""
    with _client_lock(client):
        wakeups: _Wakeups = vars(client).setdefault("_idembus_wakeups", _Wakeups())
    return wakeups


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _aware(moment: datetime.datetime) -> datetime.datetime:
    """A stored time in UTC (mongomock, and clients without tz_aware, return it naive)."""
    return moment if moment.tzinfo else moment.replace(tzinfo=datetime.timezone.utc)

