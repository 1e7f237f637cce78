"""An endpoint's failed messages: kept in its storage, read, retried and purged from there.

The error queue is an inbox of failures, not where they are looked at: :func:`ingest` moves
what is in it into the endpoint's storage (the store of parked messages, :mod:`idembus.
parking`), acknowledging each broker message only after its storage write returned, and
every view — ``idembus errors list/show/export``, the dashboard — reads the storage only, a
page at a time. Reading a quorum queue with ``basic.get`` and giving the message back is a
redelivery that raises its ``x-delivery-count``, and a delivery limit (a policy,
``x-delivery-limit``, RabbitMQ 4's default of 20) then drops every failed message after a
few looks; a row in the storage can be looked at any number of times. What :func:`ingest`
reads is acknowledged (moved), or, when it failed in another endpoint's queue (a shared
error queue), given back as a fresh copy (without the broker's delivery count) before the
original is acknowledged: nothing read is ever requeued. On RabbitMQ, :func:`ingest`
returns only once the broker has applied its acknowledgements.

* :class:`FailedMessage`: one message's failure story, from its headers;
* :class:`Selection`: message ids, everything, or a filter (type, exception, time of
  failure);
* :func:`look` goes through the error queue's messages without moving them, for a
  storage whose tables were never created;
* :func:`reading` moves the error queue's messages into the storage, then goes through the
  endpoint's failed messages a page at a time; :func:`survey` and :func:`chosen_pages`
  select a page at a time what a retry or purge acts on, bounded by what was counted and
  confirmed (a message failed meanwhile is not among them);
* :func:`retry` sends one back where it failed and only then removes it; :func:`purge`
  removes a page of them for good. Both then release the hold a copy of a claim-checked
  message had on its body (:func:`idembus.storage.claims.hold`).

A moved message is idempotent in the storage: its id derives from its queue, headers and
body (:func:`idembus.parking.parked_id`), so the same message moved twice (the process died
between the write and the acknowledgement) is kept once.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from ... import headers as h
from ...envelope import Envelope, parse_utc, utc_now
from ...errors import ConfigurationError
from ...failures import without_failure_headers
from ...redaction import redact
from ...storage.base import (
    MOVED_FROM_ERROR_QUEUE,
    SETTLED_FROM_ERROR_QUEUE,
    ParkedKey,
    ParkedMessage,
    ParkingStore,
    parked_key,
)
from ...storage.claims import release, retention_of
from ...storage.errors import StorageError
from ...transports.base import Delivery
from ...transports.errors import TransportUnavailable
from .parking import ParkedDelivery, keep, parked_id

if TYPE_CHECKING:
    from ..endpoint import Endpoint

log = logging.getLogger(__name__)

#: How many failed messages :func:`ingest` and :func:`reading` hold at a time.
PAGE = 100
#: How often :func:`ingest` asks the broker how many messages wait (at the start, then
#: for what arrived meanwhile or was not counted yet).
_LOOKS = 2
#: How long what is left of a retried or purged message is kept (see :func:`settle`).
SETTLED_KEPT = datetime.timedelta(days=14)


@dataclass(frozen=True)
class FailedMessage:
    """One message of the error queue, as its failure headers tell it."""

    message_id: str | None
    message_type: str | None
    exception_type: str | None
    exception_message: str | None
    failed_queue: str | None
    time_of_failure: str | None
    #: The attempts counted by the failure headers (``None``: no such header, or not a
    #: whole number).
    immediate_attempts: int | None
    delayed_attempts: int | None
    #: Kept in the storage because the broker refused it a place (:mod:`.parking`),
    #: not moved there from the error queue.
    parked: bool = False
    #: Its id in the storage (a copy of a message: each failure of it has its own).
    stored_id: str | None = None

    @classmethod
    def of(cls, delivery: Delivery) -> FailedMessage:
        """Read the failure story from a delivery's headers."""
        headers = delivery.headers
        stored = delivery.parked if isinstance(delivery, ParkedDelivery) else None
        return cls(
            parked=stored is not None and stored.source != MOVED_FROM_ERROR_QUEUE,
            stored_id=stored.parked_id if stored is not None else None,
            message_id=headers.get(h.MESSAGE_ID),
            message_type=headers.get(h.MESSAGE_TYPE),
            exception_type=headers.get(h.EXCEPTION_TYPE),
            exception_message=headers.get(h.EXCEPTION_MESSAGE),
            failed_queue=headers.get(h.FAILED_QUEUE),
            time_of_failure=headers.get(h.TIME_OF_FAILURE),
            immediate_attempts=_count(headers.get(h.IMMEDIATE_ATTEMPTS)),
            delayed_attempts=_count(headers.get(h.DELAYED_ATTEMPTS)),
        )

    @property
    def failed_at(self) -> datetime.datetime | None:
        """The time of failure, if its header is readable."""
        return parse_utc(self.time_of_failure)


