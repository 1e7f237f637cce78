"""Delayed delivery on RabbitMQ without a plugin: a cascade of binary delay levels.

A delay is a whole number of seconds below 2^28 (8.5 years), written in binary. Level ``k``
holds a message for 2^k seconds, so a message visits the level of every 1 bit of its delay
and skips the others: 5 s = 4 s (level 2) + 1 s (level 0).

Topology (all durable, declared by every transport that delays, identical arguments)::

    publish to the exchange of the delay's highest 1 bit, routing key = bits + queue name

    exchange idembus.delay.27 --bit 27 = 1--> queue idembus.delay.27 (TTL 2^27 s)
          |                                          | expired: dead-lettered to
          +--bit 27 = 0--> exchange idembus.delay.26 <---+
                                ...
    exchange idembus.delay.1  --bit 1 = 1--> queue idembus.delay.1 (TTL 2 s)
          |                                          |
          +--bit 1 = 0--> exchange idembus.delay.0 <-----+
    exchange idembus.delay.0  --bit 0 = 1--> queue idembus.delay.0 (TTL 1 s)
          |                                          |
          +--bit 0 = 0--> exchange idembus.delay.deliver <--+
    exchange idembus.delay.deliver --"*.*.(28 times).sales.eu"--> queue sales.eu

The routing key spells the delay's 28 bits from bit 27 down to bit 0 as words, then the
destination queue's name: a 5 s delay to ``sales.eu`` is ``0.0.….0.1.0.1.sales.eu`` (25
zeros, then 1, 0, 1). Exchange ``k`` looks only at word ``27 - k``. Dead-lettering keeps
the routing key, so the message walks down the levels and reaches ``idembus.delay.deliver``,
where each destination queue is bound with a pattern that skips the 28 bit words and spells
its name word by word (NServiceBus binds ``#.<queue>``, which also matches every queue
whose name ends in ``.<queue>``; ``*`` and ``#`` words are refused in names for the same
reason).

Every message in a level's queue waits the same time, so they expire in arrival order: a
short delay never waits behind a long one, which is what per-message TTLs in one queue get
wrong (RabbitMQ expires only the head of a queue; 0.5 s behind 4 s waited 4 s).

Delays are rounded *up* to whole seconds: a message is never early and at most one second
late. A finer unit would either shorten the longest delay (milliseconds in 28 levels: 74
hours) or add levels, hence queues and dead-letter hops; idembus delays (retries, deferrals)
are seconds to days, so a second is the unit.

Two topologies exist side by side, by queue type (``KombuTransport(queue_type=)``):
classic levels (``idembus.delay.*``) dead-letter *at most once* — a message in flight when a
node fails can be lost between two levels — and quorum levels (``idembus.qdelay.*``) are
quorum queues with ``x-dead-letter-strategy=at-least-once`` (and the
``x-overflow=reject-publish`` it requires; RabbitMQ 3.10 or later), which keep a message in
its level until the next level has it. Their names differ so that a broker that already has
one never sees the other redeclared with other arguments, and a deployment can move from
one to the other while the old levels drain.

A message whose destination queue was deleted while it waited matches no binding of the
delivery exchange. Rather than drop it (classic levels) or keep retrying it at the head of
level 0 (quorum levels dead-letter at least once: RabbitMQ holds an unroutable message in
the level and retries it, and 32 such messages stop the level for everyone — seen on
RabbitMQ 3.10), the delivery exchange has an *alternate exchange*, ``<prefix>.undeliverable``,
which routes whatever matches no binding into the queue of the same name, headers and
routing key (hence the destination's name) unchanged. Nothing is lost and no level stalls;
an operator moves them on or purges them.

Everything here but :meth:`Topology.declare` and :meth:`Topology.bind_destination` is
arithmetic.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kombu import Exchange, Queue

#: Number of binary delay levels.
LEVELS = 28
#: The longest delay, in seconds (8.5 years).
MAX_DELAY = (1 << LEVELS) - 1
#: Name prefix of the classic level exchanges and queues.
PREFIX = "idembus.delay"
#: Name prefix of the quorum level exchanges and queues.
QUORUM_PREFIX = "idembus.qdelay"
#: Where classic level 0 dead-letters to; binds every destination that got a delayed message.
DELIVER_EXCHANGE = f"{PREFIX}.deliver"
#: AMQP limit on routing and binding keys (a shortstr), in bytes.
MAX_KEY_BYTES = 255
#: Headers RabbitMQ adds when it dead-letters a message (and prefixes of such headers):
#: bookkeeping, not the sender's.
DEAD_LETTER_HEADER = "x-death"
DEAD_LETTER_PREFIXES = ("x-first-death-", "x-last-death-")

_BIT_WORDS = LEVELS * "*."


@dataclass(frozen=True)
class Level:
    """One delay level: its exchange and queue (same name) and their bindings."""

    number: int
    prefix: str = PREFIX
    quorum: bool = False
    #: ``x-quorum-initial-group-size`` of a quorum level (``None``: RabbitMQ's default).
    group_size: int | None = None

    @property
    def name(self) -> str:
        return level_name(self.number, self.prefix)

    @property
    def ttl_ms(self) -> int:
        return 1000 << self.number  # 1000 * 2^k

    @property
    def dead_letter_exchange(self) -> str:
        """Where the queue's expired messages go: the level below, or delivery."""
        if self.number:
            return level_name(self.number - 1, self.prefix)
        return f"{self.prefix}.deliver"

    @property
    def queue_arguments(self) -> dict[str, Any]:
        """Fixed: RabbitMQ refuses to redeclare a queue with other arguments."""
        arguments: dict[str, Any] = {"x-message-ttl": self.ttl_ms,
                                     "x-dead-letter-exchange": self.dead_letter_exchange}
        if self.quorum:
            arguments.update({"x-queue-type": "quorum",
                              "x-dead-letter-strategy": "at-least-once",
                              "x-overflow": "reject-publish"})
            if self.group_size is not None:
                arguments["x-quorum-initial-group-size"] = self.group_size
        return arguments

    @property
    def hold_key(self) -> str:
        """Binding key of the level's queue: this level's bit is 1."""
        return self._bit_pattern("1")

    @property
    def pass_key(self) -> str:
        """Binding key of the next exchange down (:attr:`dead_letter_exchange`): bit is 0."""
        return self._bit_pattern("0")

    def _bit_pattern(self, bit: str) -> str:
        return (LEVELS - 1 - self.number) * "*." + bit + ".#"


