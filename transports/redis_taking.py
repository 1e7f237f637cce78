"""Redis: a consumer takes a message without a moment where a process killed loses it.

kombu's Redis channel takes a message off its list with ``BRPOP`` and only then records it as
unacknowledged (its ``unacked`` hash and ``unacked_index`` sorted set, from which a dead
consumer's messages come back after the visibility timeout): a process killed between the two
lost that message. :class:`TakingChannel` takes it with a move instead, onto a list of its own
(its *landing* list, one per list it consumes), and then records it in kombu's ``unacked`` hash
and index, in kombu's format, removing it from the landing list in the same script. At every
moment the message is in one of the three places, so nothing is lost:

- On its queue's list: ``LMOVE`` (a script taking from the first of the channel's lists that
  holds a message, in kombu's ``BRPOP`` order, priorities included) or, when all are empty,
  ``BLMOVE`` blocking on the first list of kombu's queue cycle (messages on the others wait at
  most one polling interval).
- On the landing list, between the move and the record (microseconds). A channel holds a
  lease (``_idembus.taker.<id>``, expiring ``landing_lease`` seconds after its last renewal,
  the transport's ``partition_lease``) and lists its landing lists in the hash
  ``_idembus.landings``. Every ``landing_lease`` seconds one of the consuming channels (the
  first to take its turn, ``_idembus.landings.turn``) moves the landing lists of channels
  whose lease expired (a process killed) back to the head of their queues, where they are
  taken first. A channel that closes gives its own back at once; one that takes over a
  partition of ordered messages gives back its earlier holders' (:mod:`.redis_leases`).
- In kombu's ``unacked`` hash and index: kombu's acknowledgement, rejection, requeue and
  visibility timeout (``restore_visible``) go on as before.

The lists, the messages and the ``unacked`` entries are kombu's: kombu's producers and
consumers, and foreign ones, read and write them as before. Every command keys are given to is
prefixed here with kombu's ``global_keyprefix`` (its client leaves ``EVAL``'s keys as they are).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Collection, Sequence
from queue import Empty
from typing import Any

import kombu
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import dumps, loads

from ..errors import ConfigurationError
from .redis_leases import owner_id

log = logging.getLogger(f"{__package__}.kombu")  # the kombu transport's logger

#: The hash of every channel's landing lists: the landing list's key -> ``[lease, queue]``.
LANDINGS_KEY = "_idembus.landings"
#: Whose turn it is to give back the landing lists of dead channels (expires after a lease).
TURN_KEY = "_idembus.landings.turn"
#: A channel's lease: present while the channel lives.
TAKER_KEY = "_idembus.taker.{id}"
#: A channel's landing list for one of kombu's lists (a queue or one of its priorities).
LANDING_KEY = "_idembus.landing.{id}.{source}"

# Take from the first non-empty list of KEYS (pairs: a list, its landing list): its index (the
# pair's, from 1) and the message, or nil.
_TAKE = ("for i = 1, #KEYS, 2 do "
         "local item = redis.call('LMOVE', KEYS[i], KEYS[i + 1], 'RIGHT', 'LEFT') "
         "if item then return {(i + 1) / 2, item} end end "
         "return false")
# Move ARGV[1] (the message) from the landing list KEYS[1] into kombu's unacked index KEYS[2]
# (scored ARGV[4]) and hash KEYS[3] (ARGV[2] the delivery tag, ARGV[3] kombu's entry); 0 if the
# message was given back meanwhile.
_RECORD = ("if redis.call('LREM', KEYS[1], 1, ARGV[1]) == 0 then return 0 end "
           "redis.call('ZADD', KEYS[2], ARGV[4], ARGV[2]) "
           "redis.call('HSET', KEYS[3], ARGV[2], ARGV[3]) "
           "return 1")
# Renew the lease KEYS[1] for ARGV[1] ms and list the landing lists (ARGV[2], ARGV[3], ...:
# pairs of a landing list and its entry) in KEYS[2].
_RENEW = ("redis.call('SET', KEYS[1], '1', 'PX', ARGV[1]) "
          "for i = 2, #ARGV, 2 do redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1]) end "
          "return 1")
# Move the landing list KEYS[2] back to the head of its list KEYS[3] (its oldest message
# first in line), and forget it in KEYS[4] if its lease KEYS[1] expired; with ARGV[1] == '1'
# only if it did (-1 otherwise). How many messages went back.
_GIVE_BACK = ("local live = redis.call('EXISTS', KEYS[1]) == 1 "
              "if ARGV[1] == '1' and live then return -1 end "
              "local moved = 0 "
              "while redis.call('LMOVE', KEYS[2], KEYS[3], 'LEFT', 'RIGHT') do "
              "moved = moved + 1 end "
              "if not live then redis.call('HDEL', KEYS[4], KEYS[2]) end "
              "return moved")
_END = "return redis.call('DEL', KEYS[1])"
_TURN = "return redis.call('SET', KEYS[1], '1', 'NX', 'PX', ARGV[1])"


#: The oldest Redis server whose commands the consumers use (``LMOVE``, ``BLMOVE``).
OLDEST_SERVER = (6, 2)


def require_server(client: Any, where: str) -> None:
    """Fail with a :class:`~idembus.errors.ConfigurationError` naming the server's version
    when the Redis server at ``where`` (a URL without its password) is older than
    :data:`OLDEST_SERVER`: its consumers could take no message."""
    version = str(client.info("server").get("redis_version", ""))
    if _version_of(version) < OLDEST_SERVER:
        oldest = ".".join(map(str, OLDEST_SERVER))
        raise ConfigurationError(
            f"the Redis server at {where} is version {version or 'unknown'}: idembus needs "
            f"Redis {oldest} or later (its consumers take messages with LMOVE and BLMOVE); "
            f"upgrade the server or use another broker")


def _version_of(text: str) -> tuple[int, ...]:
    """``"7.0.15"`` as ``(7, 0, 15)``; each part's leading digits (``"7.2-rc1"``: (7, 2)),
    ``()`` when there are none."""
    parts = []
    for part in text.split("."):
        digits = len(part) - len(part.lstrip("0123456789"))
        if not digits:
            break
        parts.append(int(part[:digits]))
    return tuple(parts)


def give_back(client: Any, prefix: str, *, sources: Collection[str] | None = None,
              dead_only: bool = True) -> int:
    """Move the landing lists of channels whose lease expired (every channel's with
    ``dead_only`` false) back to the head of their lists, those of ``sources`` (kombu's
    lists, prefixed) only if given; how many messages went back."""
    registry = prefix + LANDINGS_KEY
    entries = []
    for landing, value in client.hgetall(registry).items():
        lease, source = json.loads(value)
        if sources is None or source in sources:
            entries.append((bytes_to_str(landing), lease, source))
    if entries and dead_only:
        alive = client.execute_command("MGET", *[lease for _, lease, _ in entries])
        entries = [entry for entry, live in zip(entries, alive, strict=True) if live is None]
    total = 0
    for landing, lease, source in entries:
        moved = client.eval(_GIVE_BACK, 4, lease, landing, source, registry,
                            "1" if dead_only else "0")
        if moved and moved > 0:
            total += moved
            log.warning("%d message(s) taken by a consumer that %s were put back first in "
                        "line in %r", moved, "died" if dead_only else "lost its partition",
                        source[len(prefix):])
    return total


class TakingQoS(kombu_redis.QoS):  # type: ignore[misc]
    """kombu's QoS, which does not record again a message the channel recorded taking it."""

    channel: TakingChannel

    def append(self, message: Any, delivery_tag: Any) -> None:
        if self.channel._recorded == delivery_tag:
            self.channel._recorded = None
            virtual.QoS.append(self, message, delivery_tag)
            return
        super().append(message, delivery_tag)