def _count(header: str | None) -> int | None:
    """An attempt count header as a number (``None``: absent, or not a whole number)."""
    try:
        return int(header) if header is not None and header.strip().isdigit() else None
    except ValueError:  # digits of another script that int() refuses
        return None


def exception_matches(exception_type: str | None, wanted: str) -> bool:
    """True if ``wanted`` is the full dotted name of the exception type or its last part."""
    if not exception_type:
        return False
    return wanted in (exception_type, exception_type.rsplit(".", 1)[-1])


@dataclass(frozen=True)
class Selection:
    """Which failed messages to act on: ``ids`` (every copy of each), ``everything``, or a
    filter — ``message_type`` exactly, ``exception`` by its full or last dotted name, and
    a time of failure from ``failed_after`` (inclusive) to ``failed_before`` (exclusive);
    the parts of a filter given must all match."""

    ids: tuple[str, ...] = ()
    everything: bool = False
    message_type: str | None = None
    exception: str | None = None
    failed_after: datetime.datetime | None = None
    failed_before: datetime.datetime | None = None

    @property
    def by_filter(self) -> bool:
        return any(part is not None for part in (self.message_type, self.exception,
                                                  self.failed_after, self.failed_before))

    def require(self, command: str) -> None:
        """Refuse an empty or ambiguous selection (ConfigurationError: exit status 2)."""
        kinds = [bool(self.ids), self.everything, self.by_filter]
        if sum(kinds) == 0:
            raise ConfigurationError(
                f"errors {command} needs a selection: message ids, --all, --type or "
                "--exception")
        if sum(kinds) > 1:
            raise ConfigurationError(
                f"errors {command}: give message ids, --all, or --type/--exception, "
                "not several of them")

    def matches(self, delivery: Delivery) -> bool:
        headers = delivery.headers
        if self.ids:
            return headers.get(h.MESSAGE_ID) in self.ids
        if self.message_type is not None and headers.get(h.MESSAGE_TYPE) != self.message_type:
            return False
        if self.exception is not None and not exception_matches(
                headers.get(h.EXCEPTION_TYPE), self.exception):
            return False
        if self.failed_after is not None or self.failed_before is not None:
            failed_at = parse_utc(headers.get(h.TIME_OF_FAILURE))
            if failed_at is None:
                return False
            if self.failed_after is not None and failed_at < self.failed_after:
                return False
            if self.failed_before is not None and failed_at >= self.failed_before:
                return False
        return True

    def pick(self, deliveries: Sequence[Delivery], queue: str) -> list[Delivery]:
        """The selected deliveries; ConfigurationError if a given id is not among them."""
        chosen = [delivery for delivery in deliveries if self.matches(delivery)]
        self.refuse_missing({delivery.headers.get(h.MESSAGE_ID) for delivery in chosen}, queue)
        return chosen

    def refuse_missing(self, found: Collection[str | None], queue: str) -> None:
        """ConfigurationError if a given id is not among the ids ``found``."""
        missing = [message_id for message_id in self.ids if message_id not in found]
        if missing:
            raise ConfigurationError(
                f"no message {', '.join(missing)} in the error queue {queue!r}; nothing "
                "was changed (see: idembus errors list)")


