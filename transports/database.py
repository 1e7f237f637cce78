"""What the transports that keep their queues in a database share (PostgreSQL, MongoDB);
their consume loop, built on these, is :mod:`.db_engine`.

* Failures: the database's own taxonomy (:mod:`idembus.storage.postgres_errors`, the
  MongoDB storage's codes) decides, then :func:`transport_error` says it in the transport's
  words: an outage is :class:`~idembus.transports.errors.TransportUnavailable`, a refused
  login or a missing table :class:`~idembus.transports.errors.BrokerAccessDenied` (the
  endpoint's to fix), whatever the database refuses of one message
  :class:`~idembus.transports.errors.DestinationRefused`.
* Headers travel as a JSON object of strings, written in ASCII (``\\u`` escapes), so that
  any header text — a NUL, a lone surrogate — is stored as it was given and read back the
  same; a row written by another client may hold anything, which :func:`read_headers`
  judges as :func:`idembus.wire.text_headers` does.
* A consumer that lost its database waits with backoff before it connects again, and
  says so at WARNING once per queue and cause every 10 s (:class:`Reconnects`).
* A claimed message is leased: :class:`LeaseKeeper` renews the leases of the deliveries
  not settled yet, so a slow handler keeps its message while a dead one does not.
* Size before body: a claim learns the size of each body (and of the headers) before it
  reads any. A consumer moves a message over its queue's :class:`BodyLimit` to the error
  queue inside the database, body and all, with the failure headers of
  :func:`failure_story`; it never brings that body into this process. ``browse`` and
  ``inspect`` leave such a body in the database too (:class:`BodyOnDemand`): it is read,
  one message at a time, only when a tool asks for that message's body (``errors show``,
  ``errors retry``).
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from .. import headers as h
from .. import hierarchy, wire
from ..envelope import Envelope
from ..errors import ConfigurationError, MalformedMessage
from ..failures import failure_headers
from ..logs import Throttle
from ..policies import Backoff
from ..redaction import redact
from ..storage.errors import StorageAccessDenied, StorageError, StorageUnavailable
from .base import Delivery, OnDelivery, Transport
from .errors import BrokerAccessDenied, DestinationRefused, TransportError, TransportUnavailable

log = logging.getLogger(__name__)

D = TypeVar("D", bound=Delivery)

_PREFIX = re.compile(r"[a-z_][a-z0-9_]{0,40}")

#: Most bytes of a stored message's headers, content type and content encoding together
#: that a claim reads; a message whose are larger is moved aside unread, like a body over
#: its limit (idembus's own headers weigh a few hundred bytes; an error copy's at most
#: :data:`idembus.failures.HEADERS_BUDGET`).
MAX_METADATA_BYTES = 1024 * 1024


@dataclass(frozen=True)
class BodyLimit:
    """What a database transport does with the messages of one queue whose body is over
    ``max_bytes``: its consumers move them to ``error_queue`` inside the database, unread
    (:meth:`BodyLimits.limit_bodies`; the endpoint sets its ``max_message_bytes`` and error
    queue)."""

    max_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES
    error_queue: str = "error"


class BodyLimits:
    """The :class:`BodyLimit` of each queue a transport consumes (the default one for a
    queue nobody limited)."""

    def __init__(self) -> None:
        self._body_limits: dict[str, BodyLimit] = {}

    def limit_bodies(self, queue: str, *, max_bytes: int, error_queue: str) -> None:
        """Move the messages of ``queue`` whose body is over ``max_bytes`` to
        ``error_queue`` inside the database, without reading their bodies."""
        if max_bytes < 1:
            raise ConfigurationError(f"max_bytes must be at least 1, got {max_bytes}")
        if error_queue == queue:
            raise ConfigurationError(f"the error queue cannot be {queue!r} itself")
        self._body_limits[queue] = BodyLimit(max_bytes, error_queue)

    def body_limit(self, queue: str) -> BodyLimit:
        """The limit of ``queue`` (the default: 1 MiB, to ``error``)."""
        return self._body_limits.get(queue) or BodyLimit()


def oversize(body_bytes: int | None, metadata_bytes: int | None, max_bytes: int) -> str | None:
    """Why a stored message of these sizes is not read (``None``: it is)."""
    if metadata_bytes is not None and metadata_bytes > MAX_METADATA_BYTES:
        return (f"its headers, content type and content encoding take {metadata_bytes} "
                f"bytes; at most {MAX_METADATA_BYTES} are read")
    if body_bytes is not None and body_bytes > max_bytes:
        return f"the body of {body_bytes} bytes exceeds max_message_bytes={max_bytes}"
    return None


def failure_story(headers: Mapping[str, str], reason: str, *, queue: str) -> dict[str, str]:
    """The failure headers of a message of ``queue`` that the database moves to the error
    queue for ``reason`` (a :class:`~idembus.errors.MalformedMessage`, never attempted):
    those of :func:`~idembus.failures.failure_headers` that ``headers`` (what was
    read of the original ones; may be empty) does not already hold. Written after the
    original ones, they win over an earlier failure's."""
    try:
        delayed = max(0, int(headers.get(h.DELAYED_ATTEMPTS) or 0))
    except ValueError:
        delayed = 0
    full = failure_headers(headers, MalformedMessage(reason), queue=queue,
                           immediate_attempts=0, delayed_attempts=delayed)
    return {name: value for name, value in full.items() if headers.get(name) != value}


