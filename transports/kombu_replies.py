"""Reply queues on Redis that outlive their requester by one lease at most
(:mod:`.reply_leases`).

Redis has no queue tied to a connection, so a reply queue is an ordinary one (a list, a
member of :data:`~.kombu_core.REDIS_QUEUES`) with:

* a lease key, ``_idembus.reply_lease.<queue>``, that expires (``PX``) unless its process
  renews it, and the queue's name in the set ``_idembus.reply_queues`` (the queues that
  have a lease: one of an older idembus, without it, is left alone);
* an expiry on the list, renewed with the lease, and set by the responder after each reply
  it sends there: a reply to a requester that died expires with its lease;
* sweeps by any live process (an atomic script per queue): a queue whose lease is gone is
  deleted, its list with it; a reply sent to such a queue is deleted at once and refused
  (the responder drops it).
"""

from __future__ import annotations

from typing import Any

from .errors import DestinationRefused
from .kombu_core import REDIS_QUEUES, KombuCore
from .reply_leases import is_reply_queue

#: The set of the reply queues that have a lease.
LEASED_QUEUES = "_idembus.reply_queues"
_LEASE_KEY = "_idembus.reply_lease.{}"

# KEYS: the lease, REDIS_QUEUES, LEASED_QUEUES, the queue's lists; ARGV: the queue.
_GONE = """
for i = 4, #KEYS do redis.call('DEL', KEYS[i]) end
redis.call('SREM', KEYS[2], ARGV[1])
redis.call('SREM', KEYS[3], ARGV[1])
"""
#: Delete the queue if its lease is gone: 1 if deleted.
_SWEEP = ("if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end" + _GONE + "return 1")
#: After a reply was put on the queue: its lists expire with the lease (1); a queue whose
#: lease is gone, or that was swept (in neither set), is deleted, the reply with it (0); a
#: declared queue that never had a lease (an older idembus's) is left (2).
_REPLIED = ("local lease = redis.call('GET', KEYS[1]) "
            "if lease then for i = 4, #KEYS do redis.call('PEXPIRE', KEYS[i], lease) end "
            "return 1 end "
            "if redis.call('SISMEMBER', KEYS[3], ARGV[1]) == 0 "
            "and redis.call('SISMEMBER', KEYS[2], ARGV[1]) == 1 then return 2 end"
            + _GONE + "return 0")


class KombuReplyQueues(KombuCore):
    """The leases of reply queues on Redis (see the module docstring)."""

    def renew_reply_queue(self, queue: str) -> None:
        """See the contract: the lease key, the sets, the lists' expiry, in one
        transaction."""
        if not self._is_redis:
            return
        lease = max(1, int(self.reply_lease * 1000))
        with self._channel() as channel:
            with channel.client.pipeline() as pipe:
                pipe.set(_LEASE_KEY.format(queue), lease, px=lease)
                pipe.sadd(REDIS_QUEUES, queue)
                pipe.sadd(LEASED_QUEUES, queue)
                for key in _lists(channel, queue):
                    pipe.pexpire(key, lease)
                pipe.execute()
        self._known_queues.add(queue)

    def sweep_reply_queues(self) -> list[str]:
        """See the contract: every reply queue with a lease once, whose lease is gone."""
        if not self._is_redis:
            return []
        swept = []
        with self._channel() as channel:
            client = channel.client
            for member in sorted(client.smembers(LEASED_QUEUES)):
                queue = member.decode("utf-8") if isinstance(member, bytes) else str(member)
                if self._run(channel, _SWEEP, queue):
                    swept.append(queue)
        for queue in swept:
            self._known_queues.discard(queue)
        return swept

    def _replied(self, queue: str) -> None:
        """After a send to ``queue`` on Redis: a reply queue's lists expire with its lease;
        a reply to a requester that is gone is deleted and refused."""
        if not (self._is_redis and is_reply_queue(queue)):
            return
        with self._channel() as channel:
            outcome = self._run(channel, _REPLIED, queue)
        if outcome == 0:
            self._known_queues.discard(queue)
            raise DestinationRefused(
                f"the reply queue {queue!r} on {self.safe_url} is gone: its requester's "
                "lease ran out (the process died), so the reply was deleted")

    def _run(self, channel: Any, script: str, queue: str) -> int:
        """``script`` on ``queue``'s keys (the global key prefix applied, as kombu applies
        it to its own commands)."""
        prefix = str(self._transport_options.get("global_keyprefix") or "")
        keys = [prefix + key for key in (_LEASE_KEY.format(queue), REDIS_QUEUES,
                                         LEASED_QUEUES, *_lists(channel, queue))]
        return int(channel.client.eval(script, len(keys), *keys, queue))

    def _forget_lease(self, channel: Any, queue: str) -> None:
        """The lease of ``queue``, deleted with it (``delete_queue``)."""
        channel.client.delete(_LEASE_KEY.format(queue))
        channel.client.srem(LEASED_QUEUES, queue)


def _lists(channel: Any, queue: str) -> list[str]:
    """The Redis lists kombu keeps ``queue``'s messages in (one per priority step)."""
    return list(dict.fromkeys(channel._q_for_pri(queue, step)
                              for step in channel.priority_steps))
