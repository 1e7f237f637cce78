"""A transport whose queues are a MongoDB collection (pymongo), or mongomock in one process.

Features
========
* One collection holds the messages of every queue, ``<prefix>_queue``::

      {_id: "<message id>:<digest>", queue, headers: <JSON text>, body: <bytes>,
       size: <bytes in body>, content_type, content_encoding, visible_at,
       order: <ObjectId>, leased_until, lease, deliveries, ordering_key}

  beside ``<prefix>_queues`` (``{_id: <queue>}``) and ``<prefix>_subscriptions``
  (``{_id, message_type, queue}``).
* The ``_id`` is the message id followed by a digest of the queue, headers and body: an
  outbox re-send of a message still queued (the same bytes) is the same ``_id`` and the
  insert deduplicates it, while different messages that share an id — one event failed by
  two endpoints into one error queue, a delayed retry of a message still in flight — are
  all kept.
* A consumer claims the oldest due message of its queue with ``find_one_and_update``
  (``visible_at`` passed, no live lease), setting a lease (``leased_until``, ``lease``),
  up to ``prefetch`` of them; acknowledging deletes it, requeueing clears the lease (it
  keeps its place). Unsettled deliveries have their leases renewed every third of
  ``visibility_timeout``; a consumer that dies renews nothing, and its messages are
  delivered again once their leases run out.
* Ordered messages: a sent command's ``idembus.ordering.key`` header is kept in
  ``ordering_key``. A claim passes over a document while an older one (by ``order``, the
  sender's ObjectId) of its key is in its queue — waiting, delayed, or claimed and not
  settled — taking the oldest due one as before but giving back at once, as it was, one
  whose key has an older document, then leaving that key out. Acknowledging an ordered
  message wakes its queue's idle consumers.
* Delayed delivery is native: ``visible_at`` is the due time (``idembus.deliver_at``).
* Size before body: idembus writes each body's size beside it (``size``). A claim takes
  only documents whose fields it can use as they are (``$type`` checks: a numeric
  delivery count below 2**31 - 1, a binary body, headers that are text or a document,
  a content type and encoding that are text or absent, a numeric size within the
  queue's limit, when there is one). When those run short, a consumer moves the other
  due documents of its queue to the error queue inside the database — claimed with a
  projection without the body, then updated: queue, failure headers with the reason (the
  original headers kept in ``original_headers`` when they could not be read), due now —
  and never reads their bodies (a document whose due time is not a time is never due:
  it stays where it is, in nobody's way); ``browse`` and ``inspect`` leave a body over
  the limit in the database until a tool reads that message's body. A document written
  by another client without ``size`` is read whole, as before (MongoDB bounds it at
  16 MiB). **Not measured in the database**: mongomock has neither ``$bsonSize`` nor
  ``$binarySize``, so the recorded ``size`` is trusted (a writer that lies about it is
  read whole, within the document limit); a real server could measure the body with
  ``$binarySize`` (MongoDB 4.4), left undone as nothing here could verify it.
* A reply queue (``bus.request``) has a lease, ``lease_until`` in its ``<prefix>_queues``
  document, which its process renews; a reply sent to it once the lease ran out is
  refused, and any process that consumes a reply queue, or starts an endpoint, deletes
  the expired ones with their messages (:mod:`.reply_leases`).
* Publish/subscribe: ``declare`` writes the queue's subscriptions; ``publish`` inserts one
  copy for each queue subscribed to the event's type or a type it derives from
  (``idembus.enclosed_types``), and returns False when there was none. Sends to a queue
  nobody declared are refused (``DestinationRefused``).
* Waking idle consumers: on a real server, each insert also writes a signal into a capped
  collection, ``<prefix>_signals``, that idle consumers follow with a tailable cursor
  (``TAILABLE_AWAIT``), so they wake at once without polling; they also wake when the next
  delayed message or lease is due, and at least every ``max_idle_wait`` seconds. On
  mongomock (no capped collections, no tailable cursors) an idle consumer is woken inside
  the process by the same inserts and settlements, and polls too, from 5 ms up to
  ``poll_interval`` seconds.
* Times are this process's clock (mongomock has no server time): leases and due times of
  processes whose clocks differ are off by the difference.

**Verified only on a real server**: the capped signal collection and its tailable cursor
are written against pymongo's documented API (``create_collection(capped=True)``,
``CursorType.TAILABLE_AWAIT``, ``max_await_time_ms``) and guarded — if they fail, the
consumer logs it once and polls as on mongomock — but no MongoDB server can be installed
where idembus is built, so they have not run. Everything else runs on mongomock in the
transport contract suite, and on a real server when ``IDEMBUS_MONGODB_URL`` is set.

mongomock
=========
mongomock is not thread-safe: every operation of the transports sharing one mongomock
client goes through one lock, kept on that client.

Failures
========
pymongo's errors by the MongoDB storage's taxonomy (:func:`idembus.storage.mongo.translated`):
connection failures and retryable codes are ``TransportUnavailable`` (a consumer waits
them out), a refused login or privilege ``BrokerAccessDenied``, what the server refuses of
one message (a document over 16 MiB) ``DestinationRefused``.

Connection String
=================
``MongoTransport("mongodb://host:27017/?replicaSet=rs0", database="shop")``, a
``pymongo.MongoClient``, or a ``mongomock.MongoClient`` shared by the transports of one
process; ``Endpoint(transport="mongodb://host:27017/shop")`` builds one on the URL's
database (``idembus`` without one).

Options
=======
``database``            the database (``idembus``)
``collection_prefix``   prefix of the collections (``idembus``)
``visibility_timeout``  seconds after which a claimed message whose consumer stopped
                        renewing its lease is delivered again (15)
``max_idle_wait``       most seconds an idle consumer waits without looking (5)
``poll_interval``       longest wait between two looks of an idle consumer on mongomock (0.1)
``reconnect_backoff``   waits between a consumer's attempts after an outage
``reply_lease``         seconds a reply queue (``bus.request``) outlives a requester that
                        died without closing its endpoint (30; renewed every third of it)
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import secrets
import urllib.parse
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import bson
import pymongo
import pymongo.errors

from .. import headers as h
from .. import wire
from ..envelope import Envelope
from ..errors import ConfigurationError
from ..policies import Backoff
from ..redaction import redact
from ..routing import base_queue
from ..storage.errors import StorageError
from ..storage.mongo import is_mongomock, translated
from .base import Delivery, OrderedKeys, QueueDepth
from .database import (
    MAX_METADATA_BYTES,
    check_prefix,
    encode_headers,
    failure_story,
    read_headers,
    routing_names,
    transport_error,
)
from .db_engine import Claim, DatabaseTransport
from .errors import BrokerAccessDenied, DestinationRefused, TransportError
from .mongo_documents import (
    _aware,
    _client_lock,
    _client_wakeups,
    _document_id,
    _due,
    _flaws,
    _MongoDelivery,
    _now,
    _readable,
    behind,
    ordered_keys,
    pass_over,
    queue_depth,
)
from .mongo_reading import MongoReading
from .mongo_replies import MongoReplyQueues
from .mongo_watch import _Watch
from .reply_leases import is_reply_queue

log = logging.getLogger(__name__)


#: Size of the capped signal collection, in bytes (signals are a few dozen bytes each).
SIGNALS_SIZE = 1 << 20


class MongoTransport(MongoReplyQueues, MongoReading,
                     DatabaseTransport[_MongoDelivery, None]):
    """Transport on MongoDB collections; see the module docstring."""

    def __init__(
        self,
        client: Any,
        *,
        database: str | None = None,
        collection_prefix: str = "idembus",
        visibility_timeout: float = 15.0,
        max_idle_wait: float = 5.0,
        poll_interval: float = 0.1,
        reconnect_backoff: Backoff | None = None,
        reply_lease: float = 30.0,
    ) -> None:
        if min(visibility_timeout, max_idle_wait, poll_interval, reply_lease) <= 0:
            raise ConfigurationError("visibility_timeout, max_idle_wait, poll_interval and "
                                     "reply_lease must be positive seconds")
        self.reply_lease = float(reply_lease)
        check_prefix(collection_prefix)
        super().__init__()
        if isinstance(client, str):
            url = client
            database = database or urllib.parse.urlsplit(url).path.lstrip("/") or None
            options: dict[str, Any] = {} if "serverselectiontimeoutms" in url.lower() else {
                "serverSelectionTimeoutMS": 5000}
            try:
                client = pymongo.MongoClient(url, tz_aware=True, **options)
            except (pymongo.errors.ConfigurationError, ValueError) as exc:
                raise ConfigurationError(
                    f"transport URL {redact(url)!r} cannot be used: {redact(str(exc))}; use "
                    "mongodb://user:password@host:27017/database") from exc
            self._owns_client = True
        else:
            url = f"mongodb ({type(client).__module__.split('.')[0]})"
            self._owns_client = False
        self.client = client
        #: Where the transport connects, as it may be shown (password hidden).
        self.safe_url = redact(url)
        self.database = client[database or "idembus"]
        self.process_local = is_mongomock(client)
        self.messages = self.database[f"{collection_prefix}_queue"]
        self.queues = self.database[f"{collection_prefix}_queues"]
        self.subscriptions = self.database[f"{collection_prefix}_subscriptions"]
        self._signals_name = f"{collection_prefix}_signals"
        #: The capped collection idle consumers tail; ``None`` until made, or on mongomock.
        self._signals: Any = None
        self.poll_interval = poll_interval
        self._start_engine(url=self.safe_url, visibility_timeout=visibility_timeout,
                           max_idle_wait=max_idle_wait, backoff=reconnect_backoff,
                           name="idembus-mongo-leases")
        self._guard: AbstractContextManager[Any] = (
            _client_lock(client) if self.process_local else contextlib.nullcontext())
        self._known_queues: set[str] = set()
        self._indexed = False
        #: How idle consumers on mongomock are woken in this process (``None``: a server).
        self._wakeups = _client_wakeups(client) if self.process_local else None

    @classmethod
    def embedded(cls, database: str = "idembus", **options: Any) -> MongoTransport:
        """A transport on a mongomock client of its own (one process, one transport: give
        transports that must see each other one shared ``mongomock.MongoClient``)."""
        import mongomock

        return cls(mongomock.MongoClient(), database=database, **options)

    # -- schema -----------------------------------------------------------------------

    def migrate(self) -> bool:
        """Create the indexes (and, on a real server, the capped signal collection)."""
        with self._op("creating the transport's indexes", refusal=BrokerAccessDenied):
            self.messages.create_index([("queue", 1), ("visible_at", 1), ("order", 1)],
                                       name="idembus_ready")
            self.subscriptions.create_index([("message_type", 1)], name="idembus_routes")
            self.messages.create_index(
                [("queue", 1), ("ordering_key", 1), ("order", 1)], name="idembus_ordering",
                partialFilterExpression={"ordering_key": {"$type": "string"}})
        self._indexed = True
        if not self.process_local:
            self._make_signals()
        return True

    def _make_signals(self) -> None:
        """The capped signal collection, with one document (a tailable cursor on an empty
        capped collection dies at once). Unverified here: see the module docstring."""
        try:
            with contextlib.suppress(pymongo.errors.CollectionInvalid):
                self.database.create_collection(self._signals_name, capped=True,
                                                size=SIGNALS_SIZE)
            signals = self.database[self._signals_name]
            if signals.find_one() is None:
                signals.insert_one({"queue": None})
            self._signals = signals
        except pymongo.errors.PyMongoError as exc:
            log.warning("idle consumers of %s will poll: the signal collection %s cannot be "
                        "used (%s)", self.safe_url, self._signals_name, redact(str(exc)))

    def drop_tables(self) -> None:
        """Drop the collections and every message in them (tests and samples clean up)."""
        with self._op("dropping the transport's collections"):
            for name in (self.messages.name, self.queues.name, self.subscriptions.name,
                         self._signals_name):
                self.database.drop_collection(name)
        self._indexed = False
        self._known_queues.clear()

    # -- topology ---------------------------------------------------------------------

    def declare(self, queue: str, *, subscriptions: Collection[str] = ()) -> None:
        if not queue:
            raise ConfigurationError("a queue needs a name")
        if not self._indexed:
            self.migrate()
        with self._op(f"declaring queue {queue!r}", refusal=BrokerAccessDenied):
            self.queues.update_one({"_id": queue}, {"$setOnInsert": {"declared_at": _now()}},
                                   upsert=True)
            for name in sorted(subscriptions):
                self.subscriptions.update_one(
                    {"_id": f"{name}\n{queue}"},
                    {"$set": {"message_type": name, "queue": queue}}, upsert=True)
        self._known_queues.add(queue)

    def delete_queue(self, queue: str) -> None:
        """Delete ``queue``, its messages and its subscriptions (tests and samples)."""
        with self._op(f"deleting queue {queue!r}"):
            self.messages.delete_many({"queue": queue})
            self.subscriptions.delete_many({"queue": queue})
            self.queues.delete_one({"_id": queue})
        self._known_queues.discard(queue)

    # -- sending ----------------------------------------------------------------------

    def send(self, envelope: Envelope) -> None:
        queue = envelope.destination and base_queue(envelope.destination)
        if not queue:
            raise ValueError(f"message {envelope.headers.get(h.MESSAGE_ID)} has no destination "
                             "queue")
        what = f"putting {envelope.headers.get(h.MESSAGE_ID, 'a message without id')} on {queue!r}"
        reply = is_reply_queue(queue)  # looked up each time: its requester may be gone
        if reply or queue not in self._known_queues:
            with self._op(what):
                found = self.queues.find_one({"_id": queue})
            if found is None:
                raise DestinationRefused(
                    f"no queue {queue!r} in {self.queues.name} at {self.safe_url}: no endpoint "
                    "declared it (start the endpoint that consumes it, or correct the route)")
            self.check_lease(found)
            if not reply:
                self._known_queues.add(queue)
        self._insert(envelope, [queue], what)

    def publish(self, envelope: Envelope) -> bool:
        """Insert a copy for every queue subscribed to one of the event's types; False if
        there was none."""
        names = routing_names(envelope)
        what = (f"publishing {envelope.headers.get(h.MESSAGE_ID, 'a message without id')} "
                f"({envelope.message_type})")
        with self._op(what):
            queues = sorted({document["queue"] for document in self.subscriptions.find(
                {"message_type": {"$in": names}}, {"queue": 1})})
        self._insert(envelope, queues, what)
        return bool(queues)

    def _insert(self, envelope: Envelope, queues: list[str], what: str) -> None:
        if not queues:
            return
        now = _now()
        due = envelope.deliver_at
        visible_at = max(due, now) if due is not None else now
        headers = encode_headers(envelope.headers)
        # The key of an ordered command (only a sent one: a published event has none).
        key = envelope.headers.get(h.ORDERING_KEY) if envelope.destination else None
        with self._op(what):
            body = envelope.body.encode("utf-8", "surrogateescape")
        documents = [{
            "_id": _document_id(envelope, queue, headers, body), "queue": queue,
            "headers": headers, "body": body, "size": len(body),
            "content_type": envelope.content_type,
            "content_encoding": envelope.content_encoding, "visible_at": visible_at,
            "order": bson.ObjectId(), "leased_until": None, "lease": None, "deliveries": 0,
            **({"ordering_key": key} if key is not None else {}),
        } for queue in queues]
        with self._op(what):
            try:
                self.messages.insert_many(documents, ordered=False)
            except pymongo.errors.BulkWriteError as exc:
                others = [e for e in exc.details.get("writeErrors", []) if e.get("code") != 11000]
                if others:  # a duplicate key is a copy already queued: deduplicated
                    raise
        self._signal(queues)

    def _signal(self, queues: list[str]) -> None:
        """Wake the idle consumers of ``queues`` (real servers; best effort: they also look
        every ``max_idle_wait`` seconds)."""
        if self._wakeups is not None:
            self._wakeups.wake(queues)
        if self._signals is None:
            return
        try:
            self._signals.insert_many([{"queue": queue} for queue in queues])
        except pymongo.errors.PyMongoError:
            log.debug("could not signal %s", queues, exc_info=True)

    # -- consuming: the engine's primitives ------------------------------------------

    def _session(self, queue: str) -> AbstractContextManager[None]:
        """Nothing of its own: a consumer claims through the client's pool."""
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def _waiter(self, queue: str) -> Iterator[_Watch]:
        watch = _Watch(self, queue)
        try:
            yield watch
        finally:
            watch.close()

    def _claim(self, session: None, queue: str, limit: int) -> Claim[_MongoDelivery]:
        """Up to ``limit`` documents, unusable ones moved aside; claim again at once while
        anything was claimed or moved."""
        claimed, moved = self._claim_documents(queue, limit, move_aside=True)
        return Claim(claimed, again=bool(claimed) or moved > 0)

    def _take(self, queue: str, limit: int | None) -> list[_MongoDelivery]:
        return self._claim_documents(queue, limit, move_aside=False)[0]

    def _claim_documents(self, queue: str, limit: int | None, *,
               move_aside: bool) -> tuple[list[_MongoDelivery], int]:
        """Up to ``limit`` due messages of ``queue`` (all for ``None``), leased here, oldest
        due first (their leases are renewed until they are settled), and how many were
        moved aside. First those a claim can use as they are (:func:`_readable`), whole;
        if they are fewer than ``limit``, the due ones it cannot (a body over the queue's
        limit, fields of other types), claimed without their bodies: a consumer
        (``move_aside``) moves them to the error queue inside the database, a tool gets
        them with their bodies left there. (Looking for those only when the others run
        short keeps a claim on the index: ``$nor`` cannot use it.)"""
        token = secrets.randbits(63)
        limits = self.body_limit(queue)
        move_aside = move_aside and limits.error_queue != queue
        claimed: list[_MongoDelivery] = []
        moved = 0
        with self._op(f"consuming {queue!r}", refusal=BrokerAccessDenied):
            passed: list[Any] = []  # keys in flight, or claimed here already
            while limit is None or len(claimed) < limit:
                now = _now()
                document = self.messages.find_one_and_update(
                    {**_due(queue, now), **_readable(limits.max_bytes),
                     **({"ordering_key": {"$nin": passed}} if passed else {})},
                    {"$set": {"leased_until": now + datetime.timedelta(
                        seconds=self.visibility_timeout), "lease": token},
                     "$inc": {"deliveries": 1}},
                    sort=[("visible_at", 1), ("order", 1)],
                    return_document=pymongo.ReturnDocument.AFTER)
                if document is None:
                    break
                key = document.get("ordering_key")
                if key is not None:
                    passed.append(key)
                    if behind(self.messages, queue, document):
                        pass_over(self.messages, document, token)
                        if not behind(self.messages, queue, document):
                            # Its elder was settled meanwhile, and whoever claimed then
                            # saw it leased here: it is free now, look for it again.
                            passed.remove(key)
                        continue
                claimed.append(_MongoDelivery(self, queue, document, lease=token))
            while limit is None or len(claimed) + moved < limit:
                now = _now()
                document = self.messages.find_one_and_update(
                    {"$and": [_due(queue, now), {"$nor": [_readable(limits.max_bytes)]}]},
                    {"$set": {"leased_until": now + datetime.timedelta(
                        seconds=self.visibility_timeout), "lease": token}},
                    projection={"body": 0}, sort=[("visible_at", 1), ("order", 1)],
                    return_document=pymongo.ReturnDocument.BEFORE)
                if document is None:
                    break
                if move_aside:
                    self._move_aside(queue, document, token)
                    moved += 1
                else:
                    claimed.append(_MongoDelivery(self, queue, document, lease=token))
        self._leases.hold(claimed)
        return claimed, moved

    def _move_aside(self, queue: str, document: Mapping[str, Any], lease: int) -> None:
        """Move ``document`` (claimed with ``lease``, read without its body) to the error
        queue of ``queue``, with failure headers saying what is wrong with it."""
        limits = self.body_limit(queue)
        raw = document.get("headers")
        encoding = document.get("content_encoding")
        headers, unreadable = read_headers(raw, encoding if isinstance(encoding, str) else None)
        is_bytes = self.messages.count_documents(
            {"_id": document["_id"], "body": {"$type": "binData"}}, limit=1) > 0
        reason = "; ".join(_flaws(document, is_bytes=is_bytes, max_bytes=limits.max_bytes)
                           or ["it is not a message idembus can read"])
        story = failure_story(headers, f"{reason} (moved to {limits.error_queue!r} by the "
                              "database, unread)", queue=queue)
        changes: dict[str, Any] = {
            "queue": limits.error_queue, "headers": encode_headers({**headers, **story}),
            "visible_at": _now(), "order": bson.ObjectId(), "leased_until": None,
            "lease": None, "deliveries": 0, "ordering_key": None}
        if (unreadable or not isinstance(raw, str)) and len(
                bson.encode({"kept": raw})) <= MAX_METADATA_BYTES:
            changes["original_headers"] = raw  # as written (bounded: the document must fit)
        self.messages.update_one({"_id": document["_id"], "lease": lease}, {"$set": changes})
        log.warning("moved %s from %r to %r inside the database, unread: %s",
                    wire.shown(headers.get(h.MESSAGE_ID, "a message without id")), queue,
                    limits.error_queue, reason)
        self._signal([limits.error_queue])

    def _idle_wait(self, session: None, queue: str, claim: Claim[_MongoDelivery]) -> float:
        """Seconds until the next delayed message or lease of ``queue`` is due, at most
        ``max_idle_wait``."""
        now = _now()
        found = []
        with self._op(f"consuming {queue!r}", refusal=BrokerAccessDenied):
            for field, condition in (
                    ("visible_at", {"visible_at": {"$gt": now}}),
                    ("leased_until", {"visible_at": {"$lte": now},
                                      "leased_until": {"$gt": now}})):
                first = self.messages.find_one({"queue": queue, **condition},
                                               {field: 1}, sort=[(field, 1)])
                if first is not None:
                    found.append((_aware(first[field]) - now).total_seconds())
        return max(0.0, min([*found, self.max_idle_wait]))

    # -- settling ---------------------------------------------------------------------

    def _delete_row(self, delivery: _MongoDelivery) -> None:
        """Delete ``delivery``'s document; if it was an ordered message, wake its queue's
        idle consumers (the next message of its key is free)."""
        with self._op(f"acknowledging a message of {delivery.queue!r}"):
            self.messages.delete_one({"_id": delivery.document_id})
        if h.ORDERING_KEY in delivery.headers:
            self._signal([delivery.queue])

    def _clear_leases(self, deliveries: Sequence[_MongoDelivery]) -> None:
        """Clear the leases their claims still hold (they keep their places); wake the
        queue's idle consumers."""
        with self._op(f"requeueing messages of {deliveries[0].queue!r}"):
            for delivery in deliveries:
                self.messages.update_one({"_id": delivery.document_id, "lease": delivery.lease},
                                         {"$set": {"leased_until": None, "lease": None}})
        self._signal(sorted({delivery.queue for delivery in deliveries}))

    def renew(self, deliveries: Sequence[_MongoDelivery]) -> None:
        """Extend the leases their claims still hold (every third of the timeout)."""
        until = _now() + datetime.timedelta(seconds=self.visibility_timeout)
        with self._op("renewing leases"):
            for delivery in deliveries:
                self.messages.update_one({"_id": delivery.document_id, "lease": delivery.lease},
                                         {"$set": {"leased_until": until}})

    # -- tools ------------------------------------------------------------------------

    def get(self, queue: str) -> Delivery | None:
        with self._op(f"taking a message of {queue!r}"):
            document = self.messages.find_one_and_delete(
                _due(queue, _now()), sort=[("visible_at", 1), ("order", 1)])
        return None if document is None else _MongoDelivery(self, queue, document, lease=0,
                                                             settled=True)

    def pending(self, queue: str) -> int:
        with self._op(f"counting {queue!r}", refusal=BrokerAccessDenied):
            return int(self.messages.count_documents(_due(queue, _now())))

    def depth(self, queue: str) -> QueueDepth:
        """Ready, leased and delayed documents of ``queue``, and the oldest ready one's wait."""
        with self._op(f"counting {queue!r}", refusal=BrokerAccessDenied):
            return queue_depth(self.messages, queue, _now())

    def ordered_keys(self, queue: str) -> OrderedKeys:
        """Keys of ``queue`` in flight and ordered documents waiting."""
        with self._op(f"counting {queue!r}", refusal=BrokerAccessDenied):
            return ordered_keys(self.messages, queue, _now())

    # -- the seam -----------------------------------------------------------------------

    @contextlib.contextmanager
    def _op(self, what: str, *, refusal: type[TransportError] = DestinationRefused,
            ) -> Iterator[None]:
        """One operation on the database: behind mongomock's lock, its failures as
        transport errors (``refusal`` for what is neither an outage nor the endpoint's)."""
        try:
            with self._guard, translated():
                yield
        except StorageError as exc:
            error = transport_error(exc, f"{what} on {self.safe_url}")
            if isinstance(error, DestinationRefused) and refusal is not DestinationRefused:
                error = refusal(str(error))
            raise error from exc
        except UnicodeEncodeError as exc:  # text that cannot be stored as UTF-8
            raise refusal(f"{what} on {self.safe_url}: {exc}") from exc

    def _disconnect(self) -> None:
        if self._owns_client:
            self.client.close()
