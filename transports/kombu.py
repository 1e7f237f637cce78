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
  idembus reaches this broker without kombu's producer and consumer machinery
  (:mod:`.kombu_in_process`): a publish puts the message kombu would make (its body as
  bytes, not base64 text) on the queues its bindings route it to, matched once; a batch
  consumer blocks on its queue until a message is put there and takes each without
  kombu's ``Message`` and QoS. The messages stay in kombu's format: a kombu producer or
  channel in the process reads and writes the same queues. Consumers of one delivery at
  a time (and partition queues) go through kombu, whose polling interval defaults to 5 ms
  instead of its 1 s.
* ``inspect(queue)`` (tools such as ``idembus errors``) takes the waiting messages with
  ``basic_get`` on one channel, unacknowledged. RabbitMQ puts the ones not acknowledged
  back in their original places (and does the same if the tool dies meanwhile). On
  memory:// and redis:// each goes back as a copy published to that queue, after which the
  original is acknowledged: they end up behind the messages not taken, in the order they
  were taken. (kombu's own requeue there would route an event through its exchange again,
  into every subscribed queue, and memory:// drops unacknowledged messages when a channel
  closes.) A tool that dies on redis:// leaves them to kombu's visibility timeout (1 h).
* On ``redis://`` the polling interval (kombu's BRPOP timeout, here ``BLMOVE``'s) defaults
  to 0.1 s, so a consumer stops within a fraction of a second. Consumers take a message by
  moving it, so that a process killed loses nothing (:mod:`.redis_taking`).

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

Modules
=======
:class:`KombuTransport` joins the parts of the transport, one module each:
:mod:`.kombu_core` (options, connections, raw channels), :mod:`.kombu_topology` (queues,
bindings, delay levels, mismatches), :mod:`.kombu_publishing` (sends, publishes, batches
with one confirm wait, over :mod:`.confirms` and :mod:`.delays`), :mod:`.kombu_consuming`,
:mod:`.kombu_inspection` (get, inspect, take, pending), :mod:`.kombu_delivery`,
:mod:`.kombu_errors` (the failure taxonomy) and :mod:`.kombu_frames` (bodies and properties
kept as the broker holds them).

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
``reply_lease``      redis://: seconds a reply queue (``bus.request``) outlives a requester
                     that died without closing its endpoint (30; renewed every third of it)
``partition_lease``  on Redis, the life (seconds, 10) of a process's lease on a partition
                     queue of ordered messages: a process consumes a partition only while it
                     holds its lease (:mod:`.redis_leases`); and of a consumer's lease on the
                     message it is taking (:mod:`.redis_taking`)
"""

from __future__ import annotations

from ..wire import encoding_problem as _encoding_problem
from .kombu_consuming import KombuConsuming
from .kombu_core import QUEUE_TYPES, REDIS_QUEUES
from .kombu_delivery import _KombuDelivery
from .kombu_errors import _classified, _connection_failure
from .kombu_frames import _RawBody
from .kombu_inspection import KombuInspection
from .kombu_publishing import KombuPublishing, event_routing_key

#: The public names, and the private ones tests reach here (where they were before the
#: transport was split by concern).
__all__ = ["QUEUE_TYPES", "REDIS_QUEUES", "KombuTransport", "event_routing_key",
           "_KombuDelivery", "_RawBody", "_classified", "_connection_failure",
           "_encoding_problem"]


class KombuTransport(KombuPublishing, KombuConsuming, KombuInspection):
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
    reply_lease:
        redis://: seconds a reply queue outlives a requester that died without closing its
        endpoint (:mod:`idembus.transports.kombu_replies`).
    partition_lease:
        On Redis, the life in seconds of a process's lease on a partition queue of ordered
        messages (renewed every fifth of it): how long the partitions of a process that
        died wait before another process consumes them, and the message it was taking
        before it goes back to its queue.
    """

    #: Ordered messages travel in partition queues (``<queue>.ordered.<i>``).
    partition_queues = True

    def _overrides(self, *methods: str) -> bool:
        """Whether a subclass overrides one of ``methods``: the batched paths then go
        through them (a test's fault injection, a user's instrumentation) one at a time."""
        return any(getattr(type(self), name) is not getattr(KombuTransport, name)
                   for name in methods)
