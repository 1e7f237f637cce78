"""Reading the MongoDB transport's queues without taking anything: ``browse`` and the body
of a message a claim or a read left in the database (the tools: ``idembus errors``, the
dashboard, ``inspect``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

from .base import Delivery, Transport
from .database import BodyLimit
from .errors import DestinationRefused
from .mongo_documents import _MongoDelivery


class MongoReading(Transport):
    """The read-only tools of :class:`~idembus.transports.mongo.MongoTransport`."""

    messages: Any
    #: MongoTransport's: one operation behind mongomock's lock, failures translated.
    _op: Callable[..., AbstractContextManager[None]]
    #: DatabaseTransport's: the largest body a consumer of a queue reads.
    body_limit: Callable[[str], BodyLimit]

    @contextlib.contextmanager
    def browse(self, queue: str, *, page: int = 100) -> Iterator[Iterator[Delivery]]:
        """Read the messages stored in ``queue`` now (due, delayed or in flight), each once,
        in the order they were sent, at most ``page`` at a time; nothing is taken, and the
        deliveries are for reading only (settled)."""
        if page < 1:
            raise ValueError(f"page must be at least 1, got {page}")
        with self._op(f"reading {queue!r}"):
            newest = self.messages.find_one({"queue": queue}, {"order": 1},
                                            sort=[("order", -1)])
        max_bytes = self.body_limit(queue).max_bytes

        def read() -> Iterator[Delivery]:
            if newest is None:
                return
            bound: dict[str, Any] = {"$lte": newest["order"]}
            while True:
                with self._op(f"reading {queue!r}"):
                    documents = list(self.messages.find(
                        {"queue": queue, "order": bound}, {"body": 0}
                    ).sort("order", 1).limit(page))
                    bodies = {found["_id"]: found.get("body") for found in self.messages.find(
                        {"_id": {"$in": [d["_id"] for d in documents]},
                         "size": {"$type": "number", "$lte": max_bytes}}, {"body": 1})}
                for document in documents:
                    if document["_id"] in bodies:
                        document = {**document, "body": bodies[document["_id"]]}
                    yield _MongoDelivery(self, queue, document, lease=0, settled=True)
                if len(documents) < page:
                    return
                bound = {"$gt": documents[-1]["order"], "$lte": newest["order"]}

        yield read()

    def _body_of(self, document_id: Any, queue: str) -> bytes:
        """The body of the document ``document_id``, read now (a tool asked for a body
        that a claim or read left in the database)."""
        with self._op(f"reading a body of {queue!r}"):
            document = self.messages.find_one({"_id": document_id}, {"body": 1})
        if document is None:
            raise DestinationRefused(f"the message is no longer in {queue!r}: its body "
                                     "cannot be read")
        body = document.get("body")
        if isinstance(body, bytes):
            return body
        return b"" if body is None else str(body).encode("utf-8", "surrogateescape")