def retried_envelope(delivery: Delivery) -> Envelope:
    """The message as it was before it failed, addressed to the queue that failed it."""
    queue = delivery.headers.get(h.FAILED_QUEUE)
    if not queue:
        raise ConfigurationError(
            f"message {delivery.headers.get(h.MESSAGE_ID, '(without id)')} has no "
            f"{h.FAILED_QUEUE} header: there is no queue to return it to")
    headers = without_failure_headers(delivery.headers)
    return Envelope(
        headers=headers,
        body=delivery.body.decode("utf-8", "surrogateescape"),
        destination=queue,
        content_type=delivery.content_type or h.CONTENT_TYPE,
        content_encoding=delivery.content_encoding,
    )


# -- moving the error queue into the storage ----------------------------------------------


def ingest(endpoint: Endpoint, *, all_endpoints: bool = False, page: int = PAGE) -> int:
    """Move the messages waiting in the endpoint's error queue now into its storage, at
    most ``page`` held at a time; how many were moved.

    Each one that failed in the endpoint's own queue (every one, ``all_endpoints``: filed
    under the endpoint whose queue failed it) is written to the storage, and only then
    acknowledged; any other is given back as a fresh copy, then acknowledged (never
    requeued: a requeue raises a quorum queue's delivery count). Returns once the broker
    applied the acknowledgements (``KombuTransport.inspect`` ends with a round trip). A
    process that dies between a write and its acknowledgement leaves the message in both
    places; the next move writes the same id again, and the storage keeps one."""
    return _through_queue(endpoint, page, lambda deliveries: _move(
        endpoint, deliveries, all_endpoints=all_endpoints))


def ingest_unless_unreachable(endpoint: Endpoint, *, all_endpoints: bool = False,
                              page: int = PAGE) -> TransportUnavailable | None:
    """:func:`ingest`; but when the broker cannot be reached, the outage (nothing was
    moved): the failed messages the storage holds can be shown all the same."""
    try:
        ingest(endpoint, all_endpoints=all_endpoints, page=page)
    except TransportUnavailable as outage:
        return outage
    return None


def look(endpoint: Endpoint, seen: Callable[[Delivery], object], *,
         all_endpoints: bool = False, page: int = PAGE) -> int:
    """Go through the messages waiting in the endpoint's error queue without moving them
    into its storage — for a storage that cannot keep them yet (its tables were never
    created, :class:`~idembus.storage.errors.SchemaMissing`): each that failed in the
    endpoint's queue (every one, ``all_endpoints``) is shown to ``seen``, and every one is
    given back as :func:`ingest` gives back another endpoint's (a fresh copy, never a
    requeue that a quorum queue counts). How many were shown."""
    shown = 0

    def glance(deliveries: Iterable[Delivery]) -> tuple[int, int]:
        nonlocal shown
        taken = 0
        held: list[Delivery] = []
        try:
            for delivery in deliveries:
                held.append(delivery)
                taken += 1
                if _stored_here(delivery, endpoint, all_endpoints):
                    seen(delivery)
                    shown += 1
                _hand_back(delivery)
                held.clear()
        except BaseException:
            _hand_back_all(held)
            raise
        return taken, 0

    _through_queue(endpoint, page, glance)
    return shown


#: What :func:`_through_queue` does with the messages of a page: how many it took and how
#: many it moved into the storage (the others it gave back).
_PageMover = Callable[[Iterable[Delivery]], tuple[int, int]]


def _through_queue(endpoint: Endpoint, page: int, mover: _PageMover) -> int:
    """Take what waits in the error queue now, a page at a time, each page given to
    ``mover``; how many it moved."""
    if page < 1:
        raise ValueError(f"page must be at least 1, got {page}")
    transport, queue = endpoint.transport, endpoint.error_queue
    remaining, moved, copies = transport.pending(queue), 0, 0
    with ExitStack() as held_back:
        for _ in range(_LOOKS):
            if remaining <= 0:  # what arrived meanwhile, or the broker had not counted yet
                remaining = transport.pending(queue) - copies  # not the copies given back
            while remaining > 0:
                taken, moved_now, copied = _move_page(endpoint, min(page, remaining),
                                                      held_back, mover)
                if not taken:
                    return moved
                remaining, moved, copies = remaining - taken, moved + moved_now, copies + copied
    return moved