def level_name(number: int, prefix: str = PREFIX) -> str:
    """Name of the exchange and of the queue of delay level ``number``."""
    return f"{prefix}.{number}"


def levels() -> list[Level]:
    """The classic levels, lowest first (the order to declare them: each binds the one
    below)."""
    return Topology.for_queue_type("classic").levels()


@dataclass(frozen=True)
class Topology:
    """The delay levels of one queue type: their names and how to declare them."""

    prefix: str
    quorum: bool
    #: ``x-quorum-initial-group-size`` of every quorum queue of the topology: the
    #: replicas of each level on a cluster (``None``: RabbitMQ's default).
    group_size: int | None = None

    @classmethod
    def for_queue_type(cls, queue_type: str, group_size: int | None = None) -> Topology:
        """The levels of ``queue_type``; ``group_size`` applies to quorum levels only."""
        if queue_type == "quorum":
            return cls(QUORUM_PREFIX, True, group_size)
        return cls(PREFIX, False)

    @property
    def deliver_exchange(self) -> str:
        """Where level 0 dead-letters to; binds every destination of a delayed message."""
        return f"{self.prefix}.deliver"

    @property
    def undeliverable(self) -> str:
        """The alternate exchange of :attr:`deliver_exchange`, and its queue: delayed
        messages whose destination no longer exists."""
        return f"{self.prefix}.undeliverable"

    @property
    def queue_arguments(self) -> dict[str, Any]:
        """Arguments of a queue of this topology's type that is not a level."""
        if not self.quorum:
            return {}
        if self.group_size is None:
            return {"x-queue-type": "quorum"}
        return {"x-queue-type": "quorum", "x-quorum-initial-group-size": self.group_size}

    def levels(self) -> list[Level]:
        """Every level, lowest first (each binds the one below)."""
        return [Level(number, self.prefix, self.quorum, self.group_size)
                for number in range(LEVELS)]

    def entry_exchange(self, delay: int) -> str:
        """The exchange a message delayed ``delay`` seconds is published to."""
        _check_delay(delay)
        return level_name(delay.bit_length() - 1, self.prefix)

    def declare(self, channel: Any) -> None:
        """Declare the delivery exchange (with its alternate exchange and queue) and every
        level, bindings included. Idempotent."""
        undeliverable = Exchange(self.undeliverable, type="fanout", durable=True)
        Queue(self.undeliverable, exchange=undeliverable, durable=True,
              queue_arguments=self.queue_arguments or None)(channel).declare()
        Exchange(self.deliver_exchange, type="topic", durable=True,
                 arguments={"alternate-exchange": self.undeliverable})(channel).declare()
        for level in self.levels():
            # Declares the level's exchange and queue and binds the queue for bit = 1 ...
            Queue(level.name, exchange=_exchange(level.name), routing_key=level.hold_key,
                  durable=True, queue_arguments=level.queue_arguments)(channel).declare()
            # ... and the next exchange down (declared just before) for bit = 0.
            _exchange(level.dead_letter_exchange)(channel).bind_to(
                level.name, routing_key=level.pass_key)

    def bind_destination(self, channel: Any, queue: str) -> None:
        """Bind the existing ``queue`` to the delivery exchange (idempotent); a queue that
        does not exist is refused by the broker (NOT_FOUND), never created here."""
        channel.queue_bind(queue=queue, exchange=self.deliver_exchange,
                           routing_key=deliver_key(queue))


