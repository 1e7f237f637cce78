"""A transport over kombu: one implementation for every kombu URL.

Features
========
* ``amqp://`` (RabbitMQ): a durable queue per endpoint; a durable topic exchange for events,
  routed by the message type name (an event deriving from other events by the names of
  all its types, :mod:`idembus.hierarchy`); publisher confirms on by default; consumer
  prefetch. Hierarchy bindings are anchored at the key's first word (no binding starts
  with ``#``; ``declare`` removes the unanchored ``#.<name>.#`` of earlier versions), and a
  delivery from the events exchange whose routing key is neither its type nor that type's
  hierarchy key arrives with ``Delivery.wire_error`` set: topic permissions that bound an
  account's routing keys bound which subscribers it reaches.
  Publishing happens on connections of its own: on one connection that also consumes,
  deliveries re-enter the consumer callback while a publish waits for its confirm.
  Delayed delivery is native (``native_delay``) and needs no plugin: a message whose
  ``idembus.deliver_at`` is in the future goes through the delay levels of
  ``transports/delays.py``, which hold it in the broker until then (rounded up to a second).
  ``declare`` declares the delay levels (once per transport) and binds the queue to their
  delivery exchange, so that a broker whose delay topology differs fails at start.
  Deliveries do not show the ``x-death`` / ``x-first-death-*`` / ``x-last-death-*`` headers
  dead-lettering adds, nor quorum queues' ``x-delivery-count``: they are broker bookkeeping.
* ``redis://``: the same topology emulated by kombu; no publisher confirms.
* ``memory://``: the embedded default. Its broker state is shared by every connection in
  the process (even across virtual hosts), so give every test its own queue and exchange
  names. An unacknowledged message is dropped when its channel closes; idembus requeues a
  delivery whose processing stopped abruptly, which is the redelivery a real broker makes.
  The polling interval defaults to 5 ms instead of kombu's 1 s.
* ``inspect(queue)`` (tools such as ``idembus errors``) takes the waiting messages with
  ``basic_get`` on one channel, unacknowledged. RabbitMQ puts the ones not acknowledged
  back in their original places (and does the same if the tool dies meanwhile). On
  memory:// and redis:// each goes back as a copy published to that queue, after which the
  original is acknowledged: they end up behind the messages not taken, in the order they
  were taken. (kombu's own requeue there would route an event through its exchange again,
  into every subscribed queue, and memory:// drops unacknowledged messages when a channel
  closes.) A tool that dies on redis:// leaves them to kombu's visibility timeout (1 h).
* On ``redis://`` the polling interval (kombu's BRPOP timeout) defaults to 0.1 s, so a
  consumer stops within a fraction of a second.

Failures
========
Broker errors are classified here, once, from kombu's and py-amqp's own classes
(:func:`_classified`): kombu's ``recoverable_*`` errors, lost connections and timeouts are
*transient* (``TransportUnavailable``: wait and try again); a login or virtual host the
broker refuses, or the endpoint's own queue refused, is *permanent for the endpoint*
(``BrokerAccessDenied``: ``consume`` raises it for the endpoint to report and retry); every
other channel error on a publish — no such exchange or queue, a reserved ``amq.*`` name,
a message over the broker's size, headers that cannot fit its frame — is *permanent for
this message* (``DestinationRefused``). A channel the broker closed is replaced.

Events nobody subscribes to are noticed: ``publish`` returns False when no queue took the
event. On RabbitMQ events are published ``mandatory`` and the broker's ``basic.return`` says
so (before its confirm; without publisher confirms a return comes too late to be seen, and
``publish`` returns None); on memory:// and redis:// the exchange's bindings are looked up
as kombu routes (on Redis one more read of the binding set per event).

Sends are loud: a command sent to a queue nobody declared fails with
``DestinationRefused`` instead of creating the queue and stranding the message there. On
RabbitMQ sends are published ``mandatory`` (an unroutable message comes back as
``NO_ROUTE``); memory:// asks its broker (a passive declare); on redis://, where an empty
queue does not exist as a key, ``declare`` records every queue in the set
``_idembus.queues`` and sends look there — and, for a queue an older idembus declared
without recording it, at the bindings of the events exchange (then record it). Such a queue
without subscriptions cannot be told from a mistyped name: it is refused until its endpoint
restarts.

Received messages are taken as the broker holds them: kombu would decompress a body with a
``compression`` header before anyone could refuse it (a 242-byte bz2 body took a consumer to
2.6 GiB), and py-amqp would decode it by its content encoding (a latin-1 ``é`` then went to
the error queue as UTF-8), so channels here keep bodies raw, and such a message, one with
another content encoding, or one whose ``idembus.*`` headers are not text
(:func:`idembus.wire.text_headers`) arrives with ``Delivery.wire_error`` set, for the endpoint to
send to the error queue as is; ``Delivery.content_encoding`` and an envelope's
``content_encoding`` carry the encoding on to the copy. Other headers that are not text are
left out and named in ``idembus.wire.dropped_headers``. A content type or other AMQP
property that is not UTF-8 — on which py-amqp stopped the consumer, and then the next, on
the same message — is read as surrogate escapes (:func:`_lenient_frames`) and published on
as its bytes.

Connection String
=================
Any kombu URL: ``memory://``, ``amqp://guest:guest@127.0.0.1:5672//``,
``redis://127.0.0.1:6379/0``.

Options
=======
``exchange``         name of the topic exchange for events (``idembus.events``)
``confirm_publish``  wait for publisher confirms where the broker has them (``True``)
``polling_interval`` seconds between polls of virtual transports (memory:// 5 ms, redis:// 0.1 s)
``transport_options`` passed to kombu unchanged
``reconnect_backoff`` waits between attempts to reconnect a consumer
                     (:class:`idembus.policies.Backoff`); the warning about it is written
                     once per queue and cause every 10 s at most, with a count
``queue_type``       RabbitMQ queues: ``"quorum"`` (default: replicated, and dead-lettering
                     at least once, which the delay levels need) or ``"classic"``
``queue_arguments``  further arguments of every queue declared (RabbitMQ ``x-*``), the
                     error queue included: ``x-max-length`` there drops failed messages,
                     ``x-delivery-limit`` lets the broker drop a message idembus never saw
                     fail
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.util
import logging
import re
import struct
import threading
import time
from collections.abc import Callable, Collection, Generator, Iterator, Mapping, Sequence
from typing import Any

import amqp.exceptions
import amqp.method_framing
import kombu
import kombu.exceptions
from kombu import Exchange, Queue, binding

from .. import headers as h
from .. import hierarchy, wire
from ..envelope import Envelope
from ..errors import ConfigurationError
from ..logs import Throttle
from ..policies import Backoff
from ..redaction import redact
from ..wire import encoding_problem as _encoding_problem
from ..wire import joined as _joined
from . import amqp_reads, confirms, delays
from .base import Delivery, OnBatch, OnDelivery, Transport
from .errors import (
    BrokerAccessDenied,
    DestinationRefused,
    TransportError,
    TransportUnavailable,
)

log = logging.getLogger(__name__)

#: Seconds between polls of kombu's virtual transports. kombu's default (1 s) made an idle
#: memory:// consumer wait ~0.5 s per message; on Redis it is also the BRPOP timeout, which
#: bounds how long a consumer takes to notice that it should stop.
_DEFAULT_POLLING_INTERVALS = {"memory": 0.005, "redis": 0.1, "rediss": 0.1}
#: How long one wait for deliveries lasts before the stop flag is looked at again.
_DRAIN_TIMEOUT = 0.1
QUEUE_TYPES = ("quorum", "classic")
#: The Redis set in which ``declare`` records queues, for sends to look in.
REDIS_QUEUES = "_idembus.queues"
#: Headers a broker adds to a delivery for its own bookkeeping (RabbitMQ's quorum queues
#: count redeliveries): not the sender's, so neither read nor listed as dropped.
_BROKER_HEADERS = frozenset({"x-delivery-count"})
#: How RabbitMQ names what a PRECONDITION_FAILED is about.
_ENTITY = re.compile(r"for (queue|exchange) '(.*?)' in vhost")
#: Room left in an AMQP frame for what a content header holds besides the headers.
_FRAME_MARGIN = 1024
#: What py-amqp raises when the broker refuses a login or its virtual host at connection.
_LOGIN_REFUSED: tuple[type[BaseException], ...] = (amqp.exceptions.AccessRefused,
                                                   amqp.exceptions.NotAllowed)
#: Errors that a publish's content caused: the same publish would fail again.
_MESSAGE_CAUSED: tuple[type[BaseException], ...] = (
    amqp.exceptions.ContentTooLarge, amqp.exceptions.FrameError,
    amqp.exceptions.FrameSyntaxError)


class KombuTransport(Transport):
    """Transport for any kombu URL; see the module docstring.

    Parameters
    ----------
    url:
        ``memory://``, ``amqp://user:password@host:5672/vhost`` or ``redis://host:6379/0``.
    exchange:
        The topic exchange events are published to.
    confirm_publish:
        Wait for publisher confirms where the broker has them.
    polling_interval:
        Seconds between polls of virtual transports (memory:// 5 ms, redis:// 0.1 s).
    transport_options:
        Passed to kombu unchanged.
    reconnect_backoff:
        The waits between attempts to reconnect a consumer.
    queue_type:
        RabbitMQ queues: ``"quorum"`` or ``"classic"``.
    queue_arguments:
        Further arguments of every queue declared (RabbitMQ ``x-*``), the error queue too.
    """

    def __init__(
        self,
        url: str = "memory://",
        *,
        exchange: str = "idembus.events",
        confirm_publish: bool = True,
        polling_interval: float | None = None,
        transport_options: Mapping[str, Any] | None = None,
        reconnect_backoff: Backoff | None = None,
        queue_type: str = "quorum",
        queue_arguments: Mapping[str, Any] | None = None,
    ) -> None:
        self.url = url
        #: The URL as it may be shown: without its password.
        self.safe_url = redact(url)
        self._reconnect_backoff = reconnect_backoff or Backoff()
        #: A consumer's repeated reconnection warnings: one per queue and cause every 10 s,
        #: with how many were held back.
        self.reconnect_lines = Throttle(10.0)
        options = dict(transport_options or {})
        scheme = url.split("://", 1)[0] if "://" in url else url
        if polling_interval is None:
            polling_interval = _DEFAULT_POLLING_INTERVALS.get(scheme)
        if polling_interval is not None:
            options.setdefault("polling_interval", polling_interval)
        self._is_amqp = scheme in ("amqp", "amqps", "pyamqp")
        self._is_redis = scheme in ("redis", "rediss")
        if self._is_redis and importlib.util.find_spec("redis") is None:
            raise ConfigurationError(
                f"{self.safe_url} needs the redis library: pip install 'idembus[redis]'")
        self.process_local = scheme == "memory"
        self.native_delay = self._is_amqp
        if confirm_publish and self._is_amqp:
            options.setdefault("confirm_publish", True)
        if self._is_amqp:
            options.setdefault("frame_handler", _lenient_frames)
        self.publisher_confirms = bool(options.get("confirm_publish"))
        self._transport_options = options
        if queue_type not in QUEUE_TYPES:
            raise ConfigurationError(
                f"queue_type {queue_type!r} is not one of {', '.join(QUEUE_TYPES)}")
        #: RabbitMQ's type of every queue this transport declares (ignored elsewhere).
        self.queue_type = queue_type
        self._queue_arguments: dict[str, Any] = (
            {"x-queue-type": queue_type, **(queue_arguments or {})} if self._is_amqp else {})
        self._delay_levels = delays.Topology.for_queue_type(queue_type)
        try:
            # Resolves the scheme and loads its driver; nothing connects yet.
            kombu.Connection(url, transport_options=options).transport  # noqa: B018
        except (KeyError, ImportError, ValueError) as exc:
            raise ConfigurationError(
                f"transport URL {self.safe_url!r} cannot be used: {redact(str(exc))}. Use a "
                "kombu URL such as memory://, amqp://user:password@host:5672// or "
                "redis://host:6379/0 (redis:// needs the [redis] extra)."
            ) from exc
        self._events = Exchange(exchange, type="topic", durable=True)
        self._local = threading.local()
        self._connections: list[kombu.Connection] = []
        self._connections_lock = threading.Lock()
        #: Queues known to exist (declared or looked up); sends to others are checked.
        self._known_queues: set[str] = set()
        self._exchange_declared = False
        #: Queues bound to the delay delivery exchange by this transport.
        self._delay_bound: set[str] = set()
        self._delay_levels_declared = False
        self._raw_message_classes: dict[type, type] = {}

    @property
    def exchange_name(self) -> str:
        """Name of the topic exchange events are published to."""
        return str(self._events.name)

    # -- topology ---------------------------------------------------------------------

    def declare(self, queue: str, *, subscriptions: Collection[str] = ()) -> None:
        """Declare ``queue`` (durable, of this transport's queue type) bound to the event
        types ``subscriptions``. On RabbitMQ also declare the delay levels (once per
        transport) and bind ``queue`` to their delivery exchange, so that a broker whose
        topology differs fails here, at start, not at the first delayed retry. A queue or
        exchange that exists with other arguments is a configuration error saying what to
        change; a refusal of the endpoint's own queue is ``BrokerAccessDenied``."""
        bindings = [binding(self._events, routing_key=key) for name in sorted(subscriptions)
                    for key in hierarchy.binding_keys(name)]
        delayed = self.native_delay and _takes_delayed(queue)
        scope = self._channel()
        with scope as channel:
            try:
                if bindings:
                    self._events(channel).declare()
                Queue(queue, durable=True, bindings=bindings or None,
                      queue_arguments=self._queue_arguments or None)(channel).declare()
                if self._is_amqp:
                    self._unbind_legacy(channel, queue, subscriptions)
                if self._is_redis:
                    channel.client.sadd(REDIS_QUEUES, queue)
                if delayed:
                    self._declare_delays(channel, queue)
            except Exception as exc:
                raise self._topology_failure(exc, scope.connection, f"declaring queue {queue!r}",
                                             refusal=BrokerAccessDenied) from exc
        self._known_queues.add(queue)
        if delayed:
            self._delay_bound.add(queue)

    def _unbind_legacy(self, channel: Any, queue: str, subscriptions: Collection[str]) -> None:
        """Remove the unanchored ``#.<name>.#`` bindings an earlier idembus made for
        ``queue``'s subscriptions (:func:`idembus.hierarchy.legacy_binding_key`): left in
        place, any routing key containing the word would still reach the queue. RabbitMQ
        answers an unbind of a binding that does not exist as done."""
        for name in sorted(subscriptions):
            channel.queue_unbind(queue=queue, exchange=self.exchange_name,
                                 routing_key=hierarchy.legacy_binding_key(name))

    def _declare_delays(self, channel: Any, queue: str) -> None:
        """Declare the delay levels (once per transport) and bind ``queue``, which exists,
        to their delivery exchange (idempotent). After a failure the levels are declared
        again next time: a broker that lost its definitions gets them back."""
        try:
            if not self._delay_levels_declared:
                self._delay_levels.declare(channel)
                self._delay_levels_declared = True
            self._delay_levels.bind_destination(channel, queue)
        except BaseException:
            self._delay_levels_declared = False
            raise

    def _topology_failure(self, error: Exception, connection: kombu.Connection, what: str,
                          *, refusal: type[TransportError]) -> Exception:
        """What a failure to declare or bind is: a ``ConfigurationError`` saying what to
        change if the broker holds something declared otherwise; else the taxonomy."""
        mismatch = self._mismatch(error)
        if mismatch is not None:
            return mismatch
        classified = _classified(error, connection, what, refusal=refusal, url=self.safe_url)
        return classified if classified is not None else error

    def _mismatch(self, error: BaseException) -> ConfigurationError | None:
        """A ``ConfigurationError`` naming the queue or exchange that RabbitMQ holds with
        other arguments (``inequivalent arg``) or refuses the arguments of (``invalid
        arg``), and what to do; ``None`` for any other error."""
        text = next((str(cause) for cause in _causes(error)
                     if "inequivalent arg" in str(cause) or "invalid arg" in str(cause)), None)
        if text is None:
            return None
        found = _ENTITY.search(text)
        kind, name = (found.group(1), found.group(2)) if found else ("queue or exchange", "?")
        said = redact(text)
        levels = self._delay_levels
        if name.startswith(f"{levels.prefix}."):
            if "invalid arg" in text and levels.quorum:
                advice = ("quorum delay levels need RabbitMQ 3.10 or later; upgrade it or use "
                          "KombuTransport(queue_type='classic')")
            else:
                advice = (f"they were declared otherwise (by another idembus version or by "
                          f"hand): once the {levels.prefix}.* queues are empty, delete the "
                          f"{levels.prefix}.* queues and exchanges and start again; or use "
                          f"the other queue_type, whose levels are apart")
            return ConfigurationError(
                f"the delay levels on {self.safe_url} do not match this idembus: {kind} "
                f"{name!r} ({said}); {advice}")
        if kind == "exchange":
            return ConfigurationError(
                f"exchange {name!r} exists on {self.safe_url} with other arguments than a "
                f"durable topic exchange ({said}); use another name — "
                f"KombuTransport(exchange=...) — or delete it and start again")
        if "invalid arg" in text:
            return ConfigurationError(
                f"RabbitMQ on {self.safe_url} refuses the arguments of {kind} {name!r}: "
                f"{self._queue_arguments or 'none'} ({said}); correct "
                "KombuTransport(queue_type=..., queue_arguments=...)")
        return ConfigurationError(
            f"{kind} {name!r} exists on {self.safe_url} with other arguments than "
            f"{self._queue_arguments or 'none'} ({said}). Declare it as it is — "
            "KombuTransport(queue_type='classic' or 'quorum', queue_arguments=...) — "
            "or move its messages elsewhere, delete it and start again.")

    # -- publishing -------------------------------------------------------------------

    def send(self, envelope: Envelope) -> None:
        queue = envelope.destination
        if not queue:
            raise ValueError(f"message {envelope.headers.get(h.MESSAGE_ID)} has no destination "
                             "queue")
        delay = self._delay_of(envelope)
        if delay:
            self._send_delayed(envelope, queue, delay)
            return
        if not self._is_amqp and queue not in self._known_queues:
            self._look_up(queue)
        # RabbitMQ: mandatory, so that a queue nobody declared returns the message.
        self._publish(envelope, exchange="", routing_key=queue, mandatory=self._is_amqp)

    def _look_up(self, queue: str) -> None:
        """memory:// and redis://: refuse a queue that nobody declared (RabbitMQ's sends are
        mandatory instead)."""
        scope = self._channel()
        with scope as channel:
            try:
                if self._is_redis:
                    known = self._redis_knows(channel, queue)
                else:
                    channel.queue_declare(queue=queue, passive=True)
                    known = True
            except Exception as exc:
                classified = _classified(exc, scope.connection, f"looking up queue {queue!r}",
                                         refusal=DestinationRefused, url=self.safe_url)
                if isinstance(classified, DestinationRefused):
                    known = False
                else:
                    raise classified if classified is not None else exc from exc
        if not known:
            older = (f" (or one started by an older idembus, which did not record it in "
                     f"{REDIS_QUEUES}: restart that endpoint)" if self._is_redis else "")
            raise DestinationRefused(
                f"no queue {queue!r} on {self.safe_url}: no endpoint declared it{older} "
                "(start the endpoint that consumes it, or correct the route)")
        self._known_queues.add(queue)

    def _redis_knows(self, channel: Any, queue: str) -> bool:
        """Whether ``queue`` was declared on Redis: recorded in :data:`REDIS_QUEUES`, or —
        declared by an idembus that did not record queues yet — bound to this transport's
        events exchange (then it is recorded now). An empty queue is no key in Redis, so a
        queue without subscriptions that such an endpoint declared cannot be told from a
        mistyped name: it is refused until its endpoint restarts."""
        if channel.client.sismember(REDIS_QUEUES, queue):
            return True
        bound = any(len(entry) == 3 and entry[2] == queue
                    for entry in channel.get_table(self.exchange_name))
        if bound:
            channel.client.sadd(REDIS_QUEUES, queue)
        return bound

    def _delay_of(self, envelope: Envelope) -> int:
        """Seconds the broker must hold ``envelope`` (0: deliver at once)."""
        if not self.native_delay:
            return 0
        deliver_at = delays.parse_time(envelope.headers.get(h.DELIVER_AT))
        return delays.delay_seconds(deliver_at, datetime.datetime.now(datetime.timezone.utc))

    def _send_delayed(self, envelope: Envelope, queue: str, delay: int) -> None:
        levels = self._delay_levels
        try:
            key = delays.routing_key(delay, queue)
        except ValueError as exc:  # a name the delay levels cannot route
            raise DestinationRefused(str(exc)) from exc
        if queue not in self._delay_bound:
            self._bind_for_delays(queue)
        try:
            self._publish(envelope, exchange=levels.entry_exchange(delay), routing_key=key)
        except TransportUnavailable:
            # The broker may have lost the topology (a reset node): declare it again next time.
            self._delay_levels_declared = False
            self._delay_bound.clear()
            raise

    def _bind_for_delays(self, queue: str) -> None:
        """Declare the delay levels (once) and bind ``queue`` to their delivery exchange,
        for a send to a queue this transport did not declare; a queue that does not exist
        is refused, as a send to it is."""
        scope = self._channel()
        with scope as channel:
            try:
                self._declare_delays(channel, queue)
            except Exception as exc:
                raise self._topology_failure(exc, scope.connection,
                                             f"binding {queue!r} to the delay levels",
                                             refusal=DestinationRefused) from exc
        self._delay_bound.add(queue)

    def publish(self, envelope: Envelope) -> bool | None:
        """Publish the event to every queue subscribed to one of its types; False if the
        broker reports that none took it (None: it cannot tell, see the module docstring)."""
        declare = [] if self._exchange_declared else [self._events]
        key = event_routing_key(envelope)
        returned = self._publish(envelope, exchange=self._events.name, routing_key=key,
                                 declare=declare, mandatory=self._is_amqp)
        self._exchange_declared = True
        if self._is_amqp:
            return None if not self.publisher_confirms else not returned
        return self._routed(key)

    def _routed(self, routing_key: str) -> bool | None:
        """memory:// and redis://: whether the events exchange has a binding for
        ``routing_key``, as kombu routes it (None if the lookup fails)."""
        _, producer = self._producer()
        channel = producer.channel
        try:
            table = channel.get_table(self.exchange_name)
            return bool(channel.typeof(self.exchange_name).lookup(
                table, self.exchange_name, routing_key, None))
        except KeyError:  # memory://: the exchange has no bindings at all
            return False
        except Exception:
            log.debug("could not look up the queues of %r", routing_key, exc_info=True)
            return None

    def _publish(self, envelope: Envelope, *, exchange: str, routing_key: str,
                 declare: list[Any] | None = None, mandatory: bool = False) -> bool:
        """Publish; True if RabbitMQ returned the message as unroutable (``mandatory``)."""
        connection, producer = self._producer()
        what = (f"publishing {envelope.headers.get(h.MESSAGE_ID, 'a message without id')} to "
                f"{exchange or 'queue'} {routing_key!r}")
        self._check_fits(connection, envelope, routing_key, what)
        returns: list[str] = self._local.returns
        returns.clear()
        try:
            producer.publish(
                envelope.body.encode("utf-8", "surrogateescape"),
                exchange=exchange,
                routing_key=routing_key,
                headers=dict(envelope.headers),
                content_type=_as_sent(envelope.content_type),
                content_encoding=_as_sent(envelope.content_encoding),
                delivery_mode=2,
                declare=declare or [],
                mandatory=mandatory,
                retry=True,
                retry_policy={"max_retries": 3, "interval_start": 0.1, "interval_step": 0.5},
            )
        except Exception as exc:
            # Whatever happened, the channel may be closed: this thread publishes on a new
            # connection next time.
            del self._local.publisher
            self._release(connection)
            classified = _classified(exc, connection, what, refusal=DestinationRefused,
                                     url=self.safe_url)
            if classified is None:
                raise
            raise classified from exc
        if returns and exchange == "":  # a send: the queue does not exist
            raise DestinationRefused(f"{what} on {self.safe_url}: {returns[0]}")
        return bool(returns)

    def _overrides(self, *methods: str) -> bool:
        """Whether a subclass overrides one of ``methods``: the batched paths then go
        through them (a test's fault injection, a user's instrumentation) one at a time."""
        return any(getattr(type(self), name) is not getattr(KombuTransport, name)
                   for name in methods)

    def dispatch_many(self, envelopes: Sequence[Envelope]) -> list[bool | None | Exception]:
        """On RabbitMQ with publisher confirms: publish every envelope, then wait for their
        confirms once (:mod:`idembus.transports.confirms`); through :meth:`dispatch` one at
        a time where a subclass overrides it, :meth:`send` or :meth:`publish`. A message the
        broker refuses (``basic.nack``) raises ``TransportUnavailable`` for its sender, which
        sends it again with the same id; a send nobody takes is refused as :meth:`send` refuses it.
        Delayed sends, a first publish (which declares the exchange) and anything after a
        failure of the connection go one by one, each with the answer it gets alone."""
        if not (self._is_amqp and self.publisher_confirms) or self._overrides(
                "dispatch", "send", "publish"):
            return super().dispatch_many(envelopes)
        results: list[bool | None | Exception | _Unanswered] = [_UNANSWERED] * len(envelopes)
        handles: dict[int, int] = {}
        try:
            confirming = self._confirming()
            for index, envelope in enumerate(envelopes):
                route = self._pipelined_route(envelope)
                if route is None:
                    results[index] = self._dispatch_or_error(envelope)
                    continue
                exchange, key = route
                try:
                    self._check_fits(confirming.connection, envelope, key, _what(envelope, key))
                except DestinationRefused as refused:
                    results[index] = refused
                    continue
                handles[confirming.publish(
                    envelope.body.encode("utf-8", "surrogateescape"), headers=envelope.headers,
                    exchange=exchange, routing_key=key,
                    content_type=_as_sent(envelope.content_type),
                    content_encoding=_as_sent(envelope.content_encoding),
                    delivery_mode=2, mandatory=True)] = index
            ends = confirming.wait(_CONFIRM_TIMEOUT) if handles else {}
        except Exception as exc:
            log.info("publishing %d messages with one confirm wait failed (%s); each goes "
                     "alone", len(envelopes), redact(str(exc)))
            self._drop_confirming()
            handles, ends = {}, {}
            for index, envelope in enumerate(envelopes):
                if isinstance(results[index], _Unanswered):
                    results[index] = self._dispatch_or_error(envelope)
        for tag, index in handles.items():
            end, reason = ends[tag]
            envelope = envelopes[index]
            if end == confirms.NACKED:
                results[index] = TransportUnavailable(
                    f"{self.safe_url} refused {_what(envelope, '')} (basic.nack); it is sent "
                    "again with the same id")
            elif envelope.destination is not None:
                results[index] = (DestinationRefused(
                    f"{_what(envelope, envelope.destination)} on {self.safe_url}: {reason}")
                    if end == confirms.RETURNED else None)
            else:
                results[index] = end != confirms.RETURNED
        answered: list[bool | None | Exception] = []
        for result in results:
            if isinstance(result, _Unanswered):  # every place is filled above
                raise RuntimeError("a message of the batch was not answered")
            answered.append(result)
        return answered

    def _pipelined_route(self, envelope: Envelope) -> tuple[str, str] | None:
        """Exchange and routing key of an envelope that can be published in a pipeline;
        ``None`` for one that goes alone (delayed, no destination, the first publish)."""
        if envelope.destination is None:
            if not self._exchange_declared:
                return None
            return self._events.name, event_routing_key(envelope)
        if not envelope.destination or self._delay_of(envelope):
            return None
        return "", envelope.destination

    def _confirming(self) -> confirms.ConfirmingChannel:
        """This thread's channel for pipelined confirms; new after a failure."""
        confirming: confirms.ConfirmingChannel | None = getattr(self._local, "confirming",
                                                                None)
        if confirming is None:
            options = {name: value for name, value in self._transport_options.items()
                       if name != "confirm_publish"}
            connection = self._connect(options)
            try:
                confirming = confirms.ConfirmingChannel(connection)
            except Exception:
                self._release(connection)
                raise
            self._local.confirming = confirming
        return confirming

    def _drop_confirming(self) -> None:
        confirming: confirms.ConfirmingChannel | None = getattr(self._local, "confirming",
                                                                None)
        if confirming is not None:
            del self._local.confirming
            self._release(confirming.connection)

    def _check_fits(self, connection: kombu.Connection, envelope: Envelope, routing_key: str,
                    what: str) -> None:
        """Refuse, before the broker does it by closing the connection, what AMQP cannot
        carry: a routing key over 255 bytes, headers that do not fit one frame."""
        if not self._is_amqp:
            return
        if len(routing_key.encode("utf-8", "surrogateescape")) > delays.MAX_KEY_BYTES:
            raise DestinationRefused(f"{what}: the routing key is longer than "
                                     f"{delays.MAX_KEY_BYTES} bytes, the AMQP limit")
        frame_max = getattr(getattr(connection, "connection", None), "frame_max", None)
        if not isinstance(frame_max, int) or frame_max <= 0:
            return
        headers = envelope.headers
        characters = len("".join(headers)) + len("".join(headers.values()))
        if 4 * characters + 6 * len(headers) + _FRAME_MARGIN <= frame_max:
            return  # fits even at UTF-8's four bytes a character
        weight = sum(len(name.encode("utf-8", "surrogateescape"))
                     + len(value.encode("utf-8", "surrogateescape")) + 6
                     for name, value in headers.items())
        if weight + _FRAME_MARGIN > frame_max:
            raise DestinationRefused(
                f"{what}: its headers take {weight} bytes and the broker's frames hold "
                f"{frame_max} (frame_max)")

    def _producer(self) -> tuple[kombu.Connection, kombu.Producer]:
        """This thread's publishing connection and producer; new after a failure."""
        publisher: tuple[kombu.Connection, kombu.Producer] | None = getattr(
            self._local, "publisher", None)
        if publisher is None:
            connection = self._connect()
            returns: list[str] = []
            self._local.returns = returns

            def on_return(error: Exception, exchange: str, routing_key: str,
                          message: Any) -> None:
                returns.append(redact(str(error)))

            publisher = (connection, kombu.Producer(
                connection.default_channel, on_return=on_return if self._is_amqp else None))
            self._local.publisher = publisher
        return publisher

    # -- consuming --------------------------------------------------------------------

    def consume(
        self, queue: str, on_delivery: OnDelivery, *, stop: threading.Event, prefetch: int = 1
    ) -> None:
        """See the contract; outages are waited out here, and a refusal that only an
        operator can end (``BrokerAccessDenied``) is raised."""
        self._consuming(queue, stop, prefetch,
                        lambda connection: self._delivering(queue, on_delivery, connection),
                        lambda connection: None)

    def consume_batches(
        self, queue: str, on_batch: OnBatch, *, stop: threading.Event, prefetch: int = 1,
        size: int = 1, linger: float = 0.0,
    ) -> None:
        """See the contract: once a delivery is ready, the next ones are taken as they come,
        up to ``size`` or for ``linger`` seconds; outages as :meth:`consume`.

        On Redis batches hold one delivery: a wait for more leaves a ``BRPOP`` pending while
        the batch is processed, which takes the message a stopping consumer gives back.
        A subclass that overrides :meth:`consume` gets its batches through it, one delivery
        each."""
        if self._overrides("consume"):
            super().consume_batches(queue, on_batch, stop=stop, prefetch=prefetch)
            return
        if self._is_redis:
            size = 1
        ready: list[Delivery] = []

        def receiving(connection: kombu.Connection) -> Callable[[kombu.Message], None]:
            ready.clear()  # what a lost connection had delivered, the broker delivers again
            outage = _broker_errors(connection)

            def on_message(message: kombu.Message) -> None:
                ready.append(_KombuDelivery(queue, message, outage=outage,
                                            native_requeue=self._is_amqp,
                                            events_exchange=self.exchange_name))

            return on_message

        def after_drain(connection: kombu.Connection) -> None:
            deadline = time.monotonic() + linger
            while ready and len(ready) < size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    connection.drain_events(timeout=remaining)
                except TimeoutError:
                    break
            while ready:  # a drain may bring more than one: never more than size a batch
                batch = ready[:size]
                del ready[:size]
                self.deliver_batch(batch, on_batch)

        self._consuming(queue, stop, prefetch, receiving, after_drain)

    def _consuming(
        self, queue: str, stop: threading.Event, prefetch: int,
        receiving: Callable[[kombu.Connection], Callable[[kombu.Message], None]],
        after_drain: Callable[[kombu.Connection], None],
    ) -> None:
        """Consume ``queue`` with the callback ``receiving(connection)`` makes, calling
        ``after_drain`` after each delivery, until ``stop`` is set; reconnect after outages."""
        failures = 0
        while not stop.is_set():
            try:
                connection = self._connect()
            except BrokerAccessDenied:
                raise
            except TransportUnavailable as exc:
                failures = self._pause_after_failure(queue, exc, failures, stop)
                continue
            try:
                channel = self._raw_channel(connection)
                with kombu.Consumer(
                    channel, [Queue(queue, durable=True, no_declare=True)],
                    on_message=receiving(connection), prefetch_count=prefetch,
                ):
                    failures = 0
                    while not stop.is_set():
                        try:
                            connection.drain_events(timeout=_DRAIN_TIMEOUT)
                        except TimeoutError:
                            continue
                        after_drain(connection)
            except TransportUnavailable as exc:  # a delivery's connection went away
                failures = self._pause_after_failure(queue, exc, failures, stop)
            except Exception as exc:
                classified = _classified(exc, connection, f"consuming {queue!r}",
                                         refusal=BrokerAccessDenied, url=self.safe_url)
                if classified is None:
                    raise
                if isinstance(classified, BrokerAccessDenied):
                    raise classified from exc
                failures = self._pause_after_failure(queue, classified, failures, stop)
            finally:
                self._release(connection)

    def ack_many(self, deliveries: Sequence[Delivery]) -> None:
        """On RabbitMQ, deliveries with consecutive tags on one channel (a batch, every
        earlier delivery settled) are acknowledged with one ``basic.ack`` (``multiple``);
        others one by one."""
        held = [delivery for delivery in deliveries if isinstance(delivery, _KombuDelivery)]
        if not self._is_amqp or len(held) < 2 or len(held) != len(deliveries):
            super().ack_many(deliveries)
            return
        tags = sorted(delivery.delivery_tag for delivery in held)
        channels = {id(delivery.channel) for delivery in held}
        if (len(channels) != 1 or any(delivery.settled for delivery in held)
                or tags != list(range(tags[0], tags[0] + len(tags)))):
            super().ack_many(deliveries)
            return
        last = max(held, key=lambda delivery: delivery.delivery_tag)
        last.ack_up_to_here()
        for delivery in held:
            delivery.settled = True

    def _delivering(self, queue: str, on_delivery: OnDelivery,
                    connection: kombu.Connection) -> Callable[[kombu.Message], None]:
        """The kombu callback that hands each message of ``queue`` to ``on_delivery``."""
        outage = _broker_errors(connection)

        def on_message(message: kombu.Message) -> None:
            delivery = _KombuDelivery(queue, message, outage=outage,
                                      native_requeue=self._is_amqp,
                                      events_exchange=self.exchange_name)
            self.deliver(delivery, on_delivery)

        return on_message

    def _pause_after_failure(
        self, queue: str, error: BaseException, failures: int, stop: threading.Event
    ) -> int:
        delay = self._reconnect_backoff.delay(failures)
        held = self.reconnect_lines.allow(f"{queue} {type(error).__name__}")
        if held is not None:
            log.warning("consuming %r from %s failed (%s); reconnecting in %.1fs%s",
                        queue, self.safe_url, redact(str(error)), delay,
                        self.reconnect_lines.said(held))
        stop.wait(delay)
        return failures + 1

    def _raw_channel(self, connection: kombu.Connection) -> Any:
        """A new channel whose messages keep their bodies as the broker holds them: neither
        decompressed by kombu (:class:`_RawBody`) nor decoded by py-amqp by their content
        encoding (which turned a latin-1 body into text that was then written as UTF-8)."""
        channel = connection.channel()
        if hasattr(channel, "auto_decode"):
            channel.auto_decode = False
        base = type(channel).Message
        raw = self._raw_message_classes.get(base)
        if raw is None:
            raw = type(f"Raw{base.__name__}", (_RawBody, base), {})
            self._raw_message_classes[base] = raw
        channel.Message = raw
        return channel

    def get(self, queue: str) -> Delivery | None:
        with self._channel() as channel:
            message = Queue(queue, durable=True, no_declare=True)(channel).get(no_ack=True)
        if message is None:
            return None
        return _KombuDelivery(queue, message, settled=True, events_exchange=self.exchange_name)

    @contextlib.contextmanager
    def inspect(self, queue: str, *, limit: int | None = None) -> Iterator[list[Delivery]]:
        """The messages waiting in ``queue`` now, taken unsettled; see the contract.

        They are taken with ``basic_get`` (no auto-acknowledgement) on one channel, which
        never hands out a message it already holds. At the end every unsettled one goes
        back: on RabbitMQ by a native requeue, which puts it back in its original place
        (and had the process died, the broker would have done the same); on memory:// and
        redis:// by publishing a copy to ``queue`` itself and then acknowledging the
        original, as :class:`_KombuDelivery` requeues, so they end up behind the messages
        not taken, in the order they were taken.
        """
        if limit is not None and limit < 0:
            raise ValueError(f"limit must be at least 0, got {limit}")
        waiting = self.pending(queue)  # also: a missing queue has nothing to inspect
        wanted = waiting if limit is None else min(waiting, limit)
        if wanted == 0:
            yield []
            return
        scope = self._channel()
        with scope as channel:
            taken = self._take(channel, queue, wanted, scope.connection)
            try:
                yield list(taken)
            except BaseException:
                with contextlib.suppress(Exception):  # logged; the caller's error matters
                    _give_back(taken)
                raise
            _give_back(taken)
            self._settled_round_trip(channel, queue, scope.connection)

    @contextlib.contextmanager
    def take(self, queue: str, *, limit: int) -> Iterator[Iterator[Delivery]]:
        """Take up to ``limit`` messages of ``queue`` one at a time, unsettled, on one
        channel: ``with transport.take(queue, limit=100) as messages: for delivery in
        messages: ... delivery.ack()``. Each is taken only when the previous one was
        handled, so that its acknowledgement reaches the broker before the next is asked
        for (a quorum queue applies acknowledgements asynchronously: a burst of them may
        not be applied when the connection closes, and the messages come back). Settle
        each: one left unsettled goes back as a fresh copy
        (:meth:`_KombuDelivery.requeue_fresh`), never as a redelivery. Returns once the
        broker has the acknowledgements (a round trip on the channel)."""
        if limit < 0:
            raise ValueError(f"limit must be at least 0, got {limit}")
        scope = self._channel()
        with scope as channel:
            held: list[_KombuDelivery] = []

            def taken() -> Generator[Delivery, None, None]:
                for _ in range(limit):
                    _give_fresh(held)
                    held[:] = self._take(channel, queue, 1, scope.connection)
                    if not held:
                        return
                    yield held[0]

            messages = taken()
            try:
                yield messages
            except BaseException:
                messages.close()
                with contextlib.suppress(Exception):  # logged; the caller's error matters
                    _give_fresh(held)
                raise
            messages.close()
            _give_fresh(held)
            self._settled_round_trip(channel, queue, scope.connection)

    def _settled_round_trip(self, channel: Any, queue: str,
                            connection: kombu.Connection) -> None:
        """Return once the broker has applied every acknowledgement sent on ``channel``:
        a channel handles its methods in order, so the answer to a synchronous one (a
        passive declare) comes after the acks before it were passed to their queue. A
        channel closed at once after its acks may lose them (the messages come back)."""
        if not self._is_amqp:
            return
        try:
            channel.queue_declare(queue=queue, passive=True)
        except Exception as exc:
            classified = _classified(exc, connection, f"settling the messages of {queue!r}",
                                     refusal=TransportUnavailable, url=self.safe_url)
            if classified is None:
                raise
            raise classified from exc

    def _take(self, channel: Any, queue: str, count: int,
              connection: kombu.Connection) -> list[_KombuDelivery]:
        """Up to ``count`` messages of ``queue``, unsettled; all given back on a failure."""
        bound = Queue(queue, durable=True, no_declare=True)(channel)
        outage = _broker_errors(connection)
        taken: list[_KombuDelivery] = []
        try:
            while len(taken) < count:
                message = bound.get(no_ack=False)
                if message is None:
                    break
                taken.append(_KombuDelivery(queue, message, outage=outage,
                                            native_requeue=self._is_amqp))
        except BaseException as exc:
            with contextlib.suppress(Exception):  # logged; the failure to take matters
                _give_back(taken)
            classified = (_classified(exc, connection, f"taking messages of {queue!r}",
                                      refusal=DestinationRefused, url=self.safe_url)
                          if isinstance(exc, Exception) else None)
            if classified is None:
                raise
            raise classified from exc
        return taken

    def pending(self, queue: str) -> int:
        scope = self._channel()
        with scope as channel:
            try:
                _, count, _ = channel.queue_declare(queue=queue, passive=True)
            except Exception as exc:
                if "NOT_FOUND" in str(exc) or "404" in str(exc):
                    return 0  # no such queue: nothing waits in it
                classified = _classified(exc, scope.connection, f"counting {queue!r}",
                                         refusal=BrokerAccessDenied, url=self.safe_url)
                raise classified if classified is not None else exc from exc
        return int(count)

    def delete_queue(self, queue: str) -> None:
        """Delete ``queue`` and its messages (tests and samples clean up with this)."""
        with self._channel() as channel:
            channel.queue_delete(queue=queue)
            if self._is_redis:
                channel.client.srem(REDIS_QUEUES, queue)
        self._known_queues.discard(queue)
        self._delay_bound.discard(queue)

    def delete_exchange(self) -> None:
        """Delete this transport's events exchange (tests and samples clean up with this)."""
        with self._channel() as channel:
            self._events(channel).delete()
        self._exchange_declared = False

    # -- connections ------------------------------------------------------------------

    def _connect(self, options: Mapping[str, Any] | None = None) -> kombu.Connection:
        connection = kombu.Connection(self.url, transport_options=dict(
            self._transport_options if options is None else options))
        try:
            connection.ensure_connection(max_retries=3, interval_start=0.1, interval_step=0.5)
        except Exception as exc:
            _close_quietly(connection)
            raise _connection_failure(exc, connection, self.safe_url) from exc
        if self._is_amqp:
            amqp_reads.read_in_chunks(connection.connection.transport)
        with self._connections_lock:
            self._connections.append(connection)
        return connection

    def _release(self, connection: kombu.Connection) -> None:
        with self._connections_lock:
            if connection in self._connections:
                self._connections.remove(connection)
        _close_quietly(connection)

    def _channel(self) -> _ChannelScope:
        return _ChannelScope(self)

    def close(self) -> None:
        with self._connections_lock:
            connections, self._connections = self._connections, []
        for connection in connections:
            _close_quietly(connection)
        self._local = threading.local()


class _ChannelScope:
    """A short-lived channel on a short-lived connection."""

    def __init__(self, transport: KombuTransport) -> None:
        self._transport = transport

    def __enter__(self) -> Any:
        self._connection = self._transport._connect()
        self._channel = self._transport._raw_channel(self._connection)
        return self._channel

    def __exit__(self, *exc: object) -> None:
        self._transport._release(self._connection)

    @property
    def connection(self) -> kombu.Connection:
        return self._connection


class _KombuDelivery(Delivery):
    def __init__(self, queue: str, message: kombu.Message, *, settled: bool = False,
                 native_requeue: bool = True,
                 outage: tuple[type[BaseException], ...] = (),
                 events_exchange: str | None = None) -> None:
        try:
            raw = {name: value for name, value
                   in delays.without_dead_letter_headers(message.headers or {}).items()
                   if name not in _BROKER_HEADERS}
            headers, problem = wire.text_headers(raw)
            problem = _joined(problem, _encoding_problem(raw, message.content_encoding),
                              _foreign_key(message, headers, events_exchange))
        except Exception as exc:  # input nobody foresaw: refused, never a stopped consumer
            log.exception("could not read the headers of a message of %r", queue)
            headers, problem = {}, f"its headers could not be read: {wire.shown(exc)}"
        super().__init__(
            queue=queue,
            headers=headers,
            body=_as_bytes(message.body, message.content_encoding),
            content_type=message.content_type,
            content_encoding=message.content_encoding,
            redelivered=bool(message.delivery_info.get("redelivered")),
            wire_error=problem,
        )
        self._message = message
        self.settled = settled
        self._native_requeue = native_requeue
        #: What the delivery's connection raises once it is gone.
        self._outage = outage

    def _ack(self) -> None:
        with self._outage_translated("acknowledge"):
            self._message.ack()

    @property
    def delivery_tag(self) -> int:
        tag: int = self._message.delivery_tag
        return tag

    @property
    def channel(self) -> Any:
        return self._message.channel

    def ack_up_to_here(self) -> None:
        """Acknowledge this delivery and every earlier one of its channel not settled
        yet (``basic.ack`` with ``multiple``)."""
        if self.settled:
            raise RuntimeError(f"delivery from {self.queue!r} was already settled")
        with self._outage_translated("acknowledge"):
            self._message.ack(multiple=True)
        self.settled = True

    def _requeue(self) -> None:
        with self._outage_translated("requeue"):
            self._requeue_on_its_queue()

    def requeue_fresh(self) -> None:
        """Give the message back as a new one: a copy without the broker's delivery
        count and dead-letter history is published to its queue (confirmed where the
        broker confirms), then the original acknowledged. Unlike :meth:`requeue`, this
        never counts as a redelivery towards a quorum queue's ``x-delivery-limit``."""
        message = self._message
        headers = {name: value for name, value
                   in delays.without_dead_letter_headers(message.headers or {}).items()
                   if name not in _BROKER_HEADERS}

        def publish_then_ack() -> None:
            with self._outage_translated("give back"):
                kombu.Producer(message.channel).publish(
                    message.body, exchange="", routing_key=self.queue, headers=headers,
                    content_type=message.content_type,
                    content_encoding=message.content_encoding, delivery_mode=2)
                message.ack()

        self._settle(publish_then_ack)

    @contextlib.contextmanager
    def _outage_translated(self, action: str) -> Iterator[None]:
        try:
            yield
        except self._outage as exc:
            raise TransportUnavailable(
                f"could not {action} a message of {self.queue!r} ({exc}); its connection is "
                "gone, so the broker delivers it again"
            ) from exc

    def _requeue_on_its_queue(self) -> None:
        if self._native_requeue:
            self._message.requeue()
            return
        # kombu's virtual transports (memory://, redis://) route a requeued message through
        # its exchange again, which would copy an event into every subscribed queue. Put it
        # back on the queue it came from instead, then let the original go.
        message = self._message
        kombu.Producer(message.channel).publish(
            message.body,
            exchange="",
            routing_key=self.queue,
            headers=message.headers,
            content_type=message.content_type,
            content_encoding=message.content_encoding,
            delivery_mode=2,
        )
        message.ack()


class _Unanswered:
    """A place in :meth:`KombuTransport.dispatch_many`'s answers not filled yet."""


_UNANSWERED = _Unanswered()
#: Seconds a batch's publishes wait for their confirms before each goes alone.
_CONFIRM_TIMEOUT = 30.0


def _what(envelope: Envelope, routing_key: str) -> str:
    """How an error names a publish."""
    return (f"publishing {envelope.headers.get(h.MESSAGE_ID, 'a message without id')} to "
            f"{'queue' if envelope.destination else 'exchange'} {routing_key!r}")


def event_routing_key(envelope: Envelope) -> str:
    """The routing key of a published event: its type's name, or, for an event that
    encloses several types (``idembus.enclosed_types``), the key that reaches the
    subscribers of each (:func:`idembus.hierarchy.routing_key`)."""
    return hierarchy.expected_routing_key(envelope.message_type,
                                          envelope.headers.get(h.ENCLOSED_TYPES))


def _foreign_key(message: kombu.Message, headers: Mapping[str, str],
                 events_exchange: str | None) -> str | None:
    """Why a delivery from the events exchange does not belong to its headers: its routing
    key is neither its type's name nor that type's hierarchy key (``None``: it does, or it
    came otherwise — sent to the queue, a delayed retry). Topic permissions bound the keys
    an account publishes with; this check binds the type header to the key."""
    info = message.delivery_info or {}
    if events_exchange is None or info.get("exchange") != events_exchange:
        return None
    routing = info.get("routing_key")
    if not isinstance(routing, str):
        return None
    return hierarchy.unexpected_routing_key(routing, headers.get(h.MESSAGE_TYPE),
                                            headers.get(h.ENCLOSED_TYPES))


def _give_back(deliveries: list[_KombuDelivery]) -> None:
    """Requeue every unsettled delivery; try them all, then raise the first failure.

    A delivery that could not be requeued (the broker is unreachable) stays unacknowledged
    and is not lost: RabbitMQ requeues it when the connection closes; on redis:// kombu
    restores it when the channel closes or after its visibility timeout, through the
    exchange it came from (for a message sent to the queue directly, as everything in an
    error queue is, that is the queue itself). memory:// cannot fail here.
    """
    failures: list[Exception] = []
    for delivery in deliveries:
        if delivery.settled:
            continue
        try:
            delivery.requeue()
        except Exception as exc:
            log.warning("could not give a message back to %r: %s", delivery.queue, exc)
            failures.append(exc)
    if failures:
        raise failures[0]


def _give_fresh(deliveries: list[_KombuDelivery]) -> None:
    """Give back, as fresh copies, those of ``deliveries`` left unsettled."""
    for delivery in deliveries:
        if not delivery.settled:
            delivery.requeue_fresh()


def _broker_errors(connection: kombu.Connection) -> tuple[type[BaseException], ...]:
    """What a delivery's connection raises once it is gone (acknowledging then fails)."""
    return (*connection.connection_errors, *connection.channel_errors,
            kombu.exceptions.OperationalError)


def _causes(error: BaseException) -> Iterator[BaseException]:
    """``error`` and what it was raised from (kombu wraps driver errors)."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _classified(error: BaseException, connection: kombu.Connection, what: str, *,
                refusal: type[TransportError], url: str,
                preposition: str = "on") -> TransportError | None:
    """The failure taxonomy for a broker error met while doing ``what``: transient
    (``TransportUnavailable``), or ``refusal`` — ``DestinationRefused`` where the broker
    refused this message's destination or content, ``BrokerAccessDenied`` where it refused
    the endpoint's own queue. ``None``: not a broker error."""
    text = f"{what} {preposition} {url}: {redact(str(error))}"
    if isinstance(error, TransportError):
        return error
    recoverable = _recoverable(connection)
    for cause in _causes(error):
        if isinstance(cause, _MESSAGE_CAUSED):
            return refusal(text)
        if isinstance(cause, recoverable):
            return TransportUnavailable(text)
        if isinstance(cause, tuple(connection.channel_errors)):
            return refusal(text)
        if isinstance(cause, (*connection.connection_errors,
                              kombu.exceptions.OperationalError)):
            return TransportUnavailable(text)
    if isinstance(error, AttributeError):
        # After its connection died for good, kombu's producer has no connection left.
        return TransportUnavailable(text)
    return None


def _recoverable(connection: kombu.Connection) -> tuple[type[BaseException], ...]:
    """The errors that kombu's transport says go away by themselves. Where a transport does
    not say (memory://, redis://), kombu counts every channel error as recoverable, so a
    missing queue would be waited out forever: only connection errors are, then."""
    transport = connection.get_transport_cls()
    if hasattr(transport, "recoverable_connection_errors"):
        return (*transport.recoverable_connection_errors,
                *getattr(transport, "recoverable_channel_errors", ()))
    return tuple(connection.connection_errors)


def _connection_failure(error: Exception, connection: kombu.Connection,
                        url: str) -> Exception:
    """A failure to connect: a refused login or virtual host is the endpoint's to fix
    (``BrokerAccessDenied``); anything else a broker can say, an outage."""
    for cause in _causes(error):
        if isinstance(cause, _LOGIN_REFUSED) or _is_redis_auth_error(cause):
            return BrokerAccessDenied(f"{url} refused this endpoint: {redact(str(cause))}")
    classified = _classified(error, connection, "cannot connect", refusal=TransportUnavailable,
                             url=url, preposition="to")
    return classified if classified is not None else TransportUnavailable(
        f"cannot connect to {url}: {redact(str(error))}")


def _is_redis_auth_error(error: BaseException) -> bool:
    """redis-py's refusal of a password (or of a missing one)."""
    name = type(error).__name__
    return (type(error).__module__.startswith("redis") and name.startswith("Authentication")
            or "NOAUTH" in str(error) or "WRONGPASS" in str(error))


class _RawBody:
    """Mixed into a channel's kombu ``Message`` class: the body stays as the broker holds
    it. kombu decompresses a body with a ``compression`` header while it builds the
    message — before anyone could refuse it — unless the message already has errors, so
    the message has one while it is built and none after."""

    errors: list[Any] | None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.errors = [(None, None, None)]
        super().__init__(*args, **kwargs)
        self.errors = []


def _as_bytes(body: Any, encoding: str | None) -> bytes:
    """The body's bytes. Channels here do not decode bodies (:meth:`KombuTransport.
    _raw_channel`); should a driver have decoded one anyway, it is encoded back with the
    encoding it was decoded by, never re-encoded as UTF-8 (a latin-1 ``b"\\xe9"`` would
    become ``b"\\xc3\\xa9"``). An empty body stays empty (``"".encode("utf-16")`` is a
    byte order mark)."""
    if isinstance(body, bytes):
        return body
    if isinstance(body, str):
        if not body:  # py-amqp's body of a message without one (no body frame)
            return b""
        try:
            return body.encode(encoding or "utf-8", "surrogateescape")
        except LookupError:  # an encoding Python does not know cannot have decoded it
            return body.encode("utf-8", "surrogateescape")
    return bytes(body)


def _as_sent(text: str | None) -> Any:
    """A content type or encoding as its bytes went over the wire: text that a content
    header carried as bytes that are not UTF-8 (see :func:`_lenient_frames`) goes back out
    as those bytes (py-amqp writes bytes as they are), not as the escapes."""
    if text is None:
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        try:
            return text.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:  # surrogates that were on the wire as such
            return text.encode("utf-8", "surrogatepass")
    return text


#: The properties of a basic content header, by flag bit, in wire order, by kind: a short
#: string (``s``), the headers table (``F``), an octet (``o``), a timestamp (``T``).
_PROPERTIES = ((0x8000, "s"), (0x4000, "s"), (0x2000, "F"), (0x1000, "o"), (0x0800, "o"),
               (0x0400, "s"), (0x0200, "s"), (0x0100, "s"), (0x0080, "s"), (0x0040, "T"),
               (0x0020, "s"), (0x0010, "s"), (0x0008, "s"), (0x0004, "s"))
#: Where a content header's property flags start: after class id, weight and body size.
_FLAGS_AT = 12
_SHORTSTR_MAX = 255


def _lenient_frames(connection: Any, callback: Any, **options: Any) -> Callable[[Any], Any]:
    """py-amqp's frame reader for the connections here, except for a content header whose
    short-string properties (content type and encoding, message id, type, ...) are not
    UTF-8: py-amqp raised ``UnicodeDecodeError`` on it, the consumer died, and the broker
    gave the same message to the next one — one message stopped an endpoint for good.
    Such a header is read again with those bytes as surrogate escapes (at most 255 bytes
    of them), so the message arrives: idembus reads no AMQP property but the content type
    and encoding, and refuses a message whose content type or encoding is not text."""
    on_frame = amqp.method_framing.frame_handler(connection, callback, **options)

    def on_any_frame(frame: Any) -> Any:
        try:
            return on_frame(frame)
        except UnicodeDecodeError:
            frame_type, channel, payload = frame
            if frame_type != 2:  # only a content header carries what a publisher chose
                raise
            return on_frame((frame_type, channel, _escaped_header(bytes(payload))))

    return on_any_frame


def _escaped_header(payload: bytes) -> bytes:
    """A basic content header with every short string that is not UTF-8 escaped."""
    (flags,) = struct.unpack_from(">H", payload, _FLAGS_AT)
    offset = _FLAGS_AT + 2
    rewritten = bytearray(payload[:offset])
    for bit, kind in _PROPERTIES:
        if not flags & bit:
            continue
        if kind == "s":
            size = payload[offset]
            text = _escaped(payload[offset + 1:offset + 1 + size])
            rewritten += bytes([len(text)]) + text
            offset += 1 + size
            continue
        (size,) = struct.unpack_from(">I", payload, offset) if kind == "F" else (0,)
        width = {"F": 4 + size, "o": 1, "T": 8}[kind]
        rewritten += payload[offset:offset + width]
        offset += width
    return bytes(rewritten + payload[offset:])


def _escaped(raw: bytes) -> bytes:
    """``raw`` if it is UTF-8 (surrogates allowed, as py-amqp reads it); else its
    surrogate-escaped form, cut to a short string's 255 bytes between characters."""
    try:
        raw.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        text = raw.decode("utf-8", "surrogateescape")
        escaped = text.encode("utf-8", "surrogatepass")
        while len(escaped) > _SHORTSTR_MAX:
            text = text[:-1]
            escaped = text.encode("utf-8", "surrogatepass")
        return escaped
    return raw


def _takes_delayed(queue: str) -> bool:
    """Whether delayed messages can be routed to ``queue`` by name (see
    :func:`delays.check_queue_name`)."""
    try:
        delays.check_queue_name(queue)
    except ValueError as exc:
        log.warning("%s", exc)
        return False
    return True


def _close_quietly(connection: kombu.Connection) -> None:
    try:
        connection.close()
    except Exception:  # closing a broken connection may raise; nothing to do about it
        log.debug("closing a kombu connection failed", exc_info=True)