#: How much of the end of headers too large to read is read to find the failure story a move
#: aside wrote there (:func:`story_at_end`), in characters.
STORY_TAIL = 64 * 1024


def story_at_end(tail: str | None) -> dict[str, str]:
    """The failure headers at the end of ``tail`` — the end of a stored JSON object too
    large to read, where a move aside appended them (:func:`failure_story` of no headers:
    the exception type first) — or nothing. Inside a JSON string a quote is escaped, so the
    last ``"<exception type header>":`` of the text starts the members written last."""
    if not tail:
        return {}
    start = tail.rfind(f'"{h.EXCEPTION_TYPE}":')
    if start < 0:
        return {}
    try:
        found = json.loads("{" + tail[start:])
    except (ValueError, RecursionError):
        return {}
    if not isinstance(found, dict):
        return {}
    return {name: value for name, value in found.items() if isinstance(value, str)}


class BodyOnDemand:
    """A delivery of a database transport whose body may have been left in the database
    (over the limit, for a tool): :attr:`body_size` is then its size, and reading
    :attr:`body` fetches it — each time, one message's, never kept — when a tool asks for
    it (showing or retrying that message). Put before :class:`Delivery` in the bases."""

    #: The size of the body left in the database, if known (``None`` too when the body was
    #: read: see :attr:`body_left`).
    body_size: int | None = None
    _read_body: bytes = b""
    _fetch_body: Callable[[], bytes] | None = None

    @property
    def body(self) -> bytes:
        """The body: read with the message, or fetched now."""
        if self._fetch_body is not None:
            return self._fetch_body()
        return self._read_body

    @body.setter
    def body(self, value: bytes) -> None:
        self._read_body = value

    @property
    def body_left(self) -> bool:
        """Whether the body was left in the database (read on demand)."""
        return self._fetch_body is not None

    def leave_body(self, size: int | None, fetch: Callable[[], bytes]) -> None:
        """The body, of ``size`` bytes (``None``: unknown), stays in the database;
        ``fetch`` reads it."""
        self.body_size = size
        self._fetch_body = fetch


def check_prefix(prefix: str) -> None:
    """Refuse a table or collection prefix that is not a plain lower-case identifier."""
    if not _PREFIX.fullmatch(prefix):
        raise ConfigurationError(
            f"prefix {prefix!r} must be lower-case letters, digits and '_' (at most 41, not "
            "starting with a digit)")


def routing_names(envelope: Envelope) -> list[str]:
    """The type names a published event is routed by: its type and, where
    ``idembus.enclosed_types`` starts with it, the types it derives from (a subscriber of
    any of them gets one copy)."""
    names = [name for name, _ in hierarchy.parse_enclosed(
        envelope.headers.get(h.ENCLOSED_TYPES))]
    if len(names) > 1 and names[0] == envelope.message_type:
        return names
    return [envelope.message_type]


def transport_error(error: StorageError, what: str) -> TransportError:
    """The transport's error for the database failure ``error`` met while doing ``what``
    (already classified by the database's taxonomy, password hidden)."""
    text = f"{what}: {redact(str(error))}"
    if isinstance(error, StorageAccessDenied):
        return BrokerAccessDenied(text)
    if isinstance(error, StorageUnavailable):
        return TransportUnavailable(text)
    return DestinationRefused(text)


