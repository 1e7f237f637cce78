"""Reply queues of the MongoDB transport that outlive their requester by one lease at most
(``bus.request``, :mod:`.reply_leases`).

A reply queue's document in ``<prefix>_queues`` holds its lease, ``lease_until``, which
the process consuming the queue renews every third of ``reply_lease``. A send to a reply
queue looks its document up each time and is refused once the lease ran out (the
responder drops the reply); any process that consumes a reply queue, or starts an
endpoint, deletes the reply queues whose lease ran out, with their messages. A queue
document without ``lease_until`` (declared by an older idembus) is left alone.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

from .base import Transport
from .errors import DestinationRefused
from .mongo_documents import _aware, _now

log = logging.getLogger(__name__)


class MongoReplyQueues(Transport):
    """The leases of :class:`~idembus.transports.mongo.MongoTransport`'s reply queues."""

    expiring_reply_queues = True

    safe_url: str
    queues: Any
    messages: Any
    subscriptions: Any
    _known_queues: set[str]
    #: MongoTransport's: one operation behind mongomock's lock, failures translated.
    _op: Callable[..., AbstractContextManager[None]]

    def renew_reply_queue(self, queue: str) -> None:
        """See the contract: the queue's document holds the lease (``lease_until``)."""
        now = _now()
        with self._op(f"renewing the lease of reply queue {queue!r}"):
            self.queues.update_one(
                {"_id": queue},
                {"$set": {"lease_until": now + datetime.timedelta(seconds=self.reply_lease)},
                 "$setOnInsert": {"declared_at": now}}, upsert=True)
        self._known_queues.add(queue)

    def sweep_reply_queues(self) -> list[str]:
        """See the contract: the queues whose ``lease_until`` passed, with their messages."""
        now = _now()
        swept = []
        with self._op("deleting the reply queues of requesters that are gone"):
            expired = [document["_id"] for document in self.queues.find(
                {"lease_until": {"$lt": now}}, {"_id": 1})]
            for queue in expired:
                # Again with the condition: a renewal meanwhile keeps the queue.
                if self.queues.delete_one({"_id": queue, "lease_until": {"$lt": now}}
                                          ).deleted_count:
                    self.messages.delete_many({"queue": queue})
                    self.subscriptions.delete_many({"queue": queue})
                    swept.append(queue)
        for queue in swept:
            self._known_queues.discard(queue)
        if swept:
            log.info("deleted %d reply queue(s) whose requesters are gone: %s", len(swept),
                     ", ".join(swept))
        return swept

    def check_lease(self, document: Mapping[str, Any]) -> None:
        """Refuse a send to the queue of ``document`` if it is a reply queue whose lease
        ran out (its requester is gone)."""
        lease = document.get("lease_until")
        if isinstance(lease, datetime.datetime) and _aware(lease) < _now():
            raise DestinationRefused(
                f"the reply queue {document['_id']!r} at {self.safe_url} is gone: its "
                "requester's lease ran out (the process died)")
