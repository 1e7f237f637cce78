"""Single active consumer for the partition queues on Redis, with leases.

RabbitMQ gives each partition queue to one consumer at a time (``x-single-active-consumer``);
kombu's Redis transport has nothing of the kind. Here each partition has a lease, a Redis key
(``_idembus.lease.<queue>.ordered.<i>``) holding its owner's id with an expiry
(``SET NX PX``), and a process consumes a partition queue only while it holds its lease:

- A :class:`PartitionLeases` (one per process and endpoint queue) renews the leases it holds
  every ``ttl / 5`` from a thread of its own, so a handler's duration does not matter.
- A lease is taken only when its key is absent: released by its holder once it stopped
  consuming the partition (the unacknowledged message, if any, put back first in line), or
  expired, ``ttl`` after its holder's last renewal (a process killed or cut off).
- Before consuming a partition it has just taken, a process puts back, first in line, the
  messages of that partition left unacknowledged in kombu's ``unacked`` hash by an earlier
  holder (a process killed mid-message), and those it had just taken (its landing lists,
  :mod:`.redis_taking`): they are handled before the later ones of their key, without
  waiting for kombu's visibility timeout (an hour) or the landing list's lease.
- Processes announce themselves in the sorted set ``_idembus.leases.<queue>`` (scored with
  their expiry, by the Redis server's clock); a process holds at most
  ``ceil(partitions / live processes)`` leases, gives back the ones above that share, and
  takes free ones up to it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterator
from typing import Any

from .. import routing

log = logging.getLogger(f"{__package__}.kombu")  # the kombu transport's logger

#: A lease's key: its holder's id, expiring ``ttl`` after its last renewal.
LEASE_KEY = "_idembus.lease.{queue}"
#: The sorted set of the processes consuming an endpoint's partitions, scored by expiry (ms).
MEMBERS_KEY = "_idembus.leases.{queue}"

# Renew (``PEXPIRE``) or release (``DEL``) a lease only if its holder is still ARGV[1].
_RENEW = ("if redis.call('get', KEYS[1]) == ARGV[1] then "
          "return redis.call('pexpire', KEYS[1], ARGV[2]) else return 0 end")
_RELEASE = ("if redis.call('get', KEYS[1]) == ARGV[1] then "
            "return redis.call('del', KEYS[1]) else return 0 end")
# Take a free lease (or one still ours, after an outage): ARGV[1] the owner, ARGV[2] the
# ttl (ms).
_TAKE = ("local holder = redis.call('get', KEYS[1]) "
         "if holder == false then "
         "return redis.call('set', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) "
         "elseif holder == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) "
         "else return 0 end")
# Announce ARGV[1] until the server's now + ARGV[2] ms, forget the expired; how many live.
_ANNOUNCE = ("local t = redis.call('time') "
             "local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) "
             "redis.call('zadd', KEYS[1], now + tonumber(ARGV[2]), ARGV[1]) "
             "redis.call('zremrangebyscore', KEYS[1], '-inf', now) "
             "redis.call('pexpire', KEYS[1], 2 * tonumber(ARGV[2])) "
             "return redis.call('zcard', KEYS[1])")
_LEAVE = "return redis.call('zrem', KEYS[1], ARGV[1])"


def owner_id() -> str:
    """An id for this process's leases: host, pid and a random part (unique per start)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class PartitionLeases:
    """This process's leases on the partitions of one queue's ordered messages.

    Consumer threads :meth:`watch` their partitions (an event is set whenever the set they
    may consume changes), consume :meth:`consumable` ones only, and :meth:`release` those
    they stopped consuming. The renewing thread runs while some partition is watched.

    ``connect`` makes a kombu connection to the Redis the queues are in, ``release``
    closes it (the renewing thread's own); ``count`` is how many partitions the queue has;
    ``ttl`` the lease's life in seconds. Every lease command is a script (``EVAL``), whose
    keys kombu's client leaves as they are: the ``global_keyprefix`` is added here.
    """

    def __init__(self, connect: Callable[[], Any], release: Callable[[Any], None], queue: str,
                 count: int, *, ttl: float, owner: str | None = None) -> None:
        self._connect = connect
        self._disconnect = release
        self.queue = queue
        self.count = count
        self.ttl = ttl
        self.owner = owner or owner_id()
        self._lock = threading.Lock()
        self._watchers: dict[int, threading.Event] = {}
        #: Partitions whose lease this process holds.
        self._held: set[int] = set()
        #: Held partitions to give back (above this process's share) once not consumed.
        self._leaving: set[int] = set()
        #: Partitions a consumer thread of this process consumes now (or still finishes a
        #: message of): never taken again, nor their messages put back, meanwhile.
        self._busy: set[int] = set()
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._connection: Any = None
        self._connecting = threading.Lock()
        #: When the leases were last renewed (monotonic), for giving them up in an outage.
        self._renewed = time.monotonic()

    # -- what consumer threads call ---------------------------------------------------

    def watch(self, partitions: Collection[int], changed: threading.Event) -> None:
        """Register a consumer thread's ``partitions``; ``changed`` is set whenever the ones
        it may consume change. Starts the renewing thread if needed."""
        with self._lock:
            for index in partitions:
                self._watchers[index] = changed
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"idembus-leases-{self.queue}", daemon=True)
                self._thread.start()
            else:
                self._wake.set()

    def consumable(self, partitions: Collection[int]) -> set[int]:
        """Which of ``partitions`` this process holds and keeps."""
        with self._lock:
            return {index for index in partitions
                    if index in self._held and index not in self._leaving}

    @contextlib.contextmanager
    def consuming(self, partitions: Collection[int]) -> Iterator[None]:
        """Marks ``partitions`` as consumed by the caller while the block runs."""
        with self._lock:
            self._busy.update(partitions)
        try:
            yield
        finally:
            with self._lock:
                self._busy.difference_update(partitions)

    def release(self, partitions: Collection[int], *, unwatch: bool = False) -> None:
        """Give back the leases of ``partitions`` that are held but no longer consumable
        (all of them with ``unwatch``, which also stops watching them): the caller no
        longer consumes them, and their unacknowledged messages are back in their queues."""
        with self._lock:
            if unwatch:
                for index in partitions:
                    self._watchers.pop(index, None)
                giving = {index for index in partitions if index in self._held}
            else:
                giving = {index for index in partitions if index in self._leaving}
            self._held -= giving
            self._leaving -= giving
            last = unwatch and not self._watchers
        for index in sorted(giving):
            try:
                self._client().eval(_RELEASE, 1, self._lease_key(index), self.owner)
            except Exception:  # it expires after ttl
                log.debug("releasing the lease of %s failed", self._name(index), exc_info=True)
        if last:
            self._wake.set()

    # -- the renewing thread ----------------------------------------------------------

    def _run(self) -> None:
        interval = self.ttl / 5
        while True:
            with self._lock:
                if not self._watchers:
                    self._thread = None
                    break
            try:
                self._beat()
            except Exception as exc:
                log.warning("renewing the partition leases of %r failed (%s)", self.queue,
                            exc, exc_info=log.isEnabledFor(logging.DEBUG))
                self._forget_channel()
                if time.monotonic() - self._renewed > self.ttl / 2:
                    self._lose(self.consumable(range(self.count)) | self._leaving)
            self._wake.wait(interval)
            self._wake.clear()
        try:
            self._client().eval(_LEAVE, 1, self._members_key(), self.owner)
        except Exception:  # its entry expires after ttl
            log.debug("leaving the members of %r failed", self.queue, exc_info=True)
        self._forget_channel()

    def _beat(self) -> None:
        """Announce this process, renew its leases, give back the ones above its share and
        take free ones up to it."""
        client = self._client()
        ttl_ms = max(1, int(self.ttl * 1000))
        live = max(1, int(client.eval(_ANNOUNCE, 1, self._members_key(), self.owner, ttl_ms)))
        with self._lock:
            held = sorted(self._held)
            watched = sorted(set(self._watchers) - self._busy)
        lost = {index for index in held
                if not client.eval(_RENEW, 1, self._lease_key(index), self.owner, ttl_ms)}
        self._renewed = time.monotonic()
        with self._lock:
            lost &= self._held  # not those released meanwhile
        if lost:
            log.warning("lost the leases of %s (renewed too late): another process may "
                        "consume them now", ", ".join(self._name(i) for i in sorted(lost)))
            self._lose(lost)
        share = math.ceil(self.count / live)
        with self._lock:
            kept = sorted(self._held - self._leaving)
            above = kept[share:] if len(kept) > share else []
            self._leaving.update(above)
            room = share - len(self._held)
        self._notify(above)
        taken: list[int] = []
        for index in watched:
            if room <= 0:
                break
            if index in held or index in taken:
                continue
            if client.eval(_TAKE, 1, self._lease_key(index), self.owner, ttl_ms):
                self._restore_orphans(index)
                taken.append(index)
                room -= 1
        if taken:
            with self._lock:
                self._held.update(taken)
            log.info("took the leases of partition(s) %s of %s (holding %d, a share of %d "
                     "for %d live process(es))", ", ".join(map(str, taken)), self.queue,
                     len(held) - len(lost) + len(taken), share, live)
            self._notify(taken)

    def _restore_orphans(self, index: int) -> None:
        """Put back first in line the messages of partition ``index`` that an earlier holder
        left unacknowledged (in kombu's ``unacked`` hash), the oldest delivery first."""
        channel = self._channel_now()
        client = channel.client
        name = self._name(index)
        prefix = getattr(channel, "global_keyprefix", "") or ""
        # Taken by an earlier holder and not yet recorded as unacknowledged: the newest, so
        # put back first (the unacknowledged ones then go ahead of them).
        from .redis_taking import give_back
        give_back(client, prefix, dead_only=False,
                  sources={prefix + channel._q_for_pri(name, step)
                           for step in channel.priority_steps})
        entries = client.hgetall(prefix + channel.unacked_key)
        orphans = []
        for tag, value in entries.items():
            try:
                _payload, _exchange, routing_key = _loads(value)
            except (ValueError, TypeError):
                continue
            if routing_key == name:
                orphans.append(tag.decode() if isinstance(tag, bytes) else tag)
        if not orphans:
            return
        scores = {tag: client.zscore(prefix + channel.unacked_index_key, tag) or 0.0
                  for tag in orphans}
        # Each restore goes to the head of the queue: the newest first, the oldest last.
        for tag in sorted(orphans, key=lambda t: scores[t], reverse=True):
            channel.qos.restore_by_tag(tag, client)
        log.warning("%d unacknowledged message(s) of %s put back first in line (left by a "
                    "process that stopped holding its lease)", len(orphans), name)

    def _lose(self, partitions: Collection[int]) -> None:
        with self._lock:
            self._held -= set(partitions)
            self._leaving -= set(partitions)
        self._notify(partitions)

    def _notify(self, partitions: Collection[int]) -> None:
        with self._lock:
            events = {id(event): event for index, event in self._watchers.items()
                      if index in partitions}
        for event in events.values():
            event.set()

    # -- Redis ------------------------------------------------------------------------

    def _channel_now(self) -> Any:
        with self._connecting:
            if self._connection is None:
                self._connection = self._connect()
            return self._connection.default_channel

    def _client(self) -> Any:
        return self._channel_now().client

    def _forget_channel(self) -> None:
        with self._connecting:
            connection, self._connection = self._connection, None
        if connection is not None:
            self._disconnect(connection)

    def _name(self, index: int) -> str:
        return routing.partition_queue(self.queue, index)

    def _lease_key(self, index: int) -> str:
        return self._prefix() + LEASE_KEY.format(queue=self._name(index))

    def _members_key(self) -> str:
        return self._prefix() + MEMBERS_KEY.format(queue=self.queue)

    def _prefix(self) -> str:
        # kombu's client does not prefix the keys of EVAL, HGETALL and ZSCORE.
        return str(getattr(self._channel_now(), "global_keyprefix", "") or "")


def _loads(value: bytes | str) -> list[Any]:
    import json
    text = value.decode() if isinstance(value, bytes) else value
    loaded = json.loads(text)
    if not isinstance(loaded, list):
        raise ValueError("not an unacked entry")
    return loaded