def _move_page(endpoint: Endpoint, limit: int, held_back: ExitStack,
               mover: _PageMover) -> tuple[int, int, int]:
    """Move one page of the error queue (``mover``): how many were taken, moved and given
    back as copies. A transport that takes one at a time (``KombuTransport.take``) gets
    each acknowledgement before the next message is taken. Otherwise the page is taken at
    once (``Transport.inspect``), and another endpoint's messages that cannot be given
    back as copies stay taken, without their contents, until ``held_back`` ends (see
    :func:`_hand_back`)."""
    transport, queue = endpoint.transport, endpoint.error_queue
    if isinstance(transport, _Taking):
        with transport.take(queue, limit=limit) as messages:
            taken, moved = mover(messages)
        return taken, moved, taken - moved
    with ExitStack() as this_page:
        page = this_page.enter_context(transport.inspect(queue, limit=limit))
        taken, moved = mover(page)
        others = [delivery for delivery in page if not delivery.settled]
        for delivery in others:
            delivery.body, delivery.headers = b"", {}
        if others:
            held_back.enter_context(this_page.pop_all())
        return taken, moved, taken - moved - len(others)


@runtime_checkable
class _Taking(Protocol):
    """A transport that takes a queue's messages one at a time (``KombuTransport.take``)."""

    def take(self, queue: str, *,
             limit: int) -> AbstractContextManager[Iterator[Delivery]]: ...


def _stored_here(delivery: Delivery, endpoint: Endpoint, all_endpoints: bool) -> bool:
    """Whether ``delivery`` is the endpoint's to move (else: another endpoint's)."""
    return all_endpoints or delivery.headers.get(h.FAILED_QUEUE) == endpoint.name


def _move(endpoint: Endpoint, deliveries: Iterable[Delivery], *,
          all_endpoints: bool) -> tuple[int, int]:
    """Move each of ``deliveries`` that is the endpoint's into its storage, then
    acknowledge it; give back the others. How many there were, and how many moved. On a
    failure, what is unsettled is given back as fresh copies where the transport can."""
    taken = moved = 0
    held: list[Delivery] = []
    try:
        for delivery in deliveries:
            held.append(delivery)
            taken += 1
            if not _stored_here(delivery, endpoint, all_endpoints):
                _hand_back(delivery)
                continue
            owner = delivery.headers.get(h.FAILED_QUEUE) or endpoint.name
            keep(endpoint.storage_as(ParkingStore), _stored(owner, endpoint.error_queue, delivery),
                 _envelope_of(delivery))
            delivery.ack()  # only once the storage has it
            moved += 1
            held.clear()
    except BaseException:
        _hand_back_all(held)
        raise
    return taken, moved


def _envelope_of(delivery: Delivery) -> Envelope:
    """A failed delivery as the storage keeps it: addressed to the queue that failed it
    (none if it does not say: a retry then refuses it)."""
    return Envelope(dict(delivery.headers), delivery.body.decode("utf-8", "surrogateescape"),
                    delivery.headers.get(h.FAILED_QUEUE) or None,
                    delivery.content_type or h.CONTENT_TYPE, delivery.content_encoding)


def _stored(owner: str, queue: str, delivery: Delivery) -> ParkedMessage:
    envelope = _envelope_of(delivery)
    return ParkedMessage(parked_id(MOVED_FROM_ERROR_QUEUE, owner, queue, envelope), owner,
                         MOVED_FROM_ERROR_QUEUE, envelope, utc_now())


