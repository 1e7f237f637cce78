"""What every part of the kombu transport stands on: its options (:class:`KombuCore`'s
constructor), its connections and short-lived channels, raw channels (bodies kept as the
broker holds them). The parts by concern — :mod:`.kombu_topology`, :mod:`.kombu_publishing`,
:mod:`.kombu_consuming`, :mod:`.kombu_inspection` — extend it, and
:class:`~idembus.transports.kombu.KombuTransport` joins them."""

from __future__ import annotations

import importlib.util
import logging
import math
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import kombu
from kombu import Exchange
from kombu.transport import pyamqp

from ..errors import ConfigurationError
from ..logs import Throttle
from ..policies import Backoff
from ..redaction import redact
from . import amqp_reads, delays
from .base import Transport
from .kombu_errors import _connection_failure
from .kombu_frames import _lenient_frames, _RawAmqpBody, _RawBody
from .kombu_in_process import in_process_tags
from .reply_leases import check_lease

log = logging.getLogger(f"{__package__}.kombu")  # one logger for the kombu transport

#: Seconds between polls of kombu's virtual transports. kombu's default (1 s) made an idle
#: memory:// consumer wait ~0.5 s per message; on Redis it is also the BRPOP timeout, which
#: bounds how long a consumer takes to notice that it should stop.
_DEFAULT_POLLING_INTERVALS = {"memory": 0.005, "redis": 0.1, "rediss": 0.1}
#: How long one wait for deliveries lasts before the stop flag is looked at again.
_DRAIN_TIMEOUT = 0.1
QUEUE_TYPES = ("quorum", "classic")
#: The argument that says on how many nodes of a cluster a quorum queue is replicated.
GROUP_SIZE = "x-quorum-initial-group-size"
#: The Redis set in which ``declare`` records queues, for sends to look in.
REDIS_QUEUES = "_idembus.queues"


class KombuCore(Transport):
    """The kombu transport's options, connections and channels (see
    :class:`~idembus.transports.kombu.KombuTransport`).

    ``url`` may name several brokers, the nodes of one cluster: kombu's failover syntax
    (``amqp://a;amqp://b;amqp://c``) or a list of URLs. Every connection is made to the
    node that answered last, and to the next one, round robin, when it does not."""

    def __init__(
        self,
        url: str | Sequence[str] = "memory://",
        *,
        exchange: str = "idembus.events",
        confirm_publish: bool = True,
        polling_interval: float | None = None,
        transport_options: Mapping[str, Any] | None = None,
        reconnect_backoff: Backoff | None = None,
        queue_type: str = "quorum",
        queue_arguments: Mapping[str, Any] | None = None,
        reply_lease: float = 30.0,
        partition_lease: float = 10.0,
    ) -> None:
        #: The broker URLs: one, or the nodes of a cluster.
        self.urls = _split_urls(url)
        url = ";".join(self.urls)
        self.url = url
        #: The URL as it may be shown: without its password.
        self.safe_url = redact(url)
        #: Index in :attr:`urls` of the node the last connection reached.
        self._preferred = 0
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
        try:
            self.reply_lease = check_lease(reply_lease)
        except ValueError as exc:
            raise ConfigurationError(str(exc)) from exc
        #: Redis: reply queues have a lease (:mod:`.kombu_replies`); RabbitMQ ties them to
        #: the connection, memory:// to the process.
        self.expiring_reply_queues = self._is_redis
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
        self._delay_levels = delays.Topology.for_queue_type(
            queue_type, _group_size(self._queue_arguments))
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
        if (isinstance(partition_lease, bool) or not isinstance(partition_lease, int | float)
                or not partition_lease > 0):
            raise ConfigurationError(
                f"partition_lease must be a number of seconds above 0, not {partition_lease!r}")
        #: On Redis, the life of a partition's lease (seconds): how long a partition of a
        #: process that died waits before another process takes it.
        self.partition_lease = float(partition_lease)
        if self._is_redis:
            # A consumer's landing lists (:mod:`.redis_taking`) outlive a killed process as
            # long as its partitions' leases.
            options.setdefault("landing_lease", self.partition_lease)
            # kombu's lock around a sweep of unacknowledged messages whose visibility timed
            # out: a process killed while it held it stopped every sweep for kombu's 300 s;
            # a sweep takes milliseconds, so a killed holder now delays them a lease at most.
            options.setdefault("unacked_mutex_expire", max(1, math.ceil(self.partition_lease)))
        #: How many partitions each queue was declared with (``declare_partitions``).
        self._partition_counts: dict[str, int] = {}
        #: On Redis, this process's leases on each queue's partitions.
        self._leases: dict[str, Any] = {}

    @property
    def exchange_name(self) -> str:
        """Name of the topic exchange events are published to."""
        return str(self._events.name)

    # -- connections ------------------------------------------------------------------

    def _connect(self, options: Mapping[str, Any] | None = None) -> kombu.Connection:
        """A connection to the node that answered last, or, failing that, to the next ones
        (round robin; every node is tried at least once)."""
        start = self._preferred
        ordered = self.urls[start:] + self.urls[:start]
        connection = self._connection_class()(
            ordered if len(ordered) > 1 else ordered[0],
            transport_options=dict(self._transport_options if options is None else options))
        failures = 0

        def failed(error: Exception, interval: float) -> None:
            nonlocal failures
            failures += 1

        try:
            connection.ensure_connection(errback=failed, max_retries=max(3, len(ordered)),
                                         interval_start=0.1, interval_step=0.5)
        except Exception as exc:
            _close_quietly(connection)
            raise _connection_failure(exc, connection, self.safe_url) from exc
        if len(ordered) > 1:
            self._preferred = (start + failures) % len(ordered)
        if self._is_amqp:
            amqp_reads.read_in_chunks(connection.connection.transport)
        with self._connections_lock:
            self._connections.append(connection)
        return connection

    def _connection_class(self) -> Any:
        """kombu's, or on Redis one whose consumers take messages by moving them
        (:mod:`.redis_taking`)."""
        if not self._is_redis:
            return kombu.Connection
        from .redis_taking import TakingConnection
        return TakingConnection

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


    def _raw_channel(self, connection: kombu.Connection) -> Any:
        """A new channel whose messages keep their bodies as the broker holds them: neither
        decompressed by kombu (:class:`_RawBody`) nor decoded by py-amqp by their content
        encoding (which turned a latin-1 body into text that was then written as UTF-8)."""
        channel = connection.channel()
        if self.process_local:
            in_process_tags(channel)
        if hasattr(channel, "auto_decode"):
            channel.auto_decode = False
        base = type(channel).Message
        raw = self._raw_message_classes.get(base)
        if raw is None:
            mixin = _RawAmqpBody if base is pyamqp.Message else _RawBody
            raw = type(f"Raw{base.__name__}", (mixin, base), {})
            self._raw_message_classes[base] = raw
        channel.Message = raw
        return channel

    def _overrides(self, *methods: str) -> bool:
        """Whether a subclass overrides one of ``methods`` (answered by
        :class:`~idembus.transports.kombu.KombuTransport`)."""
        raise NotImplementedError


