"""An endpoint's failed messages: the error queue's, and those parked in its storage.

What ``idembus errors`` and the dashboard (:mod:`idembus.dashboard`) both do with them —
read them, choose some, retry or purge them — in one place, so that the two cannot
disagree about what a selection means or how a message goes back:

* :class:`FailedMessage`: one message's failure story, from its headers;
* :class:`Selection`: message ids, everything, or a filter (type, exception, time of
  failure);
* :func:`reading` goes through the failed messages for reading only (a page at a time where
  the transport can browse); :func:`taking` takes them all unsettled, to retry or purge some;
* :func:`retry` sends one back where it failed (a parked one to its own destination) and
  only then removes it; :func:`purge` removes one for good.

Error queues are often shared: only the messages that failed in the endpoint's own queue
are its own, unless ``all_endpoints``; its parked messages always are.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from ... import headers as h
from ...envelope import Envelope, parse_utc
from ...errors import ConfigurationError
from ...failures import without_failure_headers
from ...storage.base import ParkingStore
from ...transports.base import Delivery
from .parking import ParkedDelivery, parked_deliveries

if TYPE_CHECKING:
    from ..endpoint import Endpoint

#: How many messages of the error queue :func:`reading` holds at a time.
PAGE = 100


@dataclass(frozen=True)
class FailedMessage:
    """One message of the error queue, as its failure headers tell it."""

    message_id: str | None
    message_type: str | None
    exception_type: str | None
    exception_message: str | None
    failed_queue: str | None
    time_of_failure: str | None
    immediate_attempts: str | None
    delayed_attempts: str | None
    #: Kept in the storage because the broker refused it a place
    # (``idembus.runtime.recoverability.parking``).
    parked: bool = False

    @classmethod
    def of(cls, delivery: Delivery) -> FailedMessage:
        """Read the failure story from a delivery's headers."""
        headers = delivery.headers
        return cls(
            parked=isinstance(delivery, ParkedDelivery),
            message_id=headers.get(h.MESSAGE_ID),
            message_type=headers.get(h.MESSAGE_TYPE),
            exception_type=headers.get(h.EXCEPTION_TYPE),
            exception_message=headers.get(h.EXCEPTION_MESSAGE),
            failed_queue=headers.get(h.FAILED_QUEUE),
            time_of_failure=headers.get(h.TIME_OF_FAILURE),
            immediate_attempts=headers.get(h.IMMEDIATE_ATTEMPTS),
            delayed_attempts=headers.get(h.DELAYED_ATTEMPTS),
        )

    @property
    def failed_at(self) -> datetime.datetime | None:
        """The time of failure, if its header is readable."""
        return parse_utc(self.time_of_failure)


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
        found = {delivery.headers.get(h.MESSAGE_ID) for delivery in chosen}
        missing = [message_id for message_id in self.ids if message_id not in found]
        if missing:
            raise ConfigurationError(
                f"no message {', '.join(missing)} in the error queue {queue!r}; nothing "
                "was changed (see: idembus errors list)")
        return chosen


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


def retry(endpoint: Endpoint, delivery: Delivery) -> Envelope:
    """Send ``delivery`` (taken with :func:`taking`) back where it failed — a parked one to
    its own destination, an event without one published again — then remove it: a crash
    in between leaves a copy in both places, never none. The envelope sent;
    ConfigurationError (and nothing changed) if it has no queue to go back to."""
    if isinstance(delivery, ParkedDelivery):
        envelope = delivery.retried()
        endpoint.transport.dispatch(envelope)
    else:
        envelope = retried_envelope(delivery)
        endpoint.transport.send(envelope)
    delivery.ack()  # only once the broker has the retried copy
    return envelope


def purge(delivery: Delivery) -> None:
    """Remove ``delivery`` (taken with :func:`taking`) for good."""
    delivery.ack()


def own(endpoint: Endpoint, deliveries: Iterable[Delivery], *,
        all_endpoints: bool = False) -> Iterator[Delivery]:
    """The deliveries of the error queue that failed in the endpoint's own queue (every one
    with ``all_endpoints``), then the messages it parked in its storage."""
    for delivery in deliveries:
        if all_endpoints or delivery.headers.get(h.FAILED_QUEUE) == endpoint.name:
            yield delivery
    yield from parked_deliveries(endpoint.storage_as(ParkingStore), endpoint.name)


@contextmanager
def taking(endpoint: Endpoint, *,
           all_endpoints: bool = False) -> Iterator[list[Delivery]]:
    """The endpoint's failed messages (:func:`own`), all taken unsettled for the block
    (``Transport.inspect``): retry or purge some inside it; the others go back."""
    with endpoint.transport.inspect(endpoint.error_queue) as deliveries:
        yield list(own(endpoint, deliveries, all_endpoints=all_endpoints))


@runtime_checkable
class _Browsing(Protocol):
    """A transport that reads a queue a page at a time (``KombuTransport.browse``)."""

    def browse(self, queue: str, *,
               page: int = ...) -> AbstractContextManager[Iterator[Delivery]]: ...


@contextmanager
def reading(endpoint: Endpoint, *, all_endpoints: bool = False,
            page: int = PAGE) -> Iterator[Iterator[Delivery]]:
    """The endpoint's failed messages (:func:`own`) one after the other, for reading only
    (settle none): at most ``page`` of the error queue are held at a time where the
    transport can browse, whatever the length of the queue."""
    transport = endpoint.transport
    browsing = (transport.browse(endpoint.error_queue, page=page)
                if isinstance(transport, _Browsing)
                else transport.inspect(endpoint.error_queue))
    with browsing as deliveries:
        yield own(endpoint, deliveries, all_endpoints=all_endpoints)