# -- one message ------------------------------------------------------------------------


def parse_time(text: str | None) -> datetime.datetime | None:
    """An ISO 8601 time header as an aware datetime (UTC if zone-less, ``Z`` accepted);
    ``None`` if absent or unreadable."""
    if not text:
        return None
    if text.endswith(("Z", "z")):  # Python 3.10's fromisoformat does not take "Z"
        text = text[:-1] + "+00:00"
    try:
        moment = datetime.datetime.fromisoformat(text)
    except ValueError:
        return None
    return moment if moment.tzinfo else moment.replace(tzinfo=datetime.timezone.utc)


def delay_seconds(deliver_at: datetime.datetime | None, now: datetime.datetime) -> int:
    """Whole seconds (rounded up) from ``now`` until ``deliver_at``; 0 if due or absent.

    Raises ``ValueError`` beyond :data:`MAX_DELAY`: delivering earlier would break the
    promise.
    """
    if deliver_at is None:
        return 0
    seconds = math.ceil((deliver_at - now).total_seconds())
    if seconds > MAX_DELAY:
        raise ValueError(f"delivery at {deliver_at.isoformat()} is {seconds} s away; the "
                         f"longest delay on RabbitMQ is {MAX_DELAY} s (2^{LEVELS} - 1)")
    return max(seconds, 0)


def entry_exchange(delay: int) -> str:
    """The classic exchange a message delayed ``delay`` seconds is published to: its
    highest level."""
    return Topology.for_queue_type("classic").entry_exchange(delay)


def routing_key(delay: int, queue: str) -> str:
    """``delay``'s bits, highest first, as words, then ``queue``: ``0.(…).1.0.1.sales``."""
    _check_delay(delay)
    check_queue_name(queue)
    return ".".join(format(delay, f"0{LEVELS}b")) + "." + queue


def deliver_key(queue: str) -> str:
    """Binding key of ``queue`` on :data:`DELIVER_EXCHANGE`: any bits, then the name."""
    check_queue_name(queue)
    return _BIT_WORDS + queue


def check_queue_name(queue: str) -> None:
    """Refuse names that a topic pattern cannot match literally or that are too long."""
    if not queue:
        raise ValueError("a delayed message needs a destination queue")
    wildcards = {"*", "#"}.intersection(queue.split("."))
    if wildcards:
        raise ValueError(f"queue {queue!r} has a {' '.join(sorted(wildcards))!r} word, which "
                         "a topic binding reads as a wildcard; it cannot get delayed messages")
    longest = MAX_KEY_BYTES - len(_BIT_WORDS)
    if len(queue.encode("utf-8")) > longest:
        raise ValueError(f"queue {queue!r} is longer than {longest} bytes; delayed messages "
                         f"are routed by its name after {LEVELS} bit words, in {MAX_KEY_BYTES}")


def _check_delay(delay: int) -> None:
    if not 0 < delay <= MAX_DELAY:
        raise ValueError(f"a delay is 1 to {MAX_DELAY} seconds, not {delay}")


def without_dead_letter_headers(headers: Mapping[Any, Any]) -> dict[Any, Any]:
    """``headers`` without what RabbitMQ added when it dead-lettered the message. A name
    that is not text (py-amqp gives bytes for one that is not UTF-8) is kept as it is."""
    return {name: value for name, value in headers.items()
            if not isinstance(name, str)
            or name != DEAD_LETTER_HEADER and not name.startswith(DEAD_LETTER_PREFIXES)}


def _exchange(name: str) -> Exchange:
    return Exchange(name, type="topic", durable=True)