def encode_headers(headers: Mapping[str, str]) -> str:
    """``headers`` as stored: a JSON object in ASCII, every character kept."""
    return json.dumps(dict(headers), ensure_ascii=True, separators=(",", ":"))


def read_headers(raw: Any, content_encoding: str | None) -> tuple[dict[str, str], str | None]:
    """The headers of a stored message (JSON text, or what a document holds) and what keeps
    it from being read as idembus's wire format, if anything (headers that are not text, a
    compressed body, another content encoding); never raises."""
    if isinstance(raw, (str, bytes)):
        try:
            raw = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            return {}, f"its headers are not JSON: {wire.shown(exc)}"
    if not isinstance(raw, Mapping):
        return {}, f"its headers are {wire.shown(raw)}, not an object of names and values"
    headers, problem = wire.text_headers(raw)
    return headers, wire.joined(problem, wire.encoding_problem(raw, content_encoding))


def deliver_claimed(deliveries: Sequence[D], on_delivery: OnDelivery, stop: threading.Event,
                    give_back: Callable[[list[D]], None]) -> None:
    """Hand a consumer's claimed ``deliveries`` to ``on_delivery`` one by one until
    ``stop``; whatever is left unsettled (stopped, or the database went) is given back at
    once if the database can take it, else its lease runs out."""
    try:
        for delivery in deliveries:
            if stop.is_set():
                break
            Transport.deliver(delivery, on_delivery)
    finally:
        left = [delivery for delivery in deliveries if not delivery.settled]
        if left:
            try:
                give_back(left)
            except TransportError as exc:
                log.info("%d claimed message(s) of %r go back when their leases run out: %s",
                         len(left), left[0].queue, exc)


class Reconnects:
    """The waits of consumers whose database went away: growing (``backoff``), each said
    at WARNING once per queue and cause every 10 s, with a count of those held back."""

    def __init__(self, backoff: Backoff | None, url: str) -> None:
        self._backoff = backoff or Backoff()
        self._url = url
        self.lines = Throttle(10.0)

    def pause(self, queue: str, error: BaseException, failures: int,
              stop: threading.Event) -> int:
        """Wait before the next attempt (or until ``stop``); the new failure count."""
        delay = self._backoff.delay(failures)
        held = self.lines.allow(f"{queue} {type(error).__name__}")
        if held is not None:
            log.warning("consuming %r from %s failed (%s); reconnecting in %.1fs%s", queue,
                        self._url, redact(str(error)), delay, self.lines.said(held))
        stop.wait(delay)
        return failures + 1


class LeaseKeeper(Generic[D]):
    """Renews the leases of unsettled deliveries (``renew(deliveries)``) every third of
    ``visibility_timeout`` seconds, in a thread started with the first delivery held and
    ended by :meth:`close`. A failed renewal is logged: those leases run out, and the
    messages are delivered again (at least once)."""

    def __init__(self, renew: Callable[[list[D]], None], visibility_timeout: float, *,
                 name: str) -> None:
        self._renew = renew
        self._interval = visibility_timeout / 3
        self._name = name
        self._held: dict[int, D] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def hold(self, deliveries: Sequence[D]) -> None:
        """Keep renewing the leases of ``deliveries`` until they are settled or dropped."""
        if not deliveries:
            return
        with self._lock:
            for delivery in deliveries:
                self._held[id(delivery)] = delivery
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(target=self._run, daemon=True, name=self._name)
                self._thread.start()

    def drop(self, deliveries: Sequence[D]) -> None:
        """Stop renewing the leases of ``deliveries`` (settled, or given back)."""
        with self._lock:
            for delivery in deliveries:
                self._held.pop(id(delivery), None)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            with self._lock:
                for key in [key for key, d in self._held.items() if d.settled]:
                    del self._held[key]
                held = list(self._held.values())
            if not held:
                continue
            try:
                self._renew(held)
            except TransportError as exc:
                log.warning("could not renew the leases of %d message(s): %s", len(held), exc)

    def close(self) -> None:
        """Renew nothing any more (the leases held run out)."""
        self._stop.set()
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=5)