class TakingChannel(kombu_redis.Channel):  # type: ignore[misc]
    """kombu's Redis channel, taking messages by moving them (module docstring)."""

    QoS = TakingQoS
    #: Seconds a channel's lease lasts after its last renewal (transport option
    #: ``landing_lease``): how long a killed process's landing lists wait to be given back.
    landing_lease = 10.0
    from_transport_options = (*kombu_redis.Channel.from_transport_options, "landing_lease")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._taker = owner_id()
        self._sources: list[str] = []
        self._landings: dict[str, str] = {}  # a list's key -> its landing list's key
        self._pending = "EVAL"
        self._timeout: float = 1.0
        self._renewed = float("-inf")
        self._looked = float("-inf")
        self._recorded: Any = None
        super().__init__(*args, **kwargs)

    # -- taking --------------------------------------------------------------------

    def _brpop_start(self, timeout: float | None = None) -> None:
        if timeout is None:
            timeout = self.brpop_timeout
        queues = self._queue_cycle.consume(len(self.active_queues))
        if not queues:
            return
        sources = [self._key(self._q_for_pri(queue, pri))
                   for pri in self.priority_steps for queue in queues]
        self._renew_if_due(sources, self.client)
        self._give_back_the_dead_if_due()
        keys: list[str] = []
        for source in sources:
            keys += [source, self._landings[source]]
        self._sources = sources
        self._timeout = timeout or 0
        connection = self.client.connection
        self._in_poll = connection
        self._brpop_sent_at = time.monotonic()
        self._pending = "EVAL"
        connection.send_command("EVAL", _TAKE, len(keys), *keys)

    def _brpop_read(self, **options: Any) -> bool:
        connection = self.client.connection
        try:
            reply = self.client.parse_response(connection, self._pending, **options)
        except self.connection_errors:
            self._read()
            connection.disconnect()
            raise
        except BaseException:
            self._read()
            raise
        if self._pending == "EVAL":
            if not reply:
                # Nothing waiting: block on the first list, whose reply comes in a later poll.
                source = self._sources[0]
                self._pending = "BLMOVE"
                self._brpop_sent_at = time.monotonic()
                connection.send_command("BLMOVE", source, self._landings[source], "RIGHT",
                                        "LEFT", self._timeout)
                return False
            index, item = reply
            source = self._sources[int(index) - 1]
        else:
            if not reply:
                self._read()
                raise Empty()
            source, item = self._sources[0], reply
        self._read()
        self._deliver_taken(source, item)
        return True

    def _read(self) -> None:
        """The reply of the command in poll is read: the connection is free again."""
        self._in_poll = None
        self._flush_brpop_reauth()

    def _record(self, source: str, item: bytes, client: Any) -> dict[str, Any] | None:
        """Move ``item`` from the landing list of ``source`` into kombu's unacked hash and
        index; its payload, or None if it was given back to its queue meanwhile."""
        landing = self._landings[source]
        try:
            payload: dict[str, Any] = loads(bytes_to_str(item))
            properties = payload["properties"]
            tag = properties["delivery_tag"]
            info = properties.get("delivery_info") or {}
            entry = dumps([payload, info.get("exchange"), info.get("routing_key")])
        except Exception:
            # Not a message kombu can read: its BRPOP would have taken it off and failed too.
            client.execute_command("LREM", landing, 1, item)
            raise
        prefix = self.global_keyprefix or ""
        if not client.eval(_RECORD, 3, landing, prefix + self.unacked_index_key,
                                prefix + self.unacked_key, item, tag, entry, time.time()):
            return None  # this channel's lease had expired: the message is in its queue
        return payload

    def _deliver_taken(self, source: str, item: bytes) -> None:
        """Record ``item`` (taken from ``source``) and deliver it to its consumer."""
        payload = self._record(source, item, self.client)
        if payload is None:
            return
        queue = source[len(self.global_keyprefix or ""):].rsplit(self.sep, 1)[0]
        self._queue_cycle.rotate(queue)
        self._recorded = payload["properties"]["delivery_tag"]
        try:
            self.connection._deliver(payload, queue)
        finally:
            self._recorded = None

    def basic_get(self, queue: str, no_ack: bool = False, **kwargs: Any) -> Any:
        """kombu's, except that a message kept unacknowledged is taken by moving it (the
        tools' reads of a queue)."""
        if no_ack:
            return super().basic_get(queue, no_ack=True, **kwargs)
        sources = [self._key(self._q_for_pri(queue, pri)) for pri in self.priority_steps]
        with self.conn_or_acquire() as client:  # not the connection a consumer polls
            self._renew_if_due(sources, client)
            keys: list[str] = []
            for source in sources:
                keys += [source, self._landings[source]]
            reply = client.eval(_TAKE, len(keys), *keys)
            self._maybe_update_queues_expire(client, queue)
            payload = reply and self._record(sources[int(reply[0]) - 1], reply[1], client)
        if not payload:
            return None
        message = self.Message(payload, channel=self)
        self._recorded = message.delivery_tag
        try:
            self.qos.append(message, message.delivery_tag)
        finally:
            self._recorded = None
        return message

    # -- leases and landing lists ----------------------------------------------------

    def _key(self, name: str) -> str:
        return (self.global_keyprefix or "") + name

    def _renew_if_due(self, sources: Sequence[str], client: Any) -> None:
        """Renew this channel's lease every fifth of it, and list new landing lists."""
        new = [source for source in sources if source not in self._landings]
        now = time.monotonic()
        if not new and now - self._renewed < self.landing_lease / 5:
            return
        lease = self._key(TAKER_KEY.format(id=self._taker))
        for source in new:
            self._landings[source] = self._key(LANDING_KEY.format(id=self._taker,
                                                                  source=source))
        pairs: list[str] = []
        for source, landing in self._landings.items():
            pairs += [landing, json.dumps([lease, source])]
        client.eval(_RENEW, 2, lease, self._key(LANDINGS_KEY),
                         max(1, int(self.landing_lease * 1000)), *pairs)
        self._renewed = now

    def _give_back_the_dead_if_due(self) -> None:
        """Every ``landing_lease`` seconds: give back the landing lists of channels whose
        lease expired."""
        now = time.monotonic()
        if now - self._looked < self.landing_lease:
            return
        self._looked = now
        prefix = self.global_keyprefix or ""
        if self.client.eval(_TURN, 1, prefix + TURN_KEY, max(1, int(self.landing_lease * 1000))):
            give_back(self.client, prefix)

    def _give_back_mine(self) -> None:
        """Put this channel's landing lists back (a reply in poll read first) and end its
        lease."""
        if self._in_poll:
            try:
                self.client.parse_response(self.client.connection, self._pending)
            finally:
                self._read()
        if not self._landings:
            return
        lease = self._key(TAKER_KEY.format(id=self._taker))
        registry = self._key(LANDINGS_KEY)
        self.client.eval(_END, 1, lease)
        for source, landing in self._landings.items():
            self.client.eval(_GIVE_BACK, 4, lease, landing, source, registry, "0")
        self._landings.clear()

    def close(self) -> None:
        if not self.closed:
            try:
                self._give_back_mine()
            except Exception:  # they come back once the lease expired
                log.debug("giving back the landing lists failed", exc_info=True)
        super().close()


class TakingTransport(kombu_redis.Transport):  # type: ignore[misc]
    """kombu's Redis transport with :class:`TakingChannel` channels."""

    Channel = TakingChannel


class TakingConnection(kombu.Connection):  # type: ignore[misc]
    """A kombu connection whose Redis transport is :class:`TakingTransport` (``redis://``
    and ``rediss://`` keep kombu's URL handling: only the transport's class changes)."""

    def get_transport_cls(self) -> Any:
        found = super().get_transport_cls()
        return TakingTransport if found is kombu_redis.Transport else found