def _hand_back(delivery: Delivery) -> None:
    """Give back ``delivery``, which failed in another endpoint's queue, without counting a
    redelivery: on a kombu broker as a fresh copy, then the original acknowledged. A
    database queue's message (whose copy would be deduplicated against the original) is
    left unsettled: :func:`ingest` keeps it aside, without its contents, until it ends,
    and the transport then clears its lease (its place and counters unchanged)."""
    fresh = getattr(delivery, "requeue_fresh", None)
    if callable(fresh):
        fresh()


def _hand_back_all(taken: Sequence[Delivery]) -> None:
    """After a failure: give back what is unsettled, as fresh copies, as far as possible."""
    for delivery in taken:
        if not delivery.settled:
            try:
                _hand_back(delivery)
            except Exception as exc:  # the broker's own requeue takes over
                log.warning("could not give a failed message back to %r: %s", delivery.queue,
                            exc)


# -- reading, selecting, acting -------------------------------------------------------------


def stored(endpoint: Endpoint, *, all_endpoints: bool = False, page: int = PAGE,
           upto: ParkedKey | None = None) -> Iterator[ParkedDelivery]:
    """The endpoint's failed messages in the storage (every endpoint's, ``all_endpoints``),
    oldest first, ``page`` read at a time; none after ``upto``."""
    for found in _pages(endpoint, all_endpoints=all_endpoints, page=page, upto=upto):
        yield from found


def _pages(endpoint: Endpoint, *, all_endpoints: bool, page: int,
           upto: ParkedKey | None) -> Iterator[list[ParkedDelivery]]:
    storage = endpoint.storage_as(ParkingStore)
    owner = None if all_endpoints else endpoint.name
    after: ParkedKey | None = None
    while True:
        found = storage.parked_page(owner, after=after, limit=page)
        kept = [p for p in found if upto is None or parked_key(p) <= upto]
        _forget_settled(storage, kept)
        failed = [ParkedDelivery(storage, parked) for parked in kept
                  if parked.source != SETTLED_FROM_ERROR_QUEUE]
        if failed:
            yield failed
        if len(found) < page or len(kept) < len(found):
            return
        after = parked_key(found[-1])


def _forget_settled(storage: ParkingStore, found: Sequence[ParkedMessage]) -> None:
    """Remove what is left of messages retried or purged longer than :data:`SETTLED_KEPT`
    ago (a copy the broker gave back came back long since)."""
    expired = utc_now() - SETTLED_KEPT
    old = [parked.parked_id for parked in found
           if parked.source == SETTLED_FROM_ERROR_QUEUE and parked.parked_at < expired]
    if old:
        storage.unpark(old)


@contextmanager
def reading(endpoint: Endpoint, *, all_endpoints: bool = False,
            page: int = PAGE) -> Iterator[Iterator[ParkedDelivery]]:
    """The endpoint's failed messages one after the other, read from its storage once
    what waits in the error queue was moved there (:func:`ingest`): at most ``page`` are
    held at a time, and reading changes nothing in the broker's count of deliveries."""
    ingest(endpoint, all_endpoints=all_endpoints, page=page)
    yield stored(endpoint, all_endpoints=all_endpoints, page=page)


@dataclass(frozen=True)
class Survey:
    """What a selection chose when it was counted (and confirmed): how many, and the last
    stored message then (what a retry or purge acts on goes no further)."""

    count: int
    upto: ParkedKey | None


def survey(endpoint: Endpoint, selection: Selection, *, all_endpoints: bool = False,
           page: int = PAGE) -> Survey:
    """Move the error queue into the storage, then count what ``selection`` chooses, a
    page at a time; ConfigurationError (and nothing changed) if a given id is not there."""
    ingest(endpoint, all_endpoints=all_endpoints, page=page)
    count, upto = 0, None
    found: set[str | None] = set()
    for delivery in stored(endpoint, all_endpoints=all_endpoints, page=page):
        upto = parked_key(delivery.parked)
        if selection.matches(delivery):
            count += 1
            if selection.ids:
                found.add(delivery.headers.get(h.MESSAGE_ID))
    selection.refuse_missing(found, endpoint.error_queue)
    return Survey(count, upto)


