"""The kombu transport's topology: queues, the events exchange and its bindings, the delay
levels, looking up a queue before a send, and what a mismatch with what the broker holds
means (a configuration error saying what to change)."""

from __future__ import annotations

import logging
import re
from collections.abc import Collection
from typing import Any

import kombu
from kombu import Queue, binding

from .. import hierarchy, routing
from ..errors import ConfigurationError
from ..redaction import redact
from . import delays
from .errors import BrokerAccessDenied, DestinationRefused, TransportError
from .kombu_core import REDIS_QUEUES
from .kombu_errors import _causes, _classified
from .kombu_replies import KombuReplyQueues

log = logging.getLogger(f"{__package__}.kombu")  # one logger for the kombu transport

#: The queue argument with which RabbitMQ delivers to one consumer at a time.
SINGLE_ACTIVE_CONSUMER = "x-single-active-consumer"
#: How RabbitMQ names what a PRECONDITION_FAILED is about.
_ENTITY = re.compile(r"for (queue|exchange) '(.*?)' in vhost")


class KombuTopology(KombuReplyQueues):
    """Declaring and deleting queues, the events exchange and the delay levels."""

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
                if self._is_redis:
                    from .redis_taking import require_server
                    require_server(channel.client, self.safe_url)
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
            except ConfigurationError:
                raise
            except Exception as exc:
                raise self._topology_failure(exc, scope.connection, f"declaring queue {queue!r}",
                                             refusal=BrokerAccessDenied) from exc
        self._known_queues.add(queue)
        if delayed:
            self._delay_bound.add(queue)

    def declare_partitions(self, queue: str, count: int) -> None:
        """Declare the ``count`` partition queues of ``queue``'s ordered messages
        (``<queue>.ordered.<i>``, :func:`idembus.routing.partition_queue`), each durable, of
        this transport's queue type and, on RabbitMQ, with a single active consumer
        (``x-single-active-consumer``): the broker gives each to one consumer at a time,
        the others standing by. Idempotent."""
        arguments = dict(self._queue_arguments)
        if self._is_amqp:
            arguments[SINGLE_ACTIVE_CONSUMER] = True
        scope = self._channel()
        with scope as channel:
            for index in range(count):
                name = routing.partition_queue(queue, index)
                try:
                    Queue(name, durable=True, queue_arguments=arguments or None)(
                        channel).declare()
                    if self._is_redis:
                        channel.client.sadd(REDIS_QUEUES, name)
                except Exception as exc:
                    raise self._topology_failure(exc, scope.connection,
                                                 f"declaring queue {name!r}",
                                                 refusal=BrokerAccessDenied) from exc
                self._known_queues.add(name)
        self._partition_counts[queue] = count

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

    def delete_queue(self, queue: str) -> None:
        """Delete ``queue`` and its messages (tests and samples clean up with this)."""
        with self._channel() as channel:
            channel.queue_delete(queue=queue)
            if self.process_local:  # kombu's memory:// deletes only a queue with bindings
                channel.queues.pop(queue, None)
            if self._is_redis:
                channel.client.srem(REDIS_QUEUES, queue)
                self._forget_lease(channel, queue)
        self._known_queues.discard(queue)
        self._delay_bound.discard(queue)

    def delete_exchange(self) -> None:
        """Delete this transport's events exchange (tests and samples clean up with this)."""
        with self._channel() as channel:
            self._events(channel).delete()
        self._exchange_declared = False


def _takes_delayed(queue: str) -> bool:
    """Whether delayed messages can be routed to ``queue`` by name (see
    :func:`delays.check_queue_name`)."""
    try:
        delays.check_queue_name(queue)
    except ValueError as exc:
        log.warning("%s", exc)
        return False
    return True