class _ChannelScope:
    """A short-lived channel on a short-lived connection."""

    def __init__(self, transport: KombuCore) -> None:
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



def _group_size(arguments: Mapping[str, Any]) -> int | None:
    """The ``x-quorum-initial-group-size`` of ``arguments``, which the delay levels take
    too (their replicas on a cluster); ``None`` if absent."""
    size = arguments.get(GROUP_SIZE)
    if size is None:
        return None
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigurationError(f"queue_arguments[{GROUP_SIZE!r}] must be a whole number of "
                                 f"replicas (1 or more), not {size!r}")
    return size


def _split_urls(url: str | Sequence[str]) -> list[str]:
    """The broker URLs of ``url``: kombu's failover syntax or a list; one scheme for all."""
    parts = [url] if isinstance(url, str) else list(url)
    urls = [piece.strip() for part in parts for piece in _failover_pieces(part)
            if piece.strip()]
    if not urls:
        raise ConfigurationError("no broker URL given: use a kombu URL such as "
                                 "amqp://user:password@host:5672//, or several for a cluster")
    schemes = {piece.split("://", 1)[0].lower() if "://" in piece else piece for piece in urls}
    if len(schemes) > 1:
        raise ConfigurationError(
            f"the broker URLs {redact(';'.join(urls))!r} mix schemes "
            f"({', '.join(sorted(schemes))}): the nodes of one cluster speak one protocol")
    return urls


def _failover_pieces(url: str) -> list[str]:
    """``url`` split at ``;`` (kombu's failover syntax) when every piece is a URL; else
    whole: a raw ``;`` in a password is not a second node (the URL check then says how to
    write it)."""
    pieces = url.split(";")
    if len(pieces) > 1 and all("://" in piece for piece in pieces if piece.strip()):
        return pieces
    return [url]


def _close_quietly(connection: kombu.Connection) -> None:
    try:
        connection.close()
    except Exception:  # closing a broken connection may raise; nothing to do about it
        log.debug("closing a kombu connection failed", exc_info=True)