def chosen_pages(endpoint: Endpoint, selection: Selection, counted: Survey, *,
                 all_endpoints: bool = False,
                 page: int = PAGE) -> Iterator[list[ParkedDelivery]]:
    """What ``selection`` chose when it was ``counted``, a page at a time (those retried
    or purged meanwhile are gone; those stored since are not among them)."""
    if counted.upto is None:
        return
    for found in _pages(endpoint, all_endpoints=all_endpoints, page=page,
                        upto=counted.upto):
        chosen = [delivery for delivery in found if selection.matches(delivery)]
        if chosen:
            yield chosen


def retry(endpoint: Endpoint, delivery: ParkedDelivery) -> Envelope:
    """Send ``delivery`` back where it failed — a parked one to its own destination, an
    event without one published again — then remove it from the storage (:func:`settle`):
    a crash in between leaves a copy in both places, never none. The envelope sent;
    ConfigurationError (and nothing changed) if it has no queue to go back to."""
    if delivery.parked.source == MOVED_FROM_ERROR_QUEUE:
        envelope = retried_envelope(delivery)
    else:
        envelope = delivery.retried()
    endpoint.transport.dispatch(envelope)
    # only once the broker has the retried copy
    settle(endpoint.storage_as(ParkingStore), [delivery])
    # and only then its claim-checked body's hold: kept a retention from now
    _release_holds(endpoint, [delivery], retention_of(endpoint.context.claim_check))
    return envelope


def purge(endpoint: Endpoint, deliveries: Sequence[ParkedDelivery]) -> int:
    """Remove ``deliveries`` from the storage for good (:func:`settle`), then release the
    holds they had on claim-checked bodies; how many were still there (the others were
    retried or purged meanwhile)."""
    removed = settle(endpoint.storage_as(ParkingStore), deliveries)
    _release_holds(endpoint, deliveries, datetime.timedelta(0))
    return removed


def _release_holds(endpoint: Endpoint, deliveries: Sequence[ParkedDelivery],
                   kept: datetime.timedelta) -> None:
    """Release the holds of ``deliveries`` (retried or purged) on their claim-checked
    bodies, each body kept ``kept`` from now at least. A store that cannot be reached
    leaves a hold (the body stays longer, never shorter), and says so."""
    store = endpoint.context.payloads()
    until = utc_now() + kept
    for delivery in deliveries:
        if h.CLAIM_CHECK_HOLD not in delivery.headers:
            continue
        if store is None:
            log.warning("%s has no payload store: the hold %s on the body of %s stays",
                        endpoint.name, delivery.headers[h.CLAIM_CHECK_HOLD][:80],
                        delivery.headers.get(h.MESSAGE_ID, "a message")[:200])
            continue
        try:
            release(delivery.headers, store, keep_until=until)
        except StorageError as error:
            log.warning("could not release the hold %s on a claim-checked body: %s",
                        delivery.headers[h.CLAIM_CHECK_HOLD][:80], redact(str(error)))


def settle(storage: ParkingStore, deliveries: Sequence[ParkedDelivery]) -> int:
    """Remove ``deliveries`` from ``storage``; how many were still there. Of a message
    moved from the error queue, its id stays (without headers or body) for
    :data:`SETTLED_KEPT`: should the broker give it back — RabbitMQ applies a quorum
    queue's acknowledgements asynchronously, and a connection that closes before they
    are applied returns the messages — :func:`ingest` finds the id taken and only
    acknowledges it, so a purged or retried message never reappears."""
    if not deliveries:
        return 0
    removed = storage.unpark([delivery.parked.parked_id for delivery in deliveries])
    for delivery in deliveries:
        delivery.settled = True
        parked = delivery.parked
        if parked.source == MOVED_FROM_ERROR_QUEUE:
            storage.park(ParkedMessage(parked.parked_id, parked.endpoint,
                                       SETTLED_FROM_ERROR_QUEUE, Envelope({}, "", None),
                                       utc_now()))
    return removed
